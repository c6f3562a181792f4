#!/usr/bin/env bash
# Inference over Keel's KV cache, on the licence corpus (/usr/share/common-licenses: 17 files of
# 1.5-35 KB, GPL / LGPL / GFDL being links to GPL-3 / LGPL-3 / GFDL-1.3, the GNU licences sharing
# long passages):
#   1. generation tokens/s without and with the KV cache (greedy: the same text, checked);
#   2. `keel generate --prompts`: every licence's opening as a prompt, the cache's blocks under a
#      small device budget in host DRAM (the tier manager's hit rate, prefix-reuse hits);
#   3. `keel score --documents` over the licences with and without prefix reuse: time, tokens
#      reused, the losses (equal up to float rounding).
# The model: llama-d4 (5.5M parameters) with a 512-token BPE, trained briefly on the licences here
# (speed, not quality, is measured), context 1024, 64-token blocks.
# Usage: bench/kv_cache.sh [NEW_TOKENS]   (from the repository root, after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
K=$(pwd)/build/keel
N=${1:-400}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$K" tokenize --input /usr/share/common-licenses --out "$dir/data" --vocab-size 512 > /dev/null
"$K" train --set model.preset=llama-d4 --set model.max_seq_len=1024 --set train.seq_len=256 --set train.batch_size=4 \
  --set train.steps=40 --set train.sample_tokens=0 --set train.eval_every=0 --set train.eval_batches=1 \
  --set data.train="$dir/data/train.bin" --set data.val="$dir/data/val.bin" --set data.tokenizer="$dir/data/tokenizer.json" \
  --set train.run_dir="$dir/run" --set train.log_every=1000 > "$dir/train.log"
ckpt=$(ls -d "$dir"/run/ckpt/step-* | tail -1)
now() { date +%s.%N; }

echo "== 1. generation, $N new tokens, greedy"
for kv in false true; do
  t0=$(now)
  "$K" generate --checkpoint "$ckpt" --prompt "This License" --tokens "$N" --temperature 0 \
    --set generate.kv_cache=$kv > "$dir/gen_$kv.txt"
  t1=$(now)
  awk -v a="$t0" -v b="$t1" -v n="$N" -v kv=$kv 'BEGIN { printf "kv_cache=%s: %.2f s, %.1f tokens/s\n", kv, b - a, n / (b - a) }'
done
cmp -s "$dir/gen_false.txt" "$dir/gen_true.txt" && echo "the same text" || echo "THE TEXTS DIFFER"

echo "== 2. generate --prompts: each licence's first 1500 characters, 32 new tokens, 4 MiB of blocks in memory"
for f in /usr/share/common-licenses/*; do head -c 1500 "$f" | tr '\n\t' '  '; echo; done > "$dir/prompts.txt"
"$K" generate --checkpoint "$ckpt" --prompts "$dir/prompts.txt" --tokens 32 --temperature 0 \
  --set generate.kv_device_mib=4 --set generate.kv_tier=host 2> "$dir/prompts.err" |
  python3 -c "$(cat <<'PY'
import json, sys
rows = [json.loads(line) for line in sys.stdin]
prompt = sum(r["prompt_tokens"] for r in rows)
reused = sum(r["reused_tokens"] for r in rows)
print(f"{len(rows)} prompts, {prompt} prompt tokens, {reused} reused ({reused / prompt:.0%}), "
      f"{max(r['ms'] for r in rows):.0f} ms")
PY
)"
grep "KV cache" "$dir/prompts.err"

echo "== 3. score --documents /usr/share/common-licenses, with and without prefix reuse"
for reuse in false true; do
  "$K" score --checkpoint "$ckpt" --documents /usr/share/common-licenses --set generate.prefix_reuse=$reuse \
    2> /dev/null | tail -1 | sed "s/^/prefix_reuse=$reuse: /"
done
