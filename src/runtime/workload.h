// What a run trains: its data and the model each rank builds from it. The training loop
// (runtime/trainer.h) is the same for every workload; a workload builds the rank's components
// (RankModel), draws the weights, keeps the data position checkpoints record, counts a step's
// tokens and FLOPs, and evaluates. Two: a language model over token shards ([model], [data]) and a
// CLIP-style dual encoder over an image-caption dataset ([clip], with [model] as its text tower).
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "comm/process_groups.h"
#include "core/config.h"
#include "data/loader.h"
#include "pipeline/layout.h"
#include "runtime/rank_model.h"

namespace keel {

struct Evaluation {
  double loss = 0;        // the held-out loss (the run summary's)
  nlohmann::json fields;  // the evaluation line's fields in metrics.jsonl
  std::string text;       // its line on stdout, after "step N | "
};

class Workload {
 public:
  virtual ~Workload() = default;
  // This rank's model and components for `layout` (a pipeline stage's layers; none: the whole model).
  virtual std::unique_ptr<RankModel> build(std::optional<pipeline::PipelineLayout> layout) = 0;
  virtual void init_weights(RankModel& rank, uint64_t seed) = 0;
  // The training data's position (the same on every rank): what a checkpoint records.
  virtual LoaderPosition position() const = 0;
  virtual void set_position(const LoaderPosition& p) = 0;
  // Tokens optimizer step `step` (0-based) trains on over every data-parallel rank (a dual
  // encoder: its captions' windows), and the matrix products' FLOPs of its forward and backward.
  virtual double tokens_of_step(int64_t step) const = 0;
  virtual double flops_of_step(RankModel& rank, int64_t step) const = 0;
  virtual int64_t activation_bytes(RankModel& rank) const = 0;
  // The held-out evaluation (every rank calls it): `batches` batches of it, where that applies.
  virtual Evaluation evaluate(RankModel& rank, int batches, int64_t steps_done) = 0;
  // Rank 0's start-up lines about the model and the data.
  virtual void print_startup(RankModel& rank) const = 0;
  // The "model" object of the run line in metrics.jsonl.
  virtual nlohmann::json describe(double parameters) const = 0;
  // After the run (rank 0): a language model's text samples.
  virtual void print_samples(RankModel& rank) {}
};

// The workload the config describes ([clip] set: a dual encoder; else a language model). Reads
// the data (shards and tokenizer, or the image-caption dataset): bad input is one line naming it.
std::unique_ptr<Workload> make_workload(const Config& config, ProcessGroups& groups,
                                        std::function<void(const nlohmann::json&)> log_event);

}  // namespace keel
