#!/usr/bin/env python3
"""PyTorch peer of Keel's tensor parallelism (bench/tensor_parallel.py): the models Keel's presets
gpt2-124m and llama-110m describe, split over T ranks with PyTorch's own tensor parallelism
(torch.distributed.tensor.parallel.parallelize_module, gloo, CPU, float32), trained on random
tokens with AdamW and global grad-norm clipping at 1.0, whole optimizer steps timed.

The layout is Megatron's, as torchtitan writes it: per block the q, k, v and MLP input
projections ColwiseParallel (each rank its heads, its hidden units), the attention output and MLP
output projections RowwiseParallel (their outputs all-reduced); the token embedding
RowwiseParallel (vocabulary-parallel) and the head ColwiseParallel with its logits left sharded by
vocabulary and the loss under loss_parallel() (no rank holds the whole logits); the head tied to
the token embedding (both shard the [V, C] matrix by rows: one parameter). Everything else (norms,
GPT-2's position table) replicated as DTensors (distribute_module), so AdamW's foreach kernels see
one kind of tensor. --sequence-parallel (llama only) adds SequenceParallel on the norms, the
residual stream sharded along the sequence, all-gather / reduce-scatter in place of the all-reduces.

Shapes (Keel's presets): gpt2-124m L12 C768 H12, vocabulary 50304 rows (Keel's padded 50257),
position table 1024, fused-in-Keel qkv as three Linear (same matrices), tanh GELU, biases;
llama-110m L12 C768 H12 (12 key/value heads), SwiGLU hidden 2048, vocabulary 32000, RMSNorm eps
1e-5, RoPE theta 10000, no biases, tied head.

Prints one JSON line (rank 0): tokens_per_s, ms_per_step (median of the timed steps), step_ms,
peak_rss_mb_per_rank (ru_maxrss of each rank's process), loss, and comm: the bytes each rank handed
to each kind of collective in one more (untimed) step, counted by a TorchDispatchMode on the
c10d functional ops DTensor issues, forward and backward.

  bench/.venv/bin/python bench/torch_tensor_parallel.py --model gpt2-124m --ranks 2 --batch 4 --seq 64
"""
import argparse
import json
import math
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_long_context import apply_rope, rope_tables  # noqa: E402  (the llama peer's RoPE, Keel's pair order)

SHAPES = {  # layers, heads, kv heads, channels, vocabulary rows, position table, MLP hidden
    "gpt2-124m": (12, 12, 12, 768, 50304, 1024, 3072),
    "llama-110m": (12, 12, 12, 768, 32000, 1024, 2048),
}


class RMSNorm(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class Attention(nn.Module):
    def __init__(self, C, NH, NKV, bias, rope):
        super().__init__()
        self.hs = C // NH
        self.rope = rope
        self.wq = nn.Linear(C, NH * self.hs, bias=bias)
        self.wk = nn.Linear(C, NKV * self.hs, bias=bias)
        self.wv = nn.Linear(C, NKV * self.hs, bias=bias)
        self.wo = nn.Linear(NH * self.hs, C, bias=bias)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # (-1: the heads this rank holds after ColwiseParallel)
        q = self.wq(x).view(B, T, -1, self.hs).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.hs).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.hs).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, C, H, llama):
        super().__init__()
        self.llama = llama
        self.w1 = nn.Linear(C, H, bias=not llama)
        self.w2 = nn.Linear(H, C, bias=not llama)
        if llama:
            self.w3 = nn.Linear(C, H, bias=False)

    def forward(self, x):
        if self.llama:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, NH, NKV, H, llama):
        super().__init__()
        norm = (lambda: RMSNorm(C)) if llama else (lambda: nn.LayerNorm(C, eps=1e-5))
        self.attention_norm = norm()
        self.attention = Attention(C, NH, NKV, bias=not llama, rope=llama)
        self.ffn_norm = norm()
        self.feed_forward = MLP(C, H, llama)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, name, seq):
        super().__init__()
        L, NH, NKV, C, V, maxT, H = SHAPES[name]
        self.llama = name.startswith("llama")
        self.tok_embeddings = nn.Embedding(V, C)
        if not self.llama:
            self.pos_embeddings = nn.Embedding(maxT, C)
        self.layers = nn.ModuleList(Block(C, NH, NKV, H, self.llama) for _ in range(L))
        self.norm = RMSNorm(C) if self.llama else nn.LayerNorm(C, eps=1e-5)
        self.output = nn.Linear(C, V, bias=False)
        cos, sin = rope_tables(seq, C // NH)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
        self.output.weight = self.tok_embeddings.weight  # tied, as both presets are

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        if not self.llama:
            x = x + self.pos_embeddings(torch.arange(idx.shape[1]))
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        return self.output(self.norm(x))


def parallelize(model, mesh, sequence_parallel):
    from torch.distributed.tensor import Replicate, Shard, distribute_module, DTensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    for block in model.layers:
        bplan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if model.llama:
            bplan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            bplan["attention_norm"] = SequenceParallel()
            bplan["ffn_norm"] = SequenceParallel()
            bplan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                    desired_input_layouts=(Replicate(), None, None))
            bplan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, bplan)
    # The tied head: the embedding's and the head's [V, C] weights are both sharded by rows.
    model.output.weight = model.tok_embeddings.weight

    # What is left (norms without sequence parallelism, GPT-2's position table): replicated DTensors,
    # their inputs and outputs plain tensors, so every parameter is a DTensor.
    def to_dtensor(mod, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(mod, out, device_mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    for mod in model.modules():
        own = list(mod.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(mod, mesh, input_fn=to_dtensor, output_fn=to_local)
    assert all(isinstance(p, DTensor) for p in model.parameters())


class CommBytes:
    """Counts the bytes handed to each c10d functional collective DTensor issues (all-reduce and
    reduce-scatter: their input; all-gather: its output)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
                    t = args[0]
                    ts = t if isinstance(t, (list, tuple)) else [t]
                    n = sum(x.numel() * x.element_size() for x in ts)
                    if name.startswith("all_gather"):  # (its output: the input times the group's size)
                        n *= args[1]
                    counts[name] = counts.get(name, 0) + n
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def worker(rank, a, port, q):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(a["threads"])
    torch.set_flush_denormal(True)
    T = a["ranks"]
    dist.init_process_group("gloo", rank=rank, world_size=T)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (T,))
    torch.manual_seed(0)
    model = Decoder(a["model"], a["seq"])
    n_params = sum(p.numel() for p in model.parameters())
    if T > 1:
        parallelize(model, mesh, a["sequence_parallel"])
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    g = torch.Generator().manual_seed(1)
    steps = a["warmup"] + a["steps"] + 1
    data = torch.randint(0, a["vocab"], (steps, a["batch"], a["seq"] + 1), generator=g)
    group = dist.group.WORLD

    def step(i):
        opt.zero_grad(set_to_none=True)
        logits = model(data[i, :, :-1])
        targets = data[i, :, 1:]
        if T > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        # Global grad-norm clipping at 1.0: sharded gradients' squares summed over the group,
        # replicated ones counted once (one all-reduce of a scalar).
        sharded = torch.zeros((), dtype=torch.float32)
        replicated = torch.zeros((), dtype=torch.float32)
        for p in params:
            gr = p.grad
            if isinstance(gr, DTensor):
                local = gr.to_local().float().pow(2).sum()
                if any(isinstance(pl, Shard) for pl in gr.placements):
                    sharded += local
                else:
                    replicated += local
            else:
                replicated += gr.float().pow(2).sum()
        if T > 1:
            dist.all_reduce(sharded, group=group)
        norm = math.sqrt(float(sharded + replicated))
        if norm > 1.0:
            for p in params:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(1.0 / (norm + 1e-6))
        opt.step()
        return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())

    times = []
    loss = float("nan")
    for i in range(a["warmup"] + a["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(i)
        dist.barrier()
        if i >= a["warmup"]:
            times.append(time.perf_counter() - t0)
    comm = {}
    if T > 1:
        counter = CommBytes()
        with counter.mode:
            step(a["warmup"] + a["steps"])
        comm = counter.counts
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    allr = [torch.zeros_like(rss) for _ in range(T)]
    dist.all_gather(allr, rss)
    if rank == 0:
        times.sort()
        ms = 1000 * times[len(times) // 2]
        q.put({"tokens_per_s": a["batch"] * a["seq"] * 1000 / ms, "ms_per_step": ms,
               "step_ms": [1000 * t for t in times], "peak_rss_mb_per_rank": [float(x.item()) for x in allr],
               "loss": loss, "comm_bytes": comm, "torch": torch.__version__, "params": n_params})
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-124m", choices=sorted(SHAPES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=0, help="token ids drawn below this (default: the model's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--sequence-parallel", action="store_true")
    a = vars(ap.parse_args())
    a["vocab"] = a["vocab"] or SHAPES[a["model"]][4]
    if a["sequence_parallel"] and not a["model"].startswith("llama"):
        sys.exit("torch_tensor_parallel.py: --sequence-parallel: llama only (GPT-2's position table is not split along the sequence here)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(a, port, q), nprocs=a["ranks"], join=True)
    print(json.dumps(q.get()))


if __name__ == "__main__":
    main()
