#!/usr/bin/env -S /usr/bin/python3
"""PyTorch DistributedDataParallel peer of Keel's data-parallel training (CPU, float32, gloo).

The model, its initialisation and the optimizer come from bench/torch_gpt2_train.py (imported,
not copied): GPT-2 with learned positions, pre-LN, fused qkv, tanh GELU, tied head; AdamW with
weight decay on 2-D weights; global grad-norm clipping at 1.0. Each of --world ranks trains on
its own random tokens (seeded per rank) with per-rank batch --batch, and gradients are averaged
by DistributedDataParallel over gloo on 127.0.0.1. --world 1 runs the same loop without DDP.

Processes are started with torch.multiprocessing.spawn (Debian's torchrun crashes on
Python 3.11). The causal mask is a plain attribute of the model, not a buffer, so DDP's buffer
broadcast (which rejects bool tensors over gloo) has nothing to do.

Rank 0 prints one JSON line:
  {"tokens_per_s" (global), "ms_per_step", "peak_rss_mb" (max over ranks),
   "peak_rss_mb_per_rank" (getrusage maxrss of each rank, rank order), "world", "threads",
   "params", "final_loss", "ddp", "gradient_as_bucket_view", "bucket_cap_mb"}

Example (small shape, 2 ranks x 1 thread, PyTorch's tuned environment):
  OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=1 \
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \
  bench/torch_ddp_train.py --world 2 --threads 1 --layers 4 --channels 256 --heads 4 --batch 8 --seq 128 --steps 5
Environment variables are inherited by the ranks; set them before starting Python (OpenBLAS
reads OPENBLAS_NUM_THREADS when it is loaded).
"""

import argparse
import inspect
import json
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt2_train import GPT2, make_optimizer  # noqa: E402  (the single-process peer's model)

HAS_BUCKET_VIEW = "gradient_as_bucket_view" in inspect.signature(DDP).parameters


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, a, port, result_queue):
    world = a.world
    if a.threads:
        torch.set_num_threads(a.threads)
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)

    max_seq = a.max_seq or a.seq
    torch.manual_seed(a.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = GPT2(a.layers, a.channels, a.heads, a.vocab, max_seq)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    bucket_view = False
    if world > 1:
        kwargs = {}
        if a.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = a.bucket_cap_mb
        if HAS_BUCKET_VIEW and a.bucket_view == "on":
            kwargs["gradient_as_bucket_view"] = True
            bucket_view = True
        ddp = DDP(model, **kwargs)
    else:
        ddp = model
    opt = make_optimizer(model)

    # All batches made up front so the timed loop does no data work; each rank its own tokens.
    total = a.warmup_steps + a.steps
    data = torch.randint(0, a.vocab, (total, a.batch, a.seq + 1),
                         generator=torch.Generator().manual_seed(a.seed + 1 + rank))

    # With gradients as bucket views, keep the gradient tensors (they alias DDP's buckets) and
    # zero them in place; otherwise drop them, as the single-process peer does.
    set_to_none = not bucket_view

    def step(i):
        idx, targets = data[i, :, :-1], data[i, :, 1:]
        opt.zero_grad(set_to_none=set_to_none)
        loss = ddp(idx, targets)
        loss.backward()  # DDP all-reduces (averages) gradient buckets during backward
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss

    for i in range(a.warmup_steps):
        step(i)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.warmup_steps, total):
        loss = step(i)
    if world > 1:
        dist.barrier()  # the step is done when every rank is done
    elapsed = time.perf_counter() - t0

    loss_t = loss.detach().clone()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(loss_t)
        loss_t /= world
        rss_all = [torch.zeros_like(rss) for _ in range(world)]
        dist.all_gather(rss_all, rss)
        rss_list = [float(r.item()) for r in rss_all]
    else:
        rss_list = [float(rss.item())]
    if rank == 0:
        result_queue.put({
            "tokens_per_s": round(world * a.batch * a.seq * a.steps / elapsed, 1),
            "ms_per_step": round(1000.0 * elapsed / a.steps, 2),
            "peak_rss_mb": round(max(rss_list), 1),
            "peak_rss_mb_per_rank": [round(x, 1) for x in rss_list],
            "world": world,
            "threads": torch.get_num_threads(),
            "params": n_params,
            "final_loss": round(float(loss_t.item()), 6),
            "ddp": world > 1,
            "gradient_as_bucket_view": bucket_view,
            "bucket_cap_mb": a.bucket_cap_mb if a.bucket_cap_mb is not None else 25,
        })
    if world > 1:
        dist.barrier()
        # Leave without tearing DDP down: in PyTorch 1.13 the Reducer's destructor joins a gloo
        # thread that waits for the GIL the destructor holds, and the rank hangs at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main():
    ap = argparse.ArgumentParser(description="PyTorch DDP (gloo) GPT-2 training benchmark (peer of keel launch -n N)")
    ap.add_argument("--world", type=int, default=1, help="ranks (processes); 1 = no DDP")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--channels", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, required=True, help="sequences per step on each rank")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--max-seq", type=int, default=None,
                    help="rows of the position table (block size); default --seq")
    ap.add_argument("--steps", type=int, required=True, help="timed steps")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each rank; default: torch's")
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb; default: DDP's (25)")
    ap.add_argument("--bucket-view", choices=("on", "off"), default="on",
                    help="DDP gradient_as_bucket_view (where this PyTorch has it); default on")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    max_seq = a.max_seq or a.seq
    if a.channels % a.heads or a.seq > max_seq or min(a.layers, a.channels, a.heads, a.vocab, a.batch, a.seq,
                                                      a.steps, a.world) < 1:
        print("error: need positive sizes, channels divisible by heads, seq <= max-seq", file=sys.stderr)
        return 1

    if a.world == 1:
        # Same loop, no process group, no extra process.
        import queue
        q = queue.Queue()
        worker(0, a, 0, q)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: both ranks are on this machine
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.spawn(worker, args=(a, free_port(), q), nprocs=a.world, join=True)
    print(json.dumps(q.get()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
