#!/usr/bin/env python3
"""What checkpoints cost: Keel (async differential, and synchronous) vs PyTorch torch.save, side by side.

Trains the same GPT on random tokens with a checkpoint every K steps and without any, and reports
for each trainer the tokens/s, the slowdown checkpoints cause, the training time lost per
checkpoint, and the bytes each checkpoint writes. Then a fine-tuning run (every layer but the
last block and the head frozen) shows what differential checkpoints write when few chunks move.
Runs are interleaved and repeated; each configuration's best tokens/s is kept (noisy machine).

Usage: bench/checkpoint_cost.py [--preset small|gpt2-124m] [--steps N] [--every K] [--repeats R]
Environment: KEEL (default build/keel), PYTHON (default /usr/bin/python3).
"""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
PEER = os.path.join(ROOT, "bench", "torch_gpt2_train.py")
MODELS = {  # preset: (layers, channels, heads, batch, seq)
    "small": (4, 256, 4, 8, 128),
    "gpt2-124m": (12, 768, 12, 4, 64),
}


def write_shard(path, n, vocab, seed):
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack(f"<{n}H", *(rng.randrange(vocab) for _ in range(n))))


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"checkpoint_cost.py: failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def keel(work, tag, preset, steps, every, extra):
    layers, channels, heads, batch, seq = MODELS[preset]
    run_dir = os.path.join(work, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [KEEL, "train", "--set", f"model.preset={preset}", "--set", "model.vocab_size=50257",
           "--set", f"model.max_seq_len={seq}", "--set", f"train.batch_size={batch}", "--set", f"train.seq_len={seq}",
           "--set", f"train.steps={steps}", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
           "--set", "train.sample_tokens=0", "--set", "runtime.threads=2", "--set", "runtime.peak_gflops=100",
           "--set", f"train.checkpoint_every={every}", "--set", f"data.train={work}/train.bin",
           "--set", f"data.val={work}/val.bin", "--set", "data.tokenizer=", "--set", f"train.run_dir={run_dir}"]
    for kv in extra:
        cmd += ["--set", kv]
    run(cmd, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps_ = [l for l in lines if "loss" in l and l["step"] > 1]
    events = [l for l in lines if l.get("event") == "checkpoint" and l["step"] < steps]  # not the final save
    total_s = sum(l["ms"] for l in steps_) / 1000.0
    tokens = batch * seq * len(steps_)
    stall = sum(l.get("ckpt_stall_ms", 0) for l in steps_)
    full = [e["written_bytes"] for e in events if e["full"]]
    diff = [e["written_bytes"] for e in events if not e["full"]]
    return {"tps": tokens / total_s, "stall_ms": stall / max(1, len(events)), "count": len(events),
            "full_mb": sum(full) / len(full) / 1e6 if full else 0, "diff_mb": sum(diff) / len(diff) / 1e6 if diff else 0,
            "raw_mb": events[0]["raw_bytes"] / 1e6 if events else 0,
            "write_ms": sum(e["write_ms"] for e in events) / max(1, len(events))}


def torch_run(work, preset, steps, every):
    layers, channels, heads, batch, seq = MODELS[preset]
    d = os.path.join(work, "torch-ckpt")
    os.makedirs(d, exist_ok=True)
    cmd = [PYTHON, PEER, "--layers", str(layers), "--channels", str(channels), "--heads", str(heads),
           "--vocab", "50257", "--batch", str(batch), "--seq", str(seq), "--steps", str(steps - 1),
           "--warmup-steps", "1", "--threads", "2"]
    if every:
        cmd += ["--ckpt-every", str(every), "--ckpt-dir", d]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OPENBLAS_NUM_THREADS="2",
               GLIBC_TUNABLES="glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736")
    out = json.loads(run(cmd, env=env).strip().splitlines()[-1])
    return {"tps": out["tokens_per_s"], "stall_ms": out["ckpt_ms_mean"], "count": out["ckpt_count"],
            "full_mb": out["ckpt_bytes"] / 1e6, "diff_mb": 0, "raw_mb": 0, "write_ms": 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=41)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    if a.steps < 2 * a.every or a.every < 1 or a.repeats < 1:
        sys.exit("checkpoint_cost.py: need --every >= 1, --steps >= 2 x --every, --repeats >= 1")
    if not os.access(KEEL, os.X_OK):
        sys.exit(f"checkpoint_cost.py: {KEEL} not found; run scripts/build.sh")
    work = tempfile.mkdtemp(prefix="keel-ckpt-cost.")
    try:
        write_shard(os.path.join(work, "train.bin"), 300000, 50257, 1)
        write_shard(os.path.join(work, "val.bin"), 20000, 50257, 2)
        n_layer = MODELS[a.preset][0]
        configs = [
            ("keel, no checkpoints", lambda: keel(work, "none", a.preset, a.steps, 0, [])),
            ("keel, async differential", lambda: keel(work, "async", a.preset, a.steps, a.every, [])),
            ("keel, synchronous", lambda: keel(work, "sync", a.preset, a.steps, a.every, ["checkpoint.async=false"])),
            ("pytorch, no checkpoints", lambda: torch_run(work, a.preset, a.steps, 0)),
            ("pytorch, torch.save", lambda: torch_run(work, a.preset, a.steps, a.every)),
        ]
        best = {}
        for rep in range(a.repeats):
            for name, fn in configs:
                print(f"  [{rep + 1}/{a.repeats}] {name} ...", file=sys.stderr, flush=True)
                r = fn()
                if name not in best or r["tps"] > best[name]["tps"]:
                    best[name] = r
        tune = keel(work, "finetune", a.preset, a.steps, a.every, [f"optim.freeze_layers={n_layer}"])

        print(f"\n{a.preset}: {a.steps} steps, a checkpoint every {a.every} steps, best of {a.repeats}")
        print(f"{'':28} {'tok/s':>9} {'slowdown':>9} {'lost/ckpt ms':>13} {'MB/ckpt full':>13} {'MB/ckpt diff':>13}")
        for name, base in (("keel", "keel, no checkpoints"), ("pytorch", "pytorch, no checkpoints")):
            for key in [k for k, _ in configs if k.startswith(name)]:
                r = best[key]
                slow = "" if key == base else f"{100 * (1 - r['tps'] / best[base]['tps']):8.1f}%"
                lost = "" if key == base else f"{r['stall_ms']:13.1f}"
                full = "" if key == base else f"{r['full_mb']:13.1f}"
                diff = f"{r['diff_mb']:13.1f}" if r["diff_mb"] else ""
                print(f"{key:28} {r['tps']:9.1f} {slow:>9} {lost:>13} {full:>13} {diff:>13}")
        ka, pt = best["keel, async differential"], best["pytorch, torch.save"]
        print(f"training time lost per checkpoint, keel async / torch.save: {ka['stall_ms']:.1f} / {pt['stall_ms']:.1f} ms"
              f" = {ka['stall_ms'] / pt['stall_ms']:.3f}")
        print(f"keel background write per checkpoint (encode + write + fsync, off the training thread): {ka['write_ms']:.0f} ms")
        print(f"fine-tuning (optim.freeze_layers={n_layer}: only the last block and the head train): differential "
              f"checkpoints write {tune['diff_mb']:.2f} MB of {tune['raw_mb']:.1f} MB of state "
              f"({100 * tune['diff_mb'] / tune['raw_mb']:.1f} %); full ones {tune['full_mb']:.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
