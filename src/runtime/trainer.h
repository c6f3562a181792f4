// The training loop: builds the chunk store, the model, the data loaders and the optimizer from a
// resolved Config, and runs steps of forward, backward (B then W per layer), gradient sync across
// data-parallel ranks (overlapped with backward), clipping and AdamW, reporting progress as text
// and JSON lines in the run directory. With one rank it is the single-process trainer; under
// mpirun every rank runs it, rank 0 reports and writes checkpoints.
#pragma once

#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "ckpt/checkpoint.h"
#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "core/config.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "pipeline/executor.h"
#include "pipeline/layout.h"
#include "pipeline/gradient_predictor.h"
#include "pipeline/micro_batching.h"
#include "store/chunk_store.h"
#include "store/placement.h"
#include "store/tiers.h"

namespace keel {

struct StepStats {
  int64_t step = 0;       // 1-based number of the step just taken
  double loss = 0;        // mean training loss over the step's micro-batches
  double lr = 0;
  double grad_norm = 0;   // before clipping
  double ms = 0;
  double tokens_per_s = 0;
  double mfu = 0;         // achieved matmul FLOP/s over peak_gflops
  SyncStats sync;         // data-parallel gradient sync (zero on one rank)
  double sync_jitter = 0; // std/mean of sync latency over the last window of steps
  double peak_rss_mb = 0; // largest peak resident set over ranks so far
  double ckpt_stall_ms = 0; // step time spent on checkpoints (snapshot, waiting for a write)
  TierStats tiers;          // tiered memory, this step (when [tier] is on)
  // Pipeline (parallel.pipeline > 1), over the ranks of data-parallel replica 0: idle time in
  // the span of the step's F, B and W over ranks x span, and the same per pipeline rank.
  double bubble = 0;
  std::vector<double> rank_bubble;
  double recv_wait_ms = 0;          // the longest any rank waited for activations or gradients
  double activation_mb = 0;         // the most activation memory in use on any rank
  bool rolled_back = false;         // post-validation redid this rank's optimizer step (clipping)
};

struct RunSummary {
  double val_loss_start = 0, val_loss_end = 0;
  int64_t steps = 0;
  double mean_tokens_per_s = 0;
};

class Trainer {
 public:
  // Requires a config resolved for comm.size() ranks. Reads shards and tokenizer, builds the
  // model, initialises the weights from train.seed or resumes from train.resume. Throws
  // keel::Error on bad input.
  explicit Trainer(Config config, Communicator& comm = Communicator::world());
  ~Trainer();

  // One optimizer step over grad_accum micro-batches; begins a checkpoint after it when
  // train.checkpoint_every says so (except after the last step: run() saves at the end).
  StepStats step();
  // Mean validation loss over the first `batches` validation batches (file order).
  double evaluate(int batches);
  // The whole run: evaluation before, steps with progress lines, evaluations, checkpoints,
  // evaluation after, samples. Prints to stdout; JSON lines to run_dir/metrics.jsonl.
  RunSummary run();
  // Saves a checkpoint of the current state under the checkpoint root `root` (every rank calls
  // it), synchronously: it returns once the checkpoint is published (or failed, which is printed).
  void save(const std::string& root);
  // The checkpoint this run resumed from ("" = a fresh start).
  const std::string& resumed_from() const { return resumed_from_; }

  GPT& model() { return *model_; }
  ChunkStore& store() { return *store_; }
  const Config& config() const { return config_; }
  int64_t steps_done() const { return steps_done_; }
  double peak_gflops() const { return peak_gflops_; }

 private:
  void log_json(const std::string& line);
  // Pipeline: the step's micro-batches through the executor (returns the sum of their losses on
  // the last stage's rank); then its bubble, gathered over the replica's ranks, into s.
  double pipeline_backward();
  void pipeline_report(StepStats& s);
  // Runs the pipeline with this plan from the next step on (allocates its activation slots).
  void use_plan(pipeline::Plan plan);
  // Dynamic micro-batches (parallel.dynamic_micro_batches): measures steps 2 and 3 at two counts,
  // then runs the count whose simulated step is shortest.
  void adapt_micro_batches();
  // Gradient prediction: adds the prediction of the deferred W's gradients (before the sync), and
  // after the update leaves its negative in the plane for the true gradients to correct.
  void predict_deferred_gradients();
  void carry_prediction();
  pipeline::StageTimes measured_stage_times();
  // Pipeline: sums the gradient of the tied token embedding over the first and last stages.
  void tie_embedding_grads();
  void write_pipeline_trace();
  // Pipeline: the whole model (parameters and AdamW moments) assembled on rank 0 from replica
  // 0's stages and saved as the checkpoint one rank would write (eval, generate, export and a
  // later run read it). Returns its directory on rank 0 ("" elsewhere, or when not written).
  std::string save_assembled(const std::string& root);
  // This rank's data-parallel group: the whole world without a pipeline, else its stage's replicas.
  Communicator& dp() { return dp_comm_ ? *dp_comm_ : comm_; }
  // ZeRO: after this rank updated its shard, every rank receives every updated parameter.
  void gather_parameters();
  void print_samples();
  // Compressed sync: per-layer bytes over the run, printed at its end.
  void accumulate_sync(const SyncStats& s);
  void print_sync_summary();
  void attach_tiers();
  void accumulate_tiers(const TierStats& s);
  void print_tier_summary();
  // Checkpoints: begin (snapshot, background write), commit (all ranks done: rank 0 publishes).
  void begin_checkpoint(const std::string& root);
  void commit_checkpoint();
  // The compression residuals of this rank in a checkpoint being resumed (into out; empty when
  // there are none to restore, with the reason returned). Throws when they are corrupt.
  std::string load_residuals(const TrainState& state, std::vector<float>& out);
  // After a resume: drops metrics lines of steps that will be replayed, reports recovery.
  void trim_metrics(int64_t step);

  Config config_;
  Communicator& comm_;
  // Pipeline parallelism: the communicators of this rank's stage replicas (dp), its replica's
  // stages (pp) and the ranks holding a copy of the tied embedding (first and last stage).
  std::unique_ptr<Communicator> dp_comm_, pp_comm_, tied_comm_;
  std::unique_ptr<pipeline::Executor> executor_;
  std::vector<LayerRange> stages_;
  pipeline::ScheduleCheck schedule_check_;
  int micro_batches_ = 1;
  std::vector<int> step_inputs_, step_targets_;  // the step's sequences, cut into micro-batches
  int first_untied_chunk_ = 0;  // chunks before it hold this rank's copy of wte (not counted in the norm)
  std::vector<std::string> last_timelines_;
  pipeline::StageTimes first_measure_;  // dynamic micro-batches: step 2's stage times
  // Gradient prediction (parallel.predict_gradients): over the grad plane, the prediction added
  // this step, what the carried W's really added, and the plane before they ran.
  std::vector<float> predicted_, measured_, snapshot_, momentum_;
  // predict_gradients = lstm: the predictor, and the mean and previous its last blend mixed.
  std::unique_ptr<pipeline::GradientPredictor> lstm_;
  std::vector<float> lstm_mean_, lstm_previous_;
  std::vector<float> backup_;  // post-validation: params, grads and moments before the optimistic step
  bool measured_valid_ = false;
  std::vector<int> step_inputs_prev_, step_targets_prev_;  // the batches of W's carried into this step  // every rank's last step timeline (trace), on rank 0
  std::unique_ptr<ChunkStore> store_;
  std::unique_ptr<TierManager> tiers_;  // after store_: drains its transfers into the store first
  Placement placement_;
  TierStats tier_totals_;  // over the run, for the summary
  std::unique_ptr<GradSync> sync_;
  ChunkPartition partition_;  // ZeRO owners (every chunk on every rank when zero = 0)
  std::deque<double> sync_latencies_ms_;
  std::unique_ptr<GPT> model_;
  std::unique_ptr<DataLoader> train_data_;
  std::unique_ptr<DataLoader> val_data_;
  std::optional<Tokenizer> tokenizer_;
  AdamW optimizer_;
  // The optimizer update deferred into the next forward pass (tier.defer_update): its step's
  // learning rate, update count and clipping factor.
  struct Deferred {
    double lr = 0;
    int64_t t = 0;
    float clip = 1.0f;
  } deferred_;
  int64_t steps_done_ = 0;
  bool resumed_ = false;
  std::string resumed_from_;
  ChunkPartition writers_;  // which rank writes which chunks of a checkpoint
  std::unique_ptr<CheckpointWriter> ckpt_;
  std::string ckpt_root_;
  double pending_stall_ms_ = 0;  // checkpoint cost to report with the next step
  double ckpt_begin_ms_ = 0;
  int64_t ckpt_step_ = -1;        // step of the checkpoint begun last
  std::string ckpt_inflight_root_;
  std::vector<float> residual_scratch_;  // compression residuals handed to a checkpoint
  std::map<int, LayerSyncStats> sync_totals_;  // by layer, over the run (compressed sync)
  double sync_encode_ms_ = 0, sync_decode_ms_ = 0;
  double peak_gflops_ = 0;
  std::ofstream metrics_;
};

}  // namespace keel
