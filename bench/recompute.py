#!/usr/bin/env python3
"""Activation recomputation (train.recompute) measured and simulated, side by side.

For each setting (none, selective, full) on one rank: the real run's step time (median of the
steps after warm-up, settings interleaved and repeated), its printed activation memory (the
start-up line) and its peak resident set, next to what `keel simulate` predicts for the same
config from the none run's measured per-layer costs (`--layer-costs`, the layer profiler's F, B,
W): the step and the activations. The cluster file is this machine as one device whose only
fitted figure is step_overhead_ms, the none run's step beyond its own prediction (as
bench/simulate_calibration.py fits it); the recomputing settings are predicted out of sample.
The memory comparison: the difference of peak resident sets against none's next to the
difference of printed (and simulated) activations. Prints `uptime` with the figures: the machine
is shared.

  python3 bench/recompute.py [--keel build/keel] [--reps 2] [--steps 4] [--schedule 1f1b|zb-h1 --pipeline 2]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Activations dominate: 4 blocks of C = 128 at 16 x 256 tokens, dense attention (T x T per head).
JOB = ["model.preset=tiny", "model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.vocab_size=512",
       "model.max_seq_len=256", "train.seq_len=256", "train.batch_size=16", "train.grad_accum=1",
       "model.attention=dense", "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0",
       "train.log_every=1", "data.tokenizer=", "train.overwrite=true"]
MODES = ["none", "selective", "full"]

CLUSTER = """# This machine as one device (written by bench/recompute.py); layer costs come measured.
[cluster]
name = "local"
nodes = 1
devices_per_node = {devices}

[device]
name = "this CPU"
tflops_bf16 = {tflops}
tflops_fp32 = {tflops}
memory_gib = 100
hbm_gbps = 10
matmul_efficiency = 0.5
step_overhead_ms = {overhead:.2f}   # the none run's step beyond its prediction

[host]
memory_gib = 100
pcie_gbps = 10

[intra]
kind = "pcie"
gbps = 10
latency_us = 1

[network]
gbit = 10
nics_per_node = 1
latency_us = 10
topology = "fat-tree"
"""


def sets(items):
    out = []
    for s in items:
        out += ["--set", s]
    return out


def train(keel, work, mode, rep, steps, extra, ranks):
    run_dir = os.path.join(work, "%s-%d" % (mode, rep))
    items = JOB + extra + ["data.train=" + work + "/tokens.bin", "data.val=" + work + "/tokens.bin",
                           "train.steps=%d" % steps, "train.run_dir=" + run_dir, "train.recompute=" + mode,
                           "monitor.layer_costs_every=%d" % steps]
    cmd = [keel, "train"] + sets(items)
    if ranks > 1:
        cmd = [keel, "launch", "-n", str(ranks), "--"] + cmd[1:]
    out = benchutil.run_or_exit(cmd, dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    m = re.search(r"([0-9.]+) MB per micro-batch in flight x (\d+), ([0-9.]+) MB recomputed set, ([0-9.]+) MB in all", out)
    if not m:
        sys.exit("recompute.py: no activation line in the output of %s:\n%s" % (" ".join(cmd), out[-2000:]))
    ms, rss, costs = [], 0.0, None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j.get("event") == "layer_costs":
                costs = j["layer_costs"]
            elif "loss" in j and "step" in j:
                rss = max(rss, j.get("peak_rss_mb", 0.0))
                if j["step"] > 1:  # (the first step allocates and warms up)
                    ms.append(j["ms"])
    costs_path = run_dir + ".layer_costs.json"
    with open(costs_path, "w") as f:
        json.dump(costs, f)
    return {"mode": mode, "ms": statistics.median(ms), "rss_mb": rss, "printed_mb": float(m.group(4)),
            "slot_mb": float(m.group(1)), "slots": int(m.group(2)), "shared_mb": float(m.group(3)), "costs": costs_path}


def simulate(keel, work, mode, costs, overhead, extra, ranks):
    path = os.path.join(work, "cluster-%.0f.toml" % overhead)
    with open(path, "w") as f:
        f.write(CLUSTER.format(devices=ranks, tflops=1.0, overhead=overhead))
    cmd = [keel, "simulate", "--cluster", path, "--layer-costs", costs, "--json", "yes"] + \
        sets(JOB + extra + ["train.recompute=" + mode])
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit("recompute.py: %s: %s" % (" ".join(cmd), (p.stdout + p.stderr).strip()[-2000:]))
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", default=os.path.join(ROOT, "build", "keel"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pipeline", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    a = ap.parse_args()
    extra = []
    if a.pipeline > 1:
        extra = ["parallel.pipeline=%d" % a.pipeline, "parallel.schedule=" + a.schedule, "train.grad_accum=4",
                 "train.batch_size=4"]
    work = tempfile.mkdtemp(prefix="keel-recompute-bench-")
    benchutil.write_tokens(os.path.join(work, "tokens.bin"), n=1 << 18, vocab=512)
    print("load before: %s" % subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    runs = {m: [] for m in MODES}
    for rep in range(a.reps):  # interleaved: each repeat runs every setting
        for mode in MODES:
            runs[mode].append(train(a.keel, work, mode, rep, a.steps, extra, a.pipeline))
    print("load after: %s" % subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ("ms", "rss_mb", "printed_mb")} for m in MODES}
    costs = runs["none"][0]["costs"]
    bare = simulate(a.keel, work, "none", costs, 0.0, extra, a.pipeline)
    overhead = med["none"]["ms"] - bare["step_ms"]
    rows, worst = [], 0.0
    for mode in MODES:
        p = simulate(a.keel, work, mode, costs, overhead, extra, a.pipeline)
        sim_act_mb = p["memory_gib"]["activations"] * (1 << 30) / 1e6
        err = (p["step_ms"] - med[mode]["ms"]) / med[mode]["ms"]
        if mode != "none":
            worst = max(worst, abs(err))
        rows.append([mode, "%.1f" % med[mode]["ms"], "%.1f" % p["step_ms"], "%+.1f %%" % (100 * err),
                     "%.2f" % (med[mode]["ms"] / med["none"]["ms"]), "%.1f" % med[mode]["printed_mb"],
                     "%.1f" % sim_act_mb, "%.1f" % med[mode]["rss_mb"],
                     "%.1f" % (med["none"]["rss_mb"] - med[mode]["rss_mb"]),
                     "%.1f" % (med["none"]["printed_mb"] - med[mode]["printed_mb"])])
    print("one step, median of %d interleaved repeats x %d steps; simulated from the none run's layer costs, "
          "step_overhead_ms %.1f fitted on none" % (a.reps, a.steps - 1, overhead))
    benchutil.print_table(["recompute", "measured ms", "simulated ms", "error", "x none", "activations MB (printed)",
                           "simulated MB", "peak RSS MB", "RSS saved MB", "printed saved MB"], rows)
    print("worst step-time error of the recomputing settings: %.1f %% (%s)" %
          (100 * worst, "within 10 %" if worst <= 0.10 else "OUTSIDE 10 %"))


if __name__ == "__main__":
    main()
