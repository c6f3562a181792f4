#include "runtime/workload.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "comm/expert_parallel.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/clip_loader.h"
#include "data/text_codec.h"
#include "data/tokenizer.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/int8_gemm.h"
#include "runtime/clip_step.h"
#include "runtime/generate.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

using LogEvent = std::function<void(const nlohmann::json&)>;

// ---- a language model over token shards ----------------------------------------------------------
class LanguageModel final : public Workload {
 public:
  LanguageModel(const Config& config, ProcessGroups& groups, LogEvent log)
      : config_(config), groups_(groups), log_(std::move(log)) {
    const ModelConfig& m = config.model;
    const TrainConfig& t = config.train;
    // Text samples read with a Hugging Face start's own tokenizer.json, else data.tokenizer.
    const std::string tokenizer = TextCodec::choose_path(config.data.tokenizer, config.train.init_hf_dir());
    if (!tokenizer.empty() && fs::exists(tokenizer)) {
      tokenizer_ = TextCodec::load(tokenizer);
      check(m.vocab_size >= tokenizer_->vocab_size(),
            "model.vocab_size: expected at least the vocabulary of tokenizer " + tokenizer + " (" +
                std::to_string(tokenizer_->vocab_size()) + "), found " + std::to_string(m.vocab_size));
    }
    Communicator& dp = groups.dp();
    // Windows of the longest length a curriculum reaches; shorter steps read them in parts. A
    // context group's ranks (consecutive in the data-parallel group) read one data rank's sequences.
    const int context = groups.context_size(), data_rank = dp.rank() / context, data_ranks = dp.size() / context;
    train_ = std::make_unique<DataLoader>(config.data.train, t.batch_size, t.longest_seq_len(), m.vocab_size,
                                          config.data.shuffle, t.seed, data_rank, data_ranks, groups.context_rank(),
                                          context);
    val_ = std::make_unique<DataLoader>(config.data.val, t.batch_size, t.longest_seq_len(), m.vocab_size, false, t.seed,
                                        data_rank, data_ranks, groups.context_rank(), context);
  }

  std::unique_ptr<RankModel> build(std::optional<pipeline::PipelineLayout> layout) override {
    return RankModel::build(config_, groups_, *train_, std::move(layout), log_);
  }
  void init_weights(RankModel& rank, uint64_t seed) override { rank.model->init_weights(seed); }
  LoaderPosition position() const override { return train_->position(); }
  void set_position(const LoaderPosition& p) override { train_->set_position(p); }
  double tokens_of_step(int64_t step) const override {
    const TrainConfig& t = config_.train;
    return static_cast<double>(t.batch_size) * t.seq_len_at(step) * t.grad_accum * groups_.dp().size() /
           groups_.context_size();
  }
  double flops_of_step(RankModel& rank, int64_t step) const override {
    return rank.model->train_flops_per_token(config_.train.seq_len_at(step)) * tokens_of_step(step);
  }
  int64_t activation_bytes(RankModel& rank) const override { return rank.model->activation_bytes(); }

  Evaluation evaluate(RankModel& rank, int batches, int64_t steps_done) override {
    // Every rank evaluates its share of the same global windows.
    batches = static_cast<int>(std::min<uint64_t>(batches, val_->num_windows()));
    rank.store->apply_pending();
    double sum = 0;
    // At the length the coming step trains at (a curriculum's validation loss follows its length).
    const int T = config_.train.seq_len_at(std::min<int64_t>(steps_done, config_.train.steps - 1));
    for (int i = 0; i < batches; ++i) {
      rank.optimizer->begin_pass(LeasePass::evaluation);  // ZeRO-3: apart from the steps' schedule
      sum += rank.engine->forward_loss(val_->window(i, T));
    }
    // With a pipeline only the last stage's ranks hold losses.
    Evaluation e;
    // (every rank of a tensor group holds its replica's loss)
    e.loss = groups_.world().allreduce_sum(sum) /
             (static_cast<double>(batches) * groups_.dp().size() * groups_.tensor_size());
    char text[96];
    std::snprintf(text, sizeof text, "val loss %.4f | val ppl %.2f", e.loss, std::exp(e.loss));
    e.fields = {{"val_loss", e.loss}, {"val_ppl", std::exp(e.loss)}};
    e.text = text;
    return e;
  }

  void print_startup(RankModel& rank) const override {
    const TrainConfig& t = config_.train;
    const ModelConfig& m = config_.model;
    std::printf("keel: model L=%d H=%d C=%d V=%d (%.2fM parameters, %zu chunks), batch %dx%d x%d x%d ranks, %d threads/rank\n",
                m.n_layer, m.n_head, m.n_embd, m.vocab_size, rank.store->param_count() / 1e6,
                rank.store->chunks().size(), t.batch_size, t.seq_len, t.grad_accum, groups_.dp().size(),
                omp_get_max_threads());
    if (!t.seq_len_schedule.empty()) std::printf("keel: sequence-length curriculum: %s\n", t.describe_seq_lens().c_str());
    if (rank.whole_state) {
      // (the data-parallel group spans data x context: comm/process_groups.h)
      const int context = groups_.context_size();
      const std::string with_context = context > 1 ? " x context " + std::to_string(context) : "";
      std::printf("keel: tensor parallel over %d ranks (data %d x pipeline %d%s x tensor %d): %.2fM of the model's "
                  "%.2fM parameters on each\n",
                  groups_.tensor_size(), groups_.dp().size() / context, config_.parallel.pipeline, with_context.c_str(),
                  groups_.tensor_size(), rank.store->param_count() / 1e6, rank.whole_state->store().param_count() / 1e6);
      if (config_.parallel.sequence_parallel) {
        // (with context parallelism: of the context rank's chunks, T / context tokens of each sequence)
        std::printf("keel: sequence parallel: norms and residual stream as 1/%d of each micro-batch's %d x %d token "
                    "rows per rank (all-gather before, reduce-scatter after the split products)\n",
                    groups_.tensor_size(), t.batch_size, t.longest_seq_len() / context);
      }
    }
    if (const int context = groups_.context_size(); context > 1) {
      std::printf("keel: context parallel over %d ranks (data %d x context %d): %d of each sequence's %d tokens on "
                  "each (chunks r and %d-r of %d), ring attention\n",
                  context, groups_.dp().size() / context, context, t.longest_seq_len() / context, t.longest_seq_len(),
                  2 * context - 1, 2 * context);
    }
    if (rank.expert_group) {
      const int P = rank.expert_group->size();
      const bool sharded = experts_sharded(config_);  // (with tensor groups a rank's bytes are a shard's anyway)
      std::printf("keel: expert parallel over %d ranks (data %d = %d expert groups of %d): each runs%s %d of every MoE "
                  "block's %d experts for its group's tokens (all-to-all there and back); %s: %.2f MB of the "
                  "model's %.2f MB of parameters per rank\n",
                  P, groups_.dp().size(), groups_.dp().size() / P, P, sharded ? " and holds" : "",
                  config_.model.moe_experts / P, config_.model.moe_experts,
                  !sharded                          ? "every expert on every rank (ZeRO shards them as the rest)"
                  : config_.parallel.zero == 3      ? "the others' chunks on the other ranks of its group; ZeRO-3 shards "
                                                      "each expert's parameters and state over the ranks holding it"
                  : config_.parallel.zero > 0       ? "the others' chunks on the other ranks of its group; ZeRO shares "
                                                      "each expert's state out over the ranks holding it"
                                                    : "the others' chunks on the other ranks of its group",
                  rank.expert_group->param_bytes() / 1e6, rank.expert_group->model_param_bytes() / 1e6);
    }
    const GPT& g = *rank.model;
    std::printf("keel: activations (train.recompute = %s, blocks %s): %.1f MB per micro-batch in flight x %d, "
                "%.1f MB recomputed set, %.1f MB in all\n",
                to_string(t.recompute), t.recompute_layers.c_str(), g.slot_bytes() / 1e6, g.slots(),
                g.recomputed_bytes() / 1e6, g.activation_bytes() / 1e6);
    std::printf("keel: train %s (%llu tokens), val %s (%llu tokens), run dir %s\n", config_.data.train.c_str(),
                static_cast<unsigned long long>(train_->num_tokens()), config_.data.val.c_str(),
                static_cast<unsigned long long>(val_->num_tokens()), t.run_dir.c_str());
    if (static_cast<uint64_t>(t.eval_batches) > val_->num_windows()) {
      std::printf("keel: train.eval_batches %d capped to the %llu windows of the validation set\n", t.eval_batches,
                  static_cast<unsigned long long>(val_->num_windows()));
    }
  }

  nlohmann::json describe(double parameters) const override {
    const ModelConfig& m = config_.model;
    return {{"preset", m.preset},         {"n_layer", m.n_layer},       {"n_head", m.n_head},
            {"n_embd", m.n_embd},         {"vocab_size", m.vocab_size}, {"max_seq_len", m.max_seq_len},
            {"parameters", static_cast<int64_t>(parameters)}};
  }

  void print_samples(RankModel& rank) override {
    const TextCodec* tok = tokenizer_ ? &*tokenizer_ : nullptr;
    if (!rank.model->whole() || !tok || !tok->can_encode() || tok->document_token() < 0 || config_.train.sample_tokens == 0) {
      return;
    }
    // (An expert group's blocks exchange rows collectively: one rank cannot run them alone.)
    if (groups_.tensor_size() > 1 || groups_.context_size() > 1 || groups_.ep() != nullptr) {
      if (groups_.world().is_root()) {
        std::printf("keel: no text samples with parallel.%s > 1 (generation runs one rank's whole model: "
                    "`keel generate` from the checkpoint)\n",
                    groups_.tensor_size() > 1 ? "tensor" : groups_.context_size() > 1 ? "context" : "expert");
      }
      return;
    }
    rank.optimizer->gather_whole_model();  // ZeRO-3 (every rank): rank 0 runs the model alone
    if (!groups_.world().is_root()) return;
    Rng rng(config_.train.seed ^ 0xC0FFEEull);
    SampleOptions options;
    options.max_new_tokens = config_.train.sample_tokens;
    options.stop_token = tok->document_token();
    options.stop_tokens = stop_token_ids(config_.generate.stop_tokens);
    std::printf("samples (temperature %.1f, top-k %d):\n", options.temperature, options.top_k);
    for (int i = 0; i < config_.train.samples; ++i) {
      const std::vector<int> prompt = {tok->document_token()};
      std::vector<int> out = generate(*rank.model, config_.train.longest_seq_len(), prompt, options, rng);
      std::string text = tok->decode(std::vector<int>(out.begin() + 1, out.end()));
      std::printf("--- sample %d ---\n%s\n", i + 1, text.c_str());
    }
    std::fflush(stdout);
  }

 private:
  const Config& config_;
  ProcessGroups& groups_;
  LogEvent log_;
  std::optional<TextCodec> tokenizer_;
  std::unique_ptr<DataLoader> train_, val_;
};

// ---- a CLIP-style dual encoder over an image-caption dataset -----------------------------------------
class DualEncoder final : public Workload {
 public:
  DualEncoder(const Config& config, ProcessGroups& groups, LogEvent log)
      : config_(config), groups_(groups), log_(std::move(log)), tokenizer_(load_tokenizer(config)) {
    const std::string& dir = config.clip.dataset;
    check(fs::exists(fs::path(dir) / "meta.json"),
          "config key 'clip.dataset': " + dir + " is not a finished `keel data images` dataset (no meta.json)");
    const int T = config.train.seq_len;
    train_data_ = load_captioned_images(dir, "train", tokenizer_, T);
    val_data_ = load_captioned_images(dir, "val", tokenizer_, T);
    Communicator& dp = groups.dp();
    const TrainConfig& t = config.train;
    check(train_data_.split.count >= t.batch_size * dp.size(),
          "config key 'train.batch_size': " + std::to_string(t.batch_size) + " pairs x " + std::to_string(dp.size()) +
              " ranks is more than the " + std::to_string(train_data_.split.count) + " training pairs of " + dir);
    train_ = std::make_unique<ClipLoader>(train_data_, t.batch_size, dp.rank(), dp.size(), t.seed, config.data.shuffle);
    check(val_data_.split.count >= 1, "config key 'clip.dataset': " + dir + " holds no held-out pairs (val)");
    val_ = std::make_unique<ClipLoader>(val_data_, t.batch_size, 0, 1, t.seed, false);
  }

  std::unique_ptr<RankModel> build(std::optional<pipeline::PipelineLayout> layout) override {
    check(!layout, "a dual encoder runs without pipeline stages");
    return RankModel::build_clip(config_, groups_, *train_, log_);
  }
  void init_weights(RankModel& rank, uint64_t seed) override { rank.clip->init_weights(seed); }
  LoaderPosition position() const override { return train_->loader_position(); }
  void set_position(const LoaderPosition& p) override { train_->set_loader_position(p); }
  double samples_of_step() const {
    const TrainConfig& t = config_.train;
    return static_cast<double>(t.batch_size) * t.grad_accum * groups_.dp().size();
  }
  double tokens_of_step(int64_t) const override { return samples_of_step() * config_.train.seq_len; }
  double flops_of_step(RankModel& rank, int64_t) const override {
    return rank.clip->train_flops_per_sample() * samples_of_step();
  }
  int64_t activation_bytes(RankModel& rank) const override {
    return rank.clip->image().activation_bytes() + rank.clip->text().activation_bytes();
  }

  Evaluation evaluate(RankModel& rank, int, int64_t) override {
    double loss = 0;
    const RetrievalRecall r = static_cast<ClipStep&>(*rank.engine).evaluate(*val_, &loss);
    Evaluation e;
    e.loss = loss;
    e.fields = {{"val_loss", loss},          {"val_pairs", r.pairs},         {"recall_i2t_at1", r.i2t_at1},
                {"recall_i2t_at5", r.i2t_at5}, {"recall_t2i_at1", r.t2i_at1}, {"recall_t2i_at5", r.t2i_at5}};
    char text[200];
    std::snprintf(text, sizeof text,
                  "val loss %.4f | zero-shot retrieval over %d held-out pairs: image->text R@1 %.3f R@5 %.3f, "
                  "text->image R@1 %.3f R@5 %.3f",
                  loss, r.pairs, r.i2t_at1, r.i2t_at5, r.t2i_at1, r.t2i_at5);
    e.text = text;
    return e;
  }

  void print_startup(RankModel& rank) const override {
    const TrainConfig& t = config_.train;
    const ModelConfig& m = config_.model;
    const ClipModel& clip = *rank.clip;
    const ClipConfig& c = config_.clip;
    char tower[160];
    if (c.image_tower == ImageTower::vit) {
      std::snprintf(tower, sizeof tower, "vit image tower (%dx%d patches of %d px, L=%d H=%d C=%d, %d px)",
                    clip.spec().image_size / c.vit_patch, clip.spec().image_size / c.vit_patch, c.vit_patch,
                    c.vit_layers, c.vit_heads, c.vit_width, clip.spec().image_size);
    } else {
      std::snprintf(tower, sizeof tower, "%s image tower (width %d, %d px)", to_string(*c.image_tower), c.image_width,
                    clip.spec().image_size);
    }
    std::printf("keel: dual encoder: %s + %s text tower L=%d H=%d C=%d V=%d, embedding "
                "%d (%.2fM parameters, %zu chunks), batch %d pairs x %d x %d ranks, %d threads/rank\n",
                tower, to_string(m.family.value_or(Family::gpt2)),
                m.n_layer, m.n_head, m.n_embd, m.vocab_size, config_.clip.embed_dim, rank.store->param_count() / 1e6,
                rank.store->chunks().size(), t.batch_size, t.grad_accum, groups_.dp().size(), omp_get_max_threads());
    std::printf("keel: image-caption dataset %s: %d train pairs, %d held out; captions of up to %d tokens "
                "(tokenizer %s); run dir %s\n",
                config_.clip.dataset.c_str(), train_data_.split.count, val_data_.split.count, t.seq_len,
                config_.data.tokenizer.c_str(), t.run_dir.c_str());
    std::string switches;
    auto add = [&](const std::string& s) { switches += (switches.empty() ? "" : "; ") + s; };
    if (c.image_update_every > 1) add("image tower trained every " + std::to_string(c.image_update_every) + " steps");
    if (c.text_update_every > 1) add("text tower trained every " + std::to_string(c.text_update_every) + " steps");
    if (c.grad_balance != GradBalance::none) add(std::string("gradient balance: ") + to_string(c.grad_balance));
    if (c.vit_mask > 0) add("FLIP: " + std::to_string(static_cast<int>(std::lround(c.vit_mask * 100))) + "% of patches masked");
    if (c.visual_quant == VisualQuant::bf16) add("image tower's products in bf16 (" + bf16_engine() + ")");
    if (c.visual_quant == VisualQuant::int8) add("visual tokens in int8 (" + int8_engine() + "), backward in bf16 (" + bf16_engine() + ")");
    if (!switches.empty()) std::printf("keel: multimodal switches: %s\n", switches.c_str());
  }

  nlohmann::json describe(double parameters) const override {
    const ModelConfig& m = config_.model;
    return {{"preset", "clip"},
            {"image_tower", to_string(*config_.clip.image_tower)},
            {"image_width", config_.clip.image_width},
            {"embed_dim", config_.clip.embed_dim},
            {"n_layer", m.n_layer},
            {"n_head", m.n_head},
            {"n_embd", m.n_embd},
            {"vocab_size", m.vocab_size},
            {"max_seq_len", m.max_seq_len},
            {"parameters", static_cast<int64_t>(parameters)}};
  }

 private:
  static Tokenizer load_tokenizer(const Config& config) {
    const std::string& path = config.data.tokenizer;
    check(!path.empty() && fs::exists(path),
          "config key 'data.tokenizer': the captions' tokenizer " + (path.empty() ? std::string("\"\"") : path) +
              " does not exist (`keel data images` writes DATASET/tokenizer.json)");
    Tokenizer t = Tokenizer::load(path);
    check(t.can_encode(), "config key 'data.tokenizer': " + path + " cannot encode text (an llm.c decoding table)");
    check(config.model.vocab_size >= t.vocab_size(),
          "model.vocab_size: expected at least the vocabulary of tokenizer " + path + " (" +
              std::to_string(t.vocab_size()) + "), found " + std::to_string(config.model.vocab_size));
    return t;
  }

  const Config& config_;
  ProcessGroups& groups_;
  LogEvent log_;
  Tokenizer tokenizer_;
  CaptionedImages train_data_, val_data_;
  std::unique_ptr<ClipLoader> train_, val_;
};

}  // namespace

std::unique_ptr<Workload> make_workload(const Config& config, ProcessGroups& groups, LogEvent log_event) {
  if (config.clip.enabled()) return std::make_unique<DualEncoder>(config, groups, std::move(log_event));
  return std::make_unique<LanguageModel>(config, groups, std::move(log_event));
}

}  // namespace keel
