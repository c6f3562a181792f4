#include "pipeline/pipeline_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "comm/expert_parallel.h"
#include "comm/tensor_parallel.h"
#include "core/error.h"
#include "core/fileio.h"
#include "model/moe.h"
#include "optim/adamw.h"
#include "pipeline/micro_batching.h"
#include "pipeline/partitioner.h"
#include "store/tiers.h"

namespace keel::pipeline {

using nlohmann::json;

namespace {

// One rank's timeline as text for gathering: "op micro stage start end" per interval.
std::string encode_timeline(const std::vector<Interval>& timeline) {
  std::ostringstream out;
  out.precision(17);
  for (const Interval& iv : timeline) {
    out << static_cast<int>(iv.instr.op) << ' ' << iv.instr.micro << ' ' << iv.instr.stage << ' ' << iv.start << ' '
        << iv.end << '\n';
  }
  return out.str();
}

std::vector<Interval> decode_timeline(const std::string& text) {
  std::vector<Interval> timeline;
  std::istringstream in(text);
  int op = 0;
  Interval iv;
  while (in >> op >> iv.instr.micro >> iv.instr.stage >> iv.start >> iv.end) {
    iv.instr.op = static_cast<Op>(op);
    timeline.push_back(iv);
  }
  return timeline;
}

}  // namespace

PipelineLayout PipelineLayout::make(const Config& config, int pipeline_rank) {
  return make(config, pipeline_rank, startup_cut(config));
}

PipelineLayout PipelineLayout::make(const Config& config, int pipeline_rank, std::vector<LayerRange> stages) {
  PipelineLayout l;
  const int S = config.parallel.pipeline * virtual_stages(config.parallel);
  l.stages = std::move(stages);
  check(static_cast<int>(l.stages.size()) == S, "pipeline: " + std::to_string(l.stages.size()) + " stages cut for " +
                                                    std::to_string(S));
  l.plan = pipeline::plan(config, l.stages, micro_batches(config));
  for (int s : l.plan.schedule.stages_of(pipeline_rank)) l.mine.push_back(l.stages[s]);
  return l;
}

PipelineStep::PipelineStep(const Config& config, ProcessGroups& groups, PipelineLayout layout, ChunkStore& store,
                           GPT& model, DataLoader& data, GradSync& sync, ShardedOptimizer& optimizer,
                           std::function<void(const nlohmann::json&)> log_event)
    : config_(config),
      groups_(groups),
      store_(store),
      model_(model),
      data_(data),
      sync_(sync),
      optimizer_(optimizer),
      log_event_(std::move(log_event)),
      stages_(std::move(layout.stages)) {
  if (config_.parallel.predict_gradients != PredictGradients::off) {
    prediction_.emplace(config_.parallel.predict_gradients, store_);
    // (Its mask asks each MoE block which experts a W writes: chunks_weights_write.)
    for (int l = 0; l < model_.num_layers(); ++l) {
      if (model_.holds_any({l}) && model_.layer(l).moe() != nullptr) model_.layer(l).moe()->record_experts_written();
    }
  }
  if (config_.monitor.layer_costs_every > 0) {
    profiler_ = std::make_unique<LayerProfiler>(model_, &groups_.pp(), config_.monitor.layer_costs_every, log_event_);
  }
  use_plan(std::move(layout.plan));
  if (config.model.moe() && config.model.moe_balance == MoeBalance::bias) {
    balancer_ = std::make_unique<MoeBiasBalancer>(config.model, groups_.dp(), model_, &groups_.pp());
  }
  // Tied parameters (GPT-2's wte: the embedding's and the head's stages): the ranks holding a
  // copy sum its gradient (every pipeline rank splits, in the model's order of the groups).
  for (const TiedGroup& group : model_.tied_groups()) {
    const bool holds = model_.holds_any(group.layers);
    std::unique_ptr<Communicator> comm = groups_.pp().split(holds ? 0 : 1, groups_.pp().rank());
    tied_comms_.push_back(holds ? std::move(comm) : nullptr);
  }
}

PipelineStep::~PipelineStep() = default;

void PipelineStep::use_plan(Plan plan) {
  const TrainConfig& t = config_.train;
  Communicator& pp = groups_.pp();
  micro_batches_ = plan.schedule.spec.micro;
  schedule_check_ = plan.check;
  // Activation slots from the schedule's proven peak of micro-batches in flight; evaluation sends
  // whole batches of train.batch_size through the stages.
  const int deferred_stages = prediction_ ? static_cast<int>(plan.schedule.stages_of(pp.rank()).size()) : 0;
  if (executor_) check(!executor_->defers_last_weights(), "pipeline: a new plan with gradient prediction");
  executor_.reset();
  // (a context group's rank holds T / context of each sequence: model/context_group.h)
  model_.allocate(std::max(plan.micro_batch, t.batch_size), t.longest_seq_len() / groups_.context_size(),
                  Executor::slots_needed(schedule_check_, pp.rank(), deferred_stages));
  executor_ = std::make_unique<Executor>(model_, pp, std::move(plan.schedule), stages_, config_.parallel.lookahead);
  // Lookahead: the chunk store hears which layers the next instructions use.
  executor_->set_lookahead_hook([this](const std::vector<LayerHint>& hints) { store_.hint_layers(hints); });
  // A new plan is a new order of leases: the tiers record it afresh.
  store_.residency().step_shape_changed();
  if (prediction_) prediction_->attach(*executor_);
}

StepResult PipelineStep::run(int64_t step, double lr) {
  const int step_micro_batches = micro_batches_;  // dynamic micro-batches may change it after the step
  if (profiler_) model_.take_layer_times();        // (evaluations between steps are not the step's)
  model_.set_frozen_layers(config_.optim.frozen_at(step));
  sync_.begin(true, step);  // W notifications reach it for the last micro-batch only
  double loss_sum = run_micro_batches(config_.train.seq_len_at(step));
  const auto sync_start = std::chrono::steady_clock::now();
  if (prediction_) {
    // A mixture of experts: a routed expert the carried W's micro-batch did not choose keeps its
    // gradient; its prediction is zero.
    const int* last = inputs_.data() + inputs_.size() / static_cast<size_t>(micro_batches_) * static_cast<size_t>(micro_batches_ - 1);
    prediction_->predict(micro_batches_, config_.model.moe()
                                             ? chunks_weights_write(model_, store_, last, config_.optim.frozen_at(step))
                                             : std::vector<bool>{});
  }
  sum_tied_grads();  // before the sync takes the tied tensors' home buckets
  sync_.finish();
  StepResult r;
  r.sync = sync_.stats();
  optimizer_.clear_frozen_grads(step);
  const int64_t skipped = optimizer_.skipped_steps();
  update(step, lr, loss_sum, r);
  if (balancer_) balancer_->after_step(optimizer_.skipped_steps() == skipped);
  if (prediction_) prediction_->carry(config_.optim.frozen_at(step));
  executor_->record(Op::grad_sync, sync_start, std::chrono::steady_clock::now());
  report(step);
  if (profiler_) profile(step);
  if (config_.parallel.dynamic_micro_batches) adapt_micro_batches(step);
  r.loss = loss_sum / step_micro_batches;
  return r;
}

std::string PipelineStep::stage_words() const {
  const Schedule& sc = executor_->schedule();
  std::string words;
  for (size_t i = 0; i < stages_.size(); ++i) {
    words += (i ? " " : "") + std::to_string(stages_[i].first) + "-" + std::to_string(stages_[i].last) + "@r" +
             std::to_string(sc.stage_rank[i]);
  }
  return words;
}

std::string PipelineStep::prediction_layout() const {
  return "parallel.predict_gradients = \"" + std::string(to_string(config_.parallel.predict_gradients)) + "\" on parallel.pipeline = " +
         std::to_string(groups_.pp().size()) + " x " + std::to_string(groups_.dp().size()) +
         " data-parallel replica(s), stages (layers@rank) " + stage_words() + ", rank " +
         std::to_string(groups_.world().rank()) + " holding " + std::to_string(store_.chunks().size()) + " chunks of " +
         std::to_string(store_.numel()) + " floats";
}

std::string PipelineStep::save(int64_t steps_done, std::vector<float>& floats) {
  model_.set_frozen_layers(config_.optim.frozen_at(steps_done));
  executor_->run_deferred();
  json saved = {{"what", prediction_layout()}, {"prediction", prediction_->save(floats)}};
  // Bias balancing's routing biases after the prediction's floats, described as it describes them.
  if (balancer_) saved["balance"] = json::parse(balancer_->save(steps_done, floats));
  return saved.dump();
}

namespace {

// The floats of the routing biases a record's "balance" description (comm/moe_balance.h) holds.
size_t balance_floats(const json& balance) {
  return balance.at("moe_blocks").get<size_t>() * balance.at("experts").get<size_t>();
}

}  // namespace

std::string PipelineStep::check_resume(const std::string& layout, size_t floats) const {
  if (layout.empty()) return "";  // none saved (a run without prediction): it starts as at a first step
  std::string saved, fits;
  try {
    const json j = json::parse(layout);
    if (!j.contains("prediction")) {  // the routing biases alone (a run without prediction)
      if (!balancer_) return "its ranks saved routing biases (model.moe_balance = \"bias\"), which this run does not balance by";
      return balancer_->check_resume(layout, floats);  // (the prediction then starts as at a first step)
    }
    saved = j.at("what").get<std::string>();
    if (j.contains("balance") != (balancer_ != nullptr)) {
      return std::string("its gradient prediction state was saved ") + (balancer_ ? "without" : "with") +
             " routing biases; this run has " + (balancer_ ? "" : "no ") +
             "bias balancing: resume it with the same model.moe_balance";
    }
    size_t biases = 0;
    if (balancer_) {
      biases = std::min(floats, balance_floats(j.at("balance")));
      if (std::string why = balancer_->check_resume(j.at("balance").dump(), biases); !why.empty()) return why;
    }
    fits = prediction_->check_saved(j.at("prediction"), floats - biases);
  } catch (const json::exception& e) {
    return std::string("its gradient prediction state has an unreadable description (") + e.what() + ")";
  }
  const std::string mine = prediction_layout();
  if (saved != mine) {
    return "its gradient prediction state was saved with " + saved + "; this run has " + mine +
           ": resume it with the same parallel.predict_gradients, parallel.pipeline, parallel.schedule, stage cut "
           "(parallel.stage_boundaries), data-parallel size and store.chunk_bytes (the predictor's state is per rank "
           "and per element of its stages)";
  }
  return fits;
}

void PipelineStep::restore(const std::string& layout, const std::vector<float>& floats) {
  if (layout.empty()) return;
  const json j = json::parse(layout);
  if (!j.contains("prediction")) {  // the routing biases alone (check_resume accepted them)
    balancer_->restore(layout, floats);
    return;
  }
  const size_t biases = j.contains("balance") ? balance_floats(j.at("balance")) : 0;
  prediction_->restore(j.at("prediction"), std::span<const float>(floats.data(), floats.size() - biases));
  if (biases > 0) {
    balancer_->restore(j.at("balance").dump(), std::vector<float>(floats.end() - static_cast<std::ptrdiff_t>(biases), floats.end()));
  }
}

void PipelineStep::profile(int64_t step) {
  std::vector<double> comm(static_cast<size_t>(model_.num_layers()), 0.0);
  double quickest = -1;
  for (const Interval& iv : executor_->message_timeline()) {
    const Op op = iv.instr.op;
    const LayerRange& r = stages_[iv.instr.stage];
    // An activation leaves a stage's last layer and enters the next stage's first; its gradient
    // goes back the other way.
    const bool at_last = op == Op::send_act || op == Op::recv_grad;
    comm[at_last ? r.last : r.first] += iv.end - iv.start;
    if (op == Op::recv_act || op == Op::recv_grad) quickest = quickest < 0 ? iv.end - iv.start : std::min(quickest, iv.end - iv.start);
  }
  const int micro_batch = config_.train.batch_size * config_.train.grad_accum / micro_batches_;
  profiler_->after_step(step + 1, config_.train.seq_len_at(step), micro_batch, micro_batches_, &comm, quickest);
}

void PipelineStep::update(int64_t step, double lr, double& loss_sum, StepResult& r) {
  Communicator& world = groups_.world();
  Communicator& pp = groups_.pp();
  const int replicas = groups_.dp().size();
  if (!config_.parallel.post_validate) {
    // Each stage's share of the norm (tied tensors counted once, at home), summed over the
    // replica's stages; the loss lives on the last stage, averaged over replicas.
    // Under ZeRO-2 each replica holds the summed gradient of its own chunks only.
    // With tensor parallelism a stage's share is its tensor group's (split tensors summed over the
    // group, replicated ones once), and every rank of the last stage's group holds the same loss:
    // the group's first rank counts it.
    Communicator* tensor = groups_.tp();
    if (tensor != nullptr && config_.sync.codec != SyncCodec::none) tensor_share_replicated_grads(model_, *tensor);
    const bool sharded = optimizer_.norm_is_sharded();
    // Sharded experts (comm/expert_parallel.h): each expert's squares once, over the expert group.
    Communicator* experts = experts_sharded(config_) ? groups_.ep() : nullptr;
    const auto owned = [&](int chunk) { return optimizer_.owns(chunk); };
    const double squares = tensor == nullptr ? (experts != nullptr && !sharded ? expert_grad_squares(store_, *experts)
                                                                              : optimizer_.local_grad_squares())
                           : sharded         ? tensor_grad_share(model_, tensor->rank(), owned)
                                             : tensor_grad_squares(model_, *tensor, experts);
    r.grad_norm = std::sqrt(sharded ? world.allreduce_sum(squares) : pp.allreduce_sum(squares));
    if (tensor != nullptr && tensor->rank() != 0) loss_sum = 0;
    loss_sum = world.allreduce_sum(loss_sum) / replicas;
    if (optimizer_.accept(step, loss_sum, r.grad_norm)) optimizer_.step(lr, step + 1, optimizer_.clip_for(r.grad_norm));
    return;
  }
  // Zero Bubble's post-validation: the sum of the norm over the stages runs while this rank
  // steps as if the norm needs no clipping, from a copy kept in case it does; once the norm is
  // known, the step is redone from the copy if it did. The same arithmetic as waiting: the
  // same bytes. With tensor parallelism the stage's share is its tensor group's, summed over the
  // group first (blocking; the copy covers the rank's shards), and the loss is counted once per group.
  Communicator* tensor = groups_.tp();
  if (tensor != nullptr && config_.sync.codec != SyncCodec::none) tensor_share_replicated_grads(model_, *tensor);
  Communicator* experts = experts_sharded(config_) ? groups_.ep() : nullptr;
  double squares = tensor != nullptr    ? tensor_grad_squares(model_, *tensor, experts)
                   : experts != nullptr ? expert_grad_squares(store_, *experts)
                                        : grad_sum_squares(store_);
  if (tensor != nullptr && tensor->rank() != 0) loss_sum = 0;
  Communicator::Request norm_request = pp.iallreduce_sum(&squares, 1);
  // The copy: the float32 planes, but those bf16 training state holds (between steps their float32
  // pages are given back): its bits and masters instead (store/bf16_state.h).
  Bf16State* bf16 = optimizer_.bf16_state();
  std::vector<Plane> planes;  // the float32 planes copied, each n floats of backup_ in this order
  for (Plane plane : {Plane::param, Plane::grad, Plane::adam_m, Plane::adam_v}) {
    if (bf16 == nullptr || !bf16->holds(plane)) planes.push_back(plane);
  }
  const size_t n = static_cast<size_t>(store_.numel());
  backup_.resize(planes.size() * n);
  for (size_t k = 0; k < planes.size(); ++k) {
    const std::span<float> v = store_.range_view(planes[k], 0, store_.numel());
    std::copy(v.begin(), v.end(), backup_.begin() + static_cast<int64_t>(k * n));
  }
  if (bf16 != nullptr) bf16->copy_into(bf16_backup_);
  optimizer_.step_now(lr, step + 1, 1.0f);
  pp.wait(norm_request);
  r.grad_norm = std::sqrt(squares);
  loss_sum = world.allreduce_sum(loss_sum) / replicas;
  auto restore = [&](bool grads) {
    for (size_t k = 0; k < planes.size(); ++k) {
      if (planes[k] == Plane::grad && !grads) continue;
      const std::span<float> v = store_.range_view(planes[k], 0, store_.numel());
      std::copy_n(backup_.begin() + static_cast<int64_t>(k * n), n, v.begin());
    }
    if (bf16 != nullptr) bf16->restore(bf16_backup_, grads);
  };
  if (!std::isfinite(r.grad_norm) || !std::isfinite(loss_sum)) {
    restore(false);  // the optimistic step is undone; accept() drops the gradients
    rolled_back_ = true;
    optimizer_.accept(step, loss_sum, r.grad_norm);
    return;
  }
  const float clip = optimizer_.clip_for(r.grad_norm);
  rolled_back_ = clip != 1.0f;
  if (rolled_back_) {
    restore(true);
    optimizer_.step_now(lr, step + 1, clip);
  }
}

double PipelineStep::run_micro_batches(int sequence_T) {
  const TrainConfig& t = config_.train;
  // A context group's rank reads its T / context rows of each sequence (data/loader.h); the data
  // group spans data x context, so the gradient scale below still counts every token once.
  const int T = sequence_T / groups_.context_size();
  const int sequences = t.batch_size * t.grad_accum, b = sequences / micro_batches_;
  const int replicas = groups_.dp().size();
  // The step reads the same grad_accum batches one rank would, then cuts them into the
  // pipeline's micro-batches (every rank reads them: stage 0 needs the inputs, the last stage the
  // targets; the rest only their shape). W's carried into this step read the previous step's
  // tokens (the embedding's W does).
  std::swap(inputs_, inputs_prev_);
  std::swap(targets_, targets_prev_);
  inputs_.resize(static_cast<size_t>(sequences) * T);
  targets_.resize(inputs_.size());
  for (int k = 0; k < t.grad_accum; ++k) {
    const Batch batch = data_.next(sequence_T);
    const size_t n = static_cast<size_t>(batch.B) * T, at = static_cast<size_t>(k) * t.batch_size * T;
    std::copy(batch.inputs, batch.inputs + n, inputs_.begin() + at);
    std::copy(batch.targets, batch.targets + n, targets_.begin() + at);
  }
  std::vector<Batch> micro(micro_batches_);
  for (int j = 0; j < micro_batches_; ++j) {
    micro[j].inputs = inputs_.data() + static_cast<size_t>(j) * b * T;
    micro[j].targets = targets_.data() + static_cast<size_t>(j) * b * T;
    micro[j].B = b;
    micro[j].T = T;
    micro[j].grad_scale = 1.0f / (static_cast<float>(b) * T * micro_batches_ * replicas);
  }
  return executor_->run_step(micro, replicas > 1 ? &sync_ : nullptr);
}

void PipelineStep::sum_tied_grads() {
  const std::vector<TiedGroup>& groups = model_.tied_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    Communicator* comm = tied_comms_[i].get();
    if (comm == nullptr || comm->size() < 2) continue;
    const TensorId id = store_.find(groups[i].tensor);
    const PageLease use = store_.use_tensor(id, {Plane::grad}, {Plane::grad});
    std::span<float> g = store_.view(id, Plane::grad);
    comm->allreduce_sum(g.data(), g.size());
  }
}

void PipelineStep::report(int64_t step) {
  Communicator& world = groups_.world();
  const ExecutorStats& e = executor_->stats();
  double maxima[2] = {e.recv_wait_ms, e.peak_activation_bytes / 1e6};
  world.allreduce_max(maxima, 2);
  recv_wait_ms_ = maxima[0];
  activation_mb_ = maxima[1];
  // The bubble of replica 0, measured on its ranks' common clock origin (pipeline/executor.h).
  const std::string mine = encode_timeline(executor_->timeline());
  const std::vector<std::string> parts = groups_.pp().gather_strings(mine);
  if (world.is_root()) {
    Timeline timeline;
    for (const std::string& p : parts) timeline.per_rank.push_back(decode_timeline(p));
    account_bubble(timeline);
    bubble_ = timeline.bubble;
    rank_bubble_ = timeline.rank_bubble;
  }
  if (config_.parallel.trace && step + 1 == config_.train.steps) write_trace(step, world.gather_strings(mine));
}

void PipelineStep::write_trace(int64_t step, const std::vector<std::string>& timelines) {
  if (!groups_.world().is_root()) return;
  Timeline timeline;
  for (const std::string& p : timelines) timeline.per_rank.push_back(decode_timeline(p));
  const std::string path = config_.train.run_dir + "/pipeline_trace.json";
  const std::string trace = chrome_trace(timeline, std::string("keel ") + to_string(config_.parallel.schedule) + " step " + std::to_string(step + 1));
  write_file_atomic(path, {ByteRange{trace.data(), trace.size()}});
  // The same step as a text Gantt chart (replica 0), under the run's summary: its stages are
  // world ranks stage x (context x tensor) (comm/process_groups.h), the first context and tensor
  // rank of each.
  const int stride = std::max(1, config_.parallel.context) * std::max(1, config_.parallel.tensor);
  Timeline replica0;
  for (int stage = 0; stage < config_.parallel.pipeline; ++stage) {
    replica0.per_rank.push_back(std::move(timeline.per_rank.at(static_cast<size_t>(stage) * stride)));
  }
  timeline = std::move(replica0);
  account_bubble(timeline);
  std::printf("keel: pipeline timeline of step %lld (replica 0; F forward, B input grads, W weight grads, S sync + "
              "optimizer, . idle), bubble %.1f%%; Chrome trace %s\n%s",
              static_cast<long long>(step + 1), 100 * timeline.bubble, path.c_str(), gantt(timeline, 100).c_str());
  std::fflush(stdout);
}

StageTimes PipelineStep::measured_stage_times() {
  StageTimes times;
  times.micro_batch = config_.train.batch_size * config_.train.grad_accum / micro_batches_;
  const int S = static_cast<int>(stages_.size());
  times.forward.assign(S, 0.0);
  times.backward_input.assign(S, 0.0);
  times.backward_weight.assign(S, 0.0);
  add_stage_times(executor_->timeline(), times);
  // Each stage runs on one rank of the replica: the sums put every stage's times everywhere.
  std::vector<double> all;
  for (const auto* v : {&times.forward, &times.backward_input, &times.backward_weight}) all.insert(all.end(), v->begin(), v->end());
  groups_.pp().allreduce_sum(all.data(), all.size());
  for (int s = 0; s < S; ++s) {
    times.forward[s] = all[s];
    times.backward_input[s] = all[S + s];
    times.backward_weight[s] = all[2 * S + s];
  }
  return times;
}

void PipelineStep::adapt_micro_batches(int64_t step_index) {
  const int64_t step = step_index + 1;  // the step just measured (step 1 pays for warm-up)
  if (step != 2 && step != 3) return;
  const StageTimes times = measured_stage_times();
  std::string reason;
  int m = micro_batches_;
  if (step == 2) {
    first_measure_ = times;
    m = probe_micro_batches(config_, micro_batches_);
    reason = "measuring a second count";
  } else {
    // Every rank runs what rank 0 (replica 0's measurement) chose.
    if (first_measure_.micro_batch != times.micro_batch) {
      const MicroBatchChoice c = choose_micro_batches(config_, stages_, first_measure_, times);
      m = c.micro_batches;
      reason = c.reason;
    }
    m = static_cast<int>(groups_.world().broadcast(static_cast<int64_t>(m)));
  }
  if (groups_.world().is_root()) {
    std::printf("keel: step %lld: pipeline micro-batches %d -> %d (%s)\n", static_cast<long long>(step), micro_batches_, m,
                reason.c_str());
    std::fflush(stdout);
  }
  log_event_({{"event", "micro_batches"}, {"step", step}, {"from", micro_batches_}, {"to", m}, {"reason", reason}});
  if (m != micro_batches_) use_plan(plan(config_, stages_, m));
}

void PipelineStep::print_startup() const {
  const Schedule& sc = executor_->schedule();
  const std::string cut = stage_words();
  int peak = 0;
  for (int p : schedule_check_.peak_in_flight) peak = std::max(peak, p);
  std::printf("keel: pipeline of %d ranks x %d data-parallel replica(s), schedule %s, %d stages (layers@rank: %s), "
              "%d micro-batches of %d sequences, at most %d in flight per rank (%.1f MB of activations)\n",
              sc.spec.ranks, groups_.dp().size(), kind_name(sc.spec.kind), sc.num_stages(), cut.c_str(), micro_batches_,
              config_.train.batch_size * config_.train.grad_accum / micro_batches_, peak,
              *std::max_element(schedule_check_.peak_bytes.begin(), schedule_check_.peak_bytes.end()) / 1e6);
  json stages = json::array();
  for (const LayerRange& r : stages_) stages.push_back({r.first, r.last});
  log_event_({{"event", "pipeline"}, {"schedule", kind_name(sc.spec.kind)}, {"ranks", sc.spec.ranks},
              {"replicas", groups_.dp().size()}, {"stages", stages}, {"stage_rank", sc.stage_rank},
              {"micro_batches", micro_batches_}, {"peak_in_flight", schedule_check_.peak_in_flight},
              {"peak_activation_bytes", schedule_check_.peak_bytes}});
}

void PipelineStep::add_step_fields(double step_ms, nlohmann::json& line) {
  if (profiler_) profiler_->add_step_fields(step_ms, line);
  line["pipeline_bubble"] = bubble_;
  line["pipeline_rank_bubble"] = rank_bubble_;
  line["pipeline_recv_wait_ms"] = recv_wait_ms_;
  line["pipeline_activation_mb"] = activation_mb_;
  if (config_.parallel.post_validate) line["pipeline_rolled_back"] = rolled_back_;
}

std::string PipelineStep::progress_fragment(double) const {
  char buf[80];
  std::snprintf(buf, sizeof buf, "bubble %.1f%%, waits %.1f ms", 100 * bubble_, recv_wait_ms_);
  return buf;
}

}  // namespace keel::pipeline
