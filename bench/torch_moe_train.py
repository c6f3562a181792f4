#!/usr/bin/env python3
"""PyTorch's side of bench/moe.py: a llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) whose
MLPs are dense or mixtures of experts as Keel's model/moe.h defines them, trained in float32 with
AdamW on an llm.c token shard. Written for this bench from that definition (not Keel's code):

  p = softmax(x Wr^T) over E experts; the k most probable chosen; out = sum_j p[e_j] SwiGLU_{e_j}(x)
  (+ the shared experts' SwiGLU(x)); the balancing loss per sequence E sum_e f_e P_e (f_e: the share
  of the sequence's T k choices that picked e, P_e: the mean probability of e), averaged over
  sequences, weighted by --aux-weight, summed over MoE blocks.

The experts' products are grouped as torchtitan groups them on a CPU: the (token, choice) pairs
sorted by expert (a stable argsort), each expert's rows one contiguous slice, one product per
expert and projection, the weighted rows added back with index_add_. Attention is
scaled_dot_product_attention (causal). Prints one JSON object: the per-step wall ms, the losses,
the validation loss at the end (with --val), the tokens routed to each expert over the last step.
The shard is read as keel train reads it (--data-order sequences, the default: each epoch a
permutation of its sequences of --seq tokens, another permutation than Keel's; "random": random
offsets, this script's order before 2026-12-05), and the validation loss is over the windows keel
train evaluates (the validation shard's first --eval-batches batches of consecutive sequences).

  python torch_moe_train.py --layers 4 --channels 256 --heads 8 --kv-heads 4 --vocab 8192
      --experts 8 --top-k 2 --moe-hidden 352 --batch 16 --seq 128 --steps 100 --data train.bin --val val.bin
  (--experts 0: dense MLPs of --ffn-hidden units)
"""

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def rope_tables(T, hs, theta=10000.0):
    freqs = theta ** (-torch.arange(0, hs, 2, dtype=torch.float32) / hs)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), freqs)  # (T, hs/2)
    return torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]


def rotate(x, cos, sin):
    """x: (B, T, heads, hs); each adjacent pair (2i, 2i+1) rotated by the position's angle i."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def swiglu(x, gate_up, proj):
    a = x @ gate_up.T
    h = a.shape[-1] // 2
    return (F.silu(a[..., :h]) * a[..., h:]) @ proj.T


class Model(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        C, V, L = a.channels, a.vocab, a.layers
        self.a = a
        hs = C // a.heads
        kv = a.kv_heads * hs
        init = lambda *shape, std=0.02: torch.nn.Parameter(torch.randn(*shape) * std)  # noqa: E731
        out_std = 0.02 / math.sqrt(2 * L)
        self.wte = init(V, C)
        self.lm_head = init(V, C)
        self.norm = torch.nn.Parameter(torch.ones(C))
        self.blocks = torch.nn.ModuleList()
        for _ in range(L):
            b = torch.nn.Module()
            b.attn_norm = torch.nn.Parameter(torch.ones(C))
            b.mlp_norm = torch.nn.Parameter(torch.ones(C))
            b.qkv = init(C + 2 * kv, C)
            b.proj = init(C, C, std=out_std)
            if a.experts > 0:
                b.router = init(a.experts, C)
                b.gate_up = init(a.experts, 2 * a.moe_hidden, C)
                b.down = init(a.experts, C, a.moe_hidden, std=out_std)
                if a.shared > 0:
                    b.shared_gate_up = init(2 * a.shared * a.moe_hidden, C)
                    b.shared_down = init(C, a.shared * a.moe_hidden, std=out_std)
            else:
                b.gate_up = init(2 * a.ffn_hidden, C)
                b.down = init(C, a.ffn_hidden, std=out_std)
            self.blocks.append(b)
        self.cos, self.sin = rope_tables(a.seq, hs)
        self.routed = torch.zeros(max(a.experts, 1), dtype=torch.long)

    def moe(self, b, x, auxes):
        B, T, C = x.shape
        E, k = self.a.experts, self.a.top_k
        flat = x.reshape(B * T, C)
        probs = torch.softmax(flat @ b.router.T, dim=-1)  # (BT, E)
        weights, chosen = torch.topk(probs, k, dim=-1)  # (BT, k): p of the chosen, not renormalised
        picked = F.one_hot(chosen, E).sum(1).reshape(B, T, E).float()  # choices per token and expert
        f = picked.sum(1) / (T * k)  # (B, E)
        P = probs.reshape(B, T, E).mean(1)
        auxes.append((E * (f * P).sum(-1)).mean())
        experts = chosen.reshape(-1)
        order = torch.argsort(experts, stable=True)
        tokens = torch.arange(B * T).repeat_interleave(k)[order]
        counts = torch.bincount(experts, minlength=E).tolist()
        self.routed += torch.tensor(counts)
        rows = flat[tokens]
        outs = []
        at = 0
        for e, n in enumerate(counts):
            if n:
                outs.append(swiglu(rows[at:at + n], b.gate_up[e], b.down[e]))
            at += n
        y = torch.cat(outs) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add_(0, tokens, y).reshape(B, T, C)
        if self.a.shared > 0:
            out = out + swiglu(x, b.shared_gate_up, b.shared_down)
        return out

    def forward(self, idx, targets):
        B, T = idx.shape
        C, NH, NKV = self.a.channels, self.a.heads, self.a.kv_heads
        hs = C // NH
        kv = NKV * hs
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        x = self.wte[idx]
        auxes = []
        for b in self.blocks:
            h = rms(x, b.attn_norm)
            qkv = h @ b.qkv.T
            q = rotate(qkv[..., :C].reshape(B, T, NH, hs), cos, sin).transpose(1, 2)
            kk = rotate(qkv[..., C:C + kv].reshape(B, T, NKV, hs), cos, sin).transpose(1, 2)
            v = qkv[..., C + kv:].reshape(B, T, NKV, hs).transpose(1, 2)
            kk = kk.repeat_interleave(NH // NKV, dim=1)
            v = v.repeat_interleave(NH // NKV, dim=1)
            att = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            x = x + att.transpose(1, 2).reshape(B, T, C) @ b.proj.T
            h2 = rms(x, b.mlp_norm)
            x = x + (self.moe(b, h2, auxes) if self.a.experts > 0 else swiglu(h2, b.gate_up, b.down))
        logits = rms(x, self.norm) @ self.lm_head.T
        ce = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        aux = torch.stack(auxes).sum() if auxes else torch.zeros(())
        return ce, aux


def read_shard(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        dtype = np.uint32 if header[0] == 20240801 else np.uint16
        return torch.from_numpy(np.frombuffer(f.read(), dtype=dtype).astype(np.int64))


def windows(tokens, starts, T):
    x = torch.stack([tokens[s:s + T] for s in starts])
    y = torch.stack([tokens[s + 1:s + T + 1] for s in starts])
    return x, y


def batch_starts(tokens, B, T, steps, order, gen):
    """Each step's B sequence starts. "sequences": as keel train's shuffled loader reads a shard, each
    epoch a permutation of its sequences of T tokens (sequences left after the last whole batch sit
    out; another permutation than Keel's); "random": B uniformly random offsets per step."""
    if order == "sequences":
        sequences = (tokens.numel() - 1) // T
        per_epoch = sequences // B
        if per_epoch < 1:
            raise SystemExit("--data: %d sequences of %d tokens, fewer than one batch of %d" % (sequences, T, B))
        epochs = (steps + per_epoch - 1) // per_epoch
        perms = [torch.randperm(sequences, generator=gen)[:per_epoch * B].view(per_epoch, B) for _ in range(epochs)]
        return torch.cat(perms)[:steps] * T
    return torch.randint(0, tokens.numel() - T - 1, (steps, B), generator=gen)


def main():
    ap = argparse.ArgumentParser()
    for name in ("layers", "channels", "heads", "kv-heads", "vocab", "batch", "seq", "steps"):
        ap.add_argument("--" + name, type=int, required=True)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-hidden", type=int, default=0)
    ap.add_argument("--shared", type=int, default=0)
    ap.add_argument("--ffn-hidden", type=int, default=0)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--data", required=True)
    ap.add_argument("--data-order", choices=("sequences", "random"), default="sequences",
                    help="sequences: each epoch a permutation of the shard's sequences (as keel train shuffles); "
                         "random: uniformly random offsets")
    ap.add_argument("--val", default=None)
    ap.add_argument("--eval-batches", type=int, default=16,
                    help="the validation shard's first N batches of consecutive sequences (as keel train evaluates)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch 2.x)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(a.seed)
    model = Model(a)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    forward = torch.compile(model) if a.compile else model
    tokens = read_shard(a.data)
    gen = torch.Generator().manual_seed(a.seed)
    starts = batch_starts(tokens, a.batch, a.seq, a.steps, a.data_order, gen)

    def lr_at(step):  # Keel's schedule: linear warm-up, cosine to min_lr_ratio x lr
        if step < a.lr_warmup:
            return a.lr * (step + 1) / a.lr_warmup
        progress = (step - a.lr_warmup) / max(1, a.steps - a.lr_warmup)
        return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    ms, losses = [], []
    for step in range(a.steps):
        x, y = windows(tokens, starts[step], a.seq)
        model.routed.zero_()
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ce, aux = forward(x, y)
        opt.zero_grad(set_to_none=True)
        (ce + a.aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(ce.item())
    out = {"ms": ms, "loss": losses, "routed": model.routed.tolist() if a.experts else [],
           "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__, "compiled": a.compile}
    if a.val:
        val = read_shard(a.val)
        n = min(a.eval_batches * a.batch, (val.numel() - 1) // a.seq)  # the windows keel train evaluates
        if n < 1:
            raise SystemExit("--val: %d tokens, fewer than one window of %d" % (val.numel(), a.seq + 1))
        with torch.no_grad():
            total = 0.0
            for b0 in range(0, n, a.batch):
                rows = torch.arange(b0, min(b0 + a.batch, n)) * a.seq
                total += model(*windows(val, rows, a.seq))[0].item() * rows.numel()
        out["val_loss"] = total / n
    print(json.dumps(out))


if __name__ == "__main__":
    main()
