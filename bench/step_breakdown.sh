#!/usr/bin/env bash
# One training step's time by part (GEMMs, attention, elementwise, optimizer, communication) beside
# each part's bound on this machine, and the step's ratio to the sum of bounds
# (build/bench/keel_step_breakdown; see bench/step_breakdown.cpp for what is measured and how the
# bounds are computed), for GPT-2 124M and llama-110m, fp32 and bf16, at B=4 T=128 and B=8 T=512.
# fp32 and bf16 runs of one shape alternate and repeat; the fastest step of each is kept, and the
# table gives bf16's tokens/s over fp32's beside them. The first lines name the CPU, its matrix
# engine for bf16 and the load while the bench ran.
# Usage: bench/step_breakdown.sh [STEPS] [REPEATS] [SHAPES]   (from the repository root, after
# scripts/build.sh; SHAPES: "4x128 8x512" by default)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3}
repeats=${2:-2}
shapes=${3:-"4x128 8x512"}
K=build/bench/keel_step_breakdown
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
echo "bf16 instructions: $([[ $flags == *avx512_bf16* ]] && echo AVX512_BF16 || echo none)," \
     "AMX: $([[ $flags == *amx_bf16* ]] && echo yes || echo 'no (the AMX targets cannot be measured here)')"
echo "load before: $(uptime | sed 's/.*load average: //')"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for shape in $shapes; do
  B=${shape%x*}
  T=${shape#*x}
  for r in $(seq 1 "$repeats"); do
    for preset in gpt2-124m llama-110m; do
      for precision in fp32 bf16; do
        line=$("$K" --steps "$steps" --warmup-steps 1 --set model.preset="$preset" --set train.batch_size="$B" \
               --set train.seq_len="$T" --set runtime.threads=2 --set runtime.precision="$precision" 2>/dev/null \
               | tail -1) || line="{}"
        echo "$preset $precision $shape $line" >> "$out"
      done
    done
  done
done
echo "load after: $(uptime | sed 's/.*load average: //')"
python3 - "$out" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    preset, precision, shape, js = line.split(" ", 3)
    try:
        j = json.loads(js)
        j["step_ms"]
    except (ValueError, KeyError):
        print(f"{preset} {precision} {shape}: no result")
        continue
    key = (preset, shape, precision)
    if key not in best or j["step_ms"] < best[key]["step_ms"]:
        best[key] = j
engines = {j["engine"] for j in best.values() if j["precision"] == "bf16"}
print("bf16 engine: " + "; ".join(sorted(engines)))
parts = ["gemm", "attention", "elementwise", "optimizer", "communication"]
print(f"{'model':11s} {'shape':6s} {'prec':4s} {'step ms':>8s} " +
      " ".join(f"{p[:9] + ' ms/bound':>20s}" for p in parts) + f" {'step/bound':>10s} {'tok/s':>7s} {'bf16/fp32':>9s}")
for (preset, shape, precision), j in sorted(best.items()):
    fp32 = best.get((preset, shape, "fp32"))
    ratio = f"{j['tokens_per_s'] / fp32['tokens_per_s']:.2f}x" if precision == "bf16" and fp32 else ""
    cells = " ".join(f"{j[p + '_ms']:9.1f}/{j[p + '_bound_ms']:<9.1f}" + " " for p in parts)
    print(f"{preset:11s} {shape:6s} {precision:4s} {j['step_ms']:8.1f} {cells} {j['step_over_bound']:9.2f}x "
          f"{j['tokens_per_s']:7.1f} {ratio:>9s}")
print("probes: " + "; ".join(f"{k[0]} {k[1]} {k[2]}: GEMM {j['gemm_probe_gflops']:.0f} GFLOP/s, "
                            f"{j['bandwidth_gbs']:.1f} GB/s" for k, j in sorted(best.items())))
PY
