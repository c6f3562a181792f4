#!/usr/bin/env -S /usr/bin/python3
"""An independent float64 PyTorch implementation of Keel's llama family (model.family = "llama").

Written from the architecture, not from Keel's kernels: RMSNorm as x * rsqrt(mean(x^2) + 1e-5) * w,
rotary embeddings as complex multiplication (Meta's formulation: consecutive pairs of a head's
dimensions are one complex number, rotated by position * theta^(-2i/hs)), grouped-query attention by
repeating each key/value head for its query heads, a causal mask and softmax, SwiGLU as
silu(gate) * up, cross-entropy over the real vocabulary. Gradients come from autograd.

Usage: llama_reference.py DIR | --llama2c FILE.bin DIR | --self-check
  reads  DIR/model.json   (config, batch, and the tensors' names, shapes and float offsets)
         DIR/weights.bin  (float32, the tensors at those offsets)
  writes DIR/reference.json (the mean loss) and DIR/grads.bin (float64, the same layout)
  --llama2c FILE.bin DIR: the weights from a llama2.c model file (its run.c format, parsed here)
         and the batch from DIR/batch.json; writes DIR/reference.json (the mean loss)
  --self-check: torch.autograd.gradcheck of this implementation's loss on a tiny random model.
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def rotate(x, theta):
    """x: (B, T, heads, hs) -> the same, each consecutive pair rotated by t * theta^(-2i/hs)."""
    B, T, Hn, hs = x.shape
    freqs = theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)  # (T, hs/2)
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    xc = torch.view_as_complex(x.reshape(B, T, Hn, hs // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).reshape(B, T, Hn, hs)


def loss_of(cfg, p, tokens, targets):
    B, T = tokens.shape
    C, NH, NKV, H = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"], cfg["ffn_hidden"]
    hs, V = C // NH, cfg["vocab_size"]
    kv = NKV * hs
    x = p["wte"][tokens]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for l in range(cfg["n_layer"]):
        q_ = f"h.{l}."
        h = rms(x, p[q_ + "attn_norm.w"])
        qkv = h @ p[q_ + "attn.qkv.w"].T
        q = rotate(qkv[..., :C].reshape(B, T, NH, hs), cfg["rope_theta"])
        k = rotate(qkv[..., C:C + kv].reshape(B, T, NKV, hs), cfg["rope_theta"])
        v = qkv[..., C + kv:].reshape(B, T, NKV, hs)
        k = k.repeat_interleave(NH // NKV, dim=2)
        v = v.repeat_interleave(NH // NKV, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        a = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1) @ v
        x = x + a.transpose(1, 2).reshape(B, T, C) @ p[q_ + "attn.proj.w"].T
        h2 = rms(x, p[q_ + "mlp_norm.w"])
        gu = h2 @ p[q_ + "mlp.gate_up.w"].T
        x = x + (F.silu(gu[..., :H]) * gu[..., H:]) @ p[q_ + "mlp.proj.w"].T
    head = p["wte"] if cfg["tie_embeddings"] else p["lm_head.w"]
    logits = rms(x, p["norm.w"]) @ head.T
    return F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))


def run(d):
    with open(os.path.join(d, "model.json")) as f:
        spec = json.load(f)
    raw = np.fromfile(os.path.join(d, "weights.bin"), dtype=np.float32)
    params = {}
    for t in spec["tensors"]:
        n = int(np.prod(t["shape"]))
        a = raw[t["offset"]:t["offset"] + n].astype(np.float64).reshape(t["shape"])
        params[t["name"]] = torch.tensor(a, requires_grad=True)
    B, T = spec["B"], spec["T"]
    tokens = torch.tensor(spec["tokens"], dtype=torch.long).reshape(B, T)
    targets = torch.tensor(spec["targets"], dtype=torch.long).reshape(B, T)
    loss = loss_of(spec["config"], params, tokens, targets)
    loss.backward()
    grads = np.zeros(raw.size, dtype=np.float64)
    for t in spec["tensors"]:
        g = params[t["name"]].grad
        n = int(np.prod(t["shape"]))
        grads[t["offset"]:t["offset"] + n] = (g if g is not None else torch.zeros(t["shape"])).numpy().ravel()
    grads.tofile(os.path.join(d, "grads.bin"))
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"loss": loss.item()}, f)


def read_llama2c(path):
    """run.c's format: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
    vocab_size < 0: a classifier of its own), then float32 weights in run.c's order."""
    raw = np.fromfile(path, dtype=np.int32, count=7)
    dim, hidden, L, NH, NKV, vocab, seq_len = (int(x) for x in raw)
    shared, V = vocab > 0, abs(vocab)
    w = np.fromfile(path, dtype=np.float32, offset=28)
    hs, kv = dim // NH, (dim // NH) * NKV
    at = 0

    def take(*shape):
        nonlocal at
        n = int(np.prod(shape))
        t = torch.tensor(w[at:at + n].astype(np.float64).reshape(shape))
        at += n
        return t

    emb = take(V, dim)
    rms_att, wq, wk, wv, wo = take(L, dim), take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
    rms_ffn, w1, w2, w3 = take(L, dim), take(L, hidden, dim), take(L, dim, hidden), take(L, hidden, dim)
    rms_final = take(dim)
    take(seq_len * hs // 2)
    take(seq_len * hs // 2)  # the RoPE table run.c skips
    wcls = emb if shared else take(V, dim)
    assert at == w.size, f"{path}: {w.size - at} floats left over"
    cfg = {"n_layer": L, "n_head": NH, "n_kv_head": NKV, "n_embd": dim, "ffn_hidden": hidden, "vocab_size": V,
           "rope_theta": 10000.0, "tie_embeddings": False}
    p = {"wte": emb, "norm.w": rms_final, "lm_head.w": wcls}
    for l in range(L):
        p[f"h.{l}.attn_norm.w"] = rms_att[l]
        p[f"h.{l}.attn.qkv.w"] = torch.cat([wq[l], wk[l], wv[l]])
        p[f"h.{l}.attn.proj.w"] = wo[l]
        p[f"h.{l}.mlp_norm.w"] = rms_ffn[l]
        p[f"h.{l}.mlp.gate_up.w"] = torch.cat([w1[l], w3[l]])
        p[f"h.{l}.mlp.proj.w"] = w2[l]
    return cfg, p


def run_llama2c(path, d):
    cfg, p = read_llama2c(path)
    with open(os.path.join(d, "batch.json")) as f:
        b = json.load(f)
    tokens = torch.tensor(b["tokens"], dtype=torch.long).reshape(b["B"], b["T"])
    targets = torch.tensor(b["targets"], dtype=torch.long).reshape(b["B"], b["T"])
    with torch.no_grad():
        loss = loss_of(cfg, p, tokens, targets)
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"loss": loss.item()}, f)


def self_check():
    torch.manual_seed(3)
    cfg = {"n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 8, "ffn_hidden": 12, "vocab_size": 7,
           "rope_theta": 10000.0, "tie_embeddings": False}
    shapes = {"wte": (8, 8), "h.0.attn_norm.w": (8,), "h.0.attn.qkv.w": (16, 8), "h.0.attn.proj.w": (8, 8),
              "h.0.mlp_norm.w": (8,), "h.0.mlp.gate_up.w": (24, 8), "h.0.mlp.proj.w": (8, 12), "norm.w": (8,),
              "lm_head.w": (8, 8)}
    names = list(shapes)
    init = [torch.randn(shapes[n], dtype=torch.float64, requires_grad=True) for n in names]
    tokens = torch.randint(0, 7, (2, 5))
    targets = torch.randint(0, 7, (2, 5))
    ok = torch.autograd.gradcheck(lambda *ts: loss_of(cfg, dict(zip(names, ts)), tokens, targets), init)
    print("gradcheck", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-check":
        sys.exit(self_check())
    if len(sys.argv) == 4 and sys.argv[1] == "--llama2c":
        run_llama2c(sys.argv[2], sys.argv[3])
        sys.exit(0)
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    run(sys.argv[1])
