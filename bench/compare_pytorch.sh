#!/usr/bin/env bash
# Keel vs PyTorch, side by side, on this machine, in one invocation. Two modes:
#
# --steady (the mode the README's headline quotes): bench/steady_state.py. `keel train` as users
# run it against PyTorch 1.13 and the current PyTorch (bench/.venv), each at its best, on the
# fortunes shards the default job trains on, 300 steps, the median of the last 50 steps; the
# default job's model (d4) and GPT-2 124M's shape. See that script's docstring.
#
# Without --steady, from initialisation (quick): for GPT-2 124M (L12 C768 H12, B=4, T=64) and a small GPT (L4 C256 H4, B=8, T=128), both with
# vocab 50304, runs three trainers on random tokens and times whole optimizer steps:
#   keel   build/bench/keel_bench_train, runtime.threads=2
#   stock  bench/torch_gpt2_train.py --threads 2, default environment
#   tuned  bench/torch_gpt2_train.py --threads 2 --flush-denormal with OMP_WAIT_POLICY=PASSIVE,
#          OPENBLAS_NUM_THREADS=2, GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
#          and OPENBLAS_CORETYPE where Debian's OpenBLAS falls back to older kernels than the CPU's
# Runs are interleaved (keel, stock, tuned, keel, stock, tuned, ...) and repeated R times; the
# run with the best tokens/s of each trainer is reported, so machine noise hurts all three alike.
# Prints a table per model and a PASS/MISS line per target. Exits 0 whatever the verdicts;
# non-zero only when a run fails or prints no result.
#
# Usage: bench/compare_pytorch.sh [--steps N] [--warmup N] [--repeats R] [--only small|124m] [--out FILE]
#        bench/compare_pytorch.sh --report FILE
#        bench/compare_pytorch.sh --steady [--steps N] [--repeats R] [--only d4|124m] [--denormals] [--out FILE]
#        bench/compare_pytorch.sh --steady --report FILE
#   --steps N     timed steps per run (default: 6 for 124M, 10 for small)
#   --warmup N    untimed steps before timing (default 2)
#   --repeats R   runs of each trainer per model; best tokens/s is kept (default 2)
#   --only M      run one model only: small or 124m
#   --out FILE    also write every run's raw JSON line (tagged with model, impl, rep) to FILE
#   --report FILE run nothing; print the tables and verdicts again from a file written by --out
#   --steady      steady state (steps default 300, repeats default 1); --denormals adds Keel with
#                 runtime.flush_denormals=false
# Environment: KEEL_BENCH (default build/bench/keel_bench_train), PYTHON (default /usr/bin/python3).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BENCH=${KEEL_BENCH:-$ROOT/build/bench/keel_bench_train}
PYTHON=${PYTHON:-/usr/bin/python3}
PEER=$ROOT/bench/torch_gpt2_train.py

steps="" warmup=2 repeats=2 only="" out="" report="" steady=""
usage() { sed -n '/^# Usage:/,/^# Environment:/p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ " $* " == *" --steady "* ]]; then  # the steady-state mode has its own runner
  args=()
  for a in "$@"; do [[ $a == --steady ]] || args+=("$a"); done
  exec "$PYTHON" "$ROOT/bench/steady_state.py" "${args[@]}"
fi
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps)   steps=${2:?}; shift 2 ;;
    --warmup|--warmup-steps) warmup=${2:?}; shift 2 ;;
    --repeats) repeats=${2:?}; shift 2 ;;
    --only)    only=${2:?}; shift 2 ;;
    --out)     out=${2:?}; shift 2 ;;
    --report)  report=${2:?}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_pytorch.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for v in "$warmup" "$repeats" ${steps:+"$steps"}; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "compare_pytorch.sh: '$v' is not a number" >&2; exit 2; }
done
(( repeats >= 1 )) || { echo "compare_pytorch.sh: --repeats must be >= 1" >&2; exit 2; }
[[ -z "$steps" ]] || (( steps >= 1 )) || { echo "compare_pytorch.sh: --steps must be >= 1" >&2; exit 2; }
case "$only" in
  "") models=(124m small) ;;
  small|124m) models=("$only") ;;
  *) echo "compare_pytorch.sh: --only takes small or 124m" >&2; exit 2 ;;
esac
[[ -z "$report" || -r "$report" ]] || { echo "compare_pytorch.sh: cannot read $report" >&2; exit 1; }
[[ -n "$report" || -x "$KEEL_BENCH" ]] || { echo "compare_pytorch.sh: $KEEL_BENCH not found; build it: make -C build keel_bench_train" >&2; exit 1; }
[[ -x "$PYTHON" ]] || { echo "compare_pytorch.sh: $PYTHON not found" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-compare.XXXXXX")
trap 'rm -rf "$work"' EXIT
raw=$work/raw.jsonl
: > "$raw"

# Environment variables that change either trainer's speed; cleared first so every run starts
# from the same place, then the tuned runs set their own.
CLEAN_ENV=(env -u OMP_WAIT_POLICY -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS -u GLIBC_TUNABLES -u MKL_NUM_THREADS)
TUNED_ENV=(OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=2
           GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736)
# The kernels Keel picks for itself where Debian's OpenBLAS falls back to older ones (an exported
# OPENBLAS_CORETYPE is kept, for every run alike).
coretype=$(cd "$ROOT/bench" && "$PYTHON" -c 'import steady_state; print(steady_state.openblas_coretype()[1] or "")')
[[ -n "${OPENBLAS_CORETYPE:-}" || -z "$coretype" ]] || TUNED_ENV+=(OPENBLAS_CORETYPE=$coretype)

# run_one MODEL IMPL REP CMD...: runs CMD, takes the last line of its stdout as the result,
# tags it and appends it to $raw. Any failure stops the script.
run_one() {
  local model=$1 impl=$2 rep=$3; shift 3
  local log=$work/$model-$impl-$rep
  printf '  [%s %d/%d] %-5s ... ' "$model" "$rep" "$repeats" "$impl" >&2
  if ! "$@" > "$log.out" 2> "$log.err"; then
    echo "FAILED" >&2
    echo "compare_pytorch.sh: $impl run failed for $model: $*" >&2
    tail -n 20 "$log.err" >&2
    exit 1
  fi
  "$PYTHON" - "$log.out" "$model" "$impl" "$rep" "$n" "$warmup" >> "$raw" <<'EOF' || { echo "compare_pytorch.sh: $impl printed no JSON result for $model" >&2; cat "$log.out" "$log.err" >&2; exit 1; }
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
sys.stderr.write("%.1f tok/s, %.0f ms/step, %.0f MB\n" % (r["tokens_per_s"], r["ms_per_step"], r["peak_rss_mb"]))
EOF
}

[[ -z "$report" ]] || models=()  # --report: no runs
for model in "${models[@]}"; do
  if [[ $model == 124m ]]; then L=12 C=768 H=12 B=4 T=64 preset=gpt2-124m n=${steps:-6}
  else                          L=4  C=256 H=4  B=8 T=128 preset=small    n=${steps:-10}
  fi
  echo "$model: L$L C$C H$H B=$B T=$T V=50304, $n timed + $warmup warm-up steps, $repeats repeats" >&2
  keel=("$KEEL_BENCH" --steps "$n" --warmup-steps "$warmup"
        --set model.preset=$preset --set model.vocab_size=50304 --set model.max_seq_len=$T
        --set train.batch_size=$B --set train.seq_len=$T --set runtime.threads=2)
  peer=("$PYTHON" "$PEER" --layers $L --channels $C --heads $H --vocab 50304 --batch $B --seq $T
        --steps "$n" --warmup-steps "$warmup" --threads 2)
  for ((rep = 1; rep <= repeats; rep++)); do
    run_one "$model" keel  "$rep" "${CLEAN_ENV[@]}" "${keel[@]}"
    run_one "$model" stock "$rep" "${CLEAN_ENV[@]}" "${peer[@]}"
    run_one "$model" tuned "$rep" "${CLEAN_ENV[@]}" "${TUNED_ENV[@]}" "${peer[@]}" --flush-denormal
  done
done
if [[ -n "$report" ]]; then raw=$report; else echo >&2; fi
[[ -z "$out" || -n "$report" ]] || cp "$raw" "$out"

"$PYTHON" - "$raw" <<'EOF'
import json, sys

raw = sys.argv[1]
runs = [json.loads(l) for l in open(raw) if l.strip()]
SHAPES = {"124m": ("GPT-2 124M", "L12 C768 H12, B=4, T=64, V=50304"),
          "small": ("small", "L4 C256 H4, B=8, T=128, V=50304")}
# Targets: Keel/stock on both, Keel/tuned per model, RSS vs stock, GEMM vs measured SGEMM.
TUNED_TARGET = {"124m": 1.0, "small": 1.3}
STOCK_TARGET, GEMM_TARGET = 1.5, 0.60
LABEL = {"keel": "Keel", "stock": "PyTorch stock", "tuned": "PyTorch tuned"}

verdicts = []
def verdict(ok, text):
    verdicts.append("%-4s  %s" % ("PASS" if ok else "MISS", text))

for model in [m for m in SHAPES if any(r["model"] == m for r in runs)]:
    name, shape = SHAPES[model]
    best, alltps = {}, {}
    for impl in ("keel", "stock", "tuned"):
        rs = [r for r in runs if r["model"] == model and r["impl"] == impl]
        best[impl] = max(rs, key=lambda r: r["tokens_per_s"])
        alltps[impl] = [r["tokens_per_s"] for r in rs]
    repeats = len(alltps["keel"])
    k, s, t = best["keel"], best["stock"], best["tuned"]
    print("=== %s (%s), from initialisation on random tokens: %d timed + %d warm-up steps, best of %d interleaved runs, 2 threads each ==="
          % (name, shape, k["steps"], k["warmup_steps"], repeats))
    print("%-15s %10s %10s %12s %9s" % ("", "tokens/s", "ms/step", "peak RSS MB", "Keel/peer"))
    for impl in ("keel", "stock", "tuned"):
        r = best[impl]
        ratio = "" if impl == "keel" else "%.2fx" % (k["tokens_per_s"] / r["tokens_per_s"])
        print("%-15s %10.1f %10.1f %12.0f %9s" % (LABEL[impl], r["tokens_per_s"], r["ms_per_step"], r["peak_rss_mb"], ratio))
    gemm_pct = k["gemm_gflops"] / k["sgemm_gflops"] if k["sgemm_gflops"] > 0 else 0.0
    print("Keel compute:   model %.1f GFLOP/s; GEMM %.1f GFLOP/s, %.1f %% of step time;"
          % (k["model_gflops"], k["gemm_gflops"], 100 * k["gemm_time_share"]))
    print("                SGEMM measured in the same run %.1f GFLOP/s -> GEMM at %.0f %% of SGEMM"
          % (k["sgemm_gflops"], 100 * gemm_pct))
    sgemm_all = [r["sgemm_gflops"] for r in runs if r["model"] == model and r["impl"] == "keel"]
    if gemm_pct > 1.0:
        print("                (GEMM above the SGEMM probe: the probe, 3 x 1024^3 at start-up, was disturbed;"
              " all runs' probes: %s GFLOP/s)" % " ".join("%.1f" % x for x in sgemm_all))
    print("all runs tok/s: " + "; ".join("%s %s" % (i, " ".join("%.1f" % x for x in alltps[i])) for i in alltps))
    print("params:         Keel %d, PyTorch %d%s; final loss Keel %.3f, stock %.3f, tuned %.3f; threads %d/%d/%d"
          % (k["params"], s["params"], "" if k["params"] == s["params"] else "  (MISMATCH)",
             k["final_loss"], s["final_loss"], t["final_loss"], k["threads"], s["threads"], t["threads"]))
    print()

    rs_, rt_ = k["tokens_per_s"] / s["tokens_per_s"], k["tokens_per_s"] / t["tokens_per_s"]
    verdict(rs_ >= STOCK_TARGET, "%-10s Keel >= %.1fx PyTorch stock:   %.2fx (%.1f vs %.1f tok/s)"
            % (name, STOCK_TARGET, rs_, k["tokens_per_s"], s["tokens_per_s"]))
    verdict(rt_ >= TUNED_TARGET[model], "%-10s Keel >= %.1fx PyTorch tuned:   %.2fx (%.1f vs %.1f tok/s)"
            % (name, TUNED_TARGET[model], rt_, k["tokens_per_s"], t["tokens_per_s"]))
    verdict(k["peak_rss_mb"] <= s["peak_rss_mb"], "%-10s Keel peak RSS <= stock's:     %.0f vs %.0f MB"
            % (name, k["peak_rss_mb"], s["peak_rss_mb"]))
    verdict(gemm_pct >= GEMM_TARGET, "%-10s GEMM >= %d %% of measured SGEMM: %.0f %% (%.1f of %.1f GFLOP/s)%s"
            % (name, 100 * GEMM_TARGET, 100 * gemm_pct, k["gemm_gflops"], k["sgemm_gflops"],
               "  [probe disturbed, see above]" if gemm_pct > 1.0 else ""))

print("=== Verdicts ===")
print("\n".join(verdicts))
EOF
