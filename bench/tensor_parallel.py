#!/usr/bin/env python3
"""Tensor parallelism side by side (issue 40 item 7): Keel's `parallel.tensor = T` against PyTorch's
tensor parallelism (bench/torch_tensor_parallel.py: parallelize_module with ColwiseParallel /
RowwiseParallel, vocabulary-parallel embedding and loss, gloo; the current PyTorch in bench/.venv)
on the same model, batch and sequence, T = 1, 2 (and 4, oversubscribed on this 2-core machine),
one thread per rank in both, random tokens.

Per engine, model and T: tokens/s (one replica's batch x sequence over the median timed step),
peak RSS per rank, and the bytes each rank hands to the tensor group's collectives per step (Keel:
metrics.jsonl's tensor_allreduce_bytes; PyTorch: the bytes handed to each c10d collective in one
counted step) with what a ring sends of them per rank (all-reduce 2 (T-1)/T, all-gather and
reduce-scatter (T-1)/T). Runs interleave (Keel, PyTorch) per repeat; each engine's best repeat is
reported, every repeat's tokens/s beside it, the load average before and after each run.
Target (printed beside the result): Keel >= 1.3x PyTorch's tokens/s at T = 2 and lower peak RSS
per rank.

  bench/.venv/bin/python bench/tensor_parallel.py [--models gpt2-124m,llama-110m] [--tensors 1,2,4]
      [--batch 4] [--seq 64] [--warmup 2] [--steps 3] [--repeats 2] [--sequence-parallel] [--out FILE]

Keel's run: `keel train` (T = 1) or `keel launch -n T -- train` with --set model.preset=P
--set parallel.tensor=T --set runtime.threads=1 --set train.batch_size=B --set train.seq_len=S
(model.max_seq_len the preset's), warm-up + timed steps, no evaluation, no checkpoint, no samples;
its step time is the median `ms` of the timed steps' metrics.jsonl lines, its peak RSS per rank the
last line's peak_rss_mb (the largest rank's ru_maxrss). PyTorch's: the largest rank's ru_maxrss.
Environment: KEEL (the binary).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from benchutil import print_table, write_tokens  # noqa: E402

VOCAB = {"gpt2-124m": 50257, "llama-110m": 32000}  # token ids drawn below the model's vocabulary
TARGET_SPEED = 1.3


def load():
    return "%.1f" % os.getloadavg()[0]


def ring_sent(kind, nbytes, T):
    """Bytes a ring sends per rank for a collective handed `nbytes` (all-gather: its output's)."""
    return nbytes * (2 if kind == "all_reduce" else 1) * (T - 1) / T


def keel_run(work, name, model, T, a):
    keel = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
    run_dir = os.path.join(work, name)
    sets = ["model.preset=" + model, "parallel.tensor=%d" % T, "runtime.threads=1",
            "train.batch_size=%d" % a.batch, "train.seq_len=%d" % a.seq, "train.steps=%d" % (a.warmup + a.steps),
            "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0", "train.checkpoint_every=0",
            "train.log_every=1", "data.train=" + os.path.join(work, model + ".bin"),
            "data.val=" + os.path.join(work, model + ".bin"), "data.tokenizer=", "train.run_dir=" + run_dir]
    cmd = [keel] + (["launch", "-n", str(T), "--"] if T > 1 else []) + ["train"]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        sys.exit("keel run %s failed:\n%s" % (name, r.stdout[-3000:]))
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in l]
    timed = [l["ms"] for l in lines[a.warmup:]]
    ms = statistics.median(timed)
    tab = lines[-1].get("tensor_allreduce_bytes", 0) if T > 1 else 0
    return {"tokens_per_s": a.batch * a.seq * 1000 / ms, "ms_per_step": ms, "step_ms": timed,
            "peak_rss_mb": lines[-1]["peak_rss_mb"],
            "comm_bytes": {"all_reduce": tab} if tab else {}, "loss": lines[-1]["loss"]}


def torch_run(model, T, a):
    py = os.path.join(HERE, ".venv", "bin", "python")
    cmd = [py, os.path.join(HERE, "torch_tensor_parallel.py"), "--model", model, "--ranks", str(T), "--batch",
           str(a.batch), "--seq", str(a.seq), "--vocab", str(VOCAB[model]), "--warmup", str(a.warmup), "--steps",
           str(a.steps), "--threads", "1"]
    if a.sequence_parallel and T > 1 and model.startswith("llama"):
        cmd.append("--sequence-parallel")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        sys.exit("torch run %s T=%d failed:\n%s" % (model, T, r.stdout[-3000:]))
    t = json.loads(r.stdout.strip().splitlines()[-1])
    t["peak_rss_mb"] = max(t["peak_rss_mb_per_rank"])
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-124m,llama-110m")
    ap.add_argument("--tensors", default="1,2,4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sequence-parallel", action="store_true", help="PyTorch with SequenceParallel (llama only)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    models = a.models.split(",")
    tensors = [int(t) for t in a.tensors.split(",")]
    out = open(a.out, "a") if a.out else None
    print("uptime: %s" % subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip())
    print("batch %d x %d tokens per step (one replica), %d warm-up + %d timed steps, 1 thread per rank, %d repeats"
          % (a.batch, a.seq, a.warmup, a.steps, a.repeats), flush=True)
    best = {}
    every = {}
    with tempfile.TemporaryDirectory(prefix="keel-tp-bench.") as work:
        for m in models:
            write_tokens(os.path.join(work, m + ".bin"), n=100000, vocab=VOCAB[m])
        for rep in range(a.repeats):
            for m in models:
                for T in tensors:
                    for engine in ("keel", "pytorch"):
                        l0 = load()
                        r = keel_run(work, "%s_t%d_%d" % (m, T, rep), m, T, a) if engine == "keel" else torch_run(m, T, a)
                        r.update(engine=engine, model=m, tensor=T, rep=rep, load_before=l0, load_after=load())
                        if out:
                            out.write(json.dumps(r) + "\n")
                            out.flush()
                        key = (m, T, engine)
                        every.setdefault(key, []).append(r["tokens_per_s"])
                        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
                            best[key] = r
                        print("  rep %d %-10s T=%d %-7s %8.1f tokens/s %9.0f ms/step  peak RSS/rank %s MB  load %s -> %s"
                              % (rep, m, T, engine, r["tokens_per_s"], r["ms_per_step"],
                                 "%.0f" % r["peak_rss_mb"] if r["peak_rss_mb"] else "?", l0, r["load_after"]), flush=True)
    for m in models:
        print("\n== %s, batch %d x %d, 1 thread per rank ==" % (m, a.batch, a.seq))
        rows = []
        for T in tensors:
            for engine in ("keel", "pytorch"):
                r = best.get((m, T, engine))
                if not r:
                    continue
                comm = r.get("comm_bytes", {})
                handed = ", ".join("%s %.1f" % (k, v / 1e6) for k, v in sorted(comm.items())) or "-"
                sent = sum(ring_sent(k, v, T) for k, v in comm.items())
                k, p = best.get((m, T, "keel")), best.get((m, T, "pytorch"))
                ratio = "%.2fx" % (k["tokens_per_s"] / p["tokens_per_s"]) if engine == "keel" and k and p else ""
                rows.append([T, engine, "%.1f" % r["tokens_per_s"], ratio, "%.0f" % r["ms_per_step"],
                             "%.0f" % r["peak_rss_mb"] if r["peak_rss_mb"] else "?", handed,
                             "%.1f" % (sent / 1e6) if sent else "-",
                             " ".join("%.1f" % x for x in every[(m, T, engine)]), "%s/%s" % (r["load_before"], r["load_after"])])
        print_table(["T", "engine", "tokens/s", "Keel/PyTorch", "ms/step", "peak RSS/rank MB", "handed MB/step",
                     "ring-sent MB/rank", "every repeat's tokens/s", "load before/after"], rows)
        k, p = best.get((m, 2, "keel")), best.get((m, 2, "pytorch"))
        if k and p:
            speed = k["tokens_per_s"] / p["tokens_per_s"]
            print("%s  %s T=2: Keel %.2fx PyTorch's tokens/s (target >= %.1fx)" % (
                "PASS" if speed >= TARGET_SPEED else "MISS", m, speed, TARGET_SPEED))
            if k["peak_rss_mb"] and p["peak_rss_mb"]:
                print("%s  %s T=2: peak RSS per rank Keel %.0f MB, PyTorch %.0f MB (target: Keel lower)" % (
                    "PASS" if k["peak_rss_mb"] < p["peak_rss_mb"] else "MISS", m, k["peak_rss_mb"], p["peak_rss_mb"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
