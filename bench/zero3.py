#!/usr/bin/env -S /usr/bin/python3
"""ZeRO-3 side by side (issue 39 item 5), on this machine, 2 ranks, random tokens.

Parts (--part, default all; each figure is printed with the load average it was taken under):
  overlap  Keel ZeRO-2 against ZeRO-3 with and without parallel.zero3_progress_thread (the
           thread that drives the broadcasts started ahead while forward's layers compute), at
           one model (--preset, default "small"), interleaved, --repeats times: median ms per step
           (the steps after the first two), peak RSS per rank.
  fsdp     Keel ZeRO-3 against PyTorch FSDP2 (`fully_shard` on every block and the root, gloo, the
           current PyTorch in bench/.venv) at one GPT-2-shaped model both run (--preset's shape),
           interleaved, --repeats times: peak RSS per rank and tokens/s.
  rows     At one llama (--large, --large-layers), 2 ranks, --large-steps steps: ZeRO-2, ZeRO-3,
           ZeRO-3 + train.recompute = "full", ZeRO-3 + full recompute + bf16 training state, and
           ZeRO-3 + full recompute + bf16 state + a 64 MiB compute tier with the rest (the
           moments) on NVMe (--nvme-dir): parameters, tokens/s, peak RSS per rank, bytes gathered
           and bytes of gradient sync sent per step; a run that fails says why.
  search   The largest llama of a ladder (SEARCH_SHAPES) that takes --large-steps optimizer steps
           on 2 ranks under each of the rows ZeRO-2, ZeRO-3, ZeRO-3 + full recompute, ZeRO-3 +
           full recompute + bf16 state + NVMe tier. First a prediction per row and shape from
           Keel's start-up line (`memory per rank`'s "in all": the tiered planes counted as the
           tiers' device and host budgets; the run is stopped once the line is printed), then real runs, largest predicted fit first, only
           of the shapes predicted within --edge of the memory available when the search began:
           tokens/s, peak RSS per rank, wall per step, NVMe bytes read/written per step and the
           NVMe file's size. Every run is started with oom_score_adj 1000 (the kernel kills it,
           not another process, when memory runs out).
  nvme     A 3B-class llama (--nvme-shape, --large-layers to cut it) under ZeRO-3 + full recompute
           with float32 state, every plane through the tiers (an --nvme-device-mib compute tier, the
           rest on NVMe): the disk checked first (16 B a parameter plus a block's scratch), stopped at its start-up line
           where 2 ranks exceed the memory available, otherwise after --large-steps steps and before
           its end-of-run checkpoint; tier files and run directory removed. Wall per step,
           tokens/s, peak RSS per rank, NVMe bytes per step, tier files' size on disk (and rank 0's
           file: its own slots and the scratch other ranks' pages spilled to).
  largest  Keel ZeRO-3 at --large (default tinyllama-1.1b: 17.6 GB of float32 state) on 2 ranks:
           whether it takes --large-steps optimizer steps, its peak RSS per rank (start-up and
           after the steps), tokens/s, the parameters gathered per step.

Usage: bench/zero3.py [--part overlap,fsdp,rows,largest,search,nvme] [--repeats 3] [--preset small] [--steps 6]
Environment: KEEL (the binary; default build/keel).
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

# model.preset -> (layers, heads, channels) of Keel's presets used here (src/core/config.cpp).
SHAPES = {"tiny": (2, 2, 64), "small": (4, 4, 256), "gpt2-124m": (12, 12, 768)}


def load():
    return "%.1f" % os.getloadavg()[0]


def keel_cmd(work, name, preset, steps, zero, extra=(), vocab=None, batch=2, seq=64):
    keel = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
    run_dir = os.path.join(work, name)
    cmd = [keel, "launch", "-n", "2", "--", "train", "--set", "model.preset=" + preset,
           "--set", "model.max_seq_len=%d" % seq, "--set", "train.batch_size=%d" % batch,
           "--set", "train.seq_len=%d" % seq, "--set", "train.steps=%d" % steps, "--set", "train.eval_batches=1",
           "--set", "train.eval_every=0", "--set", "train.sample_tokens=0", "--set", "train.checkpoint_every=0",
           "--set", "runtime.peak_gflops=100", "--set", "parallel.zero=%d" % zero,
           "--set", "data.train=" + os.path.join(work, "train.bin"), "--set", "data.val=" + os.path.join(work, "val.bin"),
           "--set", "data.tokenizer=", "--set", "train.run_dir=" + run_dir]
    if vocab:
        cmd += ["--set", "model.vocab_size=%d" % vocab]
    for e in extra:
        cmd += ["--set", e]
    return cmd, run_dir


def last_to_die():
    """preexec_fn: this process and its children are the ones the kernel kills first."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")


def keel_run(work, name, preset, steps, zero, extra=(), vocab=None, batch=2, seq=64, fatal=True):
    """One `keel launch -n 2` training run; returns its step lines and the run's wall seconds
    (fatal=False: a failed run returns (None, its output's last line) instead of exiting)."""
    cmd, run_dir = keel_cmd(work, name, preset, steps, zero, extra, vocab, batch, seq)
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=last_to_die)
    if r.returncode != 0:
        if not fatal:
            return None, (r.stdout.strip().splitlines() or ["exit %d" % r.returncode])[-1]
        sys.exit("keel run %s failed:\n%s" % (name, r.stdout[-3000:]))
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in l]
    return lines, time.time() - t0


def steady_ms(lines):
    ms = [l["ms"] for l in lines[2:]] or [l["ms"] for l in lines]
    return statistics.median(ms)


def part_overlap(a, work):
    print("\n== overlap: Keel ZeRO-2 vs ZeRO-3 (progress thread on / off), %s, 2 ranks ==" % a.preset)
    runs = {"zero2": (2, ()), "zero3 thread": (3, ("parallel.zero3_progress_thread=true",)),
            "zero3 no thread": (3, ("parallel.zero3_progress_thread=false",))}
    ms = {k: [] for k in runs}
    rss = {}
    for rep in range(a.repeats):
        for k, (zero, extra) in runs.items():
            lines, _ = keel_run(work, "ov_%d_%s" % (rep, k.replace(" ", "_")), a.preset, a.steps, zero, extra)
            ms[k].append(steady_ms(lines))
            rss[k] = lines[-1]["peak_rss_mb"]
            print("  rep %d %-16s %8.0f ms/step  peak RSS %6.0f MB (max over ranks)  load %s"
                  % (rep, k, ms[k][-1], rss[k], load()), flush=True)
    base = statistics.median(ms["zero2"])
    for k in runs:
        m = statistics.median(ms[k])
        print("  %-16s median %8.0f ms/step  %.2fx ZeRO-2" % (k, m, m / base))


FSDP_WORKER = r'''
import json, os, resource, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, sys.argv[1])
from torch_gpt2_train import GPT2, make_optimizer
from torch.distributed.fsdp import fully_shard

def worker(rank, a, port, q):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT2(a["layers"], a["channels"], a["heads"], a["vocab"], a["seq"])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = make_optimizer(model)
    data = torch.randint(0, a["vocab"], (a["steps"], a["batch"], a["seq"] + 1), generator=torch.Generator().manual_seed(1 + rank))
    times = []
    for i in range(a["steps"]):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(data[i, :, :-1], data[i, :, 1:])
        loss.backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    allr = [torch.zeros_like(rss) for _ in range(2)]
    dist.all_gather(allr, rss)
    if rank == 0:
        steady = sorted(times[2:] or times)[len(times[2:] or times) // 2]
        q.put({"ms_per_step": 1000 * steady, "tokens_per_s": 2 * a["batch"] * a["seq"] / steady,
               "peak_rss_mb_per_rank": [float(x.item()) for x in allr], "loss": float(loss.item())})
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)

if __name__ == "__main__":
    import socket
    a = json.loads(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(a, port, q), nprocs=2, join=True)
    print(json.dumps(q.get()))
'''


def part_fsdp(a, work):
    layers, heads, channels = SHAPES[a.preset]
    vocab, batch, seq = 50257, 2, 64
    print("\n== fsdp: Keel ZeRO-3 vs PyTorch FSDP2 (fully_shard, gloo), %s shape (%d layers, %d channels), "
          "2 ranks x batch %d x %d tokens ==" % (a.preset, layers, channels, batch, seq))
    py = os.path.join(HERE, ".venv", "bin", "python")
    if not os.path.exists(py):
        print("  skipped: bench/.venv (PyTorch with torch.distributed.fsdp.fully_shard) not found")
        return
    worker = os.path.join(work, "fsdp_worker.py")
    with open(worker, "w") as f:
        f.write(FSDP_WORKER)
    spec = {"layers": layers, "channels": channels, "heads": heads, "vocab": vocab, "seq": seq, "batch": batch,
            "steps": a.steps, "threads": max(1, (os.cpu_count() or 2) // 2)}
    for rep in range(a.repeats):
        lines, _ = keel_run(work, "fs_%d" % rep, a.preset, a.steps, 3, (), batch=batch, seq=seq)
        keel_ms = steady_ms(lines)
        keel_rss = max(lines[-1]["peak_rss_mb"], 0)
        keel_z3 = lines[-1].get("zero3_param_peak_resident_bytes")
        print("  rep %d keel ZeRO-3 %8.0f ms/step %8.0f tokens/s  peak RSS %6.0f MB (max over ranks)  load %s"
              % (rep, keel_ms, 2 * batch * seq * 1000 / keel_ms, keel_rss, load()), flush=True)
        if keel_z3:
            print("         parameters resident at their peak per rank: %s MB" % [round(x / 1e6) for x in keel_z3])
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        r = subprocess.run([py, worker, HERE, json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env)
        if r.returncode != 0:
            print("  FSDP2 run failed:\n" + r.stdout[-2000:])
            return
        t = json.loads(r.stdout.strip().splitlines()[-1])
        print("  rep %d FSDP2      %8.0f ms/step %8.0f tokens/s  peak RSS per rank %s MB  load %s"
              % (rep, t["ms_per_step"], t["tokens_per_s"], [round(x) for x in t["peak_rss_mb_per_rank"]], load()),
              flush=True)


def row_settings(a, work):
    """(name, ZeRO stage, settings) of the combinations the rows and the search compare; the NVMe
    tier's directory is --nvme-dir or one under the work directory."""
    nvme = a.nvme_dir or os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    full = ("train.recompute=full",)
    bf16 = ("runtime.param_dtype=bf16", "runtime.grad_dtype=bf16")
    tier = ("tier.device_mib=64", "tier.host_mib=0", "tier.nvme_dir=" + nvme)
    return [("ZeRO-2", 2, ()), ("ZeRO-3", 3, ()), ("ZeRO-3 + full recompute", 3, full),
            ("ZeRO-3 + full recompute + bf16 state", 3, full + bf16),
            ("ZeRO-3 + full recompute + bf16 state + NVMe tier", 3, full + bf16 + tier)]


def part_rows(a, work):
    layers = ("model.n_layer=%d" % a.large_layers,) if a.large_layers else ()
    rows = row_settings(a, work)
    print("\n== rows: %s%s, 2 ranks, batch 1 x %d tokens, %d steps ==" % (
        a.large, " with %d layers" % a.large_layers if a.large_layers else "", a.large_seq, a.large_steps))
    print("  %-48s %10s %9s %22s %14s %14s" % ("", "params M", "tok/s", "peak RSS/rank MB", "gathered MB", "sync sent MB"))
    for name, zero, extra in rows:
        lines, wall = keel_run(work, "row_" + name.replace(" ", "_").replace("+", ""), a.large, a.large_steps, zero,
                               layers + extra, batch=1, seq=a.large_seq,
                               vocab=32000 if "llama" in a.large else None, fatal=False)
        if lines is None or not lines:
            print("  %-48s did not step: %s  load %s" % (name, wall, load()), flush=True)
            continue
        last = lines[-1]
        run_dir = os.path.join(work, "row_" + name.replace(" ", "_").replace("+", ""))
        params = next((json.loads(l)["model"]["parameters"] for l in open(os.path.join(run_dir, "metrics.jsonl"))
                       if '"model"' in l and '"parameters"' in l), float("nan"))
        rss = [round(x / 1e6) for x in last.get("zero3_startup_peak_rss_bytes", [])]
        gathered = sum(last.get("zero3_gathered_bytes", [0])) / len(last.get("zero3_gathered_bytes", [0])) / 1e6
        print("  %-48s %10.1f %9.2f %22s %14.1f %14.1f  load %s" % (
            name, params / 1e6,
            2 * a.large_seq * 1000 / last["ms"], "%.0f (max; start-up %s)" % (last["peak_rss_mb"], rss),
            gathered, last.get("sync_sent_bytes", 0) / 1e6, load()), flush=True)


def part_largest(a, work):
    layers = ("model.n_layer=%d" % a.large_layers,) if a.large_layers else ()
    print("\n== largest: Keel ZeRO-3, %s%s, 2 ranks, batch 1 x %d tokens, %d steps ==" % (
        a.large, " with %d layers" % a.large_layers if a.large_layers else "", a.large_seq, a.large_steps))
    free_gb = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    print("  memory available before: %.1f GiB  load %s" % (free_gb, load()), flush=True)
    lines, wall = keel_run(work, "large", a.large, a.large_steps, 3, layers,
                           batch=1, seq=a.large_seq, vocab=32000 if "llama" in a.large else None)
    last = lines[-1]
    print("  took %d optimizer steps in %.0f s (wall, start-up included)  load %s" % (len(lines), wall, load()))
    print("  start-up peak RSS per rank: %s MB" % [round(x / 1e6) for x in last["zero3_startup_peak_rss_bytes"]])
    print("  peak RSS (max over ranks) after the steps: %.0f MB" % last["peak_rss_mb"])
    print("  parameter shard per rank: %s MB; gathered per step: %s MB; moments per rank: %s MB"
          % ([round(x / 1e6) for x in last["zero3_param_shard_bytes"]], [round(x / 1e6) for x in last["zero3_gathered_bytes"]],
             [round(x / 1e6) for x in last["zero3_moment_bytes"]]))
    print("  ms per step (last): %.0f; tokens/s: %.2f" % (last["ms"], 2 * a.large_seq * 1000 / last["ms"]))


# The search's ladder: (name, preset, overrides), smallest first. The 3B class is open_llama_3b's
# dimensions (26 layers x 3200 channels, 32 heads without grouping, MLP 8640) on tinyllama's preset.
LLAMA_3B = ("model.n_embd=3200", "model.n_head=32", "model.n_kv_head=32", "model.ffn_hidden=8640")
SEARCH_SHAPES = [
    ("tinyllama-1.1b x 4 layers", "tinyllama-1.1b", ("model.n_layer=4",)),
    ("tinyllama-1.1b x 6 layers", "tinyllama-1.1b", ("model.n_layer=6",)),
    ("tinyllama-1.1b x 8 layers", "tinyllama-1.1b", ("model.n_layer=8",)),
    ("tinyllama-1.1b x 11 layers", "tinyllama-1.1b", ("model.n_layer=11",)),
    ("tinyllama-1.1b (22 layers)", "tinyllama-1.1b", ()),
    ("tinyllama-1.1b x 27 layers", "tinyllama-1.1b", ("model.n_layer=27",)),
    ("tinyllama-1.1b x 33 layers", "tinyllama-1.1b", ("model.n_layer=33",)),
    ("tinyllama-1.1b x 44 layers", "tinyllama-1.1b", ("model.n_layer=44",)),
    ("3B class: 26 x 3200", "tinyllama-1.1b", ("model.n_layer=26",) + LLAMA_3B),
    ("3B class: 32 x 3200", "tinyllama-1.1b", ("model.n_layer=32",) + LLAMA_3B),
]


def available_gib():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def predict(cmd, nvme_dir):
    """Runs `cmd` until Keel prints its start-up memory line, then stops it (and removes the NVMe
    tier files its ranks left in `nvme_dir`). Returns (MB per rank by Keel's own accounting: the
    line's "in all", the tiered planes counted as the tiers' budgets, parameters in millions, the
    line) or (None, params, the last line) when it exits first."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: (last_to_die(), os.setsid()))
    params, last = None, ""
    try:
        for line in p.stdout:
            last = line.strip()
            m = re.search(r"\(([0-9.]+)M parameters", line)
            if m:
                params = float(m.group(1))
            m = re.search(r"keel: memory per rank: .*; ([0-9.]+) MB in all", line)
            if m:
                return float(m.group(1)), params, last
    finally:
        stop_and_clean(p, nvme_dir)
    return None, params, last


def part_search(a, work):
    rows = [r for r in row_settings(a, work) if r[0] != "ZeRO-3 + full recompute + bf16 state"]  # issue 39's four
    shapes = [s for s in SEARCH_SHAPES if not a.search_shapes or s[0] in a.search_shapes.split(",")]
    if a.search_rows:
        rows = [rows[int(i) - 1] for i in a.search_rows.split(",")]
    budget_mb = available_gib() * 1024 * 1.048576  # MiB -> MB
    print("\n== search: 2 ranks, batch 1 x %d tokens, %d steps; %.1f GB available at the start  load %s ==" % (
        a.large_seq, a.large_steps, budget_mb / 1000, load()), flush=True)
    for name, zero, extra in rows:
        tag = lambda shape: "search_" + (name + "_" + shape).replace(" ", "_").replace("+", "").replace(":", "")
        predicted = []
        for shape, preset, overrides in shapes:
            cmd, _ = keel_cmd(work, tag(shape) + "_predict", preset, a.large_steps, zero, overrides + extra,
                              vocab=32000, batch=1, seq=a.large_seq)
            mb, params, line = predict(cmd, a.nvme_dir or os.path.join(work, "nvme"))
            if mb is None:
                print("  %-48s %-28s predicted: no start-up line (%s)  load %s" % (name, shape, line, load()), flush=True)
                continue
            predicted.append((shape, preset, overrides, mb, params))
            print("  %-48s %-28s %8.1f M params  predicted %7.0f MB per rank (x 2 = %.1f GB of %.1f)  load %s" % (
                name, shape, params or float("nan"), mb, 2 * mb / 1000, budget_mb / 1000, load()), flush=True)
        # Real runs: the shapes predicted within the edge, largest first, until one takes its steps.
        for shape, preset, overrides, mb, params in sorted(predicted, key=lambda t: -t[3]):
            if 2 * mb > a.edge * budget_mb:
                continue
            before = available_gib()
            lines, wall = keel_run(work, tag(shape), preset, a.large_steps, zero, overrides + extra, batch=1,
                                   seq=a.large_seq, vocab=32000, fatal=False)
            if lines is None or len(lines) < a.large_steps:
                print("  %-48s %-28s did not take its steps: %s  load %s" % (name, shape, wall, load()), flush=True)
                continue
            last = lines[-1]
            nvme_rw = "%.0f / %.0f MB" % (last.get("tier_nvme_read_bytes", 0) / 1e6, last.get("tier_nvme_written_bytes", 0) / 1e6)
            print("  %-48s %-28s TOOK %d steps: %.0f s per step (last), %.2f tokens/s, peak RSS %.0f MB (max over ranks), "
                  "NVMe read / written in the last step %s, %.1f GB available before, %.0f s wall  load %s" % (
                      name, shape, len(lines), last["ms"] / 1000, 2 * a.large_seq * 1000 / last["ms"],
                      last["peak_rss_mb"], nvme_rw, before, wall, load()), flush=True)
            break


def llama_block_parameters(overrides):
    """Parameters of one block of tinyllama-1.1b's preset with `overrides` (model.KEY=VALUE)."""
    m = {"n_layer": 22, "n_embd": 2048, "n_head": 32, "n_kv_head": 4, "ffn_hidden": 5632, "vocab_size": 32000}
    for o in overrides:
        key, value = o.split("=")
        m[key.split(".")[1]] = int(value)
    C, F = m["n_embd"], m["ffn_hidden"]
    kv = C * m["n_kv_head"] // m["n_head"]
    return 2 * C * C + 2 * C * kv + 3 * C * F + 2 * C


def llama_parameters(overrides):
    """Parameters of tinyllama-1.1b's preset with `overrides` (model.KEY=VALUE; untied head)."""
    m = {"n_layer": 22, "n_embd": 2048, "n_head": 32, "n_kv_head": 4, "ffn_hidden": 5632, "vocab_size": 32000}
    for o in overrides:
        key, value = o.split("=")
        m[key.split(".")[1]] = int(value)
    C, L, V, F = m["n_embd"], m["n_layer"], m["vocab_size"], m["ffn_hidden"]
    kv = C * m["n_kv_head"] // m["n_head"]
    return 2 * V * C + L * (2 * C * C + 2 * C * kv + 3 * C * F + 2 * C) + C


def tier_files(nvme_dir):
    return [os.path.join(nvme_dir, f) for f in os.listdir(nvme_dir) if f.startswith("keel-tier-")]


def stop_and_clean(p, nvme_dir, run_dir=None):
    """Kills a run's process group, waits for it, and removes its tier files (and its run directory)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    for f in tier_files(nvme_dir):
        os.remove(f)
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)


def part_nvme(a, work):
    """A llama of SEARCH_SHAPES (--nvme-shape) under ZeRO-3 + full recompute with float32 state
    (no bf16 state) and every plane through the tiers: an --nvme-device-mib compute tier, no host
    tier, the rest homed on NVMe (--nvme-dir). Refused before it starts where the disk cannot hold
    16 bytes a parameter plus one block's parameters and gradients of scratch per rank, with 10 %
    and 2 GB to spare: each rank's tier file has slots for its own chunks' four planes only
    (parameters, gradients, both moments: 16 bytes a parameter over the ranks); other ranks'
    chunks pass through the compute tier when gathered or before their reduce-scatter, and spill
    to scratch at the file's end only when evicted with bytes. The run's start-up line gives its memory per rank ("in all"); it is stopped
    there where 2 ranks of it exceed the memory available, and otherwise once it took
    --large-steps optimizer steps, before its end-of-run checkpoint (which would need as much disk
    again), and its tier files and run directory are removed."""
    shape, preset, overrides = next(s for s in SEARCH_SHAPES if s[0] == a.nvme_shape)
    if a.large_layers:
        overrides = overrides + ("model.n_layer=%d" % a.large_layers,)
    nvme = a.nvme_dir or os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    params = llama_parameters(overrides)
    scratch = 2 * 8 * llama_block_parameters(overrides)  # 2 ranks x one block's parameters and gradients
    need, free = 16 * params + scratch, shutil.disk_usage(nvme).free
    print("\n== nvme: %s%s (%.2f B parameters), 2 ranks, ZeRO-3 + full recompute + float32 state through the tiers "
          "(device %d MiB, host 0, NVMe in %s), batch 1 x %d tokens, %d steps ==" % (
              shape, " with %d layers" % a.large_layers if a.large_layers else "", params / 1e9, a.nvme_device_mib,
              nvme, a.large_seq, a.large_steps), flush=True)
    print("  disk: %.1f GB needed on NVMe (16 B a parameter over the 2 ranks' files, %.1f GB of it scratch), %.1f GB free  load %s" % (
              need / 1e9, scratch / 1e9, free / 1e9, load()),
          flush=True)
    if free < 1.1 * need + 2e9:
        print("  not run: the disk cannot hold the tier files with 10 % and 2 GB to spare", flush=True)
        return
    tier = ("train.log_every=1", "train.recompute=full", "tier.device_mib=%d" % a.nvme_device_mib, "tier.host_mib=0",
            "tier.nvme_dir=" + nvme)
    cmd, run_dir = keel_cmd(work, "nvme_row", preset, a.large_steps, 3, overrides + tier, vocab=32000, batch=1,
                            seq=a.large_seq)
    t0, available = time.time(), available_gib()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: (last_to_die(), os.setsid()))
    metrics = os.path.join(run_dir, "metrics.jsonl")
    steps, files_gb, disk_low, last, stepped = [], 0.0, free, "", False
    try:
        for line in p.stdout:
            last = line.strip()
            if "keel: tiered memory: device" in line or "keel: ZeRO-3 over" in line:
                print("  " + last, flush=True)
            m = re.search(r"keel: memory per rank: .*; ([0-9.]+) MB in all", line)
            if m:
                mb = float(m.group(1))
                print("  start-up line: %.0f MB per rank in all (x 2 = %.1f GB of %.1f GiB available)  load %s" % (
                    mb, 2 * mb / 1000, available, load()), flush=True)
                if 2 * mb / 1000 > available * 1.073741824:
                    print("  stopped: 2 ranks of it exceed the memory available", flush=True)
                    return
            stepped = stepped or re.match(r"step +\d+/\d+ \|", line) is not None
            if stepped:
                files_gb = max(files_gb, sum(os.stat(f).st_blocks * 512 for f in tier_files(nvme)) / 1e9)
                disk_low = min(disk_low, shutil.disk_usage(nvme).free)
                if os.path.exists(metrics):
                    steps = [json.loads(l) for l in open(metrics) if '"loss"' in l]
                if len(steps) >= a.large_steps:
                    break
    finally:
        stop_and_clean(p, nvme, run_dir)
    if len(steps) < a.large_steps:
        print("  did not take its steps: %s  load %s" % (last, load()), flush=True)
        return
    s = steps[-1]
    print("  TOOK %d steps: %.0f s per step (last), %.2f tokens/s, peak RSS %.0f MB (max over ranks; start-up %s MB), "
          "NVMe read / written in the last step %.0f / %.0f MB, tier files %.1f GB on disk (%.1f GB free at the "
          "lowest; rank 0's file %.2f GB, of it %.2f GB scratch), %.0f s wall to the last step  load %s" % (
              len(steps), s["ms"] / 1000, a.large_seq * 2 * 1000 / s["ms"], s["peak_rss_mb"],
              [round(x / 1e6) for x in s.get("zero3_startup_peak_rss_bytes", [])],
              s.get("tier_nvme_read_bytes", 0) / 1e6, s.get("tier_nvme_written_bytes", 0) / 1e6, files_gb,
              disk_low / 1e9, s.get("tier_nvme_file_bytes", 0) / 1e9, s.get("tier_nvme_scratch_bytes", 0) / 1e9,
              time.time() - t0, load()), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="overlap,fsdp,rows,largest")
    ap.add_argument("--edge", type=float, default=1.0,
                    help="search: run shapes predicted within this fraction of the memory available")
    ap.add_argument("--search-shapes", default="", help="search: names of SEARCH_SHAPES to try (default all)")
    ap.add_argument("--search-rows", default="", help="search: rows to try, 1-based, e.g. 4 or 1,2 (default all)")
    ap.add_argument("--nvme-dir", default="", help="rows, search, nvme: the NVMe tier's directory (default: under the work dir)")
    ap.add_argument("--nvme-shape", default="3B class: 26 x 3200", help="nvme: a name of SEARCH_SHAPES")
    ap.add_argument("--nvme-device-mib", type=int, default=2048, help="nvme: the compute tier's budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--preset", default="small", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--large", default="tinyllama-1.1b")
    ap.add_argument("--large-steps", type=int, default=2)
    ap.add_argument("--large-seq", type=int, default=64)
    ap.add_argument("--large-layers", type=int, default=0, help="--large with this many layers (0: the preset's)")
    a = ap.parse_args()
    from benchutil import write_tokens
    with tempfile.TemporaryDirectory(prefix="keel-zero3-bench.") as work:
        write_tokens(os.path.join(work, "train.bin"), n=200000, vocab=32000)
        write_tokens(os.path.join(work, "val.bin"), n=20000, vocab=32000)
        print("uptime: %s" % subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip())
        for part in a.part.split(","):
            {"overlap": part_overlap, "fsdp": part_fsdp, "rows": part_rows, "largest": part_largest,
             "search": part_search, "nvme": part_nvme}[part](a, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
