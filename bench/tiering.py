#!/usr/bin/env python3
"""Tiered chunk memory: a model whose training state is 4x the memory granted, against the same
model all in memory, side by side on this machine.

Three runs of the same model, data, seed and steps (one process, all cores):
  memory    everything in DRAM (no [tier] section)
  tiered    [tier] with budgets of device + host about a quarter of the state, the rest on the
            NVMe tier (an O_DIRECT file under --nvme-dir), prefetch with --lookahead
  naive     the same budgets, prefetch off: every page loaded when first needed (the static
            placement then keeps room for one operation's pages, not two, so more is homed on
            the device tier); updates are deferred into the forward pass in both
Reports tokens/s (mean over the timed steps) and its ratio to memory, the off-device hit rate
(a page already present when a step first touches it), the stall share (time acquires waited for
pages over step time), bytes read and written per step per tier, and the peak resident set size
against the budgets plus the activations (which the tiers do not hold) and a stated overhead.
Checks that the three runs' losses are the same bytes. Targets: tiered >= 70 % of memory's
tokens/s, hit rate >= 95 %.

Usage: bench/tiering.py [--preset gpt2-124m] [--batch 8] [--seq 128] [--steps 6] [--device-mib N]
                        [--host-mib N] [--lookahead K] [--policy static|adaptive] [--nvme-dir DIR]
                        [--runs memory,tiered,naive] [--keep] [--out FILE]
Environment: KEEL (default build/keel).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from benchutil import write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
OVERHEAD_MB = 300  # process, BLAS and loader buffers, partial pages at chunk edges: stated, checked


def run(work, name, args, sets):
    run_dir = os.path.join(work, name)
    tokens = os.path.join(work, "tokens.bin")
    cmd = [KEEL, "train", "--set", "model.preset=" + args.preset, "--set", "model.vocab_size=50304",
           "--set", "model.max_seq_len=%d" % args.seq, "--set", "data.train=" + tokens, "--set", "data.val=" + tokens,
           "--set", "data.tokenizer=", "--set", "train.batch_size=%d" % args.batch, "--set", "train.seq_len=%d" % args.seq,
           "--set", "train.steps=%d" % args.steps, "--set", "train.eval_batches=1", "--set", "train.eval_every=0",
           "--set", "train.sample_tokens=0", "--set", "train.checkpoint_every=0", "--set", "train.log_every=1",
           "--set", "runtime.peak_gflops=100", "--set", "train.run_dir=" + run_dir] + sets
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("OMP_NUM_THREADS", None)
    log = os.path.join(work, name + ".log")
    print("  [tiering] %-7s ..." % name, file=sys.stderr, flush=True)
    with open(log, "w") as out:
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    text = open(log).read()
    if rc != 0:
        sys.exit("tiering.py: %s failed (exit %d):\n%s" % (name, rc, text[-3000:]))
    steps = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in l]
    m = re.search(r"activations ([0-9.]+) MB", text)
    # Untimed: step 1 (page faults, warm-up; with tiers nothing is deferred into it yet) and step 2
    # (the tiers record the schedule of a steady step: no prefetch yet). The same steps for every run.
    timed = steps[2:] if len(steps) > 2 else steps
    r = {"run": name, "losses": [s["loss"] for s in steps],
         "tokens_per_s": sum(s["tokens_per_s"] for s in timed) / len(timed),
         "peak_rss_mb": steps[-1]["peak_rss_mb"], "activations_mb": float(m.group(1)) if m else 0.0,
         "state_mb": None}
    m = re.search(r"\(([0-9.]+)M parameters", text)
    if m:
        r["state_mb"] = float(m.group(1)) * 16  # params, grads, two moments: 16 bytes per parameter
    if "tier_hit_rate" in steps[-1]:
        r["hit_rate"] = sum(s["tier_hit_rate"] for s in timed) / len(timed)
        r["stall_share"] = sum(s["tier_stall_share"] for s in timed) / len(timed)
        for t in ("device", "host", "nvme"):
            r[t + "_read_mb"] = sum(s["tier_%s_read_bytes" % t] for s in timed) / len(timed) / 1e6
            r[t + "_written_mb"] = sum(s["tier_%s_written_bytes" % t] for s in timed) / len(timed) / 1e6
            r[t + "_resident_mb"] = steps[-1]["tier_%s_resident_bytes" % t] / 1e6
        r["stale_refetches"] = sum(s["tier_stale_refetches"] for s in steps)
        m = re.search(r"keel: tiered memory: device .*", text)
        r["placement"] = m.group(0) if m else ""
    return r


def report(results, args):
    by = {r["run"]: r for r in results}
    mem = by.get("memory")
    budget_mb = (args.device_mib + args.host_mib) * 1.048576
    state = next((r["state_mb"] for r in results if r.get("state_mb")), 0)
    print("Tiered memory: %s, batch %d x %d tokens, %d steps (first two untimed), state %.0f MB = %.1fx the budgets "
          "(device %d MiB + host %d MiB), NVMe tier in %s" % (args.preset, args.batch, args.seq, args.steps, state,
                                                               state / budget_mb if budget_mb else 0, args.device_mib,
                                                               args.host_mib, args.nvme_dir))
    print()
    print("| Run | tokens/s | vs memory | off-device hit rate | stall share | NVMe read MB/step | NVMe written MB/step "
          "| host read MB/step | peak RSS MB | budgets + activations + %d MB |" % OVERHEAD_MB)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r["tokens_per_s"] / mem["tokens_per_s"] if mem else float("nan")
        limit = budget_mb + r["activations_mb"] + OVERHEAD_MB
        if r["run"] == "memory":
            print("| memory | %.1f | 1.00x | - | - | - | - | - | %.0f | - |" % (r["tokens_per_s"], r["peak_rss_mb"]))
        else:
            print("| %s | %.1f | %.2fx | %.1f %% | %.1f %% | %.0f | %.0f | %.0f | %.0f | %.0f (%s) |" % (
                r["run"], r["tokens_per_s"], ratio, 100 * r["hit_rate"], 100 * r["stall_share"], r["nvme_read_mb"],
                r["nvme_written_mb"], r["host_read_mb"], r["peak_rss_mb"], limit,
                "within" if r["peak_rss_mb"] <= limit else "OVER"))
    print()
    for r in results:
        if r.get("placement"):
            print("%s: %s" % (r["run"], r["placement"]))
    same = all(r["losses"] == results[0]["losses"] for r in results)
    print("Losses of every run the same bytes: %s" % ("yes" if same else "NO"))
    if mem and "tiered" in by:
        t = by["tiered"]
        print("Targets: tokens/s >= 70 %% of memory: %s (%.0f %%); hit rate >= 95 %%: %s (%.1f %%)" % (
            "PASS" if t["tokens_per_s"] >= 0.7 * mem["tokens_per_s"] else "MISS", 100 * t["tokens_per_s"] / mem["tokens_per_s"],
            "PASS" if t["hit_rate"] >= 0.95 else "MISS", 100 * t["hit_rate"]))
    return same


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device-mib", type=int, default=320)
    ap.add_argument("--host-mib", type=int, default=150)
    ap.add_argument("--lookahead", type=int, default=16)
    ap.add_argument("--policy", default="static", help="tier.policy of the tiered and naive runs (static|adaptive)")
    ap.add_argument("--nvme-dir", default=None, help="default: a fresh directory under /var/tmp")
    ap.add_argument("--runs", default="memory,tiered,naive")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, metrics) and print its path")
    ap.add_argument("--out", default=None, help="also write each run's result as a JSON line")
    args = ap.parse_args()
    if not os.path.exists(KEEL):
        sys.exit("tiering.py: %s not found (build first: cmake --build build)" % KEEL)
    work = tempfile.mkdtemp(prefix="keel-tiering.")
    if args.nvme_dir is None:
        args.nvme_dir = tempfile.mkdtemp(prefix="keel-tiering-nvme.", dir="/var/tmp")
    write_tokens(os.path.join(work, "tokens.bin"), 1 << 20, 50257)
    tiers = ["--set", "tier.device_mib=%d" % args.device_mib, "--set", "tier.host_mib=%d" % args.host_mib,
             "--set", "tier.nvme_dir=" + args.nvme_dir, "--set", "tier.lookahead=%d" % args.lookahead,
             "--set", "tier.policy=" + args.policy]
    variants = {"memory": [], "tiered": tiers, "naive": tiers + ["--set", "tier.prefetch=false"]}
    results = []
    for name in args.runs.split(","):
        results.append(run(work, name, args, variants[name]))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
    ok = report(results, args)
    if args.keep:
        print("Work directory kept: " + work)
    else:
        subprocess.call(["rm", "-rf", work])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
