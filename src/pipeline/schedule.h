// Pipeline schedules as data. A schedule is, for every pipeline rank, the ordered list of what
// that rank does in one optimizer step: forward (F), backward for inputs (B), backward for weights
// (W) of a micro-batch on one of its stages, the sends and receives that move activations and
// their gradients between stages, then gradient sync and the optimizer step. Generators produce
// the textbook schedules (GPipe, 1F1B, interleaved 1F1B, Zero Bubble's ZB-H1, ZB-H2 and ZB-V);
// validate() proves a list can run (dependencies, matched messages, no deadlock, activation
// memory within a bound) before anything executes it; simulate() replays it with given costs,
// which is how bubbles are predicted; the executor (pipeline/executor.h) runs it over MPI.
//
// Stages: the model is cut into S = ranks x virtual stages contiguous pieces, stage 0 holding the
// embedding and stage S-1 the head and loss. Stage s lives on rank stage_rank[s]: s % ranks for
// GPipe, 1F1B, interleaved and the ZB-H schedules; for ZB-V rank r holds stages r and 2P-1-r.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"

namespace keel::pipeline {

enum class Op : uint8_t {
  forward,          // F(micro, stage)
  backward_input,   // B(micro, stage): gradient of the stage's input; keeps what W needs
  backward_weight,  // W(micro, stage): weight gradients; frees the micro-batch's activations
  send_act,         // stage's output of `micro` to the rank of stage + 1
  recv_act,         // input of `stage` for `micro` from the rank of stage - 1
  send_grad,        // gradient of stage's input to the rank of stage - 1
  recv_grad,        // gradient of stage's output from the rank of stage + 1
  grad_sync,        // data-parallel gradient sync of this rank's stages (after its last W)
  optimizer,        // optimizer step (after grad_sync)
};
const char* op_name(Op op);  // "F", "B", "W", "send-act", "recv-act", "send-grad", "recv-grad", "sync", "opt"
bool is_compute(Op op);      // F, B, W

struct Instr {
  Op op = Op::forward;
  int micro = -1;  // micro-batch (-1 for grad_sync, optimizer)
  int stage = -1;  // virtual stage (-1 for grad_sync, optimizer)
  int peer = -1;   // sends and receives: the other rank
  bool operator==(const Instr&) const = default;
};
std::string to_string(const Instr& i);  // e.g. "F3@1", "B0@2", "recv-act 2@1 from 0"

using Kind = ScheduleKind;  // (core/config.h: parallel.schedule)
// Parses "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v" (as parallel.schedule does);
// throws keel::Error otherwise.
Kind parse_kind(const std::string& name);
const char* kind_name(Kind kind);
// Virtual stages per rank a schedule uses when the config says 0: 2 for interleaved and zb-v, else 1.
int default_virtual_stages(Kind kind);

struct ScheduleSpec {
  Kind kind = Kind::one_f_one_b;
  int ranks = 1;           // pipeline ranks P
  int micro = 1;           // micro-batches per step m
  int virtual_stages = 1;  // stages per rank v (interleaved: >= 2 and m a multiple of P; zb-v: 2)
};

struct Schedule {
  ScheduleSpec spec;
  std::vector<int> stage_rank;               // rank of each stage, size ranks * virtual_stages
  std::vector<std::vector<Instr>> per_rank;  // instruction list of each rank
  int num_stages() const { return static_cast<int>(stage_rank.size()); }
  // The stages of rank r, ascending.
  std::vector<int> stages_of(int rank) const;
};

// Builds the schedule. Throws keel::Error naming the offending value when the spec is impossible
// (ranks < 1, micro < 1, interleaved with m not a multiple of P, zb-v with virtual_stages != 2, ...).
Schedule make_schedule(const ScheduleSpec& spec);

// Per-stage activation footprint (bytes one in-flight micro-batch keeps on its stage, from F
// until its W) and the bound per rank (0 = none).
struct MemoryBound {
  std::vector<int64_t> stage_bytes;  // empty = every stage counts 1 (the bound is then in micro-batches)
  int64_t limit = 0;
};

struct ScheduleCheck {
  std::vector<int> peak_in_flight;      // per rank: most micro-batch-stages between F and W at once
  std::vector<int64_t> peak_bytes;      // per rank: the same weighted by stage_bytes
};

// Checks that the schedule can run: every rank's list holds exactly one F, B and W for each
// (micro, stage) it owns (in that order), a send for every activation and gradient that crosses
// ranks and a matching receive on the peer (same micro, stage, peers), that every instruction's
// inputs are produced before it (F after the input arrives or the previous stage ran on this
// rank; B after F and the output gradient; W after B), grad_sync after the rank's last W and the
// optimizer after it; and, by running all ranks in lock-free order with sends that never block
// and receives that wait, that every list completes (no deadlock). Throws keel::Error with a
// message naming the rank, the position and the instruction on the first violation, or on a
// rank whose activations in flight exceed bound.limit.
ScheduleCheck validate(const Schedule& schedule, const MemoryBound& bound = {});

// Replays a schedule with per-instruction costs. Compute costs are per stage (F, B, W may
// differ); a message arrives `comm` after its send ends (sends and receives themselves take no
// time); grad_sync and optimizer take their costs once per rank.
struct Costs {
  std::vector<double> forward, backward_input, backward_weight;  // per stage
  double comm = 0;        // latency of one activation or gradient message
  double grad_sync = 0;
  double optimizer = 0;
  // Equal costs for every stage.
  static Costs uniform(int stages, double f, double b, double w, double comm = 0);
};

struct Interval {
  Instr instr;
  double start = 0, end = 0;
};

struct Timeline {
  std::vector<std::vector<Interval>> per_rank;  // compute intervals (and sync, optimizer) of each rank
  double makespan = 0;                          // first start to last end over all ranks
  // Bubble share: idle time within the span of the pipeline (first F start to last W end over all
  // ranks; grad_sync and optimizer excluded) over ranks x that span; per rank the same over its
  // own idle time.
  double bubble = 0;
  std::vector<double> rank_bubble;
  std::vector<double> busy;  // per rank: F + B + W time
};

// Runs the schedule on the simulator (validate() first: a schedule that deadlocks throws).
Timeline simulate(const Schedule& schedule, const Costs& costs);

// Bubble share of a timeline of compute intervals (simulated or measured): fills makespan, bubble,
// rank_bubble, busy from per_rank.
void account_bubble(Timeline& timeline);

// Text Gantt chart, one row per rank, `columns` characters wide: each interval drawn with its op
// letter (F, B, W, S for sync, O for optimizer) and the micro-batch number where it fits, '.' idle.
std::string gantt(const Timeline& timeline, int columns = 120);
// Chrome trace JSON (chrome://tracing, Perfetto): one process per rank, one complete event ("X")
// per interval, times in microseconds (timeline units are milliseconds).
std::string chrome_trace(const Timeline& timeline, const std::string& name);

}  // namespace keel::pipeline
