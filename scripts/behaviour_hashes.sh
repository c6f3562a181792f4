#!/usr/bin/env bash
# Trains a fixed set of short runs and prints each run's final-weights hash (SHA-256 of the final
# checkpoint exported in llm.c's format), so that two builds of Keel can be compared byte for byte:
# a refactoring that keeps behaviour keeps every hash. Hashes depend on the CPU (kernels are built
# with -march=native), so compare two builds on the same machine; no test hard-codes them.
#
# Usage: bash scripts/behaviour_hashes.sh [KEEL_BINARY]        (default: build/keel)
#        bash scripts/behaviour_hashes.sh --ref REV             (builds REV in a temporary worktree)
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
keel="$top/build/keel"
if [ "${1:-}" = "--ref" ]; then
  ref=${2:?"--ref needs a revision"}
  tree=$(mktemp -d /tmp/keel-ref-XXXXXX)
  git worktree add --detach "$tree" "$ref" >/dev/null
  trap 'git -C "$top" worktree remove --force "$tree"' EXIT
  cmake -S "$tree" -B "$tree/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DKEEL_BENCH=OFF >/dev/null
  cmake --build "$tree/build" -j"$(nproc)" --target keel >/dev/null
  keel="$tree/build/keel"
elif [ -n "${1:-}" ]; then
  keel=$(realpath "$1")
fi
[ -x "$keel" ] || { echo "behaviour_hashes: $keel is not an executable keel binary" >&2; exit 2; }

work=$(mktemp -d /tmp/keel-hashes-XXXXXX)
cleanup_work() { rm -rf "$work"; }
trap 'cleanup_work; [ -n "${tree:-}" ] && git -C "$top" worktree remove --force "$tree"' EXIT
export OMP_WAIT_POLICY=PASSIVE OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# Data: the fortunes corpus with a small vocabulary (seconds to tokenize).
"$keel" tokenize --out "$work/data" --vocab-size 512 >/dev/null
common=(--set model.preset=tiny --set model.vocab_size=512 --set train.batch_size=4 --set train.seq_len=64
        --set train.steps=12 --set train.eval_every=0 --set train.eval_batches=2 --set train.sample_tokens=0
        --set train.log_every=100 --set optim.warmup_steps=4 --set runtime.threads=1
        --set data.train="$work/data/train.bin" --set data.val="$work/data/val.bin"
        --set data.tokenizer="$work/data/tokenizer.json")

# run NAME RANKS [--set k=v ...]: trains, exports the final checkpoint, prints NAME and its hash.
run() {
  local name=$1 ranks=$2
  shift 2
  local dir="$work/$name"
  if [ "$ranks" -eq 1 ]; then
    "$keel" train "${common[@]}" --set train.run_dir="$dir" "$@" >"$work/$name.log" 2>&1
  else
    "$keel" launch -n "$ranks" -- train "${common[@]}" --set train.run_dir="$dir" "$@" >"$work/$name.log" 2>&1
  fi || { echo "$name: run failed (log follows)"; tail -20 "$work/$name.log"; return 1; }
  local ckpt
  ckpt=$(ls -d "$dir"/ckpt/step-* | sort | tail -1)
  "$keel" export --checkpoint "$ckpt" --out "$work/$name.bin" >/dev/null
  printf '%-22s %s\n' "$name" "$(sha256sum "$work/$name.bin" | cut -c1-16)"
}

echo "keel: $keel ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
run one-rank 1
run dp2-zero0 2 --set parallel.zero=0
run dp2-zero1 2 --set parallel.zero=1
run dp2-zero2 2 --set parallel.zero=2
run dp2-hybrid 2 --set sync.codec=hybrid --set sync.warmup_steps=2
run tiers-nvme 1 --set tier.device_mib=1 --set tier.host_mib=1 --set tier.nvme_dir="$work" --set store.chunk_bytes=65536
run pipe-zb-h2-2 2 --set parallel.pipeline=2 --set parallel.schedule=zb-h2 --set train.grad_accum=4
run pipe-zb-h2-2x2 4 --set parallel.pipeline=2 --set parallel.schedule=zb-h2 --set train.grad_accum=4
# Resume: checkpoints at steps 6 and 12; the step-12 one is removed and the run resumed from step 6
# (its hash must equal one-rank's: checkpoints do not change training).
run resume 1 --set train.checkpoint_every=6 >/dev/null
rm -rf "$work/resume/ckpt"/step-00000012*
run resume 1 --set train.checkpoint_every=6 --set train.resume=auto
