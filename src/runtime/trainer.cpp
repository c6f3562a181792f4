#include "runtime/trainer.h"

#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "ckpt/hf.h"
#include "comm/sync_policy.h"
#include "core/cpu.h"
#include "core/error.h"
#include "core/fileio.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/gemm_probe.h"
#include "monitor/alerts.h"
#include "monitor/endpoint.h"
#include "monitor/energy.h"
#include "pipeline/pipeline_step.h"
#include "pipeline/partitioner.h"
#include "pipeline/repartitioner.h"
#include "pipeline/stage_migration.h"
#include "runtime/dynamic_windows.h"
#include "runtime/generate.h"
#include "runtime/launcher.h"
#include "runtime/memory_line.h"
#include "runtime/single_stage_step.h"
#include "runtime/step_reduction.h"
#include "runtime/stop_signal.h"
#include "store/placement.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

double peak_rss_mb() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

}  // namespace

Trainer::Trainer(Config config, Communicator& comm)
    : config_(std::move(config)), groups_(comm, config_.parallel.pipeline, config_.parallel.tensor, config_.parallel.context,
              config_.parallel.expert), metrics_(config_, comm) {
  if (config_.runtime.threads > 0) omp_set_num_threads(config_.runtime.threads);
  float_mode_.emplace(config_.runtime.flush_denormals);
  check_blas();
  const ModelConfig& m = config_.model;
  const TrainConfig& t = config_.train;
  std::optional<pipeline::PipelineLayout> layout;
  if (groups_.pipelined()) layout = pipeline::PipelineLayout::make(config_, groups_.pp().rank());
  Communicator& dp = groups_.dp();
  auto log = [this](const nlohmann::json& line) { metrics_.log(line); };
  workload_ = make_workload(config_, groups_, log);
  measure_peaks();  // (in float32: the SGEMM reference of matmul_efficiency)
  rank_ = workload_->build(std::move(layout));
  for (MetricsSource* source : rank_->sources()) metrics_.add_source(source);
  if (rank_->tiers) hooks_.push_back(rank_->tiers.get());
  if (rank_->expert_tiers) hooks_.push_back(rank_->expert_tiers.get());  // (before the routing report resets its counts)
  if (rank_->tensor_group) hooks_.push_back(rank_->tensor_group.get());  // (its step's traffic)
  if (rank_->expert_group) hooks_.push_back(rank_->expert_group.get());
  // After the tiers: a tiered run's checkpoints stream from them (no snapshot buffers).
  ChunkStore& written = rank_->whole_state ? rank_->whole_state->store() : *rank_->store;  // tensor parallel: whole
  checkpointer_ = std::make_unique<Checkpointer>(config_, comm, written, *rank_->sync, peaks_.peak_gflops, log);
  checkpointer_->set_carried_state(rank_->engine->carried_state());
  checkpointer_->set_whole_state(rank_->whole_state.get());
  resume_or_init();
  if (m.dynamic_window()) {  // after resuming (it goes on with the checkpoint's windows); first of the hooks:
    // its probe passes (the first validation window) come before the step the tiers record as a schedule.
    hooks_.insert(hooks_.begin(), metrics_.adopt(std::make_unique<DynamicWindows>(
                                      config_, dp, *rank_->model, progress_.resumed_from, [this] { return evaluate(1); }, log, groups_.tp())));
  }
  // Monitoring: energy per step and token, alerts on the operating targets ([monitor]).
  if (config_.monitor.enabled) {
    hooks_.push_back(metrics_.adopt(
        std::make_unique<EnergyMeter>(config_.monitor, comm, [this](int64_t step) { return workload_->tokens_of_step(step); })));
    metrics_.add_sink(metrics_.adopt(std::make_unique<Alerts>(config_.monitor, log)));
  }
  if (config_.monitor.enabled && config_.monitor.port > 0 && comm.is_root()) {
    metrics_.add_sink(metrics_.adopt(std::make_unique<PrometheusEndpoint>(config_.monitor)));
  }
  if (config_.parallel.repartition_every > 0) {  // last of the hooks: a re-cut replaces the tiers' hook
    hooks_.push_back(metrics_.adopt(std::make_unique<pipeline::Repartitioner>(
        config_, comm, pipeline::startup_cut(config_), [this] { return rank_->engine->layer_costs(); },
        [this](const std::vector<LayerRange>& from, const std::vector<LayerRange>& to) { return recut(from, to); }, log)));
  }
  if (comm.is_root()) {
    fs::create_directories(t.run_dir);
    write_file(t.run_dir + "/config.toml", config_.to_toml());
  }
  // A resumed run continues its metrics (without the steps it is about to replay); a fresh run
  // starts them anew. A restarted job that found no checkpoint starts from step 0 but keeps the
  // record of its earlier failures and recoveries.
  metrics_.open(!progress_.resumed_from.empty() || std::getenv("KEEL_RESTART") != nullptr, progress_.steps_done);
}

Trainer::~Trainer() = default;

void Trainer::resume_or_init() {
  if (const std::optional<TrainState> state = checkpointer_->resume()) {
    progress_.resumed_from = state->dir;
    progress_.steps_done = state->step;
    workload_->set_position(state->data);
  } else {
    workload_->init_weights(*rank_, config_.train.seed);
    // Each rank fills the tensors it holds (its stages'; all of them before ZeRO-3 settles).
    if (const std::string hf = config_.train.init_hf_dir(); !hf.empty()) import_hf(hf, *rank_->store, config_.model);
  }
  rank_->optimizer->weights_settled();  // ZeRO-3: from here on a rank holds its own shard
}

nlohmann::json Trainer::recut(const std::vector<LayerRange>& from, const std::vector<LayerRange>& to) {
  checkpointer_->finish_in_flight();
  rank_->store->apply_pending();  // deferred updates (tiers) land before the state moves
  config_.parallel.stage_boundaries = pipeline::boundaries_of(to);  // what checkpoints record from here on
  std::unique_ptr<RankModel> next = workload_->build(pipeline::PipelineLayout::make(config_, groups_.pp().rank(), to));
  const pipeline::MigrationStats moved = pipeline::migrate_stages(config_, groups_, from, *rank_->store, to, *next->store);
  next->optimizer->carry_counts(*rank_->optimizer);
  const pipeline::ResidualMoveStats residuals =
      pipeline::migrate_residuals(config_, groups_, next->model->tied_groups(), to, *rank_->sync, *next->sync);
  // State the engine carries that every rank holds alike (bias balancing's routing biases: the
  // whole model's on every rank) goes to the new stages' engine as a resume would hand it over.
  if (CarriedState* carried = rank_->engine->carried_state(); carried != nullptr && carried->replicated()) {
    std::vector<float> floats;
    const std::string layout = carried->save(progress_.steps_done, floats);
    next->engine->carried_state()->restore(layout, floats);
  }
  // The step's figures not yet in its line (the hooks run before it) follow their blocks.
  if (rank_->moe_report) next->moe_report->carry(*rank_->moe_report);
  if (rank_->expert_tiers) next->expert_tiers->carry(*rank_->expert_tiers);  // (and their homes by share)
  if (rank_->expert_group) next->expert_group->carry_step(*rank_->expert_group);
  metrics_.replace_sources(rank_->sources(), next->sources());
  for (const auto& [was, now] : {std::pair<StepHook*, StepHook*>{rank_->tiers.get(), next->tiers.get()},
                                 {rank_->expert_tiers.get(), next->expert_tiers.get()},
                                 {rank_->tensor_group.get(), next->tensor_group.get()},
                                 {rank_->expert_group.get(), next->expert_group.get()}}) {
    std::replace(hooks_.begin(), hooks_.end(), was, now);
  }
  rank_ = std::move(next);  // the old stages' memory goes back here
  // Tensor parallelism: checkpoints are written from the new stages' whole copy (WholeModelState).
  checkpointer_->set_whole_state(rank_->whole_state.get());
  checkpointer_->relayout(rank_->whole_state ? rank_->whole_state->store() : *rank_->store, *rank_->sync);
  checkpointer_->set_carried_state(rank_->engine->carried_state());
  Communicator& world = groups_.world();
  double figures[2] = {static_cast<double>(moved.bytes_sent + residuals.bytes_sent), static_cast<double>(moved.bytes_copied)};
  world.allreduce_sum(figures, 2);
  nlohmann::json out = {{"move_ms", world.allreduce_max(moved.ms + residuals.ms)}, {"bytes_sent", figures[0]},
                        {"bytes_kept", figures[1]}, {"exchange_rounds", moved.rounds}};
  if (residuals.of > 0) out["compression_residuals"] = {{"buckets", residuals.of}, {"moved", residuals.buckets}};
  return out;
}

void Trainer::measure_peaks() {
  Communicator& world = groups_.world();
  // MFU's peak: each rank's cores (its threads, or its share of the host's cores when ranks
  // outnumber them), summed over the ranks; runtime.peak_gflops overrides it (for the whole job).
  const int local_ranks = world.local_size();
  const double cores = std::min<double>(omp_get_max_threads(), static_cast<double>(online_cpus()) / local_ranks);
  const CpuPeak peak = cpu_peak(cores);
  const double configured = config_.runtime.peak_gflops;
  peaks_.peak_gflops = configured > 0 ? configured : world.allreduce_sum(peak.gflops);
  char how[320];
  std::snprintf(how, sizeof how, "%s", configured > 0 ? "runtime.peak_gflops" : peak.how.c_str());
  peaks_.how = how;
  if (configured <= 0 && world.size() > 1) peaks_.how += " per rank, " + std::to_string(world.size()) + " ranks";
  // matmul_efficiency's reference: rank 0's SGEMM rate (a restart's: an earlier start's), times the ranks.
  bool cached = false;
  peaks_.sgemm_gflops = world.allreduce_max(world.is_root() ? sgemm_reference_gflops(&cached) : 0.0) * world.size();
  peaks_.sgemm_how = cached ? "SGEMM as an earlier start on this host measured it" : "SGEMM measured now";
  if (world.is_root() && config_.runtime.precision == Precision::bf16) {
    peaks_.bf16_gflops = measure_gemm_gflops(MatmulPrecision::bf16);
  }
}

StepStats Trainer::step(const StopSignals* signals) {
  const TrainConfig& t = config_.train;
  const auto t0 = std::chrono::steady_clock::now();
  for (StepHook* hook : hooks_) hook->before_step(progress_.steps_done);
  StepStats s;
  s.lr = learning_rate(config_.optim, static_cast<int>(progress_.steps_done), t.steps);
  rank_->optimizer->begin_pass(LeasePass::step);  // ZeRO-3: the step's leases follow the last step's
  const StepResult r = rank_->engine->run(progress_.steps_done, s.lr);
  // (The tiers' schedule is the step's own: a checkpoint or an evaluation after it is off it.)
  for (StepHook* hook : hooks_) hook->step_computed(progress_.steps_done);
  s.loss = r.loss;
  s.grad_norm = r.grad_norm;
  rank_->sync_report->take(r.sync);
  s.step = ++progress_.steps_done;
  // The step's one reduction: peak memory, a stop signal, the components' per-rank figures.
  const std::vector<double> maxima = reduce_step_maxima(
      groups_.world(), rank_->sources(), {peak_rss_mb(), signals != nullptr ? static_cast<double>(signals->received()) : 0.0});
  s.peak_rss_mb = maxima[0];
  s.stop_signal = static_cast<int>(maxima[1]);
  checkpointer_->after_step(s.step, workload_->position());
  s.ckpt_stall_ms = checkpointer_->take_stall_ms();
  for (StepHook* hook : hooks_) hook->after_step(s.step);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.seq_len = t.seq_len_at(s.step - 1);
  s.ms = seconds * 1e3;
  s.tokens_per_s = workload_->tokens_of_step(s.step - 1) / seconds;
  const double model_gflops = workload_->flops_of_step(*rank_, s.step - 1) / seconds / 1e9;
  s.mfu = model_gflops / peaks_.peak_gflops;
  s.matmul_efficiency = model_gflops / peaks_.sgemm_gflops;
  return s;
}

double Trainer::evaluate(int batches) { return workload_->evaluate(*rank_, batches, progress_.steps_done).loss; }

double Trainer::evaluate_and_log() {
  const Evaluation e = workload_->evaluate(*rank_, config_.train.eval_batches, progress_.steps_done);
  metrics_.evaluation(progress_.steps_done, e.fields, e.text);
  return e.loss;
}

void Trainer::save(const std::string& root) { checkpointer_->save(root, progress_.steps_done, workload_->position()); }

void Trainer::print_startup(double moments_mb) {
  if (!groups_.world().is_root()) return;
  workload_->print_startup(*rank_);
  std::printf("keel: MFU against a peak of %.1f GFLOP/s (%s); matmul efficiency against %s, "
              "%.1f GFLOP/s (OpenBLAS kernels %s)\n",
              peaks_.peak_gflops, peaks_.how.c_str(), peaks_.sgemm_how.c_str(), peaks_.sgemm_gflops, blas_core().c_str());
  if (config_.runtime.precision == Precision::bf16) {
    const double sgemm_gflops = peaks_.sgemm_gflops / groups_.world().size();  // rank 0's
    // (The training state's dtypes, runtime.param_dtype / grad_dtype, are said by the bf16-state line.)
    const bool fp32_state = config_.runtime.param_dtype == StateDtype::fp32 && config_.runtime.grad_dtype == StateDtype::fp32;
    std::printf("keel: precision bf16: matrix products with bf16 operands, %s: probe %.1f GFLOP/s, SGEMM %.1f; %s\n",
                bf16_engine().c_str(), peaks_.bf16_gflops, sgemm_gflops,
                fp32_state ? "master weights, gradients and AdamW in float32" : "training state: see the bf16 state line");
    if (const std::string warning = bf16_slower_warning(peaks_.bf16_gflops, sgemm_gflops); !warning.empty()) {
      std::printf("%s\n", warning.c_str());
    }
  }
  metrics_.print_startup();
  std::printf("%s\n", memory_per_rank_line(config_.tier, *rank_->optimizer, rank_->tiers.get(), moments_mb,
                                          static_cast<double>(workload_->activation_bytes(*rank_)),
                                          static_cast<double>(checkpointer_->buffer_bytes()))
                         .c_str());
  if (!progress_.resumed_from.empty()) {
    std::printf("keel: resumed from %s at step %lld\n", progress_.resumed_from.c_str(),
                static_cast<long long>(progress_.steps_done));
  }
}

void Trainer::log_run_event() {
  const TrainConfig& t = config_.train;
  const ParallelConfig& p = config_.parallel;
  // The whole model's parameters: each stage's own (a tied tensor's replicas counted once).
  double parameters = 0;
  const ChunkStore& held = rank_->whole_state ? rank_->whole_state->store() : *rank_->store;  // (unsplit)
  for (const Chunk& c : held.chunks()) {
    if (c.replica) continue;
    for (const Segment& seg : c.segments) parameters += static_cast<double>(seg.numel);
  }
  if (groups_.pipelined()) parameters = groups_.pp().allreduce_sum(parameters);
  if (rank_->expert_group) parameters = static_cast<double>(rank_->expert_group->model_param_bytes()) / 4;  // (every expert)
  char host[256] = "";
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char started[32];
  std::strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json run = {{"event", "run"},
                        {"step", progress_.steps_done},
                        {"started", started},
                        {"host", host},
                        {"cpu", cpu_model_name()},
                        {"blas_core", blas_core()},
                        {"threads_per_rank", omp_get_max_threads()},
                        {"peak_gflops", peaks_.peak_gflops},
                        {"peak_how", peaks_.how}};
  run["model"] = workload_->describe(parameters);
  run["batch"] = {{"batch_size", t.batch_size}, {"seq_len", t.seq_len}, {"grad_accum", t.grad_accum},
                  {"steps", t.steps}};
  if (!t.seq_len_schedule.empty()) run["batch"]["seq_len_schedule"] = t.seq_len_schedule;
  run["layout"] = {{"ranks", groups_.world().size()},
                   {"data", groups_.dp().size() / groups_.context_size()},
                   {"pipeline", p.pipeline},
                   {"zero", p.zero},                  {"codec", to_string(config_.sync.codec)}};
  if (p.tensor > 1) {  // (absent where 1: earlier runs' "run" events unchanged)
    run["layout"]["tensor"] = p.tensor;
    if (p.sequence_parallel) run["layout"]["sequence_parallel"] = true;
    // This rank's activation memory (the model's counter: every slot, scratch and recomputed set).
    run["activation_bytes"] = workload_->activation_bytes(*rank_);
  }
  if (p.context > 1) run["layout"]["context"] = p.context;  // (likewise)
  if (p.expert > 1) run["layout"]["expert"] = p.expert;  // (likewise)
  if (config_.tier.device_mib > 0) {
    run["layout"]["tiers"] = {{"device_mib", config_.tier.device_mib},
                              {"host_mib", config_.tier.host_mib},
                              {"nvme_dir", config_.tier.nvme_dir}};
  }
  if (!progress_.resumed_from.empty()) run["resumed_from"] = progress_.resumed_from;
  metrics_.log(run);
}

RunSummary Trainer::run() {
  const bool resumed = !progress_.resumed_from.empty();
  // Memory per rank, as allocated (the moments shrink with ZeRO-1/2), the largest over ranks.
  const double moments_mb = groups_.world().allreduce_max(rank_->optimizer->moment_bytes_held() / 1e6);
  print_startup(moments_mb);
  log_run_event();
  RunSummary summary;
  // A resumed run does not evaluate again where it resumes (that loss is known, and a restart
  // should be training again as soon as it can).
  summary.val_loss_start = std::nan("");
  if (!resumed) {
    summary.val_loss_start = evaluate_and_log();
  }
  checkpointer_->report_recovery(progress_.steps_done, progress_.resumed_from);
  std::fflush(stdout);
  const int64_t first_step = progress_.steps_done;
  summary.mean_tokens_per_s = train_steps(moments_mb, &summary.stop_signal);
  summary.steps = progress_.steps_done;
  if (summary.stop_signal != 0) {
    stop(summary);
    return summary;
  }
  metrics_.print_summaries();
  summary.val_loss_end = evaluate_and_log();
  // A run resumed from its own checkpoint with no step left to do is already saved there (one
  // resumed from elsewhere saves the state into its own directory, in its own layout).
  const bool nothing_new =
      resumed && progress_.steps_done == first_step &&
      fs::weakly_canonical(fs::path(progress_.resumed_from)).parent_path() == fs::weakly_canonical(checkpointer_->root());
  const std::string dir = nothing_new ? progress_.resumed_from
                                      : checkpointer_->save_final(progress_.steps_done, workload_->position());
  summary.final_checkpoint_written = groups_.world().broadcast(groups_.world().is_root() && dir.empty() ? 0 : 1) != 0;
  if (summary.final_checkpoint_written) checkpointer_->remove_memory_copies();
  print_end(summary);
  workload_->print_samples(*rank_);
  return summary;
}

double Trainer::train_steps(double moments_mb, int* stop_signal) {
  const TrainConfig& t = config_.train;
  const StopSignals signals;
  double tokens_per_s_sum = 0;
  int64_t timed = 0;
  try {
    while (progress_.steps_done < t.steps) {
      const StepStats s = step(&signals);
      if (s.step > 1) tokens_per_s_sum += s.tokens_per_s, timed++;  // the first step pays for warm-up
      metrics_.step(s, moments_mb);
      if ((*stop_signal = s.stop_signal) != 0) break;
      if (t.eval_every > 0 && s.step % t.eval_every == 0 && s.step != t.steps) evaluate_and_log();
    }
  } catch (const NonFiniteStep& e) {
    // Every rank stops at the same step: a checkpoint of good state still being written is
    // published, and nothing of the bad step is saved.
    checkpointer_->finish_in_flight();
    const std::string newest = checkpointer_->newest_verified();
    throw NonFiniteStep(std::string(e.what()) + "; newest checkpoint: " + (newest.empty() ? "none" : newest));
  }
  return timed > 0 ? tokens_per_s_sum / timed : 0;
}

void Trainer::stop(RunSummary& summary) {
  const bool written = !checkpointer_->save_final(progress_.steps_done, workload_->position()).empty();
  summary.final_checkpoint_written = groups_.world().broadcast(groups_.world().is_root() && !written ? 0 : 1) != 0;
  if (summary.final_checkpoint_written) checkpointer_->remove_memory_copies();
  summary.checkpoint = checkpointer_->newest_verified();
  if (!groups_.world().is_root()) return;
  std::printf("keel: %s: stopped after step %lld; checkpoint %s%s\n", ::strsignal(summary.stop_signal),
              static_cast<long long>(progress_.steps_done), summary.checkpoint.empty() ? "none" : summary.checkpoint.c_str(),
              summary.final_checkpoint_written ? "" : " (the stop checkpoint was not written)");
  std::fflush(stdout);
}

void Trainer::print_end(RunSummary& summary) {
  // The summary names what is on disk and verifies, not what was meant to be.
  summary.checkpoint = checkpointer_->newest_verified();
  if (!groups_.world().is_root()) return;
  const char* newest = summary.checkpoint.empty() ? "none" : summary.checkpoint.c_str();
  if (!summary.final_checkpoint_written) {
    std::printf("keel: the final checkpoint (step %lld) was not written; newest checkpoint: %s\n",
                static_cast<long long>(progress_.steps_done), newest);
  }
  if (!progress_.resumed_from.empty()) {
    std::printf("keel: val loss %.4f after %lld steps (resumed from %s), %.0f tok/s mean; checkpoint %s\n",
                summary.val_loss_end, static_cast<long long>(summary.steps), progress_.resumed_from.c_str(),
                summary.mean_tokens_per_s, newest);
  } else {
    std::printf("keel: val loss %.4f -> %.4f after %lld steps, %.0f tok/s mean; checkpoint %s\n", summary.val_loss_start,
                summary.val_loss_end, static_cast<long long>(summary.steps), summary.mean_tokens_per_s, newest);
  }
  std::fflush(stdout);
}

}  // namespace keel
