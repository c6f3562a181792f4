#!/usr/bin/env bash
# Recovery under repeated SIGKILL: the job of tests/chaos_test.cpp (2 ranks, batch 2 x 32, a
# checkpoint every C steps), longer, is killed --kills times (default 100) under
# `keel launch --max-restarts`. Every kill must be recovered, and the job must end with the weights
# and AdamW moments of the same job run without kills.
#
# Kills:
#   external   SIGKILL to a random rank, 1..2C steps after the job (re)started training.
#   in a checkpoint write
#              KEEL_FAULT=kill:op=N:path=ckpt/step-:rank=R:once=MARKER in the launcher's environment
#              (mpirun passes it to ranks on this machine): rank R dies at its Nth file operation on
#              ckpt/step-*, N drawn inside the writing of R's rR.bin or of the manifest in the run's
#              first or second checkpoint. A rank that finds MARKER at start-up takes the plan as
#              spent, so the fault is armed for a chosen restart only, by deleting MARKER just before
#              the external kill that ends the run before it.
# KEEL_FAULT is fixed for a launch, so the kills are spread over launches of --per-launch kills each,
# each with its own R and N. A launch ends, once its last kill was recovered and a few more steps
# trained, with SIGTERM to the launcher (a stop, not counted as a kill); the next launch continues
# with train.resume=auto. The first launch has only external kills (N is drawn from the chunk
# layout that its checkpoints record).
#
# The job trains at a constant learning rate after warm-up (optim.min_lr_ratio = 1), so that its
# trajectory does not depend on train.steps: the killed launches run with a large train.steps, a
# last launch trains to the newest checkpoint + C steps, and the uninterrupted reference to the same
# step. Equal means: every chunk's param, adam_m and adam_v have the same XXH3 of their decoded bytes
# in the two final manifests (after `keel checkpoints --verify yes` decoded and checked every record
# of both), and `keel export` writes byte-identical llm.c files.
#
# Reports kills, recoveries, recovery rate, recovery time (median, p99, max: from the restarted job's
# "keel: recovered from failure K (...) in X s", the time from the failure being noticed to training
# resumed), whether the final weights are equal, and the total time. Exits 0 when every kill was
# recovered and the weights are equal, 1 otherwise, 2 on bad arguments. Every process it started and
# its temporary directory are removed on exit, failure or Ctrl-C (--keep keeps the directory).
#
# Usage: bench/chaos.sh [--kills N] [--preset P] [--seed S] [--checkpoint-every C] [--per-launch K]
#                       [--fault-fraction F] [--keep]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
KEEL=$ROOT/build/keel

kills=100 preset=small seed=1 ckpt_every=10 per_launch=10 fault_fraction=0.25 keep=0
usage() { sed -n '/^# Usage:/,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die_usage() { echo "chaos.sh: $1 (see bench/chaos.sh --help)" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --kills) kills=${2-}; shift 2 ;;
    --preset) preset=${2-}; shift 2 ;;
    --seed) seed=${2-}; shift 2 ;;
    --checkpoint-every) ckpt_every=${2-}; shift 2 ;;
    --per-launch) per_launch=${2-}; shift 2 ;;
    --fault-fraction) fault_fraction=${2-}; shift 2 ;;
    --keep) keep=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument '$1'" ;;
  esac
done
for v in kills seed ckpt_every per_launch; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die_usage "--${v//_/-}: expected a whole number, found '${!v}'"
done
((kills >= 1 && ckpt_every >= 1 && per_launch >= 1)) || die_usage "--kills, --checkpoint-every and --per-launch must be >= 1"
fault_permille=$(awk -v f="$fault_fraction" 'BEGIN { if (f !~ /^[0-9.]+$/ || f > 1) print -1; else print int(f * 1000 + 0.5) }')
((fault_permille >= 0)) || die_usage "--fault-fraction: expected a number in [0, 1], found '$fault_fraction'"
[[ -x $KEEL ]] || { echo "chaos.sh: $KEEL not found: build first (bash scripts/build.sh)" >&2; exit 2; }
case $preset in small|gpt2-*) vocab=50257 ;; *) vocab=8192 ;; esac

readonly HANG_GUARD_S=600   # longest any one wait may take before the bench calls it a hang
t_start=$(date +%s.%N)
tmp=$(mktemp -d /tmp/keel-chaos-bench.XXXXXX)
launcher_pid=""
failed=0

# Stops what this bench started: the running launcher (SIGTERM, which it forwards to mpirun; SIGKILL
# after 20 s), then any process left whose command line names this bench's temporary directory.
cleanup() {
  trap - EXIT INT TERM
  if [[ -n $launcher_pid ]] && kill -0 "$launcher_pid" 2>/dev/null; then
    kill -TERM "$launcher_pid" 2>/dev/null
    for _ in $(seq 200); do kill -0 "$launcher_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$launcher_pid" 2>/dev/null
    wait "$launcher_pid" 2>/dev/null
  fi
  local left
  left=$(pgrep -f -- "$tmp/" || true)
  # shellcheck disable=SC2086  # one pid per word
  [[ -n $left ]] && kill -KILL $left 2>/dev/null
  if ((keep)); then echo "chaos.sh: kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'echo "chaos.sh: interrupted" >&2; exit 130' INT
trap 'echo "chaos.sh: terminated" >&2; exit 143' TERM

fail() { echo "chaos.sh: FAILED: $*" >&2; failed=1; }
# Runs a keel command in the background (so that a signal to this script is handled at once) and
# waits for it; its output goes to the log $1. Returns its exit code.
run_logged() {
  local out=$1; shift
  "$@" >"$out" 2>&1 &
  launcher_pid=$!
  local code=0
  wait "$launcher_pid" || code=$?
  launcher_pid=""
  return "$code"
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# Sets REPLY to a uniform integer in [0, n) (no subshell: $RANDOM must advance in this shell).
rand_below() { REPLY=$(( ((RANDOM << 15) | RANDOM) % $1 )); }

# --- the job ---------------------------------------------------------------------------------------
python3 - "$tmp" "$vocab" "$seed" <<'EOF'
import random, struct, sys
from array import array
out, vocab, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
for name, n in (("train.bin", 200000), ("val.bin", 4000)):
    header = [0] * 256
    header[:3] = [20240520, 1, n]
    tokens = array("H", (rng.randrange(vocab) for _ in range(n)))
    with open(f"{out}/{name}", "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(tokens.tobytes())
EOF
cat >"$tmp/job.toml" <<EOF
[model]
preset = "$preset"
[train]
batch_size = 2
seq_len = 32
steps = 100000000
checkpoint_every = $ckpt_every
eval_every = 0
eval_batches = 1
sample_tokens = 0
log_every = 1
[optim]
lr = 1e-3
warmup_steps = 10
min_lr_ratio = 1.0
[data]
train = "$tmp/train.bin"
val = "$tmp/val.bin"
tokenizer = ""
[runtime]
peak_gflops = 100
EOF
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
unset KEEL_FAULT
train_args=(train --config "$tmp/job.toml")
marker=$tmp/fault.spent

# "F R RESUME LAST" of a launch's log: failures the launcher reported, recoveries the restarted job
# reported, the step the current run resumed at, and its last completed step (-1: none yet).
log_state() {
  awk '
    /^keel: launch: failure [0-9]+:/ { F++ }
    /^keel: resumed from .* at step [0-9]+$/ { resume = $NF + 0 }
    /keel: recovered from failure / {
      R++; last = -1
      if (match($0, /training resumes at step [0-9]+/)) resume = substr($0, RSTART + 25, RLENGTH - 25) + 0
    }
    /^step +[0-9]+\// { split($2, a, "/"); if (a[1] + 0 > last) last = a[1] + 0 }
    END { print F + 0, R + 0, resume + 0, last }' last=-1 "$1"
}

# Waits until `$1` (a shell condition on F R RESUME LAST, the launcher's liveness ALIVE) holds.
wait_for() {
  local cond=$1 what=$2 until=$((EPOCHSECONDS + HANG_GUARD_S))
  while :; do
    # shellcheck disable=SC2034  # read by the evaluated condition
    read -r F R RESUME LAST < <(log_state "$log")
    ALIVE=0; kill -0 "$launcher_pid" 2>/dev/null && ALIVE=1
    eval "$cond" && return 0
    if ((!ALIVE)); then fail "the launcher exited while waiting for $what"; return 1; fi
    if ((EPOCHSECONDS >= until)); then fail "no $what after ${HANG_GUARD_S} s (hang)"; return 1; fi
    sleep 0.1
  done
}

# The running ranks' pid for MPI rank $1.
rank_pid() {
  local pid
  for pid in $(pgrep -f -- "^$KEEL train --config $tmp/job.toml"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then
      echo "$pid"; return 0
    fi
  done
  return 1
}

newest_checkpoint() {  # highest step, then highest attempt (step-00000040.1 after step-00000040)
  local root=$1
  find "$root" -mindepth 2 -maxdepth 2 -name manifest.json -printf '%h\n' 2>/dev/null |
    awk -F/ '{ n = $NF; sub(/^step-/, "", n); split(n, p, "."); printf "%012d %06d %s\n", p[1], p[2], $0 }' |
    sort -r | head -1 | cut -d' ' -f3
}

printf 'chaos.sh: %d kills, preset %s, seed %s, checkpoint every %d steps, %d kills per launch, %s of kills in checkpoint writes\n' \
  "$kills" "$preset" "$seed" "$ckpt_every" "$per_launch" "$fault_fraction"
echo "chaos.sh: working in $tmp"
RANDOM=$seed
run_dir=$tmp/chaos
external=0 in_write=0 not_fired=0 done_kills=0 launch_no=0
recovery_lines=()

# --- the killed launches ---------------------------------------------------------------------------
while ((done_kills < kills && !failed)); do
  launch_no=$((launch_no + 1))
  k_here=$(( kills - done_kills < per_launch ? kills - done_kills : per_launch ))
  log=$tmp/launch-$launch_no.log
  # What each kill of this launch is: a checkpoint-write kill (never twice in a row: the fault's own
  # kill spends the marker as the next run starts) or an external one.
  kinds=()
  fault_env=""
  layout=$(python3 -c 'import json,sys; print(" ".join(str(b - a) for a, b in json.load(open(sys.argv[1] + "/manifest.json"))["layout"]["writers"]))' \
    "$(newest_checkpoint "$run_dir/ckpt")" 2>/dev/null)
  for ((j = 0; j < k_here; j++)); do
    rand_below 1000
    prev=""; ((j > 0)) && prev=${kinds[j - 1]}
    if [[ -n $layout && $prev != fault ]] && ((REPLY < fault_permille)); then
      kinds+=(fault)
    else
      kinds+=(external)
    fi
  done
  if [[ -n $layout ]]; then
    read -r -a chunks <<<"$layout"
    rand_below 2; fault_rank=$REPLY
    n=${chunks[fault_rank]}
    # Rank 1: op 2 is create r1.bin, 3..3n+2 its appends, 3n+4 its close (ops per checkpoint 3n+5),
    # in the run's first or second checkpoint. Rank 0: its first, from create r0.bin to the
    # manifest's rename (3n+10).
    if ((fault_rank == 1)); then rand_below 2; ordinal=$((REPLY + 1)); last_op=$((3 * n + 4)); else ordinal=1; last_op=$((3 * n + 10)); fi
    rand_below $((last_op - 1))
    fault_op=$(( (ordinal - 1) * (3 * n + 5) + 2 + REPLY ))
    fault_env="kill:op=$fault_op:path=ckpt/step-:rank=$fault_rank:once=$marker"
  fi
  if [[ ${kinds[0]} == fault ]]; then rm -f "$marker"; else : >"$marker"; fi
  echo "chaos.sh: launch $launch_no: ${k_here} kills (${kinds[*]})${fault_env:+, KEEL_FAULT=$fault_env}"
  KEEL_FAULT=$fault_env "$KEEL" launch -n 2 --max-restarts $((k_here + 2)) -- "${train_args[@]}" \
    --set train.run_dir="$run_dir" --set train.resume=auto >"$log" 2>&1 &
  launcher_pid=$!

  for ((j = 0; j < k_here && !failed; j++)); do
    # The current run trains: every failure so far recovered, and a step done since.
    wait_for '((F > j || (F == j && R == j && LAST >= 0)))' "training in launch $launch_no after $j kills" || break
    if ((F > j)); then
      fail "launch $launch_no: a failure the bench did not cause: $(grep '^keel: launch: failure' "$log" | tail -1)"
      break
    fi
    run_resume=$RESUME
    if [[ ${kinds[j]} == fault ]]; then
      # Rank R dies inside a checkpoint write of this run; if it has not within 3 checkpoint
      # intervals, the fault was not armed (or N was not reached): kill from outside instead.
      wait_for '((F > j || LAST >= run_resume + 3 * ckpt_every))' "checkpoint-write kill" || break
      if ((F > j)); then
        [[ -e $marker ]] || fail "rank $fault_rank died but the KEEL_FAULT marker is missing"
        in_write=$((in_write + 1)); done_kills=$((done_kills + 1))
        printf 'kill %3d/%d: launch %d: KEEL_FAULT killed rank %d (op %d of ckpt/step-*) after step %d\n' \
          "$done_kills" "$kills" "$launch_no" "$fault_rank" "$fault_op" "$LAST"
        continue
      fi
      not_fired=$((not_fired + 1))
      kinds[j]="external-fallback"
    fi
    rand_below $((2 * ckpt_every)); target=$((run_resume + 1 + REPLY))
    if [[ ${kinds[j]} == external ]]; then
      wait_for '((LAST >= target))' "step $target in launch $launch_no" || break
    fi
    rand_below 2; victim=$REPLY
    pid=$(rank_pid "$victim") || { fail "rank $victim of launch $launch_no not found"; break; }
    # The next run is a checkpoint-write kill's: arm it (this run's ranks read the marker at start).
    [[ ${kinds[j + 1]-} == fault ]] && rm -f "$marker"
    read -r _ _ _ LAST < <(log_state "$log")
    kill -KILL "$pid" 2>/dev/null || { fail "could not kill pid $pid"; break; }
    external=$((external + 1)); done_kills=$((done_kills + 1))
    printf 'kill %3d/%d: launch %d: SIGKILL rank %d (pid %d) after step %d\n' "$done_kills" "$kills" "$launch_no" \
      "$victim" "$pid" "$LAST"
    wait_for '((F > j))' "failure report for kill $done_kills" || break
  done
  if ((!failed)); then
    # End the launch: its last kill recovered, a few steps more, then SIGTERM (a stop, not a kill).
    if wait_for '((R == k_here && LAST >= 0))' "recovery from the last kill of launch $launch_no"; then
      rand_below "$ckpt_every"; target=$((RESUME + 1 + REPLY))
      wait_for '((LAST >= target))' "step $target in launch $launch_no"
    fi
  fi
  if ((!failed)); then
    kill -TERM "$launcher_pid"
    code=0; wait "$launcher_pid" || code=$?
    launcher_pid=""
    grep -q "not restarting: the launcher was stopped by signal 15" "$log" ||
      fail "launch $launch_no did not stop as asked (exit $code): $(tail -3 "$log")"
    for _ in $(seq 200); do pgrep -f -- "^$KEEL train --config $tmp/job.toml" >/dev/null || break; sleep 0.1; done
    pgrep -f -- "^$KEEL train --config $tmp/job.toml" >/dev/null && fail "ranks left running after launch $launch_no stopped"
    f=$(grep -c "^keel: launch: failure [0-9]*:" "$log"); r=$(grep -c "keel: recovered from failure" "$log")
    ((f == k_here)) || fail "launch $launch_no: $f failures reported for $k_here kills"
    ((r == f)) || fail "launch $launch_no: $r recoveries for $f failures"
  fi
  while IFS= read -r line; do recovery_lines+=("$line"); done < <(grep "keel: recovered from failure" "$log")
  if ((failed)); then echo "chaos.sh: the end of $log:" >&2; grep -v "^step " "$log" | tail -40 >&2; fi
done

# --- the end: train to the newest checkpoint + C, then the reference to the same step ----------------
if ((!failed)); then
  newest=$(newest_checkpoint "$run_dir/ckpt")
  newest_step=$(basename "$newest" | sed 's/^step-0*\([0-9]\)/\1/; s/\..*//')
  final_steps=$((newest_step + ckpt_every))
  echo "chaos.sh: finishing: newest checkpoint $(basename "$newest"); training to step $final_steps"
  log=$tmp/final.log
  run_logged "$log" "$KEEL" launch -n 2 --max-restarts 2 -- "${train_args[@]}" --set train.run_dir="$run_dir" \
    --set train.resume=auto --set train.steps=$final_steps || fail "the final launch failed: $(grep -v '^step ' "$log" | tail -5)"
  grep -q "keel: launch: failure" "$log" && fail "the final launch failed without a kill: $(grep 'keel: launch:' "$log")"
  t_ref=$(now)
  echo "chaos.sh: reference: $final_steps steps uninterrupted"
  run_logged "$tmp/reference.log" "$KEEL" launch -n 2 -- "${train_args[@]}" --set train.run_dir="$tmp/reference" \
    --set train.steps=$final_steps --set train.checkpoint_every=0 || fail "the reference run failed: $(tail -5 "$tmp/reference.log")"
  echo "chaos.sh: reference took $(elapsed "$t_ref") s"
fi

# --- the verdict ----------------------------------------------------------------------------------
weights="not compared"
if ((!failed)); then
  mine=$(newest_checkpoint "$run_dir/ckpt") theirs=$(newest_checkpoint "$tmp/reference/ckpt")
  incomplete=$(find "$run_dir/ckpt" -mindepth 1 -maxdepth 1 -type d '!' -exec test -e '{}/manifest.json' ';' -print)
  [[ -z $incomplete ]] || fail "directories without a manifest left under ckpt/: $incomplete"
  "$KEEL" checkpoints --dir "$mine" --verify yes >"$tmp/verify.log" 2>&1 || fail "keel checkpoints --verify: $(tail -3 "$tmp/verify.log")"
  "$KEEL" checkpoints --dir "$theirs" --verify yes >>"$tmp/verify.log" 2>&1 || fail "keel checkpoints --verify: $(tail -3 "$tmp/verify.log")"
  planes=$(python3 - "$mine" "$theirs" <<'EOF'
import json, sys
def sums(d):
    m = json.load(open(d + "/manifest.json"))
    return m["step"], {(c["id"], p): r["sum"] for c in m["chunks"] for p, r in c["planes"].items()}
(step_a, a), (step_b, b) = sums(sys.argv[1]), sums(sys.argv[2])
differ = sorted({p for k, p in a.keys() | b.keys() if a.get((k, p)) != b.get((k, p))})
print(f"step {step_a} vs {step_b}: " + ("equal" if step_a == step_b and not differ else "differ in " + (",".join(differ) or "step")))
EOF
)
  "$KEEL" export --checkpoint "$mine" --out "$tmp/mine.llmc.bin" >/dev/null 2>&1 &&
    "$KEEL" export --checkpoint "$theirs" --out "$tmp/theirs.llmc.bin" >/dev/null 2>&1 &&
    cmp -s "$tmp/mine.llmc.bin" "$tmp/theirs.llmc.bin" && exported=identical || exported=different
  if [[ $planes == *": equal" && $exported == identical ]]; then
    weights="yes (param, adam_m, adam_v of every chunk, $planes; llm.c export byte-identical)"
  else
    weights="NO ($planes; llm.c export $exported)"
    failed=1
  fi
fi

recoveries=${#recovery_lines[@]}
total_s=$(elapsed "$t_start")
echo
echo "== Recovery under repeated SIGKILL (bench/chaos.sh) =="
printf '%s\n' "${recovery_lines[@]}" | python3 -c '
import math, re, sys
kills, external, in_write, not_fired, launches, preset, ckpt, total, weights = sys.argv[1:10]
times = sorted(float(m.group(1)) for line in sys.stdin
               for m in [re.search(r"\) in (-?[0-9.]+) s: training resumes", line)] if m)
kills = int(kills)
print(f"job:            preset {preset}, 2 ranks, batch 2 x 32, checkpoint every {ckpt} steps, {launches} launches")
print(f"kills:          {kills} ({external} external SIGKILLs at random steps, {in_write} inside checkpoint writes"
      + (f"; {not_fired} planned checkpoint-write kills did not fire and were done from outside" if int(not_fired) else "") + ")")
print(f"recoveries:     {len(times)}")
print(f"recovery rate:  {100.0 * len(times) / kills:.1f} %" if kills else "recovery rate:  -")
if times:
    p99 = times[max(0, math.ceil(0.99 * len(times)) - 1)]
    med = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2
    print(f"recovery time:  median {med:.2f} s, p99 {p99:.2f} s, max {times[-1]:.2f} s")
print(f"final weights equal to an uninterrupted run: {weights}")
print(f"total time:     {float(total):.0f} s")
' "$done_kills" "$external" "$in_write" "$not_fired" "$launch_no" "$preset" "$ckpt_every" "$total_s" "$weights"
((recoveries == done_kills && done_kills == kills)) || failed=1
if ((failed)); then echo "chaos.sh: FAILED (see the messages above)"; exit 1; fi
echo "chaos.sh: OK"
