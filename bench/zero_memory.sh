#!/usr/bin/env bash
# Memory per rank with ZeRO 0, 1 and 2: GPT-2 124M (or --preset P) on 2 data-parallel ranks,
# a few steps each, reporting the largest peak RSS over ranks and the AdamW moments a rank holds
# (both from Keel's own metrics.jsonl). Usage: bench/zero_memory.sh [--ranks N] [--preset P] [--steps S]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL=${KEEL:-$ROOT/build/keel}
ranks=2 preset=gpt2-124m steps=6
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks=${2:?}; shift 2 ;;
    --preset) preset=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    *) echo "zero_memory.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -x "$KEEL" ]] || { echo "zero_memory.sh: $KEEL not found; run scripts/build.sh" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/keel-zero.XXXXXX")
trap '[[ -n "${KEEP_WORK:-}" ]] || rm -rf "$work"' EXIT
# Random tokens in llm.c's shard format: speed and memory do not depend on the text.
/usr/bin/python3 - "$work" <<'PY'
import random, struct, sys
random.seed(0)
for name, n in (("train.bin", 400000), ("val.bin", 20000)):
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack(f"<{n}H", *(random.randrange(50257) for _ in range(n))))
PY
printf "%-8s %14s %18s %16s\n" "ZeRO" "tokens/s" "peak RSS/rank MB" "moments/rank MB"
for zero in 0 1 2; do
  OMP_NUM_THREADS=1 "$KEEL" launch -n "$ranks" -- train --set model.preset="$preset" --set model.max_seq_len=64 \
    --set train.batch_size=4 --set train.seq_len=64 --set train.steps="$steps" --set train.eval_batches=1 \
    --set train.eval_every=0 --set train.sample_tokens=0 --set runtime.peak_gflops=100 \
    --set parallel.zero="$zero" --set data.train="$work/train.bin" --set data.val="$work/val.bin" \
    --set data.tokenizer= --set train.run_dir="$work/run$zero" > "$work/log$zero" 2>&1 ||
    { cat "$work/log$zero" >&2; exit 1; }
  /usr/bin/python3 - "$work/run$zero/metrics.jsonl" "$zero" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
last = steps[-1]
tps = sum(s["tokens_per_s"] for s in steps[1:]) / max(1, len(steps) - 1)
print(f"{sys.argv[2]:<8} {tps:14.1f} {last['peak_rss_mb']:18.0f} {last['moments_mb']:16.0f}")
PY
done
