#include "ckpt/llmc.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace {

// Tensor names in llm.c file order; "h.*." names are stacked over all layers.
const char* const kLayerTensors[] = {"ln1.w",      "ln1.b",      "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
                                     "ln2.w",      "ln2.b",      "mlp.fc.w",   "mlp.fc.b",   "mlp.proj.w",  "mlp.proj.b"};

// Calls fn(tensor name) for every tensor in llm.c's order.
template <typename Fn>
void for_each_llmc_tensor(const ModelConfig& m, Fn fn) {
  fn(std::string("wte"));
  fn(std::string("wpe"));
  for (const char* t : kLayerTensors) {
    for (int l = 0; l < m.n_layer; ++l) fn("h." + std::to_string(l) + "." + t);
  }
  fn(std::string("lnf.w"));
  fn(std::string("lnf.b"));
}

int64_t llmc_param_count(const ModelConfig& m) {
  const int64_t C = m.n_embd, L = m.n_layer;
  return static_cast<int64_t>(m.padded_vocab_size) * C + static_cast<int64_t>(m.max_seq_len) * C +
         L * (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C) + 2 * C;
}

}  // namespace

std::vector<std::string> llmc_tensor_order(const ModelConfig& model) {
  std::vector<std::string> names;
  for_each_llmc_tensor(model, [&](const std::string& n) { names.push_back(n); });
  return names;
}

ModelConfig read_llmc_model_config(const std::string& path) {
  check(std::filesystem::exists(path), "llm.c checkpoint " + path + ": not found");
  uint64_t size = 0;
  const FileStream f = open_regular_stream(path, "llm.c checkpoint", &size);
  const auto file_bytes = static_cast<int64_t>(size);
  check(file_bytes >= 256 * 4, "llm.c checkpoint " + path + ": expected a 1024-byte header, found a " +
                                   std::to_string(file_bytes) + "-byte file");
  int32_t h[256];
  check(std::fread(h, sizeof(int32_t), 256, f.get()) == 256, "llm.c checkpoint " + path + ": cannot read header");
  check(h[0] == kLlmcModelMagic, "llm.c checkpoint " + path + ": expected magic " + std::to_string(kLlmcModelMagic) +
                                     ", found " + std::to_string(h[0]));
  check(h[1] == kLlmcModelVersion, "llm.c checkpoint " + path + ": expected version 3 (fp32, padded vocabulary), found " +
                                       std::to_string(h[1]) + (h[1] == 5 ? " (bf16, not supported)" : ""));
  ModelConfig m;
  m.preset = "d4";
  m.max_seq_len = h[2];
  m.vocab_size = h[3];
  m.n_layer = h[4];
  m.n_head = h[5];
  m.n_embd = h[6];
  m.padded_vocab_size = h[7];
  m.family = Family::gpt2;
  m.tie_embeddings = true;
  validate_model(m, "llm.c checkpoint " + path);
  m.n_kv_head = m.n_head;       // (after the sizes are known to be in range: 4C cannot overflow)
  m.ffn_hidden = 4 * m.n_embd;
  const int64_t expected = 1024 + 4 * llmc_param_count(m);
  check(file_bytes == expected, "llm.c checkpoint " + path + ": expected " + std::to_string(expected) +
                                    " bytes for its header's sizes, found " + std::to_string(file_bytes));
  return m;
}

void import_llmc(const std::string& path, ChunkStore& store, const ModelConfig& model) {
  const ModelConfig m = read_llmc_model_config(path);
  check(m.n_layer == model.n_layer && m.n_embd == model.n_embd && m.n_head == model.n_head &&
            m.padded_vocab_size == model.padded_vocab_size && m.max_seq_len == model.max_seq_len,
        "llm.c checkpoint " + path + ": its sizes do not match the model being loaded");
  std::vector<char> bytes = read_file(path);
  const char* cursor = bytes.data() + 1024;
  for_each_llmc_tensor(m, [&](const std::string& name) {
    std::span<float> dst = store.view(store.find(name), Plane::param);
    std::memcpy(dst.data(), cursor, dst.size_bytes());
    cursor += dst.size_bytes();
    // Weights that are not numbers would train and evaluate to NaN without a word.
    const auto bad = std::find_if(dst.begin(), dst.end(), [](float v) { return !std::isfinite(v); });
    if (bad != dst.end()) {
      throw Error("llm.c checkpoint " + path + ": tensor " + name + " holds a non-finite value (" + std::to_string(*bad) +
                  ") at element " + std::to_string(bad - dst.begin()));
    }
  });
}

void export_llmc(const std::string& path, const ChunkStore& store, const ModelConfig& m) {
  check(!m.llama(), "export " + path + ": llm.c's format holds GPT-2 models; this is a llama model (--format llama2c)");
  std::vector<char> bytes(1024 + 4 * llmc_param_count(m));
  int32_t h[256] = {};
  h[0] = kLlmcModelMagic;
  h[1] = kLlmcModelVersion;
  h[2] = m.max_seq_len;
  h[3] = m.vocab_size;
  h[4] = m.n_layer;
  h[5] = m.n_head;
  h[6] = m.n_embd;
  h[7] = m.padded_vocab_size;
  std::memcpy(bytes.data(), h, sizeof h);
  char* cursor = bytes.data() + 1024;
  for_each_llmc_tensor(m, [&](const std::string& name) {
    std::span<const float> src = store.view(store.find(name), Plane::param);
    std::memcpy(cursor, src.data(), src.size_bytes());
    cursor += src.size_bytes();
  });
  write_file_atomic(path, {ByteRange{bytes.data(), bytes.size()}});
}

}  // namespace keel
