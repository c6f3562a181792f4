#!/usr/bin/env python3
"""`keel simulate` calibrated on this machine: every local configuration run for real and predicted,
side by side, with the error of each prediction (target: within 10 %).

The job: model d4 (L4 C256 H4, vocabulary 8192, ~5.3M parameters: 21 MB of float32 gradients),
random tokens, 4 micro-batches of 2 sequences of 128 tokens per replica and step, 1 thread per rank.
Ranks run as hosts in network namespaces joined by veth pairs through a bridge (scripts/netns.sh),
real TCP between them, on two links:
  unshaped  the veth links as they are
  shaped    tbf at --rate (default 1gbit) each way
Configurations (each predicted from a separate profiling run, below): 1 rank; 2 and 4 ranks on each link with ZeRO 0, 1 and 2, HybridGC (sync.codec=hybrid,
no uncompressed warm-up), a 2-stage pipeline (1f1b; on 4 ranks 2 replicas of it), tensor
parallelism over all the ranks (parallel.tensor = 2 on 2 ranks, 4 on 4); and data 2 x tensor 2 on
4 unshaped ranks; a mixture of experts (llama-moe-d4: 8 experts, top-2, a shared expert) on 2 ranks
of each link without and with expert parallelism (parallel.expert = 1, 2), predicted from a
profiling run of that model, each exchange priced by the probe's all-to-all fit at the exchange's
sizes (below). A tensor-parallel configuration is predicted on a cluster file whose node is its
tensor group (devices_per_node = T, nodes = ranks / T) and whose [intra] link is the tensor
group's all-reduce as the collective probe measures it (below); its step lines'
tensor_allreduce_bytes are printed beside the simulator's (they must be equal).

What the simulator is given, all measured here before or beside the runs, none fitted to them:
  * per-layer F, B, W: the layer_costs line of a profiling run per rank count and repeat (ZeRO-0,
    uncompressed, unshaped, 3 x the timed steps; ranks that share this machine's cores slow each
    other, so a "device" here is a rank at that count), run just before that count's
    configurations: every configuration is predicted from a run other than its own;
  * the link: bench/collective_probe.cpp across the namespaces at each rank count, over groups of
    the configuration's data group's size among them, every group at once (a 4-rank pipeline's
    pairs among 4 ranks on the cores; since 2026-12-05, before: that many ranks alone): GradSync's
    bucketed all-reduce of the model's gradient bytes through Keel's communicator, as the
    bandwidth a ring would need for its time (OpenMPI's algorithm on TCP is not a ring: this is
    what the collective reaches), and a one-float all-reduce for the latency; a TCP stream and
    round trip between two namespaces are printed beside it; and OpenMPI's other collectives the
    trainer calls, each at its own rate as a ring's bandwidth (its non-blocking algorithms are not
    its blocking ones): GradSync's bucketed reduce-scatter (ZeRO-2), ZeRO-1/2's blocking all-gather
    of the parameters, a blocking all-reduce of GPT-2's tied wte (a pipeline's tied sum). With more
    ranks than cores every run and probe waits yielding (scripts/netns.sh passes mpi_yield_when_idle
    1: each namespace is a one-slot host, so OpenMPI would poll); --poll runs them polling, as every
    run here did before 2026-12-05, with the yielding probe printed beside for comparison only;
  * a tensor group's all-reduces: the same probe across the namespaces with the job's rank count
    split into groups of T (all groups at once, as the job runs them), replaying one step of the
    trainer's blocking all-reduces in the trainer's order and sizes (per micro-batch: the
    embedding's N x C floats, two N x C per block in forward, the vocabulary-parallel loss's N
    doubles and 2 N floats, the head's N x C input gradient, two N x C per block in backward; N =
    tokens per micro-batch), each after the compute the trainer does before it (that layer's
    share of the profiling run's F, or B + W, over T), spun as CPU time (the profile's wall time
    times min(1, cores / ranks)): with more ranks than cores a rank that waits for a core reaches
    its next call late, as the trainer's do, and a shaped link's token bucket refills only as much
    as the trainer's own gaps let it; in the last micro-batch the data group's sync (each layer's
    gradient bytes over T, non-blocking, over the ranks / T data ranks) starts after each layer's
    backward and is waited for at the step's end, as GradSync does. Five steps timed after one;
    per size the mean of its calls (a call that waits for a time slice is part of what a step adds
    up to); in every repeat just after that rank count's profiling run. A line latency + bytes /
    bandwidth fitted to those points (least squares) is the tensor group's link: the cluster file's
    [intra] latency and bandwidth are set so that the simulator's ring formula gives that line,
    times what the calls add to the replayed steps' wall time as a share of their own times (the
    probe replays five steps with the calls and five without, the gaps and the data group's sync
    alone: collective_probe's `added`). That share is about 1 with no more ranks than cores; with
    more, a rank waiting in a call waits partly for peers computing on the cores it would share,
    time the profile's layer costs (measured with every rank computing) already hold. An expert
    group's all-to-all probe (below) is scaled the same way (its loop against its gaps alone).
    The earlier probe (the three sizes in turn, each after a quarter of a block's F + B + W over T
    of wall time) runs beside it and predicts the same runs, for comparison;
  * the device's memory bandwidth (AdamW's traffic) and the codecs' throughput: `keel simulate
    --probe yes` (a streaming triad and Keel's own codecs, one thread, on this machine), times
    min(1, cores / ranks): ranks beyond the cores share them.
  * the per-step overhead outside the model: each profiling run's median step less what the model
    predicts for that run from its own costs. A one-rank profile's is a few ms either way; a
    data-parallel profile's (+7 to +72 ms) is its sync's cost beyond the model's exposed sync, so
    each configuration carries it in proportion to the bytes its own data-parallel sync sends per
    rank and step (the simulator's sync_sent_bytes against the profile's): a tensor-parallel or
    pipeline row without a data group none, HybridGC's its compressed share (--per-call: the whole
    of it everywhere, and collectives at their calls' own times, as before 2026-12-05 11:00).
These go into a cluster file per link, rank count and repeat (written beside the results), and `keel simulate --json yes`
predicts each configuration's step. Measured: the median over repeats of each run's median step
time; predicted: the median over repeats of the predictions from that repeat's profile. Exit status 0 whatever the errors; non-zero only when a run fails.

Usage: bench/simulate_calibration.py [--steps N] [--warmup N] [--repeats R] [--rate R] [--only LIST]
                                     [--out FILE] [--report FILE] [--repredict FILE [--one-rate] [--per-call]]
                                     [--poll]
  --steps N     timed steps per run (default 8), after --warmup N untimed (default 3)
  --repeats R   runs of each configuration (default 2), alternating
  --only LIST   configurations by name (default all; see the table)
  --out FILE    also write every result as a JSON line; --report FILE prints the table from one
  --poll        runs and probes of more ranks than cores with OpenMPI's mpi_yield_when_idle 0: ranks
                that wait poll, holding their core (the default yields, as scripts/netns.sh does)
  --repredict FILE  predicts an --out file's runs again with this keel (no run); --one-rate: as the
                bench priced them before 2026-12-05 (every collective at the all-reduce's rate, each
                data group by the probe of that many ranks alone); --per-call: as before 2026-12-05
                11:00 (collectives at their calls' own times, every row its profile's whole overhead)
Environment: KEEL (default build/keel), RUN_TIMEOUT (seconds per run, default 900). Needs root and
iproute2.
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import netns_sh, run_logged, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
NETNS = os.path.join(ROOT, "scripts", "netns.sh")
RUN_TIMEOUT = int(os.environ.get("RUN_TIMEOUT", "900"))
TARGET = 0.10
# --poll: OpenMPI's ranks poll while they wait, where a run has more ranks than cores (each
# namespace is a one-slot host: scripts/netns.sh then passes mpi_yield_when_idle 1 unless told).
POLL = []


def wait_mca(ranks):
    """The mpirun options of a run or probe of `ranks` ranks: --poll's, beyond the cores."""
    return ["--mca", "mpi_yield_when_idle", "0"] if POLL and ranks > (os.cpu_count() or 1) else []
D4_PARAMETERS = 5322240  # model d4's parameters (its run event says so)
D4_WIDTH = 256  # model d4's n_embd
D4_TIED_BYTES = 8192 * D4_WIDTH * 4  # GPT-2's tied wte (padded vocabulary x C floats): a pipeline's sum

JOB = ["model.preset=d4", "train.batch_size=2", "train.grad_accum=4", "train.seq_len=128", "train.eval_batches=1",
       "train.eval_every=0", "train.sample_tokens=0", "train.checkpoint_every=0", "train.log_every=1",
       "runtime.threads=1", "sync.warmup_steps=0", "data.tokenizer="]

# name, ranks, link, settings beyond JOB
CONFIGS = [("1 rank", 1, "none", [])]
for _r in (2, 4):
    for _link in ("unshaped", "shaped"):
        CONFIGS += [
            ("%dr %s zero0" % (_r, _link), _r, _link, []),
            ("%dr %s zero1" % (_r, _link), _r, _link, ["parallel.zero=1"]),
            ("%dr %s zero2" % (_r, _link), _r, _link, ["parallel.zero=2"]),
            ("%dr %s hybrid" % (_r, _link), _r, _link, ["sync.codec=hybrid"]),
            ("%dr %s pipeline2" % (_r, _link), _r, _link, ["parallel.pipeline=2", "parallel.schedule=1f1b"]),
            ("%dr %s tensor%d" % (_r, _link, _r), _r, _link, ["parallel.tensor=%d" % _r]),
        ]
CONFIGS += [("4r unshaped data2 tensor2", 4, "unshaped", ["parallel.tensor=2"])]
# A mixture of experts (llama-moe-d4: 8 experts, top-2, one shared expert) on 2 data-parallel ranks,
# without expert parallelism and with parallel.expert = 2 (each rank runs 4 experts' products for
# both ranks' tokens, the rows exchanged by all-to-alls).
MOE = ["model.preset=llama-moe-d4"]
MOE_EXPERTS, MOE_TOP_K = 8, 2  # llama-moe-d4's (src/core/config.cpp presets)
for _link in ("unshaped", "shaped"):
    CONFIGS += [("2r %s moe expert1" % _link, 2, _link, MOE), ("2r %s moe expert2" % _link, 2, _link, MOE + ["parallel.expert=2"])]
# On 4 unshaped ranks: P = 2 holds each expert on 2 of the 4 data ranks, its gradient summed between them.
CONFIGS += [("4r unshaped moe expert1", 4, "unshaped", MOE), ("4r unshaped moe expert2", 4, "unshaped", MOE + ["parallel.expert=2"])]


def tensor_of(cfg):
    return next((int(x.split("=")[1]) for x in cfg[3] if x.startswith("parallel.tensor=")), 1)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def group_of(cfg):
    """The rank count whose collective probe prices a configuration's data group and stage link:
    its data-parallel group (at least 2: a pipeline's tied sum runs between 2 ranks), None on 1 rank."""
    pipeline = next((int(x.split("=")[1]) for x in cfg[3] if x.startswith("parallel.pipeline=")), 1)
    return max(2, cfg[1] // pipeline // tensor_of(cfg)) if cfg[1] > 1 else None


def expert_of(cfg):
    return next((int(x.split("=")[1]) for x in cfg[3] if x.startswith("parallel.expert=")), 1)


def is_moe(cfg):
    return any(x in MOE for x in cfg[3])


def profile_of(cfg):
    """The profiling run whose layer costs stand for every configuration of this rank count and model."""
    return "profile %dr%s" % (cfg[1], " moe" if is_moe(cfg) else "")


def profile_cfg(cfg):
    return (profile_of(cfg), cfg[1], "unshaped" if cfg[1] > 1 else "none", tuple(MOE) if is_moe(cfg) else ())


def netns(prefix, *args, check=True):
    return netns_sh(NETNS, KEEL, prefix, "simulate_calibration.py", *args, check=check)


def netns_subnet(prefix):
    state = os.environ.get("KEEL_NETNS_STATE", "/tmp/keel-netns-" + prefix)
    for line in open(os.path.join(state, "settings")):
        if line.startswith("NS_SUBNET="):
            return line.split("=", 1)[1].strip().strip("'\"")
    sys.exit("simulate_calibration.py: no NS_SUBNET in %s/settings" % state)


# A TCP stream and a ping-pong between namespace 0 (server) and 1 (client), in Python sockets.
SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(200):                       # ping-pong: echo 8 bytes
    b = b""
    while len(b) < 8: b += c.recv(8 - len(b))
    c.sendall(b)
total = 0
while True:                                # stream: count until closed, then answer
    b = c.recv(1 << 20)
    if not b or b.endswith(b"END!"): total += len(b); break
    total += len(b)
c.sendall(b"%d" % total); c.close()
"""
CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(200):
    t = time.perf_counter(); c.sendall(b"12345678"); b = b""
    while len(b) < 8: b += c.recv(8 - len(b))
    rtts.append(time.perf_counter() - t)
rtts.sort()
chunk = b"x" * (1 << 20); n = int(sys.argv[3]) << 20
t = time.perf_counter(); sent = 0
while sent < n: c.sendall(chunk); sent += len(chunk)
c.sendall(b"END!"); c.shutdown(socket.SHUT_WR); c.recv(64)
dt = time.perf_counter() - t
print(rtts[len(rtts) // 2] * 1e6, sent * 8 / dt / 1e9)
"""


def measure_link(prefix, mb):
    """Median round trip (us) and stream throughput (Gbit/s) from namespace 1 to namespace 0."""
    subnet = netns_subnet(prefix)
    host = subnet + ".1"
    srv = subprocess.Popen(["ip", "netns", "exec", prefix + "0", sys.executable, "-c", SERVER, host, "47731"],
                           stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        out = subprocess.run(["ip", "netns", "exec", prefix + "1", sys.executable, "-c", CLIENT, host, "47731", str(mb)],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            sys.exit("simulate_calibration.py: link measurement failed: " + out.stderr.strip())
        rtt_us, gbit = map(float, out.stdout.split())
    finally:
        srv.wait(timeout=60)
    return rtt_us, gbit


def probe():
    """`keel simulate --probe yes`: this machine's memory bandwidth and codec rates (one thread), as
    (hbm_gbps, the [codecs] lines)."""
    p = subprocess.run([KEEL, "simulate", "--probe", "yes"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("simulate_calibration.py: keel simulate --probe yes: " + p.stderr.strip())
    hbm, codecs, in_codecs = None, [], False
    for line in p.stdout.splitlines():
        if line.startswith("[codecs]"):
            in_codecs = True
        elif line.startswith("hbm_gbps"):
            hbm = float(line.split("=")[1].split("#")[0])
        elif in_codecs and "=" in line:
            codecs.append(line)
    return hbm, "\n".join(codecs)


PROBE = os.environ.get("KEEL_COLLECTIVE_PROBE", os.path.join(os.path.dirname(KEEL), "bench", "keel_collective_probe"))


def collective(prefix, ranks, nbytes, tensor_sizes=(), tensor_group=None, gap_ms=0.0, alltoall_sizes=(), expert_group=None,
               mca=(), plain_group=None):
    """bench/collective_probe.cpp across `ranks` namespaces: GradSync's bucketed all-reduce of
    `nbytes` (and, with `tensor_sizes`, groups of `tensor_group` ranks' blocking all-reduces of each
    size), as the JSON line it prints."""
    env = dict(os.environ, KEEL_NETNS_PREFIX=prefix, KEEL_BINARY=KEEL, OMP_NUM_THREADS="1")
    extra = ["8388608", "5", "262144", ",".join(str(b) for b in tensor_sizes) or "0", str(tensor_group or ranks),
             "%.3f" % gap_ms, ",".join(str(b) for b in alltoall_sizes) or "0", str(expert_group or ranks), str(D4_TIED_BYTES),
             str(plain_group or ranks)]
    p = subprocess.run(["bash", NETNS, "run", "--mpirun", "-n", str(ranks)] + (list(mca) or wait_mca(ranks)) + ["--", PROBE, str(nbytes)] + extra,
                       capture_output=True, text=True, env=env, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.exit("simulate_calibration.py: collective probe on %d ranks failed: %s" % (ranks, (p.stdout + p.stderr)[-2000:]))
    return json.loads(lines[-1])


def tensor_sizes():
    """The bytes of the all-reduces the trainer hands a tensor group (comm/tensor_parallel.cpp),
    for JOB: the loss's N floats and N doubles, the activations' N x C floats."""
    opts = dict(x.split("=", 1) for x in JOB)
    n = int(opts["train.batch_size"]) * int(opts["train.seq_len"])
    return [4 * n, 8 * n, 4 * n * D4_WIDTH]


def tensor_step_sequence(costs_path, T, ranks, cores):
    """One step of the trainer's tensor-group all-reduces for JOB, in order, as the probe's
    "bytes:gap_ms:dp_bytes" items (bench/collective_probe.cpp): per micro-batch the embedding's
    forward sum after its forward; per block two after halves of its forward (attention, then MLP);
    the cross-entropy's maxima (N doubles) and sums (2 N floats) after the head's forward; the head's
    input gradient after its B; per block two after halves of its B (MLP, then attention); each
    layer's W after its B's calls (GPT::backward: B, then W, layer by layer). Each gap is the
    layer's share of the profiling run's F, B or W over T, in CPU time
    (the profile's wall time times min(1, cores / ranks): ranks beyond the cores share them). In the
    last micro-batch each layer's gradient (its param bytes over T) starts the data group's
    all-reduce once its backward is done, as GradSync starts a bucket (the data group: ranks / T)."""
    lc = json.load(open(costs_path))
    f, bi, bw, params = lc["forward"], lc["backward_input"], lc["backward_weight"], lc["param_bytes"]
    opts = dict(x.split("=", 1) for x in JOB)
    n = int(opts["train.batch_size"]) * int(opts["train.seq_len"])
    act, share, head = 4 * n * D4_WIDTH, min(1.0, cores / float(ranks)), len(f) - 1
    out = []

    def item(nbytes, ms, dp=0):
        out.append("%d:%.4f:%d" % (nbytes, ms * share / T, dp))

    accum = int(opts["train.grad_accum"])
    for mb in range(accum):
        last = mb == accum - 1
        item(act, f[0])
        for i in range(1, head):
            item(act, f[i] / 2)
            item(act, f[i] / 2)
        item(8 * n, f[head])
        item(8 * n, 0.0)
        # (a layer's B, with the all-reduces in it, then its W: GPT::backward; W's gradients are
        # ready, and their bucket's sync starts, once W is done)
        item(act, bi[head])
        item(0, bw[head], int(params[head] / T) if last else 0)
        for i in range(head - 1, 0, -1):
            item(act, bi[i] / 2)
            item(act, bi[i] / 2)
            item(0, bw[i], int(params[i] / T) if last else 0)
        item(0, bi[0] + bw[0], int(params[0] / T) if last else 0)
    return ",".join(out)


def mean_block_ms(costs_path):
    """A profiling run's mean F + B + W of one block (its layer_costs line, the blocks between the
    embedding and the head), in ms: the compute a probe spins between two calls is a share of it."""
    lc = json.load(open(costs_path))
    return statistics.mean(lc["forward"][i] + lc["backward_input"][i] + lc["backward_weight"][i]
                           for i in range(1, len(lc["forward"]) - 1))


def collective_text(c):
    """The probe's collectives at one rank count, as one line."""
    out = "all-reduce of %.1f MB in %.1f ms (a ring at %.3f Gbit/s), one float %.0f us, a %d-byte message %.3f ms" % (
        c["bytes"] / 1e6, c["allreduce_ms"], c["ring_gbit"], c["small_us"], c.get("message_bytes", 0), c.get("message_ms", 0))
    if "allgather_ms" in c:
        out += "; reduce-scatter %.1f ms (%.3f), all-gather %.1f ms (%.3f), blocking all-reduce of %.1f MB %.1f ms (%.3f)" % (
            c["reduce_scatter_ms"], c["reduce_scatter_gbit"], c["allgather_ms"], c["allgather_gbit"],
            c["blocking_bytes"] / 1e6, c["blocking_allreduce_ms"], c["blocking_allreduce_gbit"])
    return out


def points_text(points):
    return ", ".join("%d B %.3f ms (median %.3f)" % (q["bytes"], q["ms"], q["median_ms"]) for q in points)


def fit_line(points):
    """Least squares ms = a + b x bytes over the probe's points: (a ms, b ms per byte)."""
    xs = [p["bytes"] for p in points]
    ys = [p["ms"] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    b = max(b, 1e-12)  # (a flat or falling line: no bandwidth term to speak of)
    return max(0.0, my - b * mx), b


def run_keel(args, log_path, env_extra=None, prefix=None):
    run_logged((prefix or [KEEL]) + args, log_path, ROOT, RUN_TIMEOUT, "simulate_calibration.py", env_extra)


def sets(items):
    out = []
    for s in items:
        out += ["--set", s]
    return out


def train_run(work, cfg, rep, prefixes, tokens, warmup, steps, every=None):
    name, ranks, link, extra = cfg
    run_dir = os.path.join(work, "%s-%d" % (name.replace(" ", "_"), rep))
    items = JOB + extra + ["data.train=" + tokens, "data.val=" + tokens, "train.steps=%d" % (warmup + steps),
                           "train.run_dir=" + run_dir, "monitor.layer_costs_every=%d" % (every or (warmup + steps))]
    log("  %-22s rep %d ..." % (name, rep))
    if ranks == 1:
        run_keel(["train"] + sets(items), run_dir + ".log")
    else:
        prefix = prefixes[link]
        run_keel(["train"] + sets(items), run_dir + ".log", env_extra={"KEEL_NETNS_PREFIX": prefix, "KEEL_BINARY": KEEL},
                 prefix=["bash", NETNS, "run", "-n", str(ranks)] + wait_mca(ranks) + ["--"])
    steps_seen, costs, peak = [], None, None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j.get("event") == "run":
                peak = j.get("peak_gflops")
            elif j.get("event") == "layer_costs":
                costs = j
            elif "loss" in j and j["step"] > warmup:
                steps_seen.append(j)
    tab = sorted(set(s.get("tensor_allreduce_bytes", 0) for s in steps_seen))
    eab = sorted(set(s.get("expert_alltoall_bytes", 0) for s in steps_seen))
    held = sorted(set(s.get("param_bytes", 0) for s in steps_seen))
    sent = sorted(set(round(s.get("sync_sent_bytes", 0)) for s in steps_seen))
    costs_path = run_dir + ".layer_costs.json"
    with open(costs_path, "w") as f:
        json.dump(costs["layer_costs"], f)
    shutil.rmtree(run_dir, ignore_errors=True)
    # (the layer costs also inline: --repredict works once the work directory is gone)
    return {"name": name, "rep": rep, "ms": [s["ms"] for s in steps_seen], "costs": costs_path, "peak_gflops": peak,
            "layer_costs": costs["layer_costs"],
            "sync_exposed_ms": statistics.median([s.get("sync_exposed_ms", 0.0) for s in steps_seen]),
            "tensor_allreduce_bytes": tab, "expert_alltoall_bytes": eab, "param_bytes": held, "sync_sent_bytes": sent,
            # (rank 0's wall time in its tensor group's collectives and its expert group's waits: where a
            # run's layer time goes, for the report; no prediction uses them)
            "tensor_comm_ms": statistics.median([s.get("tensor_comm_ms", 0.0) for s in steps_seen]),
            "expert_wait_ms": statistics.median([s.get("expert_wait_ms", 0.0) for s in steps_seen])}


CLUSTER = """# This machine as `keel simulate` sees it (written by bench/simulate_calibration.py): every rank a
# host in its own network namespace (one device per node), the link between them as measured.
[cluster]
name = "local-{link}"
nodes = {nodes}
devices_per_node = {per_node}

[device]
name = "1 CPU thread"
tflops_bf16 = {tflops}
tflops_fp32 = {tflops}        # the run's peak (MFU); layer costs come measured
memory_gib = 20
hbm_gbps = {mem:.2f}           # keel simulate --probe yes: a streaming triad, one thread
matmul_efficiency = 0.5
step_overhead_ms = {overhead:.2f}     # the profiling run's step beyond its prediction

[host]
memory_gib = 24
pcie_gbps = {mem:.2f}

[intra]
kind = "pcie"
gbps = {intra_gbps:.4f}        # a tensor group's link (GB/s): the collective probe's at T ranks; else memory
latency_us = {intra_lat:.2f}

[network]
gbit = {gbit:.4f}             # bench/collective_probe.cpp: GradSync's all-reduce as a ring's bandwidth
nics_per_node = 1
latency_us = {lat:.2f}          # ... a one-float all-reduce over its 2 (n-1) rounds
# OpenMPI's other collectives the trainer calls, each as a ring's bandwidth (the same probe; 0: gbit):
reduce_scatter_gbit = {reduce_scatter_gbit:.4f}       # GradSync's non-blocking reduce-scatter (ZeRO-2)
allgather_gbit = {allgather_gbit:.4f}            # ZeRO-1/2's blocking all-gather of the parameters
blocking_allreduce_gbit = {blocking_allreduce_gbit:.4f}   # a blocking all-reduce (the pipeline's tied sum)
topology = "fat-tree"
{alltoall}

[codecs]
{codecs}
"""


def predict(work, cfg, cluster_path, costs_path):
    name, ranks, link, extra = cfg
    items = JOB + extra
    cmd = [KEEL, "simulate", "--cluster", cluster_path, "--nodes", str(ranks // tensor_of(cfg)), "--layer-costs", costs_path,
           "--json", "yes"] + sets(items)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit("simulate_calibration.py: %s: %s" % (" ".join(cmd), (p.stdout + p.stderr).strip()[-2000:]))
    return json.loads(p.stdout.strip().splitlines()[-1])


def report(results):
    runs = [r for r in results if r.get("kind") == "run"]
    preds = {}
    for r in results:
        if r.get("kind") == "prediction":
            preds.setdefault(r["name"], []).append(r)
    links = {r["link"]: r for r in results if r.get("kind") == "link"}
    print("\n== keel simulate against runs on this machine: d4, 4 x 2 x 128 tokens per replica and step, 1 thread/rank ==")
    probe = next((r for r in results if r.get("kind") == "probe"), {})
    if probe.get("yield_when_idle"):
        print("(runs and probes of more ranks than cores yielded while they waited)")
    else:
        print("(--poll, or before 2026-12-05: runs and probes of more ranks than cores polled while they waited)")
    for name, l in sorted(links.items()):
        print("link %-9s TCP stream %.3f Gbit/s, round trip %.0f us" % (name, l["gbit"], l["rtt_us"]))
    for o in sorted([r for r in results if r.get("kind") == "overhead"], key=lambda r: (r["ranks"], r["rep"])):
        print("  profile %d ranks rep %d: %.1f ms per step, %.1f predicted from its layer costs: overhead %+.1f ms" % (
            o["ranks"], o["rep"], o["profile_ms"], o["predicted_ms"], o["ms"]))
    for c in [r for r in results if r.get("kind") in ("collective", "collective_yield")]:
        g = c.get("plain_group", c["ranks"])
        print("  %-9s %d ranks%s%s: %s" % (c["link"], c["ranks"], " in groups of %d" % g if g < c["ranks"] else "",
                                           ", yielding (not used)" if c["kind"] == "collective_yield" else "", collective_text(c)))
    for t in [r for r in results if r.get("kind") in ("tensor_probe", "tensor_probe_uniform", "alltoall_probe")]:
        print("  %-9s %d ranks in %s groups of %d, rep %d: %s; fit %.3f ms + bytes at %.3f GB/s" % (
            t["link"], t["ranks"], {"tensor_probe": "tensor (a step's sequence)", "tensor_probe_uniform": "tensor (earlier probe)",
                                    "alltoall_probe": "expert"}[t["kind"]], t["group"], t["rep"],
            ", ".join("%d B %.3f ms" % (q["bytes"], q["ms"]) for q in t["points"]), t["latency_ms"], 1e-6 / t["ms_per_byte"]))
        if t.get("added"):
            print("  %-9s   the calls add %.1f of their %.1f ms to the loop's wall time (%.1f ms, gaps alone %.1f): share %.3f" % (
                "", t["added"]["loop_ms"] - t["added"]["gaps_ms"], t["added"]["calls_ms"], t["added"]["loop_ms"],
                t["added"]["gaps_ms"], t["added"]["share"]))
    print("%-26s %10s %10s %8s %10s %10s  %s" % ("configuration", "measured", "predicted", "error", "sync exp.",
                                                 "predicted", "layer costs from"))
    worst = 0.0
    for cfg in CONFIGS:
        name = cfg[0]
        reps = [r for r in runs if r["name"] == name]
        if not reps or name not in preds:
            continue
        meas = statistics.median([statistics.median(r["ms"]) for r in reps])
        p = {k: statistics.median([x[k] for x in preds[name]]) for k in ("step_ms", "sync_exposed_ms")}
        err = p["step_ms"] / meas - 1
        worst = max(worst, abs(err))
        exp_meas = statistics.median([r["sync_exposed_ms"] for r in runs if r["name"] == name])
        print("%-26s %8.1f ms %8.1f ms %+7.1f%% %8.1f ms %8.1f ms  %s" % (
            name, meas, p["step_ms"], 100 * err, exp_meas, p["sync_exposed_ms"], profile_of(cfg)))
        if expert_of(cfg) > 1:
            counted = sorted(set(b for r in reps for b in r.get("expert_alltoall_bytes", [])))
            predicted = sorted(set(int(x.get("expert_alltoall_bytes", 0)) for x in preds[name]))
            print("%-26s expert_alltoall_bytes per step: runs %d..%d (rank 0's, as routed), simulator %s (balanced)" % (
                "", min(counted), max(counted), predicted))
        if is_moe(cfg) and cfg[1] > 1:
            for key in ("param_bytes", "sync_sent_bytes"):
                counted = sorted(set(b for r in reps for b in r.get(key, [])))
                predicted = sorted(set(int(round(x.get(key, 0))) for x in preds[name]))
                print("%-26s %s (rank 0's): runs %s, simulator %s" % ("", key, counted, predicted))
        uniform = [x["step_ms"] for x in results if x.get("kind") == "prediction_uniform" and x["name"] == name]
        if uniform:
            per_rep = ", ".join("%+.1f %%" % (100 * (x["step_ms"] / statistics.median(r["ms"]) - 1)) for x in preds[name]
                                for r in reps if r["rep"] == x["rep"])
            print("%-26s each repeat %s; the earlier probe (sizes in turn, wall-time gaps) on the same runs: %.1f ms, %+.1f %%" % (
                "", per_rep, statistics.median(uniform), 100 * (statistics.median(uniform) / meas - 1)))
        if tensor_of(cfg) > 1:
            counted = sorted(set(b for r in reps for b in r.get("tensor_allreduce_bytes", [])))
            predicted = sorted(set(x.get("tensor_allreduce_bytes", 0) for x in preds[name]))
            print("%-26s tensor_allreduce_bytes per step: runs %s, simulator %s: %s" % (
                "", counted, [int(x) for x in predicted], "EQUAL" if counted == [int(x) for x in predicted] else "DIFFER"))
            if any("tensor_comm_ms" in r for r in reps):
                print("%-26s the tensor group's collectives: %.1f ms a step in the runs (rank 0's wall time in them), "
                      "simulator %.1f ms" % ("", statistics.median([r["tensor_comm_ms"] for r in reps]),
                                             statistics.median([x["tensor_comm_ms"] for x in preds[name]])))
    print("%s: worst error %.1f %% (target within %.0f %%)" % ("PASS" if worst <= TARGET else "MISS", 100 * worst,
                                                              100 * TARGET))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--report", default="")
    ap.add_argument("--repredict", default="")
    ap.add_argument("--poll", action="store_true",
                    help="runs and probes with more ranks than cores: OpenMPI's ranks poll while they wait")
    ap.add_argument("--yield-when-idle", action="store_true",
                    help="the default since 2026-12-05 (accepted so that earlier commands still run)")
    ap.add_argument("--per-call", action="store_true",
                    help="the pricing before 2026-12-05 11:00, for comparison: a tensor group's or expert group's "
                         "collectives at their calls' own times (not what they add to a step's wall time) and every "
                         "row carrying its profiling run's whole overhead")
    ap.add_argument("--one-rate", action="store_true",
                    help="the pricing before 2026-12-05, for comparison: every collective at the all-reduce's "
                         "rate, each data group by the probe of that many ranks alone")
    a = ap.parse_args()
    if a.report:
        report([json.loads(l) for l in open(a.report) if l.strip()])
        return
    if a.poll:
        POLL.append(True)
    if not os.access(KEEL, os.X_OK):
        sys.exit("simulate_calibration.py: no keel binary at %s (bash scripts/build.sh, or set KEEL)" % KEEL)
    only = set(x.strip() for x in a.only.split(",") if x.strip())
    configs = [c for c in CONFIGS if not only or c[0] in only]
    work = tempfile.mkdtemp(prefix="keel-simcal-")
    results = []
    out = open(a.out, "w") if a.out else None

    def keep(r):
        results.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    if a.repredict:
        # The runs and probes of an earlier --out file (its work directory still holding the layer
        # costs), predicted again by this keel.
        for r in (json.loads(l) for l in open(a.repredict) if l.strip()):
            if r["kind"] in ("run", "profile", "probe", "link", "collective", "collective_yield", "tensor_probe", "tensor_probe_uniform",
                             "alltoall_probe"):
                keep(r)
        probe_line = next(r for r in results if r["kind"] == "probe")
        mem, codec_lines = probe_line["hbm_gbps"], probe_line["codecs"]
        for r in results:
            if r["kind"] in ("profile", "run") and not os.path.exists(r["costs"]) and "layer_costs" in r:
                r["costs"] = os.path.join(work, os.path.basename(r["costs"]))
                with open(r["costs"], "w") as f:
                    json.dump(r["layer_costs"], f)
        missing = [r["costs"] for r in results if r["kind"] == "profile" and not os.path.exists(r["costs"])]
        if missing:
            sys.exit("simulate_calibration.py: --repredict: layer costs gone (%s) and not in the file" % missing[0])
        a.repeats = 1 + max(r["rep"] for r in results if r["kind"] == "profile")
        configs = [c for c in configs if any(r["kind"] == "run" and r["name"] == c[0] for r in results)]
    else:
        tokens = os.path.join(work, "tokens.bin")
        write_tokens(tokens, n=1 << 19, vocab=8192)
        pid = os.getpid() % 1000
        prefixes = {"unshaped": "kcu%d-" % pid, "shaped": "kcs%d-" % pid}
        try:
            netns(prefixes["unshaped"], "up", "4")
            netns(prefixes["shaped"], "up", "4", "--rate", a.rate)
            mem, codec_lines = probe()
            keep({"kind": "probe", "hbm_gbps": mem, "codecs": codec_lines, "yield_when_idle": not POLL, "poll": bool(POLL)})
            grad_bytes = 4 * D4_PARAMETERS
            for link, prefix in prefixes.items():
                rtt, gbit = measure_link(prefix, 400 if link == "unshaped" else 100)
                keep({"kind": "link", "link": link, "gbit": gbit, "rtt_us": rtt, "mem_gbps": mem})
                log("link %s: TCP stream %.3f Gbit/s, round trip %.0f us" % (link, gbit, rtt))
                # Every data group at the job's rank count: groups of g among all the job's ranks,
                # every group at once (a 4-rank pipeline's data groups and tied sums are pairs
                # among 4 ranks on the cores, not 2 ranks alone).
                # (and all of them as one group: a profiling run's)
                for ranks, g in sorted(set((c[1], group_of(c)) for c in configs if c[1] > 1) |
                                       set((c[1], c[1]) for c in configs if c[1] > 1)):
                    c = collective(prefix, ranks, grad_bytes, plain_group=g)
                    c.update({"kind": "collective", "link": link})
                    keep(c)
                    log("  %d ranks%s: %s" % (ranks, " in groups of %d" % g if g < ranks else "", collective_text(c)))
                    if ranks > (os.cpu_count() or 1) and g == ranks and POLL:
                        # Every namespace is a host of one slot holding one rank, so OpenMPI does not
                        # see that the ranks share this machine's cores and its ranks wait by polling
                        # without yielding (mpi_oversubscribe 0; `mpirun` on one host with more ranks
                        # than cores sets it, and with it mpi_yield_when_idle). For comparison only
                        # (no prediction uses it): the same probe with the ranks yielding.
                        c = collective(prefix, ranks, grad_bytes, mca=("--mca", "mpi_yield_when_idle", "1"))
                        c.update({"kind": "collective_yield", "link": link})
                        keep(c)
                        log("  %d ranks, yielding when idle: %s" % (ranks, collective_text(c)))
            # Each repeat: per rank count, a profiling run (ZeRO-0, uncompressed, unshaped; 3 x the
            # timed steps, costs reported every 3 steps so that the smoothed figures forget the
            # warm-up), then every configuration at that count, predicted from that repeat's profile.
            for rep in range(a.repeats):
                for pcfg in sorted(set(profile_cfg(c) for c in configs), key=lambda c: (c[1], c[0])):
                    ranks = pcfg[1]
                    r = train_run(work, (pcfg[0], ranks, pcfg[2], list(pcfg[3])), rep, prefixes, tokens, a.warmup,
                                  3 * a.steps, every=3)
                    r["kind"] = "profile"
                    keep(r)
                    # An expert group's all-to-alls at the trainer's sizes (the routing counts, E int32;
                    # a micro-batch's N x top-k rows of C floats at balanced routing), each after a fifth
                    # of a MoE block's F + B + W (a block exchanges five times a micro-batch).
                    for link, P in sorted(set((c[2], expert_of(c)) for c in configs if expert_of(c) > 1
                                              and profile_of(c) == pcfg[0])):
                        gap = mean_block_ms(r["costs"]) / 5 * min(1.0, (os.cpu_count() or 1) / float(ranks))  # CPU time
                        sizes = [4 * MOE_EXPERTS, tensor_sizes()[0] * MOE_TOP_K * D4_WIDTH]
                        c = collective(prefixes[link], ranks, 4 * 4096, [], ranks, gap, sizes, P)
                        a_ms, b_ms = fit_line(c["alltoall"])
                        keep({"kind": "alltoall_probe", "link": link, "ranks": ranks, "group": P, "rep": rep, "gap_ms": gap,
                              "points": c["alltoall"], "latency_ms": a_ms, "ms_per_byte": b_ms, "added": c.get("alltoall_added")})
                        log("  %s %d ranks in expert groups of %d, %.2f ms apart: %s; fit %.3f ms + bytes at %.3f GB/s" % (
                            link, ranks, P, gap, points_text(c["alltoall"]), a_ms, 1e-6 / b_ms))
                    if is_moe(pcfg):
                        for cfg in [c for c in configs if profile_of(c) == pcfg[0]]:
                            r = train_run(work, cfg, rep, prefixes, tokens, a.warmup, a.steps)
                            r["kind"] = "run"
                            keep(r)
                        continue
                    # The tensor groups' all-reduces at this rank count, measured in each repeat just
                    # after its profile and before its runs (the load of a shared machine moves):
                    # one step's calls in the trainer's order, each after the compute the trainer
                    # does before it (that profile's layer costs over T, in CPU time), the data
                    # group's sync started in the last micro-batch's backward.
                    for link, T in sorted(set((c[2], tensor_of(c)) for c in configs if tensor_of(c) > 1 and c[1] == ranks)):
                        # (and, for comparison on the same runs, the earlier probe: the three sizes
                        # in turn, each after a quarter of a block's F + B + W over T of wall time)
                        gap = mean_block_ms(r["costs"]) / 4 / T
                        for kind, args in (("tensor_probe", ([tensor_step_sequence(r["costs"], T, ranks, os.cpu_count() or 1)], T, 0.0)),
                                           ("tensor_probe_uniform", (tensor_sizes(), T, -gap))):
                            c = collective(prefixes[link], ranks, 4 * 4096, *args)
                            a_ms, b_ms = fit_line(c["tensor"])
                            keep({"kind": kind, "link": link, "ranks": ranks, "group": T, "rep": rep, "gap_ms": gap,
                                  "points": c["tensor"], "latency_ms": a_ms, "ms_per_byte": b_ms, "added": c.get("tensor_added")})
                            log("  %s %d ranks in groups of %d (%s): %s; fit %.3f ms + bytes at %.3f GB/s" % (
                                link, ranks, T, kind, points_text(c["tensor"]), a_ms, 1e-6 / b_ms))
                    for cfg in [c for c in configs if c[1] == ranks and not is_moe(c)]:
                        r = train_run(work, cfg, rep, prefixes, tokens, a.warmup, a.steps)
                        r["kind"] = "run"
                        keep(r)
        finally:
            netns(prefixes["unshaped"], "down", check=False)
            netns(prefixes["shaped"], "down", check=False)
    links = {r["link"]: r for r in results if r["kind"] == "link"}
    peak = next(r["peak_gflops"] for r in results if r["kind"] == "profile")
    cores = os.cpu_count() or 1

    def added_share(probe_line):
        """The share of a probe's call times that its calls add to the wall time of the loop or step
        making them (bench/collective_probe.cpp `added`); 1 with --per-call or for a file from before."""
        added = probe_line.get("added") or {}
        # (with no more ranks than cores a blocking call's time is what it adds: 1, not the probe's
        # measure of it, which is noise around 1 where the calls are short beside their gaps)
        if a.per_call or "share" not in added or probe_line["ranks"] <= cores:
            return 1.0
        return added["share"]

    def cluster_file(link, ranks, rep, overhead, group=None, tensor=1, expert=1, tensor_kind="tensor_probe"):
        # R ranks on this machine's cores: each gets min(1, cores / R) of a core for its codecs and
        # its memory traffic (the layer costs were measured at that sharing already).
        share = min(1.0, cores / float(ranks))
        rates = {"reduce_scatter_gbit": 0.0, "allgather_gbit": 0.0, "blocking_allreduce_gbit": 0.0}
        if ranks == 1:
            gbit, lat = 100.0, 1.0  # no link is used
        else:
            # The link as the collectives of a group of that many ranks see it (OpenMPI's algorithms
            # differ with the group's size; a pipeline's data-parallel groups are smaller than the
            # world, and its tied-embedding sum runs between 2 ranks).
            g = group or ranks
            # The probe of groups of g among this many ranks (--one-rate, and files from before it:
            # g ranks alone, where there is one).
            def probe_of(n):
                return next((r for r in results if r["kind"] == "collective" and r["link"] == link and r["ranks"] == n
                             and r.get("plain_group", n) == g), None)
            c = (probe_of(g) or probe_of(ranks)) if a.one_rate else (probe_of(ranks) or probe_of(g))
            gbit, lat = c["ring_gbit"], c["small_us"] / (2 * (g - 1))
            # The library's other collectives at their own measured rates (0: as gbit; results
            # written before the probe measured them).
            rates = {k: 0.0 if a.one_rate else c.get(k, 0.0) for k in ("reduce_scatter_gbit", "allgather_gbit",
                                                                         "blocking_allreduce_gbit")}
        scaled = []
        for line in codec_lines.splitlines():
            k, v = line.split("=")
            scaled.append("%s= %.3f" % (k, float(v) * share))
        intra_gbps, intra_lat = mem * share, 1.0
        if tensor > 1:
            # The tensor group's all-reduce, fitted to the probe at its own sizes, rank count and
            # grouping (ms = a + b bytes), as the [intra] link of the simulator's ring formula
            # (2 (T-1) latencies + 2 (T-1) / T of the bytes at the link's bandwidth).
            t = next(r for r in results if r["kind"] == tensor_kind and r["link"] == link and r["ranks"] == ranks
                     and r["group"] == tensor and r["rep"] == rep)
            # The calls as they add to a step's wall time: the fit times the probe's added share
            # (1 with no more ranks than cores; below it a waiting rank's peers compute on the cores
            # the profile's layer costs already share out).
            s = added_share(t)
            intra_lat = t["latency_ms"] * s * 1e3 / (2 * (tensor - 1))
            # (a fit with no slope to speak of: the link's largest bandwidth a cluster file takes)
            intra_gbps = min(1e6, 2 * (tensor - 1) / tensor / max(1e-12, t["ms_per_byte"] * s * 1e6))
        alltoall = ""
        if expert > 1:
            # The expert group's exchange, fitted to the probe (ms = a + b bytes sent in all), as the
            # simulator's latency + off-rank bytes ((P-1)/P of them) at alltoall_gbps.
            e = next(r for r in results if r["kind"] == "alltoall_probe" and r["link"] == link and r["ranks"] == ranks
                     and r["group"] == expert and r["rep"] == rep)
            s = added_share(e)
            alltoall = "alltoall_latency_us = %.2f   # bench/collective_probe.cpp's all-to-all fit\nalltoall_gbps = %.6f" % (
                e["latency_ms"] * s * 1e3, min(1e6, (expert - 1) / expert / max(1e-12, e["ms_per_byte"] * s * 1e6)))
        path = os.path.join(work, "local-%s-%d-%d-g%d-t%d-e%d%s.toml" % (link, ranks, rep, group or ranks, tensor, expert,
                                                                      "-uniform" if tensor_kind != "tensor_probe" else ""))
        with open(path, "w") as f:
            f.write(CLUSTER.format(link=link, nodes=1, per_node=tensor, tflops=peak / 1e3, mem=mem * share, gbit=gbit,
                                   lat=lat, intra_gbps=intra_gbps, intra_lat=intra_lat, codecs="\n".join(scaled),
                                   alltoall=alltoall, overhead=overhead, **rates))
        return path

    # Each profiling run calibrates the per-step overhead at its rank count: its median step beyond
    # what the model predicts for it from its own layer costs (the only figure taken from a run).
    # That overhead is what the profile's data-parallel sync costs beyond the model's exposed sync (a
    # one-rank profile's is a few ms either way; the tensor-parallel rows' steps end within their
    # optimizer's time of their layers: docs/simulation.md): each configuration carries it in
    # proportion to the bytes its own data-parallel sync sends per rank and step (the simulator's
    # sync_sent_bytes, the profile's the same way; none without a data group), the whole of it
    # where the profile sends none (one rank), and with --per-call the whole of it everywhere.
    overheads, profile_sync = {}, {}
    for prof in [r for r in results if r["kind"] == "profile"]:
        ranks = int(prof["name"].split()[1][:-1])
        cfg = (prof["name"], ranks, "unshaped" if ranks > 1 else "none", MOE if prof["name"].endswith(" moe") else [])
        p = predict(work, cfg, cluster_file(cfg[2] if ranks > 1 else "none", ranks, prof["rep"], 0.0), prof["costs"])
        overheads[(prof["name"], prof["rep"])] = statistics.median(prof["ms"]) - p["step_ms"]
        profile_sync[(prof["name"], prof["rep"])] = p.get("sync_sent_bytes", 0.0)
        keep({"kind": "overhead", "name": prof["name"], "ranks": ranks, "rep": prof["rep"], "ms": overheads[(prof["name"], prof["rep"])],
              "profile_ms": statistics.median(prof["ms"]), "predicted_ms": p["step_ms"], "sync_sent_bytes": profile_sync[(prof["name"], prof["rep"])]})

    def overhead_of(cfg, rep, group, T):
        whole, sync = overheads[(profile_of(cfg), rep)], profile_sync[(profile_of(cfg), rep)]
        if a.per_call or sync <= 0:
            return whole, 1.0
        p = predict(work, cfg, cluster_file(cfg[2], cfg[1], rep, 0.0, group, T, expert_of(cfg)), costs_of(cfg, rep))
        share = p.get("sync_sent_bytes", 0.0) / sync
        return whole * share, share

    def costs_of(cfg, rep):
        return next(r["costs"] for r in results if r["kind"] == "profile" and r["name"] == profile_of(cfg) and r["rep"] == rep)

    for cfg in configs:
        for rep in range(a.repeats):
            costs = costs_of(cfg, rep)
            T = tensor_of(cfg)
            group = group_of(cfg)
            overhead, overhead_share = overhead_of(cfg, rep, group, T)
            path = cluster_file(cfg[2], cfg[1], rep, overhead, group, T, expert_of(cfg))
            p = predict(work, cfg, path, costs)
            p.update({"kind": "prediction", "name": cfg[0], "rep": rep, "overhead_ms": overhead, "overhead_share": overhead_share})
            keep(p)
            if T > 1 and any(r["kind"] == "tensor_probe_uniform" for r in results):
                path = cluster_file(cfg[2], cfg[1], rep, overhead, group, T, expert_of(cfg),
                                    "tensor_probe_uniform")
                p = predict(work, cfg, path, costs)
                p.update({"kind": "prediction_uniform", "name": cfg[0], "rep": rep})
                keep(p)
    report(results)
    log("cluster files and layer costs: %s" % work)


if __name__ == "__main__":
    main()
