#!/usr/bin/env -S /usr/bin/python3
"""Self-test of the GPT-2 reference (tests/reference/gpt2_reference.py).

Keel's tests trust the reference, so the reference is itself checked here:
  1. its forward agrees with a naive implementation written independently
     (explicit per-(batch, head, query) loops, hand-written LayerNorm, GELU,
     softmax and cross-entropy, no torch.nn.functional);
  2. its float64 autograd gradients agree with central finite differences on
     random parameter entries of every tensor (plus torch.autograd.gradcheck
     on two small tensors), and padded vocab rows get exactly zero gradient;
  3. the committed fixtures are consistent: loss/gradients recomputed from
     tests/fixtures/tiny_{gpt2,tokens}.bin match tiny_expected.bin, and
     make-fixtures is deterministic.
Exits 0 on success, 1 on any failure. Takes a few seconds.
"""

import math
import os
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, HERE)
import gpt2_reference as ref  # noqa: E402

FIXTURES = os.path.join(HERE, "..", "fixtures")

failures = []


def check(name, ok, detail):
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


def random_model(cfg, seed):
    """Random params (float32 values, like a checkpoint) for an arbitrary cfg."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in ref.param_shapes(cfg):
        if name in ("ln1w", "ln2w", "lnfw"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("b"):
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.2 * torch.randn(shape, generator=g)
        params[name] = t.numpy().astype(np.float32)
    # Non-zero padding here (unlike the fixtures) so that a reference that
    # leaked padded rows into the logits would be caught by the zero-grad check.
    return params


# ---------------------------------------------------------------------------
# Naive second formulation. Shares nothing with ref.forward but the parameter
# dict: different op decomposition, explicit loops, index-based masking.


def naive_layernorm(x, w, b):
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    d = x - mu
    var = (d * d).sum(-1, keepdim=True) / x.shape[-1]
    return d * (1.0 / torch.sqrt(var + 1e-5)) * w + b


def naive_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def naive_linear(x, w, b):
    # Elementwise-and-sum instead of a matmul: (..., 1, in) * (out, in).
    return (x.unsqueeze(-2) * w).sum(-1) + b


def naive_forward(cfg, p, idx, targets):
    B, T = idx.shape
    V, L, NH, C = cfg["V"], cfg["L"], cfg["NH"], cfg["C"]
    hs = C // NH
    x = torch.stack([torch.stack([p["wte"][idx[b, t]] + p["wpe"][t] for t in range(T)]) for b in range(B)])
    for l in range(L):
        h = naive_layernorm(x, p["ln1w"][l], p["ln1b"][l])
        qkv = naive_linear(h, p["qkvw"][l], p["qkvb"][l])
        y = torch.zeros(B, T, C, dtype=x.dtype)
        for b in range(B):
            for hd in range(NH):
                lo = hd * hs
                q = qkv[b, :, lo:lo + hs]
                k = qkv[b, :, C + lo:C + lo + hs]
                v = qkv[b, :, 2 * C + lo:2 * C + lo + hs]
                for t in range(T):
                    # Causality by only looking at keys 0..t, not by masking.
                    s = (k[:t + 1] * q[t]).sum(-1) / math.sqrt(hs)
                    e = torch.exp(s - s.max())
                    w = e / e.sum()
                    y[b, t, lo:lo + hs] = (w.unsqueeze(-1) * v[:t + 1]).sum(0)
        x = x + naive_linear(y, p["attprojw"][l], p["attprojb"][l])
        h = naive_layernorm(x, p["ln2w"][l], p["ln2b"][l])
        x = x + naive_linear(naive_gelu(naive_linear(h, p["fcw"][l], p["fcb"][l])), p["fcprojw"][l], p["fcprojb"][l])
    x = naive_layernorm(x, p["lnfw"], p["lnfb"])
    logits = torch.einsum("btc,vc->btv", x, p["wte"][:V])
    total = 0.0
    for b in range(B):
        for t in range(T):
            z = logits[b, t]
            m = z.max()
            total = total + (m + torch.log(torch.exp(z - m).sum())) - z[targets[b, t]]
    return logits, total / (B * T)


def test_forward_vs_naive():
    for cfg, B, T, seed in [
        (dict(ref.TINY), 2, 8, 7),
        (dict(maxT=12, V=29, Vp=32, L=3, NH=4, C=16), 3, 12, 8),
    ]:
        params = random_model(cfg, seed)
        g = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg["V"], (B, T + 1), generator=g)
        idx, tgt = toks[:, :-1], toks[:, 1:]
        p = ref.to_torch(params)
        with torch.no_grad():
            lg1, l1 = ref.forward(cfg, p, idx, tgt)
            lg2, l2 = naive_forward(cfg, p, idx, tgt)
        dl = abs(l1.item() - l2.item())
        dlg = (lg1 - lg2).abs().max().item()
        check(f"forward vs naive (L={cfg['L']} NH={cfg['NH']} B={B} T={T})",
              dl < 1e-12 and dlg < 1e-12, f"loss {l1.item():.12f}, |dloss|={dl:.1e}, max|dlogit|={dlg:.1e}")


def test_gradients():
    cfg = dict(maxT=8, V=29, Vp=32, L=2, NH=4, C=16)
    B, T = 2, 6
    params = random_model(cfg, 11)
    g = torch.Generator().manual_seed(11)
    toks = torch.randint(0, cfg["V"], (B, T + 1), generator=g)
    idx, tgt = toks[:, :-1], toks[:, 1:]

    _, grads = ref.loss_and_grads(cfg, params, idx, tgt)
    p64 = ref.to_torch(params)  # the same float32 values, widened

    def loss_of(p):
        with torch.no_grad():
            return ref.forward(cfg, p, idx, tgt)[1].item()

    # Central differences on a few random entries of every tensor.
    rng = np.random.default_rng(11)
    h, worst, n, off = 1e-6, 0.0, 0, 0
    offsets = {}
    for name, shape in ref.param_shapes(cfg):
        offsets[name] = off
        off += math.prod(shape)
    for name, shape in ref.param_shapes(cfg):
        flat = p64[name].view(-1)
        hi = cfg["V"] * cfg["C"] if name == "wte" else flat.numel()  # real rows only
        for j in rng.choice(hi, size=3, replace=False):
            orig = flat[j].item()
            flat[j] = orig + h
            lp = loss_of(p64)
            flat[j] = orig - h
            lm = loss_of(p64)
            flat[j] = orig
            fd = (lp - lm) / (2 * h)
            an = grads[offsets[name] + j]
            worst = max(worst, abs(fd - an) / (1e-6 + abs(an)))
            n += 1
    check("autograd vs central differences", worst < 1e-5, f"{n} entries over 16 tensors, worst rel err {worst:.1e}")

    pad = grads[cfg["V"] * cfg["C"]:cfg["Vp"] * cfg["C"]]
    check("padded vocab rows get zero gradient", not pad.any(), f"{pad.size} entries, max |g|={np.abs(pad).max():.1e}")

    # torch's own gradcheck on two whole (small) tensors, the rest held fixed.
    def make_fn(name, l):
        def fn(t):
            q = dict(p64)
            full = q[name].clone()
            full[l] = t
            q[name] = full
            return ref.forward(cfg, q, idx, tgt)[1]
        return fn

    ok = True
    for name, l in [("qkvb", 0), ("ln2w", 1)]:
        t = p64[name][l].clone().requires_grad_(True)
        ok &= torch.autograd.gradcheck(make_fn(name, l), (t,), eps=1e-6, atol=1e-8, rtol=1e-6, raise_exception=False)
    check("torch.autograd.gradcheck on qkvb[0], ln2w[1]", ok, "passed" if ok else "mismatch")


def test_fixtures():
    paths = {k: os.path.join(FIXTURES, f"tiny_{k}.bin") for k in ("gpt2", "tokens", "expected")}
    if not all(os.path.exists(p) for p in paths.values()):
        check("fixtures present", False, f"missing under {os.path.normpath(FIXTURES)}; run make-fixtures --out tests/fixtures")
        return
    cfg, params = ref.read_checkpoint(paths["gpt2"])
    tokens = ref.read_shard(paths["tokens"])
    B, T, loss, grads = ref.read_expected(paths["expected"])
    rloss, rgrads = ref.loss_and_grads(cfg, params, *ref.get_batch(tokens, 0, B, T))
    dg = np.abs(rgrads - grads).max() / np.abs(grads).max()
    check("fixtures self-consistent", len(rgrads) == len(grads) and abs(rloss - loss) < 1e-12 and dg < 1e-12,
          f"loss {loss:.12f}, P={len(grads)}, max rel grad diff {dg:.1e}")

    torch.set_num_threads(1)  # what make-fixtures uses
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        devnull = open(os.devnull, "w")
        saved, sys.stdout = sys.stdout, devnull
        try:
            ref.main(["make-fixtures", "--out", d1])
            ref.main(["make-fixtures", "--out", d2])
        finally:
            sys.stdout = saved
            devnull.close()
        names = ("tiny_gpt2.bin", "tiny_tokens.bin", "tiny_expected.bin")
        read = lambda d, n: open(os.path.join(d, n), "rb").read()
        same = all(read(d1, n) == read(d2, n) for n in names)
        check("make-fixtures deterministic", same, "two runs byte-identical" if same else "runs differ")
        # Informational: a different torch build may draw other random numbers;
        # the committed files stay valid (self-consistent) either way.
        fresh = all(read(d1, n) == read(FIXTURES, n) for n in names)
        print(f"note committed fixtures {'match' if fresh else 'DIFFER from'} a fresh make-fixtures run")


def main():
    torch.manual_seed(0)
    test_forward_vs_naive()
    test_gradients()
    test_fixtures()
    if failures:
        print(f"check_reference: {len(failures)} FAILED: {', '.join(failures)}")
        return 1
    print("check_reference: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
