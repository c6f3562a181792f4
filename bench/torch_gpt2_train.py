#!/usr/bin/env -S /usr/bin/python3
"""PyTorch peer of Keel's GPT-2 training benchmark (CPU, float32).

Trains the same architecture Keel trains (GPT-2: learned positions, pre-LN,
fused qkv, tanh GELU, tied head) with AdamW and global grad-norm clipping on
random tokens, and times whole optimizer steps. Written the way a competent
PyTorch user would write it for speed, so the comparison is fair to PyTorch:
fused qkv projection, batched attention, torch.nn.functional ops, foreach
AdamW. torch.compile is not used (not available in PyTorch 1.13).

Prints one JSON line:
  {"tokens_per_s", "ms_per_step", "peak_rss_mb", "params", "final_loss", "threads"}

Example (small shape):
  bench/torch_gpt2_train.py --layers 4 --channels 256 --heads 4 --batch 8 --seq 128 --steps 5
Useful environment for small core counts (set before starting Python):
  OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=2 \
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
"""

import argparse
import os
import inspect
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)  # one GEMM for q, k and v
        self.attproj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)

    def forward(self, x, mask_bias):
        B, T, C = x.shape
        NH, hs = self.NH, C // self.NH
        qkv = self.qkv(self.ln1(x))
        # (B, T, 3, NH, hs) -> 3 x (B*NH, T, hs): all heads in one batched GEMM.
        q, k, v = qkv.view(B, T, 3, NH, hs).permute(2, 0, 3, 1, 4).reshape(3, B * NH, T, hs).unbind(0)
        # baddbmm fuses the 1/sqrt(hs) scale and the additive causal mask
        # into the QK^T GEMM, saving two full passes over the (T, T) scores.
        att = torch.baddbmm(mask_bias, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(hs)).softmax(dim=-1)
        y = torch.bmm(att, v).view(B, NH, T, hs).transpose(1, 2).reshape(B, T, C)
        x = x + self.attproj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, L, C, NH, V, maxT):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(V, C))
        self.wpe = nn.Parameter(torch.empty(maxT, C))
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.lnf = nn.LayerNorm(C, eps=1e-5)
        # A plain attribute, not a buffer: it is derived data, not model state.
        self._mask_bias = {}
        # GPT-2 initialisation, so that final_loss is a sensible number.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("attproj.weight", "fcproj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def mask_bias(self, T):
        if T not in self._mask_bias:
            self._mask_bias[T] = torch.full((T, T), float("-inf")).triu(1)
        return self._mask_bias[T]

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte[idx] + self.wpe[:T]
        mask_bias = self.mask_bias(T)
        for block in self.blocks:
            x = block(x, mask_bias)
        logits = F.linear(self.lnf(x), self.wte)  # tied head
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def make_optimizer(model):
    # Weight decay on 2-D weights (matrices and embeddings) only, as in GPT-2/llm.c.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    if "foreach" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["foreach"] = True  # multi-tensor kernels: far fewer Python-level ops
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], **kwargs)


def main():
    ap = argparse.ArgumentParser(description="PyTorch GPT-2 training benchmark (peer of Keel's)")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--channels", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--max-seq", type=int, default=None,
                    help="rows of the position table (block size); default --seq")
    ap.add_argument("--steps", type=int, required=True, help="timed steps")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true",
                    help='forward and loss under torch.autocast("cpu", dtype=torch.bfloat16); fp32 master weights')
    ap.add_argument("--ckpt-every", type=int, default=0,
                    help="torch.save model and optimizer state every N timed steps (0 = never)")
    ap.add_argument("--ckpt-dir", default=None, help="where --ckpt-every writes (required with it)")
    a = ap.parse_args()
    if a.ckpt_every and not a.ckpt_dir:
        print("error: --ckpt-every needs --ckpt-dir", file=sys.stderr)
        return 1
    max_seq = a.max_seq or a.seq
    if a.channels % a.heads or a.seq > max_seq or min(a.layers, a.channels, a.heads, a.vocab, a.batch, a.seq, a.steps) < 1:
        print("error: need positive sizes, channels divisible by heads, seq <= max-seq", file=sys.stderr)
        return 1

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = GPT2(a.layers, a.channels, a.heads, a.vocab, max_seq)
    opt = make_optimizer(model)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)

    # All batches made up front so the timed loop does no data work.
    total = a.warmup_steps + a.steps
    data = torch.randint(0, a.vocab, (total, a.batch, a.seq + 1),
                         generator=torch.Generator().manual_seed(a.seed + 1))

    def step(i):
        idx, targets = data[i, :, :-1], data[i, :, 1:]
        if a.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx, targets)
        else:
            loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss

    # The common practice (Lightning, HF Trainer): a synchronous torch.save of model and optimizer
    # state, made atomic the way Keel's are (temporary file, fsync, rename).
    save_ms, save_bytes = [], 0

    def save(i):
        nonlocal save_bytes
        t = time.perf_counter()
        path = os.path.join(a.ckpt_dir, "ckpt.pt")
        with open(path + ".tmp", "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": i}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        save_ms.append(1000.0 * (time.perf_counter() - t))
        save_bytes = os.path.getsize(path)

    for i in range(a.warmup_steps):
        step(i)
    t0 = time.perf_counter()
    for i in range(a.warmup_steps, total):
        loss = step(i)
        if a.ckpt_every and (i + 1 - a.warmup_steps) % a.ckpt_every == 0:
            save(i)
    elapsed = time.perf_counter() - t0
    final_loss = loss.item()  # after timing; CPU ops are synchronous anyway

    print(json.dumps({
        "tokens_per_s": round(a.batch * a.seq * a.steps / elapsed, 1),
        "ms_per_step": round(1000.0 * elapsed / a.steps, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "params": n_params,
        "final_loss": round(final_loss, 6),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bf16": a.bf16,
        "ckpt_count": len(save_ms),
        "ckpt_ms_mean": round(sum(save_ms) / len(save_ms), 2) if save_ms else 0,
        "ckpt_bytes": save_bytes,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
