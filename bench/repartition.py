#!/usr/bin/env python3
"""Stages re-cut while training (parallel.repartition_every), in real two-stage runs on this machine.

Each workload runs three times at P = 2 (two ranks, one thread each, ZB-H1, 8 micro-batches a
step), from the same start-up cut (the FLOP model's static one, given as stage_boundaries):
  static     the cut is never changed
  dp         every 10 steps the exact partitioner proposes a cut from the measured layer costs;
             the stages move when the simulator predicts >= 2 % shorter steps
  qlearning  the same with the Q-learning agent (one boundary moved by one layer per decision)
Workloads (a 256-wide model of 8 blocks at T = 128):
  frozen        the embedding and the first 4 blocks frozen from the start (optim.freeze_layers)
  freeze-mid    the same layers frozen from step 20 on (optim.freeze_at_step): the load shifts
                mid-run, a static cut stays where the dense model wanted it
  slow-rank     the second rank 1.5x slower (runtime.slow_factor: a sleep after each layer, the
                documented test-only slowdown); the re-cut estimates the factor from the
                ranks' measured forward times
  curriculum    sequences of 128 tokens, then of 512 from step 20 (train.seq_len_schedule):
                attention's share of every block grows, the head's share of the step shrinks
Per run: the median step time of the last 20 steps, the cuts the run went through, the moves'
cost (ms on the slowest rank), and for qlearning the first 10-step interval whose median step
is within 5 % of the dp run's final one (the steps the agent needed, counted from the shift).

    python3 bench/repartition.py [--keel build/keel] [--steps 60]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import run_or_exit as run, write_tokens  # noqa: E402


def read(metrics):
    steps, events = [], []
    for line in open(metrics):
        j = json.loads(line)
        if j.get("event") == "repartition":
            events.append(j)
        elif "loss" in j and "ms" in j and "event" not in j:
            steps.append(j)
    return steps, events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    work = tempfile.mkdtemp(prefix="keel-recut-")
    data = os.path.join(work, "tokens.bin")
    write_tokens(data, n=1 << 20, vocab=8192)
    base = ["--set", "model.preset=tiny", "--set", "model.n_layer=8", "--set", "model.n_embd=256",
            "--set", "model.n_head=4", "--set", "model.max_seq_len=128", "--set", "model.vocab_size=8192",
            "--set", "train.seq_len=128", "--set", "train.batch_size=2", "--set", "train.grad_accum=8",
            "--set", "train.eval_every=0", "--set", "train.sample_tokens=0", "--set", "train.steps=%d" % args.steps,
            "--set", "train.log_every=1000", "--set", "monitor.layer_costs_every=10",
            "--set", "data.train=" + data, "--set", "data.val=" + data, "--set", "data.tokenizer=",
            "--set", "parallel.pipeline=2", "--set", "parallel.schedule=zb-h1", "--set", "runtime.threads=1"]
    shift = 20
    workloads = {
        "frozen": (["--set", "optim.freeze_layers=5"], 0),
        "freeze-mid": (["--set", "optim.freeze_layers=5", "--set", "optim.freeze_at_step=%d" % shift], shift),
        "slow-rank": (["--set", "runtime.slow_rank=1", "--set", "runtime.slow_factor=1.5"], 0),
        "curriculum": (["--set", "model.max_seq_len=512", "--set", "train.seq_len_schedule=%d:512" % shift], shift),
    }
    recut = {
        "static": [],
        "dp": ["--set", "parallel.repartition_every=10", "--set", "parallel.partitioner=dp",
               "--set", "parallel.repartition_threshold=0.02"],
        "qlearning": ["--set", "parallel.repartition_every=10", "--set", "parallel.partitioner=qlearning",
                      "--set", "parallel.repartition_threshold=0.02"],
    }
    print("cpu: %s" % open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":", 1)[1].strip())
    print("| workload | run | cuts (step: cut) | moves (ms each) | median step ms, last 20 | bubble | vs static |")
    print("|---|---|---|---|---|---|---|")
    for name, (extra, shifted_at) in workloads.items():
        results = {}
        # Every run starts from the static cut (a dp / qlearning run would otherwise start from its
        # own partitioner's cut on the FLOP model, which knows a slowed rank's factor).
        static = json.loads(run([args.keel, "schedule"] + base + extra +
                                ["--partitioner", "static", "--json", "yes"], env).strip().splitlines()[-1])
        start = ["--set", "parallel.stage_boundaries=" + static["boundaries"]]
        print("| %s | start cut | %s |  |  |  |  |" % (name, static["boundaries"]))
        for label, flags in recut.items():
            run_dir = os.path.join(work, "%s-%s" % (name, label))
            out = run([args.keel, "launch", "-n", "2", "--", "train"] + base + extra + flags + start +
                      ["--set", "train.run_dir=" + run_dir], env)
            steps, events = read(os.path.join(run_dir, "metrics.jsonl"))
            first = out.split("stages now ")[1].split("\n")[0] if "stages now " in out else None
            tail = [s["ms"] for s in steps[-20:]]
            results[label] = {"steps": steps, "events": events, "median": statistics.median(tail),
                              "bubble": statistics.median(s.get("pipeline_bubble", 0) for s in steps[-20:]),
                              "first": first or steps[0].get("stage_boundaries", "")}
        for label, r in results.items():
            moved = [e for e in r["events"] if e.get("moved")]
            cuts = ", ".join("%d: %s" % (e["step"], e["proposed"]) for e in moved) or "(start cut kept)"
            moves = "%d (%s)" % (len(moved), ", ".join("%.0f" % e["move_ms"] for e in moved)) if moved else "0"
            print("| %s | %s | %s | %s | %.1f | %.1f %% | %+.1f %% |" % (
                name, label, cuts, moves, r["median"], 100 * r["bubble"],
                100 * (results["static"]["median"] / r["median"] - 1)))
        # The agent: the first 10-step interval after the shift whose median is within 5 % of dp's final.
        target = results["dp"]["median"]
        q = results["qlearning"]["steps"]
        reached = None
        for start in range(max(shifted_at, 1), len(q) - 9, 10):
            if statistics.median(s["ms"] for s in q[start:start + 10]) <= 1.05 * target:
                reached = start + 10 - shifted_at
                break
        print("| %s | qlearning within 5 %% of dp's step | %s |  |  |  |  |" % (
            name, "after %d steps" % reached if reached is not None else "not within %d steps" % (len(q) - shifted_at)))


if __name__ == "__main__":
    main()
