#!/usr/bin/env -S /usr/bin/python3
"""PyTorch peer of Keel's GPT-2 training benchmark (CPU, float32).

Trains the same architecture Keel trains (GPT-2: learned positions, pre-LN,
fused qkv, tanh GELU, tied head) with AdamW and global grad-norm clipping on
random tokens, or on a token shard (--data), and times whole optimizer steps.
Written the way a competent PyTorch user would write it for speed, so the
comparison is fair to PyTorch: fused qkv projection, batched attention,
torch.nn.functional ops, foreach AdamW; --compile wraps the model in
torch.compile (PyTorch 2.x; inductor needs a C++ compiler) and
--flush-denormal calls torch.set_flush_denormal(True).

Steady state (bench/steady_state.py): --data TRAIN.bin trains on an llm.c token
shard (what `keel train` reads; --data-order: random offsets, or as keel train
reads it) with Keel's learning-rate
schedule (--lr, linear warm-up over --lr-warmup steps, cosine to
--min-lr-ratio x lr over the rest) and records every step's time and loss; --val
VAL.bin adds the validation loss at the end (the first --eval-batches windows).
--init FILE.bin starts from an llm.c model file (`keel export --format llmc`): with
--data-order file and keel train's data.shuffle=false both train on the same batches
from the same weights, and their per-step losses compare.

Prints one JSON line:
  {"tokens_per_s", "ms_per_step", "peak_rss_mb", "params", "final_loss", "threads", ...}
with --data also "step_ms" (every timed step's milliseconds), "step_loss", "step_cpu_ms" (the CPU time of all
the process's threads in each step: less sensitive than wall time to other load on the machine)
and "val_loss".

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


def make_optimizer(model, lr=1e-4, weight_decay=0.1):
    # Weight decay on 2-D weights (matrices and embeddings) only, as in GPT-2/llm.c and Keel.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if "foreach" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["foreach"] = True  # multi-tensor kernels: far fewer Python-level ops
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], **kwargs)


def learning_rate(a, step, total_steps):
    """Keel's schedule (src/optim/adamw.cpp): linear warm-up, then cosine to min_lr_ratio x lr."""
    if step < a.lr_warmup:
        return a.lr * (step + 1) / a.lr_warmup
    min_lr = a.lr * a.min_lr_ratio
    decay_steps = total_steps - a.lr_warmup
    if decay_steps <= 0:
        return a.lr
    progress = min(1.0, (step - a.lr_warmup) / decay_steps)
    return min_lr + 0.5 * (a.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def read_shard(path):
    """The tokens of an llm.c token shard (256 int32 header: magic 20240520, version, count; then
    uint16 tokens) as an int64 tensor. Exits with one line naming the file when it is not one."""
    import struct
    with open(path, "rb") as f:
        head = f.read(1024)
        if len(head) < 1024:
            sys.exit("%s: expected an llm.c token shard (1024-byte header), found %d bytes" % (path, len(head)))
        magic, version, count = struct.unpack("<3i", head[:12])
        if magic != 20240520 or version != 1:
            sys.exit("%s: expected an llm.c token shard (magic 20240520, version 1), found magic %d version %d"
                     % (path, magic, version))
        body = f.read()
    if len(body) != 2 * count:
        sys.exit("%s: header says %d tokens, found %d bytes of tokens" % (path, count, len(body)))
    return torch.frombuffer(bytearray(body), dtype=torch.int16).to(torch.int64) & 0xFFFF


def load_llmc(model, path, L, C, V, maxT):
    """Loads an llm.c GPT-2 model file (version 3: float32, padded vocabulary; what `keel export
    --format llmc` writes) into model. Exits with one line naming the file when its sizes differ."""
    import struct
    with open(path, "rb") as f:
        head = struct.unpack("<8i", f.read(32))
        f.seek(1024)
        body = f.read()
    magic, version, file_maxT, _, file_L, _, file_C, file_Vp = head
    if magic != 20240326 or version != 3 or (file_maxT, file_L, file_C, file_Vp) != (maxT, L, C, V):
        sys.exit("%s: expected an llm.c version-3 model with maxT %d, L %d, C %d, padded V %d; found magic %d version"
                 " %d maxT %d L %d C %d padded V %d" % (path, maxT, L, C, V, magic, version, file_maxT, file_L, file_C,
                                                       file_Vp))
    flat = torch.frombuffer(bytearray(body), dtype=torch.float32)
    at = 0

    def take(shape):
        nonlocal at
        n = math.prod(shape)
        if at + n > flat.numel():
            sys.exit("%s: shorter than its header's sizes" % path)
        t = flat[at:at + n].view(shape)
        at += n
        return t

    b = model.blocks
    stacked = [("ln1", "weight", (C,)), ("ln1", "bias", (C,)), ("qkv", "weight", (3 * C, C)), ("qkv", "bias", (3 * C,)),
               ("attproj", "weight", (C, C)), ("attproj", "bias", (C,)), ("ln2", "weight", (C,)), ("ln2", "bias", (C,)),
               ("fc", "weight", (4 * C, C)), ("fc", "bias", (4 * C,)), ("fcproj", "weight", (C, 4 * C)),
               ("fcproj", "bias", (C,))]
    with torch.no_grad():
        model.wte.copy_(take((V, C)))
        model.wpe.copy_(take((maxT, C)))
        for module, field, shape in stacked:  # llm.c's order: each tensor stacked over the layers
            for l in range(L):
                getattr(getattr(b[l], module), field).copy_(take(shape))
        model.lnf.weight.copy_(take((C,)))
        model.lnf.bias.copy_(take((C,)))
    if at != flat.numel():
        sys.exit("%s: %d floats after the model's %d" % (path, flat.numel() - at, at))


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
    ap.add_argument("--data", default=None, help="llm.c token shard to train on (random windows); default random tokens")
    ap.add_argument("--data-order", choices=("random", "sequences", "file", "windows"), default="random",
                    help="random: each sequence at a uniformly random offset; sequences: the shard's sequences of "
                         "--seq tokens (at multiples of --seq) in a random order each epoch (keel train's shuffling, "
                         "another permutation); file: the shard cut into consecutive batch x seq windows read in file "
                         "order (keel train with data.shuffle=false); windows: the same windows in a random order "
                         "each epoch (every batch one stretch of consecutive text: keel train's shuffling before "
                         "its sequences were shuffled)")
    ap.add_argument("--init", default=None, help="start from this llm.c model file (keel export --format llmc)")
    ap.add_argument("--val", default=None, help="llm.c token shard for the validation loss at the end (with --data)")
    ap.add_argument("--eval-batches", type=int, default=16, help="validation windows of batch x seq (with --val)")
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    ap.add_argument("--lr-warmup", type=int, default=0, help="linear warm-up steps; 0 = constant --lr")
    ap.add_argument("--min-lr-ratio", type=float, default=1.0, help="cosine decay to this x lr after warm-up")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch 2.x)")
    a = ap.parse_args()
    if a.ckpt_every and not a.ckpt_dir:
        print("error: --ckpt-every needs --ckpt-dir", file=sys.stderr)
        return 1
    max_seq = a.max_seq or a.seq
    if a.channels % a.heads or a.seq > max_seq or min(a.layers, a.channels, a.heads, a.vocab, a.batch, a.seq, a.steps) < 1:
        print("error: need positive sizes, channels divisible by heads, seq <= max-seq", file=sys.stderr)
        return 1

    if a.val and not a.data:
        print("error: --val needs --data", file=sys.stderr)
        return 1
    if a.compile and not hasattr(torch, "compile"):
        print("error: --compile needs PyTorch 2.x (this is %s)" % torch.__version__, file=sys.stderr)
        return 1

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.flush_denormal and not torch.set_flush_denormal(True):
        print("error: torch.set_flush_denormal(True): this CPU does not support flushing", file=sys.stderr)
        return 1
    torch.manual_seed(a.seed)
    model = GPT2(a.layers, a.channels, a.heads, a.vocab, max_seq)
    if a.init:
        load_llmc(model, a.init, a.layers, a.channels, a.vocab, max_seq)
    lr = a.lr if a.lr_warmup == 0 else learning_rate(a, 0, a.warmup_steps + a.steps)
    opt = make_optimizer(model, lr, a.weight_decay)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    forward = torch.compile(model) if a.compile else model

    # All batches made up front so the timed loop does no data work: random tokens, or random
    # windows of the shard (as Keel's shuffled loader reads it: B windows of T+1 tokens).
    total = a.warmup_steps + a.steps
    gen = torch.Generator().manual_seed(a.seed + 1)
    if a.data:
        tokens = read_shard(a.data)
        if int(tokens.max()) >= a.vocab:
            sys.exit("%s: token %d is outside the vocabulary of %d (--vocab)" % (a.data, int(tokens.max()), a.vocab))
        if tokens.numel() < a.seq + 1:
            sys.exit("%s: %d tokens, fewer than one window of %d" % (a.data, tokens.numel(), a.seq + 1))
        if a.data_order in ("file", "windows"):  # window w is tokens w*B*T .. (w+1)*B*T (+1)
            windows = (tokens.numel() - 1) // (a.batch * a.seq)
            if a.data_order == "file":
                w = torch.arange(total) % windows
            else:
                epochs = (total + windows - 1) // windows
                w = torch.cat([torch.randperm(windows, generator=gen) for _ in range(epochs)])[:total]
            starts = w.unsqueeze(-1) * (a.batch * a.seq) + torch.arange(a.batch) * a.seq
        elif a.data_order == "sequences":  # as keel train shuffles: sequences left after the last whole batch sit out
            sequences = (tokens.numel() - 1) // a.seq
            per_epoch = sequences // a.batch
            epochs = (total + per_epoch - 1) // per_epoch
            perms = [torch.randperm(sequences, generator=gen)[:per_epoch * a.batch].view(per_epoch, a.batch)
                     for _ in range(epochs)]
            starts = torch.cat(perms)[:total] * a.seq
        else:
            starts = torch.randint(0, tokens.numel() - a.seq, (total, a.batch), generator=gen)
        data = tokens[starts.unsqueeze(-1) + torch.arange(a.seq + 1)]
    else:
        data = torch.randint(0, a.vocab, (total, a.batch, a.seq + 1), generator=gen)

    def step(i):
        idx, targets = data[i, :, :-1], data[i, :, 1:]
        if a.lr_warmup:
            for group in opt.param_groups:
                group["lr"] = learning_rate(a, i, total)
        if a.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = forward(idx, targets)
        else:
            loss = forward(idx, targets)
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
    step_ms, step_cpu_ms, step_loss = [], [], []
    t0 = time.perf_counter()
    for i in range(a.warmup_steps, total):
        t_step, cpu_step = time.perf_counter(), time.process_time()
        loss = step(i)
        step_ms.append(1000.0 * (time.perf_counter() - t_step))
        step_cpu_ms.append(1000.0 * (time.process_time() - cpu_step))  # all threads' CPU time
        step_loss.append(loss.item())
        if a.ckpt_every and (i + 1 - a.warmup_steps) % a.ckpt_every == 0:
            save(i)
    elapsed = time.perf_counter() - t0
    final_loss = loss.item()  # after timing; CPU ops are synchronous anyway

    result = {}
    if a.data:
        result["step_ms"] = [round(x, 2) for x in step_ms]
        result["step_cpu_ms"] = [round(x, 2) for x in step_cpu_ms]
        result["step_loss"] = [round(x, 6) for x in step_loss]
    if a.val:
        val = read_shard(a.val)
        windows = min(a.eval_batches * a.batch, (val.numel() - 1) // a.seq)
        if windows < 1:
            sys.exit("%s: %d tokens, fewer than one window of %d" % (a.val, val.numel(), a.seq + 1))
        with torch.no_grad():
            losses = []
            for b0 in range(0, windows, a.batch):
                starts = torch.arange(b0, min(b0 + a.batch, windows)) * a.seq
                w = val[starts.unsqueeze(-1) + torch.arange(a.seq + 1)]
                losses.append(model(w[:, :-1], w[:, 1:]).item() * w.shape[0])
        result["val_loss"] = round(sum(losses) / windows, 6)

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
        "flush_denormal": a.flush_denormal,
        "compiled": a.compile,
        **result,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
