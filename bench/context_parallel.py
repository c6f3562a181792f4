#!/usr/bin/env python3
"""Context parallelism at long sequences (issue 43 item 5): Keel's `parallel.context = C` (ring
attention over Keel's blockwise kernel, each rank two mirrored chunks of every sequence) at 32k and
64k tokens, C = 1, 2, 4 (4 ranks oversubscribe this 2-core machine), on the llama-tiny preset
(2 blocks, C = 64, 4 heads, 2 key/value heads, SwiGLU 192, vocabulary 8192, untied head), batch 1,
random tokens, one thread per rank: tokens/s and peak RSS per rank.

The peer: PyTorch's context parallelism (torch.distributed.tensor.experimental.context_parallel)
does not run on CPU with the current PyTorch (checked at start-up, its error printed: the CPU's
fused attention, aten._scaled_dot_product_flash_attention_for_cpu, has no sharding strategy), so
the peer is PyTorch's SDPA on one rank (bench/torch_long_context.py --attention sdpa: the same
model, is_causal=True, PyTorch's fused flash kernel on CPU, memory linear in T), one thread.

Each run is short: --steps optimizer steps (default 1), the figure the last step's time (Keel:
metrics.jsonl's `ms`; PyTorch: its timed step after --torch-warmup untimed ones, default 0), so a
first step's start-up costs count in both when --steps 1. Prints the load average before and
after every run. The generation half of issue 43 item 5 is bench/batched_generation.py.

  bench/.venv/bin/python bench/context_parallel.py [--seqs 32768,65536] [--contexts 1,2,4] [--steps 1]
      [--repeats 1] [--no-torch] [--out FILE]
Environment: KEEL (the binary). Memory: Keel at 64k on one rank ~3.5 GB; PyTorch at 64k more
(its logits and their gradient alone are 2 x 64k x 8192 floats): the bench sets its own
oom_score_adj to 1000 (children inherit it).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from benchutil import print_table, write_tokens  # noqa: E402

# llama-tiny (src/core/config.cpp): layers, channels, heads, key/value heads, SwiGLU hidden, vocabulary
SHAPE = (2, 64, 4, 2, 192, 8192)

CP_PROBE = r'''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn.functional as F
def w(rank, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(1, 64, 16)
    W = torch.randn(16, 16, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            h = (x @ W).unsqueeze(1).expand(1, 4, -1, 16)
            F.scaled_dot_product_attention(h, h, h, is_causal=True).sum().backward()
        if rank == 0: print("RUNS", flush=True)
    except Exception as e:
        if rank == 0: print("FAILS %s: %s" % (type(e).__name__, str(e).splitlines()[0][:200]), flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(w, args=(port,), nprocs=2)
'''


def load():
    return "%.1f" % os.getloadavg()[0]


def probe_torch_cp(work, py):
    path = os.path.join(work, "cp_probe.py")
    with open(path, "w") as f:
        f.write(CP_PROBE)
    r = subprocess.run([py, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                       env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"))
    line = next((l for l in r.stdout.splitlines() if l.startswith(("RUNS", "FAILS"))), "FAILS: " + r.stdout[-300:])
    return line


def keel_run(work, tokens, seq, C, a, name):
    keel = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
    run_dir = os.path.join(work, name)
    sets = ["model.preset=llama-tiny", "model.attention=blockwise", "parallel.context=%d" % C, "runtime.threads=1",
            "train.batch_size=1", "train.seq_len=%d" % seq, "model.max_seq_len=%d" % seq, "train.steps=%d" % a.steps,
            "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0", "train.checkpoint_every=0",
            "train.log_every=1", "data.train=" + tokens, "data.val=" + tokens, "data.tokenizer=", "train.run_dir=" + run_dir]
    cmd = [keel] + (["launch", "-n", str(C), "--"] if C > 1 else []) + ["train"]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        return {"error": (r.stdout.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in l]
    act = next((l for l in r.stdout.splitlines() if "memory per rank" in l), "")
    ms = lines[-1]["ms"]
    return {"tokens_per_s": seq * 1000 / ms, "ms": ms, "peak_rss_mb": lines[-1]["peak_rss_mb"], "memory_line": act,
            "loss": lines[-1]["loss"]}


def torch_run(seq, a):
    py = os.path.join(HERE, ".venv", "bin", "python")
    L, C, H, KV, F, V = SHAPE
    cmd = [py, os.path.join(HERE, "torch_long_context.py"), "--layers", str(L), "--channels", str(C), "--heads", str(H),
           "--kv-heads", str(KV), "--ffn-hidden", str(F), "--vocab", str(V), "--batch", "1", "--seq", str(seq),
           "--attention", "sdpa", "--steps", "1", "--warmup-steps", str(a.torch_warmup), "--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        return {"error": (r.stdout.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    t = json.loads(r.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": t["tokens_per_s"], "ms": t["ms_per_step"], "peak_rss_mb": t["peak_rss_mb"], "loss": t["final_loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="32768,65536")
    ap.add_argument("--contexts", default="1,2,4")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--torch-warmup", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    seqs = [int(s) for s in a.seqs.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    out = open(a.out, "a") if a.out else None
    py = os.path.join(HERE, ".venv", "bin", "python")
    print("uptime: %s" % subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip())
    rows = []
    with tempfile.TemporaryDirectory(prefix="keel-cp-bench.") as work:
        if not a.no_torch:
            verdict = probe_torch_cp(work, py)
            print("PyTorch context_parallel (gloo, CPU, 2 ranks, causal SDPA): %s" % verdict)
            print("peer: %s" % ("PyTorch context_parallel" if verdict.startswith("RUNS") else
                                "PyTorch SDPA on one rank (context_parallel does not run on CPU: above)"), flush=True)
        tokens = os.path.join(work, "tokens.bin")
        write_tokens(tokens, n=max(seqs) + 4096, vocab=SHAPE[5])
        for rep in range(a.repeats):
            for seq in seqs:
                for engine, C in [("keel", c) for c in contexts] + ([] if a.no_torch else [("pytorch sdpa", 1)]):
                    l0 = load()
                    r = keel_run(work, tokens, seq, C, a, "k%d_%d_%d" % (seq, C, rep)) if engine == "keel" else torch_run(seq, a)
                    r.update(engine=engine, seq=seq, C=C, rep=rep, load_before=l0, load_after=load())
                    if out:
                        out.write(json.dumps(r) + "\n")
                        out.flush()
                    if "error" in r:
                        print("  rep %d %6d tokens %-12s C=%d  FAILED: %s  load %s -> %s" % (
                            rep, seq, engine, C, r["error"], l0, r["load_after"]), flush=True)
                        continue
                    print("  rep %d %6d tokens %-12s C=%d %8.1f tokens/s %9.0f ms  peak RSS/rank %6.0f MB  load %s -> %s%s"
                          % (rep, seq, engine, C, r["tokens_per_s"], r["ms"], r["peak_rss_mb"], l0, r["load_after"],
                             ("\n      " + r["memory_line"]) if r.get("memory_line") else ""), flush=True)
                    rows.append(r)
    print("\n== llama-tiny, batch 1, %d step(s), 1 thread per rank ==" % a.steps)
    table = []
    for seq in seqs:
        peer = max((r for r in rows if r["seq"] == seq and r["engine"] != "keel"), key=lambda r: r["tokens_per_s"], default=None)
        for engine, C in [("keel", c) for c in contexts] + [("pytorch sdpa", 1)]:
            best = max((r for r in rows if r["seq"] == seq and r["engine"] == engine and r["C"] == C),
                       key=lambda r: r["tokens_per_s"], default=None)
            if not best:
                continue
            table.append([seq, engine, C, "%.1f" % best["tokens_per_s"], "%.0f" % best["ms"], "%.0f" % best["peak_rss_mb"],
                          "%.2fx" % (best["tokens_per_s"] / peer["tokens_per_s"]) if peer and engine == "keel" else "",
                          "%s/%s" % (best["load_before"], best["load_after"])])
    print_table(["tokens", "engine", "C", "tokens/s", "ms/step", "peak RSS/rank MB", "vs PyTorch", "load before/after"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
