#!/usr/bin/env bash
# Energy per million tokens of one job (the d4 model, vocabulary 2048, fortunes text, batch 8x128,
# 20 steps; steps 4..20 averaged) under Keel's techniques, as metrics.jsonl reports it: from RAPL
# where the machine has it, else modelled from CPU time x monitor.cpu_watts (the line says which).
# Usage: bench/energy_techniques.sh   (from the repository root, after scripts/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
K=$PWD/build/keel
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$K" tokenize --input /usr/share/games/fortunes --out "$work/data" --vocab-size 2048 >/dev/null
base=(--set model.preset=d4 --set model.vocab_size=2048 --set data.train="$work/data/train.bin"
      --set data.val="$work/data/val.bin" --set data.tokenizer="$work/data/tokenizer.json" --set train.steps=20
      --set train.eval_every=0 --set train.sample_tokens=0 --set train.batch_size=8 --set train.seq_len=128)
run() {  # NAME RANKS [--set ...]
  local name=$1 ranks=$2
  shift 2
  if [ "$ranks" = 1 ]; then "$K" train "${base[@]}" --set train.run_dir="$work/$name" "$@" >/dev/null 2>&1
  else "$K" launch -n "$ranks" -- train "${base[@]}" --set train.run_dir="$work/$name" "$@" >/dev/null 2>&1; fi
  python3 - "$name" "$work/$name/metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[2]) if '"energy_j"' in l]
s = [x for x in lines if x["step"] >= 4]
kwh = sum(x["energy_kwh_per_mtok"] for x in s) / len(s)
tps = sum(x["tokens_per_s"] for x in s) / len(s)
print(f"{sys.argv[1]:14s} {kwh:.3e} kWh/Mtok  {tps:7.0f} tok/s  ({s[0]['energy_source']})")
PY
}
run one-rank 1
run tiers-nvme 1 --set tier.device_mib=24 --set tier.host_mib=16 --set tier.nvme_dir="$work"
run dp2-dense 2
run dp2-hybrid 2 --set sync.codec=hybrid
run pipe2-1f1b 2 --set parallel.pipeline=2 --set parallel.schedule=1f1b --set train.grad_accum=4
run pipe2-zb-h2 2 --set parallel.pipeline=2 --set parallel.schedule=zb-h2 --set train.grad_accum=4
