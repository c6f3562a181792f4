#!/usr/bin/env -S /usr/bin/python3
"""PyTorch + torchvision peer of Keel's dual-encoder (CLIP-style) training (CPU, float32).

Trains the model Keel trains with `keel train --config configs/clip.toml` on the same
`keel data images` dataset, and times whole optimizer steps. The model code is not written
here: it is tests/reference/clip_reference.py's (imported), the independent float64 PyTorch
implementation Keel's gradients are checked against, converted to float32:
  - image tower: a ResNet assembled from torchvision's BasicBlock / Bottleneck with
    GroupNorm(min(32, C)) (torchvision's own ResNet class at stem width 64), average pooling and
    a projection without bias; or the ViT (p x p patches, class token, learned positions, GPT-2
    blocks without the causal mask, tanh GELU), with FLIP patch masking through its `keep` lists;
  - text tower: GPT-2 (learned positions, pre-LayerNorm, causal attention, tanh GELU), the final
    LayerNorm's output at the caption's end token, a projection without bias;
  - loss: symmetric InfoNCE with the learnable log-scale clamped at log(100).
Initialisation follows Keel's (src/model/resnet.cpp, vit.cpp, gpt.cpp, text_tower.cpp): He
normal over fan-out for convolutions, GroupNorm 1/0, projections N(0, 1/C); GPT-2's N(0, 0.02)
with the residual projections at 0.02/sqrt(2L), biases 0, LayerNorms 1/0; the ViT's patch
embedding N(0, 1/(p*p*3)), class token N(0, 1/C), positions N(0, 0.01); logit_scale log(1/0.07).
The random draws are PyTorch's, not Keel's generator: the same distributions, not the same numbers.

Optimizer as Keel's (src/optim/adamw.cpp): torch.optim.AdamW, betas (beta1, beta2), eps, weight
decay on the tensors Keel decays (matrices, convolutions and embeddings; not biases, norms, the
ViT's class token and positions, or logit_scale), the global gradient norm clipped at --clip,
learning rate: linear warm-up lr*(s+1)/warmup for s < warmup, then cosine to lr*min_lr_ratio at
the last step.

Data as Keel's (src/data/images.h, src/data/clip_loader.h): DATASET/{train,val}.img (32-byte
header "KEELIMG1", version, count, height, width, channels, reserved; then HWC uint8) and
.jsonl captions; pixels /255 normalised with OpenAI CLIP's mean and deviation; captions encoded
with DATASET's tokenizer.json by a port of Keel's byte-level BPE (src/data/tokenizer.cpp: its
hand-written GPT-2 pre-tokenizer, then merges applied lowest rank first within each pre-token),
the end-of-text token appended, the window of --seq tokens padded with end tokens. Batches: a
fresh permutation of the training split each epoch, an epoch's tail shorter than a batch skipped
(torch's generator, not Keel's: the same scheme, another order). The images are normalised once
up front (Keel converts each batch's bytes as it loads it; a few hundred microseconds a step).

Timing: each step's wall time covers batch assembly, both towers' forward, the loss, backward,
clipping and the update (as Keel's step lines do). Evaluation at the end, not timed: zero-shot
retrieval over the held-out split (embeddings L2-normalised, cosine similarity; a tie counts
against the query), recall@1 and @5 both ways. A ViT with masking is evaluated on every patch.

Prints one JSON line: {"samples_per_s" (median over steps after the first --skip), "ms_per_step"
(its median), "samples_per_s_all", "final_loss", "recall_i2t_at1", "recall_i2t_at5",
"recall_t2i_at1", "recall_t2i_at5", "val_pairs", "params", "torch", "torchvision", "threads",
"channels_last", "compiled", "compile_error", "loss_impl", "peak_rss_mb"}.

Example:
  bench/torch_clip_train.py --dataset data/tango --tower resnet18 --width 16 --steps 20 --threads 2
  bench/torch_clip_train.py --dataset data/tango --tower vit --vit-patch 8 --vit-layers 4 \\
      --vit-width 64 --vit-heads 4 --vit-mask 0.5 --steps 20 --threads 2
"""

import argparse
import inspect
import json
import math
import os
import resource
import statistics
import struct
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ beside the reference implementation

import numpy as np
import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import clip_reference as ref  # noqa: E402  (the dual encoder's PyTorch implementation)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESNET_LAYERS = {"resnet18": ("basic", [2, 2, 2, 2]), "resnet34": ("basic", [3, 4, 6, 3]),
                 "resnet50": ("bottleneck", [3, 4, 6, 3]), "resnet101": ("bottleneck", [3, 4, 23, 3]),
                 "resnet152": ("bottleneck", [3, 8, 36, 3])}


# ---------------------------------------------------------------------------------------------
# Keel's byte-level BPE tokenizer (src/data/tokenizer.cpp), encoding only


SPACE_BYTES = frozenset(b" \t\n\r\v\f")
LETTER, DIGIT, OTHER, SPACE = range(4)


def char_class(c):
    if 97 <= c <= 122 or 65 <= c <= 90 or c >= 0x80:  # bytes >= 0x80 count as letters
        return LETTER
    if 48 <= c <= 57:
        return DIGIT
    if c in SPACE_BYTES:
        return SPACE
    return OTHER


def contraction_length(text, i):
    """Length of the contraction ('s 't 'm 'd 're 've 'll) starting at text[i], or 0."""
    if text[i] != 0x27 or i + 1 >= len(text):
        return 0
    c1 = text[i + 1]
    if c1 in b"stmd":
        return 2
    if i + 2 >= len(text):
        return 0
    if (c1, text[i + 2]) in ((0x72, 0x65), (0x76, 0x65), (0x6C, 0x6C)):  # re ve ll
        return 3
    return 0


def pretokenize(text):
    """GPT-2's pre-tokens of `text` (bytes) as Keel splits them: contractions, ` ?letters+`,
    ` ?digits+`, ` ?other+`, and whitespace runs, a run followed by a non-space leaving its last
    character to start the next pre-token."""
    n, i, out = len(text), 0, []
    while i < n:
        k = contraction_length(text, i)
        if k:
            out.append(text[i:i + k])
            i += k
            continue
        start = i
        if text[i] == 0x20 and i + 1 < n and text[i + 1] not in SPACE_BYTES:
            i += 1
        cls = char_class(text[i])
        if cls != SPACE:
            end = i + 1
            while end < n and char_class(text[end]) == cls:
                end += 1
            out.append(text[start:end])
            i = end
            continue
        end = i + 1
        while end < n and text[end] in SPACE_BYTES:
            end += 1
        if end < n and end - i >= 2:
            end -= 1
        out.append(text[i:end])
        i = end
    return out


class KeelBPE:
    """Keel's JSON tokenizer: {"format": "keel-bpe", "vocab_size", "eot", "merges": [[a, b], ...]},
    merge i making token 256 + i from tokens a and b."""

    def __init__(self, path):
        with open(path) as f:
            j = json.load(f)
        if j.get("format") != "keel-bpe":
            raise ValueError("%s: not a Keel BPE tokenizer (format %r)" % (path, j.get("format")))
        self.vocab_size, self.eot = int(j["vocab_size"]), int(j["eot"])
        self.merges = [tuple(m) for m in j["merges"]]
        self.rank = {m: 256 + r for r, m in enumerate(self.merges)}  # pair -> merged id
        self.bytes = [bytes([b]) for b in range(256)] + [b""] * (self.vocab_size - 256)
        for r, (a, b) in enumerate(self.merges):
            self.bytes[256 + r] = self.bytes[a] + self.bytes[b]
        self.cache = {}

    def encode_piece(self, piece):
        ids = list(piece)
        while len(ids) >= 2:
            best = min((self.rank.get(p, 1 << 30) for p in zip(ids, ids[1:])), default=1 << 30)
            if best == 1 << 30:
                break
            a, b = self.merges[best - 256]
            out, k = [], 0
            while k < len(ids):
                if k + 1 < len(ids) and ids[k] == a and ids[k + 1] == b:
                    out.append(best)
                    k += 2
                else:
                    out.append(ids[k])
                    k += 1
            ids = out
        return ids

    def encode(self, text):
        ids = []
        for piece in pretokenize(text.encode("utf-8")):
            if piece not in self.cache:
                self.cache[piece] = self.encode_piece(piece)
            ids += self.cache[piece]
        return ids

    def decode(self, ids):
        return b"".join(self.bytes[i] for i in ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Dataset


def read_split(dataset, split):
    """(uint8 array [N, H, W, 3], captions) of DATASET/<split>.img and .jsonl."""
    path = os.path.join(dataset, split + ".img")
    with open(path, "rb") as f:
        head = f.read(32)
        magic, version, count, h, w, c, _ = struct.unpack("<8s6I", head)
        if magic != b"KEELIMG1" or version != 1 or c != 3:
            raise ValueError("%s: not a Keel image split (magic %r, version %d, %d channels)" % (path, magic, version, c))
        pixels = np.frombuffer(f.read(), dtype=np.uint8)
    if pixels.size != count * h * w * c:
        raise ValueError("%s: %d bytes of pixels, expected %d" % (path, pixels.size, count * h * w * c))
    with open(os.path.join(dataset, split + ".jsonl")) as f:
        captions = [json.loads(line)["caption"] for line in f if line.strip()]
    if len(captions) != count:
        raise ValueError("%s.jsonl: %d captions for %d images" % (split, len(captions), count))
    return pixels.reshape(count, h, w, c), captions


def load_split(dataset, split, tok, T, channels_last):
    """(images [N, 3, H, W] float32 normalised, tokens [N, T] int64, lengths [N] int64)."""
    pixels, captions = read_split(dataset, split)
    x = torch.from_numpy(pixels.astype(np.float32) / 255.0)
    x = (x - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    x = x.permute(0, 3, 1, 2)  # a view: NHWC in memory is NCHW's channels_last
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    tokens = torch.full((len(captions), T), tok.eot, dtype=torch.long)
    lengths = torch.zeros(len(captions), dtype=torch.long)
    for i, cap in enumerate(captions):
        ids = tok.encode(cap) + [tok.eot]
        if len(ids) > T:
            raise ValueError("%s.jsonl: caption %d (%r) is %d tokens with its end token; the text tower reads %d"
                             % (split, i, cap, len(ids), T))
        tokens[i, :len(ids)] = torch.tensor(ids)
        lengths[i] = len(ids)
    return x, tokens, lengths


# ---------------------------------------------------------------------------------------------
# Model (clip_reference's code, float32) with Keel's initialisation


class DualEncoder(nn.Module):
    def __init__(self, image, text, embed_dim, max_scale=100.0):
        super().__init__()
        self.text_cfg, self.max_scale = text, max_scale
        self.visual = ref.build_visual(image, embed_dim).float()
        self.text_names = list(ref.text_shapes(text, embed_dim))
        for name, shape in ref.text_shapes(text, embed_dim).items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.zeros(shape)))
        self.logit_scale = nn.Parameter(torch.tensor([math.log(1 / 0.07)]))

    def text_params(self):
        return {n: getattr(self, n.replace(".", "_")) for n in self.text_names}

    def named_keel(self):
        """(Keel's tensor name, parameter) for every parameter."""
        for n, p in self.visual.named_parameters():
            yield "visual." + n, p
        for n in self.text_names:
            yield n, getattr(self, n.replace(".", "_"))
        yield "logit_scale", self.logit_scale

    def features(self, images, tokens, lengths):
        return self.visual(images), ref.text_features(self.text_cfg, self.text_params(), tokens, lengths)

    def forward(self, images, tokens, lengths):
        img, txt = self.features(images, tokens, lengths)
        return ref.contrastive(img, txt, self.logit_scale, self.max_scale)


def init_keel(model, image, text, seed):
    """Keel's initialisation rules (distributions, not Keel's numbers)."""
    g = torch.Generator().manual_seed(seed)

    def normal(p, std, rows=None):
        with torch.no_grad():
            p.zero_()
            n = p.shape[0] if rows is None else rows
            p[:n] = torch.randn(p[:n].shape, generator=g) * std

    with torch.no_grad():
        L_text = text["n_layer"]
        for name, p in model.named_keel():
            short = name.split(".", 1)[1] if "." in name else name
            if name == "logit_scale":
                p.fill_(math.log(1 / 0.07))
            elif image["arch"] == "resnet" and name.startswith("visual."):
                if p.dim() == 4:  # He normal over fan-out
                    normal(p, math.sqrt(2.0 / (p.shape[0] * p.shape[2] * p.shape[3])))
                elif name == "visual.proj.weight":
                    normal(p, 1.0 / math.sqrt(p.shape[1]))
                else:  # GroupNorm
                    p.fill_(1.0 if name.endswith(".weight") else 0.0)
            elif name in ("visual.patch.w",):
                normal(p, 1.0 / math.sqrt(p.shape[1]))
            elif name == "visual.cls":
                normal(p, 1.0 / math.sqrt(p.shape[0]))
            elif name == "visual.pos":
                normal(p, 0.01)
            elif short == "proj.w":  # the towers' projections (visual.proj.w, text.proj.w)
                normal(p, 1.0 / math.sqrt(p.shape[1]))
            elif name.endswith(("ln1.w", "ln2.w", "lnf.w")):
                p.fill_(1.0)
            elif p.dim() == 1:  # biases, LayerNorm shifts
                p.zero_()
            else:  # GPT-2's rule for the blocks and embeddings
                L = image["layers"] if name.startswith("visual.") else L_text
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("attn.proj.w", "mlp.proj.w")) else 0.02
                normal(p, std, rows=text["vocab_size"] if name == "text.wte" else None)


def decays(name, p):
    """Whether Keel's AdamW decays this tensor (TensorSpec::decay)."""
    return p.dim() >= 2 and name != "visual.pos"


def learning_rate(a, step):
    """Keel's schedule (src/optim/adamw.cpp), step from 0."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    min_lr = a.lr * a.min_lr_ratio
    decay = a.steps - a.warmup
    if decay <= 0:
        return a.lr
    progress = min(1.0, (step - a.warmup) / decay)
    return min_lr + 0.5 * (a.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def recall(img, txt, ks=(1, 5)):
    """Zero-shot retrieval over N pairs of normalised embeddings; an equal score counts as ahead."""
    sim = img @ txt.T
    out = {}
    for tag, s in (("i2t", sim), ("t2i", sim.T)):
        right = s.diagonal().unsqueeze(1)
        ahead = (s >= right).sum(1) - 1  # others scoring at least the right answer's
        for k in ks:
            out["recall_%s_at%d" % (tag, k)] = float((ahead < k).double().mean())
    return out


def main():
    ap = argparse.ArgumentParser(description="PyTorch + torchvision peer of Keel's dual-encoder training")
    ap.add_argument("--dataset", required=True, help="a `keel data images` directory")
    ap.add_argument("--tokenizer", default=None, help="default DATASET/tokenizer.json")
    ap.add_argument("--tower", default="resnet18", help="resnet18/34/50/101/152 or vit")
    ap.add_argument("--width", type=int, default=16, help="the ResNet's stem channels (clip.image_width)")
    ap.add_argument("--vit-patch", type=int, default=8)
    ap.add_argument("--vit-layers", type=int, default=4)
    ap.add_argument("--vit-width", type=int, default=64)
    ap.add_argument("--vit-heads", type=int, default=4)
    ap.add_argument("--vit-mask", type=float, default=0.0, help="share of patches dropped per training image (FLIP)")
    ap.add_argument("--embed-dim", type=int, default=64)
    ap.add_argument("--text-layers", type=int, default=2)
    ap.add_argument("--text-heads", type=int, default=2)
    ap.add_argument("--text-width", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512, help="model.vocab_size (>= the tokenizer's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32, help="caption window with the end token (train.seq_len)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the median")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient norm cap (0 = off)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's")
    ap.add_argument("--channels-last", action="store_true", help="ResNet: channels_last weights and images")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training forward where it exists")
    ap.add_argument("--loss", default="reference", choices=("reference", "openclip"),
                    help="the contrastive loss: clip_reference's, or open_clip.loss.ClipLoss (same formula)")
    ap.add_argument("--seed", type=int, default=1337)
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = KeelBPE(a.tokenizer or os.path.join(a.dataset, "tokenizer.json"))
    if tok.vocab_size > a.vocab:
        sys.exit("tokenizer has %d tokens; --vocab %d is smaller" % (tok.vocab_size, a.vocab))
    is_vit = a.tower == "vit"
    channels_last = a.channels_last and not is_vit
    train_x, train_t, train_n = load_split(a.dataset, "train", tok, a.seq, channels_last)
    val_x, val_t, val_n = load_split(a.dataset, "val", tok, a.seq, channels_last)
    N, size = train_x.shape[0], train_x.shape[2]
    if N < a.batch:
        sys.exit("%d training pairs cannot fill a batch of %d" % (N, a.batch))

    if is_vit:
        image = {"arch": "vit", "size": size, "patch": a.vit_patch, "layers": a.vit_layers, "width": a.vit_width,
                 "heads": a.vit_heads}
    else:
        block, layers = RESNET_LAYERS[a.tower]
        image = {"arch": "resnet", "block": block, "layers": layers, "width": a.width, "size": size}
    padded = (a.vocab + 127) // 128 * 128
    text = {"family": "gpt2", "n_layer": a.text_layers, "n_head": a.text_heads, "n_embd": a.text_width,
            "vocab_size": a.vocab, "padded_vocab_size": padded, "max_seq_len": a.seq}
    model = DualEncoder(image, text, a.embed_dim)
    init_keel(model, image, text, a.seed)
    if channels_last:
        model.visual.to(memory_format=torch.channels_last)
    named = list(model.named_keel())
    params = [p for _, p in named]
    n_params = sum(p.numel() for p in params)

    kwargs = dict(lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    if "foreach" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["foreach"] = True  # multi-tensor kernels
    opt = torch.optim.AdamW([{"params": [p for n, p in named if decays(n, p)], "weight_decay": a.weight_decay},
                             {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}], **kwargs)

    loss_fn, loss_impl = None, "clip_reference.contrastive"
    if a.loss == "openclip":
        from open_clip.loss import ClipLoss  # raises where OpenCLIP is not installed
        clip_loss = ClipLoss()
        log_max = math.log(model.max_scale)
        loss_impl = "open_clip.loss.ClipLoss"

        def loss_fn(images, tokens, lengths):
            img, txt = model.features(images, tokens, lengths)
            img = img / img.norm(dim=-1, keepdim=True)
            txt = txt / txt.norm(dim=-1, keepdim=True)
            return clip_loss(img, txt, torch.exp(torch.clamp(model.logit_scale, max=log_max))), img, txt
    else:
        loss_fn = model

    compiled, compile_error = False, ""
    train_fwd = loss_fn
    if a.compile:
        if not hasattr(torch, "compile"):
            compile_error = "torch %s has no torch.compile" % torch.__version__
        else:
            try:
                train_fwd = torch.compile(loss_fn)
                compiled = True
            except Exception as e:  # noqa: BLE001  (reported, then eager)
                compile_error = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    P = (size // a.vit_patch) ** 2 if is_vit else 0
    keep = max(1, int(math.floor(P * (1.0 - a.vit_mask) + 0.5))) if is_vit else 0  # Keel's lround
    mask_gen = torch.Generator().manual_seed(a.seed ^ 0xF11B)
    order_gen = torch.Generator().manual_seed(a.seed)
    per_epoch = N // a.batch
    order = None

    def step(i):
        nonlocal order, train_fwd, compiled, compile_error
        if i % per_epoch == 0:
            order = torch.randperm(N, generator=order_gen)
        idx = order[(i % per_epoch) * a.batch:(i % per_epoch + 1) * a.batch]
        images, tokens, lengths = train_x[idx], train_t[idx], train_n[idx]
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if is_vit and keep < P:
            model.visual.keep = torch.rand(a.batch, P, generator=mask_gen).argsort(dim=1)[:, :keep].sort(dim=1).values
        lr = learning_rate(a, i)
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            loss, img, txt = train_fwd(images, tokens, lengths)
        except Exception as e:  # noqa: BLE001  (a compiled forward that fails: reported, then eager)
            if not compiled:
                raise
            compile_error = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            train_fwd, compiled = loss_fn, False
            loss, img, txt = train_fwd(images, tokens, lengths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        return loss

    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        loss = step(i)
        times.append(time.perf_counter() - t0)
    final_loss = loss.item()

    # Zero-shot retrieval on the held-out split, every patch, micro-batches of up to --batch.
    model.eval()
    if is_vit:
        model.visual.keep = None
    with torch.no_grad():
        imgs, txts = [], []
        for first in range(0, val_x.shape[0], a.batch):
            sl = slice(first, first + a.batch)
            img, txt = model.features(val_x[sl], val_t[sl], val_n[sl])
            imgs.append(img / img.norm(dim=-1, keepdim=True).clamp_min(1e-12))
            txts.append(txt / txt.norm(dim=-1, keepdim=True).clamp_min(1e-12))
        rec = recall(torch.cat(imgs), torch.cat(txts))

    timed = times[a.skip:] if len(times) > a.skip else times
    med = statistics.median(timed)
    import torchvision
    out = {"samples_per_s": round(a.batch / med, 2), "ms_per_step": round(1e3 * med, 2),
           "samples_per_s_all": [round(a.batch / t, 1) for t in times], "steps": a.steps, "skip": a.skip,
           "final_loss": round(final_loss, 6), "val_pairs": int(val_x.shape[0]), "params": n_params,
           "torch": torch.__version__, "torchvision": torchvision.__version__, "threads": torch.get_num_threads(),
           "channels_last": channels_last, "compiled": compiled, "compile_error": compile_error,
           "loss_impl": loss_impl, "vit_keep": keep if is_vit and keep < P else None,
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    out.update({k: round(v, 6) for k, v in rec.items()})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
