#!/usr/bin/env bash
# Keel against Keel: two builds' keel_bench_train interleaved (A B B A, R rounds) on the same machine,
# to check that a change did not move training speed. Each tree is a checkout with
# build/bench/keel_bench_train built (e.g. `git worktree add --detach ../before <commit>` and
# `cmake --build build --target keel_bench_train` there). Both run with the same environment
# (OMP_WAIT_POLICY=PASSIVE, 2 threads, and OPENBLAS_CORETYPE as the caller sets it: set it, e.g. to
# the family `keel train` names on its MFU line, when a tree predates Keel choosing OpenBLAS's kernels
# itself (before commit 1921430), so both trees run the same kernels).
# Prints one line per run (tokens/s and the load average) and the median of each tree per model.
#
# Usage: bench/ab_speed.sh TREE_A TREE_B [--rounds R] [--only small|124m]
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: bench/ab_speed.sh TREE_A TREE_B [--rounds R] [--only small|124m]" >&2; exit 2; }
a=$1 b=$2; shift 2
rounds=4 models=(small 124m)
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --only) models=("$2"); shift 2 ;;
    *) echo "bench/ab_speed.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for t in "$a" "$b"; do
  [[ -x $t/build/bench/keel_bench_train ]] || { echo "bench/ab_speed.sh: $t/build/bench/keel_bench_train not found" >&2; exit 1; }
done
PYTHON=${PYTHON:-/usr/bin/python3}
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2
raw=$(mktemp); trap 'rm -f "$raw"' EXIT
run() {  # tree model
  local args
  if [[ $2 == 124m ]]; then
    args=(--steps 5 --warmup-steps 2 --set model.preset=gpt2-124m --set model.max_seq_len=64 --set train.batch_size=4 --set train.seq_len=64)
  else
    args=(--steps 10 --warmup-steps 2 --set model.preset=small --set model.max_seq_len=128 --set train.batch_size=8 --set train.seq_len=128)
  fi
  local line
  line=$("$1/build/bench/keel_bench_train" "${args[@]}" --set model.vocab_size=50304 --set runtime.threads=2 2>/dev/null | tail -1)
  local tps
  tps=$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["tokens_per_s"])' "$line")
  echo "$2 $1 $tps $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$raw"
}
echo "model tree tokens/s load (OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset})"
for m in "${models[@]}"; do
  for ((r = 1; r <= rounds; r++)); do run "$a" "$m"; run "$b" "$m"; run "$b" "$m"; run "$a" "$m"; done
done
"$PYTHON" - "$raw" "$a" "$b" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
for m in dict.fromkeys(r[0] for r in rows):
    med = {t: statistics.median(float(r[2]) for r in rows if r[0] == m and r[1] == t) for t in sys.argv[2:4]}
    a, b = sys.argv[2], sys.argv[3]
    print(f"{m}: median tokens/s {a} {med[a]:.1f}, {b} {med[b]:.1f}: B/A {med[b] / med[a]:.3f}")
PY
