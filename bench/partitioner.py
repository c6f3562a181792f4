#!/usr/bin/env python3
"""Stage cuts from measured layer costs, on workloads whose load is not where the FLOP model puts
it: the static FLOP cut, the exact partitioner (dp) and the Q-learning agent (qlearning).

For each workload a one-rank run measures every layer's F, B, W (its metrics.jsonl `layer_costs`
lines, monitor.layer_costs_every); `keel schedule --layer-costs` then cuts stages by each
partitioner and simulates P = 2, 4 and 8 (ZB-H1, 4 micro-batches per stage); at P = 2, where the
static and the dp cut differ, both also run for real (two ranks, one thread each, interleaved,
best of two) and their measured step times are compared. Workloads:
  base        the model at T = 128
  long        the same at T = 512 (a sequence-length curriculum's later half: attention heavier)
  vocab       a 65,536-token vocabulary, the most uint16 tokens allow (the head the heaviest layer)
  frozen      the embedding and the first half of the blocks frozen (optim.freeze_layers: their B
              and W are skipped, so the early stages get lighter)
Then the same measured costs as load that shifts mid-run, simulated at P = 4 and 8 (this machine
has 2 cores; bench/repartition.py runs the shifts for real at P = 2): before the shift the run
has costs A, after it costs B; the static cut is the FLOP model's at start-up and stays; dp
re-cuts on the measured costs (one interval after the shift it is on B's optimum); the agent
starts from the cut it learned on A and moves one boundary by one layer per decision on B:
  curriculum  base -> long (the sequences 4x longer mid-run)
  freeze      base -> frozen
  slow-rank   base -> base with pipeline rank 1 1.5x slower (runtime.slow_factor)
  vocab       the 64k head from the start (no shift: the start cut is the static one)

    python3 bench/partitioner.py [--keel build/keel] [--steps 15] [--layers 8]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import run_or_exit as run, write_tokens  # noqa: E402


def last_costs(metrics):
    costs = None
    for line in open(metrics):
        j = json.loads(line)
        if j.get("event") == "layer_costs":
            costs = j["layer_costs"]
    return costs


def step_ms(metrics, skip=5):
    ms = [j["ms"] for j in map(json.loads, open(metrics)) if "loss" in j and "ms" in j and "event" not in j]
    return statistics.median(ms[skip:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    work = tempfile.mkdtemp(prefix="keel-partition-")
    data = os.path.join(work, "tokens.bin")
    write_tokens(data, n=1 << 20, vocab=8192)
    base = ["--set", "model.preset=tiny", "--set", "model.n_layer=%d" % args.layers, "--set", "model.n_embd=256",
            "--set", "model.n_head=4", "--set", "model.max_seq_len=512", "--set", "train.batch_size=2",
            "--set", "train.grad_accum=8", "--set", "train.eval_every=0", "--set", "train.sample_tokens=0",
            "--set", "train.steps=%d" % args.steps, "--set", "monitor.layer_costs_every=10",
            "--set", "data.train=" + data, "--set", "data.val=" + data, "--set", "data.tokenizer=",
            "--set", "train.log_every=1000"]
    workloads = {
        "base": ["--set", "train.seq_len=128", "--set", "model.vocab_size=8192"],
        "long": ["--set", "train.seq_len=512", "--set", "model.vocab_size=8192", "--set", "train.batch_size=1"],
        "vocab": ["--set", "train.seq_len=128", "--set", "model.vocab_size=65536"],
        "frozen": ["--set", "train.seq_len=128", "--set", "model.vocab_size=8192",
                   "--set", "optim.freeze_layers=%d" % (1 + args.layers // 2)],
    }
    print("cpu: %s" % open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":", 1)[1].strip())
    print("| workload | P | static cut | span | dp cut | span | qlearning (decisions to 5 % of dp) | span | dp vs static |")
    print("|---|---|---|---|---|---|---|---|---|")
    real = []
    for name, extra in workloads.items():
        run_dir = os.path.join(work, name)
        run([args.keel, "train"] + base + extra + ["--set", "runtime.threads=1", "--set", "train.run_dir=" + run_dir], env)
        costs = last_costs(os.path.join(run_dir, "metrics.jsonl"))
        cost_file = os.path.join(work, name + ".json")
        json.dump(costs, open(cost_file, "w"))
        for P in (2, 4, 8):
            if P > args.layers + 2:
                continue
            row = {}
            for part in ("static", "dp", "qlearning"):
                out = run([args.keel, "schedule"] + base + extra +
                          ["--set", "parallel.pipeline=%d" % P, "--set", "parallel.schedule=zb-h1",
                           "--set", "train.grad_accum=%d" % (4 * P),
                           "--layer-costs", cost_file, "--partitioner", part, "--json", "yes"], env)
                row[part] = json.loads(out.strip().splitlines()[-1])
            q = row["qlearning"]["partitioner"].split(": ")[-1].replace("within 5 % of dp after ", "")
            print("| %s | %d | %s | %.1f | %s | %.1f | %s (%s) | %.1f | %+.1f %% |" % (
                name, P, row["static"]["boundaries"], row["static"]["span"], row["dp"]["boundaries"], row["dp"]["span"],
                row["qlearning"]["boundaries"], q, row["qlearning"]["span"],
                100 * (row["static"]["span"] / row["dp"]["span"] - 1)))
            # Real runs only where the cuts differ (the same cut twice measures only the machine's noise).
            if P == 2 and row["static"]["boundaries"] != row["dp"]["boundaries"]:
                real.append((name, extra, row["static"]["boundaries"], row["dp"]["boundaries"]))
    shifts(args, base, workloads, work, env)
    print("\nreal runs at P = 2 (zb-h1, 8 micro-batches, one thread per rank), median step ms:")
    print("| workload | static cut | step ms | dp cut | step ms | dp vs static |")
    print("|---|---|---|---|---|---|")
    if not real:
        print("(none: at P = 2 the dp cut is the static cut on every real workload here)")
    for name, extra, s_cut, d_cut in real:
        ms = {"static": float("inf"), "dp": float("inf")}
        for attempt in range(2):  # interleaved, best of two
            for label, cut in (("static", s_cut), ("dp", d_cut)):
                run_dir = os.path.join(work, "%s-p2-%s-%d" % (name, label, attempt))
                run([args.keel, "launch", "-n", "2", "--", "train"] + base + extra +
                    ["--set", "parallel.pipeline=2", "--set", "parallel.schedule=zb-h1", "--set", "runtime.threads=1",
                     "--set", "parallel.stage_boundaries=" + cut, "--set", "train.run_dir=" + run_dir], env)
                ms[label] = min(ms[label], step_ms(os.path.join(run_dir, "metrics.jsonl")))
        print("| %s | %s | %.1f | %s | %.1f | %+.1f %% |" % (name, s_cut, ms["static"], d_cut, ms["dp"],
                                                         100 * (ms["static"] / ms["dp"] - 1)))


def schedule(args, base, extra, cost_file, P, env, *flags):
    out = run([args.keel, "schedule"] + base + extra +
              ["--set", "parallel.pipeline=%d" % P, "--set", "parallel.schedule=zb-h1", "--set", "train.grad_accum=%d" % (4 * P),
               "--layer-costs", cost_file, "--json", "yes"] + list(flags), env)
    return json.loads(out.strip().splitlines()[-1])


def shifts(args, base, workloads, work, env):
    """Load shifting mid-run, on the simulator with measured costs at P = 4 and 8."""
    slow = ["--set", "runtime.slow_rank=1", "--set", "runtime.slow_factor=1.5"]
    cases = {"curriculum": ("base", "long", []), "freeze": ("base", "frozen", []),
             "slow-rank": ("base", "base", slow), "vocab": ("vocab", "vocab", [])}
    print("\nload shifting mid-run, simulated with the measured costs (span = simulated step ms after the shift;")
    print("decisions: the agent's, from its pre-shift cut, to come within 5 % of dp's span):")
    print("| shift | P | static cut (kept) | span | bubble | dp cut after | span | bubble | qlearning | decisions | span |"
          " dp vs static | qlearning vs static |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (before, after, flags_after) in cases.items():
        ca, cb = os.path.join(work, before + ".json"), os.path.join(work, after + ".json")
        ea, eb = workloads[before], workloads[after] + flags_after
        for P in (4, 8):
            s_a = schedule(args, base, ea, ca, P, env, "--partitioner", "static")["boundaries"]
            q_a = schedule(args, base, ea, ca, P, env, "--partitioner", "qlearning")["boundaries"]
            kept = schedule(args, base, eb, cb, P, env, "--set", "parallel.stage_boundaries=" + s_a)
            dp = schedule(args, base, eb, cb, P, env, "--partitioner", "dp")
            q = schedule(args, base, eb, cb, P, env, "--partitioner", "qlearning", "--start-cut", q_a)
            within = q["partitioner"].split(": ")[-1].replace("within 5 % of dp after ", "")
            print("| %s | %d | %s | %.1f | %.1f %% | %s | %.1f | %.1f %% | %s -> %s | %s | %.1f | %+.1f %% | %+.1f %% |" % (
                name, P, s_a, kept["span"], 100 * kept["bubble"], dp["boundaries"], dp["span"], 100 * dp["bubble"],
                q_a, q["boundaries"], within, q["span"], 100 * (kept["span"] / dp["span"] - 1),
                100 * (kept["span"] / q["span"] - 1)))


if __name__ == "__main__":
    main()
