#!/usr/bin/env -S /usr/bin/python3
"""An independent float64 PyTorch implementation of Keel's llama mixture of experts (model/moe.h).

The attention half of each block is llama_reference.py's. The MoE half is written from the design,
token by token (no sorting, no grouping): p = softmax(x Wr^T) over E experts, the k most probable
chosen (ties: the lower index), out = sum_j p[e_j] SwiGLU_{e_j}(x) + shared SwiGLU(x); with a
capacity, expert e takes at most ceil(c T k / E) of a sequence's (token, choice) pairs in position
order (token-major, choice-minor), the rest contribute nothing. The balancing loss per sequence is
E sum_e f_e P_e (f_e: the share of the sequence's T k choices that picked e, before drops; P_e:
the mean probability of e); the gradients are those of CE + aux_weight x mean over sequences.
With moe_balance = "bias" (DeepSeek's auxiliary-loss-free balancing) block l's experts are chosen
by the k largest p + bias_l (moe_bias: {"l": [E biases]}), still weighted by p alone.

Usage: moe_reference.py DIR   (model.json, weights.bin as llama_reference.py; the config also holds
  moe_experts, moe_top_k, moe_hidden, moe_shared_experts, moe_every, moe_aux_weight, moe_capacity,
  and optionally moe_balance and moe_bias)
  writes DIR/reference.json ({"loss": CE, "aux": mean balancing loss per MoE block}) and DIR/grads.bin
  --self-check: torch.autograd.gradcheck of the loss on a tiny random model (away from routing ties).
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_reference import rms, rotate  # noqa: E402


def swiglu(x, gate_up, proj):
    a = x @ gate_up.T
    h = a.shape[-1] // 2
    return (F.silu(a[..., :h]) * a[..., h:]) @ proj.T


def moe(cfg, p, pre, x, auxes, bias=None):
    """x: (B, T, C) -> (B, T, C); bias: E floats added to p for the choice only (or None)."""
    B, T, C = x.shape
    E, k, every = cfg["moe_experts"], cfg["moe_top_k"], cfg["moe_every"]
    if bias is None:
        bias = [0.0] * E
    probs = torch.softmax(x @ p[pre + "moe.router.w"].T, dim=-1)  # (B, T, E)
    cap = math.ceil(cfg["moe_capacity"] * T * k / E) if cfg["moe_capacity"] > 0 else None
    out = []
    for b in range(B):
        taken = [0] * E
        picked = [0] * E
        rows = []
        for t in range(T):
            order = sorted(range(E), key=lambda e: (-(probs[b, t, e].item() + bias[e]), e))[:k]
            y = torch.zeros(C, dtype=torch.float64)
            for e in order:
                picked[e] += 1
                if cap is not None and taken[e] >= cap:
                    continue
                taken[e] += 1
                y = y + probs[b, t, e] * swiglu(x[b, t], p[pre + f"moe.expert.{e}.gate_up.w"],
                                                p[pre + f"moe.expert.{e}.proj.w"])
            rows.append(y)
        out.append(torch.stack(rows))
        f = torch.tensor(picked, dtype=torch.float64) / (T * k)
        auxes.append(E * (f * probs[b].mean(0)).sum())
    y = torch.stack(out)
    if cfg["moe_shared_experts"] > 0:
        y = y + swiglu(x, p[pre + "moe.shared_mlp.gate_up.w"], p[pre + "moe.shared_mlp.proj.w"])
    return y


def loss_of(cfg, p, tokens, targets):
    B, T = tokens.shape
    C, NH, NKV, H = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"], cfg["ffn_hidden"]
    hs, V = C // NH, cfg["vocab_size"]
    kv = NKV * hs
    x = p["wte"][tokens]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    auxes = []
    for l in range(cfg["n_layer"]):
        q_ = f"h.{l}."
        h = rms(x, p[q_ + "attn_norm.w"])
        qkv = h @ p[q_ + "attn.qkv.w"].T
        q = rotate(qkv[..., :C].reshape(B, T, NH, hs), cfg["rope_theta"])
        k = rotate(qkv[..., C:C + kv].reshape(B, T, NKV, hs), cfg["rope_theta"])
        v = qkv[..., C + kv:].reshape(B, T, NKV, hs)
        k = k.repeat_interleave(NH // NKV, dim=2)
        v = v.repeat_interleave(NH // NKV, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        a = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1) @ v
        x = x + a.transpose(1, 2).reshape(B, T, C) @ p[q_ + "attn.proj.w"].T
        h2 = rms(x, p[q_ + "mlp_norm.w"])
        if (l + 1) % cfg["moe_every"] == 0:
            bias = cfg.get("moe_bias", {}).get(str(l)) if cfg.get("moe_balance", "aux") == "bias" else None
            x = x + moe(cfg, p, q_, h2, auxes, bias)
        else:
            x = x + swiglu(h2, p[q_ + "mlp.gate_up.w"], p[q_ + "mlp.proj.w"])
    head = p["wte"] if cfg["tie_embeddings"] else p["lm_head.w"]
    logits = rms(x, p["norm.w"]) @ head.T
    ce = F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))
    aux = torch.stack(auxes).sum() / B  # per MoE block: the mean over sequences, summed over blocks
    return ce, aux


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
    cfg = spec["config"]
    ce, aux = loss_of(cfg, params, tokens, targets)
    (ce + cfg["moe_aux_weight"] * aux).backward()
    grads = np.zeros(raw.size, dtype=np.float64)
    for t in spec["tensors"]:
        g = params[t["name"]].grad
        n = int(np.prod(t["shape"]))
        grads[t["offset"]:t["offset"] + n] = (g if g is not None else torch.zeros(t["shape"])).numpy().ravel()
    grads.tofile(os.path.join(d, "grads.bin"))
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"loss": ce.item(), "aux": aux.item()}, f)


def self_check():
    torch.manual_seed(3)
    cfg = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "n_embd": 8, "ffn_hidden": 12, "vocab_size": 7,
           "rope_theta": 10000.0, "tie_embeddings": False, "moe_experts": 3, "moe_top_k": 2, "moe_hidden": 4,
           "moe_shared_experts": 1, "moe_every": 1, "moe_aux_weight": 0.1, "moe_capacity": 0}
    C, E, Hm = 8, 3, 4
    shapes = {"wte": (7, C), "h.0.attn_norm.w": (C,), "h.0.attn.qkv.w": (C + 8, C), "h.0.attn.proj.w": (C, C),
              "h.0.mlp_norm.w": (C,), "h.0.moe.router.w": (E, C), "h.0.moe.shared_mlp.gate_up.w": (2 * Hm, C),
              "h.0.moe.shared_mlp.proj.w": (C, Hm), "norm.w": (C,), "lm_head.w": (7, C)}
    for e in range(E):
        shapes[f"h.0.moe.expert.{e}.gate_up.w"] = (2 * Hm, C)
        shapes[f"h.0.moe.expert.{e}.proj.w"] = (C, Hm)
    names = list(shapes)
    params = [torch.randn(*shapes[n], dtype=torch.float64).mul(0.5).requires_grad_() for n in names]
    tokens = torch.randint(0, 7, (2, 3))
    targets = torch.randint(0, 7, (2, 3))

    def f(*ps):
        ce, aux = loss_of(cfg, dict(zip(names, ps)), tokens, targets)
        return ce + cfg["moe_aux_weight"] * aux

    # aux's f_e is piecewise constant (the choices): gradcheck holds between routing changes, and
    # the steps it takes (1e-6) change no choice of a random model.
    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-5), "gradcheck failed"
    print("moe_reference self-check: gradcheck passed")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-check":
        self_check()
    elif len(sys.argv) == 2:
        run(sys.argv[1])
    else:
        sys.exit(__doc__)
