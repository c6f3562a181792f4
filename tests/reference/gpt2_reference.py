#!/usr/bin/env -S /usr/bin/python3
"""Independent PyTorch reference of GPT-2 for Keel's tests.

Reads and writes llm.c's formats (model checkpoint v3, uint16 token shards)
and computes losses and gradients in float64, so Keel's float32 results can be
compared against a reference whose own rounding error is negligible.

Subcommands:
  make-fixtures --out DIR
      Tiny random model + token shard + expected loss/gradients
      (tiny_gpt2.bin, tiny_tokens.bin, tiny_expected.bin).
  make-train-fixture --out DIR
      From DIR/tiny_gpt2.bin and DIR/tiny_tokens.bin, TRAIN_STEPS AdamW steps on
      batch 0 in float64 (hand-written AdamW, cross-checked step by step
      against torch.optim.AdamW); writes DIR/tiny_train_expected.bin.
  eval --model M.bin --tokens S.bin --batch B --seq T [--batches N]
      Mean float64 loss over batches 0..N-1; prints {"loss": ..., "batches": N}.

Written in plain torch on purpose (no HF transformers): the point is a second,
independent implementation of the architecture Keel implements.
Requires Debian's /usr/bin/python3 with python3-torch and python3-numpy.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

MODEL_MAGIC = 20240326
MODEL_VERSION = 3
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
EXPECTED_MAGIC = 20241130
EXPECTED_VERSION = 1
TRAIN_MAGIC = 20241201
TRAIN_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LN_EPS = 1e-5

# The fixture model. Deliberately odd sizes (V=61 is prime, Vp=64 padded) so
# that padding and vocab-size mix-ups in Keel show up as wrong numbers.
TINY = dict(maxT=16, V=61, Vp=64, L=2, NH=2, C=16)
TINY_B, TINY_T = 2, 8
TINY_SEED = 1234

# The training fixture: TRAIN_STEPS steps, each on batch 0 of the tiny shard
# (grad_accum 1); the hyperparameters are written to the file in this order.
# The grad norms are about 3.41, 2.54, 1.66, so grad_clip=2.0 clips the first
# two steps and not the last (make-train-fixture checks both branches occur).
TRAIN_STEPS = 3
TRAIN_HPARAMS = dict(lr=1e-2, warmup_steps=1, total_steps=3, min_lr_ratio=0.1, beta1=0.9, beta2=0.95,
                     eps=1e-8, weight_decay=0.1, grad_clip=2.0)
# Tensors AdamW decays: embeddings and matrices; never biases or LayerNorm parameters.
DECAYED = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")


class FormatError(Exception):
    """A file or argument that does not match the expected format."""


def param_shapes(cfg):
    """(name, shape) in llm.c's checkpoint order; the single source of truth
    for the parameter layout used by both the reader and the writers."""
    maxT, Vp, L, C = cfg["maxT"], cfg["Vp"], cfg["L"], cfg["C"]
    return [
        ("wte", (Vp, C)),
        ("wpe", (maxT, C)),
        ("ln1w", (L, C)),
        ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)),
        ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)),
        ("attprojb", (L, C)),
        ("ln2w", (L, C)),
        ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)),
        ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)),
        ("fcprojb", (L, C)),
        ("lnfw", (C,)),
        ("lnfb", (C,)),
    ]


def num_params(cfg):
    return sum(math.prod(s) for _, s in param_shapes(cfg))


# ---------------------------------------------------------------------------
# File I/O


def _read_header(path, what):
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise FormatError(f"{what} {path}: cannot open: {e.strerror}")
    if size < HEADER_BYTES:
        raise FormatError(f"{what} {path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    return np.fromfile(path, dtype="<i4", count=HEADER_INTS), size


def read_checkpoint(path):
    """Returns (cfg, params) with params a dict name -> float32 numpy array."""
    h, size = _read_header(path, "model")
    if h[0] != MODEL_MAGIC:
        raise FormatError(f"model {path}: bad magic {h[0]} (expected {MODEL_MAGIC})")
    if h[1] != MODEL_VERSION:
        raise FormatError(f"model {path}: unsupported version {h[1]} (expected {MODEL_VERSION})")
    cfg = dict(maxT=int(h[2]), V=int(h[3]), L=int(h[4]), NH=int(h[5]), C=int(h[6]), Vp=int(h[7]))
    for k, v in cfg.items():
        if v <= 0:
            raise FormatError(f"model {path}: header field {k}={v} must be positive")
    if cfg["Vp"] < cfg["V"]:
        raise FormatError(f"model {path}: padded vocab {cfg['Vp']} < vocab {cfg['V']}")
    if cfg["C"] % cfg["NH"]:
        raise FormatError(f"model {path}: channels {cfg['C']} not divisible by heads {cfg['NH']}")
    P = num_params(cfg)
    if size != HEADER_BYTES + 4 * P:
        raise FormatError(f"model {path}: file is {size} bytes, header implies {HEADER_BYTES + 4 * P} ({P} floats)")
    flat = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES, count=P)
    params, off = {}, 0
    for name, shape in param_shapes(cfg):
        n = math.prod(shape)
        params[name] = flat[off:off + n].reshape(shape)
        off += n
    return cfg, params


def write_checkpoint(path, cfg, params):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:8] = [MODEL_MAGIC, MODEL_VERSION, cfg["maxT"], cfg["V"], cfg["L"], cfg["NH"], cfg["C"], cfg["Vp"]]
    with open(path, "wb") as f:
        f.write(h.tobytes())
        for name, shape in param_shapes(cfg):
            a = np.asarray(params[name], dtype="<f4")
            assert a.shape == shape, (name, a.shape, shape)
            f.write(a.tobytes())


def read_shard(path):
    """Returns the tokens as an int64 numpy array."""
    h, size = _read_header(path, "tokens")
    if h[0] != SHARD_MAGIC:
        raise FormatError(f"tokens {path}: bad magic {h[0]} (expected {SHARD_MAGIC})")
    if h[1] != SHARD_VERSION:
        raise FormatError(f"tokens {path}: unsupported version {h[1]} (expected {SHARD_VERSION})")
    n = int(h[2])
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise FormatError(f"tokens {path}: file is {size} bytes, header claims {n} tokens ({HEADER_BYTES + 2 * n} bytes)")
    return np.fromfile(path, dtype="<u2", offset=HEADER_BYTES, count=n).astype(np.int64)


def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 65536
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:3] = [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def write_expected(path, B, T, loss, grads_flat):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:5] = [EXPECTED_MAGIC, EXPECTED_VERSION, B, T, len(grads_flat)]
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(np.array([loss], dtype="<f8").tobytes())
        f.write(np.asarray(grads_flat, dtype="<f8").tobytes())


def read_expected(path):
    """Returns (B, T, loss, grads_flat float64)."""
    h, size = _read_header(path, "expected")
    if h[0] != EXPECTED_MAGIC or h[1] != EXPECTED_VERSION:
        raise FormatError(f"expected {path}: bad magic/version {h[0]}/{h[1]}")
    P = int(h[4])
    if size != HEADER_BYTES + 8 * (1 + P):
        raise FormatError(f"expected {path}: file is {size} bytes, header implies {HEADER_BYTES + 8 * (1 + P)}")
    data = np.fromfile(path, dtype="<f8", offset=HEADER_BYTES, count=1 + P)
    return int(h[2]), int(h[3]), float(data[0]), data[1:]


def write_train_expected(path, hp, losses, norms, params_flat):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:4] = [TRAIN_MAGIC, TRAIN_VERSION, len(losses), len(params_flat)]
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(np.array([float(v) for v in hp.values()], dtype="<f8").tobytes())
        f.write(np.asarray(losses, dtype="<f8").tobytes())
        f.write(np.asarray(norms, dtype="<f8").tobytes())
        f.write(np.asarray(params_flat, dtype="<f8").tobytes())


def get_batch(tokens, i, B, T):
    """Batch i per llm.c's layout: a window of B*T+1 tokens, targets shifted by one."""
    start = i * B * T
    win = torch.from_numpy(tokens[start:start + B * T + 1])
    return win[:-1].view(B, T), win[1:].view(B, T)


# ---------------------------------------------------------------------------
# Model


def to_torch(params, dtype=torch.float64, requires_grad=False):
    # The float32 values from the file are widened exactly, so the float64
    # computation is of the very model Keel sees.
    return {k: torch.tensor(np.asarray(v), dtype=dtype).requires_grad_(requires_grad) for k, v in params.items()}


def forward(cfg, p, idx, targets=None):
    """GPT-2 forward. p: dict of torch tensors (any float dtype), idx/targets (B, T) int64.
    Returns (logits (B, T, V), loss or None)."""
    B, T = idx.shape
    V, L, NH, C = cfg["V"], cfg["L"], cfg["NH"], cfg["C"]
    hs = C // NH
    x = p["wte"][idx] + p["wpe"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(L):
        h = F.layer_norm(x, (C,), p["ln1w"][l], p["ln1b"][l], LN_EPS)
        qkv = F.linear(h, p["qkvw"][l], p["qkvb"][l])
        # [q | k | v], each C wide; head j is columns j*hs:(j+1)*hs of each.
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in qkv.split(C, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, p["attprojw"][l], p["attprojb"][l])
        h = F.layer_norm(x, (C,), p["ln2w"][l], p["ln2b"][l], LN_EPS)
        h = F.gelu(F.linear(h, p["fcw"][l], p["fcb"][l]), approximate="tanh")
        x = x + F.linear(h, p["fcprojw"][l], p["fcprojb"][l])
    x = F.layer_norm(x, (C,), p["lnfw"], p["lnfb"], LN_EPS)
    # Tied head over the real vocab only: padded rows V..Vp-1 never reach the
    # logits, so their gradient is exactly zero.
    logits = x @ p["wte"][:V].T
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T))
    return logits, loss


def loss_and_grads(cfg, params, idx, targets):
    """float64 loss and gradients; grads flattened in checkpoint order."""
    p = to_torch(params, torch.float64, requires_grad=True)
    _, loss = forward(cfg, p, idx, targets)
    loss.backward()
    flat = torch.cat([p[name].grad.reshape(-1) for name, _ in param_shapes(cfg)])
    return loss.item(), flat.numpy()


def learning_rate(hp, step):
    """Linear warm-up to lr over warmup_steps, then cosine to lr * min_lr_ratio at total_steps.
    step counts from 0."""
    lr, warmup, total = hp["lr"], hp["warmup_steps"], hp["total_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    min_lr = lr * hp["min_lr_ratio"]
    if total - warmup <= 0:
        return lr
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def adamw_update(hp, p, g, m, v, lr, t, decay):
    """One AdamW update of numpy float64 arrays in place; t counts from 1.
    p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), decay decoupled from the moments."""
    b1, b2 = hp["beta1"], hp["beta2"]
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    m_hat = m / (1 - b1 ** t)
    v_hat = v / (1 - b2 ** t)
    wd = hp["weight_decay"] if decay else 0.0
    p -= lr * (m_hat / (np.sqrt(v_hat) + hp["eps"]) + wd * p)


def clip_factor(hp, norm):
    return hp["grad_clip"] / norm if hp["grad_clip"] > 0 and norm > hp["grad_clip"] else 1.0


def train(cfg, params, idx, targets, hp, steps):
    """The training loop, with the hand-written AdamW and, in lockstep, torch.optim.AdamW fed
    the same clipped gradients (two groups: decayed and not; lr set per step). Asserts the two
    optimizers agree to 1e-12 after every step; a disagreement is a bug in this script.

    Both optimizers see the same gradients on purpose: the key part of qkvb has a gradient that
    is exactly zero in exact arithmetic (softmax ignores a shift shared by all keys), so autograd
    returns rounding noise of ~1e-17 there, and Adam divides that noise by itself plus eps. Two
    independent forward/backward passes would disagree there by ~lr * 1e-9 through no fault of
    either optimizer. Returns (losses, norms, params float64)."""
    names = [name for name, _ in param_shapes(cfg)]
    p = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(a) for k, a in p.items()}
    v = {k: np.zeros_like(a) for k, a in p.items()}
    tp = to_torch(params, torch.float64, requires_grad=True)
    groups = [dict(params=[tp[n] for n in names if n in DECAYED], weight_decay=hp["weight_decay"]),
              dict(params=[tp[n] for n in names if n not in DECAYED], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], foreach=False)
    losses, norms = [], []
    for s in range(steps):
        loss, flat = loss_and_grads(cfg, p, idx, targets)
        norm = math.sqrt(float(np.dot(flat, flat)))
        clip = clip_factor(hp, norm)
        lr = learning_rate(hp, s)
        off = 0
        for name, shape in param_shapes(cfg):
            n = math.prod(shape)
            g = flat[off:off + n].reshape(shape) * clip
            adamw_update(hp, p[name], g, m[name], v[name], lr, s + 1, name in DECAYED)
            tp[name].grad = torch.from_numpy(g.copy())
            off += n
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for name in names:
            diff = float(np.abs(p[name] - tp[name].detach().numpy()).max())
            assert diff <= 1e-12, f"step {s + 1}: hand-written AdamW and torch.optim.AdamW differ by {diff} in {name}"
        losses.append(loss)
        norms.append(norm)
    return losses, norms, p


def check_tokens(tokens, V, path):
    if len(tokens) and tokens.max() >= V:
        raise FormatError(f"tokens {path}: token id {int(tokens.max())} >= vocab size {V}")


# ---------------------------------------------------------------------------
# Subcommands


def make_tiny_model(seed=TINY_SEED):
    """Random tiny model. Weights are larger than GPT-2's usual 0.02 so that
    activations and gradients are far from zero and comparisons meaningful."""
    torch.manual_seed(seed)
    cfg = dict(TINY)
    params = {}
    for name, shape in param_shapes(cfg):
        if name in ("ln1w", "ln2w", "lnfw"):
            t = 1.0 + 0.1 * torch.randn(shape)
        elif name.endswith("b"):
            t = 0.1 * torch.randn(shape)
        else:
            t = 0.2 * torch.randn(shape)
        params[name] = t.numpy().astype(np.float32)
    # Padded vocab rows are zero, as llm.c writes them.
    params["wte"][cfg["V"]:] = 0.0
    tokens = torch.randint(0, cfg["V"], (TINY_B * TINY_T + 1,)).numpy()
    return cfg, params, tokens


def cmd_make_fixtures(args):
    # One thread: float64 reductions then have a fixed order, so reruns give
    # byte-identical files.
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    cfg, params, tokens = make_tiny_model()
    model_path = os.path.join(args.out, "tiny_gpt2.bin")
    tokens_path = os.path.join(args.out, "tiny_tokens.bin")
    write_checkpoint(model_path, cfg, params)
    write_shard(tokens_path, tokens)
    # Recompute from what was written, so the expectations are of the files.
    cfg, params = read_checkpoint(model_path)
    tokens = read_shard(tokens_path)
    idx, targets = get_batch(tokens, 0, TINY_B, TINY_T)
    loss, grads = loss_and_grads(cfg, params, idx, targets)
    write_expected(os.path.join(args.out, "tiny_expected.bin"), TINY_B, TINY_T, loss, grads)
    print(json.dumps({"loss": loss, "params": len(grads), "B": TINY_B, "T": TINY_T, "out": args.out}))


def cmd_make_train_fixture(args):
    torch.set_num_threads(1)  # fixed reduction order: byte-identical reruns
    hp, K = TRAIN_HPARAMS, TRAIN_STEPS
    cfg, params = read_checkpoint(os.path.join(args.out, "tiny_gpt2.bin"))
    tokens_path = os.path.join(args.out, "tiny_tokens.bin")
    tokens = read_shard(tokens_path)
    check_tokens(tokens, cfg["V"], tokens_path)
    idx, targets = get_batch(tokens, 0, TINY_B, TINY_T)
    losses, norms, final = train(cfg, params, idx, targets, hp, K)
    # The fixture must exercise both branches of clipping.
    clipped = [n > hp["grad_clip"] for n in norms]
    assert any(clipped) and not all(clipped), ("grad_clip", hp["grad_clip"], norms)
    # Padded vocab rows: zero gradient and zero weight, so they stay exactly zero.
    assert not final["wte"][cfg["V"]:].any()

    flat = np.concatenate([final[name].reshape(-1) for name, _ in param_shapes(cfg)])
    write_train_expected(os.path.join(args.out, "tiny_train_expected.bin"), hp, losses, norms, flat)
    print(json.dumps({"steps": K, "params": len(flat), "losses": losses, "grad_norms": norms,
                      "clipped": clipped, "lrs": [learning_rate(hp, s) for s in range(K)], "hparams": hp}))


def cmd_eval(args):
    if args.batch <= 0 or args.seq <= 0:
        raise FormatError("--batch and --seq must be positive")
    cfg, params = read_checkpoint(args.model)
    if args.seq > cfg["maxT"]:
        raise FormatError(f"--seq {args.seq} exceeds the model's block size {cfg['maxT']}")
    tokens = read_shard(args.tokens)
    check_tokens(tokens, cfg["V"], args.tokens)
    B, T = args.batch, args.seq
    available = (len(tokens) - 1) // (B * T) if len(tokens) else 0
    n = available if args.batches is None else args.batches
    if n < 1:
        raise FormatError(f"tokens {args.tokens}: {len(tokens)} tokens hold no full batch of B*T+1={B * T + 1}"
                          if args.batches is None else "--batches must be at least 1")
    if n > available:
        raise FormatError(f"tokens {args.tokens}: {len(tokens)} tokens hold only {available} batches of B={B} T={T}, asked for {n}")
    p = to_torch(params, torch.float64)
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            _, loss = forward(cfg, p, *get_batch(tokens, i, B, T))
            total += loss.item()
    print(json.dumps({"loss": total / n, "batches": n}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mf = sub.add_parser("make-fixtures", help="write tiny model, tokens and expected loss/gradients")
    mf.add_argument("--out", required=True, help="output directory")
    mt = sub.add_parser("make-train-fixture", help="write expected losses/norms/parameters of a few AdamW steps")
    mt.add_argument("--out", required=True, help="directory holding tiny_gpt2.bin and tiny_tokens.bin")
    ev = sub.add_parser("eval", help="float64 mean loss of a checkpoint on a token shard")
    ev.add_argument("--model", required=True)
    ev.add_argument("--tokens", required=True)
    ev.add_argument("--batch", type=int, required=True)
    ev.add_argument("--seq", type=int, required=True)
    ev.add_argument("--batches", type=int, default=None, help="default: all full batches in the shard")
    args = ap.parse_args(argv)
    try:
        commands = {"make-fixtures": cmd_make_fixtures, "make-train-fixture": cmd_make_train_fixture, "eval": cmd_eval}
        commands[args.cmd](args)
    except FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
