#include "pipeline/schedule.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>

#include "core/error.h"

namespace keel::pipeline {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Compute ops on a rank, in the order the rank runs them; messages are added afterwards.
using ComputeOrder = std::vector<std::vector<Instr>>;

Instr compute(Op op, int micro, int stage) { return Instr{op, micro, stage, -1}; }

// Rank of each stage: s % P, except ZB-V whose rank r holds stages r and 2P-1-r (the V: down the
// ranks on the way to the turn, back up after it).
std::vector<int> stage_ranks(Kind kind, int P, int v) {
  std::vector<int> rank(static_cast<size_t>(P) * v);
  for (int s = 0; s < P * v; ++s) rank[s] = kind == Kind::zb_v ? (s < P ? s : 2 * P - 1 - s) : s % P;
  return rank;
}

// GPipe: every forward, then every backward, each B followed by its W.
ComputeOrder gpipe_order(int P, int m) {
  ComputeOrder order(P);
  for (int r = 0; r < P; ++r) {
    for (int k = 0; k < m; ++k) order[r].push_back(compute(Op::forward, k, r));
    for (int k = 0; k < m; ++k) {
      order[r].push_back(compute(Op::backward_input, k, r));
      order[r].push_back(compute(Op::backward_weight, k, r));
    }
  }
  return order;
}

// 1F1B (PipeDream-flush): rank r runs P-1-r forwards ahead, so at most P-r micro-batches are in
// flight on it, then alternates one forward with one backward, then drains the backwards.
ComputeOrder one_f_one_b_order(int P, int m) {
  ComputeOrder order(P);
  for (int r = 0; r < P; ++r) {
    const int warmup = std::min(P - 1 - r, m);
    int f = 0, b = 0;
    auto forward = [&] { order[r].push_back(compute(Op::forward, f++, r)); };
    auto backward = [&] {
      order[r].push_back(compute(Op::backward_input, b, r));
      order[r].push_back(compute(Op::backward_weight, b++, r));
    };
    while (f < warmup) forward();
    while (f < m) forward(), backward();
    while (b < m) backward();
  }
  return order;
}

// Megatron's interleaved 1F1B. Work items are (micro-batch, chunk) pairs taken in groups of P
// micro-batches per chunk: forward item k runs chunk (k / P) % v of micro-batch
// (k / (P v)) P + k % P, backward item k the same micro-batch on chunk v-1-(k / P) % v. Chunk c of
// rank r is stage c P + r. Rank r runs 2(P-1-r) + (v-1) P items ahead before the 1F1B steady
// state: enough for the first backward item's gradient to come back without a stall.
ComputeOrder interleaved_order(int P, int v, int m) {
  ComputeOrder order(P);
  const int total = m * v;
  auto micro_of = [&](int k) { return (k / (P * v)) * P + k % P; };
  for (int r = 0; r < P; ++r) {
    const int warmup = std::min(2 * (P - 1 - r) + (v - 1) * P, total);
    auto forward = [&](int k) { order[r].push_back(compute(Op::forward, micro_of(k), ((k / P) % v) * P + r)); };
    auto backward = [&](int k) {
      const int stage = (v - 1 - (k / P) % v) * P + r;
      order[r].push_back(compute(Op::backward_input, micro_of(k), stage));
      order[r].push_back(compute(Op::backward_weight, micro_of(k), stage));
    };
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int i = 0; i < total - warmup; ++i) forward(warmup + i), backward(i);
    for (int i = total - warmup; i < total; ++i) backward(i);
  }
  return order;
}

// Zero Bubble's ZB-H1 and ZB-H2 (arXiv 2401.10241, section 3): 1F1B with each backward split
// into B and W, the W's deferred to where the rank would otherwise wait for a gradient. Rank r
// runs `warmup` forwards, then pairs of B and F until it holds `limit` micro-batches in flight
// (F done, W not), then cycles B, W, F, the W that retires the oldest micro-batch making room for
// the next F; the deferred W's fill the tail. ZB-H1: warm-up P-r, limit P on every rank (1F1B's
// peak, which 1F1B reaches on rank 0 only): gradients travel back at B's pace instead of B+W's,
// so at F = B = W each rank idles P-1 F's against 1F1B's 3(P-1). ZB-H2: warm-up 2(P-r)-1, limit
// 2P-1: rank 0 keeps running forwards while the first micro-batch goes down and back up, and for
// m >= 2P-1 no rank has a gap between its first F and last W (the paper's parallelogram). Both
// stay 1F1B-shaped, so they degrade gently when the real costs are not F = B = W.
ComputeOrder zero_bubble_h_order(int P, int m, bool h2) {
  ComputeOrder order(P);
  for (int r = 0; r < P; ++r) {
    const int warmup = std::min(h2 ? 2 * (P - r) - 1 : P - r, m), limit = h2 ? 2 * P - 1 : P;
    int f = 0, b = 0, w = 0;
    auto forward = [&] { if (f < m) order[r].push_back(compute(Op::forward, f++, r)); };
    auto backward = [&] { if (b < f) order[r].push_back(compute(Op::backward_input, b++, r)); };
    auto weight = [&] { if (w < b) order[r].push_back(compute(Op::backward_weight, w++, r)); };
    while (f < warmup) forward();
    while (f < m && f - w < limit) backward(), forward();
    while (w < m) backward(), weight(), forward();
  }
  return order;
}

// ZB-V (arXiv 2401.10241, section 6), found by list scheduling: a simulation with unit costs
// (F = B = W = 1 per stage, the paper's assumption) in which every rank, whenever it is free,
// starts the most urgent op it can:
//   1. an F whose input is there, while the rank holds fewer than `in_flight_limit` micro-batch-
//      stages between F and W (the memory the schedule is allowed). On the V every forward feeds
//      the next rank or the turn, so running them first keeps both legs supplied;
//   2. at the limit, a W: it frees the memory the next F waits for;
//   3. below it, a B whose output gradient is there, else a W.
// Among ready ops of one kind the oldest micro-batch goes first, then the later stage. A stage's
// ops stay in micro-batch order. The simulated order is a valid execution, so the lists cannot
// deadlock whatever the real costs; the unit costs only choose among valid orders. This rule
// was chosen over the 1F1B-like "B first" because its orders degrade gently when B and W differ
// from F: "B first" is as good at F = B = W but packs every gap exactly, and at F:B:W = 1:2:1 its
// bubble was 0.32 against 0.05 for this rule (P = 4, m = 16), ZB-H1's being 0.09.
ComputeOrder zero_bubble_v_order(Kind kind, const std::vector<int>& stage_rank, int P, int m, int in_flight_limit) {
  const int S = static_cast<int>(stage_rank.size());
  std::vector<std::vector<int>> stages(P);
  for (int s = 0; s < S; ++s) stages[stage_rank[s]].push_back(s);
  std::vector<std::vector<int>> f_end(S, std::vector<int>(m, INT_MAX)), b_end = f_end;
  std::vector<int> next_f(S, 0), next_b(S, 0), next_w(S, 0), in_flight(P, 0);
  ComputeOrder order(P);
  int remaining = 3 * m * S;
  for (int t = 0; remaining > 0; ++t) {
    bool started = false;
    for (int r = 0; r < P; ++r) {
      // The most urgent ready op: (urgency, micro, -stage) smallest.
      const bool full = in_flight[r] >= in_flight_limit;
      std::tuple<int, int, int, Op> best{INT_MAX, 0, 0, Op::forward};
      for (int s : stages[r]) {
        const int kf = next_f[s], kb = next_b[s], kw = next_w[s];
        if (kf < m && (s == 0 || f_end[s - 1][kf] <= t) && !full) best = std::min(best, {0, kf, -s, Op::forward});
        if (kb < m && f_end[s][kb] <= t && (s == S - 1 || b_end[s + 1][kb] <= t)) {
          best = std::min(best, {full ? 2 : 1, kb, -s, Op::backward_input});
        }
        if (kw < kb) best = std::min(best, {full ? 1 : 2, kw, -s, Op::backward_weight});
      }
      const auto [urgency, k, minus_s, op] = best;
      if (urgency == INT_MAX) continue;
      const int s = -minus_s;
      if (op == Op::forward) f_end[s][next_f[s]++] = t + 1, ++in_flight[r];
      if (op == Op::backward_input) b_end[s][next_b[s]++] = t + 1;
      if (op == Op::backward_weight) ++next_w[s], --in_flight[r];
      order[r].push_back(compute(op, k, s));
      started = true;
      --remaining;
    }
    // Nothing could start, and nothing runs (every op ends within its step): the limit admits no
    // schedule. The limits make_schedule passes always leave one, so this is a bug, not bad input.
    check(started, std::string("schedule ") + kind_name(kind) + ": list scheduler stuck at step " + str(t) + " with " +
                       str(remaining) + " ops left (internal error)");
  }
  return order;
}

// Adds the messages around the compute ops: a receive just before the op that consumes it (the
// executor posts receives early on its own), a send just after the op that produces it, none
// between stages on the same rank; then gradient sync and the optimizer step.
std::vector<std::vector<Instr>> with_messages(const ComputeOrder& order, const std::vector<int>& stage_rank) {
  const int S = static_cast<int>(stage_rank.size());
  std::vector<std::vector<Instr>> lists(order.size());
  for (size_t r = 0; r < order.size(); ++r) {
    const int rank = static_cast<int>(r);
    std::vector<Instr>& list = lists[r];
    for (const Instr& c : order[r]) {
      const int s = c.stage, k = c.micro;
      const int prev = s > 0 ? stage_rank[s - 1] : rank, next = s + 1 < S ? stage_rank[s + 1] : rank;
      if (c.op == Op::forward && prev != rank) list.push_back({Op::recv_act, k, s, prev});
      if (c.op == Op::backward_input && next != rank) list.push_back({Op::recv_grad, k, s, next});
      list.push_back(c);
      if (c.op == Op::forward && next != rank) list.push_back({Op::send_act, k, s, next});
      if (c.op == Op::backward_input && prev != rank) list.push_back({Op::send_grad, k, s, prev});
    }
    list.push_back({Op::grad_sync, -1, -1, -1});
    list.push_back({Op::optimizer, -1, -1, -1});
  }
  return lists;
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::forward: return "F";
    case Op::backward_input: return "B";
    case Op::backward_weight: return "W";
    case Op::send_act: return "send-act";
    case Op::recv_act: return "recv-act";
    case Op::send_grad: return "send-grad";
    case Op::recv_grad: return "recv-grad";
    case Op::grad_sync: return "sync";
    case Op::optimizer: return "opt";
  }
  return "?";
}

bool is_compute(Op op) { return op == Op::forward || op == Op::backward_input || op == Op::backward_weight; }

std::string to_string(const Instr& i) {
  if (is_compute(i.op)) return op_name(i.op) + str(i.micro) + "@" + str(i.stage);
  if (i.op == Op::grad_sync || i.op == Op::optimizer) return op_name(i.op);
  const bool send = i.op == Op::send_act || i.op == Op::send_grad;
  return std::string(op_name(i.op)) + " " + str(i.micro) + "@" + str(i.stage) + (send ? " to " : " from ") + str(i.peer);
}

Kind parse_kind(const std::string& name) { return parse_enum<Kind>(name, "parallel.schedule"); }

const char* kind_name(Kind kind) { return to_string(kind); }

int default_virtual_stages(Kind kind) { return kind == Kind::interleaved || kind == Kind::zb_v ? 2 : 1; }

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> stages;
  for (int s = 0; s < num_stages(); ++s) {
    if (stage_rank[s] == rank) stages.push_back(s);
  }
  return stages;
}

Costs Costs::uniform(int stages, double f, double b, double w, double comm) {
  Costs c;
  c.forward.assign(stages, f);
  c.backward_input.assign(stages, b);
  c.backward_weight.assign(stages, w);
  c.comm = comm;
  return c;
}

Schedule make_schedule(const ScheduleSpec& spec_in) {
  ScheduleSpec spec = spec_in;
  const std::string what = std::string("schedule ") + kind_name(spec.kind) + ": ";
  const int P = spec.ranks, m = spec.micro;
  check(P >= 1, what + "expected ranks >= 1, found " + str(P));
  check(m >= 1, what + "expected micro-batches >= 1, found " + str(m));
  // 0 means the schedule's own, as in the config (parallel.virtual_stages).
  if (spec.virtual_stages == 0) spec.virtual_stages = default_virtual_stages(spec.kind);
  const int v = spec.virtual_stages;
  switch (spec.kind) {
    case Kind::interleaved:
      check(v >= 2 || (v == 1 && P == 1), what + "expected virtual stages >= 2, found " + str(v));
      check(m % P == 0, what + "expected micro-batches a multiple of the " + str(P) + " ranks, found " + str(m));
      break;
    case Kind::zb_v:
      check(v == 2, what + "expected 2 virtual stages per rank, found " + str(v));
      break;
    default:
      check(v == 1, what + "expected 1 virtual stage per rank, found " + str(v));
  }

  Schedule schedule;
  schedule.spec = spec;
  schedule.stage_rank = stage_ranks(spec.kind, P, v);
  ComputeOrder order;
  switch (spec.kind) {
    case Kind::gpipe: order = gpipe_order(P, m); break;
    case Kind::one_f_one_b: order = one_f_one_b_order(P, m); break;
    case Kind::interleaved: order = interleaved_order(P, v, m); break;
    case Kind::zb_h1: order = zero_bubble_h_order(P, m, false); break;
    case Kind::zb_h2: order = zero_bubble_h_order(P, m, true); break;
    case Kind::zb_v:
      // A stage is half a rank's layers, so 2P micro-batch-stages are 1F1B's peak of P micro-batches.
      order = zero_bubble_v_order(spec.kind, schedule.stage_rank, P, m, 2 * P);
      break;
  }
  schedule.per_rank = with_messages(order, schedule.stage_rank);
  return schedule;
}

namespace {

// Index of an F, B, W or message instruction by (op, micro, stage).
struct Keys {
  int m = 0, S = 0;
  size_t size() const { return static_cast<size_t>(7) * m * S; }
  size_t operator()(Op op, int micro, int stage) const {
    return (static_cast<size_t>(op) * m + micro) * S + stage;
  }
};

// The send a receive waits for: (op, micro, stage) of the matching send.
std::tuple<Op, int, int> matching_send(const Instr& recv) {
  return recv.op == Op::recv_act ? std::make_tuple(Op::send_act, recv.micro, recv.stage - 1)
                                 : std::make_tuple(Op::send_grad, recv.micro, recv.stage + 1);
}

}  // namespace

ScheduleCheck validate(const Schedule& sc, const MemoryBound& bound) {
  const std::string what = std::string("schedule ") + kind_name(sc.spec.kind) + ": ";
  const int P = sc.spec.ranks, m = sc.spec.micro, S = sc.num_stages();
  check(P >= 1 && m >= 1, what + "expected ranks and micro-batches >= 1, found " + str(P) + " and " + str(m));
  check(static_cast<int>(sc.per_rank.size()) == P,
        what + "expected an instruction list for each of the " + str(P) + " ranks, found " + str(sc.per_rank.size()));
  check(S >= 1, what + "expected at least one stage, found none");
  for (int s = 0; s < S; ++s) {
    check(sc.stage_rank[s] >= 0 && sc.stage_rank[s] < P,
          what + "stage " + str(s) + ": expected a rank in 0.." + str(P - 1) + ", found " + str(sc.stage_rank[s]));
  }
  check(bound.stage_bytes.empty() || static_cast<int>(bound.stage_bytes.size()) == S,
        what + "memory bound: expected bytes for each of the " + str(S) + " stages, found " + str(bound.stage_bytes.size()));
  auto bytes_of = [&](int s) { return bound.stage_bytes.empty() ? int64_t{1} : bound.stage_bytes[s]; };
  auto at = [&](int r, size_t i) {
    return what + "rank " + str(r) + " position " + str(static_cast<int64_t>(i)) + " (" + to_string(sc.per_rank[r][i]) + "): ";
  };

  // Where each instruction sits in its rank's list (-1: absent). Once checked that every
  // instruction is on the rank of its stage, (op, micro, stage) also names the rank.
  const Keys key{m, S};
  std::vector<int> position(key.size(), -1);
  for (int r = 0; r < P; ++r) {
    const std::vector<Instr>& list = sc.per_rank[r];
    int syncs = 0, opts = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const Instr& in = list[i];
      if (in.op == Op::grad_sync || in.op == Op::optimizer) {
        if ((in.op == Op::grad_sync ? syncs++ : opts++) > 0) throw Error(at(r, i) + "expected once per rank, found again");
        continue;
      }
      if (in.micro < 0 || in.micro >= m) {
        throw Error(at(r, i) + "expected a micro-batch in 0.." + str(m - 1) + ", found " + str(in.micro));
      }
      if (in.stage < 0 || in.stage >= S) {
        throw Error(at(r, i) + "expected a stage in 0.." + str(S - 1) + ", found " + str(in.stage));
      }
      if (sc.stage_rank[in.stage] != r) {
        throw Error(at(r, i) + "expected a stage of rank " + str(r) + ", found stage " + str(in.stage) + " of rank " +
                    str(sc.stage_rank[in.stage]));
      }
      if (!is_compute(in.op)) {
        // The peer is the rank of the neighbouring stage the message crosses to, never this rank.
        const bool upward = in.op == Op::send_act || in.op == Op::recv_grad;
        const int other = upward ? in.stage + 1 : in.stage - 1;
        if (other < 0 || other >= S) {
          throw Error(at(r, i) + "expected a stage with a " + (upward ? "next" : "previous") + " stage, found stage " +
                      str(in.stage) + " of " + str(S));
        }
        if (sc.stage_rank[other] == r) {
          throw Error(at(r, i) + "expected no message: stages " + str(std::min(in.stage, other)) + " and " +
                      str(std::max(in.stage, other)) + " are both on rank " + str(r));
        }
        if (in.peer != sc.stage_rank[other]) {
          throw Error(at(r, i) + "expected peer " + str(sc.stage_rank[other]) + " (rank of stage " + str(other) + "), found " +
                      str(in.peer));
        }
      }
      int& p = position[key(in.op, in.micro, in.stage)];
      if (p >= 0) throw Error(at(r, i) + "duplicate (first at position " + str(p) + ")");
      p = static_cast<int>(i);
    }
    check(syncs == 1, what + "rank " + str(r) + ": no sync in the list (expected gradient sync after the rank's last W)");
    check(opts == 1, what + "rank " + str(r) + ": no opt in the list (expected the optimizer step after sync)");
    for (int s : sc.stages_of(r)) {
      for (int k = 0; k < m; ++k) {
        for (Op op : {Op::forward, Op::backward_input, Op::backward_weight}) {
          if (position[key(op, k, s)] < 0) {
            throw Error(what + "rank " + str(r) + ": no " + to_string(compute(op, k, s)) +
                        " in the list (expected one F, B and W per micro-batch of each of its stages)");
          }
        }
      }
    }
  }

  // Every send is received and every receive sent, by the ranks of the two stages.
  for (int r = 0; r < P; ++r) {
    const std::vector<Instr>& list = sc.per_rank[r];
    for (size_t i = 0; i < list.size(); ++i) {
      const Instr& in = list[i];
      if (in.op == Op::send_act || in.op == Op::send_grad) {
        const Instr recv = in.op == Op::send_act ? Instr{Op::recv_act, in.micro, in.stage + 1, r}
                                                 : Instr{Op::recv_grad, in.micro, in.stage - 1, r};
        if (position[key(recv.op, recv.micro, recv.stage)] < 0) {
          throw Error(at(r, i) + "no matching " + to_string(recv) + " on rank " + str(in.peer) + " (a send without a receive)");
        }
      } else if (in.op == Op::recv_act || in.op == Op::recv_grad) {
        const auto [op, micro, stage] = matching_send(in);
        if (position[key(op, micro, stage)] < 0) {
          throw Error(at(r, i) + "no matching " + to_string(Instr{op, micro, stage, r}) + " on rank " + str(in.peer) +
                      " (a receive without a send)");
        }
      }
    }
  }

  // Each instruction's inputs come earlier in its own list; activations in flight per rank.
  ScheduleCheck result;
  result.peak_in_flight.assign(P, 0);
  result.peak_bytes.assign(P, 0);
  std::vector<size_t> peak_position(P, 0);
  for (int r = 0; r < P; ++r) {
    const std::vector<Instr>& list = sc.per_rank[r];
    // Throws unless (op, micro, stage), which `role` names for the message, is earlier in the list
    // than position i.
    auto needs = [&](size_t i, Op op, int micro, int stage, const char* role) {  // (no string per call: a hot loop)
      const int at_position = position[key(op, micro, stage)];
      if (at_position >= 0 && at_position < static_cast<int>(i)) return;
      const bool recv = op == Op::recv_act || op == Op::recv_grad;
      const Instr need{op, micro, stage, recv ? sc.stage_rank[op == Op::recv_act ? stage - 1 : stage + 1] : -1};
      throw Error(at(r, i) + "before " + role + " " + to_string(need) +
                  (at_position >= 0 ? " (at position " + str(at_position) + ")" : " (not in the list: the input never arrives)"));
    };
    int in_flight = 0;
    int64_t bytes = 0;
    size_t sync_at = list.size();
    // The next micro-batch of each stage's F, B and W: the executor keeps a stage's activations
    // and weight-gradient inputs in queues, so each kind runs in micro-batch order.
    std::vector<std::array<int, 3>> next_micro(S, {0, 0, 0});
    for (size_t i = 0; i < list.size(); ++i) {
      const Instr& in = list[i];
      const int k = in.micro, s = in.stage;
      if (sync_at < i && in.op != Op::optimizer) {
        throw Error(at(r, i) + "after sync (expected gradient sync and the optimizer step last)");
      }
      if (is_compute(in.op)) {
        int& next = next_micro[s][static_cast<int>(in.op)];
        if (k != next) {
          throw Error(at(r, i) + "out of micro-batch order: expected " + to_string(compute(in.op, next, s)) +
                      " first (a stage runs each of F, B and W in micro-batch order)");
        }
        ++next;
      }
      switch (in.op) {
        case Op::forward:
          if (s > 0 && sc.stage_rank[s - 1] == r) needs(i, Op::forward, k, s - 1, "its input");
          if (s > 0 && sc.stage_rank[s - 1] != r) needs(i, Op::recv_act, k, s, "its input");
          ++in_flight;
          bytes += bytes_of(s);
          if (bytes > result.peak_bytes[r]) peak_position[r] = i;
          result.peak_in_flight[r] = std::max(result.peak_in_flight[r], in_flight);
          result.peak_bytes[r] = std::max(result.peak_bytes[r], bytes);
          break;
        case Op::backward_input:
          needs(i, Op::forward, k, s, "its");
          if (s + 1 < S && sc.stage_rank[s + 1] == r) needs(i, Op::backward_input, k, s + 1, "its output gradient");
          if (s + 1 < S && sc.stage_rank[s + 1] != r) needs(i, Op::recv_grad, k, s, "its output gradient");
          break;
        case Op::backward_weight:
          needs(i, Op::backward_input, k, s, "its");
          --in_flight;
          bytes -= bytes_of(s);
          break;
        case Op::send_act: needs(i, Op::forward, k, s, "the op that produces it,"); break;
        case Op::send_grad: needs(i, Op::backward_input, k, s, "the op that produces it,"); break;
        case Op::recv_act:
        case Op::recv_grad: break;
        case Op::grad_sync:
          for (int stage : sc.stages_of(r)) {
            for (int micro = 0; micro < m; ++micro) needs(i, Op::backward_weight, micro, stage, "the rank's");
          }
          sync_at = i;
          break;
        case Op::optimizer:
          if (sync_at > i) throw Error(at(r, i) + "before sync (expected the optimizer step after gradient sync)");
          if (i + 1 < list.size()) {
            throw Error(at(r, i) + "expected last, found " + str(list.size() - i - 1) + " instruction(s) after it");
          }
          break;
      }
    }
  }

  // No deadlock: run every rank as far as it can, sends never blocking, a receive waiting for its
  // send; repeat until nobody moves. The local checks above make receives the only waits.
  std::vector<char> sent(key.size(), 0);
  std::vector<size_t> next(P, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < P; ++r) {
      const std::vector<Instr>& list = sc.per_rank[r];
      for (; next[r] < list.size(); ++next[r], moved = true) {
        const Instr& in = list[next[r]];
        if (in.op == Op::recv_act || in.op == Op::recv_grad) {
          const auto [op, micro, stage] = matching_send(in);
          if (!sent[key(op, micro, stage)]) break;
        }
        if (in.op == Op::send_act || in.op == Op::send_grad) sent[key(in.op, in.micro, in.stage)] = 1;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < P; ++r) {
    if (next[r] < sc.per_rank[r].size()) {
      stuck += (stuck.empty() ? "" : ", ") + std::string("rank ") + str(r) + " waits at position " +
               str(static_cast<int64_t>(next[r])) + " (" + to_string(sc.per_rank[r][next[r]]) + ")";
    }
  }
  check(stuck.empty(), what + "deadlock: " + stuck);

  if (bound.limit > 0) {
    for (int r = 0; r < P; ++r) {
      const std::string unit = bound.stage_bytes.empty() ? " micro-batch-stages" : " bytes";
      check(result.peak_bytes[r] <= bound.limit, at(r, peak_position[r]) + "activations in flight peak at " +
                                                     str(result.peak_bytes[r]) + unit + ", expected at most the limit " +
                                                     str(bound.limit));
    }
  }
  return result;
}

Timeline simulate(const Schedule& sc, const Costs& costs) {
  validate(sc);
  const std::string what = std::string("schedule ") + kind_name(sc.spec.kind) + ": costs: ";
  const int P = sc.spec.ranks, S = sc.num_stages();
  for (const auto& [name, per_stage] : {std::make_pair("forward", &costs.forward),
                                        std::make_pair("backward_input", &costs.backward_input),
                                        std::make_pair("backward_weight", &costs.backward_weight)}) {
    check(static_cast<int>(per_stage->size()) == S,
          what + "expected " + name + " for each of the " + str(S) + " stages, found " + str(per_stage->size()));
    for (double c : *per_stage) {
      if (!(c >= 0)) throw Error(what + "expected " + name + " >= 0, found " + std::to_string(c));  // NaN too
    }
  }
  check(costs.comm >= 0 && costs.grad_sync >= 0 && costs.optimizer >= 0, what + "expected comm, grad_sync and optimizer >= 0");

  // Replay in passes, each rank as far as its receives allow; validate() guarantees an end.
  const Keys key{sc.spec.micro, S};
  std::vector<double> sent_at(key.size(), -1);
  std::vector<double> now(P, 0);
  std::vector<size_t> next(P, 0);
  Timeline timeline;
  timeline.per_rank.resize(P);
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < P; ++r) {
      const std::vector<Instr>& list = sc.per_rank[r];
      for (; next[r] < list.size(); ++next[r], moved = true) {
        const Instr& in = list[next[r]];
        if (in.op == Op::recv_act || in.op == Op::recv_grad) {
          const auto [op, micro, stage] = matching_send(in);
          const double sent = sent_at[key(op, micro, stage)];
          if (sent < 0) break;  // its send has not run yet
          now[r] = std::max(now[r], sent + costs.comm);
          continue;
        }
        if (in.op == Op::send_act || in.op == Op::send_grad) {
          sent_at[key(in.op, in.micro, in.stage)] = now[r];
          continue;
        }
        const double cost = in.op == Op::forward          ? costs.forward[in.stage]
                            : in.op == Op::backward_input  ? costs.backward_input[in.stage]
                            : in.op == Op::backward_weight ? costs.backward_weight[in.stage]
                            : in.op == Op::grad_sync       ? costs.grad_sync
                                                           : costs.optimizer;
        timeline.per_rank[r].push_back({in, now[r], now[r] + cost});
        now[r] += cost;
      }
    }
  }
  account_bubble(timeline);
  return timeline;
}

void account_bubble(Timeline& t) {
  const int P = static_cast<int>(t.per_rank.size());
  const double inf = std::numeric_limits<double>::infinity();
  double first = inf, last = -inf, all_first = inf, all_last = -inf;
  t.busy.assign(P, 0);
  for (int r = 0; r < P; ++r) {
    for (const Interval& iv : t.per_rank[r]) {
      all_first = std::min(all_first, iv.start);
      all_last = std::max(all_last, iv.end);
      if (!is_compute(iv.instr.op)) continue;
      first = std::min(first, iv.start);
      last = std::max(last, iv.end);
      t.busy[r] += iv.end - iv.start;
    }
  }
  t.makespan = all_last > all_first ? all_last - all_first : 0;
  const double span = last > first ? last - first : 0;
  t.rank_bubble.assign(P, 0);
  t.bubble = 0;
  if (span <= 0) return;
  double idle = 0;
  for (int r = 0; r < P; ++r) {
    t.rank_bubble[r] = (span - t.busy[r]) / span;
    idle += span - t.busy[r];
  }
  t.bubble = idle / (P * span);
}

namespace {

char op_letter(Op op) {
  switch (op) {
    case Op::grad_sync: return 'S';
    case Op::optimizer: return 'O';
    default: return op_name(op)[0];
  }
}

}  // namespace

std::string gantt(const Timeline& t, int columns) {
  check(columns >= 1, "gantt: expected columns >= 1, found " + str(columns));
  double first = std::numeric_limits<double>::infinity(), last = -first;
  for (const auto& rank : t.per_rank) {
    for (const Interval& iv : rank) first = std::min(first, iv.start), last = std::max(last, iv.end);
  }
  const double span = last > first ? last - first : 1;
  auto column = [&](double time) { return static_cast<int>(std::lround((time - first) / span * columns)); };
  const std::string label_width = str(static_cast<int64_t>(t.per_rank.size()) - 1);
  std::string out;
  for (size_t r = 0; r < t.per_rank.size(); ++r) {
    std::string row(columns, '.');
    for (const Interval& iv : t.per_rank[r]) {
      const int c0 = std::clamp(column(iv.start), 0, columns), c1 = std::clamp(column(iv.end), 0, columns);
      if (c1 <= c0) continue;  // shorter than half a column: left to its neighbours
      // "F12---": letter, micro-batch where it fits, the rest of the op's width as dashes.
      std::string cell(1, op_letter(iv.instr.op));
      if (iv.instr.micro >= 0 && c1 - c0 > static_cast<int>(str(iv.instr.micro).size())) cell += str(iv.instr.micro);
      cell.resize(c1 - c0, '-');
      row.replace(c0, c1 - c0, cell);
    }
    std::string label = str(static_cast<int64_t>(r));
    label.insert(0, label_width.size() - label.size(), ' ');
    out += "rank " + label + " |" + row + "|\n";
  }
  return out;
}

std::string chrome_trace(const Timeline& t, const std::string& name) {
  nlohmann::json events = nlohmann::json::array();
  for (size_t r = 0; r < t.per_rank.size(); ++r) {
    const std::string process = "rank " + str(static_cast<int64_t>(r));
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r}, {"tid", 0}, {"args", {{"name", process}}}});
    for (const Interval& iv : t.per_rank[r]) {
      const Instr& in = iv.instr;
      nlohmann::json e = {{"name", is_compute(in.op) ? op_name(in.op) + str(in.micro) + " s" + str(in.stage) : op_name(in.op)},
                          {"cat", op_name(in.op)},
                          {"ph", "X"},
                          {"pid", r},
                          {"tid", 0},
                          {"ts", iv.start * 1000},  // timeline milliseconds to trace microseconds
                          {"dur", (iv.end - iv.start) * 1000}};
      if (is_compute(in.op)) e["args"] = {{"micro", in.micro}, {"stage", in.stage}};
      events.push_back(std::move(e));
    }
  }
  nlohmann::json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", {{"name", name}}}};
  return trace.dump();
}

}  // namespace keel::pipeline
