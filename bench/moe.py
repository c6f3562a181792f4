#!/usr/bin/env python3
"""Mixture of experts side by side (issue 44 item 6), on the fortunes shards the default job trains on.

Models: "moe" is the preset llama-moe-d4 (llama-d4's size, 8 experts of 352 SwiGLU units, top-2,
the balancing loss at 0.01) and "dense" is llama-d4 (one SwiGLU of 704 units: the same active MLP
units per token, 2 x 352). Both at the default job's batch (16 x 128 tokens) and optimizer.

Parts (--part, default all):
  quality  Keel trains each model for --steps steps: validation loss at equal tokens (the same
           steps), tokens/s (median of the last half of the steps), and the MoE run's routing at the
           end (worst imbalance max/mean over its blocks, tokens per expert); then the dense model
           again for as many steps as fit in the MoE run's wall time: validation loss at equal time.
  peer     The same two models in PyTorch (bench/torch_moe_train.py, bench/.venv's current PyTorch:
           the experts' products grouped by sorting the (token, choice) pairs by expert, as
           torchtitan does on a CPU; 2 threads, passive OpenMP waiting, flushed denormals), the same
           steps, batch and learning-rate schedule on the same shard: tokens/s and validation loss
           beside Keel's.
  expert   The MoE model on 2 ranks: data parallel (every rank all experts) against expert
           parallelism (parallel.expert = 2), tokens/s; where parallel.expert is not built, says so.
  tiers    The MoE model in the memory tiers at a compute tier with room for a quarter of the
           experts' parameter and gradient pages (beside the embedding, attention and norms, and
           two operations' working sets; moments on host): experts homed on host DRAM, on NVMe,
           and by routing share (tier.experts = "by_frequency", re-homed every 5 steps), each
           against all in memory (run before and after it: interleaved, so that a drifting load
           moves both): tokens/s ratio and the experts' hit rate over the last half of the steps
           (min(--steps, 40) steps each; --repeats tiered runs per configuration).

Every figure is printed with the load average it was taken under: the machine is shared.

Usage: bench/moe.py [--part quality,peer,expert,tiers] [--steps 200] [--repeats 1] [--keel build/keel]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import steady_state  # noqa: E402  (the fortunes shards, the tuned environment of the PyTorch peers)

PEER = os.path.join(HERE, "torch_moe_train.py")
VENV_PY = os.path.join(HERE, ".venv", "bin", "python")
MODELS = {"moe": "llama-moe-d4", "dense": "llama-d4"}
# The peer's shapes of the two presets (src/core/config.cpp model_presets).
SHAPE = ["--layers", "4", "--channels", "256", "--heads", "8", "--kv-heads", "4", "--vocab", "8192",
         "--batch", "16", "--seq", "128"]
PEER_MODEL = {"moe": ["--experts", "8", "--top-k", "2", "--moe-hidden", "352"], "dense": ["--ffn-hidden", "704"]}


def load():
    return "%.1f" % os.getloadavg()[0]


def step_lines(run_dir):
    lines, val = [], None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for raw in f:
            j = json.loads(raw)
            if "val_loss" in j:
                val = j["val_loss"]
            elif "loss" in j and "event" not in j:
                lines.append(j)
    return lines, val


def keel_train(a, work, name, model, steps, ranks=0, extra=()):
    run_dir = os.path.join(work, name)
    sets = ["model.preset=" + MODELS[model], "train.steps=%d" % steps, "train.run_dir=" + run_dir,
            "train.log_every=1", "train.sample_tokens=0", "train.checkpoint_every=0", "train.eval_every=0",
            "train.overwrite=true"] + list(extra)
    cmd = ([a.keel, "launch", "-n", str(ranks), "--"] if ranks else [a.keel]) + ["train"]
    cmd += [x for s in sets for x in ("--set", s)]
    before = load()
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        return None, (p.stdout + p.stderr).strip().splitlines()[-1:] or ["exit %d" % p.returncode]
    lines, val = step_lines(run_dir)
    ms = [j["ms"] for j in lines]
    half = ms[len(ms) // 2:]
    return {"val": val, "wall": wall, "ms": statistics.median(half), "tok_s": 16 * 128 * max(1, ranks) / statistics.median(half) * 1e3,
            "last": lines[-1], "load": "%s -> %s" % (before, load())}, None


def peer_train(a, model, steps):
    if not os.path.exists(VENV_PY):
        return None, "no bench/.venv (python3 -m venv bench/.venv && bench/.venv/bin/pip install torch)"
    env = steady_state.clean_env(dict(steady_state.TUNED_ENV))
    cmd = [VENV_PY, PEER] + SHAPE + PEER_MODEL[model] + [
        "--steps", str(steps), "--data", os.path.join(ROOT, steady_state.DATA["train"]),
        "--val", os.path.join(ROOT, steady_state.DATA["val"]), "--threads", "2"]  # the peer's defaults: Keel's data order, its 16 eval batches
    before = load()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return None, (p.stdout + p.stderr).strip().splitlines()[-1]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    half = out["ms"][len(out["ms"]) // 2:]
    out["median_ms"] = statistics.median(half)
    out["tok_s"] = 16 * 128 / out["median_ms"] * 1e3
    out["load"] = "%s -> %s" % (before, load())
    return out, None


def ensure_fortunes(a, work):
    for path in steady_state.DATA.values():
        if not os.path.exists(os.path.join(ROOT, path)):
            print("moe.py: %s not found; tokenizing the fortunes corpus (keel tokenize)" % path, file=sys.stderr)
            log = os.path.join(work, "tokenize.log")
            if steady_state.run([a.keel, "tokenize"], steady_state.clean_env(), log, "keel tokenize") != 0:
                steady_state.fail("keel tokenize", [a.keel, "tokenize"], log)
            return


def routing(last):
    layers = last.get("moe_layers", [])
    worst = max((l["imbalance"] for l in layers), default=float("nan"))
    tokens = [l["tokens"] for l in layers]
    return worst, tokens


def part_quality(a, work):
    print("\n== quality and speed: Keel, %d steps, batch 16 x 128 (validation loss at the end)" % a.steps)
    moe, err = keel_train(a, work, "moe", "moe", a.steps)
    if err:
        sys.exit("moe.py: the MoE run failed: %s" % err[0])
    dense, err = keel_train(a, work, "dense", "dense", a.steps)
    if err:
        sys.exit("moe.py: the dense run failed: %s" % err[0])
    worst, tokens = routing(moe["last"])
    for name, r in (("moe (llama-moe-d4)", moe), ("dense (llama-d4)", dense)):
        print("%-20s val loss %.4f  %7.0f tok/s  (median %.0f ms/step)  wall %.0f s  load %s" %
              (name, r["val"], r["tok_s"], r["ms"], r["wall"], r["load"]))
    print("MoE routing at the last step: worst imbalance (max/mean over a block's experts) %.2f; tokens per expert "
          "per block %s" % (worst, tokens))
    print("equal tokens: MoE val loss - dense val loss = %+.4f" % (moe["val"] - dense["val"]))
    steps_equal_time = max(1, int(round(a.steps * moe["wall"] / dense["wall"])))
    timed, err = keel_train(a, work, "dense-time", "dense", steps_equal_time)
    if err:
        print("dense at equal time failed: %s" % err[0])
    else:
        print("equal time: dense for %d steps (the MoE run's %.0f s of wall time at the dense run's pace): val loss "
              "%.4f; MoE - dense = %+.4f  load %s" % (steps_equal_time, moe["wall"], timed["val"],
                                                      moe["val"] - timed["val"], timed["load"]))
    return moe, dense


def part_peer(a, keel):
    print("\n== Keel against PyTorch (%s), the same models, steps, batch and schedule" % VENV_PY)
    for model in ("moe", "dense"):
        out, err = peer_train(a, model, a.steps)
        if err:
            print("%s: PyTorch did not run: %s" % (model, err))
            continue
        line = "%-6s PyTorch %s: %7.0f tok/s, val loss %.4f (load %s)" % (
            model, out["torch"], out["tok_s"], out.get("val_loss", float("nan")), out["load"])
        if keel and model in keel:
            line += "   Keel: %7.0f tok/s, val loss %.4f: Keel / PyTorch = %.2fx" % (
                keel[model]["tok_s"], keel[model]["val"], keel[model]["tok_s"] / out["tok_s"])
        print(line)
        if model == "moe" and out["routed"]:
            mean = sum(out["routed"]) / len(out["routed"])
            print("       PyTorch's routing at the last step (all blocks): max/mean %.2f" % (max(out["routed"]) / mean))


def part_expert(a, work):
    print("\n== the MoE model on 2 ranks: data parallel against expert parallel (%d steps each)" % a.steps)
    runs = {}
    for name, extra in (("data 2 (E = 1)", []), ("data 2, expert 2", ["parallel.expert=2"])):
        r, err = keel_train(a, work, "ep%d" % len(runs), "moe", a.steps, ranks=2, extra=extra)
        if err:
            print("%-18s not run: %s" % (name, err[0]))
            continue
        runs[name] = r
        print("%-18s %7.0f tok/s  val loss %.4f  peak RSS %s MB  load %s" %
              (name, r["tok_s"], r["val"], r["last"].get("peak_rss_mb", "?"), r["load"]))
    if len(runs) == 2:
        print("expert / data parallel: %.2fx tokens/s" % (runs["data 2, expert 2"]["tok_s"] / runs["data 2 (E = 1)"]["tok_s"]))


# llama-moe-d4's pages (src/core/config.cpp presets): 4 blocks of 8 experts, C = 256, Hm = 352.
EXPERT_BYTES = 3 * 352 * 256 * 4  # one expert's gate_up [704, 256] and proj [256, 352], float32
EXPERTS = 4 * 8


def part_tiers(a, work, steps):
    print("\n== experts in the memory tiers: a compute tier of a quarter of the experts' parameters and "
          "gradients against all in memory (%d steps each; each tiered run between two in-memory runs, "
          "%d times)" % (steps, a.repeats))
    # Device: the embeddings (token table and untied head), attention and norms (parameters and
    # gradients: 34.0 MiB homed there, as the start-up line says), two operations' working sets
    # (the head's: its 8 MiB plus the token table's, 16.0 MiB each), and room for a quarter of the
    # experts' parameter and gradient pages (16.5 MiB); the moments in host DRAM (updated there);
    # the experts and routers homed on host DRAM or NVMe.
    quarter_mib = EXPERTS // 4 * 2 * EXPERT_BYTES / 2**20
    device_mib = int(round(34.0 + 2 * 16.0 + quarter_mib))
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    common = ["tier.device_mib=%d" % device_mib, "tier.host_mib=1024", "tier.nvme_dir=" + nvme,
              "tier.embedding=device", "tier.optimizer=host"]
    # The in-memory run is repeated around every tiered run (memory, tiered, memory, tiered, ...,
    # memory) and each tiered run is compared with the mean of its two neighbours: a load that
    # drifts over the bench moves both alike.
    memory_runs = []

    def memory_run():
        r, err = keel_train(a, work, "tiers-memory", "moe", steps)
        if err:
            sys.exit("moe.py: the in-memory run failed: %s" % err[0])
        memory_runs.append(r)
        print("in memory:          %7.0f tok/s (median %.0f ms/step)  load %s" % (r["tok_s"], r["ms"], r["load"]))
        return r

    before = memory_run()
    for name, extra in (("experts on host", ["tier.ffn=host"]), ("experts on nvme", ["tier.ffn=nvme"]),
                        ("by_frequency", ["tier.ffn=nvme", "tier.experts=by_frequency", "tier.experts_every=5"])):
        ratios, rates = [], []
        for rep in range(a.repeats):
            run = "tiers-" + name.replace(" ", "-")
            r, err = keel_train(a, work, run, "moe", steps, extra=common + extra)
            if err:
                print("%-19s not run: %s" % (name + ":", err[0]))
                break
            after = memory_run()
            lines, _ = step_lines(os.path.join(work, run))
            half = lines[len(lines) // 2:]
            hits = sum(sum(b["hits"]) for l in half for b in l.get("tier_experts", []))
            touches = sum(sum(b["acquires"]) for l in half for b in l.get("tier_experts", []))
            stall = statistics.median([l.get("tier_expert_stall_ms", 0) for l in half])
            homes = [h for b in r["last"].get("tier_experts", []) for h in b["home"]]
            ratio = r["tok_s"] / ((before["tok_s"] + after["tok_s"]) / 2)
            ratios.append(ratio)
            rates.append(100.0 * hits / max(1, touches))
            print("%-19s %7.0f tok/s = %.2fx in memory (its neighbours' mean); experts' hit rate %.1f%% (%d first "
                  "touches, last half), median stall %.1f ms/step, pages' hit rate %s; homes at the end: %d device, "
                  "%d host, %d nvme; device %d MiB; load %s" %
                  (name + ":", r["tok_s"], ratio, rates[-1], touches, stall, r["last"].get("tier_hit_rate"),
                   homes.count("device"), homes.count("host"), homes.count("nvme"), device_mib, r["load"]))
            before = after
        if ratios:
            print("%-19s median %.2fx in memory, experts' hit rate %.1f%% (over %d pairs)" %
                  (name + ":", statistics.median(ratios), statistics.median(rates), len(ratios)))
    print("in memory over the bench: %s tok/s (first / last = %.2f: the load's drift)" %
          (" ".join("%.0f" % r["tok_s"] for r in memory_runs), memory_runs[0]["tok_s"] / memory_runs[-1]["tok_s"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="quality,peer,expert,tiers")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--keel", default=os.path.join(ROOT, "build", "keel"))
    ap.add_argument("--repeats", type=int, default=1, help="tiers: tiered runs per configuration (default 1)")
    a = ap.parse_args()
    parts = a.part.split(",")
    for p in parts:
        if p not in ("quality", "peer", "expert", "tiers"):
            sys.exit("moe.py: --part: expected quality, peer, expert or tiers, found '%s'" % p)
    print("moe.py: %s, load %s" % (steady_state.cpu_name(), load()))
    with tempfile.TemporaryDirectory(prefix="keel-moe-bench.") as work:
        ensure_fortunes(a, work)
        keel = None
        if "quality" in parts:
            moe, dense = part_quality(a, work)
            keel = {"moe": moe, "dense": dense}
        if "peer" in parts:
            part_peer(a, keel)
        if "expert" in parts:
            part_expert(a, work)
        if "tiers" in parts:
            part_tiers(a, work, min(a.steps, 40))


if __name__ == "__main__":
    main()
