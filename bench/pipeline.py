#!/usr/bin/env python3
"""Pipeline schedules, side by side: real runs at P = 2 on this machine (one thread per rank) and
P = 4 and 8 in Keel's schedule simulator with per-layer costs measured in those runs.

For every schedule (1F1B is the "before"; GPipe, interleaved 1F1B, ZB-H1, ZB-H2 and ZB-V the rest)
it prints the measured bubble (idle time within the span of a step's F, B and W over ranks x that
span), step time, tokens/s and activation memory per rank, and how well the simulator, given the
run's own measured F, B and W time per stage, predicts the measured span. Then it turns the
measured stage times into per-layer costs (each stage's time split over its layers in proportion
to their FLOPs) and simulates P = 4 and P = 8 with stages cut by those costs.

    python3 bench/pipeline.py [--keel build/keel] [--steps 6] [--micro 8] [--layers 14]

The model has 14 blocks of width 384 by default so that 4 and 8 stages can balance (a stage cut
cannot be finer than a layer; the tied head costs about 1.7 blocks here)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import write_tokens  # noqa: E402

SCHEDULES = ["1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "zb-v"]


def layer_flops(n_layer, C, V, T):
    """The FLOP model of src/pipeline/layout.cpp layer_costs."""
    return [2 * C] + [24 * C * C + 4 * T * C] * n_layer + [2 * C * V + 5 * V]


def run(cmd, env):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        sys.exit("command failed: %s\n%s" % (" ".join(cmd), r.stdout[-3000:]))
    return r.stdout


def stage_costs(trace, stages):
    """Mean F, B, W duration (ms) of each stage in a Chrome trace written by the trainer."""
    sums = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or "stage" not in e.get("args", {}):
            continue
        op = e["name"][0]
        if op not in "FBW":
            continue
        key = (op, e["args"]["stage"])
        total, n = sums.get(key, (0.0, 0))
        sums[key] = (total + e["dur"] / 1e3, n + 1)
    return {op: [sums[(op, s)][0] / sums[(op, s)][1] for s in range(stages)] for op in "FBW"}


def span_ms(trace):
    """First start to last end of the F, B and W events of a trace (ms)."""
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"][:1] in "FBW"]
    return (max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step (of 2 sequences)")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args()
    keel = os.path.abspath(args.keel)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    C, H, V, T, B = 384, 6, 8192, 128, 2
    work = tempfile.mkdtemp(prefix="keel-bench-pipeline-")
    write_tokens(work + "/train.bin", n=1 << 19, vocab=V)
    write_tokens(work + "/val.bin", n=1 << 14, vocab=V, seed=2)
    model = ["--set", "model.n_layer=%d" % args.layers, "--set", "model.n_embd=%d" % C, "--set", "model.n_head=%d" % H,
             "--set", "model.vocab_size=%d" % V, "--set", "model.max_seq_len=%d" % T]
    common = model + ["--set", "train.seq_len=%d" % T, "--set", "train.batch_size=%d" % B,
                      "--set", "train.grad_accum=%d" % args.micro, "--set", "data.train=" + work + "/train.bin",
                      "--set", "data.val=" + work + "/val.bin", "--set", "data.tokenizer=",
                      "--set", "train.eval_batches=1", "--set", "train.eval_every=0", "--set", "train.sample_tokens=0",
                      "--set", "runtime.threads=1"]
    flops = layer_flops(args.layers, C, V, T)

    print("Real runs: P = 2 (2 ranks, 1 thread each), %d blocks x %d wide, %d micro-batches of %d x %d tokens, "
          "median of steps 3..%d" % (args.layers, C, args.micro, B, T, args.steps))
    print("| schedule | bubble | step ms | tokens/s | vs first | activations MB/rank | predicted span ms | measured span ms | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    layer_costs = None
    base = None
    for s in args.schedules.split(","):
        run_dir = "%s/run-%s" % (work, s)
        run([keel, "launch", "-n", "2", "--", "train"] + common +
            ["--set", "parallel.pipeline=2", "--set", "parallel.schedule=" + s, "--set", "parallel.trace=true",
             "--set", "train.steps=%d" % args.steps, "--set", "train.run_dir=" + run_dir], env)
        lines = [json.loads(x) for x in open(run_dir + "/metrics.jsonl") if '"loss"' in x]
        steady = [x for x in lines if x["step"] >= 3]
        ms = statistics.median(x["ms"] for x in steady)
        tps = statistics.median(x["tokens_per_s"] for x in steady)
        bubble = statistics.median(x["pipeline_bubble"] for x in steady)
        act = max(x["pipeline_activation_mb"] for x in steady)
        trace = json.load(open(run_dir + "/pipeline_trace.json"))
        layout = [json.loads(x) for x in open(run_dir + "/metrics.jsonl") if '"event": "pipeline"' in x
                  or '"event":"pipeline"' in x][0]
        firsts = [r[0] for r in layout["stages"]]
        costs = stage_costs(trace, len(firsts))
        per_layer = split_by_flops(costs, firsts, flops)
        cost_file = "%s/costs-%s.json" % (work, s)
        json.dump({"forward": per_layer["F"], "backward_input": per_layer["B"], "backward_weight": per_layer["W"]},
                  open(cost_file, "w"))
        if layer_costs is None:
            layer_costs = cost_file  # the first schedule's run calibrates every prediction
        # A prediction: the simulator with per-layer costs measured in the first run (for that run
        # itself, its own last step), this run's stage cut, against this run's measured span.
        sim = json.loads(run([keel, "schedule"] + common +
                             ["--set", "parallel.pipeline=2", "--set", "parallel.schedule=" + s,
                              "--set", "parallel.stage_boundaries=" + ",".join(str(b) for b in firsts[1:]),
                              "--layer-costs", layer_costs, "--json", "yes"], env))
        measured = span_ms(trace)
        if base is None:
            base = tps
        print("| %s | %.1f%% | %.0f | %.0f | %.2fx | %.1f | %.0f | %.0f | %+.1f%% |" %
              (s, 100 * bubble, ms, tps, tps / base if base else 1.0, act, sim["makespan"], measured,
               100 * (sim["makespan"] - measured) / measured))

    print()
    print("Simulated with the per-layer costs measured in the %s run (stages re-cut by them):" % args.schedules.split(",")[0])
    print("| P | micro-batches | schedule | bubble | step ms | vs first | activations MB/rank (peak) |")
    print("|---|---|---|---|---|---|---|")
    for P in (4, 8):
        for m in (args.micro, 4 * args.micro, 8 * args.micro):
            ref = None
            for s in args.schedules.split(","):
                if s in ("interleaved", "zb-v") and args.layers + 2 < 2 * P:
                    continue
                out = json.loads(run([keel, "schedule"] + model +
                                     ["--set", "train.seq_len=%d" % T, "--set", "train.batch_size=%d" % B,
                                      "--set", "train.grad_accum=%d" % m, "--set", "parallel.pipeline=%d" % P,
                                      "--set", "parallel.schedule=" + s, "--layer-costs", layer_costs,
                                      "--json", "yes"], env))
                if ref is None:
                    ref = out["makespan"]
                print("| %d | %d | %s | %.1f%% | %.0f | %.2fx | %.1f |" %
                      (P, m, s, 100 * out["bubble"], out["makespan"], ref / out["makespan"] if ref else 1.0,
                       max(out["peak_activation_bytes"]) / 1e6))


def split_by_flops(costs, firsts, flops):
    """Per-layer F, B, W costs: each stage's measured time split over its layers by FLOPs."""
    L = len(flops)
    bounds = firsts + [L]
    out = {op: [0.0] * L for op in "FBW"}
    for s in range(len(firsts)):
        layers = range(bounds[s], bounds[s + 1])
        total = sum(flops[i] for i in layers)
        for op in "FBW":
            for i in layers:
                out[op][i] = costs[op][s] * flops[i] / total
    return out


if __name__ == "__main__":
    main()
