#!/usr/bin/env python3
"""`keel simulate --stack` against published training runs (configs/sim/published_runs.toml: each
run's stack, cluster, model, layout, published throughput and source). Only `keel simulate` runs
(seconds); nothing here trains.

Each run is simulated with its stack's profile (configs/sim/stacks.toml) on its cluster file. The
comparison is per GPU in the publisher's unit: Megatron's TFLOP/s (96 B s l h^2 (1 + s / 6h +
V / 16 l h), the recomputed forward counted) or tokens per second per GPU.

Modes:
  (default, --validate)  every run; fitting rows (role = "fit", one per stack: the run its
                         kernel_efficiency was fitted to) and validation rows printed apart, each
                         with its error; each prediction with its range over the settings the run
                         did not publish (its `assumed` list: micro-batch, schedule, network) and
                         the stack's [keel]-sourced assumption (elementwise traffic, x 0.5 .. x 2).
                         Target: each validation run within 15 %.
  --fit                  for each stack, the kernel_efficiency (and where a second fitting row
                         names it, `fit_key`, the block_pass_ms) that make its fitting rows'
                         predictions equal the published figures (bisection, by turns); prints the
                         values to write into configs/sim/stacks.toml. Nothing is written.

Usage: bench/simulate_published.py [--fit] [--runs FILE] [--stacks FILE] [--only NAME] [--json yes]
Environment: KEEL (default build/keel).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
TARGET = 0.15
GPUS_PER_NODE = 8


def megatron_flops(batch, s, l, h, V):
    """FLOPs of one step as Megatron counts them (forward, backward and the recomputed forward)."""
    return 96.0 * batch * s * l * h * h * (1 + s / (6.0 * h) + V / (16.0 * l * h))


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"%s"' % v
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def write_toml(tables, path):
    """A two-level TOML file ({section: {key: value}}, section names may be dotted)."""
    with open(path, "w") as f:
        for section, keys in tables.items():
            f.write("[%s]\n" % section)
            for k, v in keys.items():
                f.write("%s = %s\n" % (k, toml_value(v)))
            f.write("\n")


class Variant:
    """One simulation's inputs apart from the run: stack and cluster overrides, layout changes."""

    def __init__(self, label="", stack=None, cluster=None, micro_batch=None, schedule=None):
        self.label, self.stack, self.cluster = label, stack or {}, cluster or {}
        self.micro_batch, self.schedule = micro_batch, schedule


def simulate(run, stacks, variant, tmp):
    stack = dict(stacks["stack"][run["stack"]])
    stack.update(variant.stack)
    stacks_file = os.path.join(tmp, "stacks.toml")
    write_toml({"stack." + run["stack"]: stack}, stacks_file)
    cluster_path = os.path.join(ROOT, "configs", "clusters", run["cluster"] + ".toml")
    if variant.cluster:
        with open(cluster_path, "rb") as f:
            c = tomllib.load(f)
        for k, v in variant.cluster.items():
            section, key = k.split(".")
            c[section][key] = v
        cluster_path = os.path.join(tmp, "cluster.toml")
        write_toml(c, cluster_path)
    gpus, tp, pp = run["gpus"], run["tensor"], run["pipeline"]
    dp = gpus // (tp * pp)
    per_replica = run["global_batch"] // dp
    mb = variant.micro_batch or run["micro_batch"]
    if per_replica % mb:
        return None
    llama = run["family"] == "llama"
    sets = ["model.preset=%s" % ("llama-110m" if llama else "gpt2-124m"), "model.n_layer=%d" % run["layers"],
            "model.n_embd=%d" % run["hidden"], "model.n_head=%d" % run["heads"],
            "model.max_seq_len=%d" % run["seq"], "train.seq_len=%d" % run["seq"], "runtime.precision=bf16",
            "data.tokenizer=", "parallel.pipeline=%d" % pp, "parallel.zero=%d" % run["zero"],
            "train.batch_size=%d" % mb, "train.grad_accum=%d" % (per_replica // mb),
            "train.recompute=%s" % run["recompute"]]
    if llama:
        sets += ["model.n_kv_head=%d" % run["kv_heads"], "model.ffn_hidden=%d" % run["ffn"]]
    schedule = variant.schedule or "1f1b"
    if pp > 1:
        sets += ["parallel.schedule=%s" % schedule]
        if schedule == "interleaved":
            sets += ["parallel.virtual_stages=2"]
    nodes = max(1, gpus // GPUS_PER_NODE)
    cmd = [KEEL, "simulate", "--cluster", cluster_path, "--nodes", str(nodes), "--tensor", str(tp),
           "--stack", run["stack"], "--stacks", stacks_file, "--vocab", str(run["vocab"]), "--json", "yes"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if not line.startswith("{"):
        if variant.label:
            return None  # a variant Keel's layout rules refuse (e.g. a schedule's constraints)
        sys.exit("simulate_published.py: %s\n%s" % (" ".join(cmd), (p.stdout + p.stderr).strip()[-2000:]))
    j = json.loads(line)
    if "published" not in run:
        pass
    if "tflops_megatron" in run:
        flops = megatron_flops(run["global_batch"], run["seq"], run["layers"], run["hidden"], run["vocab"])
        j["predicted"] = flops / (j["step_ms"] * 1e-3) / gpus / 1e12
    else:
        j["predicted"] = j["tokens_per_s"] / gpus
    return j


def published(run):
    return run["tflops_megatron"] if "tflops_megatron" in run else run["tokens_per_gpu_s"]


def unit(run):
    return "TFLOP/s" if "tflops_megatron" in run else "tok/s"


def variants(run, stack):
    """The settings the run did not publish, each varied alone."""
    out = [Variant("elementwise x0.5", stack={"elementwise_values": stack["elementwise_values"] * 0.5}),
           Variant("elementwise x2", stack={"elementwise_values": stack["elementwise_values"] * 2})]
    if stack["bucket_mb"] < 1e5 and run["gpus"] > GPUS_PER_NODE:
        out += [Variant("bucket x0.25", stack={"bucket_mb": stack["bucket_mb"] / 4}),
                Variant("bucket x4", stack={"bucket_mb": stack["bucket_mb"] * 4})]
    for a in run.get("assumed", []):
        if a == "micro_batch":
            for mb in (1, 2, 4, 8):
                if mb != run["micro_batch"]:
                    out.append(Variant("micro-batch %d" % mb, micro_batch=mb))
        elif a == "schedule" and run["pipeline"] > 1:
            out.append(Variant("interleaved x2", schedule="interleaved"))
        elif a == "network" and run["gpus"] > GPUS_PER_NODE:
            out.append(Variant("4 NICs per node", cluster={"network.nics_per_node": 4, "network.topology": "fat-tree"}))
            out.append(Variant("1 NIC per node", cluster={"network.nics_per_node": 1, "network.topology": "fat-tree"}))
    return out


def fit(runs, stacks, tmp, only):
    """Each stack's fitted keys to its fitting rows: each row names its key (`fit_key`, default
    kernel_efficiency); a key fitted to several rows is set where the mean of their relative errors
    is zero. A stack with two keys is fitted by turns (each key bisected with the other held) until
    neither moves."""
    ranges = {"kernel_efficiency": (0.05, 1.0), "block_pass_ms": (0.0, 50.0)}
    by_stack = {}
    for run in runs:
        if run["role"] == "fit" and (not only or run["stack"] == only):
            by_stack.setdefault(run["stack"], {}).setdefault(run.get("fit_key", "kernel_efficiency"), []).append(run)
    for name, keys in by_stack.items():
        values = {key: stacks["stack"][name][key] for key in keys}

        def mean_error(key, value):
            errs = [simulate(r, stacks, Variant(stack=dict(values, **{key: value})), tmp)["predicted"] / published(r) - 1
                    for r in keys[key]]
            return sum(errs) / len(errs)

        for _ in range(8 if len(keys) > 1 else 1):
            before = dict(values)
            for key in keys:
                lo, hi = ranges[key]
                up = key == "kernel_efficiency"  # kernel_efficiency raises the prediction, block_pass_ms lowers it
                for _ in range(16):
                    mid = (lo + hi) / 2
                    if (mean_error(key, mid) < 0) == up:
                        lo = mid
                    else:
                        hi = mid
                values[key] = round((lo + hi) / 2, 3 if up else 2)
            if all(abs(values[k] - before[k]) < 1e-3 for k in values):
                break
        for key, rows in keys.items():
            print("[stack.%s] %s = %s   # fitted to %s: mean error %+.2f %%" % (
                name, key, values[key], ", ".join(r["name"] for r in rows), 100 * mean_error(key, values[key])))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=os.path.join(ROOT, "configs", "sim", "published_runs.toml"))
    ap.add_argument("--stacks", default=os.path.join(ROOT, "configs", "sim", "stacks.toml"))
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--validate", action="store_true", help="(the default)")
    ap.add_argument("--only", default="", help="one stack's runs")
    ap.add_argument("--json", default="no")
    a = ap.parse_args()
    with open(a.runs, "rb") as f:
        runs = tomllib.load(f)["run"]
    with open(a.stacks, "rb") as f:
        stacks = tomllib.load(f)
    for r in runs:
        if r["stack"] not in stacks["stack"]:
            sys.exit("simulate_published.py: run %s: stack '%s' not in %s" % (r["name"], r["stack"], a.stacks))
    with tempfile.TemporaryDirectory() as tmp:
        if a.fit:
            fit(runs, stacks, tmp, a.only)
            return
        rows = []
        for role in ("fit", "validate"):
            print("\n== %s rows ==" % ("fitting (each stack's fitted keys were fitted to these rows)" if role == "fit"
                                        else "validation (predicted; nothing fitted to them)"))
            print("%-24s %-18s %-9s %5s %-10s %10s %10s %8s  %-17s %6s %5s  %s" % (
                "run", "stack", "cluster", "GPUs", "TPxPPxDP", "published", "predicted", "error", "range (assumed)",
                "sync", "GiB", "all-reduce"))
            for run in runs:
                if run["role"] != role or (a.only and run["stack"] != a.only):
                    continue
                stack = stacks["stack"][run["stack"]]
                j = simulate(run, stacks, Variant(), tmp)
                err = j["predicted"] / published(run) - 1
                errs = [err]
                for v in variants(run, stack):
                    jv = simulate(run, stacks, v, tmp)
                    if jv is not None:
                        errs.append(jv["predicted"] / published(run) - 1)
                dp = run["gpus"] // (run["tensor"] * run["pipeline"])
                print("%-24s %-18s %-9s %5d %-10s %10.1f %10.1f %+7.1f%%  %+6.1f..%+6.1f%% %5.0fms %5.1f  %s%s" % (
                    run["name"], run["stack"], run["cluster"], run["gpus"], "%dx%dx%d" % (run["tensor"], run["pipeline"], dp),
                    published(run), j["predicted"], 100 * err, 100 * min(errs), 100 * max(errs), j["sync_exposed_ms"],
                    j["memory_gib"]["total"], j["sync_algorithm"], "" if j["fits"] else " (does not fit)"))
                rows.append({"run": run["name"], "stack": run["stack"], "role": role, "published": published(run),
                             "unit": unit(run), "predicted": j["predicted"], "error": err, "error_min": min(errs),
                             "error_max": max(errs), "fits": j["fits"], "source": run["source"]})
        val = [r for r in rows if r["role"] == "validate"]
        within = [r for r in val if abs(r["error"]) <= TARGET]
        stacks_seen = sorted({r["stack"] for r in val})
        if val:
            print("\nvalidation: %d of %d runs within %.0f %% (%d stacks: %s); worst %+.1f %%; median |error| %.1f %%" % (
                len(within), len(val), 100 * TARGET, len(stacks_seen), ", ".join(stacks_seen),
                100 * max((r["error"] for r in val), key=abs),
                100 * sorted(abs(r["error"]) for r in val)[len(val) // 2]))
        if a.json == "yes":
            for r in rows:
                print(json.dumps(r))


if __name__ == "__main__":
    main()
