#!/usr/bin/env bash
# Builds Keel's libFuzzer targets (clang, ASan + UBSan, build-fuzz/) and runs each for a fixed
# budget on its seed corpus (fuzz/corpus/TARGET/) after replaying every input that once crashed it
# (fuzz/regressions/TARGET/). Exits non-zero on any crash, sanitizer report, leak or timeout; the
# input that did it is left in build-fuzz/artifacts/ (add it to fuzz/regressions/ once fixed).
# Targets run as many at a time as there are cores (each fuzzer is one single-threaded process), so
# the budget per target buys the same fuzzing in a fraction of the wall time.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
targets=(fuzz_config fuzz_shard fuzz_tokenizer fuzz_llmc fuzz_checkpoint fuzz_image fuzz_http fuzz_safetensors fuzz_hf_tokenizer)
# -O1 and line tables only (as libFuzzer's documentation builds): reports keep file:line, and the
# build, most of this script's time in CI, is shorter.
# (BUILD_TESTING is left as the tree has it: scripts/test.sh builds the sanitized unit tests here.)
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DKEEL_FUZZ=ON -DKEEL_BENCH=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target "${targets[@]}" >/dev/null
mkdir -p build-fuzz/artifacts
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

# Replays a target's regressions, fuzzes it for the budget, prints one line; the log on failure.
fuzz_one() {
  local t=$1 bin=build-fuzz/fuzz/$1 work
  if compgen -G "fuzz/regressions/$t/*" >/dev/null; then
    "$bin" -runs=0 fuzz/regressions/"$t"/* >/dev/null 2>&1 || { echo "== $t: a regression input fails again"; "$bin" -runs=0 fuzz/regressions/"$t"/* 2>&1 | tail -40; return 1; }
  fi
  work=$(mktemp -d)
  cp fuzz/corpus/"$t"/* "$work"/
  # OMP_NUM_THREADS=1: one fuzzing process per target, no thread pools to interleave.
  if ! OMP_NUM_THREADS=1 "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
         -artifact_prefix=build-fuzz/artifacts/"$t"- -print_final_stats=1 "$work" >"$work.log" 2>&1; then
    echo "== $t: FAILED (log: $work.log)"
    tail -40 "$work.log"
    return 1
  fi
  local runs cov
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work.log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$work.log" | tail -1 | grep -o '[0-9]*' || echo "?")
  echo "== $t: ok, ${seconds} s, $runs inputs, coverage $cov edges, corpus $(ls "$work" | wc -l) inputs"
  rm -rf "$work" "$work.log"
}

jobs_at_once=$(nproc)
failed=0
running=0
for t in "${targets[@]}"; do
  if (( running >= jobs_at_once )); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while (( running > 0 )); do
  wait -n || failed=1
  running=$((running - 1))
done
exit "$failed"
