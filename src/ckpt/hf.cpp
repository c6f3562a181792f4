#include "ckpt/hf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/safetensors.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr double kNormEps = 1e-5;  // Keel's LayerNorm and RMSNorm (kernels/cpu/ops.h)

// How an HF tensor's elements sit in (a row range of) a Keel tensor.
enum class Order {
  rows,        // the same rows, in order
  transposed,  // Conv1D: HF [in, out] is Keel's [out, in] transposed
  rotary,      // q_proj / k_proj: each head's rows permuted (the header's rule)
};

// One HF tensor: its name and shape, and where it lands: rows [row0, row0 + rows) of Keel tensor
// `keel` (whose rows are `cols` wide; a 1-D tensor is one row).
struct Piece {
  std::string hf;
  std::vector<int64_t> hf_shape;
  std::string keel;
  int64_t row0 = 0;
  Order order = Order::rows;
  int heads = 0;  // rotary: the heads the rows hold
  int64_t rows() const { return order == Order::transposed ? hf_shape[1] : (hf_shape.size() == 1 ? 1 : hf_shape[0]); }
  int64_t cols() const { return order == Order::transposed ? hf_shape[0] : hf_shape.back(); }
};

// The HF row (of a rows / rotary piece) that holds Keel row r of the piece.
int64_t hf_row(const Piece& p, int64_t r) {
  if (p.order != Order::rotary) return r;
  const int64_t hs = p.rows() / p.heads, h = r / hs, i = (r % hs) / 2, pair = r % 2;
  return h * hs + pair * (hs / 2) + i;
}

// Every HF tensor of the model, in the order export writes them.
std::vector<Piece> hf_layout(const ModelConfig& m, const std::string& gpt2_prefix = "transformer.") {
  const int64_t C = m.n_embd, V = m.vocab_size, L = m.n_layer;
  std::vector<Piece> out;
  if (!m.llama()) {
    const std::string& P = gpt2_prefix;
    out.push_back({P + "wte.weight", {V, C}, "wte"});
    out.push_back({P + "wpe.weight", {m.max_seq_len, C}, "wpe"});
    for (int64_t l = 0; l < L; ++l) {
      const std::string h = P + "h." + std::to_string(l) + ".", k = "h." + std::to_string(l) + ".";
      out.push_back({h + "ln_1.weight", {C}, k + "ln1.w"});
      out.push_back({h + "ln_1.bias", {C}, k + "ln1.b"});
      out.push_back({h + "attn.c_attn.weight", {C, 3 * C}, k + "attn.qkv.w", 0, Order::transposed});
      out.push_back({h + "attn.c_attn.bias", {3 * C}, k + "attn.qkv.b"});
      out.push_back({h + "attn.c_proj.weight", {C, C}, k + "attn.proj.w", 0, Order::transposed});
      out.push_back({h + "attn.c_proj.bias", {C}, k + "attn.proj.b"});
      out.push_back({h + "ln_2.weight", {C}, k + "ln2.w"});
      out.push_back({h + "ln_2.bias", {C}, k + "ln2.b"});
      out.push_back({h + "mlp.c_fc.weight", {C, 4 * C}, k + "mlp.fc.w", 0, Order::transposed});
      out.push_back({h + "mlp.c_fc.bias", {4 * C}, k + "mlp.fc.b"});
      out.push_back({h + "mlp.c_proj.weight", {4 * C, C}, k + "mlp.proj.w", 0, Order::transposed});
      out.push_back({h + "mlp.c_proj.bias", {C}, k + "mlp.proj.b"});
    }
    out.push_back({P + "ln_f.weight", {C}, "lnf.w"});
    out.push_back({P + "ln_f.bias", {C}, "lnf.b"});
    return out;
  }
  const int64_t kv = m.kv_dim(), H = m.ffn_hidden;
  out.push_back({"model.embed_tokens.weight", {V, C}, "wte"});
  for (int64_t l = 0; l < L; ++l) {
    const std::string h = "model.layers." + std::to_string(l) + ".", k = "h." + std::to_string(l) + ".";
    out.push_back({h + "input_layernorm.weight", {C}, k + "attn_norm.w"});
    out.push_back({h + "self_attn.q_proj.weight", {C, C}, k + "attn.qkv.w", 0, Order::rotary, m.n_head});
    out.push_back({h + "self_attn.k_proj.weight", {kv, C}, k + "attn.qkv.w", C, Order::rotary, m.n_kv_head});
    out.push_back({h + "self_attn.v_proj.weight", {kv, C}, k + "attn.qkv.w", C + kv});
    out.push_back({h + "self_attn.o_proj.weight", {C, C}, k + "attn.proj.w"});
    out.push_back({h + "post_attention_layernorm.weight", {C}, k + "mlp_norm.w"});
    out.push_back({h + "mlp.gate_proj.weight", {H, C}, k + "mlp.gate_up.w", 0});
    out.push_back({h + "mlp.up_proj.weight", {H, C}, k + "mlp.gate_up.w", H});
    out.push_back({h + "mlp.down_proj.weight", {C, H}, k + "mlp.proj.w"});
  }
  out.push_back({"model.norm.weight", {C}, "norm.w"});
  if (!m.tie_embeddings.value_or(false)) out.push_back({"lm_head.weight", {V, C}, "lm_head.w"});
  return out;
}

// HF tensors a checkpoint may carry that hold no weights of their own: attention-mask and rotary
// buffers older versions saved, and a tied head saved beside the embedding (checked equal to it).
bool is_buffer(const std::string& name) {
  auto ends_with = [&](const std::string& s) { return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0; };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") || ends_with("rotary_emb.inv_freq");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The store's id of tensor `name`, or -1 when this store (a pipeline stage) does not hold it.
int find_tensor(const ChunkStore& store, const std::string& name) {
  for (size_t i = 0; i < store.tensors().size(); ++i) {
    if (store.tensors()[i].spec.name == name) return static_cast<int>(i);
  }
  return -1;
}

std::string where_config(const std::string& dir) { return "hf checkpoint " + (fs::path(dir) / "config.json").string(); }

}  // namespace

ModelConfig read_hf_model_config(const std::string& dir) {
  const std::string where = where_config(dir);
  check(fs::is_directory(dir), "hf checkpoint " + dir + ": expected a directory (config.json, model.safetensors)");
  json j;
  try {
    j = json::parse(read_text_file((fs::path(dir) / "config.json").string()));
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw Error(where + ": not valid JSON: " + what);
  }
  check(j.is_object(), where + ": expected a JSON object");
  auto field = [&](const char* key) -> const json& {
    check(j.contains(key) && !j[key].is_null(), where + ": field " + key + ": expected a value, found none");
    return j[key];
  };
  auto integer = [&](const char* key) {
    const json& v = field(key);
    check(v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= (int64_t{1} << 30),
          where + ": field " + key + ": expected a positive integer, found " + v.dump());
    return static_cast<int>(v.get<int64_t>());
  };
  auto number = [&](const json& v, const std::string& key) {
    check(v.is_number(), where + ": field " + key + ": expected a number, found " + v.dump());
    return v.get<double>();
  };
  auto expect = [&](const char* key, const json& want, bool absent_ok) {
    if (!j.contains(key) || j[key].is_null()) {
      check(absent_ok, where + ": field " + key + ": expected " + want.dump() + ", found none");
      return;
    }
    const bool same = want.is_number() ? j[key].is_number() && j[key].get<double>() == want.get<double>() : j[key] == want;
    check(same, where + ": field " + key + ": expected " + want.dump() + " (what Keel computes), found " + j[key].dump());
  };
  std::string arch;
  if (j.contains("architectures")) {
    const json& a = j["architectures"];
    check(a.is_array() && a.size() == 1 && a[0].is_string(),
          where + ": field architectures: expected [\"GPT2LMHeadModel\"] or [\"LlamaForCausalLM\"], found " + a.dump());
    arch = a[0].get<std::string>();
  } else {
    const json& t = field("model_type");
    arch = t == "gpt2" ? "GPT2LMHeadModel" : t == "llama" ? "LlamaForCausalLM" : t.dump();
  }
  check(arch == "GPT2LMHeadModel" || arch == "LlamaForCausalLM",
        where + ": field architectures: expected GPT2LMHeadModel or LlamaForCausalLM, found " + arch + " (unsupported)");
  Config c;
  if (arch == "GPT2LMHeadModel") {
    c.model.preset = "d4";
    c.model.family = Family::gpt2;
    c.model.n_embd = integer("n_embd");
    c.model.n_layer = integer("n_layer");
    c.model.n_head = integer("n_head");
    c.model.vocab_size = integer("vocab_size");
    c.model.max_seq_len = integer("n_positions");
    expect("activation_function", "gelu_new", true);
    expect("layer_norm_epsilon", kNormEps, true);
    if (j.contains("n_inner") && !j["n_inner"].is_null()) expect("n_inner", 4 * c.model.n_embd, false);
    expect("scale_attn_weights", true, true);
    expect("scale_attn_by_inverse_layer_idx", false, true);
    expect("tie_word_embeddings", true, true);
  } else {
    c.model.preset = "llama-tiny";
    c.model.family = Family::llama;
    c.model.n_embd = integer("hidden_size");
    c.model.n_layer = integer("num_hidden_layers");
    c.model.n_head = integer("num_attention_heads");
    c.model.n_kv_head = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                            ? integer("num_key_value_heads") : c.model.n_head;
    c.model.ffn_hidden = integer("intermediate_size");
    c.model.ffn_multiple_of = 1;
    c.model.vocab_size = integer("vocab_size");
    c.model.max_seq_len = integer("max_position_embeddings");
    expect("hidden_act", "silu", true);
    expect("rms_norm_eps", kNormEps, false);
    expect("attention_bias", false, true);
    expect("mlp_bias", false, true);
    expect("pretraining_tp", 1, true);
    if (j.contains("head_dim") && !j["head_dim"].is_null()) expect("head_dim", c.model.n_embd / c.model.n_head, false);
    const json& tie = j.contains("tie_word_embeddings") ? j["tie_word_embeddings"] : json(true);  // transformers' default
    check(tie.is_boolean(), where + ": field tie_word_embeddings: expected true or false, found " + tie.dump());
    c.model.tie_embeddings = tie.get<bool>();
    // The rotary base and its scaling: rope_parameters (transformers 5: rope_type, rope_theta and the
    // type's keys), else rope_scaling (older files: type or rope_type, and the type's keys) beside
    // rope_theta. Types "default", "linear" (factor) and "llama3" (factor, low_freq_factor,
    // high_freq_factor, original_max_position_embeddings); another is refused.
    double theta = 10000.0;
    if (j.contains("rope_theta")) theta = number(j["rope_theta"], "rope_theta");
    const char* rope_key = j.contains("rope_parameters") && !j["rope_parameters"].is_null() ? "rope_parameters"
                           : j.contains("rope_scaling") && !j["rope_scaling"].is_null()   ? "rope_scaling"
                                                                                            : nullptr;
    if (rope_key != nullptr) {
      const json& rp = j[rope_key];
      const std::string key = rope_key;
      check(rp.is_object(), where + ": field " + key + ": expected an object, found " + rp.dump());
      const json type = rp.contains("rope_type") ? rp["rope_type"] : rp.contains("type") ? rp["type"] : json("default");
      // (A message reads a field with value(): a const json's operator[] on a missing key is undefined.)
      auto param = [&](const char* name, std::optional<double> fallback) {
        if (!rp.contains(name) || rp[name].is_null()) {
          check(fallback.has_value(), where + ": field " + key + "." + name + ": expected a number, found none");
          return *fallback;
        }
        return number(rp[name], key + "." + name);
      };
      if (rp.contains("rope_theta")) theta = number(rp["rope_theta"], key + ".rope_theta");
      if (type == "linear" || type == "llama3") {
        c.model.rope_scaling = type == "linear" ? RopeScaling::linear : RopeScaling::llama3;
        c.model.rope_factor = param("factor", std::nullopt);
        check(c.model.rope_factor >= 1, where + ": field " + key + ".factor: expected >= 1, found " + rp.value("factor", json()).dump());
        if (type == "llama3") {
          c.model.rope_low_freq_factor = param("low_freq_factor", std::nullopt);
          c.model.rope_high_freq_factor = param("high_freq_factor", std::nullopt);
          const double old_len = param("original_max_position_embeddings", std::nullopt);
          check(old_len >= 1 && old_len <= (1 << 30) && old_len == std::floor(old_len),
                where + ": field " + key + ".original_max_position_embeddings: expected a positive integer, found " +
                    rp.value("original_max_position_embeddings", json()).dump());
          c.model.rope_original_max_seq_len = static_cast<int>(old_len);
        }
        check(param("attention_factor", 1.0) == 1.0,
              where + ": field " + key + ".attention_factor: expected 1 (Keel does not scale the rotated features), found " +
                  rp.value("attention_factor", json()).dump());
      } else {
        check(type == "default", where + ": field " + key + ".rope_type: expected \"default\", \"linear\" or \"llama3\", found " +
                                     type.dump() + " (unsupported)");
      }
    }
    c.model.rope_theta = theta;
    check(c.model.n_head >= 1 && c.model.n_embd % c.model.n_head == 0,
          where + ": field num_attention_heads: expected a divisor of hidden_size " + std::to_string(c.model.n_embd) +
              ", found " + std::to_string(c.model.n_head));
  }
  c.train.seq_len = std::min(c.train.seq_len, c.model.max_seq_len);
  try {
    c.resolve(1);
  } catch (const Error& e) {
    throw Error(where + ": " + e.what());
  }
  return c.model;
}

std::vector<int> read_hf_eos_tokens(const std::string& dir) {
  const fs::path root(dir);
  auto parse = [&](const fs::path& path) {
    try {
      return json::parse(read_text_file(path.string()));
    } catch (const json::exception& e) {
      std::string what = e.what();
      std::replace(what.begin(), what.end(), '\n', ' ');
      throw Error("hf checkpoint " + path.string() + ": not valid JSON: " + what);
    }
  };
  // eos_token_id of a config file: an id or a list of ids; absent or null: none.
  auto ids = [&](const fs::path& path, std::vector<int>& out) {
    if (!fs::is_regular_file(path)) return false;
    const json j = parse(path);
    if (!j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) return false;
    const json& e = j["eos_token_id"];
    const json list = e.is_array() ? e : json::array({e});
    for (const json& id : list) {
      check(id.is_number_unsigned() && id.get<uint64_t>() < static_cast<uint64_t>(kMaxVocabSize),
            "hf checkpoint " + path.string() + ": field eos_token_id: expected token ids, found " + e.dump());
      if (std::find(out.begin(), out.end(), id.get<int>()) == out.end()) out.push_back(id.get<int>());
    }
    return !out.empty();
  };
  std::vector<int> out;
  if (ids(root / "generation_config.json", out) || ids(root / "config.json", out)) return out;
  // tokenizer_config.json's eos_token (its text, or {"content": text}), looked up in tokenizer.json.
  const fs::path tc = root / "tokenizer_config.json", tok = root / "tokenizer.json";
  if (!fs::is_regular_file(tc) || !fs::is_regular_file(tok)) return out;
  const json c = parse(tc);
  if (!c.is_object() || !c.contains("eos_token") || c["eos_token"].is_null()) return out;
  const json& e = c["eos_token"];
  const json text = e.is_object() && e.contains("content") ? e["content"] : e;
  check(text.is_string(), "hf checkpoint " + tc.string() + ": field eos_token: expected a token's text, found " + e.dump());
  const json t = parse(tok);
  if (t.is_object() && t.contains("added_tokens") && t["added_tokens"].is_array()) {
    for (const json& a : t["added_tokens"]) {
      if (a.is_object() && a.value("content", json()) == text && a.contains("id") && a["id"].is_number_unsigned()) {
        return {a["id"].get<int>()};
      }
    }
  }
  if (t.is_object() && t.contains("model") && t["model"].is_object() && t["model"].contains("vocab") &&
      t["model"]["vocab"].is_object() && t["model"]["vocab"].contains(text.get<std::string>())) {
    const json& id = t["model"]["vocab"][text.get<std::string>()];
    if (id.is_number_unsigned()) return {id.get<int>()};
  }
  throw Error("hf checkpoint " + tc.string() + ": field eos_token: " + text.dump() + " is not a token of " + tok.string());
}

std::string stop_tokens_text(const std::vector<int>& ids) {
  std::string out;
  for (int id : ids) out += (out.empty() ? "" : ",") + std::to_string(id);
  return out;
}

void take_hf_model_shape(ModelConfig& model, const ModelConfig& hf, const std::string& dir) {
  const std::string from = "train.init = hf:" + dir;
  check(!model.family.has_value() || model.family == hf.family,
        "model.family = " + std::string(to_string(*model.family)) + " disagrees with " + from + " (" +
            to_string(*hf.family) + ")");
  model.family = hf.family;
  auto take = [&](auto& key, const auto& value, const char* name, auto unset) {
    check(key == unset || key == value, std::string("model.") + name + " = " + std::to_string(key) + " disagrees with " +
                                            from + " (" + std::to_string(value) + ")");
    key = value;
  };
  take(model.n_layer, hf.n_layer, "n_layer", 0);
  take(model.n_head, hf.n_head, "n_head", 0);
  take(model.n_embd, hf.n_embd, "n_embd", 0);
  take(model.vocab_size, hf.vocab_size, "vocab_size", 0);
  take(model.max_seq_len, hf.max_seq_len, "max_seq_len", 0);
  if (hf.llama()) {
    take(model.n_kv_head, hf.n_kv_head, "n_kv_head", 0);
    take(model.ffn_hidden, hf.ffn_hidden, "ffn_hidden", 0);
    take(model.rope_theta, hf.rope_theta, "rope_theta", 0.0);
    if (model.rope_scaling == RopeScaling::none && hf.rope_scaling != RopeScaling::none) {
      model.rope_scaling = hf.rope_scaling;
      model.rope_factor = hf.rope_factor;
      model.rope_low_freq_factor = hf.rope_low_freq_factor;
      model.rope_high_freq_factor = hf.rope_high_freq_factor;
      model.rope_original_max_seq_len = hf.rope_original_max_seq_len;
    }
    check(!model.tie_embeddings.has_value() || model.tie_embeddings == hf.tie_embeddings,
          "model.tie_embeddings disagrees with " + from);
    model.tie_embeddings = hf.tie_embeddings;
    if (model.ffn_multiple_of == 0) model.ffn_multiple_of = 1;
  }
}

void import_hf(const std::string& dir, ChunkStore& store, const ModelConfig& model) {
  const SafetensorsCheckpoint ckpt(dir);
  const std::string gpt2_prefix = ckpt.find("wte.weight").tensor != nullptr ? "" : "transformer.";
  const std::vector<Piece> pieces = hf_layout(model, gpt2_prefix);
  std::set<std::string> used;
  for (const Piece& p : pieces) {
    used.insert(p.hf);
    const int id = find_tensor(store, model.tensor_prefix + p.keel);
    if (id < 0) continue;  // on another pipeline stage
    const SafetensorsCheckpoint::Entry e = ckpt.find(p.hf);
    check(e.tensor != nullptr, "hf checkpoint " + dir + ": tensor " + p.hf + " not found (the " +
                                   (model.llama() ? "LlamaForCausalLM" : "GPT2LMHeadModel") + " config.json describes needs it)");
    check(e.tensor->shape == p.hf_shape, e.file->path() + ": tensor \"" + p.hf + "\": field shape: expected " +
                                             shape_string(p.hf_shape) + " (from config.json), found " +
                                             shape_string(e.tensor->shape));
    // An F32 tensor is read in place from the mapping; others converted into a buffer first.
    std::vector<float> converted;
    std::span<const float> values = e.file->float32_view(*e.tensor);
    if (values.empty()) {
      converted = e.file->read_float32(*e.tensor);
      values = converted;
    }
    const auto bad = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
    check(bad == values.end(), e.file->path() + ": tensor \"" + p.hf + "\" holds a non-finite value at element " +
                                   std::to_string(bad - values.begin()));
    std::span<float> dst = store.view(id, Plane::param);
    const int64_t rows = p.rows(), cols = p.cols();
    for (int64_t r = 0; r < rows; ++r) {
      float* out = dst.data() + (p.row0 + r) * cols;
      if (p.order == Order::transposed) {
        for (int64_t k = 0; k < cols; ++k) out[k] = values[k * rows + r];
      } else {
        std::memcpy(out, values.data() + hf_row(p, r) * cols, sizeof(float) * cols);
      }
    }
    // The padded vocabulary's rows (beyond vocab_size) hold zeros, as a fresh model's do.
    if (p.keel == "wte" || p.keel == "lm_head.w") {
      std::fill(dst.begin() + rows * cols, dst.end(), 0.0f);
    }
  }
  const bool tied = !model.llama() || model.tie_embeddings.value_or(false);
  const std::string embedding = model.llama() ? "model.embed_tokens.weight" : gpt2_prefix + "wte.weight";
  for (const std::string& name : ckpt.names()) {
    if (used.count(name) || is_buffer(name)) continue;
    const SafetensorsCheckpoint::Entry e = ckpt.find(name);
    if (name == "lm_head.weight" && tied) {
      // A tied head saved beside the embedding must be the embedding.
      const SafetensorsCheckpoint::Entry emb = ckpt.find(embedding);
      check(emb.tensor != nullptr && e.file->read_float32(*e.tensor) == emb.file->read_float32(*emb.tensor),
            e.file->path() + ": tensor \"lm_head.weight\" differs from " + embedding +
                ", but config.json ties them (tie_word_embeddings)");
      continue;
    }
    throw Error(e.file->path() + ": tensor \"" + name + "\" is not part of the model config.json describes " +
                "(an unsupported architecture variant? its weights would be lost)");
  }
}

void export_hf(const std::string& dir, const ChunkStore& store, const ModelConfig& m, uint64_t max_shard_bytes,
               const std::vector<int>& eos) {
  check(max_shard_bytes > 0, "export --hf " + dir + ": --max-shard-size: expected a positive size");
  check(m.rope_scaling != RopeScaling::ntk, "export --hf " + dir + ": model.rope_scaling = ntk has no equivalent in "
                                            "transformers (expected none, linear or llama3)");
  check(!m.moe(), "export --hf " + dir + ": LlamaForCausalLM has no mixture of experts; this model has model.moe_experts = " +
                      std::to_string(m.moe_experts) + " (keel checkpoints hold its routed experts as moe.expert.J.*)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  check(!ec && fs::is_directory(dir), "export --hf " + dir + ": cannot create the directory: " + ec.message());
  const std::vector<Piece> pieces = hf_layout(m);
  std::vector<std::vector<float>> values(pieces.size());
  std::vector<SafetensorsOut> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    std::span<const float> src = store.view(store.find(m.tensor_prefix + p.keel), Plane::param);
    const int64_t rows = p.rows(), cols = p.cols();
    if (p.order == Order::rows) {  // the store's rows as they are: written from the store itself
      out.push_back({p.hf, p.hf_shape, src.subspan(static_cast<size_t>(p.row0 * cols), static_cast<size_t>(rows * cols))});
      continue;
    }
    values[i].resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      const float* in = src.data() + (p.row0 + r) * cols;
      if (p.order == Order::transposed) {
        for (int64_t k = 0; k < cols; ++k) values[i][k * rows + r] = in[k];
      } else {
        std::memcpy(values[i].data() + hf_row(p, r) * cols, in, sizeof(float) * cols);
      }
    }
    out.push_back({p.hf, p.hf_shape, values[i]});
  }
  json config;
  if (m.llama()) {
    config = {{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", m.n_embd},
              {"intermediate_size", m.ffn_hidden},
              {"num_hidden_layers", m.n_layer},
              {"num_attention_heads", m.n_head},
              {"num_key_value_heads", m.n_kv_head},
              {"head_dim", m.head_size()},
              {"vocab_size", m.vocab_size},
              {"max_position_embeddings", m.max_seq_len},
              {"rope_theta", m.rope_theta},
              {"rope_scaling", nullptr},
              {"eos_token_id", eos.empty() ? json(nullptr) : eos.size() == 1 ? json(eos[0]) : json(eos)},
              {"rms_norm_eps", kNormEps},
              {"hidden_act", "silu"},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"tie_word_embeddings", m.tie_embeddings.value_or(false)},
              {"torch_dtype", "float32"}};
  } else {
    config = {{"architectures", {"GPT2LMHeadModel"}},
              {"model_type", "gpt2"},
              {"n_embd", m.n_embd},
              {"n_layer", m.n_layer},
              {"n_head", m.n_head},
              {"n_inner", nullptr},
              {"vocab_size", m.vocab_size},
              {"n_positions", m.max_seq_len},
              {"n_ctx", m.max_seq_len},
              {"activation_function", "gelu_new"},
              {"layer_norm_epsilon", kNormEps},
              {"scale_attn_weights", true},
              {"tie_word_embeddings", true},
              {"torch_dtype", "float32"}};
    if (!eos.empty()) config["eos_token_id"] = eos.size() == 1 ? json(eos[0]) : json(eos);
  }
  if (m.llama() && m.rope_scaling != RopeScaling::none) {  // written as transformers 5 writes it
    json rp = {{"rope_type", to_string(m.rope_scaling)}, {"rope_theta", m.rope_theta}, {"factor", m.rope_factor}};
    if (m.rope_scaling == RopeScaling::llama3) {
      rp["low_freq_factor"] = m.rope_low_freq_factor;
      rp["high_freq_factor"] = m.rope_high_freq_factor;
      rp["original_max_position_embeddings"] = m.rope_original_max_seq_len;
    }
    config.erase("rope_scaling");
    config["rope_parameters"] = rp;
  }
  // Shards: tensors in order, a new shard when the next tensor would overflow the current one.
  std::vector<std::vector<SafetensorsOut>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const SafetensorsOut& t : out) {
    const uint64_t bytes = t.values.size_bytes();
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) shards.emplace_back(), shard_bytes = 0;
    shards.back().push_back(t);
    shard_bytes += bytes, total_bytes += bytes;
  }
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  if (shards.size() == 1) {
    write_safetensors(single.string(), out, {{"format", "pt"}});
    fs::remove(index, ec);
  } else {
    json weight_map = json::object();
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
      write_safetensors((fs::path(dir) / name).string(), shards[i], {{"format", "pt"}});
      for (const SafetensorsOut& t : shards[i]) weight_map[t.name] = name;
    }
    const std::string index_text = json{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}.dump(2) + "\n";
    write_file_atomic(index.string(), {ByteRange{index_text.data(), index_text.size()}});
    fs::remove(single, ec);
  }
  const std::string text = config.dump(2) + "\n";
  write_file_atomic((fs::path(dir) / "config.json").string(), {ByteRange{text.data(), text.size()}});
}

}  // namespace keel
