// Runs a schedule's instruction list for this rank over MPI: F, B and W of its stages on the
// model's activation slots, activations and their gradients as non-blocking messages. Receives
// are posted ahead of the instruction that needs them (up to `lookahead` compute instructions
// ahead, slots permitting) and gradients leave from buffers of their own, so computing never
// waits on a send. Every instruction's start and end is recorded: the timeline gives the step's
// bubble (pipeline/schedule.h account_bubble) and its Chrome trace.
//
// Results do not depend on timing: each stage sums its micro-batches' weight gradients in the
// schedule's order (micro order for every schedule), whatever the order messages arrive in.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "model/gpt.h"
#include "pipeline/schedule.h"

namespace keel::pipeline {

struct ExecutorStats {
  double recv_wait_ms = 0;  // time F and B waited for a message
  int peak_slots = 0;       // most activation slots in use at once
  int64_t peak_activation_bytes = 0;
};

class Executor {
 public:
  // `stages`: the layer range of every stage (all ranks' stages, schedule.num_stages() of them).
  // The model holds this rank's stages and has been allocated with slots_needed() slots.
  Executor(GPT& model, Communicator& pipeline, Schedule schedule, std::vector<LayerRange> stages, int lookahead = 2);

  // Activation slots this rank needs: the schedule's peak in flight plus room for receives
  // posted early.
  static int slots_needed(const ScheduleCheck& check, int rank) { return check.peak_in_flight[rank] + kEarlySlots; }

  // One step's F, B, W and messages. `micro` holds the step's micro-batches (every rank passes
  // all of them; stage 0 reads their inputs, the last stage their targets). `sync` hears of
  // every B and, for the last micro-batch, of every W in descending layer order (gradient sync
  // overlapped with the pipeline's drain). `lookahead_hook`, if set, is told before each compute
  // instruction which layers the next `lookahead` ones will use. Returns the sum of the
  // micro-batches' mean losses on the rank holding the last stage, 0 elsewhere.
  double run_step(const std::vector<Batch>& micro, BackwardObserver* sync = nullptr);
  // Forward only (evaluation) of one batch through every stage: the mean loss on the rank holding
  // the last stage, 0 elsewhere.
  double forward_only(const Batch& batch);

  // Gradient prediction (experimental): the last micro-batch's W of each of this rank's stages is
  // not run in its step but in the next one, at the first moment this rank would wait for a
  // message, or before the step's first W (so gradients are summed in the same order however
  // long messages take), on activations kept for it (one more slot per
  // stage: slots_needed(..., true)); the batches passed to run_step must stay valid until then.
  // The trainer predicts those gradients meanwhile; `around(true)` and `around(false)` are
  // called just before and after the carried W's run, so it can measure what they added.
  void defer_last_weights(std::function<void(bool before)> around) { around_ = std::move(around); }
  bool defers_last_weights() const { return static_cast<bool>(around_); }
  // Runs the last step's deferred W's now, between steps (before a checkpoint), as the next step
  // would have run them first: they only add into the gradient plane, which nothing touches
  // before them, so the sums are the same bytes. The next step then carries none.
  void run_deferred();
  static int slots_needed(const ScheduleCheck& check, int rank, int deferred_stages) {
    return slots_needed(check, rank) + deferred_stages;
  }

  // Told, before each compute instruction, the layers it and the next `lookahead` ones will use,
  // nearest first, with the plane each needs (F and B read parameters, W writes gradients):
  // prefetch hints for the chunk store.
  void set_lookahead_hook(std::function<void(const std::vector<LayerHint>& hints)> hook) { hook_ = std::move(hook); }
  // Adds an interval to the current step's timeline (the trainer's grad sync and optimizer step).
  void record(Op op, std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end);
  // This rank's intervals of the last step, in ms since it started.
  const std::vector<Interval>& timeline() const { return timeline_; }
  // Its sends (posting them) and receives (waiting for them) of the last step, the same way.
  const std::vector<Interval>& message_timeline() const { return messages_; }
  const ExecutorStats& stats() const { return stats_; }
  const Schedule& schedule() const { return schedule_; }
  int rank() const { return rank_; }

 private:
  static constexpr int kEarlySlots = 2;
  static constexpr int kMaxMicro = 4096;
  struct Deferred {
    int stage = 0, slot = 0;
    Batch batch;
  };
  void run_carried();
  struct Pending {
    Communicator::Request request;
    bool posted = false;
  };
  int slot_of(int micro, int stage, bool allocate);
  void release(int micro, int stage);
  void post_receives(size_t from);
  void post(const Instr& in);
  void wait_receive(const Instr& in);
  void send_grad(const Instr& in, int slot);
  int tag(Op op, int micro, int stage) const;
  // Floats of one message between stages: a micro-batch's rows of the residual stream [N, C]
  // this rank holds (under sequence parallelism its tensor group's share: N / T rows, each tensor
  // rank sending its own to the next stage's rank of the same tensor place).
  size_t message_floats() const;
  size_t rows(int64_t N) const;  // of a micro-batch's N token rows, those this rank holds
  void notify_hook(size_t from);

  GPT& model_;
  Communicator& comm_;
  Schedule schedule_;
  std::vector<LayerRange> stages_;
  int lookahead_ = 2;
  int rank_ = 0;
  std::function<void(const std::vector<LayerHint>&)> hook_;
  std::function<void(bool)> around_;
  std::vector<Deferred> deferred_;  // W's of this step left for the next
  // True when the next compute instruction after list position i (a B) is the W of its micro-batch
  // and stage.
  bool weight_follows(size_t i) const;
  std::vector<Deferred> carried_;   // W's of the previous step still to run
  // (micro, stage) whose W ran with its B: a model that recomputes activations runs B then W of each
  // layer in turn when the schedule puts the W right after the B (GPT::backward), so that W finds
  // the layer's rebuilt activations still there.
  std::set<std::pair<int, int>> fused_;
  const std::vector<Batch>* micro_ = nullptr;
  std::vector<int> free_slots_;
  std::map<std::pair<int, int>, int> slot_;  // (micro, stage) -> slot
  std::set<std::pair<int, int>> early_;      // slots taken by receives posted before their F
  std::vector<Communicator::Request> act_sends_;  // per slot: its output's send
  std::map<std::pair<int, int>, Pending> receives_;  // (op, micro * stages + stage)
  std::vector<std::pair<std::unique_ptr<float[]>, Communicator::Request>> grad_buffers_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<Interval> timeline_, messages_;
  void record_message(const Instr& in, std::chrono::steady_clock::time_point start);
  ExecutorStats stats_;
};

}  // namespace keel::pipeline
