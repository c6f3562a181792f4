#!/usr/bin/env bash
# Long-context training, side by side on this machine: Keel (keel_bench_train) against PyTorch
# (bench/torch_long_context.py) on the same small llama-style decoder at long sequence lengths,
# where attention dominates. Shape: 2 layers, width 128, 4 heads (head size 32), 2 key/value
# heads, SwiGLU hidden 352, vocabulary 512, untied head, batch 1, 2 threads, float32.
# For each sequence length T (default 2048 8192 16384 32768) three attention variants:
#   dense      Keel's reference kernel: the T x T probabilities of every layer kept for backward
#   blockwise  Keel's tiled kernel with online softmax (FlashAttention-2 style), memory linear in T
#   windowed   the blockwise kernel with a sliding window of 1024 keys per query
# and the PyTorch peers, in their tuned environment (passive OpenMP waiting, glibc malloc tunables):
#   Debian's PyTorch 1.13 (/usr/bin/python3): explicit attention (q k^T + mask, softmax, @ v),
#     the T x T scores materialised; a band mask for the windowed variant;
#   the current PyTorch in bench/.venv, where present (python3 -m venv bench/.venv &&
#     bench/.venv/bin/pip install torch): scaled_dot_product_attention, is_causal=True, and an
#     explicit boolean band mask for the windowed variant.
# PyTorch has no dense / blockwise switch: its causal run is shown in both of those rows.
# Training data is random tokens: the bench measures speed and memory, not learning (the long
# documents of the test corpus, /usr/share/common-licenses, are not needed for that).
# Each run is one warmup step and 2 timed steps (1 at T > 8192), guarded by `timeout`; a run whose
# estimated peak memory exceeds the limit is skipped ("cannot run: needs ~X GiB"). Runs are
# interleaved over REPEATS rounds and the best tokens/s of each is kept (its peak RSS shown).
# At the defaults (4 lengths, 2 rounds) it takes about half an hour on 2 busy cores; the 32768
# runs are most of it.
# Before the training steps, attention alone (LONG_CONTEXT_PARTS="attention train", the default;
# either alone): one forward + backward of one layer's attention, same heads, batch 1, float32 and
# bf16, causal and windowed, Keel's kernels (build/bench/keel_bench_attention: blockwise, and dense
# where its T x T planes fit) against the current PyTorch's scaled_dot_product_attention (bf16
# tensors for bf16; the window as an explicit boolean band mask, which sends PyTorch to its
# T x T path) and PyTorch 1.13's explicit attention where it fits; the least of the timed passes,
# interleaved over REPEATS rounds, and the ratio Keel blockwise / best PyTorch.
# Usage (from the repository root, after scripts/build.sh):
#   bench/long_context.sh [T_LIST] [REPEATS]        e.g. bench/long_context.sh "2048 4096" 1
# Environment: KEEL_BENCH_TRAIN (binary; default build/bench/keel_bench_train),
#   LONG_CONTEXT_TIMEOUT (seconds per run; default 900), LONG_CONTEXT_MEM_GIB (default 16),
#   LONG_CONTEXT_WINDOW (window of the windowed variant; default 1024),
#   KEEL_BENCH_ATTENTION (binary; default build/bench/keel_bench_attention), LONG_CONTEXT_PARTS.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a Ts <<< "$(echo "${1:-4096 8192 16384 32768}" | tr ',' ' ')"
repeats=${2:-2}
K=${KEEL_BENCH_TRAIN:-build/bench/keel_bench_train}
limit_s=${LONG_CONTEXT_TIMEOUT:-900}
mem_gib=${LONG_CONTEXT_MEM_GIB:-16}
W=${LONG_CONTEXT_WINDOW:-1024}
L=2 C=128 NH=4 NKV=2 H=352 V=512 B=1 THREADS=2
KA=${KEEL_BENCH_ATTENTION:-build/bench/keel_bench_attention}
parts=${LONG_CONTEXT_PARTS:-attention train}
[ -x "$K" ] || { echo "no Keel binary at $K (set KEEL_BENCH_TRAIN or run scripts/build.sh)" >&2; exit 1; }
[ -x "$KA" ] || { echo "no Keel binary at $KA (set KEEL_BENCH_ATTENTION or run scripts/build.sh)" >&2; exit 1; }
tuned=(env OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=2
       GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736)
peers=(/usr/bin/python3)
[ -x bench/.venv/bin/python ] && peers+=(bench/.venv/bin/python)
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT

steps_for() { if [ "$1" -le 8192 ]; then echo 2; else echo 1; fi; }

# Estimated peak resident memory in GiB of one run: KIND T, KIND one of keel-dense, keel-blockwise,
# torch-explicit, torch-sdpa, torch-sdpa-window. Quadratic terms from the kernels' buffers, linear
# terms and constants fitted to runs of this shape at T = 2048 and 4096 on this machine:
#   keel-dense         L*B*NH saved T x T probability planes, one T x T scratch per thread, ~2 more
#   torch-explicit     (L + 3) planes of B*NH*T*T floats (saved probabilities of every layer, plus
#                      scores, their gradient and the softmax gradient of the layer in flight),
#                      doubled: with mmap off (the tuned malloc) freed planes fragment the heap,
#                      measured ~11 GiB at T = 8192 against 5 planes' 5 GiB; and the T x T mask
#   torch-sdpa-window  the boolean band mask and the additive float mask PyTorch converts it to
#                      (~9 bytes per T x T element measured)
estimate_gib() {
  awk -v kind="$1" -v T="$2" -v L=$L -v B=$B -v NH=$NH -v th=$THREADS 'BEGIN {
    tt = T * T
    if (kind ~ /^att-/) L = 1             # attention alone: one layer
    if (kind ~ /keel-dense$/)             q = (L * B * NH + th + 2) * 4 * tt
    else if (kind == "att-torch-explicit") q = 2 * (L + 3) * B * NH * 4 * tt + 4 * tt
    else if (kind == "torch-explicit")    q = 2 * (L + 3) * B * NH * 4 * tt + 4 * tt
    else if (kind ~ /torch-sdpa-window$/) q = 10 * tt + ((kind ~ /^att-/) ? 3 * B * NH * 4 * tt : 0)
    else                                  q = 0
    base = (kind ~ /keel/) ? 40e6 + 40e3 * B * T : 750e6 + 50e3 * B * T
    printf "%.1f", (q + base) / 2^30 }'
}

# Runs one configuration and appends "NAME JSON" (or "NAME SKIP GiB" / "NAME TIMEOUT" /
# "NAME FAIL message") to the record file. NAME KIND T COMMAND...
run_one() {
  local name=$1 kind=$2 T=$3; shift 3
  local need line rc
  need=$(estimate_gib "$kind" "$T")
  if awk -v n="$need" -v m="$mem_gib" 'BEGIN { exit !(n > m) }'; then
    echo "$name: cannot run: needs ~$need GiB (limit $mem_gib GiB)"
    echo "$name SKIP $need" >> "$out"
    return
  fi
  rc=0
  line=$(timeout "$limit_s" "$@" 2>"$err" | tail -1) || rc=$?
  if [ "$rc" -eq 124 ]; then
    echo "$name: timed out after $limit_s s"
    echo "$name TIMEOUT" >> "$out"
  elif [ "$rc" -ne 0 ] || [ "${line:0:1}" != "{" ]; then
    echo "$name: failed (exit $rc): $(tail -1 "$err")"
    echo "$name FAIL exit $rc: $(tail -1 "$err")" >> "$out"
  else
    echo "$name: $line"
    echo "$name $line" >> "$out"
  fi
}

keel() {  # T VARIANT
  local T=$1 variant=$2 attention=$2 extra=() kind=keel-blockwise
  [ "$variant" = dense ] && kind=keel-dense
  [ "$variant" = windowed ] && attention=blockwise extra=(--set model.attention_window="$W")
  run_one "keel-$T-$variant" "$kind" "$T" "$K" --steps "$(steps_for "$T")" --warmup-steps 1 \
    --set model.preset=llama-tiny --set model.n_layer=$L --set model.n_embd=$C --set model.n_head=$NH \
    --set model.n_kv_head=$NKV --set model.ffn_hidden=$H --set model.vocab_size=$V \
    --set model.max_seq_len="$T" --set model.tie_embeddings=false --set model.attention="$attention" \
    "${extra[@]}" --set train.batch_size=$B --set train.seq_len="$T" --set runtime.threads=$THREADS
}

torch() {  # T PYTHON TAG VARIANT(causal|windowed)
  local T=$1 py=$2 tag=$3 variant=$4 attention=explicit window=0 kind=torch-explicit
  [ "$tag" != pt113 ] && attention=sdpa kind=torch-sdpa
  [ "$variant" = windowed ] && window=$W
  [ "$variant" = windowed ] && [ "$attention" = sdpa ] && kind=torch-sdpa-window
  run_one "$tag-$T-$variant" "$kind" "$T" "${tuned[@]}" "$py" bench/torch_long_context.py \
    --layers $L --channels $C --heads $NH --kv-heads $NKV --ffn-hidden $H --vocab $V --batch $B \
    --seq "$T" --window "$window" --attention $attention --steps "$(steps_for "$T")" --warmup-steps 1 \
    --threads $THREADS
}

# Attention alone: NAME KIND T PRECISION VARIANT(causal|windowed) -> the record file, as run_one.
attention_keel() {  # T PRECISION VARIANT KIND(blockwise|dense)
  local T=$1 p=$2 variant=$3 kind=$4 window=0
  [ "$variant" = windowed ] && window=$W
  run_one "att-keel-$kind-$T-$p-$variant" "att-keel-$kind" "$T" env OMP_WAIT_POLICY=PASSIVE "$KA" --kind "$kind" \
    --precision "$p" --batch $B --seq "$T" --heads $NH --kv-heads $NKV --head-size $((C / NH)) --window $window \
    --repeats "$(steps_for "$T")" --threads $THREADS
}
attention_torch() {  # T PYTHON TAG PRECISION VARIANT
  local T=$1 py=$2 tag=$3 p=$4 variant=$5 attention=explicit window=0 kind=att-torch-explicit
  [ "$tag" != pt113 ] && attention=sdpa kind=att-torch-sdpa
  [ "$variant" = windowed ] && window=$W
  [ "$variant" = windowed ] && [ "$attention" = sdpa ] && kind=att-torch-sdpa-window
  run_one "att-$tag-$T-$p-$variant" "$kind" "$T" "${tuned[@]}" "$py" bench/torch_long_context.py --attention-only \
    --layers 1 --channels $C --heads $NH --kv-heads $NKV --ffn-hidden $H --vocab $V --batch $B --seq "$T" \
    --window "$window" --attention $attention --precision "$p" --steps "$(steps_for "$T")" --warmup-steps 1 \
    --threads $THREADS
}

versions=()
for p in "${peers[@]}"; do versions+=("$("$p" -c 'import torch; print(torch.__version__)' 2>/dev/null)"); done
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores;" \
     "memory limit per run $mem_gib GiB; timeout $limit_s s; window $W; T: ${Ts[*]}; repeats: $repeats"
echo "peers: ${peers[*]} (torch ${versions[*]})"
echo "load before: $(uptime | sed 's/.*load average: //')"
for r in $(seq 1 "$repeats"); do
  [[ " $parts " == *" attention "* ]] || break
  echo "--- attention alone, round $r of $repeats"
  for T in "${Ts[@]}"; do
    for p in fp32 bf16; do
      for variant in causal windowed; do
        attention_keel "$T" "$p" "$variant" blockwise
        [ "$variant" = causal ] && attention_keel "$T" "$p" "$variant" dense
        for i in "${!peers[@]}"; do
          tag=pt113; [ "$i" -gt 0 ] && tag=ptcur
          attention_torch "$T" "${peers[$i]}" "$tag" "$p" "$variant"
        done
      done
    done
  done
done
for r in $(seq 1 "$repeats"); do
  [[ " $parts " == *" train "* ]] || break
  echo "--- training steps, round $r of $repeats"
  for T in "${Ts[@]}"; do
    for variant in dense blockwise windowed; do keel "$T" "$variant"; done
    for i in "${!peers[@]}"; do
      tag=pt113; [ "$i" -gt 0 ] && tag=ptcur
      for variant in causal windowed; do torch "$T" "${peers[$i]}" "$tag" "$variant"; done
    done
  done
done

python3 - "$out" "$W" "${versions[@]}" <<'PY'
import json, sys
path, window, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
best, status = {}, {}
for line in open(path):
    name, _, rest = line.rstrip("\n").partition(" ")
    if rest.startswith("{"):
        j = json.loads(rest)
        # attention alone: the least ms; training: the most tokens/s
        better = (name not in best or (j["ms"] < best[name]["ms"] if name.startswith("att-")
                                       else j["tokens_per_s"] > best[name]["tokens_per_s"]))
        if better:
            best[name] = j
    else:
        status.setdefault(name, rest)

def cells(name):
    """(tokens/s, MB) cells: numbers, or why there are none."""
    if name in best:
        return f"{best[name]['tokens_per_s']:.0f}", f"{best[name]['peak_rss_mb']:.0f}"
    s = status.get(name, "")
    if s.startswith("SKIP"):
        return "skip", f"~{float(s.split()[1]):.1f}G"
    if s.startswith("TIMEOUT"):
        return "timeout", "-"
    if s.startswith("FAIL"):
        return "failed", "-"
    return "-", "-"

def tps(name):
    return best[name]["tokens_per_s"] if name in best else None

def ratio(a, b, missing):
    return f"{a / b:.2f}x" if a and b else missing

def att_ms(name):
    return best[name]["ms"] if name in best else None

att_names = [n for n in list(best) + list(status) if n.startswith("att-")]
if att_names:
    print()
    print("attention alone: one layer's forward + backward, ms (least of the passes); ratio = best PyTorch ms / Keel blockwise ms")
    print(f"{'T':>6s} {'prec':4s} {'variant':8s} {'keel blk':>9s} {'keel dense':>10s} {'pt 1.13':>9s} {'pt cur':>9s} {'keel/best pt':>12s}")
    att_Ts = sorted({int(n.split("-")[-3]) for n in att_names})
    for T in att_Ts:
        for p in ("fp32", "bf16"):
            for variant in ("causal", "windowed"):
                def cell(name):
                    if name in best:
                        return f"{best[name]['ms']:.0f}"
                    s = status.get(name, "")
                    return "skip" if s.startswith("SKIP") else ("timeout" if s.startswith("TIMEOUT") else ("failed" if s.startswith("FAIL") else "-"))
                k = f"att-keel-blockwise-{T}-{p}-{variant}"
                d = f"att-keel-dense-{T}-{p}-{variant}"
                peers_ms = [att_ms(f"att-{tag}-{T}-{p}-{variant}") for tag in ("pt113", "ptcur")]
                peers_ms = [x for x in peers_ms if x]
                r = f"{min(peers_ms) / att_ms(k):.2f}x" if peers_ms and att_ms(k) else "-"
                print(f"{T:6d} {p:4s} {variant:8s} {cell(k):>9s} {cell(d):>10s} {cell(f'att-pt113-{T}-{p}-{variant}'):>9s} "
                      f"{cell(f'att-ptcur-{T}-{p}-{variant}'):>9s} {r:>12s}")
best = {n: j for n, j in best.items() if not n.startswith("att-")}
status = {n: s for n, s in status.items() if not n.startswith("att-")}
if not best and not status:
    sys.exit(0)

Ts = sorted({int(n.split("-")[1]) for n in list(best) + list(status)})
tags = ["pt113", "ptcur"][:len(versions)]
head = f"{'T':>6s} {'variant':9s} {'keel tok/s':>10s} {'keel MB':>8s}"
for v in versions:
    short = "torch " + v.split("+")[0].replace("a0", "")
    head += f" {short + ' tok/s':>18s} {'MB':>6s}"
head += f" {'vs keel dense':>13s} {'vs keel blk':>11s} {'keel/best pt':>12s}"
print()
print(f"tokens/s: best of the rounds; MB: peak RSS of that run; skip ~NG: estimated need over the limit")
print(f"windowed: sliding window of {window} keys; PyTorch's causal run appears in the dense and blockwise rows")
print(head)
for T in Ts:
    for variant in ("dense", "blockwise", "windowed"):
        k = f"keel-{T}-{variant}"
        pv = "windowed" if variant == "windowed" else "causal"
        row = f"{T:6d} {variant:9s} " + " ".join(f"{c:>{w}s}" for c, w in zip(cells(k), (10, 8)))
        for tag in tags:
            row += " " + " ".join(f"{c:>{w}s}" for c, w in zip(cells(f"{tag}-{T}-{pv}"), (18, 6)))
        dense_missing = "dense n/a" if tps(f"keel-{T}-dense") is None else "-"
        vs_dense = "" if variant == "dense" else ratio(tps(k), tps(f"keel-{T}-dense"), dense_missing)
        vs_blk = ratio(tps(k), tps(f"keel-{T}-blockwise"), "-") if variant == "windowed" else ""
        peers = [tps(f"{tag}-{T}-{pv}") for tag in tags]
        peers = [p for p in peers if p]
        vs_pt = ratio(tps(k), max(peers) if peers else None, "-")
        row += f" {vs_dense:>13s} {vs_blk:>11s} {vs_pt:>12s}"
        print(row)
notes = [f"  {n}: {s}" for n, s in status.items() if not s.startswith("SKIP") and n not in best]
if notes:
    print("runs without a result:")
    print("\n".join(notes))
PY
echo "load after: $(uptime | sed 's/.*load average: //')"
