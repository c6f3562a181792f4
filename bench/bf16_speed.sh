#!/usr/bin/env bash
# bf16 against float32, side by side on this machine: Keel (build/bench/keel_bench_train,
# runtime.precision = fp32 / bf16) on GPT-2 124M and on llama-110m (llama2.c's stories110M shape),
# and PyTorch on GPT-2 124M in float32 and under torch.autocast("cpu", dtype=torch.bfloat16), in
# its tuned environment (PERF-NOTES: passive OpenMP waiting, glibc malloc tunables, 2 threads):
# Debian's 1.13 and, where bench/.venv holds one, the current PyTorch from PyPI
# (python3 -m venv bench/.venv && bench/.venv/bin/pip install torch). Runs interleave and repeat;
# the best tokens/s of each is kept. Batch 4 x 128 tokens, vocabulary 50304 (GPT-2) / 32000.
# The first line says which bf16 engine Keel has here: oneDNN's bf16 matmul where the CPU has
# AVX512_BF16, otherwise emulation (bf16's numbers without its speed).
# This is the from-initialisation mode (random tokens, a few steps: quick). --steady runs the
# steady-state mode instead (bench/steady_state.py --precision bf16): `keel train` and PyTorch
# (float32 and autocast(bf16), 1.13 and bench/.venv's, each at its best) on the fortunes shards,
# GPT-2 124M's shape at batch 4 x 64, STEPS steps (default 300), the median of the last 50.
# Usage: bench/bf16_speed.sh [STEPS] [REPEATS]   (from the repository root, after scripts/build.sh)
#        bench/bf16_speed.sh --steady [STEPS] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == --steady ]]; then
  exec /usr/bin/python3 bench/steady_state.py --precision bf16 --only 124m --steps "${2:-300}" --repeats "${3:-1}"
fi
echo "mode: from initialisation (random tokens, ${1:-4} timed steps after 1); --steady for training as it is run"
steps=${1:-4}
repeats=${2:-2}
K=build/bench/keel_bench_train
grep -q avx512_bf16 /proc/cpuinfo && echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) has avx512_bf16" \
  || echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) has NO avx512_bf16: Keel's bf16 is emulated here"
# Issue 38's target for bf16 over fp32 by matrix engine: 2.5x where the CPU has AMX, else 1.6x.
target=1.6
grep -q amx_bf16 /proc/cpuinfo && { target=2.5; echo "cpu: has AMX-BF16 (bf16 target over fp32: ${target}x)"; }
tuned=(env OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=2
       GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736)
# The kernels Keel picks for itself where Debian's OpenBLAS falls back to older ones.
coretype=$(cd bench && /usr/bin/python3 -c 'import steady_state; print(steady_state.openblas_coretype()[1] or "")')
[[ -n "${OPENBLAS_CORETYPE:-}" || -z "$coretype" ]] || tuned+=(OPENBLAS_CORETYPE=$coretype)
peers=(/usr/bin/python3)
[ -x bench/.venv/bin/python ] && peers+=(bench/.venv/bin/python)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
keel() {  # NAME PRESET PRECISION
  local line
  line=$("$K" --steps "$steps" --warmup-steps 1 --set model.preset="$2" --set train.batch_size=4 \
         --set train.seq_len=128 --set runtime.threads=2 --set runtime.precision="$3" 2>/dev/null | tail -1)
  echo "$1 $line" >> "$out"
}
torch() {  # NAME PYTHON [--bf16]
  local line
  line=$("${tuned[@]}" "$2" bench/torch_gpt2_train.py --layers 12 --channels 768 --heads 12 --vocab 50304 \
         --batch 4 --seq 128 --steps "$steps" --warmup-steps 1 --threads 2 --flush-denormal ${3:-} 2>/dev/null | tail -1)
  echo "$1 $line" >> "$out"
}
for r in $(seq 1 "$repeats"); do
  keel "keel-gpt2-fp32" gpt2-124m fp32
  keel "keel-gpt2-bf16" gpt2-124m bf16
  keel "keel-llama-fp32" llama-110m fp32
  keel "keel-llama-bf16" llama-110m bf16
  for p in "${peers[@]}"; do
    v=$("$p" -c "import torch; print(torch.__version__)")
    torch "torch-$v-gpt2-fp32" "$p"
    torch "torch-$v-gpt2-bf16" "$p" --bf16
  done
done
python3 - "$out" "$target" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    name, _, js = line.partition(" ")
    try:
        j = json.loads(js)
    except ValueError:
        print(f"{name}: no result"); continue
    if name not in best or j["tokens_per_s"] > best[name]["tokens_per_s"]:
        best[name] = j
print(f"{'run':32s} {'tokens/s':>9s} {'ms/step':>9s} {'peak RSS MB':>12s}")
for name, j in best.items():
    print(f"{name:32s} {j['tokens_per_s']:9.1f} {j['ms_per_step']:9.1f} {j['peak_rss_mb']:12.0f}")
def tps(n): return best[n]["tokens_per_s"] if n in best else float("nan")
for fam in ("gpt2", "llama"):
    print(f"Keel {fam}: bf16 / fp32 = {tps(f'keel-{fam}-bf16') / tps(f'keel-{fam}-fp32'):.2f}x (target >= {sys.argv[2]}x)")
peer = [n for n in best if n.startswith("torch-") and n.endswith("-gpt2-bf16")]
if peer:
    top = max(peer, key=tps)
    print(f"Keel gpt2 bf16 / {top} = {tps('keel-gpt2-bf16') / tps(top):.2f}x (target >= 1.3x the better peer)")
PY
