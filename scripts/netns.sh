#!/usr/bin/env bash
# Several "hosts" on one machine: network namespaces on a private bridge, for running Keel (or any
# OpenMPI program) as if over real hosts. Needs root and iproute2 (ip, tc).
#
#   scripts/netns.sh up N [--rate R] [--delay D] [--slots S]
#                                                  create N namespaces PREFIX0..PREFIX{N-1}
#   scripts/netns.sh run [-n N] [--mca K V]... -- SUBCOMMAND [ARGS...]
#                                                  keel launch across the namespaces (ranks default: N)
#   scripts/netns.sh run --mpirun [-n N] [--mca K V]... -- PROGRAM [ARGS...]
#                                                  plain mpirun of any program across the namespaces
#   scripts/netns.sh args                          the mpirun options that place ranks there (one line)
#   scripts/netns.sh status                        what is up (exit 1 if nothing)
#   scripts/netns.sh down                          remove everything up made (never fails)
#
# Environment: KEEL_NETNS_PREFIX (default keel-h), KEEL_NETNS_STATE (default /tmp/keel-netns-PREFIX),
# KEEL_NETNS_SUBNET (first three octets of a /24, e.g. 10.231.7; default: the first of 10.231.0..255
# that no interface uses), KEEL_NETNS_BURST / KEEL_NETNS_LATENCY (tbf, default 256kb / 50ms),
# KEEL_BINARY (default build/keel next to this script), MPIRUN (default mpirun).
#
# Layout: a bridge kb<H> in the root namespace holds address SUBNET.254; namespace i holds
# SUBNET.(i+1) on eth0, the peer of veth kv<H>-i on the bridge (<H>: 6 hex digits from the prefix, so
# interface names fit 15 characters and `down` finds them without the state directory). With --rate,
# a tbf qdisc shapes both directions: eth0 inside (traffic leaving the host) and kv<H>-i outside
# (traffic reaching it). With --delay (e.g. 0.2ms), a netem qdisc on eth0 delays every packet leaving
# a host by D (one way; a round trip between two hosts takes 2 D), with tbf under it when --rate is
# given too; it needs the kernel's sch_netem, and `up` fails saying so where it is missing. The
# state directory holds the hostfile, the rsh agent and the settings.
#
# Every namespace is a host of --slots slots to OpenMPI, which cannot see that they share this
# machine's cores: with more ranks than cores (nproc), `run` passes mpi_yield_when_idle 1 (unless
# given --mca mpi_yield_when_idle), so a rank waiting in MPI yields its core to one that computes, as
# OpenMPI does by itself for a plain oversubscribed `keel launch`. Measured 2026-12-05 (4 ranks on 2
# cores, bench/simulate_calibration.py, quiet): a one-float all-reduce 7.4 ms polling vs 0.06 ms
# yielding; a 4-rank tensor-parallel step 2,368 ms polling vs 232-288 ms yielding.
set -Eeuo pipefail

PREFIX=${KEEL_NETNS_PREFIX:-keel-h}
STATE=${KEEL_NETNS_STATE:-/tmp/keel-netns-$PREFIX}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KEEL=${KEEL_BINARY:-$(dirname "$HERE")/build/keel}
MPIRUN=${MPIRUN:-mpirun}
HASH=$(printf '%s' "$PREFIX" | cksum | awk '{printf "%06x", $1 % 16777216}')
BRIDGE=kb$HASH
VETH=kv$HASH-  # + index

die() { echo "netns.sh: $*" >&2; exit 1; }
usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

need_tools() {
  if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    die "needs ip and tc from iproute2 (apt-get install iproute2)"
  fi
  [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, veth pairs and a bridge)"
}

# OpenMPI splits plm_rsh_agent at blanks, and the agent lives here.
[[ $STATE != *[[:space:]]* ]] || die "KEEL_NETNS_STATE '$STATE': no blanks, please"
# Ending in a non-digit keeps PREFIX<number> unambiguous (prefix h1 would otherwise own h1x's h10).
[[ $PREFIX =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*[A-Za-z_.-]$ && ${#PREFIX} -le 40 ]] ||
  die "KEEL_NETNS_PREFIX '$PREFIX': use letters, digits, . _ - (at most 40), ending in a non-digit"

# Namespaces with our prefix followed by a number.
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX//./\\.}[0-9]+$" | sort -V || true; }
our_veths() { ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${VETH}[0-9]+$" || true; }
bridge_exists() { ip link show "$BRIDGE" >/dev/null 2>&1; }

teardown() {
  local ns pid
  for ns in $(our_namespaces); do
    # Processes left in a namespace keep it alive; they can only be ours (a job that outlived mpirun).
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns delete "$ns" 2>/dev/null || true
  done
  local v
  for v in $(our_veths); do ip link delete "$v" 2>/dev/null || true; done
  bridge_exists && { ip link delete "$BRIDGE" 2>/dev/null || true; }
  rm -rf -- "$STATE"
}

subnet_in_use() { ip -4 -o addr show 2>/dev/null | awk '{print $4}' | grep -q "^${1//./\\.}\."; }

pick_subnet() {
  if [[ -n ${KEEL_NETNS_SUBNET:-} ]]; then
    [[ $KEEL_NETNS_SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "KEEL_NETNS_SUBNET: expected three octets, e.g. 10.231.0"
    subnet_in_use "$KEEL_NETNS_SUBNET" && die "subnet $KEEL_NETNS_SUBNET.0/24 is already in use here"
    echo "$KEEL_NETNS_SUBNET"; return
  fi
  local i
  for i in $(seq 0 255); do subnet_in_use "10.231.$i" || { echo "10.231.$i"; return; }; done
  die "no free /24 in 10.231.0.0/16; set KEEL_NETNS_SUBNET"
}

cmd_up() {
  local n="" rate="" delay="" slots=1
  while [[ $# -gt 0 ]]; do
    case $1 in
      --rate) [[ $# -ge 2 ]] || die "--rate needs a value (e.g. 1gbit)"; rate=$2; shift 2 ;;
      --delay) [[ $# -ge 2 ]] || die "--delay needs a value (e.g. 0.2ms)"; delay=$2; shift 2 ;;
      --slots) [[ $# -ge 2 ]] || die "--slots needs a value"; slots=$2; shift 2 ;;
      -*) die "up: unknown option $1" ;;
      *) [[ -z $n ]] || die "up: unexpected argument $1"; n=$1; shift ;;
    esac
  done
  [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 253 ]] || die "up: expected a number of namespaces 1..253, found '${n}'"
  [[ $slots =~ ^[0-9]+$ && $slots -ge 1 ]] || die "up: --slots: expected a positive number, found '$slots'"
  [[ -z $delay || $delay =~ ^[0-9.]+(us|ms|s)$ ]] || die "up: --delay: expected a time such as 0.2ms, found '$delay'"
  need_tools

  # Serialise against other `up`s choosing a subnet at the same time.
  exec 9>/tmp/keel-netns.lock
  if command -v flock >/dev/null 2>&1; then flock 9; fi

  if [[ -f $STATE/settings ]]; then
    local want_n=$n want_rate=$rate want_delay=$delay
    # shellcheck disable=SC1091
    source "$STATE/settings"
    local missing=0 i
    for ((i = 0; i < NS_COUNT; i++)); do ip netns pids "$PREFIX$i" >/dev/null 2>&1 || missing=1; done
    if [[ $missing -eq 0 && $NS_COUNT == "$want_n" && $NS_RATE == "$want_rate" && ${NS_DELAY:-} == "$want_delay" ]]; then
      echo "netns.sh: already up: $NS_COUNT namespaces ${PREFIX}0..${PREFIX}$((NS_COUNT - 1)) on $NS_SUBNET.0/24" >&2
      echo "$STATE"; return 0
    fi
    die "already up with other settings or partly ($STATE); run: KEEL_NETNS_PREFIX=$PREFIX $0 down"
  fi
  if [[ -n $(our_namespaces) || -n $(our_veths) ]] || bridge_exists; then
    die "namespaces or links of prefix '$PREFIX' exist without state; run: KEEL_NETNS_PREFIX=$PREFIX $0 down"
  fi

  local subnet; subnet=$(pick_subnet)
  # shellcheck disable=SC2154  # rc is set inside the trap
  trap 'rc=$?; echo "netns.sh: up failed; removing what it made" >&2; teardown; exit $rc' ERR
  trap 'teardown; exit 130' INT TERM
  mkdir -p "$STATE"

  ip link add "$BRIDGE" type bridge stp_state 0
  ip addr add "$subnet.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local burst=${KEEL_NETNS_BURST:-256kb} latency=${KEEL_NETNS_LATENCY:-50ms} i ns
  for ((i = 0; i < n; i++)); do
    ns=$PREFIX$i
    ip netns add "$ns"
    ip link add "$VETH$i" type veth peer name eth0 netns "$ns"
    ip link set "$VETH$i" master "$BRIDGE"
    ip link set "$VETH$i" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [[ -n $rate ]]; then
      tc qdisc add dev "$VETH$i" root tbf rate "$rate" burst "$burst" latency "$latency"
    fi
    if [[ -n $delay ]]; then
      if ! ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem delay "$delay" 2>"$STATE/netem.err"; then
        echo "netns.sh: --delay $delay: tc cannot add a netem qdisc ($(tr -d '\n' <"$STATE/netem.err")): this kernel lacks sch_netem" >&2
        false
      fi
      if [[ -n $rate ]]; then
        ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: tbf rate "$rate" burst "$burst" latency "$latency"
      fi
    elif [[ -n $rate ]]; then
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency "$latency"
    fi
  done
  for ((i = 0; i < n; i++)); do echo "$PREFIX$i slots=$slots"; done >"$STATE/hostfile"
  # OpenMPI's rsh launcher runs: AGENT HOST COMMAND... and expects COMMAND to run on HOST. The agent
  # inherits mpirun's environment and working directory (no ssh in between), and so does orted.
  # Each host gets its own hostname (a UTS namespace) and TMPDIR, as separate machines have: with one
  # hostname and one /tmp the orteds create the same session directories at the same moment, and
  # now and then one fails ("mkdir /tmp/ompi.HOST.0/jf.N: File exists").
  cat >"$STATE/rsh-agent" <<EOF
#!/bin/sh
# OpenMPI plm_rsh_agent: "run COMMAND on HOST" = run it in network namespace HOST.
host=\$1
shift
TMPDIR=$STATE/tmp/\$host
export TMPDIR
mkdir -p "\$TMPDIR"
if command -v unshare >/dev/null 2>&1; then
  exec ip netns exec "\$host" unshare --uts /bin/sh -c 'hostname "\$0" && exec /bin/sh -c "\$1"' "\$host" "\$*"
fi
exec ip netns exec "\$host" /bin/sh -c "\$*"
EOF
  chmod +x "$STATE/rsh-agent"
  cat >"$STATE/settings" <<EOF
NS_COUNT=$n
NS_RATE=$rate
NS_DELAY=$delay
NS_SUBNET=$subnet
NS_SLOTS=$slots
EOF
  # Every namespace answers on the bridge before we call it up (where ping exists).
  if command -v ping >/dev/null 2>&1; then
    for ((i = 0; i < n; i++)); do
      ip netns exec "$PREFIX$i" ping -c1 -W2 "$subnet.254" >/dev/null ||
        { echo "netns.sh: $PREFIX$i cannot reach $subnet.254 over the bridge" >&2; false; }
    done
  fi
  trap - ERR INT TERM
  echo "netns.sh: up: $n namespaces ${PREFIX}0..${PREFIX}$((n - 1)) on $subnet.0/24 (bridge $BRIDGE${rate:+, tbf $rate each way}${delay:+, netem delay $delay})" >&2
  echo "$STATE"
}

load_state() {
  [[ -f $STATE/settings ]] || die "nothing is up for prefix '$PREFIX' (no $STATE); run: $0 up N"
  # shellcheck disable=SC1091
  source "$STATE/settings"
}

# The mpirun options that put one process per slot into the namespaces and keep MPI traffic there.
# orte_leave_session_attached: orted stays a child of the agent instead of daemonizing, so a daemon
# that dies is reported (with its stderr) instead of leaving mpirun waiting for it forever.
# rtc_hwloc_vmhole none: OpenMPI 4.1's orted otherwise maps a shared copy of the topology into a
# guessed hole of its address space and now and then segfaults there (hwloc_shmem_topology_write).
mpi_args() {
  # shellcheck disable=SC2054  # tcp,self is one value
  ARGS=(--hostfile "$STATE/hostfile"
        --mca plm_rsh_agent "$STATE/rsh-agent"
        --mca plm_rsh_no_tree_spawn 1
        --mca btl tcp,self
        --mca btl_tcp_if_include "$NS_SUBNET.0/24"
        --mca oob_tcp_if_include "$NS_SUBNET.0/24"
        --mca orte_leave_session_attached 1
        --mca rtc_hwloc_vmhole none)
}

cmd_args() { load_state; mpi_args; printf '%q ' "${ARGS[@]}"; echo; }

cmd_run() {
  load_state
  local ranks=$NS_COUNT raw=0 extra=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      -n) [[ $# -ge 2 ]] || die "run: -n needs a value"; ranks=$2; shift 2 ;;
      --mca) [[ $# -ge 3 ]] || die "run: --mca needs KEY VALUE"; extra+=(--mca "$2" "$3"); shift 3 ;;
      --mpirun) raw=1; shift ;;
      --) shift; break ;;
      *) die "run: unexpected '$1' (usage: $0 run [--mpirun] [-n N] [--mca K V]... -- COMMAND ...)" ;;
    esac
  done
  [[ $# -gt 0 ]] || die "run: missing the command after --"
  mpi_args
  if (( ranks > $(nproc) )) && [[ " ${extra[*]} " != *" mpi_yield_when_idle "* ]]; then
    extra+=(--mca mpi_yield_when_idle 1)
  fi
  export PMIX_MCA_gds=${PMIX_MCA_gds:-hash}  # harmless PMIx dstore errors otherwise
  if [[ $raw -eq 1 ]]; then
    if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
    local mpi=("$MPIRUN" -n "$ranks" --oversubscribe --bind-to none "${ARGS[@]}" "${extra[@]}" "$@")
  else
    [[ -x $KEEL ]] || die "keel binary $KEEL not found (build it, or set KEEL_BINARY)"
    local hostfile=("${ARGS[@]:0:2}") mca=("${ARGS[@]:2}")
    local mpi=("$KEEL" launch -n "$ranks" "${hostfile[@]}" "${mca[@]}" "${extra[@]}" -- "$@")
  fi
  echo "netns.sh: $(printf '%q ' "${mpi[@]}")" >&2
  exec "${mpi[@]}"
}

cmd_status() {
  local nss; nss=$(our_namespaces)
  if [[ ! -f $STATE/settings && -z $nss ]] && ! bridge_exists; then
    echo "netns.sh: nothing up for prefix '$PREFIX'"; return 1
  fi
  if [[ -f $STATE/settings ]]; then
    # shellcheck disable=SC1091
    source "$STATE/settings"
    echo "state: $STATE (hostfile $STATE/hostfile, agent $STATE/rsh-agent)"
    echo "subnet: $NS_SUBNET.0/24, bridge $BRIDGE ($NS_SUBNET.254), rate: ${NS_RATE:-unshaped}, delay: ${NS_DELAY:-none}, slots: $NS_SLOTS"
  else
    echo "state: missing ($STATE); leftovers below; run: $0 down"
  fi
  local ns
  for ns in $nss; do
    printf '%s: %s, processes: %s\n' "$ns" \
      "$(ip -n "$ns" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}')" \
      "$(ip netns pids "$ns" 2>/dev/null | wc -l)"
  done
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
  up) cmd_up "$@" ;;
  down)
    # Nothing to remove without iproute2; otherwise remove whatever of ours exists, ignoring errors.
    if command -v ip >/dev/null 2>&1; then
      if [[ -n $(our_namespaces) || -n $(our_veths) || -d $STATE ]] || bridge_exists; then
        [[ $(id -u) -eq 0 ]] || die "down: needs root to remove namespaces and links of prefix '$PREFIX'"
      fi
      teardown
    else
      rm -rf -- "$STATE"
    fi
    echo "netns.sh: down (prefix '$PREFIX')" >&2 ;;
  run) cmd_run "$@" ;;
  args) cmd_args ;;
  status) need_tools; cmd_status ;;
  *) usage ;;
esac
