#!/usr/bin/env bash
# bf16's quality at the default size: the default job (d4 on the fortunes corpus, 300 steps) and
# the same with the llama family (llama-d4), each in float32 and in bf16 (runtime.precision);
# prints each final validation loss and bf16's relative difference (target: within 1 %). On a CPU
# without AVX512_BF16 Keel's bf16 is emulated (the operands rounded to bf16, float32 products and
# sums), which gives bf16's numbers, so this measures quality on any machine; speed is
# bench/bf16_speed.sh's.
# Usage: bench/bf16_quality.sh [STEPS]   (from the repository root, after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
K=build/keel
steps=${1:-300}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
final_val() { grep '"val_loss"' "$1/metrics.jsonl" | tail -1 | sed 's/.*"val_loss":\([0-9.e+-]*\).*/\1/'; }
for preset in d4 llama-d4; do
  for precision in fp32 bf16; do
    "$K" train --set model.preset=$preset --set runtime.precision=$precision --set train.steps="$steps" \
      --set train.sample_tokens=0 --set train.run_dir="$dir/$preset-$precision" > "$dir/$preset-$precision.log" 2>&1 ||
      { echo "$preset $precision failed:"; tail -3 "$dir/$preset-$precision.log"; exit 1; }
  done
  a=$(final_val "$dir/$preset-fp32") b=$(final_val "$dir/$preset-bf16")
  awk -v p=$preset -v a="$a" -v b="$b" -v s="$steps" 'BEGIN {
    d = (b - a) / a * 100
    printf "%-9s %d steps: final val loss fp32 %.4f, bf16 %.4f: %+.2f %% (%s)\n", p, s, a, b, d, (d < 1 && d > -1) ? "within 1 %" : "NOT within 1 %" }'
done
grep -h "precision bf16" "$dir"/*-bf16.log | head -1
