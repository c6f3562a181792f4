#!/usr/bin/env bash
# bf16 training state's quality and memory at the default size: the default job (d4 on the
# fortunes corpus, 300 steps) and the same with the llama family (llama-d4), each with float32
# state and with bf16 state (runtime.param_dtype = grad_dtype = "bf16", store/bf16_state.h);
# prints each final validation loss and bf16 state's relative difference (target: within 1 %),
# the start-up line's parameter and gradient bytes, and the mean tokens/s of each run.
# Usage: bench/bf16_state.sh [STEPS] [EXTRA --set ARGS...]   (from the repository root, after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
K=build/keel
steps=${1:-300}
shift || true
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export OMP_WAIT_POLICY=PASSIVE
final_val() { grep '"val_loss"' "$1/metrics.jsonl" | tail -1 | sed 's/.*"val_loss":\([0-9.e+-]*\).*/\1/'; }
memory() { grep -m1 'memory per rank' "$1" | sed 's/.*memory per rank: \(params [^,]*\(, float32 master weights [^,]*\)\?, grads [^,]*\).*/\1/'; }
speed() { grep -m1 'tok/s mean' "$1" | sed 's/.* \([0-9]*\) tok\/s mean.*/\1/'; }
for preset in d4 llama-d4; do
  for state in fp32 bf16; do
    "$K" train --set model.preset=$preset --set runtime.param_dtype=$state --set runtime.grad_dtype=$state \
      --set train.steps="$steps" --set train.sample_tokens=0 --set train.run_dir="$dir/$preset-$state" "$@" \
      > "$dir/$preset-$state.log" 2>&1 ||
      { echo "$preset $state failed:"; tail -3 "$dir/$preset-$state.log"; exit 1; }
    echo "$preset $state state: $(memory "$dir/$preset-$state.log"); $(speed "$dir/$preset-$state.log") tok/s mean"
  done
  a=$(final_val "$dir/$preset-fp32") b=$(final_val "$dir/$preset-bf16")
  awk -v p=$preset -v a="$a" -v b="$b" -v s="$steps" 'BEGIN {
    d = (b - a) / a * 100
    printf "%-9s %d steps: final val loss fp32 state %.4f, bf16 state %.4f: %+.2f %% (%s)\n", p, s, a, b, d, (d < 1 && d > -1) ? "within 1 %" : "NOT within 1 %" }'
done
