#include "ckpt/llama2c.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace {

constexpr double kTheta = 10000.0;  // run.c's RoPE base

// One piece of the file: `rows` rows of `cols` floats, taken from (or put into) rows
// [row0, row0 + rows) of Keel tensor `tensor` (whose rows are `cols` wide).
struct Piece {
  std::string tensor;
  int64_t row0 = 0, rows = 0, cols = 0;
};

// The file's weights in order, as pieces of Keel tensors ("" = the RoPE table, no tensor).
std::vector<Piece> file_layout(const ModelConfig& m) {
  const int64_t C = m.n_embd, kv = m.kv_dim(), H = m.ffn_hidden, L = m.n_layer, V = m.vocab_size;
  const int64_t hs = m.head_size();
  std::vector<Piece> p;
  auto per_layer = [&](const std::string& suffix, int64_t row0, int64_t rows, int64_t cols) {
    for (int64_t l = 0; l < L; ++l) p.push_back({"h." + std::to_string(l) + "." + suffix, row0, rows, cols});
  };
  p.push_back({"wte", 0, V, C});
  per_layer("attn_norm.w", 0, 1, C);
  per_layer("attn.qkv.w", 0, C, C);       // wq
  per_layer("attn.qkv.w", C, kv, C);      // wk
  per_layer("attn.qkv.w", C + kv, kv, C); // wv
  per_layer("attn.proj.w", 0, C, C);      // wo
  per_layer("mlp_norm.w", 0, 1, C);
  per_layer("mlp.gate_up.w", 0, H, C);    // w1
  per_layer("mlp.proj.w", 0, C, H);       // w2
  per_layer("mlp.gate_up.w", H, H, C);    // w3
  p.push_back({"norm.w", 0, 1, C});
  p.push_back({"", 0, 2 * static_cast<int64_t>(m.max_seq_len), hs / 2});  // freq_cis_real, freq_cis_imag
  if (!m.tie_embeddings.value_or(false)) p.push_back({"lm_head.w", 0, V, C});
  return p;
}

int64_t file_floats(const ModelConfig& m) {
  int64_t n = 0;
  for (const Piece& piece : file_layout(m)) n += piece.rows * piece.cols;
  return n;
}

}  // namespace

ModelConfig read_llama2c_model_config(const std::string& path) {
  uint64_t size = 0;
  const FileStream f = open_regular_stream(path, "llama2.c model", &size);
  int32_t h[7] = {};
  check(std::fread(h, sizeof(int32_t), 7, f.get()) == 7, "llama2.c model " + path + ": shorter than its 28-byte header");
  const int64_t file_bytes = static_cast<int64_t>(size);
  auto s = [](int64_t v) { return std::to_string(v); };
  check(h[0] > 0 && h[1] > 0 && h[2] > 0 && h[3] > 0 && h[4] > 0 && h[5] != 0 && h[5] != INT32_MIN && h[6] > 0,
        "llama2.c model " + path + ": header sizes must be positive (dim " + s(h[0]) + ", hidden_dim " + s(h[1]) +
            ", n_layers " + s(h[2]) + ", n_heads " + s(h[3]) + ", n_kv_heads " + s(h[4]) + ", vocab_size " + s(h[5]) +
            ", seq_len " + s(h[6]) + ")");
  Config c;
  c.model.preset = "llama-tiny";
  c.model.family = Family::llama;
  c.model.n_embd = h[0];
  c.model.ffn_hidden = h[1];
  c.model.n_layer = h[2];
  c.model.n_head = h[3];
  c.model.n_kv_head = h[4];
  c.model.vocab_size = std::abs(h[5]);
  c.model.tie_embeddings = h[5] > 0;  // run.c: a negative vocab_size means a classifier of its own
  c.model.max_seq_len = h[6];
  c.model.rope_theta = kTheta;
  c.model.ffn_multiple_of = 1;
  c.train.seq_len = std::min(c.train.seq_len, h[6]);
  check(h[0] % h[3] == 0, "llama2.c model " + path + ": dim " + s(h[0]) + " is not a multiple of n_heads " + s(h[3]));
  try {
    c.resolve(1);
  } catch (const Error& e) {
    throw Error("llama2.c model " + path + ": " + e.what());
  }
  const int64_t expected = 28 + 4 * file_floats(c.model);
  check(file_bytes == expected, "llama2.c model " + path + ": expected " + s(expected) + " bytes for its header's sizes, found " +
                                    s(file_bytes));
  return c.model;
}

void import_llama2c(const std::string& path, ChunkStore& store, const ModelConfig& model) {
  const ModelConfig m = read_llama2c_model_config(path);
  check(m.n_layer == model.n_layer && m.n_embd == model.n_embd && m.n_head == model.n_head &&
            m.n_kv_head == model.n_kv_head && m.ffn_hidden == model.ffn_hidden && m.vocab_size == model.vocab_size &&
            m.tie_embeddings == model.tie_embeddings,
        "llama2.c model " + path + ": its sizes do not match the model being loaded");
  const std::vector<char> bytes = read_file(path);
  const char* cursor = bytes.data() + 28;
  for (const Piece& p : file_layout(m)) {
    const int64_t n = p.rows * p.cols;
    if (!p.tensor.empty()) {
      std::span<float> dst = store.view(store.find(p.tensor), Plane::param);
      float* at = dst.data() + p.row0 * p.cols;
      std::memcpy(at, cursor, sizeof(float) * n);
      const auto bad = std::find_if(at, at + n, [](float v) { return !std::isfinite(v); });
      if (bad != at + n) {
        throw Error("llama2.c model " + path + ": tensor " + p.tensor + " holds a non-finite value (" +
                    std::to_string(*bad) + ")");
      }
    }
    cursor += sizeof(float) * n;
  }
}

void export_llama2c(const std::string& path, const ChunkStore& store, const ModelConfig& m) {
  check(m.llama(), "export " + path + ": llama2.c's format holds llama models; this is a " + to_string(m.family.value_or(Family::gpt2)) + " model");
  check(m.rope_theta == kTheta, "export " + path + ": llama2.c's format fixes RoPE's base at 10000; this model has " +
                                    std::to_string(m.rope_theta));
  check(!m.moe(), "export " + path + ": llama2.c's format has no mixture of experts; this model has model.moe_experts = " +
                      std::to_string(m.moe_experts));
  const int32_t h[7] = {m.n_embd, m.ffn_hidden, m.n_layer, m.n_head, m.n_kv_head,
                        m.tie_embeddings.value_or(false) ? m.vocab_size : -m.vocab_size, m.max_seq_len};
  std::vector<char> bytes(28 + 4 * file_floats(m));
  std::memcpy(bytes.data(), h, sizeof h);
  float* cursor = reinterpret_cast<float*>(bytes.data() + 28);
  const int hs = m.head_size();
  for (const Piece& p : file_layout(m)) {
    if (p.tensor.empty()) {  // the RoPE table run.c once read: cos, then sin, of pos * theta^(-2i / hs)
      for (int part = 0; part < 2; ++part) {
        for (int pos = 0; pos < m.max_seq_len; ++pos) {
          for (int i = 0; i < hs / 2; ++i) {
            const double angle = pos * std::pow(kTheta, -2.0 * i / hs);
            *cursor++ = static_cast<float>(part == 0 ? std::cos(angle) : std::sin(angle));
          }
        }
      }
      continue;
    }
    std::span<const float> src = store.view(store.find(p.tensor), Plane::param);
    std::memcpy(cursor, src.data() + p.row0 * p.cols, sizeof(float) * p.rows * p.cols);
    cursor += p.rows * p.cols;
  }
  write_file_atomic(path, {ByteRange{bytes.data(), bytes.size()}});
}

}  // namespace keel
