#!/usr/bin/env -S /usr/bin/python3
"""An independent float64 PyTorch reference of a CLIP-style dual encoder: a ResNet image tower, a GPT-2
text tower and the symmetric InfoNCE loss, with the gradient of every parameter from autograd.

Image tower: torchvision's own ResNet building blocks (torchvision.models.resnet.BasicBlock / Bottleneck)
with GroupNorm(min(32, c), c, eps=1e-5) as the norm layer. At width 64 the whole trunk is torchvision's
ResNet class itself; at any other width the same structure is assembled here from torchvision's block
classes with stage widths width, 2*width, 4*width, 8*width. Then global average pooling and a projection
without bias ("visual.proj.weight") into the shared embedding. Parameter names are torchvision's
state_dict names prefixed with "visual." (the norm modules keep torchvision's "bn" names).

Text tower: GPT-2 written from the architecture (learned token and position embeddings, pre-LayerNorm
blocks with causal multi-head attention and a tanh-GELU MLP, a final LayerNorm); caption b's feature is
the final LayerNorm's output at position lengths[b] - 1, projected by "text.proj.w" (no bias).

Loss: both features L2-normalised over the embedding dimension; logits = exp(min(logit_scale,
log(logit_scale_max))) * img @ txt^T; loss = (cross_entropy(logits, arange(B)) +
cross_entropy(logits^T, arange(B))) / 2. Above the cap the clamp gives logit_scale a zero gradient.

Usage: clip_reference.py DIR | --make-example DIR | --self-check
  reads  DIR/model.json   (config, batch, and the tensors' names, shapes and float offsets)
         DIR/weights.bin  (float32, the tensors at those offsets)
         DIR/images.bin   (float32, the batch's images, [B, size, size, 3] (NHWC), already normalised)
  writes DIR/reference.json ({"loss", "image_embeddings", "text_embeddings"}: the mean loss and the
                            L2-normalised embeddings as B lists of embed_dim floats)
         DIR/grads.bin    (float64, the layout of weights.bin; zeros where a tensor gets no gradient
                            and in any float not covered by a tensor)
  model.json: {"image": {"arch": "resnet", "block": "basic" | "bottleneck", "layers": [4 ints],
                         "width": int, "size": int},
               "embed_dim": int,
               "text": {"family": "gpt2", "n_layer", "n_head", "n_embd", "vocab_size",
                        "padded_vocab_size", "max_seq_len"},
               "B": int, "T": int, "tokens": [B*T ints], "lengths": [B ints in 1..T],
               "logit_scale_max": float (optional, default 100: the cap on exp(logit_scale)),
               "tensors": [{"name", "shape", "offset"}, ...]}
  --make-example DIR: writes a small random model.json, weights.bin and images.bin into DIR.
  --self-check: torch.autograd.gradcheck of the loss on tiny random models (basic and bottleneck
                blocks), the clamp's zero gradient, the loss against an explicit formula, the text
                feature's causality, a file round trip, and torchvision's ResNet class against the
                structure assembled here at width 64.
"""

import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.stateless import functional_call
from torchvision.models import resnet as tv

sys.dont_write_bytecode = True

LN_EPS = 1e-5
GN_EPS = 1e-5
BLOCKS = {"basic": tv.BasicBlock, "bottleneck": tv.Bottleneck}


# ---------------------------------------------------------------------------
# Image tower


def group_norm(c):
    """The norm layer in place of BatchNorm: at most 32 groups, affine."""
    return nn.GroupNorm(min(32, c), c, eps=GN_EPS)


class TorchvisionVisual(tv.ResNet):
    """torchvision's ResNet class (planes 64, 128, 256, 512) with fc replaced by the projection."""

    def __init__(self, block, layers, embed_dim):
        super().__init__(block, layers, norm_layer=group_norm)
        self.fc = nn.Identity()
        self.proj = nn.Linear(512 * block.expansion, embed_dim, bias=False)

    def forward(self, x):
        return self.proj(super().forward(x))


class HandVisual(nn.Module):
    """The same structure at any base width, assembled from torchvision's block classes. The blocks
    keep torchvision's default base_width of 64, so a Bottleneck's inner width equals its planes."""

    def __init__(self, block, layers, width, embed_dim):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = group_norm(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self.stage(block, width, layers[0], 1)
        self.layer2 = self.stage(block, 2 * width, layers[1], 2)
        self.layer3 = self.stage(block, 4 * width, layers[2], 2)
        self.layer4 = self.stage(block, 8 * width, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.proj = nn.Linear(8 * width * block.expansion, embed_dim, bias=False)

    def stage(self, block, planes, n, stride):
        out = planes * block.expansion
        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, out, kernel_size=1, stride=stride, bias=False),
                                       group_norm(out))
        blocks = [block(self.inplanes, planes, stride, downsample, norm_layer=group_norm)]
        self.inplanes = out
        blocks += [block(out, planes, norm_layer=group_norm) for _ in range(1, n)]
        return nn.Sequential(*blocks)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.proj(torch.flatten(self.avgpool(x), 1))


def build_visual(image, embed_dim, force_hand=False):
    """The image tower in float64; torchvision's ResNet class itself when the width is 64."""
    assert image.get("arch") == "resnet", f"image.arch: expected \"resnet\", found {image.get('arch')!r}"
    assert image.get("block") in BLOCKS, f"image.block: expected one of {sorted(BLOCKS)}, found {image.get('block')!r}"
    layers = list(image["layers"])
    assert len(layers) == 4 and all(n >= 1 for n in layers), f"image.layers: expected 4 positive ints, found {layers}"
    block = BLOCKS[image["block"]]
    if image["width"] == 64 and not force_hand:
        m = TorchvisionVisual(block, layers, embed_dim)
    else:
        m = HandVisual(block, layers, image["width"], embed_dim)
    return m.double()


def load_visual(module, weights):
    """weights: "visual."-prefixed name -> float64 tensor. Every module parameter must be given and
    every given tensor must be a module parameter."""
    own = {k: v.shape for k, v in module.state_dict().items()}
    given = {k[len("visual."):]: v for k, v in weights.items()}
    missing = sorted(set(own) - set(given))
    unused = sorted(set(given) - set(own))
    assert not missing, f"model.json lacks image tower tensors: {['visual.' + k for k in missing]}"
    assert not unused, f"model.json has image tower tensors the module does not: {['visual.' + k for k in unused]}"
    for k, shape in own.items():
        assert tuple(given[k].shape) == tuple(shape), \
            f"visual.{k}: model.json says shape {list(given[k].shape)}, the module has {list(shape)}"
    module.load_state_dict(given, strict=True)


# ---------------------------------------------------------------------------
# Text tower


def text_shapes(t, D):
    C, L, maxT, Vp = t["n_embd"], t["n_layer"], t["max_seq_len"], t["padded_vocab_size"]
    shapes = {"text.wte": (Vp, C), "text.wpe": (maxT, C)}
    for i in range(L):
        h = f"text.h.{i}."
        shapes.update({h + "ln1.w": (C,), h + "ln1.b": (C,), h + "attn.qkv.w": (3 * C, C), h + "attn.qkv.b": (3 * C,),
                       h + "attn.proj.w": (C, C), h + "attn.proj.b": (C,), h + "ln2.w": (C,), h + "ln2.b": (C,),
                       h + "mlp.fc.w": (4 * C, C), h + "mlp.fc.b": (4 * C,), h + "mlp.proj.w": (C, 4 * C),
                       h + "mlp.proj.b": (C,)})
    shapes.update({"text.lnf.w": (C,), "text.lnf.b": (C,), "text.proj.w": (D, C)})
    return shapes


def text_features(t, p, tokens, lengths):
    """tokens (B, T) int64, lengths (B,) int64 -> (B, D): lnf(x) at position lengths[b] - 1, projected."""
    B, T = tokens.shape
    C, NH = t["n_embd"], t["n_head"]
    hs = C // NH
    x = p["text.wte"][tokens] + p["text.wpe"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(t["n_layer"]):
        h_ = f"text.h.{i}."
        h = F.layer_norm(x, (C,), p[h_ + "ln1.w"], p[h_ + "ln1.b"], LN_EPS)
        qkv = F.linear(h, p[h_ + "attn.qkv.w"], p[h_ + "attn.qkv.b"])
        # [q | k | v], each C wide; head j is columns j*hs:(j+1)*hs of each.
        q, k, v = (a.view(B, T, NH, hs).transpose(1, 2) for a in qkv.split(C, dim=-1))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + F.linear((att @ v).transpose(1, 2).reshape(B, T, C), p[h_ + "attn.proj.w"], p[h_ + "attn.proj.b"])
        h = F.layer_norm(x, (C,), p[h_ + "ln2.w"], p[h_ + "ln2.b"], LN_EPS)
        h = F.gelu(F.linear(h, p[h_ + "mlp.fc.w"], p[h_ + "mlp.fc.b"]), approximate="tanh")
        x = x + F.linear(h, p[h_ + "mlp.proj.w"], p[h_ + "mlp.proj.b"])
    x = F.layer_norm(x, (C,), p["text.lnf.w"], p["text.lnf.b"], LN_EPS)
    return x[torch.arange(B), lengths - 1] @ p["text.proj.w"].T


# ---------------------------------------------------------------------------
# Loss


def contrastive(img_feat, txt_feat, logit_scale, max_scale):
    """Returns (loss, img, txt) with img, txt the L2-normalised embeddings."""
    img = img_feat / img_feat.norm(dim=-1, keepdim=True)
    txt = txt_feat / txt_feat.norm(dim=-1, keepdim=True)
    scale = torch.exp(torch.clamp(logit_scale, max=math.log(max_scale)))
    logits = scale * (img @ txt.T)
    labels = torch.arange(img.shape[0])
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    return loss, img, txt


def clip_loss(spec, visual, text_p, logit_scale, images, tokens, lengths, visual_override=None):
    """images (B, 3, H, W). visual_override: "visual."-prefixed name -> tensor, used in place of the
    module's own parameters of those names (for gradcheck)."""
    if visual_override:
        over = {k[len("visual."):]: v for k, v in visual_override.items()}
        img_feat = functional_call(visual, over, (images,))
    else:
        img_feat = visual(images)
    txt_feat = text_features(spec["text"], text_p, tokens, lengths)
    return contrastive(img_feat, txt_feat, logit_scale, spec.get("logit_scale_max", 100.0))


# ---------------------------------------------------------------------------
# Files


def load_dir(d):
    """Returns (spec, raw float32 weights, images (B, 3, H, W) float64, tokens, lengths)."""
    with open(os.path.join(d, "model.json")) as f:
        spec = json.load(f)
    raw = np.fromfile(os.path.join(d, "weights.bin"), dtype=np.float32)
    B, T, S = spec["B"], spec["T"], spec["image"]["size"]
    t = spec["text"]
    assert t.get("family") == "gpt2", f"text.family: expected \"gpt2\", found {t.get('family')!r}"
    assert t["n_embd"] % t["n_head"] == 0, f"text: n_embd {t['n_embd']} not divisible by n_head {t['n_head']}"
    assert t["vocab_size"] <= t["padded_vocab_size"], "text: vocab_size > padded_vocab_size"
    assert 1 <= T <= t["max_seq_len"], f"T={T} outside 1..max_seq_len={t['max_seq_len']}"
    assert len(spec["tokens"]) == B * T, f"tokens: {len(spec['tokens'])} ints, expected B*T={B * T}"
    assert len(spec["lengths"]) == B, f"lengths: {len(spec['lengths'])} ints, expected B={B}"
    assert all(1 <= n <= T for n in spec["lengths"]), f"lengths {spec['lengths']} outside 1..T={T}"
    assert all(0 <= k < t["vocab_size"] for k in spec["tokens"]), f"a token is outside 0..{t['vocab_size'] - 1}"
    img = np.fromfile(os.path.join(d, "images.bin"), dtype=np.float32)
    assert img.size == B * S * S * 3, f"images.bin: {img.size} floats, expected B*size*size*3={B * S * S * 3}"
    images = torch.tensor(img.astype(np.float64).reshape(B, S, S, 3)).permute(0, 3, 1, 2).contiguous()
    tokens = torch.tensor(spec["tokens"], dtype=torch.long).reshape(B, T)
    lengths = torch.tensor(spec["lengths"], dtype=torch.long)
    return spec, raw, images, tokens, lengths


def split_weights(spec, raw):
    """name -> float64 tensor for each entry of model.json's tensors, checked against the expected
    names and shapes of the text tower and logit_scale (the image tower's are checked on loading)."""
    out = {}
    for t in spec["tensors"]:
        name, n = t["name"], int(np.prod(t["shape"]))
        assert name not in out, f"tensor {name} appears twice in model.json"
        assert 0 <= t["offset"] and t["offset"] + n <= raw.size, \
            f"{name}: floats {t['offset']}..{t['offset'] + n} outside weights.bin's {raw.size}"
        out[name] = torch.tensor(raw[t["offset"]:t["offset"] + n].astype(np.float64).reshape(t["shape"]))
    want = text_shapes(spec["text"], spec["embed_dim"])
    want["logit_scale"] = (1,)
    have = {k: tuple(v.shape) for k, v in out.items() if not k.startswith("visual.")}
    missing, unknown = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    assert not missing, f"model.json lacks tensors: {missing}"
    assert not unknown, f"model.json has tensors of neither tower: {unknown}"
    for k, shape in want.items():
        assert have[k] == shape, f"{k}: model.json says shape {list(have[k])}, expected {list(shape)}"
    return out


def run(d):
    spec, raw, images, tokens, lengths = load_dir(d)
    w = split_weights(spec, raw)
    visual = build_visual(spec["image"], spec["embed_dim"])
    load_visual(visual, {k: v for k, v in w.items() if k.startswith("visual.")})
    leaf = {k: v.requires_grad_(True) for k, v in w.items() if not k.startswith("visual.")}
    loss, img, txt = clip_loss(spec, visual, leaf, leaf["logit_scale"], images, tokens, lengths)
    loss.backward()
    grad = {k: v.grad for k, v in leaf.items()}
    grad.update({"visual." + k: v.grad for k, v in visual.named_parameters()})
    grads = np.zeros(raw.size, dtype=np.float64)
    for t in spec["tensors"]:
        g = grad[t["name"]]
        if g is not None:
            grads[t["offset"]:t["offset"] + g.numel()] = g.detach().numpy().ravel()
    grads.tofile(os.path.join(d, "grads.bin"))
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"loss": loss.item(), "image_embeddings": img.detach().tolist(),
                   "text_embeddings": txt.detach().tolist()}, f)
    return loss.item(), grads


# ---------------------------------------------------------------------------
# Random models


def random_visual_weights(visual, g):
    """Convolutions He-normal over fan-out, norm weights near 1 and biases near 0 (far from the
    identity so that their gradients matter), the projection N(0, 1/C)."""
    out = {}
    for k, v in visual.state_dict().items():
        if v.dim() == 4:
            t = torch.randn(v.shape, generator=g, dtype=torch.float64) * math.sqrt(2.0 / (v.shape[0] * v[0, 0].numel()))
        elif k == "proj.weight":
            t = torch.randn(v.shape, generator=g, dtype=torch.float64) / math.sqrt(v.shape[1])
        elif k.endswith("weight"):
            t = 1.0 + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64)
        else:
            t = 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64)
        out["visual." + k] = t
    return out


def random_text_weights(t, D, g):
    out = {}
    for k, shape in text_shapes(t, D).items():
        if k.endswith((".ln1.w", ".ln2.w", "lnf.w")):
            a = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif k.endswith(".b"):
            a = 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            a = 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
        out[k] = a
    out["text.wte"][t["vocab_size"]:] = 0.0  # padded rows, as a checkpoint writes them
    return out


def random_spec(image, embed_dim, text, B, T, seed):
    """(spec without "tensors", weights name -> float64 tensor (float32-representable), images
    (B, S, S, 3) float32 numpy)."""
    g = torch.Generator().manual_seed(seed)
    spec = {"image": image, "embed_dim": embed_dim, "text": text, "B": B, "T": T}
    spec["tokens"] = torch.randint(0, text["vocab_size"], (B * T,), generator=g).tolist()
    spec["lengths"] = torch.randint(1, T + 1, (B,), generator=g).tolist()
    visual = build_visual(image, embed_dim)
    w = random_visual_weights(visual, g)
    w.update(random_text_weights(text, embed_dim, g))
    w["logit_scale"] = torch.tensor([math.log(1 / 0.07)], dtype=torch.float64)
    w = {k: v.float().double() for k, v in w.items()}
    images = torch.randn(B, image["size"], image["size"], 3, generator=g).numpy().astype(np.float32)
    return spec, w, images


def write_dir(d, spec, w, images):
    os.makedirs(d, exist_ok=True)
    spec = dict(spec)
    spec["tensors"], off, flat = [], 0, []
    for k, v in w.items():
        spec["tensors"].append({"name": k, "shape": list(v.shape), "offset": off})
        flat.append(v.numpy().astype(np.float32).ravel())
        off += v.numel()
    np.concatenate(flat).tofile(os.path.join(d, "weights.bin"))
    np.asarray(images, dtype=np.float32).tofile(os.path.join(d, "images.bin"))
    with open(os.path.join(d, "model.json"), "w") as f:
        json.dump(spec, f)


def make_example(d):
    image = {"arch": "resnet", "block": "basic", "layers": [1, 1, 1, 1], "width": 8, "size": 32}
    text = {"family": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 61, "padded_vocab_size": 64,
            "max_seq_len": 8}
    spec, w, images = random_spec(image, 16, text, 3, 8, seed=20250101)
    write_dir(d, spec, w, images)
    print(json.dumps({"dir": d, "tensors": len(w), "floats": sum(v.numel() for v in w.values()),
                      "lengths": spec["lengths"]}))


# ---------------------------------------------------------------------------
# Self-check


def self_check():
    t0 = time.time()
    failures = []

    def check(name, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        if not ok:
            failures.append(name)

    text = {"family": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 13, "padded_vocab_size": 16,
            "max_seq_len": 5}
    # 32x32 images: at 16x16 the third stage's output is 1x1 with single-channel groups, where GroupNorm
    # returns its bias whatever the image, and the image tower would no longer depend on the image.
    for block, seed in (("basic", 11), ("bottleneck", 12)):
        image = {"arch": "resnet", "block": block, "layers": [1, 1, 1, 1], "width": 8, "size": 32}
        spec, w, images = random_spec(image, 8, text, 3, 5, seed)
        spec["lengths"] = [5, 1, 3]
        visual = build_visual(image, 8)
        load_visual(visual, {k: v for k, v in w.items() if k.startswith("visual.")})
        x = torch.tensor(images, dtype=torch.float64).permute(0, 3, 1, 2).contiguous()
        tokens = torch.tensor(spec["tokens"]).reshape(3, 5)
        lengths = torch.tensor(spec["lengths"])
        text_p = {k: v for k, v in w.items() if not k.startswith("visual.")}

        def loss_fn(names, ts, tokens=tokens):
            over = dict(zip(names, ts))
            vis = {k: v for k, v in over.items() if k.startswith("visual.")}
            tp = dict(text_p)
            tp.update({k: v for k, v in over.items() if not k.startswith("visual.")})
            return clip_loss(spec, visual, tp, tp["logit_scale"], x, tokens, lengths, vis)[0]

        def gradcheck(names, fast):
            ts = [w[k].clone().requires_grad_(True) for k in names]
            return torch.autograd.gradcheck(lambda *a: loss_fn(names, a), ts, fast_mode=fast, raise_exception=False)

        few = ["visual.bn1.weight", "visual.layer1.0.bn1.bias", "visual.layer2.0.downsample.0.weight",
               "visual.layer3.0.conv1.weight" if block == "bottleneck" else "visual.layer2.0.downsample.1.weight",
               "visual.layer4.0.bn2.weight", "visual.proj.weight", "text.wte", "text.wpe", "text.h.0.ln1.w",
               "text.h.0.attn.qkv.w", "text.h.0.attn.qkv.b", "text.h.0.mlp.proj.b", "text.lnf.b", "text.proj.w",
               "logit_scale"]
        check(f"{block}: gradcheck of {len(few)} tensors", gradcheck(few, False))
        check(f"{block}: gradcheck (fast mode) of all {len(w)} tensors", gradcheck(list(w), True))

        with torch.no_grad():
            loss, img, txt = clip_loss(spec, visual, text_p, text_p["logit_scale"], x, tokens, lengths)
            spread = (img - img.mean(0)).abs().max().item()
            check(f"{block}: image embeddings depend on the image", spread > 1e-3, f"spread {spread:.3g}")
            # The loss written out term by term: -(1/2B) sum_i [log p_row(i, i) + log p_col(i, i)].
            s = math.exp(text_p["logit_scale"].item())
            total = 0.0
            for i in range(3):
                row = [s * float(img[i] @ txt[j]) for j in range(3)]
                col = [s * float(img[j] @ txt[i]) for j in range(3)]
                total -= row[i] - math.log(sum(math.exp(r) for r in row))
                total -= col[i] - math.log(sum(math.exp(c) for c in col))
            diff = abs(total / 6 - loss.item())
            check(f"{block}: loss against its explicit formula", diff < 1e-12, f"|diff| {diff:.2g}")
            # Tokens after position lengths[b] - 1 cannot change caption b's feature.
            later = tokens.clone()
            for b, n in enumerate(spec["lengths"]):
                later[b, n:] = (later[b, n:] + 1) % text["vocab_size"]
            diff = abs(loss_fn([], [], later).item() - loss.item())
            check(f"{block}: tokens after lengths[b]-1 are ignored", diff == 0.0, f"|diff| {diff:.2g}")

        # Above the cap the scale is 100 and logit_scale's gradient exactly zero.
        ls = torch.tensor([5.0], dtype=torch.float64, requires_grad=True)
        tp = dict(text_p)
        tp["logit_scale"] = ls
        capped, _, _ = clip_loss(spec, visual, tp, ls, x, tokens, lengths)
        capped.backward()
        tp["logit_scale"] = torch.tensor([math.log(100.0)], dtype=torch.float64)
        at_cap = clip_loss(spec, visual, tp, tp["logit_scale"], x, tokens, lengths)[0]
        check(f"{block}: clamp above log(100)", ls.grad.item() == 0.0 and abs(capped.item() - at_cap.item()) < 1e-14,
              f"grad {ls.grad.item()}, loss {capped.item():.6f} vs {at_cap.item():.6f} at the cap")

        # A round trip through the files: run() must give what is computed here.
        with tempfile.TemporaryDirectory() as d:
            write_dir(d, spec, w, images)
            floss, fgrads = run(d)
            with open(os.path.join(d, "reference.json")) as f:
                ref = json.load(f)
        ts = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        direct = loss_fn(list(ts), list(ts.values()))
        direct.backward()
        off, worst = 0, 0.0
        for k, v in ts.items():
            worst = max(worst, float(np.abs(fgrads[off:off + v.numel()] - v.grad.numpy().ravel()).max()))
            off += v.numel()
        ok = abs(floss - direct.item()) < 1e-13 and worst < 1e-12 and len(ref["image_embeddings"]) == 3 \
            and len(ref["text_embeddings"][0]) == 8
        check(f"{block}: file round trip", ok, f"loss {floss:.12f}, max grad diff {worst:.2g}")

    # torchvision's ResNet class against the structure assembled here, same weights, width 64.
    for block, layers in (("basic", [2, 2, 2, 2]), ("bottleneck", [1, 1, 1, 1])):
        image = {"arch": "resnet", "block": block, "layers": layers, "width": 64, "size": 32}
        a, b = build_visual(image, 16), build_visual(image, 16, force_hand=True)
        check(f"{block} {layers} width 64: torchvision's class is used", isinstance(a, tv.ResNet) and
              not isinstance(b, tv.ResNet))
        names_a, names_b = list(a.state_dict()), list(b.state_dict())
        check(f"{block} {layers} width 64: same parameter names", names_a == names_b, f"{len(names_a)} tensors")
        w = random_visual_weights(a, torch.Generator().manual_seed(7))
        load_visual(a, w)
        load_visual(b, w)
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        with torch.no_grad():
            ya, yb = a(x), b(x)
        diff = (ya - yb).abs().max().item()
        check(f"{block} {layers} width 64: torchvision's ResNet == assembled", diff <= 1e-12,
              f"max |diff| {diff:.2g}{' (bitwise equal)' if torch.equal(ya, yb) else ''}")

    secs = time.time() - t0
    if failures:
        print(f"self-check FAILED ({len(failures)}: {', '.join(failures)}) in {secs:.1f}s")
        return 1
    print(f"self-check ok in {secs:.1f}s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-check":
        sys.exit(self_check())
    if len(sys.argv) == 3 and sys.argv[1] == "--make-example":
        make_example(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        sys.exit(2)
    loss, _ = run(sys.argv[1])
    print(json.dumps({"loss": loss}))
