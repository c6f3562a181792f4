// The training loop. It builds a run's components from a resolved Config (the chunk store and the
// model, the data, the gradient sync and the sharded optimizer, tiered memory, a step engine, the
// checkpointer, the metrics) and then only calls them: evaluate, step, report, checkpoint, save.
// Every technique lives in its component; see docs/architecture.md ("adding a technique").
// With one rank it is the single-process trainer; under mpirun every rank runs it, rank 0
// reports and writes checkpoint manifests.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpointer.h"
#include "comm/grad_sync.h"
#include "comm/process_groups.h"
#include "comm/sharded_optimizer.h"
#include "comm/sync_report.h"
#include "core/config.h"
#include "core/step_engine.h"
#include "core/step_hook.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "kernels/cpu/float_mode.h"
#include "model/gpt.h"
#include "runtime/metrics.h"
#include "runtime/rank_model.h"
#include "runtime/workload.h"
#include "store/chunk_store.h"
#include "store/tiered_memory.h"

namespace keel {

class StopSignals;

struct RunSummary {
  double val_loss_start = 0, val_loss_end = 0;
  int64_t steps = 0;
  double mean_tokens_per_s = 0;
  bool final_checkpoint_written = true;  // false: the run's final state is not saved (exit 3)
  int stop_signal = 0;                   // the SIGTERM / SIGINT that stopped the run early (0 = none)
  std::string checkpoint;                // rank 0: the newest checkpoint that exists and verifies
};

class Trainer {
 public:
  // Requires a config resolved for comm.size() ranks. Reads shards and tokenizer, builds the
  // model, initialises the weights from train.seed or resumes from train.resume. Throws
  // keel::Error on bad input.
  explicit Trainer(Config config, Communicator& comm = Communicator::world());
  ~Trainer();

  // One optimizer step; begins a checkpoint after it when train.checkpoint_every says so (except
  // after the last step: run() saves at the end).
  StepStats step(const StopSignals* signals = nullptr);  // signals: folded into the end-of-step reduction
  // Mean validation loss over the first `batches` validation batches (file order).
  double evaluate(int batches);
  // The whole run: evaluation before, steps with progress lines, evaluations, checkpoints,
  // evaluation after, samples. Prints to stdout; JSON lines to run_dir/metrics.jsonl.
  RunSummary run();
  // Saves a checkpoint of the current state under the checkpoint root `root` (every rank calls
  // it), synchronously: it returns once the checkpoint is published (or failed, which is printed).
  void save(const std::string& root);
  // The checkpoint this run resumed from ("" = a fresh start).
  const std::string& resumed_from() const { return progress_.resumed_from; }

  GPT& model() { return *rank_->model; }  // a language model's (null rank_->model for a dual encoder)
  RankModel& rank() { return *rank_; }
  ChunkStore& store() { return *rank_->store; }
  const Config& config() const { return config_; }
  int64_t steps_done() const { return progress_.steps_done; }
  // The peak FLOP/s MFU is measured against (all ranks' cores together).
  double peak_gflops() const { return peaks_.peak_gflops; }

 private:
  void resume_or_init();
  // A pipeline re-cut (pipeline/repartitioner.h): this rank's components rebuilt for cut `to`, the
  // state moved into them from cut `from` over MPI; returns the move's figures (for its event).
  nlohmann::json recut(const std::vector<LayerRange>& from, const std::vector<LayerRange>& to);
  void measure_peaks();
  void print_startup(double moments_mb);
  // The "run" line of metrics.jsonl: model, sizes, hardware and layout, for the run report.
  void log_run_event();
  // The held-out evaluation of the workload (train.eval_batches), into metrics; its loss.
  double evaluate_and_log();
  // The steps from here to train.steps (or to a stop signal, returned in *stop_signal); the mean
  // tokens/s after the first. A non-finite step past the allowed ones ends it with NonFiniteStep.
  double train_steps(double moments_mb, int* stop_signal);
  // After a stop signal: the checkpoint every rank writes, and the line naming it.
  void stop(RunSummary& summary);
  // The end-of-run line: the losses, and the newest checkpoint that exists and verifies.
  void print_end(RunSummary& summary);

  struct Progress {
    int64_t steps_done = 0;
    std::string resumed_from;
  };
  struct Peaks {
    double peak_gflops = 0;   // MFU's denominator: the hardware (or runtime.peak_gflops)
    double sgemm_gflops = 0;  // matmul_efficiency's: SGEMM measured at start-up, over the ranks
    double bf16_gflops = 0;   // under bf16: rank 0's bf16 product probe (kernels/cpu/gemm_probe.h)
    std::string how;
    std::string sgemm_how;  // where sgemm_gflops came from (rank 0's words)
  };

  Config config_;
  // runtime.flush_denormals for this trainer's lifetime (set on the pool once its size is known);
  // declared early so that it outlives every thread and kernel of the trainer.
  std::optional<FlushDenormalsScope> float_mode_;
  ProcessGroups groups_;
  // The data and what each rank builds from it: a language model or a dual encoder.
  std::unique_ptr<Workload> workload_;
  // This rank's layers and everything built on them (store, model, optimizer, sync, tiers, step
  // engine): rebuilt when a pipeline is re-cut.
  std::unique_ptr<RankModel> rank_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::vector<StepHook*> hooks_;  // called around every step, in order (the tiers' schedule, ...)
  Metrics metrics_;
  Progress progress_;
  Peaks peaks_;
};

}  // namespace keel
