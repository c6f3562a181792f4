// The job configuration: one TOML file whose sections mirror the components, every key
// overridable on the command line as `--set section.key=value`. Unknown keys, mistyped values
// and impossible combinations are errors that name the key; nothing is silently defaulted.
#pragma once

#include <array>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/error.h"

namespace keel {

// Every configuration choice with a closed set of values is one of these enums, parsed once when
// the config is read (a TOML file, `--set`) and written back with the same spelling. Each enum's
// spellings are one table (EnumNames below); to_string and parse_enum read it, and a bad value gets
// the one-line error of that table, naming the key. Components compare enums, never strings.

enum class Family : uint8_t { gpt2, llama };                 // model.family
enum class RopeScaling : uint8_t { none, linear, ntk, llama3 };  // model.rope_scaling
enum class MoeBalance : uint8_t { aux, bias };                // model.moe_balance
enum class Attention : uint8_t { automatic, dense, blockwise };  // model.attention ("auto" = resolved to one of the others)
enum class Precision : uint8_t { fp32, bf16 };               // runtime.precision
enum class StateDtype : uint8_t { fp32, bf16 };              // runtime.param_dtype, runtime.grad_dtype
enum class Recompute : uint8_t { none, selective, full };      // train.recompute
// parallel.schedule: "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v" (pipeline/schedule.h).
enum class ScheduleKind : uint8_t { gpipe, one_f_one_b, interleaved, zb_h1, zb_h2, zb_v };
enum class PartitionerKind : uint8_t { static_, dp, qlearning };  // parallel.partitioner
enum class Zero3Keep : uint8_t { none, last, all };             // parallel.zero3_keep
enum class PredictGradients : uint8_t { off, mean, previous, momentum, lstm };  // parallel.predict_gradients
// A gradient codec (comm/codec.h): "none", "fp16", "bf16", "sign1", "quant2-topk", "topk", "randk".
enum class CodecKind : uint8_t { none, fp16, bf16, sign1, quant2_topk, topk, randk };
// sync.codec: one codec for every chunk, or "hybrid" (a codec per layer depth, from sync.policy).
// The values shared with CodecKind are equal (uniform_codec).
enum class SyncCodec : uint8_t { none, fp16, bf16, sign1, quant2_topk, topk, randk, hybrid };
// sync.shape: how a dense codec's bucket is summed (comm/compressed_allreduce.h).
enum class SumShape : uint8_t { automatic, two_phase, gather };
// A memory tier (store/tiers.h): tier.embedding, attention, ffn, norm, optimizer.
enum class Tier : uint8_t { device = 0, host = 1, nvme = 2 };
enum class IoEngine : uint8_t { automatic, io_uring, threads };  // tier.engine (store/block_file.h)
enum class TierPolicy : uint8_t { static_, adaptive };            // tier.policy
enum class TierExperts : uint8_t { off, by_frequency };           // tier.experts
enum class KvTier : uint8_t { host, nvme };                        // generate.kv_tier
// clip.image_tower ("" = none: a language model run).
enum class ImageTower : uint8_t { resnet18, resnet34, resnet50, resnet101, resnet152, vit };
enum class VisualQuant : uint8_t { none, bf16, int8 };  // clip.visual_quant
enum class GradBalance : uint8_t { none, norm };         // clip.grad_balance

// The spellings of a configuration enum (every value once), and the one-line error for a value
// that is none of them: `error` with {key} and {found} replaced by the key and the value found.
template <typename E>
struct EnumNames;

template <typename E>
concept ConfigEnum = requires { EnumNames<E>::names; EnumNames<E>::error; };

#define KEEL_ENUM_NAMES(E, ERROR, ...)                                        \
  template <>                                                                 \
  struct EnumNames<E> {                                                       \
    static constexpr std::pair<E, const char*> names[] = {__VA_ARGS__};       \
    static constexpr const char* error = ERROR;                               \
  }

KEEL_ENUM_NAMES(Family, "{key}: expected \"gpt2\" or \"llama\", found \"{found}\"",  //
                {Family::gpt2, "gpt2"}, {Family::llama, "llama"});
KEEL_ENUM_NAMES(RopeScaling, "{key}: expected none, linear, ntk or llama3, found \"{found}\"",  //
                {RopeScaling::none, "none"}, {RopeScaling::linear, "linear"}, {RopeScaling::ntk, "ntk"},
                {RopeScaling::llama3, "llama3"});
KEEL_ENUM_NAMES(MoeBalance, "config key '{key}': expected \"aux\" or \"bias\", found \"{found}\"",  //
                {MoeBalance::aux, "aux"}, {MoeBalance::bias, "bias"});
KEEL_ENUM_NAMES(Attention, "{key}: expected \"auto\", \"blockwise\" or \"dense\", found \"{found}\"",  //
                {Attention::automatic, "auto"}, {Attention::dense, "dense"}, {Attention::blockwise, "blockwise"});
KEEL_ENUM_NAMES(Recompute, "config key '{key}': expected \"none\", \"selective\" or \"full\", found \"{found}\"",  //
                {Recompute::none, "none"}, {Recompute::selective, "selective"}, {Recompute::full, "full"});
KEEL_ENUM_NAMES(Precision, "config key '{key}': expected \"fp32\" or \"bf16\", found \"{found}\"",  //
                {Precision::fp32, "fp32"}, {Precision::bf16, "bf16"});
KEEL_ENUM_NAMES(StateDtype, "config key '{key}': expected \"fp32\" or \"bf16\", found \"{found}\"",  //
                {StateDtype::fp32, "fp32"}, {StateDtype::bf16, "bf16"});
KEEL_ENUM_NAMES(ScheduleKind, "{key}: expected one of gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, found \"{found}\"",
                {ScheduleKind::gpipe, "gpipe"}, {ScheduleKind::one_f_one_b, "1f1b"},
                {ScheduleKind::interleaved, "interleaved"}, {ScheduleKind::zb_h1, "zb-h1"},
                {ScheduleKind::zb_h2, "zb-h2"}, {ScheduleKind::zb_v, "zb-v"});
KEEL_ENUM_NAMES(Zero3Keep, "config key '{key}': expected \"none\", \"last\" or \"all\", found \"{found}\"",  //
                {Zero3Keep::none, "none"}, {Zero3Keep::last, "last"}, {Zero3Keep::all, "all"});
KEEL_ENUM_NAMES(PartitionerKind, "config key '{key}': expected static, dp or qlearning, found \"{found}\"",  //
                {PartitionerKind::static_, "static"}, {PartitionerKind::dp, "dp"},
                {PartitionerKind::qlearning, "qlearning"});
KEEL_ENUM_NAMES(PredictGradients,
                "config key '{key}': expected off, mean, previous, momentum or lstm, found \"{found}\"",  //
                {PredictGradients::off, "off"}, {PredictGradients::mean, "mean"},
                {PredictGradients::previous, "previous"}, {PredictGradients::momentum, "momentum"},
                {PredictGradients::lstm, "lstm"});
KEEL_ENUM_NAMES(CodecKind,
                "config key '{key}': unknown gradient codec \"{found}\" (expected one of: none, fp16, bf16, sign1, "
                "quant2-topk, topk, randk)",
                {CodecKind::none, "none"}, {CodecKind::fp16, "fp16"}, {CodecKind::bf16, "bf16"},
                {CodecKind::sign1, "sign1"}, {CodecKind::quant2_topk, "quant2-topk"}, {CodecKind::topk, "topk"},
                {CodecKind::randk, "randk"});
KEEL_ENUM_NAMES(SumShape, "config key '{key}': expected \"auto\", \"two-phase\" or \"gather\", found \"{found}\"",  //
                {SumShape::automatic, "auto"}, {SumShape::two_phase, "two-phase"}, {SumShape::gather, "gather"});
KEEL_ENUM_NAMES(Tier, "config key '{key}': unknown tier \"{found}\" (expected one of: device, host, nvme)",  //
                {Tier::device, "device"}, {Tier::host, "host"}, {Tier::nvme, "nvme"});
KEEL_ENUM_NAMES(IoEngine,
                "config key '{key}': unknown I/O engine \"{found}\" (expected one of: auto, io_uring, threads)",  //
                {IoEngine::automatic, "auto"}, {IoEngine::io_uring, "io_uring"}, {IoEngine::threads, "threads"});
KEEL_ENUM_NAMES(TierPolicy, "config key '{key}': expected \"static\" or \"adaptive\", found \"{found}\"",  //
                {TierPolicy::static_, "static"}, {TierPolicy::adaptive, "adaptive"});
KEEL_ENUM_NAMES(TierExperts, "config key '{key}': expected \"off\" or \"by_frequency\", found \"{found}\"",  //
                {TierExperts::off, "off"}, {TierExperts::by_frequency, "by_frequency"});
KEEL_ENUM_NAMES(KvTier, "config key '{key}': expected host or nvme, found \"{found}\"",  //
                {KvTier::host, "host"}, {KvTier::nvme, "nvme"});
KEEL_ENUM_NAMES(ImageTower,
                "config key '{key}': expected resnet18, resnet34, resnet50, resnet101, resnet152 or vit (\"\" = a "
                "language model run), found \"{found}\"",
                {ImageTower::resnet18, "resnet18"}, {ImageTower::resnet34, "resnet34"},
                {ImageTower::resnet50, "resnet50"}, {ImageTower::resnet101, "resnet101"},
                {ImageTower::resnet152, "resnet152"}, {ImageTower::vit, "vit"});
KEEL_ENUM_NAMES(VisualQuant, "config key '{key}': expected \"none\", \"bf16\" or \"int8\", found \"{found}\"",  //
                {VisualQuant::none, "none"}, {VisualQuant::bf16, "bf16"}, {VisualQuant::int8, "int8"});
KEEL_ENUM_NAMES(GradBalance, "config key '{key}': expected \"none\" or \"norm\", found \"{found}\"",  //
                {GradBalance::none, "none"}, {GradBalance::norm, "norm"});
#undef KEEL_ENUM_NAMES

// sync.codec's names: the codecs' own, and "hybrid".
template <>
struct EnumNames<SyncCodec> {
  static constexpr auto names = [] {
    std::array<std::pair<SyncCodec, const char*>, std::size(EnumNames<CodecKind>::names) + 1> out{};
    size_t i = 0;
    for (const auto& [kind, name] : EnumNames<CodecKind>::names) out[i++] = {static_cast<SyncCodec>(kind), name};
    out[i] = {SyncCodec::hybrid, "hybrid"};
    return out;
  }();
  static constexpr const char* error =
      "config key '{key}': unknown gradient codec \"{found}\" (expected one of: none, fp16, bf16, sign1, quant2-topk, "
      "topk, randk, hybrid)";
};

// The config's spelling of `value`.
template <ConfigEnum E>
constexpr const char* to_string(E value) {
  for (const auto& [v, name] : EnumNames<E>::names) {
    if (v == value) return name;
  }
  return "?";
}

// The value spelled `text`; nullopt if it is none of the enum's names.
template <ConfigEnum E>
constexpr std::optional<E> parse_enum(std::string_view text) {
  for (const auto& [v, name] : EnumNames<E>::names) {
    if (text == name) return v;
  }
  return std::nullopt;
}

// The enum's error line for `found` as the value of config key `key`.
std::string enum_error(const char* format, const std::string& key, std::string_view found);

// The value spelled `text` for config key `key`; throws keel::Error with the enum's one-line error.
template <ConfigEnum E>
E parse_enum(std::string_view text, const std::string& key) {
  if (const std::optional<E> v = parse_enum<E>(text)) return *v;
  throw Error(enum_error(EnumNames<E>::error, key, text));
}

// In JSON (metrics lines, manifests, `keel simulate --json`) a configuration enum is its spelling.
template <ConfigEnum E>
void to_json(nlohmann::json& j, E value) {
  j = to_string(value);
}

// Every value of the enum, in its table's order.
template <ConfigEnum E>
std::vector<E> enum_values() {
  std::vector<E> out;
  for (const auto& [v, name] : EnumNames<E>::names) out.push_back(v);
  return out;
}

// sync.codec as the codec of every chunk; requires codec != hybrid.
constexpr CodecKind uniform_codec(SyncCodec codec) { return static_cast<CodecKind>(codec); }
static_assert(static_cast<int>(SyncCodec::randk) == static_cast<int>(CodecKind::randk));

struct ModelConfig {
  std::string preset = "d4";  // named size (see model_presets()); explicit keys below override it
  // "gpt2" (learned positions, LayerNorm, GELU MLP, biases, head tied to the embedding) or
  // "llama" (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases); "" (unset) = the preset's.
  std::optional<Family> family;
  int n_layer = 0;            // 0 = take from preset
  int n_head = 0;
  int n_embd = 0;
  int vocab_size = 0;         // 0 = from preset, or from the tokenizer when one is given
  int padded_vocab_size = 0;  // 0 = vocab_size rounded up to a multiple of 128
  int max_seq_len = 0;        // size of the position table (llama: the longest trained sequence)
  // llama only (GPT-2 refuses them; resolved GPT-2 configs hold n_kv_head = n_head, ffn_hidden = 4C):
  int n_kv_head = 0;              // key/value heads (grouped-query attention); 0 = the preset's, else n_head
  int ffn_hidden = 0;             // SwiGLU hidden size; 0 = LLaMA's rule below
  int ffn_multiple_of = 0;        // the rule: 8C/3 (x ffn_dim_multiplier), rounded up to a multiple of this; 0 = preset's
  double ffn_dim_multiplier = 0;  // 0 = none
  double rope_theta = 0;          // RoPE's base; 0 = 10000
  // Past the trained length (docs/architecture.md, "Long context"): "none"; "linear" (position
  // interpolation: positions divided by rope_factor, so factor x the trained length maps onto the
  // trained angles); "ntk" (the base raised to theta * factor^(hs / (hs - 2)): high frequencies kept,
  // the lowest stretched by the factor); "llama3" (Llama 3.1's per-frequency rule, as transformers'
  // rope_type "llama3": frequencies whose wavelength exceeds rope_original_max_seq_len /
  // rope_low_freq_factor divided by rope_factor, those below rope_original_max_seq_len /
  // rope_high_freq_factor kept, the ones between interpolated smoothly).
  RopeScaling rope_scaling = RopeScaling::none;
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;   // rope_scaling = llama3
  double rope_high_freq_factor = 4.0;  // rope_scaling = llama3
  int rope_original_max_seq_len = 8192;  // rope_scaling = llama3: the length the model was trained at
  std::optional<bool> tie_embeddings;  // output head = token embedding; GPT-2: always; llama: the preset's
  // Mixture of experts (llama only; model/moe.h). moe_experts routed experts (0 = the preset's; a
  // dense preset has none): every moe_every-th block (blocks moe_every-1, 2 moe_every-1, ...)
  // replaces its SwiGLU MLP by a softmax router choosing moe_top_k experts per token (0 = the
  // preset's, else 2), each a SwiGLU MLP of moe_hidden units (0 = the preset's, else ffn_hidden),
  // weighted by its router probability, plus moe_shared_experts experts every token passes
  // through. Balancing: "aux" adds moe_aux_weight x the Switch/GShard loss E sum_i f_i P_i, taken
  // per sequence and averaged over the step's sequences (so data-parallel ranks and micro-batches
  // add up to one rank's whole batch); "bias" (DeepSeek's auxiliary-loss-free balancing) adds a
  // per-expert bias to the router probabilities for the top-k choice only (the weights stay the
  // probabilities), moved after every optimizer step by moe_bias_rate x sign(mean load - load)
  // with the loads summed over the data-parallel ranks; the balancing loss still enters the
  // gradient at moe_aux_weight (0 for DeepSeek's setting).
  // moe_capacity: 0 = dropless; c > 0 = each expert takes at most ceil(c T k / E) of a sequence's
  // T tokens (earlier positions first), the others dropped from it (counted).
  int moe_experts = 0;
  int moe_top_k = 0;
  int moe_shared_experts = -1;  // -1 = the preset's (0 for a dense preset)
  int moe_every = 0;            // 0 = the preset's, else 1
  int moe_hidden = 0;
  double moe_aux_weight = 0.01;
  MoeBalance moe_balance = MoeBalance::aux;
  double moe_bias_rate = 0.001;  // moe_balance = "bias": the bias's step per optimizer step
  double moe_capacity = 0;
  bool moe() const { return moe_experts > 0; }
  // Block `block` (0-based) is a mixture of experts; assumes a resolved config.
  bool moe_block(int block) const { return moe() && moe_every > 0 && (block + 1) % moe_every == 0; }
  // Both families. "blockwise": FlashAttention-2's tiles and online softmax, activation memory
  // linear in T; "dense": the T x T probabilities kept (the reference); "auto": with a window,
  // blockwise; else `keel train` measures both at the job's shape on this machine and takes the
  // one faster by more than 10 % (closer: by length), or a resumed checkpoint's kernel
  // (runtime/attention_choice.h, cached per machine and shape); elsewhere blockwise from
  // train.seq_len 256, dense below. Resolved configs hold "dense" or "blockwise".
  Attention attention = Attention::automatic;
  // A sliding window of W keys per query: "" or "0" = none, "W" = every layer, "LO-HI:W,..." =
  // blocks LO..HI (0-based) with window W, the others none.
  std::string attention_window;
  // "dynamic": every block's window adapts while training (runtime/dynamic_windows.h): every
  // dynamic_window_every steps the attention mass each head puts at each distance is measured;
  // for a falling tolerance eps (0.5, 0.25, ... down to dynamic_window_mass) each block's window
  // is the smallest power of two >= dynamic_window_min leaving at most eps of any head's mass
  // outside it, and the first such set of windows whose loss on a probe batch is within
  // dynamic_window_loss (relative) of full attention's is taken; none passes: full attention.
  double dynamic_window_mass = 0.01;
  double dynamic_window_loss = 0.01;
  int dynamic_window_min = 64;
  int dynamic_window_every = 10;
  // The windows a dynamic run has now, "W0,W1,..." per block (0 = none; "" = none yet): kept by
  // the run in the configuration its checkpoints carry, so that a resumed run goes on with them.
  std::string dynamic_windows_state;
  bool dynamic_window() const { return attention_window == "dynamic"; }
  // A window is asked for (a size, ranges or "dynamic"; "" and "0" are none).
  bool window_asked() const { return !attention_window.empty() && attention_window != "0"; }
  // The window of block `block` (0-based), 0 = none; assumes a validated config.
  int window_of(int block) const;
  bool llama() const { return family == Family::llama; }
  // RoPE's angles: position * rope_position_scale() * rope_base()^(-2i / hs).
  double rope_position_scale() const { return rope_scaling == RopeScaling::linear ? 1.0 / rope_factor : 1.0; }
  double rope_base() const;
  // The hs / 2 frequencies of RoPE's pairs: rope_base()^(-2i / hs), each then scaled by the llama3
  // rule when rope_scaling = llama3 (angle = position * rope_position_scale() * frequency[i]).
  std::vector<double> rope_frequencies() const;
  // Where the model sits in a chunk store it shares with other parts of a bigger model (the text
  // tower of a dual encoder): its tensors' names start with tensor_prefix and its layers' store
  // ids with layer_base. Set by the code that builds such a model, never by a config file; a
  // language model has "" and 0.
  std::string tensor_prefix;
  int layer_base = 0;
  // Attention reads only earlier positions (a language model, a text tower); false for an image
  // tower's patches (every one attends to every other; dense attention only). Not from a config file.
  bool causal = true;
  int head_size() const { return n_embd / n_head; }
  int kv_dim() const { return n_kv_head * head_size(); }  // columns of k (and of v)
  int qkv_dim() const { return n_embd + 2 * kv_dim(); }   // [q | k | v] columns
};

struct TrainConfig {
  int batch_size = 16;        // sequences per micro-batch on each data-parallel rank
  int global_batch_size = 0;  // sequences per micro-batch over all ranks; if set, batch_size is
                              // derived from it (it must divide by the number of ranks)
  int seq_len = 128;          // tokens per sequence (of the first steps, with seq_len_schedule)
  int grad_accum = 1;         // micro-batches per optimizer step
  int steps = 300;            // optimizer steps
  uint64_t seed = 1337;
  int log_every = 10;         // progress line every N steps
  int eval_every = 100;       // validation loss every N steps (0 = only at start and end)
  int eval_batches = 16;      // validation batches per evaluation
  int checkpoint_every = 0;   // save run_dir/ckpt every N steps (0 = only at the end)
  // ... and every M minutes of training (0 = not by the clock); rank 0's clock decides the step.
  double checkpoint_every_minutes = 0;
  std::string run_dir = "runs/default";
  std::string resume;         // checkpoint directory to resume from ("" = fresh start; "auto" =
                              // the newest checkpoint of run_dir if there is one, else fresh)
  bool resume_auto() const { return resume == "auto"; }
  // A fresh run's weights: "" = random from seed; "hf:DIR" = a Hugging Face checkpoint directory
  // (config.json + safetensors), whose config.json fills the model section's unset shape keys (a
  // key set to another value is refused). A resumed run takes its checkpoint's weights instead.
  std::string init;
  // DIR of init = "hf:DIR" ("" when init is "").
  std::string init_hf_dir() const { return init.rfind("hf:", 0) == 0 ? init.substr(3) : std::string(); }
  // A fresh start in a run_dir holding an earlier run's checkpoints or metrics is refused unless
  // this is true; then the earlier run is moved aside to run_dir.old-N.
  bool overwrite = false;
  int sample_tokens = 64;     // tokens generated per sample at the end (0 = none)
  int samples = 3;
  // A sequence-length curriculum: "step:T, step:T, ..." (steps increasing, 0 < step < steps):
  // after `step` optimizer steps, sequences of T tokens; before the first, seq_len. Every
  // length divides the longest: the data loader cuts its windows at the longest and reads each in
  // parts at a shorter length (data/loader.h). "" = seq_len throughout.
  std::string seq_len_schedule;
  // Activation recomputation (model/gpt.h): "none" keeps every block's activations from forward to
  // backward; "selective" keeps each block's matrix-product inputs and recomputes attention and the
  // MLP's activation function in backward; "full" keeps only each block's input and runs the
  // block's forward again in backward. recompute_layers: the blocks it applies to, "all" or
  // "LO-HI" (0-based, inclusive, as model.attention_window numbers them).
  Recompute recompute = Recompute::none;
  std::string recompute_layers = "all";

  // The schedule parsed (empty without one); throws keel::Error naming train.seq_len_schedule.
  std::vector<std::pair<int64_t, int>> seq_len_steps() const;
  int seq_len_at(int64_t step) const;  // the length of optimizer step `step` (0-based)
  int longest_seq_len() const;         // what activations, memory caps and the loader's windows are sized for
  std::string describe_seq_lens() const;  // "64 in steps 1-30, 128 from step 31 (...)" (1-based, as progress lines)
};

// What train.recompute asks of a model: the mode and the blocks (0-based, inclusive) it applies to.
struct RecomputePlan {
  Recompute mode = Recompute::none;
  int first_block = 0, last_block = -1;
  // The mode of model layer `layer` (0 = embedding, 1..n_layer = blocks): none outside the blocks.
  Recompute at_layer(int layer) const {
    return layer - 1 >= first_block && layer - 1 <= last_block ? mode : Recompute::none;
  }
};
// train.recompute and train.recompute_layers for a model of n_layer blocks; throws keel::Error
// naming train.recompute_layers when the range is malformed or outside the model.
RecomputePlan recompute_plan(const TrainConfig& train, int n_layer);

struct OptimConfig {
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int warmup_steps = 20;
  double weight_decay = 0.1;  // decoupled; never applied to biases and norms
  // Steps whose loss or gradient norm is NaN or infinite: the run stops at the first (0), or
  // skips up to N of them (no update; counted in metrics as skipped_steps) and stops at the next.
  int skip_nonfinite_steps = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;     // global L2 norm; 0 = off
  int freeze_layers = 0;      // the first N layers (0 = embeddings, 1.. = blocks) are not updated
  int64_t freeze_at_step = 0;  // ... from this (0-based) step on; every layer trains before it
  // The layers frozen in step `step` (0-based).
  int frozen_at(int64_t step) const { return step >= freeze_at_step ? freeze_layers : 0; }
};

struct DataConfig {
  std::string train = "data/fortunes/train.bin";
  std::string val = "data/fortunes/val.bin";
  std::string tokenizer = "data/fortunes/tokenizer.json";  // "" = none (no text samples)
  bool shuffle = true;  // false: training batches in file order, every epoch (as llm.c reads them)
};

struct StoreConfig {
  int64_t chunk_bytes = 4 << 20;  // chunk capacity in bytes (per plane: params, grads, moments)
};

struct ParallelConfig {
  int data = 0;                      // data-parallel ranks; 0 = the whole MPI world
  int64_t bucket_bytes = 8 << 20;    // gradient all-reduce bucket size
  int zero = 0;                      // 0: replicate everything; 1: shard AdamW moments by chunk;
                                     // 2: also reduce-scatter gradients to their owners;
                                     // 3: also shard the parameters (comm/sharded_params.h)
  // ZeRO-3: which gathered layers stay from their forward to their backward (none: every layer is
  // gathered again for its backward; last: the model's last layer stays; all: every layer stays
  // until the optimizer step).
  Zero3Keep zero3_keep = Zero3Keep::none;
  // ZeRO-3: a thread of each rank tests the broadcasts started ahead while the layers compute
  // (forward makes no MPI call between two layers' leases); off, they progress only inside MPI calls.
  bool zero3_progress_thread = true;
  // Pipeline parallelism (pipeline/): the model cut into `pipeline` x virtual_stages stages on as
  // many ranks per data-parallel replica (world = data x pipeline x tensor).
  int pipeline = 1;
  // Tensor parallelism (comm/tensor_parallel.h): every layer split over `tensor` ranks (attention
  // heads, MLP hidden units, vocabulary), world = data x pipeline x tensor, a tensor group's ranks
  // consecutive. 1 = none.
  int tensor = 1;
  // Sequence parallelism (needs tensor > 1): the norms and the residual stream between the
  // tensor-parallel regions held as B*T / tensor rows per rank, gathered before the column-parallel
  // products and reduce-scattered after the row-parallel ones (model/tensor_group.h).
  bool sequence_parallel = false;
  // Context parallelism (model/context_group.h): each sequence split over `context` ranks, world =
  // data x pipeline x context x tensor; rank r of a context group holds chunks r and 2C-1-r of the
  // sequence cut into 2C, and attention passes key/value blocks around the group's ring. 1 = none.
  int context = 1;
  // Expert parallelism (comm/expert_parallel.h): a mixture of experts' routed experts dealt out
  // over `expert` consecutive ranks of the data-parallel group, each rank running the products of
  // its E / expert experts for the tokens every rank of its expert group routes to them (an
  // all-to-all there and back). 1 = none.
  int expert = 1;
  ScheduleKind schedule = ScheduleKind::one_f_one_b;  // gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zb-v
  int virtual_stages = 0;            // stages per rank; 0 = the schedule's (interleaved, zb-v: 2; else 1)
  std::string stage_boundaries;      // first layer of stages 1.. ("3,6"); "" = cut by `partitioner`
  // How stages are cut when stage_boundaries is "" (pipeline/partitioner.h): static (the FLOP
  // model's balanced cut) | dp | qlearning, on the per-layer costs in `layer_costs` (a run's
  // metrics.jsonl or a costs file; "" = the FLOP model), every stage within stage_memory_mib
  // (parameters, gradients, moments and activations in flight; 0 = no cap).
  PartitionerKind partitioner = PartitionerKind::static_;
  std::string layer_costs;
  int64_t stage_memory_mib = 0;
  // Re-cut while training (pipeline/repartitioner.h): every `repartition_every` steps (0 = never;
  // a multiple of monitor.layer_costs_every) the partitioner proposes a cut from the profiler's
  // measured costs, and the stages move to it when the simulator predicts a step at least
  // `repartition_threshold` (relative) shorter. The first cut is still stage_boundaries' or the
  // partitioner's on layer_costs.
  int repartition_every = 0;
  double repartition_threshold = 0.05;
  int micro_batches = 0;             // per step; 0 = train.grad_accum (each of train.batch_size sequences)
  // Choose the micro-batch count from measured stage times: step 2 runs micro_batches, step 3 a
  // second count, and from step 4 on the count whose simulated step is shortest (logged, with why).
  bool dynamic_micro_batches = false;
  int64_t activation_mib = 0;        // bound on a rank's activations in flight; 0 = none
  bool trace = false;                // write run_dir/pipeline_trace.json (Chrome trace) of the last step
  int lookahead = 2;                 // compute instructions whose layers are hinted to the chunk store ahead
  // Experimental gradient prediction: each stage's last W of a step runs in the next step's first
  // wait; its gradient is predicted meanwhile and corrected by the true one a step later.
  // off | mean (this step's other micro-batches' mean) | previous (what that micro-batch's W
  // added last step) | momentum (an exponential average, 0.9, of what it added in earlier steps)
  // | lstm (per chunk, a blend of mean and previous from a small LSTM over the chunk's history).
  PredictGradients predict_gradients = PredictGradients::off;
  // Zero Bubble's optimizer post-validation: each rank steps its optimizer without waiting for the
  // global gradient norm (no clipping), and redoes the step from a copy if the norm, once summed
  // over the stages, calls for clipping or is not finite. Exact (the same bytes); not with ZeRO.
  bool post_validate = false;
};

// Compressed data-parallel gradient sync (HybridGC). Every lossy codec runs with error feedback:
// what one step's encoding lost is added to the next step's gradient.
struct SyncConfig {
  // none (plain float32 all-reduce) | fp16 | bf16 | sign1 | quant2-topk | topk | randk | hybrid
  // (a codec per layer depth, from `policy`).
  SyncCodec codec = SyncCodec::none;
  // hybrid: "LO-HI:codec,..." over transformer block indices (0-based, inclusive, "31-" = 31 and
  // deeper), or over depth fractions when a bound has a decimal point ("0-0.34:sign1,...": block
  // b of L sits at b / L, ranges are [LO, HI), the last one includes 1). Embeddings take the
  // first block's codec, the final norm the last block's. "" = the seed's split for models of 32
  // blocks or more (blocks 0-10 sign1, 11-30 quant2-topk, 31 and up fp16); for shallower ones
  // "0.0-:quant2-topk" (dense 2-bit everywhere: on the default job 1-bit in the first third of
  // the blocks cost 2.5 % more validation loss, see docs/architecture.md).
  std::string policy;
  // Overrides by chunk kind ("" = what the policy gives the chunk's layer). GPT-2 ties its head
  // to the token embedding, so `embedding` covers the head too.
  std::optional<CodecKind> embedding, attention, ffn, norm, head;
  double sign1_keep = 1.0;   // sign1: fraction of values sent (random sparsification); 1 = dense
  double quant2_keep = 1.0;  // quant2-topk: fraction of values sent (the largest |g|); 1 = dense 2-bit
  double topk_keep = 0.05;   // topk: fraction of values sent (the largest |g|)
  double randk_keep = 0.01;  // randk: fraction of values sent (random positions)
  int block = 256;           // sign1, quant2-topk: values sharing one scale
  int warmup_steps = 20;     // steps synced uncompressed before compression starts
  // How a dense codec's bucket is summed: "two-phase" (1-bit Adam: all-to-all of encoded
  // shards, each owner sums and re-encodes its shard, all-gather), "gather" (all-gather every
  // rank's encoding, everyone decodes the sum: no second lossy step, (N-1)/(2(N-1)/N) x the
  // bytes), or "auto": gather where it costs no more bytes (2 ranks), else two-phase. Sparse
  // codecs always gather.
  SumShape shape = SumShape::automatic;
};

// Tiered chunk memory (store/tiers.h): where each page (one plane of one chunk) lives between
// uses. Off while device_mib is 0: then everything stays in memory.
struct TierConfig {
  int64_t device_mib = 0;   // the compute tier's budget (DRAM on a CPU build); 0 = tiering off
  int64_t host_mib = 0;     // host DRAM for host-homed pages and NVMe staging buffers
  std::string nvme_dir;     // directory for the NVMe tier's file ("" = no NVMe tier)
  IoEngine engine = IoEngine::automatic;  // auto | io_uring | threads
  int lookahead = 16;       // acquires prefetched ahead of the current one
  bool prefetch = true;     // false: fetch on demand only (the naive baseline)
  // Each chunk's optimizer update runs just before the next forward pass first uses the chunk,
  // so its transfers overlap compute (exact: the same arithmetic; checkpoints, evaluations and
  // the end of the run apply what is pending first). false: the update is a phase of its own.
  bool defer_update = true;
  // Checksum every page when its version changes and check it at every acquire (store/tiers.h):
  // a lost or torn transfer fails at once, naming the page. For tests and suspected trouble.
  bool verify = false;
  // Homes by chunk kind (device | host | nvme); the seed's classes: attention and norms hot
  // (device), FFN warm (nvme, prefetched), embeddings cold (host).
  Tier embedding = Tier::host, attention = Tier::device, ffn = Tier::nvme, norm = Tier::device;
  std::string layers;       // overrides by layer index, "LO-HI:tier,..." (0 = embeddings, 1.. blocks)
  std::optional<Tier> optimizer;  // home of the AdamW moments ("" (unset) = their chunk's)
  // static: the homes above, demoted (device -> host -> nvme) where a budget is short;
  // adaptive: after the first step, every page re-homed by its measured accesses per step and
  // reuse distance (the NVMe file then has room for every page).
  TierPolicy policy = TierPolicy::static_;
  // A mixture of experts' routed experts (runtime/expert_tiers.h). off: homed as the other FFN
  // chunks; by_frequency: each expert's parameter and gradient pages homed by its measured routing
  // share (hot on the device, warm on host, cold on NVMe), re-homed every `experts_every`
  // optimizer steps.
  TierExperts experts = TierExperts::off;
  int experts_every = 10;
};

// Checkpoints (written to run_dir/ckpt every train.checkpoint_every steps and at the end).
struct CheckpointConfig {
  int full_every = 4;    // every Nth checkpoint is full; the others hold only what changed
  int keep = 3;          // newest complete checkpoints kept (plus what they depend on)
  bool delta = true;     // changed chunks may be stored as XOR against the previous checkpoint
  bool compress = true;  // zstd where it makes a record smaller
  bool async = true;     // snapshot in memory, write in a background thread while training goes on
  // Every N steps each rank's state also goes to host memory that outlives the process (/dev/shm)
  // and to its buddy rank's (ckpt/memory_checkpoint.h): a job restarted by `keel launch
  // --max-restarts` resumes from there when it is newer than the disk's newest. 0 = off.
  int memory_every = 0;
};

struct RuntimeConfig {
  int threads = 0;            // OpenMP/BLAS threads; 0 = all cores
  double peak_gflops = 0;     // MFU's peak for the whole job; 0 = from the CPU (vector units, cores, clock)
  // "fp32", or "bf16": matrix products with bf16 operands and float32 sums (kernels/cpu/bf16.h);
  // master weights, gradients, their reduction and AdamW stay float32 (the state's own dtype:
  // param_dtype / grad_dtype below).
  Precision precision = Precision::fp32;
  // The training state's element type (store/bf16_state.h). "bf16" param_dtype: the model's
  // working parameters held as bf16 (half the bytes), float32 master weights only where the
  // optimizer updates them (this rank's ZeRO shard); "bf16" grad_dtype: gradients accumulated,
  // held and reduced across data-parallel ranks as bf16. "fp32": float32, as the chunk store holds.
  StateDtype param_dtype = StateDtype::fp32;
  StateDtype grad_dtype = StateDtype::fp32;
  // Flush-to-zero and denormals-are-zero on every thread that computes (kernels/cpu/float_mode.h):
  // float32 values below 2^-126 (denormals, which appear in gradients and moments as a model
  // trains) become zero instead of taking the CPU's slow microcoded path. false = IEEE denormals.
  bool flush_denormals = true;
  // A documented slowdown for tests and benchmarks of unequal ranks: world rank `slow_rank` (-1 =
  // none) runs each layer's F, B and W `slow_factor` times as long (it sleeps (factor - 1) x the
  // layer's time after each; the bytes are unchanged). A pipeline's partitioners know it: stages
  // on that rank cost `slow_factor` times their layers' measured costs.
  int slow_rank = -1;
  double slow_factor = 1.0;
};

// Watching a run: alerts on Keel's operating targets, energy per token.
struct MonitorConfig {
  // Alerts, energy figures and the endpoint; off, a run reports only its components' own metrics
  // (bench/monitor_overhead.sh measures what monitoring costs against this).
  bool enabled = true;
  // Prometheus endpoint: http://BIND:PORT/metrics on rank 0 (0 = off). Loopback only unless
  // allow_remote.
  int port = 0;
  std::string bind = "127.0.0.1";
  bool allow_remote = false;
  // Alert rules (each holds when its metric is out of range on `alert_after` consecutive steps).
  double min_hit_rate = 0.90;     // tier_hit_rate below this (runs with memory tiers)
  double max_bubble = 0.05;       // pipeline_bubble above this (pipelines)
  double max_sync_jitter = 0.15;  // sync_jitter above this (data-parallel runs)
  double loss_spike = 3.0;        // loss above this many times the mean of the last 20 steps (or not finite)
  double stall_factor = 5.0;      // step time above this many times the median of the last 20 steps
  int alert_after = 3;
  // Mixtures of experts: the largest layer's load imbalance (its busiest expert's tokens over the
  // mean) above max_moe_imbalance on moe_imbalance_after consecutive steps (routing is noisy
  // step to step: a longer run of steps than alert_after's).
  double max_moe_imbalance = 2.0;
  int moe_imbalance_after = 10;
  // Every this many steps, the layers' measured costs (F, B, W, send / receive time, bytes) as a
  // `layer_costs` line of metrics.jsonl (pipeline/layer_profile.h); 0 = not measured.
  int layer_costs_every = 10;
  // Energy: RAPL counters under `powercap` where the machine has them; otherwise modelled from
  // the process's CPU time at `cpu_watts` per busy core.
  std::string powercap = "/sys/class/powercap";
  double cpu_watts = 5.0;
};

// Inference (keel generate, keel score): the KV cache (runtime/kv_cache.h).
struct GenerateConfig {
  int kv_block = 64;            // tokens per KV block
  int64_t kv_cache_mib = 1024;  // the cache's pool, all tiers together
  int64_t kv_device_mib = 0;    // 0: every block in memory; else the compute tier's budget for blocks
  KvTier kv_tier = KvTier::host;  // home of the blocks beyond kv_device_mib: host | nvme
  std::string kv_nvme_dir;      // kv_tier = nvme: directory of the tier's file
  bool prefix_reuse = true;     // share the blocks of common prefixes (a radix tree of blocks)
  int prefill_chunk = 256;      // tokens per model pass over a prompt or document
  bool kv_cache = true;         // false: generate re-runs the whole window for every token
  // Token ids, comma-separated, that also end a generated text besides the tokenizer's document
  // token: a Hugging Face model's eos_token_id ("keel import --hf" records it); "" = none.
  std::string stop_tokens;
};
// Throws keel::Error naming the key of the first invalid value.
void validate(const GenerateConfig& g);

// A CLIP-style dual encoder (model/clip.h): set image_tower to train one instead of a language
// model. The text tower is [model] (either family; train.seq_len is its caption window); batches
// come from a `keel data images` dataset and data.tokenizer. Validated by its component
// (runtime/workload.h validate_clip_config).
struct ClipConfig {
  std::optional<ImageTower> image_tower;  // "" (unset) = a language model run; resnet18 .. resnet152 | vit
  int image_width = 64;     // the ResNet's stem channels (stages: 1, 2, 4, 8 x; bottlenecks 4 x that out)
  int image_size = 0;       // 0 = the dataset's image size; else it must match it
  int embed_dim = 64;       // the shared embedding's width
  int vit_patch = 8;        // image_tower = "vit": square patches of this many pixels a side
  int vit_layers = 4;       // ... its transformer blocks (not causal; dense attention)
  int vit_width = 64;       // ... their width
  int vit_heads = 4;        // ... and attention heads
  // FLIP: the share of each training image's patches dropped before the ViT's blocks (a fresh
  // random set per sample and step; evaluation sees every patch). 0 = none.
  double vit_mask = 0.0;
  // Visual-token quantisation: "none", "bf16" (the image tower's products in bf16; a ViT also keeps
  // its activations in bf16) or, for a ViT, "int8" (its forward products in int8 with per-token and
  // per-weight-column ranges taken every step; backward in bf16). model/vit.h and model/resnet.h say
  // exactly what.
  VisualQuant visual_quant = VisualQuant::none;
  // Cross-modal gradient normalisation: "none", or "norm": after the data-parallel sum, each
  // tower's gradient is scaled to the geometric mean of the two towers' norms (the product of the
  // norms kept, the temperature's gradient untouched), before the global norm and clipping.
  GradBalance grad_balance = GradBalance::none;
  // Tower update cadences: a tower is trained on the steps whose index (0-based) is a multiple of
  // its cadence; on the other steps it runs forward only (no backward, no gradient sync, no AdamW
  // update; its moments' bias correction counts its own updates). 1 = every step.
  int image_update_every = 1;
  int text_update_every = 1;
  double logit_scale_init = 2.659260036932778;  // log(1 / 0.07)
  double logit_scale_max = 100.0;               // exp(logit_scale) is clamped here
  std::string dataset;      // a `keel data images` directory (train.img / val.img, .jsonl)
  bool enabled() const { return image_tower.has_value(); }
};

struct Config {
  ModelConfig model;
  TrainConfig train;
  OptimConfig optim;
  DataConfig data;
  StoreConfig store;
  ParallelConfig parallel;
  SyncConfig sync;
  TierConfig tier;
  CheckpointConfig checkpoint;
  RuntimeConfig runtime;
  MonitorConfig monitor;
  GenerateConfig generate;
  ClipConfig clip;

  // Parses a TOML file (path "" = defaults only), then applies `section.key=value` overrides in
  // order. Throws keel::Error naming the file/key on any unknown key or mistyped value.
  static Config load(const std::string& path, const std::vector<std::string>& overrides);
  // Parses TOML text; `where` names its origin in error messages.
  static Config parse(const std::string& toml_text, const std::string& where);
  // Applies one `section.key=value` override.
  void set(const std::string& assignment);
  // Fills model sizes from the preset, resolves the layout (data ranks, per-rank batch) for a job
  // of `world_size` ranks and validates the sections core owns (model, train, optim, checkpoint,
  // store, runtime, the layout's arithmetic). Throws on failure. The sections of the components
  // ([parallel]'s pipeline keys, [sync], [tier]) are checked by their components: a job resolves
  // its whole configuration with resolve_job_config (runtime/job_config.h).
  void resolve(int world_size = 1);
  // The fully resolved configuration as TOML text (round-trips through load()).
  std::string to_toml() const;
  // Hash of what determines the shape of the model's state (model section + chunk size).
  uint64_t shape_hash() const;
  // Hash of what determines the training trajectory regardless of layout: the shape, the
  // optimizer, the seed and the tokens per step (not the number of steps: a run may be extended).
  // A checkpoint resumes only a run with the same. Tokens per step count the data-parallel
  // replicas: world_size / (parallel.pipeline x parallel.tensor) of them.
  uint64_t trajectory_hash(int world_size) const;
};

struct ModelPreset {
  const char* name;
  int n_layer, n_head, n_embd, vocab_size, max_seq_len;
  Family family = Family::gpt2;
  int n_kv_head = 0;        // llama: 0 = n_head
  int ffn_multiple_of = 0;  // llama
  bool tie_embeddings = true;
  double ffn_dim_multiplier = 0;  // llama: 0 = none
  double rope_theta = 0;          // llama: 0 = 10000
  int moe_experts = 0, moe_top_k = 0, moe_shared_experts = 0, moe_hidden = 0;  // llama: 0 experts = dense
};
const std::vector<ModelPreset>& model_presets();

// The largest vocabulary a model may have (token shards hold uint32 ids above 65,536: data/shard.h).
inline constexpr int kMaxVocabSize = 1 << 24;

// Validates the model section alone (used also for checkpoints read from disk).
void validate_model(const ModelConfig& m, const std::string& where);

// LLaMA's SwiGLU hidden size: 2/3 of 4C, times the multiplier (if > 0), rounded up to a multiple.
int llama_ffn_hidden(int n_embd, int multiple_of, double multiplier);

// Whether, in a data group of `group_ranks` (data x context ranks), each rank is the only holder of
// its routed experts: parallel.expert equal to the group, on one stage (under ZeRO-3 a MoE block
// then leases its experts apart from its layer: comm/expert_parallel.h experts_gathered_with_layers).
bool experts_held_alone(const ParallelConfig& p, int group_ranks);

}  // namespace keel
