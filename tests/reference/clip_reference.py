#!/usr/bin/env -S /usr/bin/python3
"""An independent float64 PyTorch reference of a CLIP-style dual encoder: a ResNet or ViT image tower, a
GPT-2 text tower and the symmetric InfoNCE loss, with the gradient of every parameter from autograd.

ResNet image tower ("arch": "resnet"): torchvision's own ResNet building blocks
(torchvision.models.resnet.BasicBlock / Bottleneck) with GroupNorm(min(32, c), c, eps=1e-5) as the norm
layer. At width 64 the whole trunk is torchvision's ResNet class itself; at any other width the same
structure is assembled here from torchvision's block classes with stage widths width, 2*width, 4*width,
8*width. Then global average pooling and a projection without bias ("visual.proj.weight") into the
shared embedding. Parameter names are torchvision's
state_dict names prefixed with "visual." (the norm modules keep torchvision's "bn" names).

ViT image tower ("arch": "vit"), written here (torchvision's VisionTransformer uses the exact erf GELU),
with p = "patch", C = "width", NH = "heads":
  - patches: G = size / p per side, P = G*G, in row-major order of (patch row gy, patch col gx), so
    patch i = gy*G + gx; a patch's vector holds its p*p*3 values of the NHWC image in the order (pixel
    row r, pixel col c, channel ch) within the patch: index (r*p + c)*3 + ch.
  - patch embedding: token_i = patch_vec_i @ "visual.patch.w"^T + "visual.patch.b"   ([C, p*p*3], [C]).
  - "visual.cls" [C] is prepended as position 0; "visual.pos" [P+1, C] is added to every token: row 0
    to the class token, row 1+i to patch i.
  - mask (optional, FLIP-style): B lists, list b the increasing indices in 0..P-1 of the patches KEPT
    for sample b, every list of the same length K >= 1. Only those patches (each with its own position
    row 1+i added) follow the class token, in increasing patch order: K+1 tokens. No mask: all P kept.
  - "layers" GPT-2 blocks "visual.h.{i}.*", the text tower's block (same tensor names and shapes:
    pre-LayerNorm, qkv columns [q | k | v] each C wide, head j in columns j*hs..(j+1)*hs-1 of each,
    hs = C / NH, scale 1/sqrt(hs), tanh GELU MLP of width 4C) except that the attention is
    bidirectional (no causal mask).
  - the class token's output (position 0) through the final LayerNorm "visual.lnf.w", "visual.lnf.b"
    and the projection "visual.proj.w" [embed_dim, C] (no bias) is the image feature.

Text tower: GPT-2 written from the architecture (learned token and position embeddings, pre-LayerNorm
blocks with causal multi-head attention and a tanh-GELU MLP, a final LayerNorm); caption b's feature is
the final LayerNorm's output at position lengths[b] - 1, projected by "text.proj.w" (no bias).

Loss: both features L2-normalised over the embedding dimension; logits = exp(min(logit_scale,
log(logit_scale_max))) * img @ txt^T; loss = (cross_entropy(logits, arange(B)) +
cross_entropy(logits^T, arange(B))) / 2. Above the cap the clamp gives logit_scale a zero gradient.

Usage: clip_reference.py DIR | --make-example DIR [--arch resnet | vit] | --self-check
  reads  DIR/model.json   (config, batch, and the tensors' names, shapes and float offsets)
         DIR/weights.bin  (float32, the tensors at those offsets)
         DIR/images.bin   (float32, the batch's images, [B, size, size, 3] (NHWC), already normalised)
  writes DIR/reference.json ({"loss", "image_embeddings", "text_embeddings"}: the mean loss and the
                            L2-normalised embeddings as B lists of embed_dim floats)
         DIR/grads.bin    (float64, the layout of weights.bin; zeros where a tensor gets no gradient
                            and in any float not covered by a tensor)
  model.json: {"image": {"arch": "resnet", "block": "basic" | "bottleneck", "layers": [4 ints],
                         "width": int, "size": int}
                  or {"arch": "vit", "size": S, "patch": p (dividing S), "layers": L >= 1,
                      "width": C, "heads": NH (dividing C), "mask": [B lists of K ints] (optional)},
               "embed_dim": int,
               "text": {"family": "gpt2", "n_layer", "n_head", "n_embd", "vocab_size",
                        "padded_vocab_size", "max_seq_len"},
               "B": int, "T": int, "tokens": [B*T ints], "lengths": [B ints in 1..T],
               "logit_scale_max": float (optional, default 100: the cap on exp(logit_scale)),
               "tensors": [{"name", "shape", "offset"}, ...]}
  --make-example DIR: writes a small random model.json, weights.bin and images.bin into DIR (a ResNet
                     image tower; with --arch vit a ViT with a random mask keeping 10 of 16 patches).
  --self-check: torch.autograd.gradcheck of the loss on tiny random models (basic and bottleneck
                blocks, a ViT with and without a mask), the clamp's zero gradient, the loss against an
                explicit formula, the text feature's causality, a file round trip, torchvision's ResNet
                class against the structure assembled here at width 64, and for the ViT: a mask keeping
                every patch against no mask, the class token seeing the last kept patch and not a
                dropped one, and the tower against torch's Conv2d and TransformerEncoderLayer.
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


def vit_shapes(image, D):
    """"visual."-prefixed name -> shape of every ViT tensor, in the order of the docstring."""
    C, p, P = image["width"], image["patch"], (image["size"] // image["patch"]) ** 2
    shapes = {"visual.patch.w": (C, p * p * 3), "visual.patch.b": (C,), "visual.cls": (C,), "visual.pos": (P + 1, C)}
    for i in range(image["layers"]):
        h = f"visual.h.{i}."
        shapes.update({h + "ln1.w": (C,), h + "ln1.b": (C,), h + "attn.qkv.w": (3 * C, C), h + "attn.qkv.b": (3 * C,),
                       h + "attn.proj.w": (C, C), h + "attn.proj.b": (C,), h + "ln2.w": (C,), h + "ln2.b": (C,),
                       h + "mlp.fc.w": (4 * C, C), h + "mlp.fc.b": (4 * C,), h + "mlp.proj.w": (C, 4 * C),
                       h + "mlp.proj.b": (C,)})
    shapes.update({"visual.lnf.w": (C,), "visual.lnf.b": (C,), "visual.proj.w": (D, C)})
    return shapes


class ViTVisual(nn.Module):
    """The ViT of the docstring. Its tensors are parameters of plain nested submodules so that the
    state_dict names are the model.json names less "visual." (patch.w, cls, h.0.attn.qkv.w, ...) and
    load_visual, named_parameters and functional_call treat it like the ResNet. forward reads every
    tensor by attribute access, which is where functional_call substitutes its tensors."""

    def __init__(self, image, embed_dim):
        super().__init__()
        # Not self.patch etc.: those names would clash with the submodules holding the tensors.
        self.cfg = {k: image[k] for k in ("size", "patch", "layers", "width", "heads")}
        mask = image.get("mask")
        self.keep = None if mask is None else torch.tensor(mask, dtype=torch.long)  # (B, K), not a parameter
        self.names = []
        for name, shape in vit_shapes(image, embed_dim).items():
            *path, leaf = name[len("visual."):].split(".")
            m = self
            for part in path:
                if part not in m._modules:
                    m.add_module(part, nn.Module())
                m = m._modules[part]
            m.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=torch.float64)))
            self.names.append(name[len("visual."):])

    def tensor(self, name):
        """The tensor of that name (less "visual."), or functional_call's replacement of it."""
        m = self
        for part in name.split("."):
            m = getattr(m, part)
        return m

    def forward(self, x):
        """x (B, 3, S, S) -> (B, embed_dim)."""
        p = {k: self.tensor(k) for k in self.names}
        B, S, ps, C = x.shape[0], self.cfg["size"], self.cfg["patch"], self.cfg["width"]
        G = S // ps
        assert tuple(x.shape[1:]) == (3, S, S), f"images of shape {list(x.shape[1:])}, expected [3, {S}, {S}]"
        # NCHW -> NHWC (B, S, S, 3) = (B, gy, r, gx, c, ch) -> (B, gy, gx, r, c, ch) -> (B, P, p*p*3).
        patches = x.permute(0, 2, 3, 1).reshape(B, G, ps, G, ps, 3).permute(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(B, G * G, ps * ps * 3)
        tokens = F.linear(patches, p["patch.w"], p["patch.b"]) + p["pos"][1:]
        if self.keep is not None:
            assert self.keep.shape[0] == B, f"image.mask: {self.keep.shape[0]} lists, but the batch has B={B} images"
            tokens = tokens[torch.arange(B)[:, None], self.keep]  # (B, K, C), kept patches in increasing order
        cls = (p["cls"] + p["pos"][0]).expand(B, 1, C)
        x = torch.cat([cls, tokens], dim=1)
        for i in range(self.cfg["layers"]):
            x = gpt2_block(x, p, f"h.{i}.", self.cfg["heads"], causal=False)
        return F.layer_norm(x[:, 0], (C,), p["lnf.w"], p["lnf.b"], LN_EPS) @ p["proj.w"].T


def check_vit(image):
    """The ViT's config and mask as the docstring describes them (the mask's B is checked in forward)."""
    for k in ("size", "patch", "layers", "width", "heads"):
        assert isinstance(image.get(k), int) and image[k] >= 1, \
            f"image.{k}: expected a positive int, found {image.get(k)!r}"
    S, p = image["size"], image["patch"]
    assert S % p == 0, f"image: size {S} not divisible by patch {p}"
    assert image["width"] % image["heads"] == 0, \
        f"image: width {image['width']} not divisible by heads {image['heads']}"
    mask, P = image.get("mask"), (S // p) ** 2
    if mask is not None:
        assert isinstance(mask, list) and mask and all(isinstance(m, list) for m in mask), \
            "image.mask: expected a list of B lists of kept patch indices"
        K = len(mask[0])
        assert 1 <= K <= P, f"image.mask[0]: keeps {K} patches, expected 1..P={P}"
        for b, m in enumerate(mask):
            assert len(m) == K, f"image.mask[{b}]: keeps {len(m)} patches, mask[0] keeps {K}"
            assert all(isinstance(i, int) and 0 <= i < P for i in m), \
                f"image.mask[{b}]: {m} has an index outside 0..{P - 1}"
            assert all(m[j] < m[j + 1] for j in range(K - 1)), \
                f"image.mask[{b}]: {m} is not strictly increasing"


def build_visual(image, embed_dim, force_hand=False):
    """The image tower in float64; for a ResNet torchvision's ResNet class itself when the width is 64."""
    assert image.get("arch") in ("resnet", "vit"), \
        f"image.arch: expected \"resnet\" or \"vit\", found {image.get('arch')!r}"
    if image["arch"] == "vit":
        check_vit(image)
        return ViTVisual(image, embed_dim).double()
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


def gpt2_block(x, p, h_, NH, causal):
    """One GPT-2 block on x (B, T, C) with the tensors p[h_ + "ln1.w"], ...: pre-LayerNorm multi-head
    attention (causal for the text tower, bidirectional for the ViT) and a tanh-GELU MLP, each added
    to the residual stream."""
    B, T, C = x.shape
    hs = C // NH
    h = F.layer_norm(x, (C,), p[h_ + "ln1.w"], p[h_ + "ln1.b"], LN_EPS)
    qkv = F.linear(h, p[h_ + "attn.qkv.w"], p[h_ + "attn.qkv.b"])
    # [q | k | v], each C wide; head j is columns j*hs:(j+1)*hs of each.
    q, k, v = (a.view(B, T, NH, hs).transpose(1, 2) for a in qkv.split(C, dim=-1))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    if causal:
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    att = att.softmax(dim=-1)
    x = x + F.linear((att @ v).transpose(1, 2).reshape(B, T, C), p[h_ + "attn.proj.w"], p[h_ + "attn.proj.b"])
    h = F.layer_norm(x, (C,), p[h_ + "ln2.w"], p[h_ + "ln2.b"], LN_EPS)
    h = F.gelu(F.linear(h, p[h_ + "mlp.fc.w"], p[h_ + "mlp.fc.b"]), approximate="tanh")
    return x + F.linear(h, p[h_ + "mlp.proj.w"], p[h_ + "mlp.proj.b"])


def text_features(t, p, tokens, lengths):
    """tokens (B, T) int64, lengths (B,) int64 -> (B, D): lnf(x) at position lengths[b] - 1, projected."""
    B, T = tokens.shape
    C = t["n_embd"]
    x = p["text.wte"][tokens] + p["text.wpe"][:T]
    for i in range(t["n_layer"]):
        x = gpt2_block(x, p, f"text.h.{i}.", t["n_head"], causal=True)
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
    identity so that their gradients matter), the projection N(0, 1/C). A ViT as the text tower,
    but the patch embedding N(0, 1/(p*p*3)) and the projection N(0, 1/C)."""
    if isinstance(visual, ViTVisual):
        return random_vit_weights(visual, g)
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


def random_vit_weights(visual, g):
    out, own = {}, visual.state_dict()
    for k in visual.names:  # vit_shapes' order rather than state_dict's (cls and pos first)
        v = own[k]
        if k in ("patch.w", "proj.w"):
            a = torch.randn(v.shape, generator=g, dtype=torch.float64) / math.sqrt(v.shape[1])
        elif k.endswith(("ln1.w", "ln2.w", "lnf.w")):
            a = 1.0 + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64)
        elif k.endswith(".b"):
            a = 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64)
        else:
            a = 0.2 * torch.randn(v.shape, generator=g, dtype=torch.float64)
        out["visual." + k] = a
    return out


def random_mask(B, P, K, seed):
    """B lists of K increasing patch indices in 0..P-1, drawn independently per sample."""
    g = torch.Generator().manual_seed(seed)
    return [sorted(torch.randperm(P, generator=g)[:K].tolist()) for _ in range(B)]


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


def make_example(d, arch="resnet"):
    if arch == "vit":
        image = {"arch": "vit", "size": 32, "patch": 8, "layers": 2, "width": 16, "heads": 2,
                 "mask": random_mask(3, 16, 10, seed=20250102)}
    else:
        image = {"arch": "resnet", "block": "basic", "layers": [1, 1, 1, 1], "width": 8, "size": 32}
    text = {"family": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 61, "padded_vocab_size": 64,
            "max_seq_len": 8}
    spec, w, images = random_spec(image, 16, text, 3, 8, seed=20250101)
    write_dir(d, spec, w, images)
    print(json.dumps({"dir": d, "tensors": len(w), "floats": sum(v.numel() for v in w.values()),
                      "lengths": spec["lengths"]}))


# ---------------------------------------------------------------------------
# Self-check


def vit_by_torch_modules(image, w, x, mask):
    """The ViT from torch's modules, for comparison: the patch embedding as a Conv2d of kernel and stride
    p whose weight is patch.w viewed as (C, p, p, 3) (the patch vector's order) moved to (C, 3, p, p);
    the blocks as nn.TransformerEncoderLayer with norm_first, the tanh GELU and no dropout."""
    B, C, ps, NH = x.shape[0], image["width"], image["patch"], image["heads"]
    conv = nn.Conv2d(3, C, ps, stride=ps).double()
    conv.load_state_dict({"weight": w["visual.patch.w"].view(C, ps, ps, 3).permute(0, 3, 1, 2),
                          "bias": w["visual.patch.b"]})
    tokens = conv(x).flatten(2).transpose(1, 2) + w["visual.pos"][1:]  # (B, P, C), patches row-major
    if mask is not None:
        tokens = torch.stack([tokens[b, mask[b]] for b in range(B)])
    seq = torch.cat([(w["visual.cls"] + w["visual.pos"][0]).expand(B, 1, C), tokens], dim=1)
    for i in range(image["layers"]):
        layer = nn.TransformerEncoderLayer(C, NH, 4 * C, dropout=0.0, layer_norm_eps=LN_EPS, batch_first=True,
                                           norm_first=True, activation=lambda t: F.gelu(t, approximate="tanh"))
        h = f"visual.h.{i}."
        layer.double().load_state_dict({
            "self_attn.in_proj_weight": w[h + "attn.qkv.w"], "self_attn.in_proj_bias": w[h + "attn.qkv.b"],
            "self_attn.out_proj.weight": w[h + "attn.proj.w"], "self_attn.out_proj.bias": w[h + "attn.proj.b"],
            "linear1.weight": w[h + "mlp.fc.w"], "linear1.bias": w[h + "mlp.fc.b"],
            "linear2.weight": w[h + "mlp.proj.w"], "linear2.bias": w[h + "mlp.proj.b"],
            "norm1.weight": w[h + "ln1.w"], "norm1.bias": w[h + "ln1.b"],
            "norm2.weight": w[h + "ln2.w"], "norm2.bias": w[h + "ln2.b"]})
        seq = layer(seq)
    return F.layer_norm(seq[:, 0], (C,), w["visual.lnf.w"], w["visual.lnf.b"], LN_EPS) @ w["visual.proj.w"].T


def self_check():
    t0 = time.time()
    failures = []

    def check(name, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        if not ok:
            failures.append(name)

    text = {"family": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 13, "padded_vocab_size": 16,
            "max_seq_len": 5}
    text_few = ["text.wte", "text.wpe", "text.h.0.ln1.w", "text.h.0.attn.qkv.w", "text.h.0.attn.qkv.b",
                "text.h.0.mlp.proj.b", "text.lnf.b", "text.proj.w", "logit_scale"]
    vit = {"arch": "vit", "size": 16, "patch": 4, "layers": 1, "width": 8, "heads": 2}
    vit_mask = random_mask(3, 16, 10, seed=15)
    vit_few = ["visual.patch.w", "visual.cls", "visual.pos", "visual.h.0.attn.qkv.w", "visual.lnf.w", "visual.proj.w"]
    # 32x32 images: at 16x16 the third stage's output is 1x1 with single-channel groups, where GroupNorm
    # returns its bias whatever the image, and the image tower would no longer depend on the image.
    # The bottleneck at width 4: its expansion (4) makes the tensors checked one float at a time 4x
    # larger than the basic block's (at width 8: 6,697 floats, 50 of the self-check's 66 s of CPU);
    # at width 4 its last stage still has 128 channels in groups of 4.
    cases = [(block, {"arch": "resnet", "block": block, "layers": [1, 1, 1, 1], "width": 8 if block == "basic" else 4,
                      "size": 32}, seed,
              ["visual.bn1.weight", "visual.layer1.0.bn1.bias", "visual.layer2.0.downsample.0.weight",
               "visual.layer3.0.conv1.weight" if block == "bottleneck" else "visual.layer2.0.downsample.1.weight",
               "visual.layer4.0.bn2.weight", "visual.proj.weight"] + text_few)
             for block, seed in (("basic", 11), ("bottleneck", 12))]
    cases += [("vit", vit, 13, vit_few), ("vit masked", dict(vit, mask=vit_mask), 14, vit_few)]
    for name, image, seed, few in cases:
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

        check(f"{name}: gradcheck of {len(few)} tensors", gradcheck(few, False))
        check(f"{name}: gradcheck (fast mode) of all {len(w)} tensors", gradcheck(list(w), True))

        with torch.no_grad():
            loss, img, txt = clip_loss(spec, visual, text_p, text_p["logit_scale"], x, tokens, lengths)
            spread = (img - img.mean(0)).abs().max().item()
            check(f"{name}: image embeddings depend on the image", spread > 1e-3, f"spread {spread:.3g}")
            # The loss written out term by term: -(1/2B) sum_i [log p_row(i, i) + log p_col(i, i)].
            s = math.exp(text_p["logit_scale"].item())
            total = 0.0
            for i in range(3):
                row = [s * float(img[i] @ txt[j]) for j in range(3)]
                col = [s * float(img[j] @ txt[i]) for j in range(3)]
                total -= row[i] - math.log(sum(math.exp(r) for r in row))
                total -= col[i] - math.log(sum(math.exp(c) for c in col))
            diff = abs(total / 6 - loss.item())
            check(f"{name}: loss against its explicit formula", diff < 1e-12, f"|diff| {diff:.2g}")
            # Tokens after position lengths[b] - 1 cannot change caption b's feature.
            later = tokens.clone()
            for b, n in enumerate(spec["lengths"]):
                later[b, n:] = (later[b, n:] + 1) % text["vocab_size"]
            diff = abs(loss_fn([], [], later).item() - loss.item())
            check(f"{name}: tokens after lengths[b]-1 are ignored", diff == 0.0, f"|diff| {diff:.2g}")

        # Above the cap the scale is 100 and logit_scale's gradient exactly zero.
        ls = torch.tensor([5.0], dtype=torch.float64, requires_grad=True)
        tp = dict(text_p)
        tp["logit_scale"] = ls
        capped, _, _ = clip_loss(spec, visual, tp, ls, x, tokens, lengths)
        capped.backward()
        tp["logit_scale"] = torch.tensor([math.log(100.0)], dtype=torch.float64)
        at_cap = clip_loss(spec, visual, tp, tp["logit_scale"], x, tokens, lengths)[0]
        check(f"{name}: clamp above log(100)", ls.grad.item() == 0.0 and abs(capped.item() - at_cap.item()) < 1e-14,
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
        check(f"{name}: file round trip", ok, f"loss {floss:.12f}, max grad diff {worst:.2g}")
        unused = [k for k, v in ts.items() if not v.grad.abs().max() > 0]
        check(f"{name}: every tensor gets a nonzero gradient", not unused, f"not: {unused}" if unused else "")

    # The ViT: a mask keeping every patch is no mask; the class token sees every kept patch, the last one
    # too (which a causal mask would hide), and no dropped one; the position rows of patches no sample
    # keeps get no gradient.
    check("vit masked: the kept sets differ between samples", len({tuple(m) for m in vit_mask}) == 3, str(vit_mask))
    spec, w, images = random_spec(vit, 8, text, 3, 5, 13)
    vw = {k: v for k, v in w.items() if k.startswith("visual.")}
    x = torch.tensor(images, dtype=torch.float64).permute(0, 3, 1, 2).contiguous()
    towers = {}
    for label, mask in (("none", None), ("all", [list(range(16))] * 3), ("some", vit_mask)):
        towers[label] = build_visual(vit if mask is None else dict(vit, mask=mask), 8)
        load_visual(towers[label], vw)

    def changed(patch):
        """x with patch patch[b] of each sample b changed (G = 4 patches of 4x4 pixels per side)."""
        xp = x.clone()
        for b, i in enumerate(patch):
            gy, gx = divmod(i, 4)
            xp[b, :, 4 * gy:4 * gy + 4, 4 * gx:4 * gx + 4] += 1.0
        return xp

    with torch.no_grad():
        y, y_all, y_some = towers["none"](x), towers["all"](x), towers["some"](x)
        check("vit: a mask keeping every patch == no mask", torch.equal(y, y_all),
              f"max |diff| {(y - y_all).abs().max().item():.2g}")
        d = (towers["none"](changed([15] * 3)) - y).abs().amax(1).min().item()
        check("vit: the last patch changes every image feature", d > 1e-6, f"min over samples {d:.3g}")
        d = (towers["some"](changed([m[-1] for m in vit_mask])) - y_some).abs().amax(1).min().item()
        check("vit masked: the last kept patch changes every image feature", d > 1e-6, f"min over samples {d:.3g}")
        dropped = [min(set(range(16)) - set(m)) for m in vit_mask]
        check("vit masked: a dropped patch changes nothing", torch.equal(towers["some"](changed(dropped)), y_some),
              f"dropped patches {dropped}")
    pos = vw["visual.pos"].clone().requires_grad_(True)
    y_some = functional_call(towers["some"], {"pos": pos}, (x,))
    rows = []
    for b in range(3):
        grad, = torch.autograd.grad(y_some[b].sum(), pos, retain_graph=True)
        rows.append([r for r in range(17) if grad[r].abs().max() > 0])
    want = [[0] + [1 + i for i in m] for m in vit_mask]
    check("vit masked: sample b's feature has a gradient in exactly the rows 0, 1+mask[b] of visual.pos",
          rows == want, "" if rows == want else f"rows {rows}")

    # The ViT against torch's own modules: a Conv2d patch embedding and TransformerEncoderLayer blocks;
    # 3x3 patches of 8x8 pixels, two blocks of three heads.
    image = {"arch": "vit", "size": 24, "patch": 8, "layers": 2, "width": 12, "heads": 3}
    g = torch.Generator().manual_seed(16)
    x = torch.randn(3, 3, 24, 24, generator=g, dtype=torch.float64)
    for mask in (None, random_mask(3, 9, 5, seed=17)):
        m = build_visual(image if mask is None else dict(image, mask=mask), 10)
        vw = random_visual_weights(m, g)
        load_visual(m, vw)
        with torch.no_grad():
            ya, yb = m(x), vit_by_torch_modules(image, vw, x, mask)
        diff = (ya - yb).abs().max().item()
        check(f"vit {'masked ' if mask else ''}2 blocks: == Conv2d + TransformerEncoderLayer", diff <= 1e-12,
              f"max |diff| {diff:.2g}")

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
    if len(sys.argv) == 5 and sys.argv[1] == "--make-example" and sys.argv[3] == "--arch" \
            and sys.argv[4] in ("resnet", "vit"):
        make_example(sys.argv[2], sys.argv[4])
        sys.exit(0)
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        sys.exit(2)
    loss, _ = run(sys.argv[1])
    print(json.dumps({"loss": loss}))
