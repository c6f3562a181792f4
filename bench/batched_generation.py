#!/usr/bin/env python3
"""Batched generation: Keel's `keel generate --prompts --batch B` (continuous batching over the
paged KV cache) at B = 1, 8, 32 against transformers' generate() (PyTorch 2.x, its KV cache,
static batches with left padding) on the same model (Keel's checkpoint exported with
`keel export --hf`) and prompts of the same token counts.

  bench/.venv/bin/python bench/batched_generation.py [--steps 10] [--tokens 64] [--prompts 32]

The model: llama-d4 with a 512-token BPE (model.vocab_size = 512: every sampled id decodes), trained briefly on /usr/share/common-licenses (speed,
not quality, is measured), context 1024. The prompts: the first lines of 40+ characters of the
licences (up to 200 characters each), so their lengths differ. Greedy. Keel's figure is its own
count of new tokens over the generation's time (model load excluded: the `tokens/s` line on
stderr); transformers' is its new tokens (padding excluded) over the generate() calls' time. Both
on 2 threads (torch.set_num_threads; Keel's OMP_NUM_THREADS=2). Prints one line per B and the
load average before and after.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.path.join(ROOT, "build", "keel")
LICENCES = "/usr/share/common-licenses"


def run(*args, **kw):
    return subprocess.run([KEEL, *args], check=True, capture_output=True, text=True, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    env = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        run("tokenize", "--input", LICENCES, "--out", f"{d}/data", "--vocab-size", "512", env=env)
        run("train", "--set", "model.preset=llama-d4", "--set", "model.vocab_size=512", "--set", "model.max_seq_len=1024", "--set", "train.seq_len=256",
            "--set", "train.batch_size=4", "--set", f"train.steps={args.steps}", "--set", "train.sample_tokens=0",
            "--set", "train.eval_every=0", "--set", "train.eval_batches=1", "--set", f"data.train={d}/data/train.bin",
            "--set", f"data.val={d}/data/val.bin", "--set", f"data.tokenizer={d}/data/tokenizer.json",
            "--set", f"train.run_dir={d}/run", "--set", "train.log_every=1000", env=env)
        ckpt = sorted(os.listdir(f"{d}/run/ckpt"))[-1]
        ckpt = f"{d}/run/ckpt/{ckpt}"
        lines = []
        for name in sorted(os.listdir(LICENCES)):
            with open(os.path.join(LICENCES, name), errors="replace") as f:
                for line in f:
                    line = " ".join(line.split())
                    if len(line) >= 40 and line[:200] not in lines:
                        lines.append(line[:200])
                        break
        i = 0
        while len(lines) < args.prompts:  # more than one per licence: their second lines, and so on
            with open(os.path.join(LICENCES, sorted(os.listdir(LICENCES))[i % 17]), errors="replace") as f:
                for line in f:
                    line = " ".join(line.split())
                    if len(line) >= 40 and line[:200] not in lines:
                        lines.append(line[:200])
                        break
            i += 1
        lines = lines[: args.prompts]
        with open(f"{d}/prompts.txt", "w") as f:
            f.write("\n".join(lines) + "\n")
        keel_rate, lengths = {}, None
        # keel generate's own OpenMP waiting (kernels/cpu/blas.h default_openmp_wait: a short spin),
        # not the passive policy the training above ran with.
        gen_env = {k: v for k, v in env.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        for b in batches:
            r = run("generate", "--checkpoint", ckpt, "--prompts", f"{d}/prompts.txt", "--batch", str(b), "--tokens",
                    str(args.tokens), "--temperature", "0", env=gen_env)
            rows = [json.loads(x) for x in r.stdout.splitlines()]
            lengths = [row["prompt_tokens"] for row in rows]
            m = re.search(r"([0-9.]+) tokens/s", r.stderr)
            keel_rate[b] = float(m.group(1))
            if b == batches[0]:
                texts = [row["text"] for row in rows]
            elif [row["text"] for row in rows] != texts:
                print(f"keel B={b}: THE TEXTS DIFFER from B={batches[0]}")
        run("export", "--checkpoint", ckpt, "--hf", f"{d}/hf", env=env)

        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(2)
        model = AutoModelForCausalLM.from_pretrained(f"{d}/hf", dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
        torch_rate = {}
        for b in batches:
            made, seconds = 0, 0.0
            for s in range(0, len(prompts), b):
                group = prompts[s : s + b]
                width = max(len(p) for p in group)
                ids = torch.zeros(len(group), width, dtype=torch.long)
                mask = torch.zeros(len(group), width, dtype=torch.long)
                for j, p in enumerate(group):  # left padding
                    ids[j, width - len(p) :] = p
                    mask[j, width - len(p) :] = 1
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.tokens,
                                         min_new_tokens=args.tokens, do_sample=False, use_cache=True, pad_token_id=0)
                seconds += time.perf_counter() - t0
                made += (out.shape[1] - width) * len(group)
            torch_rate[b] = made / seconds
    load1 = os.getloadavg()[0]
    print(f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.tokens} new tokens each, greedy; "
          f"torch {torch.__version__}; load average {load0:.1f} -> {load1:.1f}")
    print("| B | Keel tokens/s | vs Keel B=1 | transformers tokens/s | Keel / transformers |")
    print("|---|---|---|---|---|")
    for b in batches:
        print(f"| {b} | {keel_rate[b]:.0f} | {keel_rate[b] / keel_rate[batches[0]]:.2f}x | {torch_rate[b]:.0f} | "
              f"{keel_rate[b] / torch_rate[b]:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
