#!/usr/bin/env bash
# Keel data parallel vs PyTorch DDP, side by side, on this machine, in one invocation.
#
# For a small GPT (L4 C256 H4, per-rank B=8, T=128) and GPT-2 124M (L12 C768 H12, per-rank B=4,
# T=64), both with vocab 50304, on random tokens, runs four trainers with 1 thread per rank:
#   keel1   OMP_NUM_THREADS=1 build/keel launch -n 1 -- train ...   (1 rank)
#   keel2   OMP_NUM_THREADS=1 build/keel launch -n 2 -- train ...   (2 ranks, MPI all-reduce)
#   torch1  bench/torch_ddp_train.py --world 1 --threads 1          (1 process, no DDP)
#   ddp2    bench/torch_ddp_train.py --world 2 --threads 1          (DistributedDataParallel, gloo)
# PyTorch runs in its tuned environment, its best setting on this machine (bench/compare_pytorch.sh,
# /work/shared/PERF-NOTES.md): OMP_WAIT_POLICY=PASSIVE, OPENBLAS_NUM_THREADS=1 and
# GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736; DDP with
# gradient_as_bucket_view=True and the default 25 MB buckets. Keel runs in a clean environment
# (its launcher sets OMP_WAIT_POLICY=PASSIVE itself).
# Runs are interleaved (keel1, keel2, torch1, ddp2, keel1, ...) and repeated R times; the run with
# the best tokens/s of each trainer is reported, so machine noise hurts all four alike.
#
# Keel's figures come from rank 0's run_dir/metrics.jsonl, over the steps after the warm-up ones:
# tokens/s = mean of the per-step (global) tokens_per_s; ms/step = mean ms; exposed communication
# share = mean sync_exposed_ms / mean ms; jitter = std/mean of sync_latency_ms over those steps.
# Keel's peak RSS per rank is each rank process's VmHWM (/proc/PID/status), read every 0.2 s
# while it runs. PyTorch's: each rank's getrusage maxrss. Scaling efficiency =
# tokens/s at 2 ranks / (2 x tokens/s at 1 rank), each trainer against its own 1-rank run.
# Prints a table per model and a PASS/MISS line per target. Exits 0 whatever the verdicts;
# non-zero only when a run fails or prints no result.
#
# Usage: bench/compare_dp.sh [--steps N] [--warmup N] [--repeats R] [--only small|124m] [--out FILE]
#        bench/compare_dp.sh --report FILE
#   --steps N     timed steps per run (default: 4 for 124M, 8 for small)
#   --warmup N    untimed steps before timing (default 2)
#   --repeats R   runs of each trainer per model; best tokens/s is kept (default 2)
#   --only M      run one model only: small or 124m
#   --out FILE    also write every run's result JSON line (tagged with model, impl, rep) to FILE
#   --report FILE run nothing; print the tables and verdicts again from a file written by --out
# Environment: KEEL (default build/keel), PYTHON (default /usr/bin/python3),
#              RUN_TIMEOUT (seconds one run may take before it counts as failed, default 1200).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL=${KEEL:-$ROOT/build/keel}
PYTHON=${PYTHON:-/usr/bin/python3}
PEER=$ROOT/bench/torch_ddp_train.py
RUN_TIMEOUT=${RUN_TIMEOUT:-1200}

steps="" warmup=2 repeats=2 only="" out="" report=""
usage() { sed -n '/^# Usage:/,/^# Environment:/p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps)   steps=${2:?}; shift 2 ;;
    --warmup|--warmup-steps) warmup=${2:?}; shift 2 ;;
    --repeats) repeats=${2:?}; shift 2 ;;
    --only)    only=${2:?}; shift 2 ;;
    --out)     out=${2:?}; shift 2 ;;
    --report)  report=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_dp.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for v in "$warmup" "$repeats" ${steps:+"$steps"}; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "compare_dp.sh: '$v' is not a number" >&2; exit 2; }
done
(( repeats >= 1 )) || { echo "compare_dp.sh: --repeats must be >= 1" >&2; exit 2; }
[[ -z "$steps" ]] || (( steps >= 1 )) || { echo "compare_dp.sh: --steps must be >= 1" >&2; exit 2; }
case "$only" in
  "") models=(small 124m) ;;
  small|124m) models=("$only") ;;
  *) echo "compare_dp.sh: --only takes small or 124m" >&2; exit 2 ;;
esac
[[ -z "$report" || -r "$report" ]] || { echo "compare_dp.sh: cannot read $report" >&2; exit 1; }
[[ -n "$report" || -x "$KEEL" ]] || { echo "compare_dp.sh: $KEEL not found; build it: make -C build keel" >&2; exit 1; }
[[ -n "$report" ]] || command -v mpirun > /dev/null || { echo "compare_dp.sh: mpirun not found (keel launch needs openmpi-bin)" >&2; exit 1; }
[[ -x "$PYTHON" ]] || { echo "compare_dp.sh: $PYTHON not found" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-compare-dp.XXXXXX")
trap 'rm -rf "$work"' EXIT
raw=$work/raw.jsonl
: > "$raw"

# Environment variables that change any trainer's speed; cleared first so every run starts from
# the same place, then each run sets its own.
CLEAN_ENV=(env -u OMP_WAIT_POLICY -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS -u GLIBC_TUNABLES -u MKL_NUM_THREADS
           -u GLOO_SOCKET_IFNAME -u MASTER_ADDR -u MASTER_PORT)
KEEL_ENV=(OMP_NUM_THREADS=1)
TUNED_ENV=(OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=1
           GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736)

# Keel's runner: starts `keel launch ...`, sends its output to stderr, records each rank's peak
# RSS while it runs, and prints one JSON line summarising run_dir/metrics.jsonl.
cat > "$work/keel_run.py" <<'EOF'
import json, os, subprocess, sys, time
run_dir, warmup, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
keel = os.path.realpath(cmd[0])

def rank_processes():
    """{pid: rank} of this run's `keel train` processes (matched by binary and run_dir)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if len(argv) < 2 or argv[1] != "train" or os.path.basename(argv[0]) != "keel":
                continue
            if not any(run_dir in a for a in argv):
                continue
            with open("/proc/%s/environ" % pid, "rb") as f:
                env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
            found[int(pid)] = int(env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK", "-1")))
        except (OSError, ValueError):
            pass
    return found

def vm_hwm_kb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None

proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
peak = {}  # rank -> kB
ranks = {}
while proc.poll() is None:
    ranks.update(rank_processes())
    for pid, rank in ranks.items():
        kb = vm_hwm_kb(pid)
        if kb is not None:
            peak[rank] = max(peak.get(rank, 0), kb)
    time.sleep(0.2)
if proc.returncode != 0:
    sys.exit("keel exited with status %d" % proc.returncode)

steps = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
steps = [s for s in steps if "tokens_per_s" in s]
timed = [s for s in steps if s["step"] > warmup]
if not timed:
    sys.exit("metrics.jsonl has no steps after the %d warm-up steps" % warmup)
mean = lambda xs: sum(xs) / len(xs)
r = {
    "tokens_per_s": round(mean([s["tokens_per_s"] for s in timed]), 1),
    "ms_per_step": round(mean([s["ms"] for s in timed]), 2),
    # PyTorch's definition (all timed tokens / all timed time), for reference:
    "tokens_per_s_total": round(sum(s["tokens_per_s"] * s["ms"] for s in timed) / sum(s["ms"] for s in timed), 1),
    "peak_rss_mb": round(max(peak.values()) / 1024, 1) if peak else 0.0,
    "peak_rss_mb_per_rank": [round(peak[k] / 1024, 1) for k in sorted(peak)],
    "world": steps[-1].get("ranks", 1),
    "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
    "final_loss": round(steps[-1]["loss"], 6),
    "step_ms": [round(s["ms"], 1) for s in timed],
}
if "sync_exposed_ms" in timed[0]:
    lat = [s["sync_latency_ms"] for s in timed]
    m = mean(lat)
    r.update({
        "sync_exposed_ms": round(mean([s["sync_exposed_ms"] for s in timed]), 2),
        "sync_exposed_share": mean([s["sync_exposed_ms"] for s in timed]) / mean([s["ms"] for s in timed]),
        "sync_latency_ms": round(m, 2),
        "sync_jitter": (mean([(x - m) ** 2 for x in lat]) ** 0.5 / m) if m > 0 else 0.0,
        "sync_jitter_keel": steps[-1]["sync_jitter"],  # Keel's own: over its last <= 20 steps, warm-up included
        "sync_sent_mb": round(mean([s["sync_sent_bytes"] for s in timed]) / 1e6, 1),
        "step_exposed_ms": [round(s["sync_exposed_ms"], 1) for s in timed],
        "step_latency_ms": [round(s["sync_latency_ms"], 1) for s in timed],
    })
print(json.dumps(r))
EOF

# run_one MODEL IMPL REP CMD...: runs CMD, takes the last line of its stdout as the result,
# tags it and appends it to $raw. Any failure stops the script.
run_one() {
  local model=$1 impl=$2 rep=$3; shift 3
  local log=$work/$model-$impl-$rep
  printf '  [%s %d/%d] %-6s ... ' "$model" "$rep" "$repeats" "$impl" >&2
  if ! timeout -k 10 "$RUN_TIMEOUT" "$@" > "$log.out" 2> "$log.err"; then
    echo "FAILED" >&2
    echo "compare_dp.sh: $impl run failed for $model: $*" >&2
    tail -n 20 "$log.err" >&2
    exit 1
  fi
  "$PYTHON" - "$log.out" "$model" "$impl" "$rep" "$n" "$warmup" >> "$raw" <<'EOF' || { echo "compare_dp.sh: $impl printed no JSON result for $model" >&2; cat "$log.out" "$log.err" >&2; exit 1; }
import json, sys
path, model, impl, rep, steps, warmup = sys.argv[1:]
lines = [l for l in open(path).read().splitlines() if l.strip()]
try:
    r = json.loads(lines[-1])
except (IndexError, ValueError):
    sys.exit("no JSON line")
tagged = {"model": model, "impl": impl, "rep": int(rep), "steps": int(steps), "warmup_steps": int(warmup)}
tagged.update(r)
print(json.dumps(tagged))
extra = ", exposed comm %.1f %%" % (100 * r["sync_exposed_share"]) if "sync_exposed_share" in r else ""
sys.stderr.write("%.1f tok/s, %.0f ms/step, %s MB%s\n" % (r["tokens_per_s"], r["ms_per_step"],
                 "/".join("%.0f" % x for x in r["peak_rss_mb_per_rank"]), extra))
EOF
  rm -rf "$work/run"
}

if [[ -z "$report" ]]; then
  # Random tokens in llm.c's shard format: 256 int32 header (magic, version, count), then uint16.
  "$PYTHON" - "$work/tokens.bin" <<'EOF'
import array, random, sys
n = 1 << 20
header = array.array("i", [0] * 256)
header[0], header[1], header[2] = 20240520, 1, n
rng = random.Random(1234)
tokens = array.array("H", (rng.randrange(50304) for _ in range(n)))
with open(sys.argv[1], "wb") as f:
    header.tofile(f)
    tokens.tofile(f)
EOF
fi

[[ -z "$report" ]] || models=()  # --report: no runs
for model in "${models[@]}"; do
  if [[ $model == 124m ]]; then L=12 C=768 H=12 B=4 T=64 preset=gpt2-124m n=${steps:-4}
  else                          L=4  C=256 H=4  B=8 T=128 preset=small    n=${steps:-8}
  fi
  echo "$model: L$L C$C H$H per-rank B=$B T=$T V=50304, $n timed + $warmup warm-up steps, $repeats repeats, 1 thread per rank" >&2
  keel_train=(train --set model.preset=$preset --set model.vocab_size=50304 --set model.max_seq_len=$T
              --set data.train="$work/tokens.bin" --set data.val="$work/tokens.bin" --set data.tokenizer=
              --set train.batch_size=$B --set train.seq_len=$T --set train.steps=$((n + warmup))
              --set train.eval_batches=1 --set train.eval_every=0 --set train.sample_tokens=0
              --set train.checkpoint_every=0 --set train.log_every=1 --set runtime.peak_gflops=100
              --set train.run_dir="$work/run")
  peer=("$PYTHON" "$PEER" --layers $L --channels $C --heads $H --vocab 50304 --batch $B --seq $T
        --steps "$n" --warmup-steps "$warmup" --threads 1)
  for ((rep = 1; rep <= repeats; rep++)); do
    for ranks in 1 2; do
      run_one "$model" keel$ranks "$rep" "${CLEAN_ENV[@]}" "${KEEL_ENV[@]}" \
        "$PYTHON" "$work/keel_run.py" "$work/run" "$warmup" "$KEEL" launch -n $ranks -- "${keel_train[@]}"
    done
    run_one "$model" torch1 "$rep" "${CLEAN_ENV[@]}" "${TUNED_ENV[@]}" "${peer[@]}" --world 1
    run_one "$model" ddp2   "$rep" "${CLEAN_ENV[@]}" "${TUNED_ENV[@]}" "${peer[@]}" --world 2
  done
done
if [[ -n "$report" ]]; then raw=$report; else echo >&2; fi
[[ -z "$out" || -n "$report" ]] || cp "$raw" "$out"

"$PYTHON" - "$raw" <<'EOF'
import json, sys

runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
SHAPES = {"small": ("small", "L4 C256 H4, per-rank B=8, T=128, V=50304"),
          "124m": ("GPT-2 124M", "L12 C768 H12, per-rank B=4, T=64, V=50304")}
IMPLS = ("keel1", "keel2", "torch1", "ddp2")
LABEL = {"keel1": "Keel 1 rank x 1 thread", "keel2": "Keel 2 ranks x 1 thread",
         "torch1": "PyTorch 1 proc x 1 thread", "ddp2": "PyTorch DDP 2 x 1 thread"}
EXPOSED_TARGET = 0.10

verdicts = []
def verdict(ok, text):
    verdicts.append("%-4s  %s" % ("PASS" if ok else "MISS", text))

for model in [m for m in SHAPES if any(r["model"] == m for r in runs)]:
    name, shape = SHAPES[model]
    best, alltps = {}, {}
    for impl in IMPLS:
        rs = [r for r in runs if r["model"] == model and r["impl"] == impl]
        best[impl] = max(rs, key=lambda r: r["tokens_per_s"])
        alltps[impl] = [r["tokens_per_s"] for r in rs]
    k1, k2, t1, d2 = (best[i] for i in IMPLS)
    eff = {"keel2": k2["tokens_per_s"] / (2 * k1["tokens_per_s"]),
           "ddp2": d2["tokens_per_s"] / (2 * t1["tokens_per_s"])}
    print("=== %s (%s): %d timed + %d warm-up steps, best of %d interleaved runs ==="
          % (name, shape, k1["steps"], k1["warmup_steps"], len(alltps["keel1"])))
    print("PyTorch in its tuned environment (OMP_WAIT_POLICY=PASSIVE, OPENBLAS_NUM_THREADS=1, glibc malloc"
          " tunables), DDP over gloo with gradient_as_bucket_view")
    print("%-27s %10s %10s %8s %10s  %s" % ("", "tokens/s", "ms/step", "scaling", "Keel/peer", "peak RSS MB per rank"))
    for impl in IMPLS:
        r = best[impl]
        scaling = "%.2f" % eff[impl] if impl in eff else ""
        peer = {"keel1": t1, "keel2": d2}.get(impl)
        ratio = "%.2fx" % (r["tokens_per_s"] / peer["tokens_per_s"]) if peer else ""
        print("%-27s %10.1f %10.1f %8s %10s  %s" % (LABEL[impl], r["tokens_per_s"], r["ms_per_step"], scaling, ratio,
                                                 " / ".join("%.0f" % x for x in r["peak_rss_mb_per_rank"])))
    print("Keel 2-rank sync:  exposed %.1f ms of a %.1f ms step = %.1f %%; all-reduce latency %.1f ms, jitter %.0f %%"
          " (std/mean over timed steps; Keel's own rolling figure %.0f %%); %.1f MB sent per step"
          % (k2["sync_exposed_ms"], k2["ms_per_step"], 100 * k2["sync_exposed_share"], k2["sync_latency_ms"],
             100 * k2["sync_jitter"], 100 * k2["sync_jitter_keel"], k2["sync_sent_mb"]))
    print("  per timed step:  ms %s; exposed ms %s; latency ms %s"
          % (" ".join("%.0f" % x for x in k2["step_ms"]), " ".join("%.1f" % x for x in k2["step_exposed_ms"]),
             " ".join("%.0f" % x for x in k2["step_latency_ms"])))
    tot_eff = k2["tokens_per_s_total"] / (2 * k1["tokens_per_s_total"])
    print("Keel tokens/s as total tokens / total time (PyTorch's definition): 1 rank %.1f, 2 ranks %.1f, scaling %.2f"
          % (k1["tokens_per_s_total"], k2["tokens_per_s_total"], tot_eff))
    print("all runs tok/s:    " + "; ".join("%s %s" % (i, " ".join("%.1f" % x for x in alltps[i])) for i in IMPLS))
    print("final loss:        " + ", ".join("%s %.3f" % (i, best[i]["final_loss"]) for i in IMPLS)
          + "; threads per rank %s" % "/".join(str(best[i]["threads"]) for i in IMPLS))
    print()
    verdict(eff["keel2"] >= eff["ddp2"], "%-10s Keel scaling efficiency >= PyTorch DDP's: %.2f vs %.2f"
            % (name, eff["keel2"], eff["ddp2"]))
    if model == "124m":
        verdict(k2["sync_exposed_share"] < EXPOSED_TARGET, "%-10s Keel exposed comm < %d %% of step: %.1f %% (%.1f of %.1f ms)"
                % (name, 100 * EXPOSED_TARGET, 100 * k2["sync_exposed_share"], k2["sync_exposed_ms"], k2["ms_per_step"]))

print("=== Verdicts ===")
print("\n".join(verdicts))
EOF
