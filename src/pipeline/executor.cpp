#include "pipeline/executor.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace keel::pipeline {

namespace {

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Passes B notifications through (they drive the sync's progress) and W notifications of the
// last micro-batch in descending layer order, which is what the gradient sync's buckets expect:
// with several stages per rank (interleaved, zb-v) a lower stage's W can finish first. The home
// layers of tied groups (GPT-2: the embedding, whose wte the head shares) are held back: their
// copies' gradients are summed (PipelineStep) before the sync takes them.
class DescendingWeights final : public BackwardObserver {
 public:
  DescendingWeights(BackwardObserver* sync, std::vector<int> layers, const std::vector<TiedGroup>& tied)
      : sync_(sync), layers_(std::move(layers)) {
    std::sort(layers_.rbegin(), layers_.rend());
    for (const TiedGroup& g : tied) std::erase(layers_, g.home);
  }
  void after_backward_input(int layer) override { sync_->after_backward_input(layer); }
  void after_backward_weight(int layer) override {
    done_.insert(layer);
    while (next_ < layers_.size() && done_.count(layers_[next_])) sync_->after_backward_weight(layers_[next_++]);
  }

 private:
  BackwardObserver* sync_;
  std::vector<int> layers_;  // this rank's layers, descending
  std::set<int> done_;
  size_t next_ = 0;
};

}  // namespace

Executor::Executor(GPT& model, Communicator& pipeline, Schedule schedule, std::vector<LayerRange> stages, int lookahead)
    : model_(model), comm_(pipeline), schedule_(std::move(schedule)), stages_(std::move(stages)),
      lookahead_(lookahead), rank_(pipeline.rank()) {
  check(static_cast<int>(stages_.size()) == schedule_.num_stages(),
        "pipeline: " + std::to_string(stages_.size()) + " layer ranges for " + std::to_string(schedule_.num_stages()) +
            " stages");
  check(comm_.size() == schedule_.spec.ranks, "pipeline: a schedule for " + std::to_string(schedule_.spec.ranks) +
                                                  " ranks on a pipeline of " + std::to_string(comm_.size()));
  for (int s : schedule_.stages_of(rank_)) {
    for (int l = stages_[s].first; l <= stages_[s].last; ++l) {
      check(model_.has_layer(l), "pipeline: rank " + std::to_string(rank_) + " lacks layer " + std::to_string(l) +
                                     " of its stage " + std::to_string(s));
    }
  }
  for (int k = model_.slots() - 1; k >= 0; --k) free_slots_.push_back(k);
  act_sends_.assign(model_.slots(), Communicator::Request{});
}


int Executor::tag(Op op, int micro, int stage) const {
  // Activations, their gradients and evaluation's activations each get tags of their own, the
  // same whatever the step's micro-batch count (3 x stages x 4096: OpenMPI's MPI_TAG_UB is 2^31 - 1).
  const int kind = op == Op::send_act || op == Op::recv_act ? 0 : op == Op::send_grad || op == Op::recv_grad ? 1 : 2;
  return (kind * schedule_.num_stages() + stage) * kMaxMicro + micro;
}

size_t Executor::message_floats() const {
  const Batch& b = micro_->front();
  return rows(static_cast<int64_t>(b.B) * b.T) * model_.config().n_embd;
}

size_t Executor::rows(int64_t N) const {
  const TensorGroup* tensor = model_.tensor_group();
  return static_cast<size_t>(tensor != nullptr ? tensor->rows(N) : N);
}

int Executor::slot_of(int micro, int stage, bool allocate) {
  const auto key = std::make_pair(micro, stage);
  if (auto it = slot_.find(key); it != slot_.end()) return it->second;
  if (!allocate) return -1;
  // Prefer a slot whose outgoing activation has left; otherwise wait for one (its receiver
  // already consumed it: the slot's W came after the gradient of that activation arrived).
  int pick = -1;
  for (size_t i = 0; i < free_slots_.size() && pick < 0; ++i) {
    if (comm_.test(act_sends_[free_slots_[i]])) pick = static_cast<int>(i);
  }
  check(!free_slots_.empty(), "pipeline: rank " + std::to_string(rank_) + " ran out of its " +
                                  std::to_string(model_.slots()) + " activation slots");
  if (pick < 0) pick = static_cast<int>(free_slots_.size()) - 1;
  const int slot = free_slots_[pick];
  free_slots_.erase(free_slots_.begin() + pick);
  comm_.wait(act_sends_[slot]);
  slot_[key] = slot;
  const int used = model_.slots() - static_cast<int>(free_slots_.size());
  stats_.peak_slots = std::max(stats_.peak_slots, used);
  stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, used * model_.slot_bytes());
  return slot;
}

void Executor::release(int micro, int stage) {
  const auto it = slot_.find({micro, stage});
  free_slots_.push_back(it->second);
  slot_.erase(it);
}

void Executor::post(const Instr& in) {
  Pending& p = receives_[{static_cast<int>(in.op), in.micro * schedule_.num_stages() + in.stage}];
  if (p.posted) return;
  const LayerRange& r = stages_[in.stage];
  if (in.op == Op::recv_act) {
    const int slot = slot_of(in.micro, in.stage, true);
    p.request = comm_.irecv(model_.input(slot, r.first), message_floats(), in.peer, tag(in.op, in.micro, in.stage));
  } else {
    const int slot = slot_of(in.micro, in.stage, false);
    if (slot < 0) return;  // its F has not run: posted later
    p.request = comm_.irecv(model_.output_grad(slot, r.last), message_floats(), in.peer, tag(in.op, in.micro, in.stage));
  }
  p.posted = true;
}

// Posts the receives of the next `lookahead` compute instructions from position `from` on.
void Executor::post_receives(size_t from) {
  const std::vector<Instr>& list = schedule_.per_rank[rank_];
  int computes = 0;
  for (size_t i = from; i < list.size() && computes <= lookahead_; ++i) {
    const Instr& in = list[i];
    if (is_compute(in.op)) computes++;
    if (in.op == Op::recv_grad) post(in);
    if (in.op == Op::recv_act && slot_of(in.micro, in.stage, false) < 0 &&
        static_cast<int>(early_.size()) < kEarlySlots && !free_slots_.empty()) {
      post(in);
      early_.insert({in.micro, in.stage});
    }
  }
}

void Executor::wait_receive(const Instr& in) {
  Pending& p = receives_[{static_cast<int>(in.op), in.micro * schedule_.num_stages() + in.stage}];
  if (!p.posted) post(in);
  check(p.posted, "pipeline: rank " + std::to_string(rank_) + " cannot post " + to_string(in));
  // A wait is where the previous step's deferred W's fill in.
  if (!carried_.empty() && !comm_.test(p.request)) run_carried();
  const auto t = std::chrono::steady_clock::now();
  comm_.wait(p.request);
  stats_.recv_wait_ms += ms_between(t, std::chrono::steady_clock::now());
}

void Executor::run_carried() {
  around_(true);
  for (const Deferred& d : carried_) {
    const auto start = std::chrono::steady_clock::now();
    model_.backward_weight(stages_[d.stage], d.slot, d.batch, nullptr);
    free_slots_.push_back(d.slot);
    Interval iv;
    iv.instr = Instr{Op::backward_weight, -1, d.stage, -1};  // micro -1: the previous step's
    iv.start = ms_between(t0_, start);
    iv.end = ms_between(t0_, std::chrono::steady_clock::now());
    timeline_.push_back(iv);
  }
  carried_.clear();
  around_(false);
}

void Executor::run_deferred() {
  if (deferred_.empty()) return;
  carried_ = std::move(deferred_);
  deferred_.clear();
  run_carried();
}

void Executor::send_grad(const Instr& in, int slot) {
  // Copied out: the slot may be reused before the previous stage takes the message.
  size_t pick = grad_buffers_.size();
  for (size_t i = 0; i < grad_buffers_.size() && pick == grad_buffers_.size(); ++i) {
    if (comm_.test(grad_buffers_[i].second)) pick = i;
  }
  const size_t n = message_floats();
  // Buffers hold the largest message the model's activations allow: a step of longer sequences
  // (a curriculum) reuses them.
  const size_t most = rows(static_cast<int64_t>(model_.allocated_B()) * model_.allocated_T()) * model_.config().n_embd;
  if (n > most) throw Error("pipeline: a message of " + std::to_string(n) + " floats exceeds the allocated activations");
  if (pick == grad_buffers_.size()) grad_buffers_.emplace_back(std::make_unique<float[]>(most), Communicator::Request{});
  float* buffer = grad_buffers_[pick].first.get();
  std::memcpy(buffer, model_.input_grad(slot, stages_[in.stage].first), n * sizeof(float));
  grad_buffers_[pick].second = comm_.isend(buffer, n, in.peer, tag(in.op, in.micro, in.stage - 1));
}

void Executor::notify_hook(size_t from) {
  if (!hook_) return;
  const std::vector<Instr>& list = schedule_.per_rank[rank_];
  std::vector<LayerHint> hints;
  int computes = 0;
  // This instruction's layers first (needed now: never evicted for the others), then the next
  // `lookahead` compute instructions'.
  for (size_t i = from; i < list.size() && computes <= lookahead_; ++i) {
    const Instr& in = list[i];
    if (!is_compute(in.op)) continue;
    computes++;
    const LayerRange& r = stages_[in.stage];
    const Plane plane = in.op == Op::backward_weight ? Plane::grad : Plane::param;
    // A layer of a tied group reads (and its W writes) the group's home chunks, held beside it on
    // a stage without the home layer (GPT-2's head and wte).
    std::vector<int> homes;
    for (const TiedGroup& g : model_.tied_groups()) {
      const bool used = std::any_of(g.layers.begin(), g.layers.end(), [&](int l) { return l >= r.first && l <= r.last; });
      if (used && (g.home < r.first || g.home > r.last)) homes.push_back(g.home);
    }
    if (in.op == Op::forward) {
      for (int l = r.first; l <= r.last; ++l) hints.push_back({l, plane});
      for (int h : homes) hints.push_back({h, plane});
    } else {
      for (int h : homes) hints.push_back({h, plane});
      for (int l = r.last; l >= r.first; --l) hints.push_back({l, plane});
    }
  }
  hook_(hints);
}

void Executor::record_message(const Instr& in, std::chrono::steady_clock::time_point start) {
  Interval iv;
  iv.instr = in;
  iv.start = ms_between(t0_, start);
  iv.end = ms_between(t0_, std::chrono::steady_clock::now());
  messages_.push_back(iv);
}

void Executor::record(Op op, std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end) {
  Interval iv;
  iv.instr.op = op;
  iv.start = ms_between(t0_, start);
  iv.end = ms_between(t0_, end);
  timeline_.push_back(iv);
}

bool Executor::weight_follows(size_t i) const {
  const std::vector<Instr>& list = schedule_.per_rank[rank_];
  for (size_t k = i + 1; k < list.size(); ++k) {
    if (!is_compute(list[k].op)) continue;
    return list[k].op == Op::backward_weight && list[k].micro == list[i].micro && list[k].stage == list[i].stage;
  }
  return false;
}

double Executor::run_step(const std::vector<Batch>& micro, BackwardObserver* sync) {
  check(schedule_.spec.micro <= kMaxMicro, "pipeline: at most " + std::to_string(kMaxMicro) + " micro-batches a step");
  check(static_cast<int>(micro.size()) == schedule_.spec.micro,
        "pipeline: " + std::to_string(micro.size()) + " micro-batches for a schedule of " +
            std::to_string(schedule_.spec.micro));
  micro_ = &micro;
  carried_ = std::move(deferred_);
  deferred_.clear();
  receives_.clear();
  early_.clear();
  fused_.clear();
  timeline_.clear();
  messages_.clear();
  stats_ = ExecutorStats{};
  std::vector<int> my_layers;
  for (int s : schedule_.stages_of(rank_)) {
    for (int l = stages_[s].first; l <= stages_[s].last; ++l) my_layers.push_back(l);
  }
  std::unique_ptr<DescendingWeights> last_weights;
  if (sync != nullptr) last_weights = std::make_unique<DescendingWeights>(sync, my_layers, model_.tied_groups());
  const int last_micro = schedule_.spec.micro - 1;
  // A common start: the timelines of all ranks share one origin (one machine's steady clock, or
  // a barrier's skew apart across machines).
  comm_.barrier();
  t0_ = std::chrono::steady_clock::now();
  double loss = 0;
  const std::vector<Instr>& list = schedule_.per_rank[rank_];
  for (size_t i = 0; i < list.size(); ++i) {
    const Instr& in = list[i];
    if (in.op == Op::grad_sync || in.op == Op::optimizer) break;  // the trainer's part
    post_receives(i);
    if (is_compute(in.op)) notify_hook(i);
    const LayerRange& r = in.stage >= 0 ? stages_[in.stage] : stages_[0];
    const auto start = std::chrono::steady_clock::now();
    switch (in.op) {
      case Op::recv_act:
      case Op::recv_grad:
        wait_receive(in);
        early_.erase({in.micro, in.stage});
        record_message(in, start);
        continue;
      case Op::send_act: {
        const int slot = slot_of(in.micro, in.stage, false);
        act_sends_[slot] = comm_.isend(model_.output(slot, r.last), message_floats(), in.peer,
                                       tag(Op::recv_act, in.micro, in.stage + 1));
        record_message(in, start);
        continue;
      }
      case Op::send_grad:
        send_grad(in, slot_of(in.micro, in.stage, false));
        record_message(in, start);
        continue;
      case Op::forward: {
        const int slot = slot_of(in.micro, in.stage, true);
        // Consecutive stages on this rank (the turn of zb-v's V) pass the activation in memory.
        if (in.stage > 0 && schedule_.stage_rank[in.stage - 1] == rank_) {
          const int from = slot_of(in.micro, in.stage - 1, false);
          std::memcpy(model_.input(slot, r.first), model_.output(from, stages_[in.stage - 1].last),
                      message_floats() * sizeof(float));
        }
        const float l = model_.forward(r, slot, micro[in.micro]);
        if (r.last == model_.num_layers() - 1) loss += l;
        break;
      }
      case Op::backward_input: {
        const int slot = slot_of(in.micro, in.stage, false);
        if (model_.recomputes() && weight_follows(i) && !(around_ && in.micro == last_micro)) {
          if (!carried_.empty()) run_carried();  // (as W below: before any of this step's)
          model_.backward(r, slot, micro[in.micro], sync, in.micro == last_micro ? last_weights.get() : nullptr);
          fused_.insert({in.micro, in.stage});
        } else {
          model_.backward_input(r, slot, micro[in.micro], sync);
        }
        if (in.stage > 0 && schedule_.stage_rank[in.stage - 1] == rank_) {
          std::memcpy(model_.output_grad(slot_of(in.micro, in.stage - 1, false), stages_[in.stage - 1].last),
                      model_.input_grad(slot, r.first), message_floats() * sizeof(float));
        }
        break;
      }
      case Op::backward_weight: {
        // Carried W's accumulate before any of this step's: the same sums whenever they ran.
        if (!carried_.empty()) run_carried();
        const int slot = slot_of(in.micro, in.stage, false);
        if (fused_.erase({in.micro, in.stage}) > 0) {  // ran with its B
          release(in.micro, in.stage);
          break;
        }
        if (around_ && in.micro == last_micro) {  // left for the next step; its slot stays taken
          deferred_.push_back({in.stage, slot, micro[in.micro]});
          slot_.erase({in.micro, in.stage});
          continue;
        }
        model_.backward_weight(r, slot, micro[in.micro], in.micro == last_micro ? last_weights.get() : nullptr);
        release(in.micro, in.stage);
        break;
      }
      default:
        break;
    }
    Interval iv;
    iv.instr = in;
    iv.start = ms_between(t0_, start);
    iv.end = ms_between(t0_, std::chrono::steady_clock::now());
    timeline_.push_back(iv);
  }
  if (!carried_.empty()) run_carried();  // no wait came: they run before the step's end
  for (auto& [buffer, request] : grad_buffers_) comm_.wait(request);
  for (Communicator::Request& r : act_sends_) comm_.wait(r);
  check(slot_.empty(), "pipeline: rank " + std::to_string(rank_) + " ended a step with activations in flight");
  return loss;
}

double Executor::forward_only(const Batch& batch) {
  const std::vector<Batch> one{batch};
  micro_ = &one;
  double loss = 0;
  // Any slot not kept for a deferred W.
  check(!free_slots_.empty(), "pipeline: rank " + std::to_string(rank_) + " has no free activation slot to evaluate");
  const int slot = free_slots_.back();
  const int S = schedule_.num_stages();
  for (int s = 0; s < S; ++s) {
    if (schedule_.stage_rank[s] != rank_) continue;
    const LayerRange& r = stages_[s];
    if (s > 0 && schedule_.stage_rank[s - 1] != rank_) {
      Communicator::Request q = comm_.irecv(model_.input(slot, r.first), message_floats(), schedule_.stage_rank[s - 1],
                                            tag(Op::forward, 0, s));
      comm_.wait(q);
    }
    const float l = model_.forward(r, slot, batch);
    if (s == S - 1) loss = l;
    if (s + 1 < S && schedule_.stage_rank[s + 1] != rank_) {
      Communicator::Request q = comm_.isend(model_.output(slot, r.last), message_floats(), schedule_.stage_rank[s + 1],
                                            tag(Op::forward, 0, s + 1));
      comm_.wait(q);
    }
  }
  micro_ = nullptr;
  return loss;
}

}  // namespace keel::pipeline
