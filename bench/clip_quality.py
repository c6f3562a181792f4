#!/usr/bin/env python3
"""Time to quality for Keel's dual-encoder switches: held-out recall@5 against training seconds,
over several seeds, on every installed icon theme.

Dataset: `keel data images --from /usr/share/icons --out WORKDIR/icons --size 64` (Tango, oxygen,
Adwaita, hicolor as installed: 2,176 training and 255 held-out pairs here), made once per work
directory.

Each configuration of bench/clip.py's ViT family (plain ViT p8 L4 C64 H4 and its switches: FLIP,
the tower cadences, all together) trains --steps steps (default 600) with every seed of --seeds
(default 1,2,3), batch 32, 2 threads, Keel's default (passive) OpenMP waiting, an evaluation every
--eval-every steps (default 100). For each evaluation the bench takes the training seconds so far
(the sum of the step lines' `ms`: evaluations not counted) and R@5, the mean of image->text and
text->image; per configuration it averages both over the seeds.

Output: a table (configuration | pairs/s | mean R@5 at each evaluation, with its training seconds |
seconds to reach --target R@5, the first evaluation whose seed-mean reaches it, and that time
against the plain ViT's), and WORKDIR/clip_quality.json. The table says what each switch buys at
equal quality, which pairs/s alone does not.

Usage: bench/clip_quality.py [--steps N] [--eval-every E] [--seeds 1,2,3] [--configs LIST]
                             [--target R] [--workdir DIR]
Environment: KEEL (default build/keel).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.dont_write_bytecode = True
from benchutil import print_table, run_logged, run_or_exit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
SOURCE = "/usr/share/icons"
THREADS = 2
VIT = ["clip.image_tower=vit", "clip.vit_patch=8", "clip.vit_layers=4", "clip.vit_width=64", "clip.vit_heads=4"]
CONFIGS = {
    "vit": ("plain ViT", []),
    "vit-flip": ("+ FLIP mask 0.5", ["clip.vit_mask=0.5"]),
    "vit-text2": ("+ text_update_every = 2", ["clip.text_update_every=2"]),
    "vit-image2": ("+ image_update_every = 2", ["clip.image_update_every=2"]),
    "vit-all": ("all: norm, text/2, mask 0.5, int8",
                ["clip.grad_balance=norm", "clip.text_update_every=2", "clip.vit_mask=0.5", "clip.visual_quant=int8"]),
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def train(cfg, seed, dataset, work, steps, eval_every):
    run_dir = os.path.join(work, "%s-seed%d" % (cfg, seed))
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = VIT + CONFIGS[cfg][1] + [
        "clip.dataset=" + dataset, "data.tokenizer=" + os.path.join(dataset, "tokenizer.json"),
        "train.run_dir=" + run_dir, "train.steps=%d" % steps, "train.eval_every=%d" % eval_every,
        "train.seed=%d" % seed, "runtime.threads=%d" % THREADS]
    cmd = [KEEL, "train", "--config", os.path.join(ROOT, "configs", "clip.toml")]
    for s in sets:
        cmd += ["--set", s]
    run_logged(cmd, run_dir + ".log", ROOT, 3600, "clip_quality.py: %s seed %d" % (cfg, seed),
               {"OMP_NUM_THREADS": str(THREADS)})
    seconds, curve, rates = 0.0, [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            j = json.loads(line)
            if "samples_per_s" in j:
                seconds += j["ms"] / 1e3
                rates.append(j["samples_per_s"])
            elif "recall_i2t_at5" in j:
                curve.append((j["step"], seconds, (j["recall_i2t_at5"] + j["recall_t2i_at5"]) / 2))
    return {"config": cfg, "seed": seed, "curve": curve, "pairs_per_s": statistics.median(rates[3:] or rates)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--target", type=float, default=0.09)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    cfgs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in cfgs if c not in CONFIGS]
    if unknown or not cfgs:
        sys.exit("clip_quality.py: --configs takes any of %s; found %s" % (", ".join(CONFIGS), ", ".join(unknown) or "none"))
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s]
    except ValueError:
        sys.exit("clip_quality.py: --seeds: expected integers separated by commas, found %s" % a.seeds)
    if a.steps < 1 or a.eval_every < 1 or not seeds:
        sys.exit("clip_quality.py: --steps and --eval-every must be positive and --seeds not empty")
    if not os.path.isdir(SOURCE):
        sys.exit("clip_quality.py: %s not found" % SOURCE)
    work = os.path.abspath(a.workdir) if a.workdir else tempfile.mkdtemp(prefix="keel-clip-quality.")
    os.makedirs(work, exist_ok=True)
    log("clip_quality.py: work directory %s" % work)
    dataset = os.path.join(work, "icons")
    if not os.path.exists(os.path.join(dataset, "meta.json")):
        shutil.rmtree(dataset, ignore_errors=True)
        log(run_or_exit([KEEL, "data", "images", "--from", SOURCE, "--out", dataset, "--size", "64"],
                        dict(os.environ)).strip().splitlines()[-1])
    t0 = time.time()
    runs = []
    for seed in seeds:  # interleaved: every configuration sees the machine in the same state
        for cfg in cfgs:
            r = train(cfg, seed, dataset, work, a.steps, a.eval_every)
            runs.append(r)
            log("  %-10s seed %d: %6.1f pairs/s, R@5 %s" % (cfg, seed, r["pairs_per_s"],
                                                           " ".join("%.3f" % c[2] for c in r["curve"])))
    rows, table = [], {}
    for cfg in cfgs:
        mine = [r for r in runs if r["config"] == cfg]
        n = min(len(r["curve"]) for r in mine)
        curve = [(mine[0]["curve"][i][0], statistics.mean(r["curve"][i][1] for r in mine),
                  statistics.mean(r["curve"][i][2] for r in mine)) for i in range(n)]
        reached = next((c for c in curve if c[2] >= a.target), None)
        table[cfg] = {"label": CONFIGS[cfg][0], "pairs_per_s": statistics.median(r["pairs_per_s"] for r in mine),
                      "curve": curve, "seconds_to_target": reached[1] if reached else None,
                      "step_to_target": reached[0] if reached else None}
    base = table.get("vit", {}).get("seconds_to_target")
    print()
    print("=== Keel's switches, time to quality: %d steps, batch 32, %d threads, seeds %s, every installed icon theme "
          "(R@5 = mean of both directions, mean over seeds; chance 0.020) ===" % (a.steps, THREADS, a.seeds))
    evals = [c[0] for c in table[cfgs[0]]["curve"]]
    head = ["configuration", "pairs/s"] + ["R@5 at step %d (s)" % s for s in evals] + [
        "s to R@5 %.2f" % a.target, "vs plain"]
    for cfg in cfgs:
        t = table[cfg]
        row = [t["label"], "%.0f" % t["pairs_per_s"]] + ["%.3f (%.0f)" % (c[2], c[1]) for c in t["curve"]]
        row += ["" for _ in range(len(evals) - len(t["curve"]))]
        reached = t["seconds_to_target"]
        row += ["%.0f (step %d)" % (reached, t["step_to_target"]) if reached is not None else "not reached",
                "%.2fx" % (base / reached) if reached and base else "-"]
        rows.append(row)
    print_table(head, rows)
    print("(s: training seconds so far, the sum of the step times, evaluations excluded; 'vs plain': the plain "
          "ViT's seconds to the target over this configuration's.)")
    out = os.path.join(work, "clip_quality.json")
    with open(out, "w") as f:
        json.dump({"steps": a.steps, "eval_every": a.eval_every, "seeds": seeds, "target": a.target,
                   "runs": runs, "table": table, "wall_s": time.time() - t0}, f, indent=1)
    print()
    print("results: %s (%.0f s in all)" % (out, time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
