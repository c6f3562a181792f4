// The llama family (model.family = "llama") against an independent float64 PyTorch
// implementation (tests/reference/llama_reference.py): the loss and every parameter gradient of
// small random models, grouped-query and multi-head, with the head tied and untied; and the model
// itself: its B/W split, its presets and the configurations it refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/llama2c.h"
#include "core/config.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

struct LlamaCase {
  const char* name;
  int n_kv_head;
  bool tied;
  const char* attention = "dense";
  int T = 7;  // tokens per sequence (80: two 64-token tiles of the blockwise kernel, the second partial)
};

ModelConfig small_llama(int n_kv_head, bool tied, const std::string& attention = "dense", int max_seq_len = 16) {
  Config c;
  c.model.preset = "llama-tiny";
  c.model.n_layer = 2;
  c.model.n_head = 4;
  c.model.n_kv_head = n_kv_head;
  c.model.n_embd = 16;
  c.model.vocab_size = 37;
  c.model.max_seq_len = max_seq_len;
  c.model.ffn_multiple_of = 8;  // 2/3 of 64 = 42, up to 48
  c.model.tie_embeddings = tied;
  c.model.attention = parse_enum<Attention>(attention, "model.attention");
  c.train.seq_len = 16;
  c.resolve(1);
  return c.model;
}

class LlamaReference : public ::testing::TestWithParam<LlamaCase> {};

TEST_P(LlamaReference, LossAndEveryGradientMatchPyTorchFloat64) {
  const LlamaCase& p = GetParam();
  const ModelConfig m = small_llama(p.n_kv_head, p.tied, p.attention, std::max(16, p.T));
  ASSERT_EQ(m.ffn_hidden, 48);
  ASSERT_STREQ(to_string(m.attention), p.attention);
  ChunkStore store(4096);  // small chunks: tensors span several
  GPT model(m, store);
  store.finalize();
  model.init_weights(5);
  // Random values everywhere (norm weights too, and not near their initial ones), so that every
  // gradient is exercised; padded vocabulary rows stay zero.
  Rng rng(17);
  json tensors = json::array();
  std::vector<float> weights;
  for (int id = 0; id < static_cast<int>(store.tensors().size()); ++id) {
    const TensorSpec& spec = store.tensors()[id].spec;
    std::span<float> w = store.view(id, Plane::param);
    const bool vocab = spec.name == "wte" || spec.name == "lm_head.w";
    const int64_t used = vocab ? static_cast<int64_t>(m.vocab_size) * m.n_embd : static_cast<int64_t>(w.size());
    for (int64_t i = 0; i < used; ++i) {
      w[i] = static_cast<float>(spec.kind == ChunkKind::norm ? 1.0 + 0.3 * rng.normal() : 0.3 * rng.normal());
    }
    tensors.push_back({{"name", spec.name}, {"shape", spec.shape}, {"offset", weights.size()}});
    weights.insert(weights.end(), w.begin(), w.end());
  }
  const int B = 2, T = p.T;
  std::vector<int> inputs(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int>(rng.below(m.vocab_size));
    targets[i] = static_cast<int>(rng.below(m.vocab_size));
  }
  model.allocate(B, T);
  store.zero_grads();
  const float scale = 1.0f / (B * T);
  const float loss = model.forward(Batch{inputs.data(), targets.data(), B, T, scale});
  model.backward(Batch{inputs.data(), targets.data(), B, T, scale});

  testing::TempDir dir("keel-llama-ref");
  const json spec = {{"config",
                      {{"n_layer", m.n_layer},
                       {"n_head", m.n_head},
                       {"n_kv_head", m.n_kv_head},
                       {"n_embd", m.n_embd},
                       {"ffn_hidden", m.ffn_hidden},
                       {"vocab_size", m.vocab_size},
                       {"rope_theta", m.rope_theta},
                       {"tie_embeddings", m.tie_embeddings.value()}}},
                     {"B", B},
                     {"T", T},
                     {"tokens", inputs},
                     {"targets", targets},
                     {"tensors", tensors}};
  testing::write_text(dir / "model.json", spec.dump());
  std::ofstream(dir / "weights.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(weights.data()), static_cast<std::streamsize>(weights.size() * 4));
  const testing::CommandResult ref = testing::run_command(
      "/usr/bin/python3 " + testing::source_path("tests/reference/llama_reference.py") + " " + dir.path());
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const double want = json::parse(read_text_file(dir / "reference.json")).at("loss").get<double>();
  EXPECT_NEAR(loss, want, 2e-6 * std::abs(want)) << p.name;
  std::vector<double> grads(weights.size());
  std::ifstream(dir / "grads.bin", std::ios::binary)
      .read(reinterpret_cast<char*>(grads.data()), static_cast<std::streamsize>(grads.size() * 8));
  for (const json& t : tensors) {
    const std::string name = t.at("name");
    std::span<const float> g = store.view(store.find(name), Plane::grad);
    const size_t at = t.at("offset").get<size_t>();
    double diff = 0, scale_ref = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      diff = std::max(diff, std::abs(g[i] - grads[at + i]));
      scale_ref = std::max(scale_ref, std::abs(grads[at + i]));
    }
    ASSERT_GT(scale_ref, 0) << name << ": the reference gives it no gradient";
    EXPECT_LT(diff / scale_ref, 2e-5) << p.name << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LlamaReference,
                         ::testing::Values(LlamaCase{"gqa-untied", 2, false}, LlamaCase{"mqa-tied", 1, true},
                                           LlamaCase{"mha-untied", 4, false},
                                           LlamaCase{"gqa-blockwise", 2, false, "blockwise", 80}),
                         [](const auto& info) {
                           std::string n = info.param.name;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(LlamaReference, TheReferenceChecksItselfWithGradcheck) {
  const testing::CommandResult r = testing::run_command(
      "/usr/bin/python3 " + testing::source_path("tests/reference/llama_reference.py") + " --self-check");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("gradcheck ok"), std::string::npos) << r.output;
}

// llama2.c's model file: a random model exported, parsed by the reference's own reader of run.c's
// format (which evaluates the same loss), imported again to the same bytes; a file whose length
// does not match its header is refused in one line.
TEST_P(LlamaReference, Llama2cExportEvaluatesTheSameInPyTorchAndImportsToTheSameBytes) {
  const LlamaCase& p = GetParam();
  const ModelConfig m = small_llama(p.n_kv_head, p.tied);
  ChunkStore store(4096);
  GPT model(m, store);
  store.finalize();
  model.init_weights(21);
  const int B = 2, T = 9;
  std::vector<int> inputs(B * T), targets(B * T);
  Rng rng(23);
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int>(rng.below(m.vocab_size));
    targets[i] = static_cast<int>(rng.below(m.vocab_size));
  }
  model.allocate(B, T);
  const float loss = model.forward(Batch{inputs.data(), targets.data(), B, T, 0.0f});
  testing::TempDir dir("keel-llama2c");
  const std::string file = dir / "model.bin";
  export_llama2c(file, store, m);
  testing::write_text(dir / "batch.json", json{{"B", B}, {"T", T}, {"tokens", inputs}, {"targets", targets}}.dump());
  const testing::CommandResult ref = testing::run_command("/usr/bin/python3 " +
                                                          testing::source_path("tests/reference/llama_reference.py") +
                                                          " --llama2c " + file + " " + dir.path());
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const double want = json::parse(read_text_file(dir / "reference.json")).at("loss").get<double>();
  EXPECT_NEAR(loss, want, 2e-6 * std::abs(want)) << p.name;

  const ModelConfig read = read_llama2c_model_config(file);
  EXPECT_EQ(read.n_kv_head, m.n_kv_head);
  EXPECT_EQ(read.ffn_hidden, m.ffn_hidden);
  EXPECT_EQ(read.tie_embeddings, m.tie_embeddings);
  ChunkStore again(4096);
  GPT copy(read, again);
  again.finalize();
  import_llama2c(file, again, read);
  ASSERT_EQ(again.numel(), store.numel());
  const std::span<const float> a = store.range_view(Plane::param, 0, store.numel());
  const std::span<const float> b = again.range_view(Plane::param, 0, again.numel());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size_bytes()));

  // Cut short by one float: its header promises more.
  const std::vector<char> bytes = read_file(file);
  std::ofstream(dir / "short.bin", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));
  const std::string e = testing::error_of([&] { read_llama2c_model_config(dir / "short.bin"); });
  EXPECT_NE(e.find("bytes for its header's sizes"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

// A zero-bubble pipeline runs every B before any W: the same bytes as B and W interleaved.
TEST(LlamaModel, DeferredWeightGradientsEqualInterleaved) {
  const ModelConfig m = small_llama(2, false);
  ChunkStore store(4096);
  GPT model(m, store);
  store.finalize();
  model.init_weights(9);
  const int B = 2, T = 9;
  std::vector<int> inputs(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) inputs[i] = (i * 5) % m.vocab_size, targets[i] = (i * 3 + 1) % m.vocab_size;
  model.allocate(B, T);
  std::vector<float> runs[2];
  for (int deferred = 0; deferred < 2; ++deferred) {
    store.zero_grads();
    model.forward(Batch{inputs.data(), targets.data(), B, T, 0.1f});
    model.backward(Batch{inputs.data(), targets.data(), B, T, 0.1f}, deferred == 1);
    std::span<const float> g = store.chunk_view(0, Plane::grad);
    runs[deferred].assign(g.data(), g.data() + store.numel());
  }
  EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), sizeof(float) * runs[0].size()));
}

// LLaMA's hidden-size rule and the presets' shapes.
TEST(LlamaConfig, PresetsAndTheHiddenSizeRule) {
  EXPECT_EQ(llama_ffn_hidden(4096, 256, 0), 11008);   // LLaMA-2 7B
  EXPECT_EQ(llama_ffn_hidden(4096, 1024, 1.3), 14336);  // Llama 3 8B
  EXPECT_EQ(llama_ffn_hidden(2048, 256, 0), 5632);    // TinyLlama
  EXPECT_EQ(llama_ffn_hidden(768, 32, 0), 2048);      // llama2.c's stories110M
  Config c;
  c.model.preset = "tinyllama-1.1b";
  c.train.seq_len = 128;
  c.resolve(1);
  EXPECT_EQ(c.model.family, Family::llama);
  EXPECT_EQ(c.model.n_layer, 22);
  EXPECT_EQ(c.model.n_embd, 2048);
  EXPECT_EQ(c.model.n_head, 32);
  EXPECT_EQ(c.model.n_kv_head, 4);
  EXPECT_EQ(c.model.ffn_hidden, 5632);
  EXPECT_FALSE(c.model.tie_embeddings.value());
  ChunkStore registry(1 << 20);  // tensor specs only: never finalized
  const GPT shape(c.model, registry);
  EXPECT_NEAR(static_cast<double>(registry.param_count()), 1.1e9, 0.01e9);  // TinyLlama-1.1B: 1,100,048,384
  // A resolved config written out and read back resolves to the same model.
  Config again = Config::parse(c.to_toml(), "written");
  again.resolve(1);
  EXPECT_EQ(again.shape_hash(), c.shape_hash());
}

TEST(LlamaConfig, BadCombinationsAreRefusedInOneLine) {
  auto refused = [](const std::vector<std::string>& sets) {  // (a bad family is refused as it is read)
    return testing::error_of([&] {
      Config c;
      for (const std::string& s : sets) c.set(s);
      c.resolve(1);
    });
  };
  EXPECT_NE(refused({"model.family=mamba"}).find("model.family: expected \"gpt2\" or \"llama\""), std::string::npos);
  EXPECT_NE(refused({"model.preset=llama-tiny", "model.n_kv_head=3"}).find("model.n_kv_head: expected a divisor of n_head"),
            std::string::npos);
  EXPECT_NE(refused({"model.rope_theta=500000"}).find("GPT-2 has learned positions"), std::string::npos);
  EXPECT_NE(refused({"model.n_kv_head=2"}).find("GPT-2 has no grouped-query attention"), std::string::npos);
  EXPECT_NE(refused({"model.tie_embeddings=false"}).find("GPT-2's head is always tied"), std::string::npos);
}

}  // namespace
}  // namespace keel
