#!/usr/bin/env python3
"""Writes tests/reference/hf/: small random Hugging Face models saved by transformers itself, and
what transformers computes with them, for hf_test (which reads them offline).

Run by hand with transformers, safetensors and torch from PyPI (bench/.venv):
    bench/.venv/bin/python tests/reference/make_hf_fixtures.py

  gpt2/        GPT2LMHeadModel (tied head), model.safetensors (F32) + config.json
  gpt2_f16/    the same weights saved as float16
  llama/       LlamaForCausalLM, grouped-query attention (4 heads over 2), untied head,
               rope_theta 50000, saved in shards (model.safetensors.index.json)
  llama_bf16/  the same weights saved as bfloat16, one file
  expected.json  per model: the input tokens, the targets, the loss and the logits [B, T, V] of
                 transformers' forward pass in float64 (eager attention), on the float32 weights
  tokenizers/{gpt2,llama3,llama2}.json  tokenizers trained here with the `tokenizers` library in the
                 shapes of GPT-2's (byte-level BPE, GPT-2's pattern), Llama 3's (its Split pattern,
                 byte-level, ignore_merges, <|begin_of_text|>) and Llama 2's / TinyLlama's
                 (SentencePiece-style: ▁, byte fallback <0xXX>, <unk> <s> </s>)
  llama_rope_llama3/, llama_rope_linear/  (--rope writes these alone) LlamaForCausalLM with rope
               scaling as transformers 5 writes it (rope_parameters: rope_type "llama3" with factor 4,
               low / high_freq_factor 1 / 4, original_max_position_embeddings 16; rope_type "linear"
               with factor 2); rope_expected.json: their logits over 2 x 32 tokens, as expected.json
  llama_text/  llama/'s files and a 300-token tokenizer.json of Llama 2's shape; llama_text_expected.json:
               `keel score`'s token count and loss on GPL-3 and greedy `keel generate`'s text through it
               (--text-only writes these alone)
  tokenizers/features/*.json, tokenizers/features_expected.json  (--tokenizer-features writes these
                 alone, from the committed gpt2.json and llama2.json): the same vocabularies with the
                 features newer files use: the Metaspace pre-tokenizer (prepend_scheme first / always /
                 never, split), ByteLevel's add_prefix_space, added tokens with lstrip, rstrip,
                 single_word and normalized; the ids the library gives on the licences, the hostile
                 texts and texts aimed at those features, and the library's decoding of them
  tokenizers/expected.json  their ids (encode without special tokens) of three licences of
                 /usr/share/common-licenses (with each file's sha256) and of hostile texts (given as hex:
                 invalid UTF-8, decoded as Python decodes it with errors="replace", control
                 characters, long words, emoji, scripts, special tokens' text)
"""
import hashlib
import json
import os
import shutil
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
B, T, V = 2, 8, 300


def randomize(model, seed):
    """Weights of a trained-looking scale (init's 0.02 gives near-uniform logits), norms near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "ln_" in name or "norm" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def expected(model, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    m64 = model.to(torch.float64)
    with torch.no_grad():
        logits = m64(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    model.to(torch.float32)
    return {"B": B, "T": T, "inputs": inputs.flatten().tolist(), "targets": targets.flatten().tolist(),
            "loss": loss.item(), "logits": [round(x, 9) for x in logits.flatten().tolist()]}


def save(model, name, dtype=torch.float32, **kw):
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    model.to(dtype).save_pretrained(path, **kw)
    model.to(torch.float32)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)


LICENCES = ["Apache-2.0", "GPL-3", "MPL-2.0"]
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HOSTILE = [
    b"Hello, world! I'LL go; we're DONE, they've it's  don't",
    b"invalid \xff\xfe utf-8 \xc3\x28 \xe2\x82 \xf0\x9f\x98 end \xed\xa0\x80 \xc0\xaf",
    b"\x00\x01\x07\x1b[31mred\x1b[0m\t\x0b\x0c\r\n\xc2\x85 \xe2\x80\xa8x\xc2\xa0y",
    b"a" * 3000 + b" " + b"supercalifragilistic" * 150,
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ❤️ ✨x".encode(),
    "中文字符 العربية Ελληνικά кириллица ① ½ ٣ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢".encode(),
    b"1234567890 3.14159 1,000,000 0x1F 42nd",
    b"  leading   spaces\n\n\n  and\ttabs \r\n\r\n trailing   ",
    b"<|endoftext|> <s> </s> <|begin_of_text|> <unk> <0x41>",
    b"",
    b"\n",
    b" ",
]


def sentencepiece_style(files, vocab_size, **trainer_options):
    # Llama 2 / TinyLlama: <unk> <s> </s>, the 256 byte tokens, then the learned pieces; spaces are ▁
    # (prepended and replaced by the normalizer), no pre-tokenizer, byte fallback for unknown characters.
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.train(files, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, max_token_length=16, **trainer_options))
    learned = json.loads(sp.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                                                     {"type": "ByteFallback"}, {"type": "Fuse"},
                                                     {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": learned["merges"]},
    }
    return Tokenizer.from_str(json.dumps(spec))


def train_tokenizers():
    """Three small tokenizers trained on the licences, in the three shapes Keel reads."""
    files = [os.path.join("/usr/share/common-licenses", f) for f in LICENCES]
    out = {}
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.train(files, trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"], show_progress=False,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out["gpt2"] = gpt2

    llama3 = Tokenizer(models.BPE(ignore_merges=True))
    llama3.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    llama3.decoder = decoders.ByteLevel()
    llama3.train(files, trainers.BpeTrainer(vocab_size=800, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                            show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = llama3.token_to_id("<|begin_of_text|>")
    llama3.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    out["llama3"] = llama3

    out["llama2"] = sentencepiece_style(files, 700)
    return out


def tokenizer_fixtures():
    path = os.path.join(OUT, "tokenizers")
    os.makedirs(path, exist_ok=True)
    expected = {"licences": {}, "hostile": [h.hex() for h in HOSTILE], "ids": {}}
    texts = {}
    for f in LICENCES:
        raw = open(os.path.join("/usr/share/common-licenses", f), "rb").read()
        expected["licences"][f] = hashlib.sha256(raw).hexdigest()
        texts[f] = raw.decode("utf-8", errors="replace")
    for i, h in enumerate(HOSTILE):
        texts["hostile/%d" % i] = h.decode("utf-8", errors="replace")
    for name, tok in train_tokenizers().items():
        tok.save(os.path.join(path, name + ".json"))
        tok = Tokenizer.from_file(os.path.join(path, name + ".json"))  # what Keel reads
        expected["ids"][name] = {k: tok.encode(t, add_special_tokens=False).ids for k, t in texts.items()}
        expected["ids"][name]["document_token"] = tok.encode("", add_special_tokens=True).ids or [
            tok.token_to_id("<|endoftext|>")]
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
        f.write("\n")


def text_fixture():
    """llama_text/: the llama fixture's weights with a 300-token tokenizer.json of Llama 2's shape, and
    what `keel score` and greedy `keel generate` must give through it: the ids of GPL-3 with <s> first,
    its loss over consecutive windows of the model's 64 positions (each window scored alone), and the
    text of 24 greedy tokens after a prompt (stopping at <s>, the document token), decoded by the library."""
    path = os.path.join(OUT, "llama_text")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(os.path.join(OUT, "llama"), path)
    files = [os.path.join("/usr/share/common-licenses", f) for f in LICENCES]
    tok = sentencepiece_style(files, V - 259, limit_alphabet=24)  # 259 = <unk> <s> </s> and the byte tokens
    tok.save(os.path.join(path, "tokenizer.json"))
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").to(torch.float64).eval()
    text = open("/usr/share/common-licenses/GPL-3", "rb").read().decode("utf-8", errors="replace")
    ids = [1] + tok.encode(text, add_special_tokens=False).ids
    nll, targets = 0.0, 0
    with torch.no_grad():
        for w in range(0, len(ids), 64):
            window = torch.tensor([ids[w:w + 64]])
            if window.shape[1] < 2:
                break
            logits = model(input_ids=window).logits[0]
            nll += torch.nn.functional.cross_entropy(logits[:-1], window[0, 1:], reduction="sum").item()
            targets += window.shape[1] - 1
        prompt = "This License"
        seq = [1] + tok.encode(prompt, add_special_tokens=False).ids
        for _ in range(24):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt == 1:
                break
    out = {"document": "GPL-3", "sha256": hashlib.sha256(open("/usr/share/common-licenses/GPL-3", "rb").read()).hexdigest(),
           "tokens": len(ids), "loss": nll / targets, "prompt": prompt, "generated": seq,
           "text": tok.decode(seq[1:], skip_special_tokens=True)}
    with open(os.path.join(OUT, "llama_text_expected.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")


FEATURE_TEXTS = [
    b"a <mask> b<mask>c  <mask>\n\t<mask>  end <mask>",
    b"License Licenses theLicense License. (License) _License License_ 1License License1 \xc3\xa9License",
    b"see the License; the  License, The License, the License\nthe License",
    b"<sep>x  <sep> y\t<sep>\n<sep>",
    b"copy copyright copy. xcopy copy",
    b"<s>Hello</s> world<s>  <unk> </s>",
    "  two leading spaces and\u3000ideographic\u3000 space".encode(),
    "\u2581already\u2581metaspace \u2581\u2581 x".encode(),
]


def feature_tokenizers():
    """Variants of the committed gpt2.json and llama2.json (their vocabularies and merges) with the
    features newer tokenizer.json files use, as the library writes them back."""
    path = os.path.join(OUT, "tokenizers")
    gpt2 = json.load(open(os.path.join(path, "gpt2.json")))
    llama2 = json.load(open(os.path.join(path, "llama2.json")))
    out = {}
    decoder_ms = lambda scheme: {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": True}
    # Llama 2 / TinyLlama as transformers converts them now: no normalizer, Metaspace "first", no split.
    for name, scheme, split, decoder in [
            ("metaspace_first", "first", False, llama2["decoder"]),
            ("metaspace_always_split", "always", True, decoder_ms("always")),
            ("metaspace_never_split", "never", True, decoder_ms("never"))]:
        t = json.loads(json.dumps(llama2))
        t["normalizer"] = None
        t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": split}
        t["decoder"] = decoder
        out[name] = Tokenizer.from_str(json.dumps(t))
    t = json.loads(json.dumps(gpt2))
    t["pre_tokenizer"]["add_prefix_space"] = True
    out["gpt2_prefix_space"] = Tokenizer.from_str(json.dumps(t))
    # Added tokens' options on a byte-level vocabulary (matched on the raw text) ...
    tok = Tokenizer.from_str(json.dumps(gpt2))
    tok.add_tokens([AddedToken("<mask>", lstrip=True, rstrip=True, special=True, normalized=False),
                    AddedToken("License", single_word=True, normalized=False),
                    AddedToken("<sep>", lstrip=True, normalized=False),
                    AddedToken("copy", single_word=True, rstrip=True, normalized=False)])
    out["added_options"] = tok
    # ... and on Llama 2's, whose normalizer (Prepend, Replace) the normalized ones are matched after.
    tok = Tokenizer.from_str(json.dumps(llama2))
    tok.add_tokens([AddedToken("the License", normalized=True),
                    AddedToken("<sep>", lstrip=True, rstrip=True, normalized=False, special=True),
                    AddedToken("copy", single_word=True, normalized=True),
                    AddedToken("Hello", normalized=True, lstrip=True)])
    out["added_normalized"] = tok
    return out


def tokenizer_feature_fixtures():
    path = os.path.join(OUT, "tokenizers")
    os.makedirs(os.path.join(path, "features"), exist_ok=True)
    hostile = HOSTILE + FEATURE_TEXTS
    expected = {"licences": {}, "hostile": [h.hex() for h in hostile], "ids": {}, "decoded": {}}
    texts = {}
    for f in LICENCES:
        raw = open(os.path.join("/usr/share/common-licenses", f), "rb").read()
        expected["licences"][f] = hashlib.sha256(raw).hexdigest()
        texts[f] = raw.decode("utf-8", errors="replace")
    for i, h in enumerate(hostile):
        texts["hostile/%d" % i] = h.decode("utf-8", errors="replace")
    for name, tok in feature_tokenizers().items():
        tok.save(os.path.join(path, "features", name + ".json"))
        tok = Tokenizer.from_file(os.path.join(path, "features", name + ".json"))  # what Keel reads
        expected["ids"][name] = {k: tok.encode(t, add_special_tokens=False).ids for k, t in texts.items()}
        expected["decoded"][name] = {k: tok.decode(ids) for k, ids in expected["ids"][name].items() if k.startswith("hostile/")}
    with open(os.path.join(path, "features_expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
        f.write("\n")


def rope_fixtures():
    out = {}
    for name, seed, rope in [
            ("llama_rope_llama3", 5, {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
            ("llama_rope_linear", 7, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})]:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                             max_position_embeddings=64, rope_parameters=rope, rms_norm_eps=1e-5,
                                             tie_word_embeddings=False, attn_implementation="eager"))
        model.eval()
        randomize(model, seed)
        save(model, name)
        g = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, V, (B, 33), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        m64 = model.to(torch.float64)
        with torch.no_grad():
            logits = m64(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        out[name] = {"B": B, "T": 32, "inputs": inputs.flatten().tolist(), "targets": targets.flatten().tolist(),
                     "loss": loss.item(), "logits": [round(x, 9) for x in logits.flatten().tolist()]}
    with open(os.path.join(OUT, "rope_expected.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")


def main():
    if sys.argv[1:] == ["--rope"]:  # llama_rope_*/ alone
        rope_fixtures()
        return
    if sys.argv[1:] == ["--tokenizer-features"]:  # tokenizers/features* alone, from the committed files
        tokenizer_feature_fixtures()
        return
    if sys.argv[1:] == ["--text-only"]:  # llama_text/ alone, from the committed llama/
        text_fixture()
        return
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)
    out = {}

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                                      attn_implementation="eager"))
    gpt2.eval()
    randomize(gpt2, 1)
    save(gpt2, "gpt2")
    out["gpt2"] = expected(gpt2, 2)
    save(gpt2, "gpt2_f16", torch.float16)  # (last: the model's weights are rounded in place)

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                         max_position_embeddings=64, rope_theta=50000.0, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False, attn_implementation="eager"))
    llama.eval()
    randomize(llama, 3)
    save(llama, "llama", max_shard_size="60KB")
    out["llama"] = expected(llama, 4)
    save(llama, "llama_bf16", torch.bfloat16)  # (last: the model's weights are rounded in place)

    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")
    tokenizer_fixtures()
    tokenizer_feature_fixtures()
    rope_fixtures()
    text_fixture()
    print("wrote", OUT, file=sys.stderr)


if __name__ == "__main__":
    main()
