#!/usr/bin/env python3
"""Keel and Hugging Face transformers, both ways (needs bench/.venv with torch, transformers).

  bench/.venv/bin/python bench/hf_interop.py check
      For each model of tests/reference/hf (GPT-2, Llama with GQA and an untied head, Llama with
      rope scaling "llama3" and "linear"): `keel import
      --hf`, `keel export --hf`, then transformers' from_pretrained on Keel's export; its float64
      logits on the fixture's tokens against the committed ones (which transformers computed on the
      original files). Prints the largest difference per model; exits 1 above 1e-9.

  bench/.venv/bin/python bench/hf_interop.py time [--preset tinyllama-1.1b]
      A random model of the preset's shape saved by transformers (save_pretrained), then, in turn
      and twice each (interleaved): Keel's import and export of it, and transformers'
      from_pretrained and save_pretrained. Prints each time and the ratios Keel / transformers,
      with the load average.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.path.join(ROOT, "build", "keel")


def keel(*args):
    subprocess.run([KEEL, *args], check=True, stdout=subprocess.DEVNULL)


def check():
    import torch
    from transformers import AutoModelForCausalLM
    expected = json.load(open(os.path.join(ROOT, "tests/reference/hf/expected.json")))
    expected.update(json.load(open(os.path.join(ROOT, "tests/reference/hf/rope_expected.json"))))
    worst_all = 0.0
    for name in ("gpt2", "llama", "llama_rope_llama3", "llama_rope_linear"):
        with tempfile.TemporaryDirectory() as tmp:
            keel("import", "--hf", os.path.join(ROOT, "tests/reference/hf", name), "--out", tmp + "/ckpt")
            keel("export", "--checkpoint", tmp + "/ckpt", "--hf", tmp + "/out")
            model = AutoModelForCausalLM.from_pretrained(tmp + "/out", attn_implementation="eager").to(torch.float64)
            want = expected[name]
            inputs = torch.tensor(want["inputs"]).reshape(want["B"], want["T"])
            with torch.no_grad():
                logits = model(input_ids=inputs).logits.flatten()
            worst = (logits - torch.tensor(want["logits"], dtype=torch.float64)).abs().max().item()
            print(f"{name}: transformers on Keel's export: largest logit difference {worst:.3g}")
            worst_all = max(worst_all, worst)
    return 0 if worst_all <= 1e-9 else 1


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_import_export(preset):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    shapes = {"tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                     max_position_embeddings=2048, tie_word_embeddings=False),
              "llama-tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256,
                                 tie_word_embeddings=False)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        config = LlamaConfig(rms_norm_eps=1e-5, **shapes[preset])
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tmp + "/hf")
        rows = []
        for _ in range(2):
            for path in (tmp + "/ckpt", tmp + "/keel_out", tmp + "/hf_out"):
                subprocess.run(["rm", "-rf", path], check=True)
            keel_import = timed(lambda: keel("import", "--hf", tmp + "/hf", "--out", tmp + "/ckpt"))
            keel_export = timed(lambda: keel("export", "--checkpoint", tmp + "/ckpt", "--hf", tmp + "/keel_out"))
            model = None

            def load():
                nonlocal model
                model = LlamaForCausalLM.from_pretrained(tmp + "/hf", torch_dtype=torch.float32)
            hf_load = timed(load)
            hf_save = timed(lambda: model.save_pretrained(tmp + "/hf_out"))
            rows.append((keel_import, keel_export, hf_load, hf_save))
        load = os.getloadavg()[0]
        for i, (ki, ke, hl, hs) in enumerate(rows):
            print(f"run {i + 1}: keel import {ki:.2f} s (transformers from_pretrained {hl:.2f} s, ratio {ki / hl:.2f}); "
                  f"keel export {ke:.2f} s (save_pretrained {hs:.2f} s, ratio {ke / hs:.2f}); load average {load:.1f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "check":
        sys.exit(check())
    if len(sys.argv) >= 2 and sys.argv[1] == "time":
        preset = sys.argv[sys.argv.index("--preset") + 1] if "--preset" in sys.argv else "tinyllama-1.1b"
        sys.exit(time_import_export(preset))
    print(__doc__)
    sys.exit(2)
