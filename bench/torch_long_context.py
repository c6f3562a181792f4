#!/usr/bin/env -S /usr/bin/python3
"""PyTorch peer of Keel's long-context training benchmark (CPU, float32).

Trains the decoder Keel's llama family trains, on random tokens, and times whole
optimizer steps:
  token embedding (no position table)
  per block:  RMSNorm (eps 1e-5) -> qkv projection, no bias, rows q | k | v with
              --kv-heads key/value heads (grouped-query attention)
              -> RoPE on q and k (interleaved pairs, theta 10000)
              -> causal attention, optionally a sliding window of W keys
                 (query i sees keys j with i - W < j <= i)
              -> output projection (no bias) -> residual
              RMSNorm -> SwiGLU MLP (gate, up: [H, C]; down: [C, H]; no bias) -> residual
  final RMSNorm, untied LM head, cross-entropy, global grad-norm clipping at 1.0, AdamW.

Two attention implementations:
  explicit  q @ k^T (with the 1/sqrt(hs) scale and an additive causal / band mask fused
            into one baddbmm), softmax, @ v: the T x T scores are materialised, and autograd
            keeps the probabilities of every layer for the backward pass. The only choice in
            PyTorch 1.13 (no scaled_dot_product_attention there).
  sdpa      torch.nn.functional.scaled_dot_product_attention: is_causal=True without a
            window (PyTorch picks its fused flash kernel on CPU, memory linear in T); with a
            window, an explicit boolean band mask (True = attend), the T x T mask itself
            then being the quadratic part.

Prints one JSON line:
  {"tokens_per_s", "ms_per_step", "peak_rss_mb", "params", "final_loss", "threads", "torch", "attention", "window"}
peak_rss_mb is resource.getrusage(RUSAGE_SELF).ru_maxrss: the peak of the whole process.

Example:
  bench/torch_long_context.py --layers 2 --channels 128 --heads 4 --kv-heads 2 --ffn-hidden 352 \\
      --vocab 512 --batch 1 --seq 2048 --attention explicit --steps 2 --warmup-steps 1 --threads 2
Useful environment for small core counts (set before starting Python):
  OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=2 \\
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
"""

import argparse
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_gpt2_train import make_optimizer  # the same AdamW setup as the GPT-2 peer


def rms_norm(x, weight, eps=1e-5):
    if hasattr(F, "rms_norm"):  # fused kernel in current PyTorch
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(T, hs, theta=10000.0):
    """cos, sin of shape (T, hs/2): pair p of a head (elements 2p, 2p+1) turns by pos * theta^(-2p/hs)."""
    freq = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs)
    angle = torch.outer(torch.arange(T, dtype=torch.float32), freq)
    return angle.cos(), angle.sin()


def apply_rope(x, cos, sin):
    """x: (B, heads, T, hs); interleaved pairs (x[2p], x[2p+1]) rotated, as llama2.c does."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, C, NH, NKV, H):
        super().__init__()
        self.NH, self.NKV, self.hs = NH, NKV, C // NH
        self.attn_norm = nn.Parameter(torch.ones(C))
        self.qkv = nn.Linear(C, C + 2 * NKV * self.hs, bias=False)  # one GEMM: rows q | k | v
        self.attproj = nn.Linear(C, C, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(C))
        self.gate = nn.Linear(C, H, bias=False)
        self.up = nn.Linear(C, H, bias=False)
        self.down = nn.Linear(H, C, bias=False)

    def attention(self, q, k, v, ctx):
        B, NH, T, hs = q.shape
        if ctx["attention"] == "sdpa":
            if ctx["window"]:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx["mask"])
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # explicit: baddbmm fuses the 1/sqrt(hs) scale and the additive mask into the QK^T GEMM.
        qf, kf, vf = (t.reshape(B * NH, T, hs) for t in (q, k, v))
        att = torch.baddbmm(ctx["mask"], qf, kf.transpose(1, 2), alpha=1.0 / math.sqrt(hs)).softmax(dim=-1)
        return torch.bmm(att, vf).view(B, NH, T, hs)

    def forward(self, x, ctx):
        B, T, C = x.shape
        NH, NKV, hs = self.NH, self.NKV, self.hs
        qkv = self.qkv(rms_norm(x, self.attn_norm))
        q, k, v = qkv.split([C, NKV * hs, NKV * hs], dim=-1)
        q = apply_rope(q.view(B, T, NH, hs).transpose(1, 2), ctx["cos"], ctx["sin"])
        k = apply_rope(k.view(B, T, NKV, hs).transpose(1, 2), ctx["cos"], ctx["sin"])
        v = v.view(B, T, NKV, hs).transpose(1, 2)
        if NKV != NH:  # query head h reads key/value head h // (NH / NKV); a copy of T x C floats
            group = NH // NKV
            k = k[:, :, None].expand(B, NKV, group, T, hs).reshape(B, NH, T, hs)
            v = v[:, :, None].expand(B, NKV, group, T, hs).reshape(B, NH, T, hs)
        y = self.attention(q, k, v, ctx).transpose(1, 2).reshape(B, T, C)
        x = x + self.attproj(y)
        h = rms_norm(x, self.mlp_norm)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, L, C, NH, NKV, H, V):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(V, C))
        self.blocks = nn.ModuleList(Block(C, NH, NKV, H) for _ in range(L))
        self.norm = nn.Parameter(torch.ones(C))
        self.head = nn.Parameter(torch.empty(V, C))  # untied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("attproj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets, ctx):
        B, T = idx.shape
        x = self.wte[idx]
        for block in self.blocks:
            x = block(x, ctx)
        logits = F.linear(rms_norm(x, self.norm), self.head)
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def make_context(attention, T, window, hs):
    """Per-sequence-length data shared by all blocks: RoPE tables and, where needed, the mask."""
    cos, sin = rope_tables(T, hs)
    ctx = {"attention": attention, "window": window, "cos": cos, "sin": sin, "mask": None}
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    allowed = j <= i
    if window:
        allowed &= j > i - window
    if attention == "explicit":
        ctx["mask"] = torch.zeros(T, T).masked_fill_(~allowed, float("-inf"))  # additive, T x T floats
    elif window:
        ctx["mask"] = allowed  # boolean band, T x T bytes
    return ctx


def attention_only(a):
    """Times attention alone, forward + backward, as keel_bench_attention does Keel's kernels: q of
    --heads heads, k and v of --kv-heads (expanded to --heads where PyTorch has no grouped-query
    SDPA), [B, heads, T, hs] each, --precision's dtype (bf16 tensors: SDPA's bf16 kernel), causal,
    or a sliding window as an explicit boolean band mask. The least of --steps timed passes."""
    hs = a.channels // a.heads
    kv = a.kv_heads or a.heads
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(a.seed)
    q = torch.randn(a.batch, a.heads, a.seq, hs, generator=g).to(dtype).requires_grad_()
    k = torch.randn(a.batch, kv, a.seq, hs, generator=g).to(dtype).requires_grad_()
    v = torch.randn(a.batch, kv, a.seq, hs, generator=g).to(dtype).requires_grad_()
    dout = (torch.randn(a.batch, a.heads, a.seq, hs, generator=g) * 0.01).to(dtype)
    ctx = make_context(a.attention, a.seq, a.window, hs)
    gqa = {}  # grouped-query SDPA (PyTorch >= 2.5) reads k and v as they are; older ones get copies
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if kv != a.heads and a.attention == "sdpa" and major_minor >= (2, 5):
        gqa = {"enable_gqa": True}

    def forward():
        kk, vv = k, v
        if kv != a.heads and not gqa:
            kk = k.repeat_interleave(a.heads // kv, dim=1)
            vv = v.repeat_interleave(a.heads // kv, dim=1)
        if a.attention == "sdpa":
            if a.window:
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=ctx["mask"], **gqa)
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **gqa)
        qf, kf, vf = (t.reshape(-1, a.seq, hs) for t in (q, kk, vv))
        att = torch.baddbmm(ctx["mask"].to(dtype), qf, kf.transpose(1, 2), alpha=1.0 / math.sqrt(hs)).softmax(dim=-1)
        return torch.bmm(att, vf).view_as(q)

    best_f = best_b = float("inf")
    for i in range(a.warmup_steps + a.steps):
        q.grad = k.grad = v.grad = None
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        if i >= a.warmup_steps:
            best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
    print(json.dumps({
        "kind": a.attention, "precision": a.precision, "seq": a.seq, "window": a.window,
        "forward_ms": round(1000 * best_f, 2), "backward_ms": round(1000 * best_b, 2),
        "ms": round(1000 * (best_f + best_b), 2), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }))
    return 0


def main():
    ap = argparse.ArgumentParser(description="PyTorch llama long-context training benchmark (peer of Keel's)")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--channels", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads; default --heads")
    ap.add_argument("--ffn-hidden", type=int, required=True, help="SwiGLU hidden size H")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--window", type=int, default=0, help="sliding window of W keys per query; 0 = none")
    ap.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    ap.add_argument("--steps", type=int, required=True, help="timed steps")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-only", action="store_true",
                    help="time attention alone (forward + backward), not training steps")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="--attention-only: the tensors' dtype; training: bf16 autocast")
    ap.add_argument("--flush-denormal", type=int, default=1, help="torch.set_flush_denormal (1 = on)")
    a = ap.parse_args()
    kv = a.kv_heads or a.heads
    if (a.channels % a.heads or (a.channels // a.heads) % 2 or a.heads % kv or a.window < 0
            or min(a.layers, a.channels, a.heads, a.ffn_hidden, a.vocab, a.batch, a.seq, a.steps) < 1):
        print("error: need positive sizes, an even head size, heads divisible by kv-heads", file=sys.stderr)
        return 1
    if a.attention == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        print(f"error: PyTorch {torch.__version__} has no scaled_dot_product_attention", file=sys.stderr)
        return 1

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_flush_denormal(bool(a.flush_denormal))
    if a.attention_only:
        return attention_only(a)
    torch.manual_seed(a.seed)
    model = Llama(a.layers, a.channels, a.heads, kv, a.ffn_hidden, a.vocab)
    opt = make_optimizer(model)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    ctx = make_context(a.attention, a.seq, a.window, a.channels // a.heads)

    total = a.warmup_steps + a.steps
    data = torch.randint(0, a.vocab, (total, a.batch, a.seq + 1),
                         generator=torch.Generator().manual_seed(a.seed + 1))

    def step(i):
        idx, targets = data[i, :, :-1], data[i, :, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = model(idx, targets, ctx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss

    for i in range(a.warmup_steps):
        step(i)
    t0 = time.perf_counter()
    for i in range(a.warmup_steps, total):
        loss = step(i)
    elapsed = time.perf_counter() - t0

    print(json.dumps({
        "tokens_per_s": round(a.batch * a.seq * a.steps / elapsed, 1),
        "ms_per_step": round(1000.0 * elapsed / a.steps, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "params": n_params,
        "final_loss": round(loss.item(), 6),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attention": a.attention,
        "window": a.window,
        "precision": a.precision,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
