"""Keel against Keel by CPU time per step at steady state: two (or more) `keel` binaries running
the default job (`keel train`, any --set added to all), interleaved (A B, A B, ...), each run's
CPU time (all threads) per step over steps FIRST..LAST, sampled from /proc at each step line of
metrics.jsonl as bench/steady_state.py does, beside its wall time and the load average. CPU time
is what a machine shared with other work disturbs least; the load is printed to judge it.

    /usr/bin/python3 bench/step_cpu_ab.py A/keel B/keel [--rounds 3] [--first 100] [--last 140]

Prints one line per run and, per binary, the median and the mean over its runs."""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import steady_state  # noqa: E402  (run_sampling_cpu, clean_env, ROOT)


def one_run(keel, sets, first, last, work, tag):
    run_dir = os.path.join(work, tag)
    cmd = [os.path.abspath(keel), "train", "--set", "train.run_dir=" + run_dir, "--set", "train.steps=%d" % last]
    for s in sets:
        cmd += ["--set", s]
    log = run_dir + ".log"
    load = os.getloadavg()[0]
    rc, cpu_at_step = steady_state.run_sampling_cpu(cmd, steady_state.clean_env(), log,
                                                    os.path.join(run_dir, "metrics.jsonl"))
    if rc != 0:
        sys.exit("step_cpu_ab: %s failed (exit %d), log %s" % (" ".join(cmd), rc, log))
    wall = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = steady_state.json.loads(line)
            if "event" not in j and "loss" in j and "ms" in j and first < j["step"] <= last:
                wall.append(j["ms"])
    shutil.rmtree(run_dir, ignore_errors=True)
    if first not in cpu_at_step or last - 1 not in cpu_at_step:
        sys.exit("step_cpu_ab: steps %d..%d not sampled in %s" % (first, last, log))
    # The step line of step s is written when step s ends: CPU time of steps first+1 .. last-1.
    cpu = (cpu_at_step[last - 1] - cpu_at_step[first]) / (last - 1 - first)
    return cpu, statistics.mean(wall), load, os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("keel", nargs="+", help="keel binaries to compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--first", type=int, default=100)
    ap.add_argument("--last", type=int, default=140)
    ap.add_argument("--set", action="append", default=[], help="a config override for every run")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="step_cpu_ab-")
    results = {k: [] for k in a.keel}
    try:
        for r in range(a.rounds):
            order = a.keel if r % 2 == 0 else list(reversed(a.keel))
            for i, keel in enumerate(order):
                cpu, wall, load0, load1 = one_run(keel, a.set, a.first, a.last, work, "r%d-%d" % (r, i))
                results[keel].append(cpu)
                print("%-40s round %d: CPU %.1f ms/step, wall %.1f ms/step (steps %d-%d), load %.2f -> %.2f"
                      % (keel, r + 1, cpu, wall, a.first + 1, a.last - 1, load0, load1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(results[a.keel[0]])
    for keel in a.keel:
        xs = results[keel]
        print("%-40s CPU ms/step median %.1f mean %.1f over %d runs (%s); %s / first: %.3fx"
              % (keel, statistics.median(xs), statistics.mean(xs), len(xs), ", ".join("%.0f" % x for x in xs), keel,
                 base / statistics.median(xs)))


if __name__ == "__main__":
    main()
