#include "core/config.h"

#include <xxhash.h>

#include <charconv>
#include <tuple>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>
#include <variant>

#include "core/error.h"
#include "core/fileio.h"
#include "core/toml_util.h"

namespace keel {

namespace {

// A key holding one of an enum's values (optional: "" = unset), read and written as its spelling.
struct ChoiceTarget {
  void* value;
  void (*assign)(void* value, std::string_view text, const std::string& key);  // throws the enum's error
  const char* (*print)(const void* value);                                      // "" when unset
};

template <ConfigEnum E>
ChoiceTarget choice(E* value) {
  return {value, [](void* v, std::string_view text, const std::string& key) { *static_cast<E*>(v) = parse_enum<E>(text, key); },
          [](const void* v) { return to_string(*static_cast<const E*>(v)); }};
}

template <ConfigEnum E>
ChoiceTarget choice(std::optional<E>* value) {
  return {value,
          [](void* v, std::string_view text, const std::string& key) {
            auto* o = static_cast<std::optional<E>*>(v);
            if (text.empty()) o->reset();
            else *o = parse_enum<E>(text, key);
          },
          [](const void* v) {
            const auto* o = static_cast<const std::optional<E>*>(v);
            return o->has_value() ? to_string(**o) : "";
          }};
}

// One configurable key: where it lives in Config and what type it holds.
struct Field {
  const char* section;
  const char* key;
  // optional<bool>: unset until the file or the command line sets it (then resolve fills it).
  std::variant<int*, int64_t*, uint64_t*, double*, std::string*, bool*, std::optional<bool>*, ChoiceTarget> target;
};

std::vector<Field> fields(Config& c) {
  return {
      {"model", "preset", &c.model.preset},
      {"model", "family", choice(&c.model.family)},
      {"model", "n_layer", &c.model.n_layer},
      {"model", "n_head", &c.model.n_head},
      {"model", "n_embd", &c.model.n_embd},
      {"model", "vocab_size", &c.model.vocab_size},
      {"model", "padded_vocab_size", &c.model.padded_vocab_size},
      {"model", "max_seq_len", &c.model.max_seq_len},
      {"model", "n_kv_head", &c.model.n_kv_head},
      {"model", "ffn_hidden", &c.model.ffn_hidden},
      {"model", "ffn_multiple_of", &c.model.ffn_multiple_of},
      {"model", "ffn_dim_multiplier", &c.model.ffn_dim_multiplier},
      {"model", "rope_theta", &c.model.rope_theta},
      {"model", "rope_scaling", choice(&c.model.rope_scaling)},
      {"model", "rope_factor", &c.model.rope_factor},
      {"model", "rope_low_freq_factor", &c.model.rope_low_freq_factor},
      {"model", "rope_high_freq_factor", &c.model.rope_high_freq_factor},
      {"model", "rope_original_max_seq_len", &c.model.rope_original_max_seq_len},
      {"model", "tie_embeddings", &c.model.tie_embeddings},
      {"model", "moe_experts", &c.model.moe_experts},
      {"model", "moe_top_k", &c.model.moe_top_k},
      {"model", "moe_shared_experts", &c.model.moe_shared_experts},
      {"model", "moe_every", &c.model.moe_every},
      {"model", "moe_hidden", &c.model.moe_hidden},
      {"model", "moe_aux_weight", &c.model.moe_aux_weight},
      {"model", "moe_balance", choice(&c.model.moe_balance)},
      {"model", "moe_bias_rate", &c.model.moe_bias_rate},
      {"model", "moe_capacity", &c.model.moe_capacity},
      {"model", "attention", choice(&c.model.attention)},
      {"model", "attention_window", &c.model.attention_window},
      {"model", "dynamic_window_mass", &c.model.dynamic_window_mass},
      {"model", "dynamic_window_loss", &c.model.dynamic_window_loss},
      {"model", "dynamic_window_min", &c.model.dynamic_window_min},
      {"model", "dynamic_window_every", &c.model.dynamic_window_every},
      {"model", "dynamic_windows_state", &c.model.dynamic_windows_state},
      {"train", "batch_size", &c.train.batch_size},
      {"train", "global_batch_size", &c.train.global_batch_size},
      {"train", "seq_len", &c.train.seq_len},
      {"train", "grad_accum", &c.train.grad_accum},
      {"train", "steps", &c.train.steps},
      {"train", "seed", &c.train.seed},
      {"train", "log_every", &c.train.log_every},
      {"train", "eval_every", &c.train.eval_every},
      {"train", "eval_batches", &c.train.eval_batches},
      {"train", "checkpoint_every", &c.train.checkpoint_every},
      {"train", "checkpoint_every_minutes", &c.train.checkpoint_every_minutes},
      {"train", "run_dir", &c.train.run_dir},
      {"train", "resume", &c.train.resume},
      {"train", "init", &c.train.init},
      {"train", "overwrite", &c.train.overwrite},
      {"train", "sample_tokens", &c.train.sample_tokens},
      {"train", "samples", &c.train.samples},
      {"train", "seq_len_schedule", &c.train.seq_len_schedule},
      {"train", "recompute", choice(&c.train.recompute)},
      {"train", "recompute_layers", &c.train.recompute_layers},
      {"optim", "lr", &c.optim.lr},
      {"optim", "min_lr_ratio", &c.optim.min_lr_ratio},
      {"optim", "warmup_steps", &c.optim.warmup_steps},
      {"optim", "weight_decay", &c.optim.weight_decay},
      {"optim", "skip_nonfinite_steps", &c.optim.skip_nonfinite_steps},
      {"optim", "beta1", &c.optim.beta1},
      {"optim", "beta2", &c.optim.beta2},
      {"optim", "eps", &c.optim.eps},
      {"optim", "grad_clip", &c.optim.grad_clip},
      {"optim", "freeze_layers", &c.optim.freeze_layers},
      {"optim", "freeze_at_step", &c.optim.freeze_at_step},
      {"data", "train", &c.data.train},
      {"data", "val", &c.data.val},
      {"data", "tokenizer", &c.data.tokenizer},
      {"data", "shuffle", &c.data.shuffle},
      {"store", "chunk_bytes", &c.store.chunk_bytes},
      {"parallel", "data", &c.parallel.data},
      {"parallel", "bucket_bytes", &c.parallel.bucket_bytes},
      {"parallel", "zero", &c.parallel.zero},
      {"parallel", "zero3_keep", choice(&c.parallel.zero3_keep)},
      {"parallel", "zero3_progress_thread", &c.parallel.zero3_progress_thread},
      {"parallel", "pipeline", &c.parallel.pipeline},
      {"parallel", "tensor", &c.parallel.tensor},
      {"parallel", "sequence_parallel", &c.parallel.sequence_parallel},
      {"parallel", "context", &c.parallel.context},
      {"parallel", "expert", &c.parallel.expert},
      {"parallel", "schedule", choice(&c.parallel.schedule)},
      {"parallel", "virtual_stages", &c.parallel.virtual_stages},
      {"parallel", "stage_boundaries", &c.parallel.stage_boundaries},
      {"parallel", "partitioner", choice(&c.parallel.partitioner)},
      {"parallel", "layer_costs", &c.parallel.layer_costs},
      {"parallel", "stage_memory_mib", &c.parallel.stage_memory_mib},
      {"parallel", "repartition_every", &c.parallel.repartition_every},
      {"parallel", "repartition_threshold", &c.parallel.repartition_threshold},
      {"parallel", "micro_batches", &c.parallel.micro_batches},
      {"parallel", "dynamic_micro_batches", &c.parallel.dynamic_micro_batches},
      {"parallel", "activation_mib", &c.parallel.activation_mib},
      {"parallel", "trace", &c.parallel.trace},
      {"parallel", "lookahead", &c.parallel.lookahead},
      {"parallel", "predict_gradients", choice(&c.parallel.predict_gradients)},
      {"parallel", "post_validate", &c.parallel.post_validate},
      {"sync", "codec", choice(&c.sync.codec)},
      {"sync", "policy", &c.sync.policy},
      {"sync", "embedding", choice(&c.sync.embedding)},
      {"sync", "attention", choice(&c.sync.attention)},
      {"sync", "ffn", choice(&c.sync.ffn)},
      {"sync", "norm", choice(&c.sync.norm)},
      {"sync", "head", choice(&c.sync.head)},
      {"sync", "sign1_keep", &c.sync.sign1_keep},
      {"sync", "quant2_keep", &c.sync.quant2_keep},
      {"sync", "topk_keep", &c.sync.topk_keep},
      {"sync", "randk_keep", &c.sync.randk_keep},
      {"sync", "block", &c.sync.block},
      {"sync", "warmup_steps", &c.sync.warmup_steps},
      {"sync", "shape", choice(&c.sync.shape)},
      {"tier", "device_mib", &c.tier.device_mib},
      {"tier", "host_mib", &c.tier.host_mib},
      {"tier", "nvme_dir", &c.tier.nvme_dir},
      {"tier", "engine", choice(&c.tier.engine)},
      {"tier", "lookahead", &c.tier.lookahead},
      {"tier", "prefetch", &c.tier.prefetch},
      {"tier", "defer_update", &c.tier.defer_update},
      {"tier", "verify", &c.tier.verify},
      {"tier", "embedding", choice(&c.tier.embedding)},
      {"tier", "attention", choice(&c.tier.attention)},
      {"tier", "ffn", choice(&c.tier.ffn)},
      {"tier", "norm", choice(&c.tier.norm)},
      {"tier", "layers", &c.tier.layers},
      {"tier", "optimizer", choice(&c.tier.optimizer)},
      {"tier", "policy", choice(&c.tier.policy)},
      {"tier", "experts", choice(&c.tier.experts)},
      {"tier", "experts_every", &c.tier.experts_every},
      {"checkpoint", "full_every", &c.checkpoint.full_every},
      {"checkpoint", "keep", &c.checkpoint.keep},
      {"checkpoint", "delta", &c.checkpoint.delta},
      {"checkpoint", "compress", &c.checkpoint.compress},
      {"checkpoint", "async", &c.checkpoint.async},
      {"checkpoint", "memory_every", &c.checkpoint.memory_every},
      {"runtime", "threads", &c.runtime.threads},
      {"runtime", "slow_rank", &c.runtime.slow_rank},
      {"runtime", "slow_factor", &c.runtime.slow_factor},
      {"runtime", "peak_gflops", &c.runtime.peak_gflops},
      {"runtime", "precision", choice(&c.runtime.precision)},
      {"runtime", "param_dtype", choice(&c.runtime.param_dtype)},
      {"runtime", "grad_dtype", choice(&c.runtime.grad_dtype)},
      {"runtime", "flush_denormals", &c.runtime.flush_denormals},
      {"monitor", "enabled", &c.monitor.enabled},
      {"monitor", "port", &c.monitor.port},
      {"monitor", "bind", &c.monitor.bind},
      {"monitor", "allow_remote", &c.monitor.allow_remote},
      {"monitor", "min_hit_rate", &c.monitor.min_hit_rate},
      {"monitor", "max_bubble", &c.monitor.max_bubble},
      {"monitor", "max_sync_jitter", &c.monitor.max_sync_jitter},
      {"monitor", "loss_spike", &c.monitor.loss_spike},
      {"monitor", "stall_factor", &c.monitor.stall_factor},
      {"monitor", "alert_after", &c.monitor.alert_after},
      {"monitor", "max_moe_imbalance", &c.monitor.max_moe_imbalance},
      {"monitor", "moe_imbalance_after", &c.monitor.moe_imbalance_after},
      {"monitor", "layer_costs_every", &c.monitor.layer_costs_every},
      {"monitor", "powercap", &c.monitor.powercap},
      {"monitor", "cpu_watts", &c.monitor.cpu_watts},
      {"generate", "kv_block", &c.generate.kv_block},
      {"generate", "kv_cache_mib", &c.generate.kv_cache_mib},
      {"generate", "kv_device_mib", &c.generate.kv_device_mib},
      {"generate", "kv_tier", choice(&c.generate.kv_tier)},
      {"generate", "kv_nvme_dir", &c.generate.kv_nvme_dir},
      {"generate", "prefix_reuse", &c.generate.prefix_reuse},
      {"generate", "prefill_chunk", &c.generate.prefill_chunk},
      {"generate", "kv_cache", &c.generate.kv_cache},
      {"generate", "stop_tokens", &c.generate.stop_tokens},
      {"clip", "image_tower", choice(&c.clip.image_tower)},
      {"clip", "image_width", &c.clip.image_width},
      {"clip", "image_size", &c.clip.image_size},
      {"clip", "embed_dim", &c.clip.embed_dim},
      {"clip", "vit_patch", &c.clip.vit_patch},
      {"clip", "vit_layers", &c.clip.vit_layers},
      {"clip", "vit_width", &c.clip.vit_width},
      {"clip", "vit_heads", &c.clip.vit_heads},
      {"clip", "vit_mask", &c.clip.vit_mask},
      {"clip", "visual_quant", choice(&c.clip.visual_quant)},
      {"clip", "grad_balance", choice(&c.clip.grad_balance)},
      {"clip", "image_update_every", &c.clip.image_update_every},
      {"clip", "text_update_every", &c.clip.text_update_every},
      {"clip", "logit_scale_init", &c.clip.logit_scale_init},
      {"clip", "logit_scale_max", &c.clip.logit_scale_max},
      {"clip", "dataset", &c.clip.dataset},
  };
}

const char* type_name(const Field& f) {
  switch (f.target.index()) {
    case 0: case 1: case 2: return "an integer";
    case 3: return "a number";
    case 5: case 6: return "true or false";
    case 7: return "a string";
    default: return "a string";
  }
}

std::string known_keys(Config& c, const std::string& section) {
  std::string out;
  for (const Field& f : fields(c)) {
    if (section != f.section) continue;
    if (!out.empty()) out += ", ";
    out += f.key;
  }
  return out;
}

Field find_field(Config& c, const std::string& section, const std::string& key, const std::string& where) {
  bool section_known = false;
  for (const Field& f : fields(c)) {
    if (section == f.section) {
      section_known = true;
      if (key == f.key) return f;
    }
  }
  if (!section_known) {
    std::string sections;  // every section the fields name, in their order
    for (const Field& f : fields(c)) {
      const std::string name = f.section;
      if (sections.find("[" + name + "]") == std::string::npos) sections += (sections.empty() ? "" : ", ") + ("[" + name + "]");
    }
    throw Error(where + ": unknown config section [" + section + "] (expected one of: " + sections + ")");
  }
  throw Error(where + ": unknown config key '" + section + "." + key + "' (known keys in [" + section +
              "]: " + known_keys(c, section) + ")");
}

template <typename Int>
Int parse_int(const std::string& text, const std::string& name) {
  Int value{};
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) {
    throw Error("config key '" + name + "' expects an integer, found '" + text + "'");
  }
  return value;
}

// A `--set` string value without the quotes around it, if any.
std::string unquoted(const std::string& text) {
  if (text.size() >= 2 && (text.front() == '"' || text.front() == '\'') && text.back() == text.front()) {
    return text.substr(1, text.size() - 2);
  }
  return text;
}

void assign_from_string(const Field& f, const std::string& text) {
  const std::string name = std::string(f.section) + "." + f.key;
  std::visit(
      [&](auto p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, ChoiceTarget>) {
          p.assign(p.value, unquoted(text), name);
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = unquoted(text);
        } else if constexpr (std::is_same_v<T, double>) {
          char* end = nullptr;
          errno = 0;
          double v = std::strtod(text.c_str(), &end);
          if (text.empty() || end != text.c_str() + text.size() || errno != 0 || !std::isfinite(v)) {
            throw Error("config key '" + name + "' expects a number, found '" + text + "'");
          }
          *p = v;
        } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) {
          if (text != "true" && text != "false") {
            throw Error("config key '" + name + "' expects true or false, found '" + text + "'");
          }
          *p = text == "true";
        } else {
          *p = parse_int<T>(text, name);
        }
      },
      f.target);
}

void assign_from_toml(const Field& f, const toml::node& node, const std::string& where) {
  const std::string name = std::string(f.section) + "." + f.key;
  auto mistyped = [&]() {
    std::ostringstream found;
    found << node.type();
    return Error(where + ": config key '" + name + "' expects " + type_name(f) + ", found " + found.str());
  };
  std::visit(
      [&](auto p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, ChoiceTarget>) {
          if (!node.is_string()) throw mistyped();
          try {
            p.assign(p.value, node.as_string()->get(), name);
          } catch (const Error& e) {
            throw Error(where + ": " + e.what());
          }
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!node.is_string()) throw mistyped();
          *p = node.as_string()->get();
        } else if constexpr (std::is_same_v<T, double>) {
          if (node.is_floating_point()) *p = node.as_floating_point()->get();
          else if (node.is_integer()) *p = static_cast<double>(node.as_integer()->get());
          else throw mistyped();
        } else if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) {
          if (!node.is_boolean()) throw mistyped();
          *p = node.as_boolean()->get();
        } else {
          if (!node.is_integer()) throw mistyped();
          int64_t v = node.as_integer()->get();
          if constexpr (std::is_same_v<T, int>) {
            if (v < INT32_MIN || v > INT32_MAX) throw Error(where + ": config key '" + name + "' is out of range");
          }
          if constexpr (std::is_same_v<T, uint64_t>) {
            if (v < 0) throw Error(where + ": config key '" + name + "' must not be negative");
          }
          *p = static_cast<T>(v);
        }
      },
      f.target);
}

std::string toml_value(const Field& f) {
  return std::visit(
      [](auto p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, ChoiceTarget>) {
          std::ostringstream out;
          if constexpr (std::is_same_v<T, ChoiceTarget>) {
            out << toml::value<std::string>(p.print(p.value));
          } else {
            out << toml::value<std::string>(*p);
          }
          return out.str();
        } else if constexpr (std::is_same_v<T, double>) {
          char buf[64];
          std::snprintf(buf, sizeof buf, "%.17g", *p);
          std::string s = buf;
          if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
          return s;
        } else if constexpr (std::is_same_v<T, bool>) {
          return *p ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::optional<bool>>) {
          return p->value_or(true) ? "true" : "false";  // resolved configs always hold a value
        } else {
          return std::to_string(*p);
        }
      },
      f.target);
}

void require(bool ok, const std::string& key, const std::string& expected, const std::string& found) {
  if (!ok) throw Error("config key '" + key + "': expected " + expected + ", found " + found);
}

}  // namespace

std::string enum_error(const char* format, const std::string& key, std::string_view found) {
  std::string out = format;
  for (const auto& [placeholder, value] : {std::pair<std::string, std::string>{"{key}", key}, {"{found}", std::string(found)}}) {
    for (size_t at = out.find(placeholder); at != std::string::npos; at = out.find(placeholder, at + value.size())) {
      out.replace(at, placeholder.size(), value);
    }
  }
  return out;
}

void validate(const GenerateConfig& g) {
  auto s = [](auto v) { return std::to_string(v); };
  require(g.kv_block >= 1 && g.kv_block <= 1024, "generate.kv_block", "1..1024 tokens", s(g.kv_block));
  require(g.kv_cache_mib >= 1, "generate.kv_cache_mib", ">= 1", s(g.kv_cache_mib));
  require(g.kv_device_mib >= 0, "generate.kv_device_mib", ">= 0 (0 = every block in memory)", s(g.kv_device_mib));
  require(g.kv_tier != KvTier::nvme || g.kv_device_mib == 0 || !g.kv_nvme_dir.empty(), "generate.kv_nvme_dir",
          "a directory when generate.kv_tier = nvme", "\"\"");
  require(g.prefill_chunk >= 1, "generate.prefill_chunk", ">= 1", s(g.prefill_chunk));
  // "" or ids "N,N,...": digits between commas, each below 2^24 (kMaxVocabSize).
  bool ids = true;
  for (size_t at = 0; ids && !g.stop_tokens.empty() && at <= g.stop_tokens.size();) {
    size_t end = g.stop_tokens.find(',', at);
    if (end == std::string::npos) end = g.stop_tokens.size();
    const std::string id = g.stop_tokens.substr(at, end - at);
    ids = !id.empty() && id.size() <= 8 && id.find_first_not_of("0123456789") == std::string::npos &&
          std::stol(id) < kMaxVocabSize;
    at = end + 1;
  }
  require(ids, "generate.stop_tokens", "token ids separated by commas (\"2\", \"128001,128009\") or \"\"",
          "\"" + g.stop_tokens + "\"");
}

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = {
      // name        L   H   C     V      maxT
      {"tiny", 2, 2, 64, 8192, 256},
      {"d4", 4, 4, 256, 8192, 256},  // the default job: ~5M parameters with an 8192 vocabulary
      {"d6", 6, 6, 384, 8192, 512},
      {"d12", 12, 12, 768, 8192, 1024},
      {"small", 4, 4, 256, 50257, 1024},  // the benchmark's small shape with GPT-2's vocabulary
      {"gpt2-124m", 12, 12, 768, 50257, 1024},
      {"gpt2-350m", 24, 16, 1024, 50257, 1024},
      {"gpt2-774m", 36, 20, 1280, 50257, 1024},
      {"gpt2-1.5b", 48, 25, 1600, 50257, 1024},
      // LLaMA-style: name      L   H    C     V     maxT  family  KV  multiple_of  tied
      {"llama-tiny", 2, 4, 64, 8192, 256, Family::llama, 2, 32, false},
      {"llama-d4", 4, 8, 256, 8192, 256, Family::llama, 4, 64, false},  // the default job's size, GQA 8:4
      {"llama-110m", 12, 12, 768, 32000, 1024, Family::llama, 12, 32, true},  // llama2.c's stories110M shape
      {"tinyllama-1.1b", 22, 32, 2048, 32000, 2048, Family::llama, 4, 256, false},  // TinyLlama's shape
      // Llama 3's shape: a 128,256-token vocabulary (uint32 token shards), GQA 4:1, rotary base 500000.
      //                         L   H    C      V      maxT  family        KV  multiple_of  tied  multiplier  theta
      {"llama3-tiny", 2, 4, 64, 128256, 256, Family::llama, 1, 32, true, 0, 500000},
      {"llama3-1b", 16, 32, 2048, 128256, 2048, Family::llama, 8, 256, true, 1.5, 500000},  // Llama 3.2 1B's shape
      {"llama3-8b", 32, 32, 4096, 128256, 2048, Family::llama, 8, 1024, false, 1.3, 500000},  // Llama 3 8B's shape
      // Mixtures of experts (model/moe.h):          L  H  C    V     maxT  family        KV mult tied mul theta E  k shared hidden
      {"llama-moe-tiny", 2, 4, 64, 8192, 256, Family::llama, 2, 32, false, 0, 0, 4, 2, 1, 64},  // for tests
      // llama-d4's size with 8 experts, top-2, each half llama-d4's MLP: active MLP units = the dense model's
      {"llama-moe-d4", 4, 8, 256, 8192, 256, Family::llama, 4, 64, false, 0, 0, 8, 2, 0, 352},
  };
  return presets;
}

Config Config::parse(const std::string& toml_text, const std::string& where) {
  Config c;
  toml::table root = parse_toml(toml_text, where);
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    if (!section_node.is_table()) {
      throw Error(where + ": '" + section + "' must be a [section], found a plain value");
    }
    for (auto&& [key, node] : *section_node.as_table()) {
      Field f = find_field(c, section, std::string(key.str()), where);
      assign_from_toml(f, node, where);
    }
  }
  return c;
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  Config c;
  if (!path.empty()) {
    if (!std::filesystem::exists(path)) throw Error("config file " + path + ": not found");
    if (std::filesystem::is_directory(path)) throw Error("config file " + path + ": is a directory, not a TOML file");
    c = parse(read_text_file(path), "config file " + path);
  }
  for (const std::string& o : overrides) c.set(o);
  return c;
}

void Config::set(const std::string& assignment) {
  const size_t eq = assignment.find('=');
  const size_t dot = assignment.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
    throw Error("--set " + assignment + ": expected section.key=value");
  }
  Field f = find_field(*this, assignment.substr(0, dot), assignment.substr(dot + 1, eq - dot - 1),
                       "--set " + assignment);
  assign_from_string(f, assignment.substr(eq + 1));
}

namespace {

// A whole non-negative decimal number: the text's value, or -1.
int non_negative(const std::string& s) {
  int v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return s.empty() || ec != std::errc() || p != s.data() + s.size() || v < 0 ? -1 : v;
}

// "LO-HI" as blocks (LO, HI) of a model of n_layer blocks; throws what `bad` makes of the reason.
template <typename Bad>
std::pair<int, int> block_range(const std::string& text, int n_layer, const Bad& bad) {
  const size_t dash = text.find('-');
  if (dash == std::string::npos) throw bad("'" + text + "' is not LO-HI");
  const int lo = non_negative(text.substr(0, dash)), hi = non_negative(text.substr(dash + 1));
  if (lo < 0 || hi < 0) throw bad("'" + text + "' is not a range of blocks");
  if (lo > hi) throw bad("the range " + text + " is empty");
  if (hi >= n_layer) throw bad("blocks " + text + " outside 0.." + std::to_string(n_layer - 1));
  return {lo, hi};
}

// model.attention_window as (first block, last block, window) ranges; throws Error naming the key.
std::vector<std::tuple<int, int, int>> parse_windows(const std::string& text, int n_layer) {
  std::vector<std::tuple<int, int, int>> out;
  auto bad = [&](const std::string& why) {
    return Error("config key 'model.attention_window': expected \"W\" or \"LO-HI:W,...\" (blocks 0.." +
                 std::to_string(n_layer - 1) + ", W >= 0), found \"" + text + "\": " + why);
  };
  auto number = [&](const std::string& s) {
    const int v = non_negative(s);
    if (v < 0) throw bad("'" + s + "' is not a count");
    return v;
  };
  if (text.empty()) return out;
  if (text == "dynamic") return out;  // the windows come from dynamic_windows_state (below)
  if (text.find(':') == std::string::npos) {
    out.emplace_back(0, n_layer - 1, number(text));
    return out;
  }
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string part = text.substr(at, end - at);
    const size_t colon = part.find(':');
    if (colon == std::string::npos) throw bad("'" + part + "' is not LO-HI:W");
    const auto [lo, hi] = block_range(part.substr(0, colon), n_layer, bad);
    out.emplace_back(lo, hi, number(part.substr(colon + 1)));
    at = end + 1;
  }
  return out;
}

}  // namespace

double ModelConfig::rope_base() const {
  const double hs = head_size();
  return rope_scaling == RopeScaling::ntk && hs > 2 ? rope_theta * std::pow(rope_factor, hs / (hs - 2)) : rope_theta;
}

std::vector<double> ModelConfig::rope_frequencies() const {
  const int hs = head_size(), half = hs / 2;
  std::vector<double> f(static_cast<size_t>(std::max(half, 0)));
  const double base = rope_base();
  for (int i = 0; i < half; ++i) f[i] = std::pow(base, -2.0 * i / hs);
  if (rope_scaling == RopeScaling::llama3) {  // transformers' _compute_llama3_parameters
    const double pi = 3.14159265358979323846, old_len = rope_original_max_seq_len;
    const double low_wavelen = old_len / rope_low_freq_factor, high_wavelen = old_len / rope_high_freq_factor;
    for (double& x : f) {
      const double wavelen = 2 * pi / x;
      if (wavelen > low_wavelen) {
        x /= rope_factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (old_len / wavelen - rope_low_freq_factor) / (rope_high_freq_factor - rope_low_freq_factor);
        x = (1 - smooth) * x / rope_factor + smooth * x;
      }
    }
  }
  return f;
}

int ModelConfig::window_of(int block) const {
  if (dynamic_window()) {  // "W0,W1,...": the window each block has now ("" = none yet)
    std::istringstream in(dynamic_windows_state);
    std::string part;
    for (int b = 0; std::getline(in, part, ','); ++b) {
      if (b == block) return std::atoi(part.c_str());
    }
    return 0;
  }
  int w = 0;
  for (const auto& [lo, hi, window] : parse_windows(attention_window, n_layer)) {
    if (block >= lo && block <= hi) w = window;
  }
  return w;
}

RecomputePlan recompute_plan(const TrainConfig& train, int n_layer) {
  const std::string& text = train.recompute_layers;
  auto bad = [&](const std::string& why) {
    return Error("config key 'train.recompute_layers': expected \"all\" or \"LO-HI\" (blocks 0.." +
                 std::to_string(n_layer - 1) + "), found \"" + text + "\": " + why);
  };
  RecomputePlan plan;
  plan.mode = train.recompute;
  if (text == "all") {
    plan.last_block = n_layer - 1;
    return plan;
  }
  std::tie(plan.first_block, plan.last_block) = block_range(text, n_layer, bad);
  return plan;
}

std::vector<std::pair<int64_t, int>> TrainConfig::seq_len_steps() const {
  std::vector<std::pair<int64_t, int>> out;
  std::istringstream in(seq_len_schedule);
  std::string part;
  while (std::getline(in, part, ',')) {
    const size_t a = part.find_first_not_of(" \t"), b = part.find_last_not_of(" \t");
    if (a == std::string::npos) continue;
    part = part.substr(a, b - a + 1);
    const size_t colon = part.find(':');
    int64_t step = -1;
    int T = 0;
    const char* end = part.data() + part.size();
    const bool ok = colon != std::string::npos &&
                    std::from_chars(part.data(), part.data() + colon, step).ptr == part.data() + colon &&
                    std::from_chars(part.data() + colon + 1, end, T).ptr == end;
    if (!ok || step < 0 || T < 1) {
      throw Error("config key 'train.seq_len_schedule': expected \"step:length, ...\" (e.g. \"100:256, 200:512\"), "
                  "found \"" + part + "\" in \"" + seq_len_schedule + "\"");
    }
    if (!out.empty() && step <= out.back().first) {
      throw Error("config key 'train.seq_len_schedule': expected increasing steps, found " + std::to_string(step) +
                  " after " + std::to_string(out.back().first) + " in \"" + seq_len_schedule + "\"");
    }
    out.emplace_back(step, T);
  }
  return out;
}

int TrainConfig::seq_len_at(int64_t step) const {
  if (seq_len_schedule.empty()) return seq_len;
  int T = seq_len;
  for (const auto& [from, length] : seq_len_steps()) {
    if (step >= from) T = length;
  }
  return T;
}

int TrainConfig::longest_seq_len() const {
  int T = seq_len;
  if (!seq_len_schedule.empty()) {
    for (const auto& [from, length] : seq_len_steps()) T = std::max(T, length);
  }
  return T;
}

std::string TrainConfig::describe_seq_lens() const {
  std::string out;
  int64_t from = 0;
  int T = seq_len;
  for (const auto& [step, length] : seq_len_steps()) {
    out += std::to_string(T) + " in steps " + std::to_string(from + 1) + "-" + std::to_string(step) + ", ";
    from = step;
    T = length;
  }
  return out + std::to_string(T) + " from step " + std::to_string(from + 1) + " (activations for " +
         std::to_string(longest_seq_len()) + "; validation at the coming step's length)";
}

bool experts_held_alone(const ParallelConfig& p, int group_ranks) {
  return p.expert > 1 && p.expert == group_ranks && p.pipeline == 1;
}

int llama_ffn_hidden(int n_embd, int multiple_of, double multiplier) {
  int64_t hidden = 2 * (4 * static_cast<int64_t>(n_embd)) / 3;
  if (multiplier > 0) hidden = static_cast<int64_t>(multiplier * static_cast<double>(hidden));
  return static_cast<int>((hidden + multiple_of - 1) / multiple_of * multiple_of);
}

namespace {

// The model.moe_* keys of a resolved llama model section.
template <typename Need>
void validate_moe(const ModelConfig& m, Need need) {
  auto s = [](auto v) { return std::to_string(v); };
  need(m.moe_experts >= 0 && m.moe_experts <= 4096, "model.moe_experts: expected 0 (dense) .. 4096, found " + s(m.moe_experts));
  if (!m.moe()) {
    need(m.moe_top_k == 0 && m.moe_shared_experts <= 0 && m.moe_every == 0 && m.moe_hidden == 0 && m.moe_capacity == 0 &&
             m.moe_balance == MoeBalance::aux,
         "model.moe_experts: the model.moe_* keys need model.moe_experts > 0 (a mixture of experts), found 0");
    return;
  }
  need(m.moe_top_k >= 1 && m.moe_top_k <= m.moe_experts,
       "model.moe_top_k: expected 1..moe_experts=" + s(m.moe_experts) + " experts per token, found " + s(m.moe_top_k));
  need(m.moe_shared_experts >= 0 && m.moe_shared_experts <= 64,
       "model.moe_shared_experts: expected 0..64, found " + s(m.moe_shared_experts));
  need(m.moe_every >= 1 && m.n_layer % m.moe_every == 0,
       "model.moe_every: expected a divisor of n_layer=" + s(m.n_layer) + " (every moe_every-th block is MoE), found " +
           s(m.moe_every));
  need(m.moe_hidden >= 1 && m.moe_hidden <= (1 << 20), "model.moe_hidden: expected 1..1048576, found " + s(m.moe_hidden));
  need(m.moe_aux_weight >= 0 && std::isfinite(m.moe_aux_weight),
       "model.moe_aux_weight: expected a finite weight >= 0, found " + std::to_string(m.moe_aux_weight));
  need(m.moe_capacity == 0 || (m.moe_capacity > 0 && m.moe_capacity <= 1024),
       "model.moe_capacity: expected 0 (dropless) or a capacity factor in (0, 1024], found " + std::to_string(m.moe_capacity));
  need(m.moe_bias_rate > 0 && m.moe_bias_rate <= 1,
       "model.moe_bias_rate: expected a step in (0, 1] per optimizer step, found " + std::to_string(m.moe_bias_rate));
}

}  // namespace

void validate_model(const ModelConfig& m, const std::string& where) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) throw Error(where + ": " + what);
  };
  auto s = [](int v) { return std::to_string(v); };
  need(m.n_layer >= 1 && m.n_layer <= 1024, "model.n_layer: expected 1..1024, found " + s(m.n_layer));
  need(m.n_head >= 1, "model.n_head: expected >= 1, found " + s(m.n_head));
  need(m.n_embd >= 1 && m.n_embd <= 65536, "model.n_embd: expected 1..65536, found " + s(m.n_embd));
  need(m.n_embd % m.n_head == 0, "model.n_head: expected a divisor of n_embd=" + s(m.n_embd) + ", found " +
                                     s(m.n_head));
  need(m.vocab_size >= 2 && m.vocab_size <= kMaxVocabSize,
       "model.vocab_size: expected 2..16777216, found " + s(m.vocab_size));
  need(m.padded_vocab_size >= m.vocab_size,
       "model.padded_vocab_size: expected >= vocab_size=" + s(m.vocab_size) + ", found " + s(m.padded_vocab_size));
  need(m.max_seq_len >= 1, "model.max_seq_len: expected >= 1, found " + s(m.max_seq_len));
  // (A model section built in code rather than resolved from a config may leave the family, and
  // GPT-2's n_kv_head and ffn_hidden, empty: that is GPT-2.)
  if (!m.llama()) {
    // GPT-2 has learned positions, a 4C GELU MLP, no grouped-query attention and a tied head.
    need(m.n_kv_head == 0 || m.n_kv_head == m.n_head,
         "model.n_kv_head: GPT-2 has no grouped-query attention (it is a llama option)");
    need(m.ffn_hidden == 0 || m.ffn_hidden == 4 * m.n_embd, "model.ffn_hidden: GPT-2's MLP is 4 x n_embd (a llama option)");
    need(m.ffn_multiple_of == 0 && m.ffn_dim_multiplier == 0,
         "model.ffn_multiple_of / ffn_dim_multiplier: llama options, GPT-2's MLP is 4 x n_embd");
    need(m.rope_theta == 0, "model.rope_theta: GPT-2 has learned positions, not rotary embeddings (a llama option)");
    need(m.rope_scaling == RopeScaling::none, "model.rope_scaling: GPT-2 has learned positions, not rotary embeddings (a llama option)");
    need(m.tie_embeddings.value_or(true), "model.tie_embeddings: GPT-2's head is always tied to the embedding");
    need(m.moe_experts == 0 && m.moe_top_k == 0 && m.moe_shared_experts <= 0 && m.moe_every == 0 && m.moe_hidden == 0 &&
             m.moe_capacity == 0,
         "model.moe_experts: a mixture of experts is a llama option (GPT-2 has no MoE blocks; "
         "model.moe_* keys need model.family = \"llama\")");
  } else {
    need(m.n_kv_head >= 1 && m.n_head % m.n_kv_head == 0,
         "model.n_kv_head: expected a divisor of n_head=" + s(m.n_head) + ", found " + s(m.n_kv_head));
    need(m.ffn_hidden >= 1 && m.ffn_hidden <= (1 << 20), "model.ffn_hidden: expected 1..1048576, found " + s(m.ffn_hidden));
    need(m.rope_theta > 0 && std::isfinite(m.rope_theta), "model.rope_theta: expected > 0");
    need(m.rope_factor >= 1 && std::isfinite(m.rope_factor), "model.rope_factor: expected >= 1, found " + std::to_string(m.rope_factor));
    if (m.rope_scaling == RopeScaling::llama3) {
      need(m.rope_low_freq_factor > 0 && m.rope_high_freq_factor > m.rope_low_freq_factor &&
               std::isfinite(m.rope_high_freq_factor),
           "model.rope_high_freq_factor: expected above rope_low_freq_factor (> 0), found " +
               std::to_string(m.rope_high_freq_factor) + " and " + std::to_string(m.rope_low_freq_factor));
      need(m.rope_original_max_seq_len >= 1, "model.rope_original_max_seq_len: expected >= 1, found " +
                                                  s(m.rope_original_max_seq_len));
    }
    need(m.n_embd % m.n_head == 0 && (m.n_embd / m.n_head) % 2 == 0,
         "model.n_head: llama's rotary embedding needs an even head size, found n_embd / n_head = " +
             s(m.n_embd / std::max(1, m.n_head)));
    need(m.tie_embeddings.has_value(), "model.tie_embeddings: not resolved");
    validate_moe(m, need);
  }
  bool windowed = m.dynamic_window();
  for (const auto& [lo, hi, w] : parse_windows(m.attention_window, m.n_layer)) windowed = windowed || w > 0;  // throws
  need(m.dynamic_window_mass > 0 && m.dynamic_window_mass < 1, "model.dynamic_window_mass: expected 0 < mass < 1, found " +
                                                                   std::to_string(m.dynamic_window_mass));
  need(m.dynamic_window_loss >= 0 && m.dynamic_window_loss < 1, "model.dynamic_window_loss: expected 0 <= loss < 1, found " +
                                                                    std::to_string(m.dynamic_window_loss));
  need(m.dynamic_window_min >= 1, "model.dynamic_window_min: expected >= 1, found " + s(m.dynamic_window_min));
  need(m.dynamic_window_every >= 1, "model.dynamic_window_every: expected >= 1, found " + s(m.dynamic_window_every));
  if (!m.dynamic_windows_state.empty()) {
    need(m.dynamic_window(), "model.dynamic_windows_state: only with model.attention_window = \"dynamic\"");
    std::istringstream in(m.dynamic_windows_state);
    std::string part;
    int count = 0;
    for (; std::getline(in, part, ','); ++count) {
      need(!part.empty() && part.find_first_not_of("0123456789") == std::string::npos,
           "model.dynamic_windows_state: expected a window (>= 0) per block, found \"" + m.dynamic_windows_state + "\"");
    }
    need(count == m.n_layer, "model.dynamic_windows_state: expected " + s(m.n_layer) + " windows (one per block), found " + s(count));
  }
  need(!windowed || m.attention == Attention::blockwise,
       "model.attention_window: a window skips tiles of the blockwise kernel; model.attention = \"dense\" has none");
}

void Config::resolve(int world_size) {
  const ModelPreset* preset = nullptr;
  std::string names;
  for (const ModelPreset& p : model_presets()) {
    if (model.preset == p.name) preset = &p;
    names += (names.empty() ? "" : ", ") + std::string(p.name);
  }
  require(preset != nullptr, "model.preset", "one of " + names, "'" + model.preset + "'");
  if (model.n_layer == 0) model.n_layer = preset->n_layer;
  if (model.n_head == 0) model.n_head = preset->n_head;
  if (model.n_embd == 0) model.n_embd = preset->n_embd;
  if (model.vocab_size == 0) model.vocab_size = preset->vocab_size;
  if (model.max_seq_len == 0) model.max_seq_len = std::max(preset->max_seq_len, train.seq_len);
  // Padded only from a vocabulary validate_model accepts; a larger one is reported there, not overflowed here.
  if (model.padded_vocab_size == 0 && model.vocab_size > 0 && model.vocab_size <= kMaxVocabSize) {
    model.padded_vocab_size = (model.vocab_size + 127) / 128 * 128;
  }
  if (!model.family.has_value()) model.family = preset->family;
  if (model.attention == Attention::automatic) {
    // Where nothing measures (config checks, the simulator, imports): dense up to 255 tokens,
    // blockwise from 256 (kernels_bench on the 2-core Xeon, 2026-12); only blockwise has windows.
    // `keel train` measures instead (runtime/attention_choice.h) and replaces this resolution.
    // Context parallelism runs ring attention on the blockwise kernel only.
    model.attention = train.longest_seq_len() >= 256 || model.window_asked() || parallel.context > 1
                          ? Attention::blockwise
                          : Attention::dense;
  }
  if (model.family == Family::llama) {
    const bool llama_preset = preset->family == Family::llama;
    if (model.n_kv_head == 0) model.n_kv_head = llama_preset && preset->n_kv_head > 0 ? preset->n_kv_head : model.n_head;
    if (model.ffn_multiple_of == 0) model.ffn_multiple_of = llama_preset ? preset->ffn_multiple_of : 256;
    require(model.ffn_multiple_of >= 1, "model.ffn_multiple_of", ">= 1", std::to_string(model.ffn_multiple_of));
    require(model.ffn_dim_multiplier >= 0 && model.ffn_dim_multiplier <= 64, "model.ffn_dim_multiplier",
            "0 (none) .. 64", std::to_string(model.ffn_dim_multiplier));
    require(model.n_embd >= 1 && model.n_embd <= 65536, "model.n_embd", "1..65536", std::to_string(model.n_embd));
    if (model.ffn_dim_multiplier == 0 && llama_preset) model.ffn_dim_multiplier = preset->ffn_dim_multiplier;
    if (model.ffn_hidden == 0) {
      model.ffn_hidden = llama_ffn_hidden(model.n_embd, model.ffn_multiple_of, model.ffn_dim_multiplier);
    }
    if (model.rope_theta == 0) model.rope_theta = llama_preset && preset->rope_theta > 0 ? preset->rope_theta : 10000.0;
    if (!model.tie_embeddings.has_value()) model.tie_embeddings = llama_preset ? preset->tie_embeddings : false;
    if (model.moe_experts == 0 && llama_preset) model.moe_experts = preset->moe_experts;
    if (model.moe()) {
      const bool moe_preset = llama_preset && preset->moe_experts > 0;
      if (model.moe_top_k == 0) model.moe_top_k = moe_preset ? preset->moe_top_k : std::min(2, model.moe_experts);
      if (model.moe_shared_experts < 0) model.moe_shared_experts = moe_preset ? preset->moe_shared_experts : 0;
      if (model.moe_every == 0) model.moe_every = 1;
      if (model.moe_hidden == 0) model.moe_hidden = moe_preset ? preset->moe_hidden : model.ffn_hidden;
    }
  } else if (model.family == Family::gpt2) {
    if (model.n_kv_head == 0) model.n_kv_head = model.n_head;
    if (model.ffn_hidden == 0 && model.n_embd > 0 && model.n_embd <= 65536) model.ffn_hidden = 4 * model.n_embd;
    if (!model.tie_embeddings.has_value()) model.tie_embeddings = true;
  }
  validate_model(model, "config");
  for (int b = 0; b < model.n_layer; ++b) {
    const int w = model.window_of(b);
    require(w <= train.longest_seq_len(), "model.attention_window",
            "windows of at most train.seq_len = " + std::to_string(train.longest_seq_len()) + " keys (block " +
                std::to_string(b) + ")",
            std::to_string(w));
  }
  require(!model.dynamic_window() || parallel.pipeline <= 1, "model.attention_window",
          "not \"dynamic\" with parallel.pipeline > 1 (each stage would probe only its own layers: the windows "
          "are not yet gathered over the stages)",
          "\"dynamic\"");

  auto s = [](auto v) { return std::to_string(v); };
  // The layout's arithmetic (the pipeline section's own checks run with it, in resolve_job_config).
  require(parallel.pipeline >= 1, "parallel.pipeline", ">= 1", s(parallel.pipeline));
  require(parallel.tensor >= 1, "parallel.tensor", ">= 1", s(parallel.tensor));
  require(parallel.context >= 1, "parallel.context", ">= 1", s(parallel.context));
  require(world_size % parallel.pipeline == 0, "parallel.pipeline",
          "a divisor of the " + s(world_size) + " rank(s) of this job (world = data x pipeline x tensor)", s(parallel.pipeline));
  require(world_size % (parallel.pipeline * parallel.tensor) == 0, "parallel.tensor",
          "pipeline x tensor (" + s(parallel.pipeline) + " x " + s(parallel.tensor) + ") dividing the " + s(world_size) +
              " rank(s) of this job (world = data x pipeline x tensor)",
          s(parallel.tensor));
  require(world_size % (parallel.pipeline * parallel.tensor * parallel.context) == 0, "parallel.context",
          "pipeline x context x tensor (" + s(parallel.pipeline * parallel.context * parallel.tensor) +
              ") dividing the " + s(world_size) + " rank(s) of this job (world = data x pipeline x context x tensor)",
          s(parallel.context));
  // Ranks per data-parallel replica (a context group's ranks share one replica's sequences).
  const int pp = parallel.pipeline * parallel.tensor * parallel.context;
  const int data_ranks = parallel.data == 0 ? world_size / pp : parallel.data;
  require(parallel.data >= 0, "parallel.data", ">= 0", s(parallel.data));
  require(data_ranks * pp == world_size, "parallel.data",
          "a layout that fits the " + s(world_size) + " rank(s) of this job (data x pipeline " + s(parallel.pipeline) +
              (parallel.context > 1 ? " x context " + s(parallel.context) : std::string()) + " x tensor " +
              s(parallel.tensor) + ")",
          s(parallel.data) + " data-parallel ranks");
  require(parallel.zero >= 0 && parallel.zero <= 3, "parallel.zero", "0, 1, 2 or 3", s(parallel.zero));
  require(parallel.expert >= 1, "parallel.expert", ">= 1", s(parallel.expert));
  if (parallel.expert > 1) {
    require(model.moe(), "parallel.expert", "1 without a mixture of experts (model.moe_experts = 0)", s(parallel.expert));
    require(model.moe_experts % parallel.expert == 0, "parallel.expert",
            "a divisor of the " + s(model.moe_experts) + " experts (model.moe_experts)", s(parallel.expert));
    // (The data group spans data x context: comm/process_groups.h.)
    const int group_ranks = data_ranks * parallel.context;
    require(group_ranks % parallel.expert == 0, "parallel.expert",
            "a divisor of the " + s(group_ranks) + " data-parallel rank(s)" +
                (parallel.context > 1 ? " (data x context)" : "") + " (experts are dealt out within the data group)",
            s(parallel.expert));
  }
  if (model.moe()) {
    // What a mixture of experts does not combine with yet (docs/architecture.md, "Mixture of experts").
    const std::string moe = " with model.moe_experts > 0 (not built yet for a mixture of experts)";
    // (Under ZeRO-3 with tier.experts = "by_frequency" a block gathers only the experts some holder
    // routed rows to: comm/expert_parallel.h experts_gathered_apart.)
    require(!clip.enabled(), "model.moe_experts", "0 in a dual encoder's text tower", s(model.moe_experts));
  }
  if (tier.experts != TierExperts::off) {  // experts homed by their routing shares (runtime/expert_tiers.h)
    const std::string found = "\"" + std::string(to_string(tier.experts)) + "\"";
    require(model.moe(), "tier.experts", "\"off\" without a mixture of experts (model.moe_experts = 0)", found);
    require(tier.device_mib > 0, "tier.experts", "\"off\" without memory tiers (tier.device_mib = 0)", found);
    require(tier.policy == TierPolicy::static_, "tier.policy",
            "\"static\" with tier.experts = \"by_frequency\" (both would re-home the experts' pages)", "\"adaptive\"");
    // (bf16 products are built: the tiers hold the float32 pages and the products round them.)
    // bf16 parameters are kept in this rank's memory, outside the tiers (store/bf16_state.h): the
    // tiers hold no expert parameter page, and homing the experts' gradient pages alone is not
    // built. (bf16 gradients alone are: the tiers hold the experts' parameter pages.)
    require(runtime.param_dtype == StateDtype::fp32, "runtime.param_dtype",
            "\"fp32\" with tier.experts = \"by_frequency\" (bf16 training state keeps the experts' parameter pages "
            "outside the memory tiers, where no routing share can home them; homing their gradient pages alone is not "
            "built)",
            "\"bf16\"");
  }
  require(tier.experts_every >= 1, "tier.experts_every", ">= 1 optimizer steps between re-homings",
          s(tier.experts_every));
  require(parallel.bucket_bytes >= 4096, "parallel.bucket_bytes", ">= 4096", s(parallel.bucket_bytes));
  require(train.global_batch_size >= 0, "train.global_batch_size", ">= 0", s(train.global_batch_size));
  if (train.global_batch_size > 0) {
    require(train.global_batch_size % data_ranks == 0, "train.global_batch_size",
            "a multiple of the " + s(data_ranks) + " data-parallel ranks", s(train.global_batch_size));
    train.batch_size = train.global_batch_size / data_ranks;
  }
  require(train.batch_size >= 1, "train.batch_size", ">= 1", s(train.batch_size));
  require(train.seq_len >= 1 && train.seq_len <= model.max_seq_len, "train.seq_len",
          "1..model.max_seq_len=" + s(model.max_seq_len), s(train.seq_len));
  const int longest = train.longest_seq_len();  // (parses the schedule: a malformed one is named)
  for (const auto& [step, T] : train.seq_len_steps()) {
    require(step > 0 && step < train.steps, "train.seq_len_schedule",
            "steps within the run's 1.." + s(train.steps - 1) + " (before the first, train.seq_len = " + s(train.seq_len) +
                ")",
            s(step) + ":" + s(T));
    require(T <= model.max_seq_len, "train.seq_len_schedule", "lengths of 1..model.max_seq_len=" + s(model.max_seq_len),
            s(step) + ":" + s(T));
  }
  std::vector<int> lengths{train.seq_len};
  for (const auto& st : train.seq_len_steps()) lengths.push_back(st.second);
  for (const int T : lengths) {
    require(longest % T == 0, "train.seq_len_schedule",
            "lengths that divide the longest, " + s(longest) + " (the loader reads each window of the longest in parts)",
            s(T));
  }
  require(train.grad_accum >= 1, "train.grad_accum", ">= 1", s(train.grad_accum));
  recompute_plan(train, model.n_layer);  // throws on a range outside the model
  require(train.steps >= 0, "train.steps", ">= 0", s(train.steps));
  require(train.log_every >= 1, "train.log_every", ">= 1", s(train.log_every));
  require(train.eval_every >= 0, "train.eval_every", ">= 0", s(train.eval_every));
  require(train.eval_batches >= 1, "train.eval_batches", ">= 1", s(train.eval_batches));
  require(train.checkpoint_every >= 0, "train.checkpoint_every", ">= 0", s(train.checkpoint_every));
  require(train.checkpoint_every_minutes >= 0 && std::isfinite(train.checkpoint_every_minutes),
          "train.checkpoint_every_minutes", ">= 0", s(train.checkpoint_every_minutes));
  require(optim.skip_nonfinite_steps >= 0, "optim.skip_nonfinite_steps", ">= 0", s(optim.skip_nonfinite_steps));
  require(!train.run_dir.empty(), "train.run_dir", "a directory", "an empty string");
  require(train.init.empty() || !train.init_hf_dir().empty(), "train.init",
          "\"\" or \"hf:DIR\" (a Hugging Face checkpoint directory)", "\"" + train.init + "\"");
  require(train.init.empty() || !clip.enabled(), "train.init", "\"\" for a dual encoder (hf: holds language models)",
          "\"" + train.init + "\"");
  require(train.sample_tokens >= 0, "train.sample_tokens", ">= 0", s(train.sample_tokens));
  require(train.samples >= 0, "train.samples", ">= 0", s(train.samples));
  // The optimizer computes in float32: a setting that rounds to 0 (or to a denormal, or to 1 for
  // a beta) there would silently train nothing, or stop a moment from moving.
  auto normal_float = [](double v) {
    const float f = static_cast<float>(v);
    return std::isfinite(f) && f >= std::numeric_limits<float>::min();
  };
  auto g = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%.9g", v);
    return std::string(text);
  };
  const std::string normal_floats = " (float32's normal range, " + g(std::numeric_limits<float>::min()) + " to " +
                                    g(std::numeric_limits<float>::max()) + ")";
  require(normal_float(optim.lr), "optim.lr", "> 0" + normal_floats, g(optim.lr));
  require(optim.min_lr_ratio >= 0 && optim.min_lr_ratio <= 1, "optim.min_lr_ratio", "0..1", g(optim.min_lr_ratio));
  require(optim.min_lr_ratio == 0 || normal_float(optim.lr * optim.min_lr_ratio), "optim.min_lr_ratio",
          "0, or a final rate optim.lr * min_lr_ratio" + normal_floats, g(optim.min_lr_ratio));
  require(optim.warmup_steps >= 0, "optim.warmup_steps", ">= 0", s(optim.warmup_steps));
  require(optim.weight_decay == 0 || normal_float(optim.weight_decay), "optim.weight_decay", "0, or > 0" + normal_floats,
          g(optim.weight_decay));
  require(optim.beta1 >= 0 && static_cast<float>(optim.beta1) < 1, "optim.beta1", "0 <= beta1 < 1 (in float32)",
          g(optim.beta1));
  require(optim.beta2 >= 0 && static_cast<float>(optim.beta2) < 1, "optim.beta2", "0 <= beta2 < 1 (in float32)",
          g(optim.beta2));
  require(normal_float(optim.eps), "optim.eps", "> 0" + normal_floats, g(optim.eps));
  require(optim.grad_clip >= 0, "optim.grad_clip", ">= 0", s(optim.grad_clip));
  require(optim.freeze_layers >= 0 && optim.freeze_layers <= model.n_layer + 2, "optim.freeze_layers",
          "0.." + s(model.n_layer + 2) + " (layers: embeddings, " + s(model.n_layer) + " blocks, head)",
          s(optim.freeze_layers));
  require(optim.freeze_at_step >= 0, "optim.freeze_at_step", ">= 0", s(optim.freeze_at_step));
  require(checkpoint.full_every >= 1, "checkpoint.full_every", ">= 1", s(checkpoint.full_every));
  require(checkpoint.keep >= 1, "checkpoint.keep", ">= 1", s(checkpoint.keep));
  require(checkpoint.memory_every >= 0, "checkpoint.memory_every", ">= 0 (0 = off)", s(checkpoint.memory_every));
  // A dynamic window's state rides in the disk checkpoint's config, which a memory copy has not.
  require(checkpoint.memory_every == 0 || !model.dynamic_window(), "checkpoint.memory_every",
          "0 with model.attention_window = \"dynamic\" (its state is kept in disk checkpoints only)",
          s(checkpoint.memory_every));
  require(store.chunk_bytes >= 4096 && store.chunk_bytes % 4096 == 0, "store.chunk_bytes",
          "a multiple of 4096", s(store.chunk_bytes));
  require(runtime.threads >= 0, "runtime.threads", ">= 0", s(runtime.threads));
  require(runtime.slow_rank >= -1, "runtime.slow_rank", "a world rank or -1", s(runtime.slow_rank));
  require(runtime.slow_factor >= 1 && runtime.slow_factor <= 100, "runtime.slow_factor", "1..100", s(runtime.slow_factor));
  require(runtime.peak_gflops >= 0, "runtime.peak_gflops", ">= 0", s(runtime.peak_gflops));
  require(monitor.port >= 0 && monitor.port <= 65535, "monitor.port", "0 (off) or 1..65535", s(monitor.port));
  require(monitor.enabled || monitor.port == 0, "monitor.port", "0 while monitor.enabled = false", s(monitor.port));
  {
    const std::string& b = monitor.bind;
    const bool loopback = b == "127.0.0.1" || b == "localhost" || b == "::1" || b == "[::1]";
    require(loopback || monitor.allow_remote, "monitor.bind",
            "a loopback address (127.0.0.1, ::1) unless monitor.allow_remote = true", "\"" + b + "\"");
  }
  require(monitor.min_hit_rate >= 0 && monitor.min_hit_rate <= 1, "monitor.min_hit_rate", "0..1", s(monitor.min_hit_rate));
  require(monitor.max_bubble >= 0 && monitor.max_bubble <= 1, "monitor.max_bubble", "0..1", s(monitor.max_bubble));
  require(monitor.max_sync_jitter >= 0, "monitor.max_sync_jitter", ">= 0", s(monitor.max_sync_jitter));
  require(monitor.loss_spike > 1, "monitor.loss_spike", "> 1", s(monitor.loss_spike));
  require(monitor.stall_factor > 1, "monitor.stall_factor", "> 1", s(monitor.stall_factor));
  require(monitor.alert_after >= 1, "monitor.alert_after", ">= 1", s(monitor.alert_after));
  require(monitor.max_moe_imbalance >= 1, "monitor.max_moe_imbalance", ">= 1 (the busiest expert over the mean)",
          s(monitor.max_moe_imbalance));
  require(monitor.moe_imbalance_after >= 1, "monitor.moe_imbalance_after", ">= 1", s(monitor.moe_imbalance_after));
  require(monitor.layer_costs_every >= 0, "monitor.layer_costs_every", ">= 0", s(monitor.layer_costs_every));
  require(monitor.cpu_watts > 0 && monitor.cpu_watts < 1000, "monitor.cpu_watts", "0 < watts < 1000", s(monitor.cpu_watts));
  validate(generate);
}

std::string Config::to_toml() const {
  Config copy = *this;
  std::ostringstream out;
  std::string section;
  for (const Field& f : fields(copy)) {
    if (section != f.section) {
      section = f.section;
      out << (out.tellp() > 0 ? "\n" : "") << "[" << section << "]\n";
    }
    // An optional key nobody set (an unresolved config) is left out, to be resolved on reading.
    if (const auto* o = std::get_if<std::optional<bool>*>(&f.target); o != nullptr && !(*o)->has_value()) continue;
    out << f.key << " = " << toml_value(f) << "\n";
  }
  return out.str();
}

uint64_t Config::trajectory_hash(int world_size) const {
  std::ostringstream s;
  s << shape_hash() << ';' << optim.lr << ',' << optim.min_lr_ratio << ',' << optim.warmup_steps << ','
    << optim.weight_decay << ',' << optim.beta1 << ',' << optim.beta2 << ',' << optim.eps << ',' << optim.grad_clip
    << ',' << optim.freeze_layers << ';' << train.seed << ',' << train.seq_len << ','
    << static_cast<int64_t>(train.batch_size) *
           (world_size / std::max(1, parallel.pipeline * parallel.tensor * parallel.context)) *
           train.grad_accum;
  if (optim.freeze_at_step > 0) s << ";freeze at " << optim.freeze_at_step;
  if (!train.seq_len_schedule.empty()) {
    s << ";lengths";
    for (const auto& [step, T] : train.seq_len_steps()) s << ' ' << step << ':' << T;
  }
  if (!data.shuffle) s << ";file order";  // (absent by default: older checkpoints keep their hash)
  if (model.moe()) s << ";moe " << model.moe_aux_weight << ',' << model.moe_capacity;
  if (model.moe() && model.moe_balance == MoeBalance::bias) s << ";bias " << model.moe_bias_rate;
  if (model.rope_scaling != RopeScaling::none) s << ";rope " << to_string(model.rope_scaling) << ',' << model.rope_factor;
  if (model.rope_scaling == RopeScaling::llama3) {
    s << ',' << model.rope_low_freq_factor << ',' << model.rope_high_freq_factor << ',' << model.rope_original_max_seq_len;
  }
  const std::string text = s.str();
  return XXH64(text.data(), text.size(), 0);
}

uint64_t Config::shape_hash() const {
  std::ostringstream s;
  s << model.n_layer << ',' << model.n_head << ',' << model.n_embd << ',' << model.vocab_size << ','
    << model.padded_vocab_size << ',' << model.max_seq_len << ',' << store.chunk_bytes;
  if (model.llama()) {  // (GPT-2 configs keep the hash they always had)
    s << ",llama," << model.n_kv_head << ',' << model.ffn_hidden << ',' << model.rope_theta << ','
      << model.tie_embeddings.value_or(false);
    if (model.moe()) {  // (dense configs keep their hash)
      s << ",moe," << model.moe_experts << ',' << model.moe_top_k << ',' << model.moe_shared_experts << ','
        << model.moe_every << ',' << model.moe_hidden;
    }
  }
  if (clip.enabled()) {  // a dual encoder's state: both towers and the temperature
    s << ",clip," << to_string(*clip.image_tower) << ',' << clip.image_width << ',' << clip.image_size << ','
      << clip.embed_dim;
    if (clip.image_tower == ImageTower::vit) {
      s << ",vit," << clip.vit_patch << ',' << clip.vit_layers << ',' << clip.vit_width << ',' << clip.vit_heads;
    }
  }
  const std::string text = s.str();
  return XXH64(text.data(), text.size(), 0);
}

}  // namespace keel
