#!/usr/bin/env bash
# Writes the fuzz targets' seed corpora (fuzz/corpus/TARGET/) from real Keel outputs: shipped
# configs, a token shard and tokenizers made by `keel tokenize`, the llm.c test model, and a
# checkpoint of it. Run once from the repository root after building build/keel; the seeds are
# committed, so CI does not need this.
set -euo pipefail
cd "$(dirname "$0")/.."
keel=build/keel
out=fuzz/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out"
mkdir -p "$out"/{fuzz_config,fuzz_shard,fuzz_tokenizer,fuzz_llmc,fuzz_checkpoint,fuzz_image,fuzz_http,fuzz_safetensors,fuzz_hf_tokenizer}

cp configs/default.toml "$out/fuzz_config/default.toml"
cp configs/gpt2-124m-llmc.toml "$out/fuzz_config/gpt2-124m-llmc.toml" 2>/dev/null || true
printf 'train.steps=3\n[model]\npreset = "tiny"\n[parallel]\npipeline = 2\nschedule = "zb-h1"\n[tier]\ndevice_mib = 4\n' \
  >"$out/fuzz_config/set-and-sections.toml"

mkdir -p "$tmp/texts"
printf 'The quick brown fox jumps over the lazy dog.\nHello, world! 123 %s\n' "été" >"$tmp/texts/a.txt"
printf 'Another document, with numbers 42 and 7, and spaces   here.\n' >"$tmp/texts/b.txt"
"$keel" tokenize --input "$tmp/texts" --out "$tmp/tok" --vocab-size 280 >/dev/null
cp "$tmp"/tok/*tokenizer*.json "$out/fuzz_tokenizer/keel.json"
ls "$tmp/tok"/*.bin | head -1 | xargs -I{} cp {} "$out/fuzz_shard/shard.bin"
# An llm.c tokenizer file (version 2): 256 x uint32 header, then per token a length byte and bytes.
python3 - "$out/fuzz_tokenizer/llmc.bin" <<'PY'
import struct, sys
tokens = [bytes([b]) for b in range(256)] + [b"<|endoftext|>"]
header = [20240328, 2, len(tokens), 256] + [0] * 252
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256I", *header))
    for t in tokens:
        f.write(bytes([len(t)]) + t)
PY

cp tests/fixtures/tiny_gpt2.bin "$out/fuzz_llmc/tiny_gpt2.bin"
# A llama2.c model (run.c format) and tokenizer.bin, exported from a tiny llama checkpoint.
"$keel" train --set model.preset=llama-tiny --set model.n_embd=32 --set model.vocab_size=280 \
  --set model.max_seq_len=16 --set train.seq_len=16 --set train.batch_size=1 --set train.steps=1 \
  --set train.eval_every=0 --set train.eval_batches=1 --set train.sample_tokens=0 --set data.train="$tmp/tok/train.bin" \
  --set data.val="$tmp/tok/val.bin" --set data.tokenizer="" --set train.run_dir="$tmp/llama" >/dev/null
"$keel" export --checkpoint "$tmp/llama/ckpt" --out "$out/fuzz_llmc/llama2c.bin" >/dev/null
"$keel" export --tokenizer "$out/fuzz_tokenizer/keel.json" --out "$out/fuzz_tokenizer/llama2c_tokenizer.bin" >/dev/null

# A checkpoint of the tiny model: uint32 manifest length, manifest.json, r0.bin.
"$keel" import --llmc tests/fixtures/tiny_gpt2.bin --out "$tmp/ckpt" >/dev/null
step=$(ls "$tmp/ckpt" | head -1)
python3 - "$tmp/ckpt/$step" "$out/fuzz_checkpoint/tiny.ckpt" <<'PY'
import struct, sys
d, out = sys.argv[1], sys.argv[2]
m = open(d + "/manifest.json", "rb").read()
r = open(d + "/r0.bin", "rb").read()
open(out, "wb").write(struct.pack("<I", len(m)) + m + r)
PY
ls -la "$out"/*

# HTTP requests to the metrics endpoint: a Prometheus scrape as Prometheus 2.42 sends it, curl and
# browser requests pipelined, a body, HTTP/1.0, HTTP/2's preface, HTTP/0.9, OPTIONS *, chunked.
h="$out/fuzz_http"
printf 'GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9100\r\nUser-Agent: Prometheus/2.42.0\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\nAccept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n' >"$h/prometheus_scrape"
printf 'GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\nGET /favicon.ico HTTP/1.1\r\nHost: localhost\r\n\r\nHEAD /metrics?x=1 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' >"$h/pipelined"
printf 'POST /metrics HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello' >"$h/post_body"
printf 'GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET http://localhost:9100/%%6detrics HTTP/1.0\r\n\r\n' >"$h/http10_keepalive"
printf 'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' >"$h/http2_preface"
printf 'GET /metrics\r\n' >"$h/http09"
printf 'OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n' >"$h/options"
printf 'GET /../metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n' >"$h/chunked"

# Images: real icons (tango-icon-theme) as PNG, and one as JPEG three ways (colour, grey, progressive).
find /usr/share/icons/Tango/16x16/actions -name "*.png" -type f | sort | head -12 | xargs -I{} cp {} "$out/fuzz_image/"
gcc -O1 -o "$tmp/mkjpg" fuzz/mkjpg.c -lpng -ljpeg
trash=/usr/share/icons/Tango/32x32/places/user-trash.png
"$tmp/mkjpg" "$trash" "$out/fuzz_image/user-trash.jpg" 80 0 0
"$tmp/mkjpg" "$trash" "$out/fuzz_image/user-trash-gray.jpg" 60 1 0
"$tmp/mkjpg" "$trash" "$out/fuzz_image/user-trash-progressive.jpg" 70 0 1

# safetensors: a shard transformers wrote (tests/reference/hf), and a file of every float dtype Keel
# reads beside others it refuses to read as float (I64), an empty tensor and metadata.
cp tests/reference/hf/llama/model-00003-of-00003.safetensors "$out/fuzz_safetensors/llama_shard.safetensors"
python3 - "$out/fuzz_safetensors/mixed.safetensors" <<'PY'
import json, struct, sys
tensors = [("a", "F32", [2, 3], struct.pack("<6f", *range(6))), ("b", "BF16", [2], bytes.fromhex("c03f00c0")),
           ("c", "F16", [3], bytes.fromhex("0038ff7b0100")), ("e", "F32", [0, 4], b""),
           ("i", "I64", [2], struct.pack("<2q", 1, 2))]
header, data = {"__metadata__": {"format": "pt"}}, b""
for name, dtype, shape, raw in tensors:
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
    data += raw
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(text)) + text + data)
PY
# tokenizer.json: the three shapes tests/reference/make_hf_fixtures.py trains (GPT-2, Llama 3, Llama 2), and two
# of its feature variants (Metaspace "first"; added tokens with lstrip / rstrip / single_word).
cp tests/reference/hf/tokenizers/{gpt2,llama3,llama2}.json tests/reference/hf/tokenizers/features/{metaspace_first,added_options}.json "$out/fuzz_hf_tokenizer/"
