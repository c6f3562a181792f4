#!/usr/bin/env python3
"""Keel's design table, simulated: a 1.2T-parameter GPT on 8, 32, 128 and 512 nodes of Keel's
recommended deployment (configs/clusters/keel-ib200.toml: 8 A100-80GB per node, one 200 Gbit/s
InfiniBand NIC per node, 2 NVMe drives per node), a conventional data-parallel baseline against
Keel's layout, beside the figures Keel's design claims (samples/s: 128, 512, 1,892, 5,327 for Keel,
112, 287, 624, 1,025 for the conventional architecture), and each of Keel's mechanisms turned off in
turn. Then the tier hit rates of a 175B model against the claimed 92 / 7 / 1 %. Only `keel simulate`
runs (seconds); nothing here trains.

The model: 132 blocks of width 27,648 (216 heads of 128), vocabulary 51,200, sequences of 2,048
tokens, bf16 matrix products (Keel's planes stay float32), full activation recomputation. The step
(not given with the claims): 4 sequences per GPU (weak scaling, as Megatron-LM's table grows its
batch), micro-batches of one sequence.

  baseline   tensor parallelism inside each node, data parallelism across nodes (ZeRO-2), float32
             gradient sync (no compression), pages over device, host and NVMe fetched on demand
  Keel       tensor inside the node x pipeline x data (pipeline degree chosen by the simulation
             among 2..64), ZB-V schedule, ZeRO-1, HybridGC compressed sync, Keel's static
             (FLOP-balanced) partitioner's cut, the tier manager's prefetch

Both use tensor parallelism of 8 inside a node, which `keel simulate` models and Keel does not run:
without it one block's float32 parameters (37 GB) cannot be pinned beside its activations in 80 GB,
and Keel's tier manager pins a layer's pages whole. Pages are homed device-first and demoted by
Keel's placement.
  ablations  Keel's layout with one mechanism off: sync uncompressed; 1F1B instead of ZB-V; tiers
             without prefetch; stages cut into equal layer counts instead of the partitioner's

A FLOP bound is printed beside both: the samples/s the cluster's bf16 peak would give at 6 FLOPs
per parameter per token (no recomputation, 100 % of peak) -- no layout of any system exceeds it.

Usage: bench/simulate_keel_table.py [--cluster FILE] [--json yes]
Environment: KEEL (default build/keel).
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))

NODES = [8, 32, 128, 512]
CLAIM_KEEL = [128, 512, 1892, 5327]
CLAIM_BASE = [112, 287, 624, 1025]
CLAIM_SERVED = (92, 7, 1)  # % of parameter accesses from device, host, NVMe (175B model)
SEQ, VOCAB = 2048, 51200
PER_GPU = 4  # sequences per GPU and step
PIPELINES = (2, 4, 8, 16, 32, 64)  # pipeline degrees tried for Keel's layout


def model_sets(layers, hidden, heads):
    return ["model.preset=gpt2-124m", "model.n_layer=%d" % layers, "model.n_embd=%d" % hidden,
            "model.n_head=%d" % heads, "model.vocab_size=%d" % VOCAB, "model.padded_vocab_size=%d" % VOCAB,
            "model.max_seq_len=%d" % SEQ, "train.seq_len=%d" % SEQ, "runtime.precision=bf16",
            "model.attention=blockwise", "data.tokenizer="]


def params(layers, hidden):
    return layers * (12 * hidden * hidden + 13 * hidden) + VOCAB * hidden + SEQ * hidden + 2 * hidden


TP = 8  # tensor parallelism inside a node (modelled by `keel simulate`; Keel does not run it)
# Pages homed device-first: Keel's placement demotes moments, then gradients, then parameters to
# host and then NVMe where a budget is short (store/placement.h).
HOMES = ["tier.embedding=device", "tier.attention=device", "tier.ffn=device", "tier.norm=device"]


def simulate(cluster, nodes, sets, tiers=True):
    cmd = [KEEL, "simulate", "--cluster", cluster, "--nodes", str(nodes), "--tensor", str(TP), "--recompute", "yes",
           "--tiers", "yes" if tiers else "no", "--json", "yes"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if not tiers and line.startswith("{"):
        return json.loads(line)  # (exits 1 where it does not fit; the figures are printed first)
    if p.returncode != 0 or not line.startswith("{"):
        return {"error": (p.stderr.strip() or p.stdout.strip()).splitlines()[-1][:300], "cmd": " ".join(cmd)}
    return json.loads(line)


def equal_cut(layers, stages):
    """First layers of stages 1.. for equal layer counts (embedding and head count as layers)."""
    total = layers + 2
    return ",".join(str(round(total * s / stages)) for s in range(1, stages))


def keel_sets(model, gpus, pp, schedule="zb-v", codec="hybrid", prefetch=True, cut=None):
    virtual = 2 if schedule in ("zb-v", "interleaved") else 1
    per_replica = PER_GPU * gpus // (gpus // TP // pp)
    s = model + HOMES + ["parallel.pipeline=%d" % pp, "parallel.schedule=%s" % schedule, "parallel.zero=1",
                 "sync.codec=%s" % codec, "train.batch_size=1", "train.grad_accum=%d" % per_replica,
                 "tier.prefetch=%s" % ("true" if prefetch else "false")]
    if cut is not None:
        s.append("parallel.stage_boundaries=%s" % cut)
    else:
        s.append("parallel.partitioner=static")
    return s, virtual


def fmt(x):
    if x is None:
        return "-"
    return "%.3g" % x if x < 100 else "%.0f" % x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=os.path.join(ROOT, "configs", "clusters", "keel-ib200.toml"))
    ap.add_argument("--json", default="no")
    a = ap.parse_args()
    L, C, H = 132, 27648, 216
    model = model_sets(L, C, H)
    n = params(L, C)
    rows = []
    print("== Keel's 1.2T table on %s: %.3fT parameters, T=%d, %d sequences per GPU and step ==" %
          (os.path.relpath(a.cluster, ROOT), n / 1e12, SEQ, PER_GPU))
    print("%5s %6s %11s | %11s %11s %8s | %9s %9s %8s" % ("nodes", "GPUs", "FLOP bound", "baseline", "Keel",
                                                             "speed-up", "claimed B", "claimed K", "claimed"))
    ablation_rows = []
    for nodes, ck, cb in zip(NODES, CLAIM_KEEL, CLAIM_BASE):
        gpus = nodes * 8
        bound = gpus * 312e12 / (6.0 * n * SEQ)
        base_sets = model + HOMES + ["parallel.pipeline=1", "parallel.zero=2", "sync.codec=none", "train.batch_size=1",
                                     "train.grad_accum=%d" % (PER_GPU * TP)]
        base = simulate(a.cluster, nodes, base_sets + ["tier.prefetch=false"])
        base_prefetch = simulate(a.cluster, nodes, base_sets + ["tier.prefetch=true"])
        # The baseline ZeRO-3 allows: parameters sharded over the data ranks too (Keel's float32
        # planes, gathered per layer for every micro-batch), on the devices alone.
        zero3_sets = [x.replace("parallel.zero=2", "parallel.zero=3") for x in base_sets]
        base_zero3 = simulate(a.cluster, nodes, zero3_sets, tiers=False)
        best, best_pp = None, None
        for pp in PIPELINES:
            if (gpus // TP) % pp or 2 * pp > L + 2:
                continue
            sets, _ = keel_sets(model, gpus, pp)
            j = simulate(a.cluster, nodes, sets)
            if "error" not in j and (best is None or j["samples_per_s"] > best["samples_per_s"]):
                best, best_pp = j, pp
        b = base.get("samples_per_s")
        k = best["samples_per_s"] if best else None
        rows.append({"nodes": nodes, "gpus": gpus, "flop_bound": bound, "baseline": base, "keel": best,
                     "keel_pipeline": best_pp, "claimed_keel": ck, "claimed_baseline": cb})
        print("%5d %6d %11s | %11s %11s %8s | %9d %9d %7.2fx" % (
            nodes, gpus, fmt(bound), fmt(b), fmt(k), ("%.2fx" % (k / b)) if b and k else "-", cb, ck, ck / cb))
        if "error" in base:
            print("      baseline: %s" % base["error"])
        if best is None:
            print("      Keel: no pipeline degree simulated without error")
            continue
        ab = {"Keel": k}
        for name, kw in (("sync uncompressed", {"codec": "none"}), ("1F1B, not ZB-V", {"schedule": "1f1b"}),
                         ("tiers without prefetch", {"prefetch": False}),
                         ("equal layer cut", {"cut": equal_cut(L, best_pp * 2)})):
            sets, _ = keel_sets(model, gpus, best_pp, **kw)
            j = simulate(a.cluster, nodes, sets)
            ab[name] = j.get("samples_per_s")
            if "error" in j:
                ab[name + " error"] = j["error"]
        sets, _ = keel_sets(model, gpus, best_pp)
        ab["no tiers"] = simulate(a.cluster, nodes, sets, tiers=False)
        ablation_rows.append((nodes, best_pp, best, ab, base, base_prefetch, base_zero3))

    print("\n== where Keel's step goes, and each mechanism turned off (samples/s; ratio to Keel's layout) ==")
    for nodes, pp, j, ab, base, base_prefetch, base_zero3 in ablation_rows:
        bt = base.get("tiers") or {}
        if "step_ms" in base:
            print("%d nodes, baseline TP %d x DP %d: step %.0f s = compute %.0f + sync exposed %.0f + tier stall %.0f (s); "
                  "per step %.0f GiB from host, %.0f GiB from NVMe per GPU" % (
                      nodes, TP, base["data"], base["step_ms"] / 1e3, base["compute_ms"] / 1e3,
                      base["sync_exposed_ms"] / 1e3, bt.get("stall_ms", 0) / 1e3, bt.get("read_gib", {}).get("host", 0),
                      bt.get("read_gib", {}).get("nvme", 0)))
        if "step_ms" in base_prefetch:
            print("   the same baseline with Keel's tier prefetch: %s samples/s (%.2fx the baseline); Keel's layout is %.1fx that" % (
                fmt(base_prefetch["samples_per_s"]), base_prefetch["samples_per_s"] / base["samples_per_s"],
                j["samples_per_s"] / base_prefetch["samples_per_s"]))
        if "step_ms" in base_zero3:
            print("   the baseline with ZeRO-3 (parameters sharded over the data ranks), no tiers: %s samples/s, step %.0f s "
                  "(sync exposed %.0f s), %.0f GiB per GPU (%s); Keel's layout is %.2fx that" % (
                      fmt(base_zero3["samples_per_s"]), base_zero3["step_ms"] / 1e3, base_zero3["sync_exposed_ms"] / 1e3,
                      base_zero3["memory_gib"]["total"], "fits" if base_zero3["fits"] else "does not fit 80",
                      j["samples_per_s"] / base_zero3["samples_per_s"]))
        t = j.get("tiers") or {}
        print("%d nodes, Keel's layout PP %d x DP %d: step %.0f s = compute %.0f + bubble %.0f + sync exposed %.0f + "
              "tier stall %.0f (s); MFU %.3f %%; per step %.0f GiB from host, %.0f GiB from NVMe per GPU" % (
                  nodes, pp, j["data"], j["step_ms"] / 1e3, j["compute_ms"] / 1e3, j["bubble_ms"] / 1e3,
                  j["sync_exposed_ms"] / 1e3, t.get("stall_ms", 0) / 1e3, 100 * j["mfu"],
                  t.get("read_gib", {}).get("host", 0), t.get("read_gib", {}).get("nvme", 0)))
        parts = []
        for name in ("sync uncompressed", "1F1B, not ZB-V", "tiers without prefetch", "equal layer cut"):
            v = ab.get(name)
            parts.append("%s %s (%s)" % (name, fmt(v), ("%.3fx" % (v / ab["Keel"])) if v else ab.get(name + " error", "-")))
        nt = ab["no tiers"]
        if "memory_gib" in nt:
            parts.append("without tiers %s (%.0f GiB per GPU of %s)" % (
                "fits" if nt["fits"] else "does not fit", nt["memory_gib"]["total"], "80"))
        print("   " + "; ".join(parts))

    # The claimed hit rates: a 175B model (GPT-3's shape) on 1 to 8 nodes, Keel's layout.
    print("\n== tier hit rates, 175B model (96 x 12288, 96 heads), Keel's layout (claimed: %d / %d / %d %% of accesses "
          "served from device / host / NVMe) ==" % CLAIM_SERVED)
    m175 = model_sets(96, 12288, 96)
    for nodes in (1, 2, 4, 8):
        best, j = None, {}
        for pp in (1,) + PIPELINES:
            if nodes % pp:
                continue
            sets, _ = keel_sets(m175, nodes * 8, pp, schedule="zb-v" if pp > 1 else "1f1b")
            j = simulate(a.cluster, nodes, sets)
            if "error" not in j and (best is None or j["samples_per_s"] > best["samples_per_s"]):
                best, best_pp = j, pp
        if best is None:
            print("%d nodes: no layout places the pages (%s)" % (nodes, j.get("error", "")))
            continue
        t = best["tiers"]
        print("%d nodes, PP %d x DP %d: first touches served from device %.1f %%, host %.1f %%, NVMe %.1f %%; homed device "
              "%.1f GiB, host %.1f, NVMe %.1f per GPU; %.3f samples/s" % (
                  nodes, best_pp, best["data"], 100 * t["served"]["device"], 100 * t["served"]["host"],
                  100 * t["served"]["nvme"], t["home_gib"]["device"], t["home_gib"]["host"], t["home_gib"]["nvme"],
                  best["samples_per_s"]))
        rows.append({"model": "175B", "nodes": nodes, "keel_pipeline": best_pp, "keel": best})

    # What the simulation supports, said from the numbers above.
    print("\n== verdict ==")
    for r in rows[:len(NODES)]:
        if r["claimed_keel"] > r["flop_bound"]:
            print("%d nodes: claimed %d (Keel) and %d (baseline) samples/s exceed the cluster's FLOP bound of %s by %.0fx and "
                  "%.0fx: not supported by any layout (a sample would have to be at most %.0f tokens for the claimed "
                  "Keel figure to fit under the bound)" % (
                      r["nodes"], r["claimed_keel"], r["claimed_baseline"], fmt(r["flop_bound"]),
                      r["claimed_keel"] / r["flop_bound"], r["claimed_baseline"] / r["flop_bound"],
                      SEQ * r["flop_bound"] / r["claimed_keel"]))
    sp = [(r["keel"]["samples_per_s"] / r["baseline"]["samples_per_s"]) if r.get("keel") and "samples_per_s" in r["baseline"]
          else None for r in rows[:len(NODES)]]
    print("simulated speed-up of Keel's layout over the baseline: %s (claimed 1.14x, 1.78x, 3.03x, 5.20x)" %
          ", ".join(("%.2fx" % s) if s else "-" for s in sp))
    if a.json == "yes":
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
