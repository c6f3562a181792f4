#!/usr/bin/env python3
"""Recovery from memory vs from disk: how long a 2-rank job is down after a rank dies.

Runs GPT-2 124M on 2 ranks under `keel launch -n 2 --max-restarts K` and SIGKILLs one rank (of the
two, at random) at a random step, K times. Two times per kill: down, from the kill to training
resumed (the state restored on every rank and the next step starting: the recovery Keel's design
figure speaks of), and from the kill to the first step the restarted job completes (down plus one
step, seen in its metrics.jsonl). Once with memory checkpoints every --every steps (no periodic
disk checkpoint: every restart resumes from /dev/shm), once with disk checkpoints every --every
steps only (every restart resumes from disk); the first step after a restart holds no checkpoint
either way.
Each recovery is split by the job's own events into: detect (kill to the launcher reaping mpirun),
mpirun (to the new ranks' process start), start+build (MPI, model build: to the state load's
start), load (reading and verifying the state), setup (to training resumed), first step; medians
over the kills (and the p90 of down), memory and disk side by side. Then the cost of memory copies
per step: the median step time of jobs with checkpoint.memory_every = 1 and without memory copies,
alternating (off, on, off, on) so that the machine's load falls on both alike. Keel's design
figure for parameter recovery (2.7 s) is printed beside the medians.

Usage: bench/recovery.py [--preset gpt2-124m] [--kills 20] [--every 4] [--sources memory,disk]
                         [--cost-steps 8] [--cost-rounds 2] [--seed 1]
Environment: KEEL (default build/keel).
"""
import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
DESIGN_RECOVERY_S = 2.7  # Keel's design figure for parameter recovery
HANG_S = 900             # a guard against a job that never comes back, not a speed limit


def train_args(work, run_dir, preset, steps, extra):
    args = ["train", "--set", f"model.preset={preset}", "--set", "model.vocab_size=50257",
            "--set", "model.max_seq_len=64", "--set", "train.batch_size=1", "--set", "train.seq_len=64",
            "--set", f"train.steps={steps}", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
            "--set", "train.sample_tokens=0", "--set", "train.log_every=1", "--set", "runtime.threads=1",
            "--set", "runtime.peak_gflops=100", "--set", f"data.train={work}/train.bin",
            "--set", f"data.val={work}/val.bin", "--set", "data.tokenizer=", "--set", f"train.run_dir={run_dir}"]
    for kv in extra:
        args += ["--set", kv]
    return args


def env():
    e = {k: v for k, v in os.environ.items() if k not in benchutil.CLEARED_ENV}
    e.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return e


def metrics(run_dir):
    """The run's metrics lines (a line being written is skipped)."""
    out = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def wait_for(what, ready, job, limit_s=HANG_S):
    until = time.time() + limit_s
    while time.time() < until:
        got = ready()
        if got is not None:
            return got
        if job.poll() is not None:
            sys.exit(f"recovery.py: the job exited ({job.returncode}) while waiting for {what}")
        time.sleep(0.02)
    sys.exit(f"recovery.py: no {what} after {limit_s} s")


def rank_pids(run_dir):
    """The job's ranks: keel processes running `train` with this run_dir (not the launcher, not mpirun).
    Read from /proc, so that how mpirun spelled the binary's path does not matter."""
    want = f"train.run_dir={run_dir}"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 1 and os.path.basename(argv[0]) == "keel" and argv[1] == "train" and want in argv:
            pids.append(int(entry))
    return sorted(pids)


def newest_checkpoint_step(run_dir):
    """The step of the newest complete disk checkpoint (its manifest published), -1 when none."""
    newest = -1
    try:
        names = os.listdir(os.path.join(run_dir, "ckpt"))
    except OSError:
        return newest
    for name in names:
        if name.startswith("step-") and os.path.exists(os.path.join(run_dir, "ckpt", name, "manifest.json")):
            try:
                newest = max(newest, int(name[5:].split(".")[0]))
            except ValueError:
                pass
    return newest


def kills(work, tag, preset, count, extra, first_copy_step, rng):
    """Kills a rank of one job `count` times; returns one dict per recovery."""
    run_dir = os.path.join(work, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    log = open(os.path.join(work, tag + ".log"), "w")
    job = subprocess.Popen([KEEL, "launch", "-n", "2", "--max-restarts", str(count), "--"] +
                           train_args(work, run_dir, preset, 1000000, extra),
                           stdout=log, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    out = []
    try:
        for k in range(count):
            # The kill comes 1..3 steps after this attempt's first step (the first attempt: after its
            # first copy).
            def steps_of_attempt():
                lines = metrics(run_dir)
                since = [i for i, l in enumerate(lines) if l.get("event") == "recovery"]
                start = since[-1] + 1 if since and len(since) == k else 0
                steps = [l["step"] for l in lines[start:] if "loss" in l and "event" not in l]
                return steps if len(since) == k else []
            base = first_copy_step if k == 0 else None
            target = rng.randint(1, 3)

            def due():
                steps = steps_of_attempt()
                if not steps:
                    return None
                floor = base if base is not None else steps[0]
                # A disk checkpoint is written in the background: the first kill waits until one is
                # complete (a restart without one would start from step 0, not recover).
                if tag == "disk" and newest_checkpoint_step(run_dir) < first_copy_step:
                    return None
                return True if steps[-1] >= floor + target else None
            wait_for(f"step {target} of attempt {k + 1}", due, job)
            try:
                pids = wait_for("the ranks", lambda: rank_pids(run_dir) if len(rank_pids(run_dir)) == 2 else None, job,
                                limit_s=60)
            except SystemExit:
                print(f"recovery.py: ranks found: {rank_pids(run_dir)}; keel processes:", flush=True)
                subprocess.run(["pgrep", "-af", "keel"])
                raise
            victim = rng.choice(pids)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)

            def back():
                lines = metrics(run_dir)
                rec = [i for i, l in enumerate(lines) if l.get("event") == "recovery"]
                if len(rec) < k + 1:
                    return None
                after = lines[rec[k] + 1:]
                if any("loss" in l and "event" not in l for l in after):
                    resume = [l for l in lines[:rec[k] + 1] if l.get("event") == "resume"]
                    return time.time(), lines[rec[k]], resume[-1] if resume else {}
                return None
            first_step_at, recovery, resume = wait_for(f"recovery {k + 1}", back, job)
            noticed = recovery.get("noticed_ns", 0) / 1e9
            process = resume.get("process_start_ns", 0) / 1e9
            started = resume.get("started_ns", 0) / 1e9
            resumed = recovery.get("resumed_ns", 0) / 1e9
            load = resume.get("load_s", 0.0)
            out.append({"total": first_step_at - killed_at, "down": resumed - killed_at, "detect": noticed - killed_at,
                        "mpirun": process - noticed, "build": started - process, "load": load,
                        "setup": resumed - started - load, "first_step": first_step_at - resumed,
                        "source": resume.get("source", "?"), "step": recovery.get("step")})
            r = out[-1]
            print(f"  {tag} kill {k + 1}/{count}: rank pid {victim}, training resumed after {r['down']:.2f} s, "
                  f"first step done after {r['total']:.2f} s (from {r['source']} at step {r['step']}; detect "
                  f"{r['detect']:.2f}, mpirun {r['mpirun']:.2f}, start+build {r['build']:.2f}, load {r['load']:.2f}, "
                  f"setup {r['setup']:.2f}, 1st step {r['first_step']:.2f}; load average {os.getloadavg()[0]:.1f})",
                  flush=True)
    finally:
        # A clean stop: the launcher forwards SIGTERM, the ranks checkpoint and exit (and drop
        # their memory copies).
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(300)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        log.close()
        for line in metrics(run_dir):
            if line.get("event") == "resume" and line.get("source") == "memory":
                shutil.rmtree(line["from"], ignore_errors=True)
    return out


def step_cost(work, preset, steps, memory_every, round_):
    """One job of `steps` steps: its steps' times and memory-copy stalls (ms), the first step left out."""
    run_dir = os.path.join(work, f"cost-{memory_every}-{round_}")
    shutil.rmtree(run_dir, ignore_errors=True)
    extra = [f"checkpoint.memory_every={memory_every}", "train.checkpoint_every=0"]
    benchutil.run_logged([KEEL, "launch", "-n", "2", "--"] + train_args(work, run_dir, preset, steps, extra),
                         os.path.join(work, f"cost-{memory_every}-{round_}.log"), ROOT, HANG_S, "recovery.py",
                         {"OMP_WAIT_POLICY": "PASSIVE"})
    lines = [l for l in metrics(run_dir) if "loss" in l and "event" not in l and l["step"] > 1]
    shutil.rmtree(run_dir, ignore_errors=True)
    return [l["ms"] for l in lines], [l.get("ckpt_stall_ms", 0) for l in lines]


def interleaved_cost(work, preset, steps, rounds):
    """Step times without and with memory copies every step, the jobs alternating (off, on, off,
    on, ...) so that the machine's load falls on both alike; medians over every step of every round."""
    off, on, stall = [], [], []
    for r in range(rounds):
        off += step_cost(work, preset, steps, 0, r)[0]
        times, stalls = step_cost(work, preset, steps, 1, r)
        on += times
        stall += stalls
        print(f"  cost round {r + 1}/{rounds}: step {statistics.median(off):.0f} ms without memory copies, "
              f"{statistics.median(on):.0f} ms with (load {os.getloadavg()[0]:.1f})", flush=True)
    return statistics.median(off), statistics.median(on), statistics.median(stall)


def summary(rows):
    downs = sorted(r["down"] for r in rows)
    p90 = downs[min(len(downs) - 1, int(round(0.9 * (len(downs) - 1))))]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return [len(rows), f"{med('down'):.2f}", f"{p90:.2f}", f"{med('total'):.2f}"] + \
        [f"{med(k):.2f}" for k in ("detect", "mpirun", "build", "load", "setup", "first_step")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--sources", default="memory,disk", help="which recoveries to measure: memory, disk or both")
    ap.add_argument("--cost-steps", type=int, default=8, help="steps per job of the per-step cost (0: not measured)")
    ap.add_argument("--cost-rounds", type=int, default=2, help="jobs without and with memory copies, alternating")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    sources = [x for x in a.sources.split(",") if x]
    if not sources or any(x not in ("memory", "disk") for x in sources):
        sys.exit(f"recovery.py: --sources: expected memory, disk or memory,disk, found '{a.sources}'")
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="keel-recovery-")
    try:
        benchutil.write_tokens(os.path.join(work, "train.bin"), n=1 << 18, seed=1)
        benchutil.write_tokens(os.path.join(work, "val.bin"), n=1 << 14, seed=2)
        print(f"{a.preset} on 2 ranks, {a.kills} kills per source; load before: {os.getloadavg()[0]:.1f}", flush=True)
        measured = {}
        for source in sources:
            extra = ([f"checkpoint.memory_every={a.every}", "train.checkpoint_every=0"] if source == "memory" else
                     ["checkpoint.memory_every=0", f"train.checkpoint_every={a.every}"])
            measured[source] = kills(work, source, a.preset, a.kills, extra, a.every, rng)
            print(f"  load after the {source} kills: {os.getloadavg()[0]:.1f}", flush=True)
        cost = interleaved_cost(work, a.preset, a.cost_steps, a.cost_rounds) if a.cost_steps > 0 else None
        print()
        names = {"memory": f"memory (memory_every={a.every})", "disk": f"disk (checkpoint_every={a.every})"}
        benchutil.print_table(["resume from", "kills", "down s (median)", "down p90", "to 1st step done",
                               "detect", "mpirun", "start+build", "load", "setup", "1st step"],
                              [[names[x]] + summary(measured[x]) for x in sources] +
                              [["Keel design figure", "", f"{DESIGN_RECOVERY_S:.1f}"] + [""] * 8])
        print("down: from the kill to training resumed (state restored on every rank, the next step starting); "
              "detect: kill to the launcher reaping mpirun; mpirun: to the new ranks' start; start+build: to the "
              "state load's start; setup: after the load, to training resumed; medians over the kills")
        if cost is not None:
            off_ms, on_ms, copy_ms = cost
            print()
            benchutil.print_table(["checkpoint.memory_every", "median step ms", "memory copy ms/step", "cost per step"],
                                  [["0 (off)", f"{off_ms:.0f}", "0", ""],
                                   ["1", f"{on_ms:.0f}", f"{copy_ms:.0f}",
                                    f"{on_ms - off_ms:+.0f} ms ({100 * (on_ms / off_ms - 1):+.0f} %)"]])
            print(f"(a copy every N steps costs about 1/N of this per step; {a.cost_rounds} alternating rounds of "
                  f"{a.cost_steps} steps each)")
        if len(sources) == 2:
            ratio = (statistics.median(r["down"] for r in measured["memory"]) /
                     statistics.median(r["down"] for r in measured["disk"]))
            print(f"\nrecovery from memory / from disk (median down times): {ratio:.2f}x")
        print(f"load after: {os.getloadavg()[0]:.1f}")
        wrong = [r for x in sources for r in measured[x] if r["source"] != x]
        if wrong:
            sys.exit(f"recovery.py: {len(wrong)} restart(s) resumed from another source than the one measured")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
