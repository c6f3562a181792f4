#!/usr/bin/env python3
"""Steady-state training speed: `keel train` against PyTorch on real text, as each is run.

The from-initialisation benches (compare_pytorch.sh, bf16_speed.sh without --steady) time a few
steps of a fresh model on random tokens; a model that trains for hundreds of steps on real text
can run at another speed (denormal floats appear as weights and moments shrink: issue 38). This
bench trains each model for --steps steps (at least 300 by default) on the fortunes shards the
default job trains on, records every step's time and reports the median over the last 50 steps
("steady") beside the median over steps 10-40 ("early"; step 1 is the first step).

Models (--only): "d4" is the default job as `keel train` runs it (configs/default.toml: L4 C256
H4, batch 16 x 128, the fortunes BPE of 8192 tokens); "124m" is GPT-2 124M's shape
(`model.preset=gpt2-124m`, batch 4 x 64) on the same shards, so with the same 8192-token
vocabulary.

Engines, interleaved within each repeat (keel, every peer, keel-noflush), each at its best:
  keel         `keel train` (build/keel) with the default job's settings; step times from its
               run directory's metrics.jsonl ("ms" of each step line), the validation loss from
               its last "val_loss" line.
  keel-noflush the same with runtime.flush_denormals=false (--denormals): the contrast for the
               denormal slowdown that flushing removes.
  torch-VER    bench/torch_gpt2_train.py on the same shards, read as keel train reads them (each
               epoch a permutation of the shard's sequences: another permutation than Keel's, so
               not the same batches), with the same AdamW settings (lr,
               warm-up, cosine decay, weight decay, betas, eps and clipping of
               configs/default.toml), 2 threads, in the tuned environment of compare_pytorch.sh
               (passive OpenMP waiting, glibc malloc tunables, OPENBLAS_NUM_THREADS=2),
               torch.set_flush_denormal(True), OPENBLAS_CORETYPE where Debian's OpenBLAS falls
               back to kernels older than the CPU's vector units (as Keel does for itself,
               docs/performance.md "OpenBLAS's kernels"), and torch.compile where the PyTorch
               has it (2.x); a compile that fails is reported and the run is repeated eagerly.
               One peer per Python found: Debian's /usr/bin/python3 (PyTorch 1.13) and
               bench/.venv/bin/python (the current PyTorch from PyPI), or --peers.
With --precision bf16 (bench/bf16_speed.sh --steady) every engine runs in float32 and in bf16:
Keel with runtime.precision=bf16, PyTorch under torch.autocast("cpu", dtype=torch.bfloat16).

Prints, per model, a table of every engine's best run (lowest steady median; every run's steady
median beside it shows the noise between repeats), the median CPU time of the last 50 steps (all
threads; on a shared machine less sensitive than wall time to other load), Keel's ratio to each
(by wall time, then by CPU time), the load average before and after each run, and the verdicts (issue 38: Keel fp32 >= 1.3x the best PyTorch at steady
state; the default job's steady median within 10 % of its early one, by CPU time where recorded). Exits 0 whatever the
verdicts, non-zero when a run fails or a file is missing.

Usage: bench/steady_state.py [--only d4|124m] [--steps N] [--repeats R] [--precision fp32|bf16]
                             [--denormals] [--peers PY,PY] [--out FILE] | --report FILE
"""

import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(ROOT, "bench", "torch_gpt2_train.py")
DATA = {"train": "data/fortunes/train.bin", "val": "data/fortunes/val.bin"}  # the default job's, from ROOT

# Keel's sets and the peer's shape per model; V is the fortunes BPE's size (keel tokenize's default).
MODELS = {
    "d4": dict(title="the default job (d4: L4 C256 H4, B=16, T=128, V=8192)", sets=[],
               L=4, C=256, H=4, V=8192, maxT=256, B=16, T=128),
    "124m": dict(title="GPT-2 124M (L12 C768 H12, B=4, T=64, V=8192)",
                 sets=["model.preset=gpt2-124m", "train.batch_size=4", "train.seq_len=64"],
                 L=12, C=768, H=12, V=8192, maxT=1024, B=4, T=64),
}
EARLY = (10, 40)  # 1-based steps, inclusive
STEADY = 50       # the last this many steps
CLEARED_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GLIBC_TUNABLES", "MKL_NUM_THREADS",
               "OPENBLAS_CORETYPE")
TUNED_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "2",
             "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"}
# OpenBLAS's kernels for CPUs without AVX2: what it falls back to on a CPU it does not know
# (the set prepare_compute_environment in src/kernels/cpu/blas.cpp recognises).
OLD_OPENBLAS_CORES = {"Katmai", "Coppermine", "Northwood", "Prescott", "Banias", "Atom", "Core2", "Penryn",
                      "Dunnington", "Nehalem", "Opteron", "Opteron(SSE3)", "Barcelona", "Nano", "Sandybridge",
                      "Bobcat", "Bulldozer", "Piledriver"}


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def vendor_is_amd():
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)


def openblas_coretype():
    """(core Debian's OpenBLAS picks here, OPENBLAS_CORETYPE to set or None): the family Keel's
    vector_kernel_family (src/core/cpu.cpp) names, where OpenBLAS falls back to older kernels."""
    name = ctypes.util.find_library("openblas")
    if name is None:
        return "no OpenBLAS", None
    lib = ctypes.CDLL(name)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    core = lib.openblas_get_corename().decode()
    if os.environ.get("OPENBLAS_CORETYPE"):
        core += " (OPENBLAS_CORETYPE in this shell: cleared for the runs)"
    flags = cpu_flags()
    amd = vendor_is_amd()
    if {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"} <= flags and not amd:
        family = "Cooperlake" if "avx512_bf16" in flags else "SkylakeX"
    elif {"avx2", "fma"} <= flags:
        family = "Zen" if amd else "Haswell"
    else:
        family = None
    return core, (family if core.split()[0] in OLD_OPENBLAS_CORES else None)


def matrix_engine():
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "AMX (amx_bf16) and AVX512_BF16"
    if "avx512_bf16" in flags:
        return "AVX512_BF16, no AMX"
    return "no bf16 instructions (Keel's bf16 is emulated: bf16's numbers without its speed)"


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update(extra or {})
    return env


def load_avg():
    return round(os.getloadavg()[0], 2)


def default_job():
    with open(os.path.join(ROOT, "configs", "default.toml"), "rb") as f:
        return tomllib.load(f)


def median_window(step_ms, first, last):
    """Median of steps first..last (1-based, inclusive) of step_ms (step 1 first)."""
    xs = step_ms[first - 1:last]
    return statistics.median(xs) if xs else float("nan")


def run(cmd, env, log_path, who):
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return rc


def fail(who, cmd, log_path):
    with open(log_path) as f:
        tail = f.read()[-2500:]
    sys.exit("steady_state.py: %s failed: %s\n%s" % (who, " ".join(cmd), tail))


def keel_run(a, model, engine, precision, work, rep):
    m = MODELS[model]
    run_dir = os.path.join(work, "%s-%s-%d" % (model, engine, rep))
    sets = m["sets"] + ["train.run_dir=" + run_dir, "train.steps=%d" % a.steps, "runtime.precision=" + precision]
    if engine == "keel-noflush":
        sets.append("runtime.flush_denormals=false")
    cmd = [a.keel, "train"] + [x for s in sets for x in ("--set", s)]
    log = run_dir + ".log"
    rc, cpu_at_step = run_sampling_cpu(cmd, clean_env(), log, os.path.join(run_dir, "metrics.jsonl"))
    if rc != 0:
        fail(engine, cmd, log)
    step_ms, val_loss, params, rss = [], None, None, 0.0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "event" not in j and "loss" in j and "ms" in j:
                step_ms.append(j["ms"])
                rss = max(rss, j.get("peak_rss_mb", 0.0))
            if "val_loss" in j:
                val_loss = j["val_loss"]
            if j.get("event") == "run":
                params = j["model"]["parameters"]
    shutil.rmtree(run_dir, ignore_errors=True)
    with open(log) as f:  # Keel's start-up line naming its bf16 engine, where it runs in bf16
        engine_line = next((l.strip() for l in f if l.startswith("keel: precision")), "keel train")
    steps = sorted(cpu_at_step)
    step_cpu_ms = [cpu_at_step[b] - cpu_at_step[a_] for a_, b in zip(steps, steps[1:]) if b == a_ + 1]
    if len(step_cpu_ms) == len(step_ms) - 1:  # step 1's start is not seen: its CPU time is unknown
        step_cpu_ms = [float("nan")] + step_cpu_ms
    else:
        step_cpu_ms = []
    return {"step_ms": step_ms, "step_cpu_ms": step_cpu_ms, "val_loss": val_loss, "params": params,
            "peak_rss_mb": rss, "note": engine_line}


def process_cpu_ms(pid):
    """CPU time (user + system, all threads) of a running process, from /proc."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def run_sampling_cpu(cmd, env, log_path, metrics_path):
    """Runs `keel train`, reading its metrics.jsonl as it grows: at each new step line, the
    process's CPU time so far (sampled every 20 ms, at /proc's 10 ms resolution). Returns (exit
    code, {step: CPU ms}). CPU time per step is less sensitive than wall time to other load."""
    cpu_at_step, pos, buf = {}, 0, b""
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while True:
            finished = p.poll() is not None
            try:
                cpu = process_cpu_ms(p.pid)
            except (OSError, IndexError, ValueError):
                cpu = None
            try:
                with open(metrics_path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos += len(chunk)
                buf += chunk
            except FileNotFoundError:
                pass
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                j = json.loads(line)
                if cpu is not None and not finished and "event" not in j and "loss" in j and "ms" in j:
                    cpu_at_step[j["step"]] = cpu
            if finished:
                return p.returncode, cpu_at_step
            time.sleep(0.02)


def torch_run(a, model, py, precision, compile_ok, work, rep, job, coretype):
    m = MODELS[model]
    o = job["optim"]
    cmd = [py, PEER, "--layers", str(m["L"]), "--channels", str(m["C"]), "--heads", str(m["H"]),
           "--vocab", str(m["V"]), "--max-seq", str(m["maxT"]), "--batch", str(m["B"]), "--seq", str(m["T"]),
           "--steps", str(a.steps), "--warmup-steps", "0", "--threads", "2",
           "--data", DATA["train"], "--data-order", "sequences" if job["data"]["shuffle"] else "file",
           "--val", DATA["val"], "--eval-batches", str(job["train"]["eval_batches"]),
           "--lr", str(o["lr"]), "--lr-warmup", str(o["warmup_steps"]), "--min-lr-ratio", str(o["min_lr_ratio"]),
           "--weight-decay", str(o["weight_decay"]), "--seed", str(job["train"]["seed"]), "--flush-denormal"]
    if precision == "bf16":
        cmd.append("--bf16")
    env = clean_env(TUNED_ENV)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    log = os.path.join(work, "%s-torch-%d-%s.log" % (model, rep, os.path.basename(py)))
    note = ""
    if compile_ok:
        if run(cmd + ["--compile"], env, log, py) == 0:
            return parse_peer(log), "compiled"
        with open(log) as f:
            lines = [l for l in f.read().splitlines() if l.strip()]
        note = "torch.compile failed (%s); eager" % (lines[-1][:120] if lines else "no output")
        print("  " + note, file=sys.stderr)
    if run(cmd, env, log, py) != 0:
        fail("PyTorch (%s)" % py, cmd, log)
    return parse_peer(log), note or "eager"


def parse_peer(log):
    with open(log) as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    r = json.loads(lines[-1])
    return {"step_ms": r["step_ms"], "step_cpu_ms": r.get("step_cpu_ms", []), "val_loss": r.get("val_loss"), "params": r["params"],
            "peak_rss_mb": r["peak_rss_mb"], "torch": r["torch"]}


def torch_version(py):
    p = subprocess.run([py, "-c", "import torch; print(torch.__version__, hasattr(torch, 'compile'))"],
                       capture_output=True, text=True, env=clean_env())
    if p.returncode != 0:
        return None, False
    version, has_compile = p.stdout.split()
    return version, has_compile == "True"


def measure(a):
    job = default_job()
    for path in DATA.values():
        if not os.path.exists(os.path.join(ROOT, path)):
            print("steady_state.py: %s not found; tokenizing the fortunes corpus (keel tokenize)" % path,
                  file=sys.stderr)
            cmd = [a.keel, "tokenize"]
            log = os.path.join(a.work, "tokenize.log")
            if run(cmd, clean_env(), log, "keel tokenize") != 0:
                fail("keel tokenize", cmd, log)
            break
    core, coretype = openblas_coretype()
    peers = []
    for py in a.peers:
        version, has_compile = torch_version(py)
        if version is None:
            print("steady_state.py: %s has no torch; skipped" % py, file=sys.stderr)
            continue
        peers.append((py, version, has_compile))
    header = {"header": True, "cpu": cpu_name(), "matrix_engine": matrix_engine(), "openblas_core": core,
              "openblas_coretype": coretype, "peers": [{"python": p, "torch": v, "compile": c} for p, v, c in peers],
              "steps": a.steps, "precision": a.precision}
    runs = [header]
    precisions = ["fp32", "bf16"] if a.precision == "bf16" else ["fp32"]
    for model in a.models:
        for rep in range(1, a.repeats + 1):
            # The contrast without flushing last: a bench cut short keeps the comparison with the peers.
            plan = ([("keel", p) for p in precisions if not a.no_keel] + [(pe, p) for p in precisions for pe in peers] +
                    ([("keel-noflush", "fp32")] if a.denormals else []))
            for engine, precision in plan:
                before = load_avg()
                if isinstance(engine, str):
                    name = engine if precision == "fp32" else engine + "-bf16"
                    print("  [%s %d/%d] %s ..." % (model, rep, a.repeats, name), file=sys.stderr, flush=True)
                    r = keel_run(a, model, engine, precision, a.work, rep)
                    r.update(impl="keel")
                else:
                    py, version, has_compile = engine
                    name = "torch-%s%s" % (version, "" if precision == "fp32" else "-autocast-bf16")
                    print("  [%s %d/%d] %s ..." % (model, rep, a.repeats, name), file=sys.stderr, flush=True)
                    r, note = torch_run(a, model, py, precision, has_compile, a.work, rep, job, coretype)
                    r.update(impl="torch", note=note)
                r.update(model=model, engine=name, precision=precision, rep=rep, load_before=before,
                         load_after=load_avg())
                steady = median_window(r["step_ms"], len(r["step_ms"]) - STEADY + 1, len(r["step_ms"]))
                print("    steady %.1f ms/step, early %.1f, load %.2f -> %.2f"
                      % (steady, median_window(r["step_ms"], *EARLY), before, r["load_after"]),
                      file=sys.stderr, flush=True)
                runs.append(r)
                if a.out:
                    with open(a.out, "w") as f:  # rewritten after every run: a long bench keeps what it measured
                        f.write("".join(json.dumps(x) + "\n" for x in runs))
    return runs


def report(runs):
    headers = [r for r in runs if r.get("header")]
    if not headers:
        sys.exit("steady_state.py: no header line among the runs: not written by --out")
    peers = {(p["python"], p["torch"]): p for h in headers for p in h["peers"]}
    header = dict(headers[0], peers=list(peers.values()))
    runs = [r for r in runs if not r.get("header")]
    print("cpu: %s; matrix engine: %s" % (header["cpu"], header["matrix_engine"]))
    print("OpenBLAS (Debian's) picks %s%s" % (header["openblas_core"], "; the peers run with OPENBLAS_CORETYPE=%s"
                                              % header["openblas_coretype"] if header["openblas_coretype"] else ""))
    print("PyTorch found: " + ("; ".join("%s at %s (torch.compile %s)" % (p["torch"], p["python"],
                                                                         "tried" if p["compile"] else "absent")
                                         for p in header["peers"]) or "none"))
    print("mode: steady state, %d steps on the fortunes shards, median of the last %d steps (\"steady\") beside "
          "steps %d-%d (\"early\")" % (header["steps"], STEADY, EARLY[0], EARLY[1]))
    verdicts = []
    for model in [m for m in MODELS if any(r["model"] == m for r in runs)]:
        rs = [r for r in runs if r["model"] == model]
        best, steadies = {}, {}
        for r in rs:
            n = len(r["step_ms"])
            r["steady"] = median_window(r["step_ms"], n - STEADY + 1, n)
            r["early"] = median_window(r["step_ms"], *EARLY)
            cpu = r.get("step_cpu_ms") or []
            r["steady_cpu"] = median_window(cpu, len(cpu) - STEADY + 1, len(cpu)) if cpu else float("nan")
            r["early_cpu"] = median_window(cpu, *EARLY) if cpu else float("nan")
            steadies.setdefault(r["engine"], []).append(r["steady"])
            if r["engine"] not in best or r["steady"] < best[r["engine"]]["steady"]:
                best[r["engine"]] = r
        m = MODELS[model]
        print()
        print("=== %s: %d steps, best of %d interleaved runs, 2 threads each ==="
              % (m["title"], len(rs[0]["step_ms"]), max(r["rep"] for r in rs)))
        print("%-28s %9s %9s %7s %9s %9s %9s %8s %11s  %-22s %s"
              % ("engine", "early ms", "steady ms", "st/ea", "tok/s", "CPU ms", "val loss", "RSS MB", "Keel fp32/",
                 "all runs' steady ms", "load before/after; how"))
        keel = best.get("keel")
        for name, r in best.items():
            tps = m["B"] * m["T"] * 1000.0 / r["steady"]
            ratio = ("%.2fx %.2fx" % (r["steady"] / keel["steady"], r["steady_cpu"] / keel["steady_cpu"])
                     if keel and name != "keel" else "")
            print("%-28s %9.1f %9.1f %7.2f %9.1f %9.1f %9s %8.0f %11s  %-22s %.1f/%.1f; %s"
                  % (name, r["early"], r["steady"], r["steady"] / r["early"], tps, r["steady_cpu"],
                     "%.4f" % r["val_loss"] if r["val_loss"] is not None else "-", r["peak_rss_mb"], ratio,
                     " ".join("%.1f" % x for x in steadies[name]), r["load_before"], r["load_after"], r["note"]))
        params = {name: r["params"] for name, r in best.items() if r["params"]}
        if len(set(params.values())) > 1:
            print("parameters differ: " + ", ".join("%s %d" % kv for kv in params.items()))
        for precision in ("fp32", "bf16"):
            k = best.get("keel" if precision == "fp32" else "keel-bf16")
            peers = [r for r in best.values() if r["impl"] == "torch" and r["precision"] == precision]
            if k is None or not peers:
                continue
            top = min(peers, key=lambda r: r["steady"])
            ratio = top["steady"] / k["steady"]
            verdicts.append("%-4s  %-10s Keel %s >= 1.3x the best PyTorch %s at steady state: %.2fx (%.1f vs %s %.1f ms/step;"
                            " CPU time per step %.2fx)"
                            % ("PASS" if ratio >= 1.3 else "MISS", model, precision,
                               "fp32" if precision == "fp32" else "autocast(bf16)", ratio, k["steady"],
                               top["engine"], top["steady"], top["steady_cpu"] / k["steady_cpu"]))
        if "keel" in best and "keel-bf16" in best:
            verdicts.append("INFO  %-10s Keel bf16 / fp32 at steady state: %.2fx"
                            % (model, best["keel"]["steady"] / best["keel-bf16"]["steady"]))
        for name in ("keel", "keel-noflush"):
            if name in best:
                # Judged by CPU time where it was recorded: a change of the machine's load during
                # the run moves wall time, not the work a step does.
                r = best[name]
                drift, drift_cpu = r["steady"] / r["early"], r["steady_cpu"] / r["early_cpu"]
                judged = drift_cpu if drift_cpu == drift_cpu else drift
                verdicts.append("%-4s  %-10s %s steady within 10 %% of early (no denormal slowdown): CPU time %.2f (%.0f vs %.0f ms),"
                                " wall time %.2f (%.1f vs %.1f ms), val loss %s"
                                % (("PASS" if abs(judged - 1) <= 0.10 else "MISS") if name == "keel" else "INFO",
                                   model, name, drift_cpu, r["steady_cpu"], r["early_cpu"], drift, r["steady"], r["early"],
                                   "%.4f" % r["val_loss"] if r["val_loss"] is not None else "-"))
    print()
    print("=== Verdicts ===")
    print("\n".join(verdicts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(MODELS), help="one model (default: d4 and 124m)")
    ap.add_argument("--steps", type=int, default=300, help="steps per run (>= 90: steps 10-40 and the last 50 apart)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of every engine; the best is reported")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: every engine in float32 and in bf16 (Keel's bf16 products, PyTorch's autocast)")
    ap.add_argument("--denormals", action="store_true", help="also Keel with runtime.flush_denormals=false")
    ap.add_argument("--no-keel", action="store_true",
                    help="leave out Keel's runs (with --denormals, only the one without flushing): to run the engines "
                         "as separate processes and print them together with --report FILE,FILE,...")
    ap.add_argument("--peers", default=None,
                    help="Pythons with torch, comma-separated (default: /usr/bin/python3 and bench/.venv/bin/python)")
    ap.add_argument("--out", help="write every run's JSON line here (after each run)")
    ap.add_argument("--report", help="measure nothing; print the tables from files written by --out (comma-separated)")
    a = ap.parse_args()
    if a.report:
        runs = []
        for path in a.report.split(","):
            try:
                with open(path) as f:
                    runs += [json.loads(l) for l in f if l.strip()]
            except (OSError, ValueError) as e:
                sys.exit("steady_state.py: --report %s: expected the JSON lines of --out, %s" % (path, e))
        report(runs)
        return 0
    if a.steps < 90:
        sys.exit("steady_state.py: --steps %d: expected at least 90 (steps 10-40 and the last 50 apart)" % a.steps)
    if a.repeats < 1:
        sys.exit("steady_state.py: --repeats %d: expected at least 1" % a.repeats)
    a.models = [a.only] if a.only else ["d4", "124m"]
    a.keel = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
    if not os.access(a.keel, os.X_OK):
        sys.exit("steady_state.py: %s not found; build it: bash scripts/build.sh" % a.keel)
    if a.peers is None:
        a.peers = [p for p in ("/usr/bin/python3", os.path.join(ROOT, "bench", ".venv", "bin", "python"))
                   if os.access(p, os.X_OK)]
    else:
        a.peers = [p for p in a.peers.split(",") if p]
    a.work = tempfile.mkdtemp(prefix="keel-steady-")
    try:
        runs = measure(a)
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    report(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
