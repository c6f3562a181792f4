// Hugging Face checkpoints and tokenizers: the safetensors reader against hand-made files (every
// rule of the header, one line per refusal), and Keel's import of models transformers saved
// (tests/reference/make_hf_fixtures.py wrote tests/reference/hf/): its logits and loss against
// transformers' float64 forward pass, F16 / BF16 files, sharded ones, export -> import bit-exact,
// the CLI's refusal of bad directories, training from one (train.init = "hf:DIR"); tokenizer.json
// files of three shapes against the ids the `tokenizers` library gave; uint32 token shards and a
// 128,256-token model that trains on them.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ckpt/checkpoint.h"
#include "ckpt/hf.h"
#include "ckpt/safetensors.h"
#include "core/fileio.h"
#include "data/hf_tokenizer.h"
#include "data/loader.h"
#include "data/shard.h"
#include "model/gpt.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A safetensors file's bytes: the header length, `header` as written, then `data_bytes` zero bytes.
std::string safetensors_bytes(const std::string& header, size_t data_bytes, int64_t claimed_length = -1) {
  std::string out(8, '\0');
  const uint64_t n = claimed_length >= 0 ? static_cast<uint64_t>(claimed_length) : header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\0');
}

std::string parse_error(const std::string& bytes) {
  return testing::error_of([&] { parse_safetensors({bytes.data(), bytes.size()}, "f.safetensors"); });
}

TEST(Safetensors, ParsesAValidHeader) {
  const std::string bytes = safetensors_bytes(
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"I64","shape":[0],"data_offsets":[14,14]}}  )",
      14);
  const SafetensorsHeader h = parse_safetensors({bytes.data(), bytes.size()}, "f");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "a");  // offset order
  EXPECT_EQ(h.find("b")->dtype, "BF16");
  EXPECT_EQ(h.find("b")->shape, std::vector<int64_t>{3});
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(Safetensors, RefusesEachBrokenRuleInOneLineNamingTheField) {
  const std::string ok_tensor = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const struct {
    std::string bytes, expected;
  } cases[] = {
      {std::string("\x05\0\0", 3), "expected an 8-byte header length"},
      {safetensors_bytes("{" + ok_tensor + "}", 8, 1000), "header length 1000 exceeds"},
      {safetensors_bytes("{" + ok_tensor, 8), "header is not valid JSON"},
      {safetensors_bytes("[1]", 0), "begin with '{'"},
      {safetensors_bytes(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8), "field dtype: expected one of"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "field shape: expected non-negative"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "field data_offsets: expected 0 <= begin <= end <= 8"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "expected 3 x 4 bytes"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       "overlapping tensors"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "leaving a gap after byte 0"},
      {safetensors_bytes("{" + ok_tensor + "}", 12), "(trailing bytes)"},
      {safetensors_bytes("{" + ok_tensor + "," + ok_tensor + "}", 8), "named twice"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8), "unexpected field \"x\""},
      {safetensors_bytes(R"({"__metadata__":{"k":1}})", 0), "field __metadata__.k: expected a string"},
  };
  for (const auto& c : cases) {
    const std::string e = parse_error(c.bytes);
    EXPECT_NE(e.find(c.expected), std::string::npos) << "expected '" << c.expected << "', got: " << e;
    EXPECT_NE(e.find("f.safetensors"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(Safetensors, HalfAndBfloat16WidenExactly) {
  EXPECT_EQ(half_to_float(0x3c00), 1.0f);
  EXPECT_EQ(half_to_float(0xc000), -2.0f);
  EXPECT_EQ(half_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));  // the smallest subnormal
  EXPECT_EQ(half_to_float(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(half_to_float(0x8000), -0.0f);
  EXPECT_TRUE(std::signbit(half_to_float(0x8000)));
  EXPECT_EQ(half_to_float(0x7c00), INFINITY);
  EXPECT_TRUE(std::isnan(half_to_float(0x7e00)));
  EXPECT_EQ(bfloat16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bfloat16_to_float(0xc0a0), -5.0f);
  // Every half against the format's definition, evaluated in double.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const int sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
    const float got = half_to_float(static_cast<uint16_t>(bits));
    if (exponent == 0x1f) {
      EXPECT_TRUE(mantissa ? std::isnan(got) : std::isinf(got)) << bits;
      continue;
    }
    const double magnitude = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
    ASSERT_EQ(got, static_cast<float>(sign ? -magnitude : magnitude)) << bits;
    ASSERT_EQ(std::signbit(got), sign == 1) << bits;
  }
}

TEST(Safetensors, WriteThenReadGivesTheSameValues) {
  testing::TempDir dir("keel-safetensors");
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 1e-30f};
  const std::vector<float> b = {42.0f};
  write_safetensors(dir / "x.safetensors", {{"a", {2, 3}, a}, {"b", {}, b}}, {{"format", "pt"}});
  const SafetensorsFile f(dir / "x.safetensors");
  EXPECT_EQ(f.header().data_offset % 8, 0u);
  EXPECT_EQ(f.read_float32(*f.header().find("a")), a);
  EXPECT_EQ(f.read_float32(*f.header().find("b")), b);
  EXPECT_EQ(f.header().find("a")->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.header().metadata.at("format"), "pt");
}

// --- models saved by transformers ---------------------------------------------------------------

std::string fixture(const std::string& name) { return testing::source_path("tests/reference/hf/" + name); }

struct Imported {
  ModelConfig config;
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<GPT> model;
};

Imported import_fixture(const std::string& dir) {
  Imported m;
  m.config = read_hf_model_config(dir);
  m.store = std::make_unique<ChunkStore>(4096);
  m.model = std::make_unique<GPT>(m.config, *m.store);
  m.store->finalize();
  import_hf(dir, *m.store, m.config);
  return m;
}

std::vector<float> params(const ChunkStore& store) {
  const std::span<const float> p = store.range_view(Plane::param, 0, store.numel());
  return {p.begin(), p.end()};
}

class HfModel : public ::testing::TestWithParam<const char*> {};

TEST_P(HfModel, LogitsAndLossEqualTransformers) {
  const std::string name = GetParam();
  Imported m = import_fixture(fixture(name));
  const json want = json::parse(read_text_file(fixture("expected.json"))).at(name);
  const int B = want.at("B"), T = want.at("T");
  const std::vector<int> inputs = want.at("inputs"), targets = want.at("targets");
  const std::vector<double> logits = want.at("logits");
  m.model->allocate(B, T);
  const float loss = m.model->forward(Batch{inputs.data(), targets.data(), B, T, 0.0f});
  EXPECT_NEAR(loss, want.at("loss").get<double>(), 1e-5);
  const float* got = m.model->logits();
  const int V = m.config.vocab_size, Vp = m.config.padded_vocab_size;
  double worst = 0;
  for (int i = 0; i < B * T; ++i) {
    for (int v = 0; v < V; ++v) worst = std::max(worst, std::abs(got[i * Vp + v] - logits[i * V + v]));
  }
  EXPECT_LT(worst, 1e-5) << name;
}

TEST_P(HfModel, ExportThenImportIsBitExact) {
  const std::string name = GetParam();
  const Imported m = import_fixture(fixture(name));
  testing::TempDir dir("keel-hf-export");
  export_hf(dir / "out", *m.store, m.config);
  const Imported again = import_fixture(dir / "out");
  EXPECT_EQ(again.config.n_kv_head, m.config.n_kv_head);
  EXPECT_EQ(again.config.rope_theta, m.config.rope_theta);
  EXPECT_EQ(again.config.tie_embeddings, m.config.tie_embeddings);
  EXPECT_EQ(again.config.max_seq_len, m.config.max_seq_len);
  const std::vector<float> a = params(*m.store), b = params(*again.store);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  // The exported tensors are the original file's, value for value (the permutations undone).
  const SafetensorsCheckpoint original(fixture(name)), exported(dir / "out");
  ASSERT_EQ(original.names(), exported.names());
  for (const std::string& t : original.names()) {
    const auto x = original.find(t), y = exported.find(t);
    EXPECT_EQ(x.tensor->shape, y.tensor->shape) << t;
    EXPECT_EQ(x.file->read_float32(*x.tensor), y.file->read_float32(*y.tensor)) << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfModel, ::testing::Values("gpt2", "llama"));


// The F16 and BF16 files hold the F32 weights rounded (to nearest even): imported, each weight is
// its F32 original rounded the same way.
TEST(HfModelDtypes, HalfAndBfloat16FilesImportAsTheRoundedWeights) {
  const struct {
    const char* f32;
    const char* narrow;
    float (*round)(float);
  } cases[] = {
      {"gpt2", "gpt2_f16", [](float x) {
         // To the nearest half (ties to even: nearbyint's default mode), spacing 2^(e - 10), subnormal below 2^-14.
         if (x == 0.0f) return x;
         int exponent = 0;
         std::frexp(x, &exponent);  // |x| in [2^(exponent - 1), 2^exponent)
         const int e = std::max(exponent - 1, -14);
         const double step = std::ldexp(1.0, e - 10);
         return static_cast<float>(std::nearbyint(x / step) * step);
       }},
      {"llama", "llama_bf16", [](float x) {
         const uint32_t u = std::bit_cast<uint32_t>(x);
         return std::bit_cast<float>((u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u);
       }},
  };
  for (const auto& c : cases) {
    const Imported wide = import_fixture(fixture(c.f32)), narrow = import_fixture(fixture(c.narrow));
    const std::vector<float> a = params(*wide.store), b = params(*narrow.store);
    ASSERT_EQ(a.size(), b.size());
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += c.round(a[i]) != b[i];
    EXPECT_EQ(differ, 0u) << c.narrow;
  }
}

// --- the CLI with bad directories ----------------------------------------------------------------

// Copies a fixture into `dir`/name (writable) and returns its path.
std::string copy_fixture(const testing::TempDir& dir, const std::string& name) {
  const std::string to = dir / name;
  fs::copy(fixture(name), to, fs::copy_options::recursive);
  for (const auto& e : fs::directory_iterator(to)) fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  return to;
}

// Rewrites the header of `path` (a safetensors file) through `edit`, keeping the data section.
void edit_header(const std::string& path, const std::function<void(json&)>& edit) {
  const std::vector<char> bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  json h = json::parse(std::string(bytes.data() + 8, n));
  edit(h);
  const std::string text = h.dump();
  const uint64_t m = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&m), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.write(bytes.data() + 8 + n, static_cast<std::streamsize>(bytes.size() - 8 - n));
}

TEST(HfCli, ImportsEvaluatesAndExports) {
  testing::TempDir dir("keel-hf-cli");
  const testing::CommandResult imported = testing::run_keel("import --hf " + fixture("llama") + " --out " + (dir / "ckpt"));
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  const testing::CommandResult exported = testing::run_keel("export --checkpoint " + (dir / "ckpt") + " --hf " + (dir / "back"));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const SafetensorsCheckpoint original(fixture("llama")), back(dir / "back");
  for (const std::string& t : original.names()) {
    const auto x = original.find(t), y = back.find(t);
    ASSERT_NE(y.tensor, nullptr) << t;
    EXPECT_EQ(x.file->read_float32(*x.tensor), y.file->read_float32(*y.tensor)) << t;
  }
}

TEST(HfCli, BadDirectoriesAreRefusedInOneLineNamingFileAndField) {
  testing::TempDir dir("keel-hf-bad");
  struct Case {
    std::string fixture, expected;
    std::function<void(const std::string&)> damage;
  };
  const std::vector<Case> cases = {
      {"gpt2", "model.safetensors: header length",
       [](const std::string& d) { fs::resize_file(d + "/model.safetensors", 100); }},
      {"gpt2", "field data_offsets", [](const std::string& d) {
         edit_header(d + "/model.safetensors", [](json& h) { h["transformer.ln_f.bias"]["data_offsets"][1] = 1u << 30; });
       }},
      {"gpt2", "overlapping tensors", [](const std::string& d) {
         edit_header(d + "/model.safetensors", [](json& h) {  // 4 bytes into the tensor before it
           json& offsets = h["transformer.ln_f.bias"]["data_offsets"];
           offsets = {offsets[0].get<uint64_t>() - 4, offsets[1].get<uint64_t>() - 4};
         });
       }},
      {"gpt2", "field dtype: expected one of", [](const std::string& d) {
         edit_header(d + "/model.safetensors", [](json& h) { h["transformer.ln_f.bias"]["dtype"] = "F24"; });
       }},
      {"gpt2", "field dtype: expected F32, BF16 or F16, found I32", [](const std::string& d) {
         edit_header(d + "/model.safetensors", [](json& h) { h["transformer.ln_f.bias"]["dtype"] = "I32"; });
       }},
      {"llama", "tensor \"model.norm.weight\": field shape: expected [32] (from config.json), found [4, 8]",
       [](const std::string& d) {
         const json index = json::parse(read_text_file(d + "/model.safetensors.index.json"));
         const std::string file = index["weight_map"]["model.norm.weight"];
         edit_header(d + "/" + file, [](json& h) { h["model.norm.weight"]["shape"] = {4, 8}; });
       }},
      {"llama", "config.json: field architectures: expected GPT2LMHeadModel or LlamaForCausalLM, found MistralForCausalLM",
       [](const std::string& d) {
         json c = json::parse(read_text_file(d + "/config.json"));
         c["architectures"] = {"MistralForCausalLM"};
         testing::write_text(d + "/config.json", c.dump());
       }},
      {"llama", "config.json: field rms_norm_eps: expected 1e-05", [](const std::string& d) {
         json c = json::parse(read_text_file(d + "/config.json"));
         c["rms_norm_eps"] = 1e-6;
         testing::write_text(d + "/config.json", c.dump());
       }},
      {"llama", "model.safetensors.index.json: field weight_map.lm_head.weight: tensor not found", [](const std::string& d) {
         json c = json::parse(read_text_file(d + "/model.safetensors.index.json"));
         c["weight_map"]["lm_head.weight"] = c["weight_map"]["model.embed_tokens.weight"];  // (another shard)
         testing::write_text(d + "/model.safetensors.index.json", c.dump());
       }},
      {"gpt2", "tensor \"transformer.h.0.attn.c_attn.extra\" is not part of the model", [](const std::string& d) {
         // A tensor the architecture does not have (an empty one: the data section stays covered).
         edit_header(d + "/model.safetensors", [](json& h) {
           h["transformer.h.0.attn.c_attn.extra"] = h["transformer.h.0.attn.c_attn.bias"];
           h["transformer.h.0.attn.c_attn.extra"]["shape"] = {0};
           h["transformer.h.0.attn.c_attn.extra"]["data_offsets"] = {0, 0};
         });
       }},
  };
  int i = 0;
  for (const Case& c : cases) {
    testing::TempDir one("keel-hf-bad-case");
    const std::string d = copy_fixture(one, c.fixture);
    c.damage(d);
    const std::string out = dir / ("out" + std::to_string(i++));
    const testing::CommandResult r = testing::run_keel("import --hf " + d + " --out " + out);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in: " << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
    EXPECT_FALSE(fs::exists(out)) << c.expected;
  }
}

// Rope scaling as transformers 5 writes it (rope_parameters), "llama3" (per-frequency) and "linear":
// Keel's logits over 32 positions (past llama3's original_max_position_embeddings of 16) equal
// transformers'; without the scaling they would not.
class HfRope : public ::testing::TestWithParam<const char*> {};

double worst_logit_error(Imported& m, const json& want) {
  const int B = want.at("B"), T = want.at("T");
  const std::vector<int> inputs = want.at("inputs"), targets = want.at("targets");
  const std::vector<double> logits = want.at("logits");
  m.model->allocate(B, T);
  m.model->forward(Batch{inputs.data(), targets.data(), B, T, 0.0f});
  const float* got = m.model->logits();
  const int V = m.config.vocab_size, Vp = m.config.padded_vocab_size;
  double worst = 0;
  for (int i = 0; i < B * T; ++i) {
    for (int v = 0; v < V; ++v) worst = std::max(worst, std::abs(got[i * Vp + v] - logits[i * V + v]));
  }
  return worst;
}

TEST_P(HfRope, LogitsEqualTransformers) {
  const std::string name = GetParam();
  const json want = json::parse(read_text_file(fixture("rope_expected.json"))).at(name);
  Imported m = import_fixture(fixture(name));
  EXPECT_EQ(m.config.rope_scaling, name == "llama_rope_llama3" ? RopeScaling::llama3 : RopeScaling::linear);
  EXPECT_LT(worst_logit_error(m, want), 1e-5) << name;
  // The same weights with plain RoPE: far off.
  testing::TempDir dir("keel-hf-rope");
  const std::string plain = copy_fixture(dir, name);
  json c = json::parse(read_text_file(plain + "/config.json"));
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c["rope_parameters"]["rope_theta"]}};
  testing::write_text(plain + "/config.json", c.dump());
  Imported p = import_fixture(plain);
  EXPECT_EQ(p.config.rope_scaling, RopeScaling::none);
  EXPECT_GT(worst_logit_error(p, want), 1e-2) << name;
}

// Older files: rope_scaling ({"type": ...} or {"rope_type": ...}) beside rope_theta read the same.
TEST_P(HfRope, OlderRopeScalingKeyReadsTheSame) {
  const std::string name = GetParam();
  const ModelConfig want = read_hf_model_config(fixture(name));
  for (const char* type_key : {"type", "rope_type"}) {
    testing::TempDir dir("keel-hf-rope-old");
    const std::string d = copy_fixture(dir, name);
    json c = json::parse(read_text_file(d + "/config.json"));
    json rs = c["rope_parameters"];
    c["rope_theta"] = rs["rope_theta"];
    rs.erase("rope_theta");
    rs.erase("rope_type");
    rs[type_key] = name == "llama_rope_llama3" ? "llama3" : "linear";
    c.erase("rope_parameters");
    c["rope_scaling"] = rs;
    testing::write_text(d + "/config.json", c.dump());
    const ModelConfig got = read_hf_model_config(d);
    EXPECT_EQ(got.rope_scaling, want.rope_scaling) << type_key;
    EXPECT_EQ(got.rope_factor, want.rope_factor) << type_key;
    EXPECT_EQ(got.rope_theta, want.rope_theta) << type_key;
    EXPECT_EQ(got.rope_frequencies(), want.rope_frequencies()) << type_key;
  }
}

// Export writes rope_parameters back: the directory imports to the same model, bit for bit.
TEST_P(HfRope, ExportThenImportKeepsTheScaling) {
  const std::string name = GetParam();
  const Imported m = import_fixture(fixture(name));
  testing::TempDir dir("keel-hf-rope-export");
  export_hf(dir / "out", *m.store, m.config);
  const json c = json::parse(read_text_file(dir / "out/config.json"));
  EXPECT_EQ(c.at("rope_parameters").at("rope_type"), name == "llama_rope_llama3" ? "llama3" : "linear");
  const Imported again = import_fixture(dir / "out");
  EXPECT_EQ(again.config.rope_frequencies(), m.config.rope_frequencies());
  EXPECT_EQ(again.config.rope_scaling, m.config.rope_scaling);
  EXPECT_EQ(again.config.rope_factor, m.config.rope_factor);
  const std::vector<float> a = params(*m.store), b = params(*again.store);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(Scaling, HfRope, ::testing::Values("llama_rope_llama3", "llama_rope_linear"));

TEST(HfRopeBad, UnsupportedRopeTypesAreRefusedNamingTheField) {
  testing::TempDir dir("keel-hf-rope-bad");
  const std::string d = copy_fixture(dir, "llama_rope_llama3");
  const json good = json::parse(read_text_file(d + "/config.json"));
  const struct {
    std::function<void(json&)> damage;
    std::string expected;
  } cases[] = {
      {[](json& c) { c["rope_parameters"]["rope_type"] = "yarn"; },
       "field rope_parameters.rope_type: expected \"default\", \"linear\" or \"llama3\", found \"yarn\""},
      {[](json& c) { c["rope_parameters"].erase("low_freq_factor"); }, "field rope_parameters.low_freq_factor: expected a number"},
      {[](json& c) { c["rope_parameters"]["factor"] = 0.5; }, "field rope_parameters.factor: expected >= 1"},
      {[](json& c) { c["rope_parameters"]["attention_factor"] = 2.0; }, "field rope_parameters.attention_factor: expected 1"},
      {[](json& c) {
         c.erase("rope_parameters");
         c["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
       },
       "field rope_scaling.rope_type: expected \"default\", \"linear\" or \"llama3\", found \"dynamic\""},
  };
  for (const auto& c : cases) {
    json j = good;
    c.damage(j);
    testing::write_text(d + "/config.json", j.dump());
    const std::string e = testing::error_of([&] { read_hf_model_config(d); });
    EXPECT_NE(e.find(c.expected), std::string::npos) << "expected '" << c.expected << "', got: " << e;
    EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  }
}

// --- tokenizer.json --------------------------------------------------------------------------------

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

class HfTokenizerShapes : public ::testing::TestWithParam<const char*> {};

TEST_P(HfTokenizerShapes, IdsEqualTheTokenizersLibrary) {
  const std::string name = GetParam();
  const HfTokenizer tok = HfTokenizer::load(fixture("tokenizers/" + name + ".json"));
  const json want = json::parse(read_text_file(fixture("tokenizers/expected.json")));
  const json& ids = want.at("ids").at(name);
  for (const auto& [licence, sha] : want.at("licences").items()) {
    const std::string text = read_text_file("/usr/share/common-licenses/" + licence);
    EXPECT_EQ(tok.encode(text), ids.at(licence).get<std::vector<int>>())
        << name << " on " << licence << " (expected.json was made from the file of sha256 " << sha << ")";
  }
  const std::vector<std::string> hostile = want.at("hostile");
  for (size_t i = 0; i < hostile.size(); ++i) {
    EXPECT_EQ(tok.encode(from_hex(hostile[i])), ids.at("hostile/" + std::to_string(i)).get<std::vector<int>>())
        << name << " on hostile text " << i;
  }
  EXPECT_EQ(tok.document_token(), ids.at("document_token")[0].get<int>());
}

TEST_P(HfTokenizerShapes, DecodeGivesTheTextBack) {
  const std::string name = GetParam();
  const HfTokenizer tok = HfTokenizer::load(fixture("tokenizers/" + name + ".json"));
  const json want = json::parse(read_text_file(fixture("tokenizers/expected.json")));
  std::vector<std::string> texts = {read_text_file("/usr/share/common-licenses/GPL-3")};
  const std::vector<std::string> hostile = want.at("hostile");
  for (size_t i = 0; i < hostile.size(); ++i) {
    if (i != 8) texts.push_back(utf8_replace_invalid(from_hex(hostile[i])));  // (8 holds special tokens' text)
  }
  for (const std::string& text : texts) EXPECT_EQ(tok.decode(tok.encode(text)), text) << name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, HfTokenizerShapes, ::testing::Values("gpt2", "llama3", "llama2"));

// The features newer tokenizer.json files use (tests/reference/hf/tokenizers/features/: the
// Metaspace pre-tokenizer's prepend schemes and split, ByteLevel's add_prefix_space, added tokens'
// lstrip, rstrip, single_word and normalized): the library's ids and its decoding of them.
class HfTokenizerFeatures : public ::testing::TestWithParam<const char*> {};

TEST_P(HfTokenizerFeatures, IdsAndDecodingEqualTheTokenizersLibrary) {
  const std::string name = GetParam();
  const HfTokenizer tok = HfTokenizer::load(fixture("tokenizers/features/" + name + ".json"));
  const json want = json::parse(read_text_file(fixture("tokenizers/features_expected.json")));
  const json& ids = want.at("ids").at(name);
  for (const auto& [licence, sha] : want.at("licences").items()) {
    const std::string text = read_text_file("/usr/share/common-licenses/" + licence);
    EXPECT_EQ(tok.encode(text), ids.at(licence).get<std::vector<int>>())
        << name << " on " << licence << " (features_expected.json was made from the file of sha256 " << sha << ")";
  }
  const std::vector<std::string> hostile = want.at("hostile");
  for (size_t i = 0; i < hostile.size(); ++i) {
    const std::string key = "hostile/" + std::to_string(i);
    const std::vector<int> got = tok.encode(from_hex(hostile[i]));
    EXPECT_EQ(got, ids.at(key).get<std::vector<int>>()) << name << " on hostile text " << i;
    EXPECT_EQ(tok.decode(ids.at(key).get<std::vector<int>>()), want.at("decoded").at(name).at(key).get<std::string>())
        << name << " decoding hostile text " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Features, HfTokenizerFeatures,
                         ::testing::Values("metaspace_first", "metaspace_always_split", "metaspace_never_split",
                                           "gpt2_prefix_space", "added_options", "added_normalized"));

// The fuzz target's inputs (its seed corpus and the inputs that once failed) through the reader as
// fuzz_hf_tokenizer runs them: read or refused with a keel::Error, ids inside the vocabulary.
TEST(HfTokenizer, FuzzInputsAreReadOrRefusedCleanly) {
  int files = 0;
  for (const std::string dir : {"fuzz/corpus/fuzz_hf_tokenizer", "fuzz/regressions/fuzz_hf_tokenizer",
                                "tests/reference/hf/tokenizers/features"}) {
    for (const auto& entry : fs::directory_iterator(testing::source_path(dir))) {
      ++files;
      const std::string text = read_text_file(entry.path().string());
      try {
        const HfTokenizer t = HfTokenizer::parse(text, "fuzz");
        for (const char* s : {"Hello, world! It's 42.", "\xff\xfe \xe2\x82 caf\xc3\xa9 \xf0\x9f\x98\x80", "  \n\t<s>x"}) {
          const std::vector<int> ids = t.encode(s);
          for (int id : ids) EXPECT_TRUE(id >= 0 && id < t.vocab_size()) << entry.path() << ": id " << id;
          t.decode(ids);
        }
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << entry.path();
      }
    }
  }
  EXPECT_GE(files, 10);
}

TEST(HfTokenizer, InvalidUtf8IsReplacedAsPythonReplacesIt) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_replace_invalid("caf\xC3\xA9 \xF0\x9F\x98\x80"), "caf\xC3\xA9 \xF0\x9F\x98\x80");
  EXPECT_EQ(utf8_replace_invalid("a\xFF" "b"), "a" + r + "b");
  EXPECT_EQ(utf8_replace_invalid("\xE2\x82 x"), r + " x");           // a truncated sequence: one
  EXPECT_EQ(utf8_replace_invalid("\xED\xA0\x80"), r + r + r);        // a surrogate: each byte
  EXPECT_EQ(utf8_replace_invalid("\xC0\xAF"), r + r);                // an overlong form: each byte
  EXPECT_EQ(utf8_replace_invalid("\xF0\x9F\x98"), r);                // cut at the end
  EXPECT_EQ(utf8_replace_invalid("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
}

TEST(HfTokenizer, UnsupportedFilesAreRefusedInOneLineNamingTheField) {
  testing::TempDir dir("keel-hf-tok");
  const json good = json::parse(read_text_file(fixture("tokenizers/gpt2.json")));
  const struct {
    std::function<void(json&)> damage;
    std::string expected;
  } cases[] = {
      {[](json& j) { j["model"]["type"] = "WordPiece"; }, "field model.type: expected \"BPE\", found \"WordPiece\""},
      {[](json& j) { j["model"]["dropout"] = 0.1; }, "field model.dropout: expected null"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; },
       "field pre_tokenizer.type: expected Sequence, Split, ByteLevel or Metaspace"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "sometimes"}}; },
       "field pre_tokenizer.prepend_scheme: expected always, first or never"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "ab"}}; },
       "field pre_tokenizer.replacement: expected one character"},
      {[](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, "field normalizer.type"},
      {[](json& j) { j["added_tokens"][0]["lstrip"] = "yes"; }, "field added_tokens[0].lstrip: expected true or false"},
      {[](json& j) { j["model"]["merges"][0] = {"Ġ", "not-a-token"}; }, "field model.merges[0]"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}}; },
       "field pre_tokenizer.pattern: pattern \"(unclosed\" does not compile"},
      {[](json& j) { j.erase("model"); }, "field model: expected the tokenizer's model"},
  };
  int i = 0;
  for (const auto& c : cases) {
    json j = good;
    c.damage(j);
    const std::string path = dir / ("t" + std::to_string(i++) + ".json");
    testing::write_text(path, j.dump());
    const std::string e = testing::error_of([&] { HfTokenizer::load(path); });
    EXPECT_NE(e.find(c.expected), std::string::npos) << "expected '" << c.expected << "', got: " << e;
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // The CLI: exit 2, one line, no shard written.
  testing::write_text(dir / "doc.txt", "some text\n%\nmore text\n");
  const testing::CommandResult r =
      testing::run_keel("tokenize --tokenizer " + (dir / "t0.json") + " --input " + (dir / "doc.txt") + " --out " + (dir / "out"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out/train.bin"));
}

TEST(HfTokenizer, TokenizeWritesShardsOfTheTokenizersIds) {
  testing::TempDir dir("keel-hf-tokenize");
  const std::string licences = "/usr/share/common-licenses/";
  const testing::CommandResult r = testing::run_keel("tokenize --tokenizer " + fixture("tokenizers/llama2.json") + " --input " +
                                                     licences + "GPL-3 --input " + licences + "MPL-2.0 --out " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const HfTokenizer tok = HfTokenizer::load(fixture("tokenizers/llama2.json"));
  std::vector<uint32_t> all = read_tokens(dir / "train.bin");
  const std::vector<uint32_t> val = read_tokens(dir / "val.bin");
  all.insert(all.end(), val.begin(), val.end());
  // One document per file (not fortune format), each [<s>, ids...], in one split or the other.
  for (const std::string f : {"GPL-3", "MPL-2.0"}) {
    std::vector<uint32_t> doc = {static_cast<uint32_t>(tok.document_token())};
    for (int id : tok.encode(read_text_file(licences + f))) doc.push_back(static_cast<uint32_t>(id));
    EXPECT_NE(std::search(all.begin(), all.end(), doc.begin(), doc.end()), all.end()) << f;
  }
  EXPECT_EQ(all.size(), 2 + tok.encode(read_text_file(licences + "GPL-3")).size() +
                            tok.encode(read_text_file(licences + "MPL-2.0")).size());
}

// --- uint32 token shards and a Llama 3-sized vocabulary --------------------------------------------

TEST(TokenShards, Uint32ShardsRoundTripAndTheWidthFollowsTheVocabulary) {
  testing::TempDir dir("keel-shard32");
  const std::vector<uint32_t> tokens = {0, 1, 65535, 65536, 128255, 7};
  write_tokens(dir / "wide.bin", tokens, 128256);
  EXPECT_EQ(fs::file_size(dir / "wide.bin"), 1024 + 4 * tokens.size());
  EXPECT_EQ(read_tokens(dir / "wide.bin"), tokens);
  const std::vector<char> bytes = read_file(dir / "wide.bin");
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240801);  // llm.c's Llama 3 shards
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], 6);
  const std::vector<uint32_t> narrow = {0, 1, 65535, 9};
  write_tokens(dir / "narrow.bin", narrow, 65536);
  EXPECT_EQ(fs::file_size(dir / "narrow.bin"), 1024 + 2 * narrow.size());
  EXPECT_EQ(read_tokens(dir / "narrow.bin"), narrow);
  EXPECT_EQ(read_token_shard(dir / "narrow.bin"), (std::vector<uint16_t>{0, 1, 65535, 9}));
  // Refusals: a uint32 shard where uint16 is read, a token past the limit, one outside the vocabulary.
  std::string e = testing::error_of([&] { read_token_shard(dir / "wide.bin"); });
  EXPECT_NE(e.find("holds uint32 tokens (magic 20240801)"), std::string::npos) << e;
  e = testing::error_of([&] { read_tokens(dir / "wide.bin", 100000); });
  EXPECT_NE(e.find("expected tokens at most 100000, found 128255 at position 4"), std::string::npos) << e;
  e = testing::error_of([&] { write_tokens(dir / "bad.bin", {70000}, 65536); });
  EXPECT_NE(e.find("outside the vocabulary of 65536"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "bad.bin"));
  // Truncated by one token.
  std::ofstream(dir / "short.bin", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));
  e = testing::error_of([&] { read_tokens(dir / "short.bin"); });
  EXPECT_NE(e.find("(truncated)"), std::string::npos) << e;
}

TEST(TokenShards, Llama3PresetTrainsOnUint32Shards) {
  testing::TempDir dir("keel-llama3");
  // A toy language over ids above 65,536: the model must learn which follows which.
  std::vector<uint32_t> train, val;
  for (int i = 0; i < 6000; ++i) train.push_back(100000 + static_cast<uint32_t>((i * 7) % 13) * 2000);
  for (int i = 0; i < 1500; ++i) val.push_back(100000 + static_cast<uint32_t>((i * 7) % 13) * 2000);
  write_tokens(dir / "train.bin", train, 128256);
  write_tokens(dir / "val.bin", val, 128256);
  const testing::CommandResult r = testing::run_keel(
      "train --set model.preset=llama3-tiny --set train.seq_len=32 --set train.batch_size=4 --set train.steps=30 "
      "--set optim.lr=3e-3 --set optim.warmup_steps=2 --set train.eval_every=0 --set train.eval_batches=2 "
      "--set train.sample_tokens=0 --set data.tokenizer= --set data.train=" + (dir / "train.bin") +
      " --set data.val=" + (dir / "val.bin") + " --set train.run_dir=" + (dir / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<nlohmann::json> evals = [&] {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir / "run/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line);
      if (j.contains("val_loss")) out.push_back(j);
    }
    return out;
  }();
  ASSERT_GE(evals.size(), 2u);
  const Config saved = [&] {
    Config c;
    c.model.preset = "llama3-tiny";
    c.resolve(1);
    return c;
  }();
  EXPECT_EQ(saved.model.vocab_size, 128256);
  EXPECT_EQ(saved.model.rope_theta, 500000.0);
  // From the uniform guess (ln 128256 = 11.76) to well below it.
  EXPECT_GT(evals.front()["val_loss"].get<double>(), 11.0);
  EXPECT_LT(evals.back()["val_loss"].get<double>(), 0.5 * evals.front()["val_loss"].get<double>());
}

// --- train.init = "hf:DIR" -----------------------------------------------------------------------

TEST(HfTrainInit, StartsFromTheCheckpointsWeights) {
  testing::TempDir dir("keel-hf-init");
  std::vector<uint32_t> tokens;
  for (int i = 0; i < 3000; ++i) tokens.push_back(static_cast<uint32_t>((i * 37) % 300));
  write_tokens(dir / "train.bin", tokens, 300);
  write_tokens(dir / "val.bin", tokens, 300);
  const std::string data = " --set data.tokenizer= --set data.train=" + (dir / "train.bin") + " --set data.val=" + (dir / "val.bin");
  const testing::CommandResult eval = testing::run_keel("eval --hf " + fixture("llama") + " --data " + (dir / "val.bin") +
                                                        " --batch 4 --seq 32 --batches 2");
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  const double want = json::parse(eval.output.substr(eval.output.find('{'))).at("loss").get<double>();
  const testing::CommandResult r = testing::run_keel(
      "train --set train.init=hf:" + fixture("llama") + " --set train.seq_len=32 --set train.batch_size=4 "
      "--set train.steps=1 --set train.eval_batches=2 --set train.sample_tokens=0 --set train.run_dir=" + (dir / "run") + data);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "run/metrics.jsonl");
  double first = NAN;
  for (std::string line; std::getline(in, line) && std::isnan(first);) {
    const json j = json::parse(line);
    if (j.contains("val_loss")) first = j["val_loss"].get<double>();
  }
  EXPECT_NEAR(first, want, 1e-5 * want);  // the step-0 evaluation is the HF model's
  // The directory's eos_token_id (config.json: 2) ends the run's generated text, kept in its checkpoints.
  EXPECT_EQ(read_checkpoint_config(dir / "run/ckpt").generate.stop_tokens, "2");
  // A model key set against the checkpoint's config.json: one line.
  const testing::CommandResult bad = testing::run_keel("train --set train.init=hf:" + fixture("llama") +
                                                       " --set model.n_layer=3 --set train.run_dir=" + (dir / "run2") + data);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("model.n_layer = 3 disagrees with train.init = hf:"), std::string::npos) << bad.output;
  EXPECT_EQ(testing::count_lines(bad.output), 1) << bad.output;
}

}  // namespace
}  // namespace keel

// --- generate and score through a model's own tokenizer.json -------------------------------------

namespace keel {
namespace {

// llama_text/ is the llama fixture with a 300-token tokenizer.json of Llama 2's shape; what
// transformers and tokenizers gave through it is llama_text_expected.json.
json text_expected() { return json::parse(read_text_file(fixture("llama_text_expected.json"))); }

// The first JSON object line of a command's output.
json first_json_line(const std::string& output) {
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '{') return json::parse(line);
  }
  return json();
}

TEST(HfText, ScoreReadsTheDirectorysTokenizer) {
  testing::TempDir dir("keel-hf-score");
  const json want = text_expected();
  const std::string licence = "/usr/share/common-licenses/GPL-3";
  fs::create_directories(dir / "docs");
  fs::copy_file(licence, dir / "docs/GPL-3");
  // --hf DIR takes DIR/tokenizer.json; an imported checkpoint keeps it as data.tokenizer.
  ASSERT_EQ(testing::run_keel("import --hf " + fixture("llama_text") + " --out " + (dir / "ckpt")).exit_code, 0);
  for (const std::string& model : {"--hf " + fixture("llama_text"), "--checkpoint " + (dir / "ckpt")}) {
    const testing::CommandResult r = testing::run_keel("score " + model + " --documents " + (dir / "docs"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json doc = first_json_line(r.output);
    EXPECT_EQ(doc.at("tokens").get<int64_t>(), want.at("tokens").get<int64_t>()) << model;
    EXPECT_NEAR(doc.at("loss").get<double>(), want.at("loss").get<double>(), 1e-5) << model;
  }
}

TEST(HfText, GreedyGenerationDecodesWithTheTokenizer) {
  testing::TempDir dir("keel-hf-generate");
  const json want = text_expected();
  {
    std::ofstream(dir / "prompts.txt") << want.at("prompt").get<std::string>() << "\n";
  }
  const std::string common = " --prompts " + (dir / "prompts.txt") + " --temperature 0 --tokens " +
                             "24";
  // Explicitly, and picked up from --hf DIR.
  for (const std::string& model : {"--hf " + fixture("llama") + " --tokenizer " + fixture("llama_text/tokenizer.json"),
                                  "--hf " + fixture("llama_text")}) {
    const testing::CommandResult r = testing::run_keel("generate " + model + common);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json out = first_json_line(r.output);
    EXPECT_EQ(out.at("text").get<std::string>(), want.at("text").get<std::string>()) << model;
  }
  // A tokenizer larger than the model's vocabulary: one line naming it.
  const testing::CommandResult big =
      testing::run_keel("generate --hf " + fixture("llama") + " --tokenizer " + fixture("tokenizers/llama2.json") + common);
  EXPECT_EQ(big.exit_code, 2) << big.output;
  EXPECT_NE(big.output.find("tokenizers/llama2.json: vocabulary 959 exceeds the model's 300"), std::string::npos) << big.output;
}

// Generation ends at the model's eos_token_id as transformers finds it: generation_config.json,
// else config.json, else tokenizer_config.json's eos_token; `keel import` records it
// (generate.stop_tokens), export writes it back. The fixture's greedy continuation is
// llama_text_expected.json's; the eos is made one of its first tokens.
TEST(HfText, GenerationStopsAtTheModelsEosToken) {
  testing::TempDir dir("keel-hf-eos");
  const json want = text_expected();
  const std::vector<int> seq = want.at("generated");
  const HfTokenizer tok = HfTokenizer::load(fixture("llama_text/tokenizer.json"));
  const int prompt_tokens = 1 + static_cast<int>(tok.encode(want.at("prompt").get<std::string>()).size());
  {
    std::ofstream(dir / "prompts.txt") << want.at("prompt").get<std::string>() << "\n";
  }
  const std::string common = " --prompts " + (dir / "prompts.txt") + " --temperature 0 --tokens 24";
  auto new_tokens = [&](const std::string& model) {
    const testing::CommandResult r = testing::run_keel("generate " + model + common);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const json out = first_json_line(r.output);
    if (out.is_null()) return -1;
    const int n = out.at("new_tokens").get<int>();
    // The text is the greedy tokens up to and with the eos, decoded.
    EXPECT_EQ(out.at("text").get<std::string>(),
              tok.decode(std::vector<int>(seq.begin() + 1, seq.begin() + prompt_tokens + n)))
        << model;
    return n;
  };
  const int second = seq[prompt_tokens + 1], third = seq[prompt_tokens + 2];
  const std::string d = copy_fixture(dir, "llama_text");
  json config = json::parse(read_text_file(d + "/config.json"));
  config["eos_token_id"] = second;
  testing::write_text(d + "/config.json", config.dump());
  EXPECT_EQ(new_tokens("--hf " + d), 2);  // config.json
  testing::write_text(d + "/generation_config.json", json{{"eos_token_id", {third, 299}}}.dump());
  EXPECT_EQ(new_tokens("--hf " + d), 3);  // generation_config.json first
  // Imported: recorded in the checkpoint; exported: config.json's eos_token_id.
  ASSERT_EQ(testing::run_keel("import --hf " + d + " --out " + (dir / "ckpt")).exit_code, 0);
  EXPECT_EQ(new_tokens("--checkpoint " + (dir / "ckpt")), 3);
  EXPECT_EQ(new_tokens("--checkpoint " + (dir / "ckpt") + " --set generate.stop_tokens=" + std::to_string(second)), 2);
  ASSERT_EQ(testing::run_keel("export --checkpoint " + (dir / "ckpt") + " --hf " + (dir / "back")).exit_code, 0);
  EXPECT_EQ(json::parse(read_text_file(dir / "back/config.json")).at("eos_token_id"), json({third, 299}));
  // Neither config names one: tokenizer_config.json's eos_token (its text) in tokenizer.json.
  fs::remove(d + "/generation_config.json");
  config.erase("eos_token_id");
  testing::write_text(d + "/config.json", config.dump());
  const json tj = json::parse(read_text_file(d + "/tokenizer.json"));
  std::string first_text;
  for (const auto& [text, id] : tj.at("model").at("vocab").items()) {
    if (id.get<int>() == seq[prompt_tokens]) first_text = text;
  }
  ASSERT_FALSE(first_text.empty());
  testing::write_text(d + "/tokenizer_config.json", json{{"eos_token", {{"content", first_text}}}}.dump());
  EXPECT_EQ(new_tokens("--hf " + d), 1);
  // None at all: the 24 tokens, as before.
  fs::remove(d + "/tokenizer_config.json");
  EXPECT_EQ(new_tokens("--hf " + d), 24);
  // A bad value: one line naming the file and field.
  testing::write_text(d + "/generation_config.json", R"({"eos_token_id": "two"})");
  const testing::CommandResult bad = testing::run_keel("generate --hf " + d + common);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("generation_config.json: field eos_token_id: expected token ids"), std::string::npos) << bad.output;
  EXPECT_EQ(testing::count_lines(bad.output), 1) << bad.output;
  const testing::CommandResult bad_key =
      testing::run_keel("generate --checkpoint " + (dir / "ckpt") + " --set generate.stop_tokens=2,x" + common);
  EXPECT_EQ(bad_key.exit_code, 2) << bad_key.output;
  EXPECT_NE(bad_key.output.find("generate.stop_tokens"), std::string::npos) << bad_key.output;
  EXPECT_EQ(testing::count_lines(bad_key.output), 1) << bad_key.output;
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

TEST(HfCli, ExportCutsShardsAboveMaxShardSizeAndImportReadsThemBitExact) {
  testing::TempDir dir("keel-hf-shards");
  ASSERT_EQ(testing::run_keel("import --hf " + fixture("llama") + " --out " + (dir / "ckpt")).exit_code, 0);
  // 20 KB: the llama fixture's 21 tensors (151,168 bytes of float32) in several shards, its 38,400-byte
  // embedding alone in one.
  const testing::CommandResult r =
      testing::run_keel("export --checkpoint " + (dir / "ckpt") + " --hf " + (dir / "back") + " --max-shard-size 20KB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(dir / "back/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "back/model.safetensors"));
  const json index = json::parse(read_text_file(dir / "back/model.safetensors.index.json"));
  std::set<std::string> files;
  for (const auto& [tensor, file] : index.at("weight_map").items()) files.insert(file.get<std::string>());
  EXPECT_GE(files.size(), 4u);
  uint64_t total = 0;
  for (const std::string& f : files) {
    const std::vector<char> bytes = read_file((dir / "back") + "/" + f);
    const SafetensorsHeader h = parse_safetensors({bytes.data(), bytes.size()}, f);
    uint64_t data = 0;
    for (const SafetensorsTensor& t : h.tensors) data += t.end - t.begin;
    EXPECT_TRUE(data <= 20000 || h.tensors.size() == 1) << f;  // over the limit only alone
    total += data;
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
  // Read back: the same tensors, bit for bit, and a one-file export replaces the shards' index.
  const SafetensorsCheckpoint original(fixture("llama")), back(dir / "back");
  EXPECT_EQ(original.names(), back.names());
  for (const std::string& t : original.names()) {
    const auto x = original.find(t), y = back.find(t);
    ASSERT_NE(y.tensor, nullptr) << t;
    EXPECT_EQ(x.file->read_float32(*x.tensor), y.file->read_float32(*y.tensor)) << t;
  }
  ASSERT_EQ(testing::run_keel("import --hf " + (dir / "back") + " --out " + (dir / "again")).exit_code, 0);
  ASSERT_EQ(testing::run_keel("export --checkpoint " + (dir / "again") + " --hf " + (dir / "back")).exit_code, 0);
  EXPECT_TRUE(fs::exists(dir / "back/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "back/model.safetensors.index.json"));
  const SafetensorsCheckpoint one(dir / "back");
  for (const std::string& t : original.names()) {
    const auto x = original.find(t), y = one.find(t);
    ASSERT_NE(y.tensor, nullptr) << t;
    EXPECT_EQ(x.file->read_float32(*x.tensor), y.file->read_float32(*y.tensor)) << t;
  }
  const testing::CommandResult bad =
      testing::run_keel("export --checkpoint " + (dir / "ckpt") + " --hf " + (dir / "x") + " --max-shard-size 5XB");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("option --max-shard-size: expected a size"), std::string::npos) << bad.output;
  EXPECT_EQ(testing::count_lines(bad.output), 1) << bad.output;
}

}  // namespace
}  // namespace keel
