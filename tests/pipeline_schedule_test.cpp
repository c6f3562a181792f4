#include "pipeline/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_util.h"

namespace keel::pipeline {
namespace {

using testing::error_of;

const Kind kAllKinds[] = {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1, Kind::zb_h2, Kind::zb_v};

Schedule make(Kind kind, int ranks, int micro, int virtual_stages = 0) {
  return make_schedule({kind, ranks, micro, virtual_stages});
}

// Runs a schedule with f, b, w the costs of a whole rank's layers: each of its v stages costs 1/v
// of them, so the work per rank and micro-batch is f + b + w whatever the schedule.
Timeline run(const Schedule& s, double f, double b, double w, double comm = 0) {
  const double v = s.spec.virtual_stages;
  return simulate(s, Costs::uniform(s.num_stages(), f / v, b / v, w / v, comm));
}

// Idle time of all ranks within the pipeline's span (what `bubble` divides by ranks x span).
double idle(const Timeline& t) {
  double busy = 0;
  for (double b : t.busy) busy += b;
  return t.bubble * busy / (1 - t.bubble);
}

// Idle time of rank r between its own first F and last W: the paper's per-device bubble, which
// leaves out the time before a rank's first input can arrive and after its last W.
double own_idle(const Timeline& t, int r) {
  double first = 1e300, last = -1e300;
  for (const Interval& iv : t.per_rank[r]) {
    if (is_compute(iv.instr.op)) first = std::min(first, iv.start), last = std::max(last, iv.end);
  }
  return last - first - t.busy[r];
}

int position(const std::vector<Instr>& list, const Instr& instr) {
  auto it = std::find(list.begin(), list.end(), instr);
  EXPECT_NE(it, list.end()) << to_string(instr);
  return static_cast<int>(it - list.begin());
}

Instr F(int micro, int stage) { return {Op::forward, micro, stage, -1}; }
Instr B(int micro, int stage) { return {Op::backward_input, micro, stage, -1}; }
Instr W(int micro, int stage) { return {Op::backward_weight, micro, stage, -1}; }

TEST(PipelineSchedule, Names) {
  EXPECT_STREQ(op_name(Op::forward), "F");
  EXPECT_STREQ(op_name(Op::backward_input), "B");
  EXPECT_STREQ(op_name(Op::backward_weight), "W");
  EXPECT_STREQ(op_name(Op::send_act), "send-act");
  EXPECT_STREQ(op_name(Op::recv_act), "recv-act");
  EXPECT_STREQ(op_name(Op::send_grad), "send-grad");
  EXPECT_STREQ(op_name(Op::recv_grad), "recv-grad");
  EXPECT_STREQ(op_name(Op::grad_sync), "sync");
  EXPECT_STREQ(op_name(Op::optimizer), "opt");
  EXPECT_TRUE(is_compute(Op::backward_weight));
  EXPECT_FALSE(is_compute(Op::recv_act));
  EXPECT_FALSE(is_compute(Op::grad_sync));
  EXPECT_EQ(to_string(F(3, 1)), "F3@1");
  EXPECT_EQ(to_string(B(0, 2)), "B0@2");
  EXPECT_EQ(to_string({Op::recv_act, 2, 1, 0}), "recv-act 2@1 from 0");
  EXPECT_EQ(to_string({Op::send_grad, 0, 2, 1}), "send-grad 0@2 to 1");
  EXPECT_EQ(to_string({Op::grad_sync, -1, -1, -1}), "sync");
  EXPECT_EQ(to_string({Op::optimizer, -1, -1, -1}), "opt");
  for (Kind kind : kAllKinds) EXPECT_EQ(parse_kind(kind_name(kind)), kind);
  EXPECT_STREQ(kind_name(Kind::one_f_one_b), "1f1b");
  EXPECT_STREQ(kind_name(Kind::zb_v), "zb-v");
  EXPECT_EQ(error_of([] { parse_kind("x"); }),
            "parallel.schedule: expected one of gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, found \"x\"");
  EXPECT_EQ(default_virtual_stages(Kind::interleaved), 2);
  EXPECT_EQ(default_virtual_stages(Kind::zb_v), 2);
  EXPECT_EQ(default_virtual_stages(Kind::zb_h2), 1);
  const Costs c = Costs::uniform(3, 1, 2, 0.5, 0.25);
  EXPECT_EQ(c.forward, std::vector<double>({1, 1, 1}));
  EXPECT_EQ(c.backward_input, std::vector<double>({2, 2, 2}));
  EXPECT_EQ(c.backward_weight, std::vector<double>({0.5, 0.5, 0.5}));
  EXPECT_EQ(c.comm, 0.25);
}

TEST(PipelineSchedule, ImpossibleSpecsNameTheValue) {
  EXPECT_EQ(error_of([] { make(Kind::one_f_one_b, 0, 4); }), "schedule 1f1b: expected ranks >= 1, found 0");
  EXPECT_EQ(error_of([] { make(Kind::gpipe, 2, 0); }), "schedule gpipe: expected micro-batches >= 1, found 0");
  EXPECT_EQ(error_of([] { make(Kind::interleaved, 4, 6); }),
            "schedule interleaved: expected micro-batches a multiple of the 4 ranks, found 6");
  EXPECT_EQ(error_of([] { make(Kind::interleaved, 2, 4, 1); }), "schedule interleaved: expected virtual stages >= 2, found 1");
  EXPECT_EQ(error_of([] { make(Kind::zb_v, 2, 4, 3); }), "schedule zb-v: expected 2 virtual stages per rank, found 3");
  EXPECT_EQ(error_of([] { make(Kind::zb_h1, 2, 4, 2); }), "schedule zb-h1: expected 1 virtual stage per rank, found 2");
  // 0 virtual stages means the schedule's own, as in the config.
  EXPECT_EQ(make(Kind::interleaved, 2, 4, 0).spec.virtual_stages, 2);
  EXPECT_EQ(make(Kind::zb_v, 2, 4, 0).spec.virtual_stages, 2);
  EXPECT_EQ(make(Kind::gpipe, 2, 4, 0).spec.virtual_stages, 1);
}

TEST(PipelineSchedule, StagesLiveWhereTheHeaderSays) {
  const Schedule il = make(Kind::interleaved, 4, 8, 3);
  EXPECT_EQ(il.stage_rank, std::vector<int>({0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(il.stages_of(1), std::vector<int>({1, 5, 9}));
  const Schedule v = make(Kind::zb_v, 4, 8);
  EXPECT_EQ(v.stage_rank, std::vector<int>({0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(v.stages_of(1), std::vector<int>({1, 6}));
  // The turn of the V stays on rank 3: no message between stages 3 and 4.
  for (const Instr& i : v.per_rank[3]) {
    if (!is_compute(i.op) && i.op != Op::grad_sync && i.op != Op::optimizer) {
      const bool up = i.op == Op::send_act || i.op == Op::recv_grad;
      EXPECT_NE(up ? i.stage : i.stage - 1, 3) << to_string(i);
    }
  }
}

// Checks the shape every generator promises beyond what validate() requires.
void expect_well_formed(const Schedule& s) {
  const std::string name = std::string(kind_name(s.spec.kind)) + " P=" + std::to_string(s.spec.ranks) +
                           " m=" + std::to_string(s.spec.micro) + " v=" + std::to_string(s.spec.virtual_stages);
  const int S = s.num_stages();
  for (int r = 0; r < s.spec.ranks; ++r) {
    const std::vector<Instr>& list = s.per_rank[r];
    ASSERT_GE(list.size(), 2u) << name;
    EXPECT_EQ(list[list.size() - 2].op, Op::grad_sync) << name;
    EXPECT_EQ(list.back().op, Op::optimizer) << name;
    for (size_t i = 0; i + 2 < list.size(); ++i) {
      const Instr& in = list[i];
      // A send right after the op that produces it, a receive right before the op that needs it.
      if (in.op == Op::send_act) {
        EXPECT_EQ(list[i - 1], F(in.micro, in.stage)) << name << " rank " << r << " position " << i;
      }
      if (in.op == Op::send_grad) {
        EXPECT_EQ(list[i - 1], B(in.micro, in.stage)) << name << " rank " << r << " position " << i;
      }
      if (in.op == Op::recv_act) {
        EXPECT_EQ(list[i + 1], F(in.micro, in.stage)) << name << " rank " << r << " position " << i;
      }
      if (in.op == Op::recv_grad) {
        EXPECT_EQ(list[i + 1], B(in.micro, in.stage)) << name << " rank " << r << " position " << i;
      }
      // Schedules without the split run W right after its B.
      const bool split = s.spec.kind == Kind::zb_h1 || s.spec.kind == Kind::zb_h2 || s.spec.kind == Kind::zb_v;
      if (!split && in.op == Op::backward_input) {
        const size_t next = i + 1 + (in.stage > 0 && s.stage_rank[in.stage - 1] != r);  // past its send
        EXPECT_EQ(list[next], W(in.micro, in.stage)) << name << " rank " << r << " position " << i;
      }
    }
    // Crossing messages exist exactly where neighbouring stages are on different ranks.
    int sends = 0;
    for (const Instr& in : list) sends += in.op == Op::send_act || in.op == Op::send_grad;
    int crossing = 0;
    for (int st : s.stages_of(r)) crossing += (st + 1 < S && s.stage_rank[st + 1] != r) + (st > 0 && s.stage_rank[st - 1] != r);
    EXPECT_EQ(sends, crossing * s.spec.micro) << name << " rank " << r;
  }
}

TEST(PipelineSchedule, EveryKindValidatesForManyShapes) {
  for (Kind kind : kAllKinds) {
    for (int P : {1, 2, 3, 4, 8}) {
      for (int m = 1; m <= 16; ++m) {
        for (int v : {0, 3}) {
          if ((kind == Kind::interleaved && m % P != 0) || (v == 3 && kind != Kind::interleaved)) continue;
          const Schedule s = make(kind, P, m, v);
          EXPECT_NO_THROW(validate(s)) << kind_name(kind) << " P=" << P << " m=" << m << ": " << error_of([&] { validate(s); });
          expect_well_formed(s);
        }
      }
    }
  }
}

TEST(PipelineSchedule, ActivationsInFlight) {
  for (int P : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, P, 2 * P, 16}) {
      const ScheduleCheck gpipe = validate(make(Kind::gpipe, P, m));
      const ScheduleCheck f1b1 = validate(make(Kind::one_f_one_b, P, m));
      const ScheduleCheck h1 = validate(make(Kind::zb_h1, P, m));
      const ScheduleCheck h2 = validate(make(Kind::zb_h2, P, m));
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(gpipe.peak_in_flight[r], m);
        EXPECT_EQ(f1b1.peak_in_flight[r], std::min(P - r, m)) << "P=" << P << " m=" << m << " rank " << r;
        // ZB-H1 keeps 1F1B's peak (P, on its rank 0) on every rank; ZB-H2 may hold 2P-1.
        EXPECT_LE(h1.peak_in_flight[r], std::min(P, m));
        EXPECT_LE(h2.peak_in_flight[r], std::min(2 * P - 1, m));
      }
      EXPECT_EQ(h1.peak_in_flight[0], std::min(P, m));
      // ZB-V's stages are half a rank's layers: weigh them 1 against 1F1B's 2, and the peaks match.
      const Schedule v = make(Kind::zb_v, P, m);
      const ScheduleCheck zv = validate(v, {std::vector<int64_t>(v.num_stages(), 1), 0});
      const ScheduleCheck f1b1_bytes = validate(make(Kind::one_f_one_b, P, m), {std::vector<int64_t>(P, 2), 0});
      for (int r = 0; r < P; ++r) EXPECT_LE(zv.peak_bytes[r], f1b1_bytes.peak_bytes[0]) << "P=" << P << " m=" << m;
      EXPECT_EQ(f1b1_bytes.peak_bytes[0], 2 * std::min(P, m));
    }
  }
}

// GPipe and 1F1B with B+W as one backward of twice a forward's cost: the textbook bubble,
// (P-1)/(m+P-1) of the span, or (P-1)/m of the ideal time.
TEST(PipelineSchedule, GpipeAndOneFOneBBubbleIsTextbook) {
  for (Kind kind : {Kind::gpipe, Kind::one_f_one_b}) {
    for (int P : {1, 2, 3, 4, 8}) {
      for (int m = 1; m <= 16; ++m) {
        const Timeline t = run(make(kind, P, m), 1, 2, 0);
        EXPECT_NEAR(t.bubble, (P - 1.0) / (m + P - 1.0), 1e-9) << kind_name(kind) << " P=" << P << " m=" << m;
        EXPECT_NEAR(idle(t) / (3.0 * m * P), (P - 1.0) / m, 1e-9);
        for (double rb : t.rank_bubble) EXPECT_NEAR(rb, t.bubble, 1e-9);
      }
    }
  }
}

// Interleaved 1F1B with v stages per rank, each a 1/v share of the rank's layers (F = 1/v,
// B+W = 2/v). Megatron's schedule fills and drains the pipeline one stage at a time, so the
// bubble is (P-1) stage-steps of forward and backward, (P-1)(1 + 2)/v, against 3m of work per
// rank: the textbook "1/v of 1F1B's bubble", (P-1)/(v m) of the ideal time. In this header's
// definition, idle over ranks x span, that is (3(P-1)/v) / (3m + 3(P-1)/v) = (P-1)/(v m + P - 1).
TEST(PipelineSchedule, InterleavedBubbleIsOneVthOfOneFOneB) {
  for (int P : {1, 2, 3, 4, 8}) {
    for (int v : {2, 3, 4}) {
      for (int m = P; m <= 16; m += P) {
        const Timeline t = run(make(Kind::interleaved, P, m, v), 1, 2, 0);
        EXPECT_NEAR(t.bubble, (P - 1.0) / (v * m + P - 1.0), 1e-9) << "P=" << P << " v=" << v << " m=" << m;
        EXPECT_NEAR(idle(t) / (3.0 * m * P), (P - 1.0) / (v * m), 1e-9);
      }
    }
  }
}

// ZB-H1 with F = B = W: the gradient goes back at B's pace instead of B+W's, so each rank idles
// (P-1) F's instead of 1F1B's 3(P-1): a third of 1F1B's bubble (B+W as one backward of cost 2).
// That is (P-1)/(3m+P-1) of the span, which is also the least any one-stage-per-rank schedule can
// reach here: the last rank cannot start before P-1 forwards and has 3m of work.
TEST(PipelineSchedule, ZeroBubbleH1IsAThirdOfOneFOneB) {
  for (int P : {2, 3, 4, 8}) {
    for (int m = P; m <= 16; ++m) {
      const Timeline h1 = run(make(Kind::zb_h1, P, m), 1, 1, 1);
      const Timeline f1b1 = run(make(Kind::one_f_one_b, P, m), 1, 2, 0);
      EXPECT_NEAR(idle(h1) / idle(f1b1), 1.0 / 3, 1e-9) << "P=" << P << " m=" << m;
      EXPECT_NEAR(h1.bubble, (P - 1.0) / (3 * m + P - 1.0), 1e-9);
    }
  }
}

// ZB-H2 spends more memory to remove the bubble inside each rank's own span: with m >= 2P-1 every
// rank runs without a gap from its first F to its last W (the paper's "zero bubble"). Over the
// whole pipeline's span the last rank still starts P-1 forwards late, so at F = B = W its share
// equals ZB-H1's (both reach the bound above); with a W cheaper than B, ZB-H1 waits for W's the
// steady state cannot hide and ZB-H2 does not.
TEST(PipelineSchedule, ZeroBubbleH2HasNoBubbleWithinEachRank) {
  for (int P : {2, 3, 4, 8}) {
    for (int m = P; m <= 16; ++m) {
      const Timeline h2 = run(make(Kind::zb_h2, P, m), 1, 1, 1);
      const Timeline h1 = run(make(Kind::zb_h1, P, m), 1, 1, 1);
      EXPECT_LE(h2.bubble, h1.bubble + 1e-12) << "P=" << P << " m=" << m;
      EXPECT_NEAR(h2.bubble, (P - 1.0) / (3 * m + P - 1.0), 1e-9);
      if (m >= 2 * P - 1) {
        for (int r = 0; r < P; ++r) EXPECT_NEAR(own_idle(h2, r), 0, 1e-9) << "P=" << P << " m=" << m << " rank " << r;
      }
      // At m = P, rank 0 of either runs every forward before its first B: the same span.
      if (m > P) {
        const Timeline h2_cheap_w = run(make(Kind::zb_h2, P, m), 1, 1, 0.5);
        const Timeline h1_cheap_w = run(make(Kind::zb_h1, P, m), 1, 1, 0.5);
        EXPECT_LT(h2_cheap_w.bubble, h1_cheap_w.bubble) << "P=" << P << " m=" << m;
      }
    }
  }
}

// ZB-V: the last rank's first stage is only P-1 half-rank forwards away, so the least bubble is
// (P-1)/2 of a rank's F per rank, (P-1)/(6m+P-1) of the span: half of ZB-H1's idle time, with
// 1F1B's memory.
TEST(PipelineSchedule, ZeroBubbleVHalvesTheBubble) {
  for (int P : {2, 3, 4, 8}) {
    for (int m = P; m <= 16; ++m) {
      const Timeline v = run(make(Kind::zb_v, P, m), 1, 1, 1);
      const Timeline h1 = run(make(Kind::zb_h1, P, m), 1, 1, 1);
      EXPECT_LT(v.bubble, h1.bubble);
      EXPECT_NEAR(v.bubble, (P - 1.0) / (6 * m + P - 1.0), 1e-9) << "P=" << P << " m=" << m;
      EXPECT_NEAR(idle(v) / idle(h1), 0.5, 1e-9) << "P=" << P << " m=" << m;
    }
  }
}

// The lists are built for F = B = W but run with real costs: the zero-bubble ones stay ahead of
// 1F1B when B and W drift from F.
TEST(PipelineSchedule, ZeroBubbleOrdersHoldUpWithUnequalCosts) {
  struct Split { double f, b, w; };
  for (Split c : {Split{1, 1.2, 0.8}, Split{1, 2, 1}, Split{1, 1, 0.5}, Split{1, 1.5, 1}, Split{1, 1, 2}}) {
    for (int P : {2, 4, 8}) {
      for (int m : {2 * P, 4 * P}) {
        const double f1b1 = run(make(Kind::one_f_one_b, P, m), c.f, c.b, c.w).bubble;
        const double h1 = run(make(Kind::zb_h1, P, m), c.f, c.b, c.w).bubble;
        const double h2 = run(make(Kind::zb_h2, P, m), c.f, c.b, c.w).bubble;
        const double v = run(make(Kind::zb_v, P, m), c.f, c.b, c.w).bubble;
        const std::string at = "F:B:W " + std::to_string(c.f) + ":" + std::to_string(c.b) + ":" + std::to_string(c.w) +
                               " P=" + std::to_string(P) + " m=" + std::to_string(m);
        EXPECT_LT(h1, f1b1) << at;
        EXPECT_LE(h2, h1 + 1e-12) << at;
        EXPECT_LT(v, h1) << at;
      }
    }
  }
}

// Not a check: the numbers a reader wants when choosing a schedule.
TEST(PipelineSchedule, PrintsBubbles) {
  for (int m : {8, 16}) {
    for (Kind kind : kAllKinds) {
      const Schedule s = make(kind, 4, m);
      const ScheduleCheck c = validate(s);
      std::printf("P=4 m=%-2d %-11s bubble F=B=W %.4f  B+W=2F %.4f  peak in flight on rank 0: %d (of stages 1/%d of a rank)\n", m,
                  kind_name(kind), run(s, 1, 1, 1).bubble, run(s, 1, 2, 0).bubble, c.peak_in_flight[0], s.spec.virtual_stages);
    }
  }
}

// P = 2, m = 2 1F1B:
//   rank 0: F0@0 send-act 0@0 to 1, F1@0, send-act 1@0 to 1, recv-grad 0@0 from 1, B0@0, W0@0,
//           recv-grad 1@0 from 1, B1@0, W1@0, sync, opt
//   rank 1: recv-act 0@1 from 0, F0@1, B0@1, send-grad 0@1 to 0, W0@1, recv-act 1@1 from 0, F1@1,
//           B1@1, send-grad 1@1 to 0, W1@1, sync, opt
Schedule small() {
  Schedule s = make(Kind::one_f_one_b, 2, 2);
  EXPECT_EQ(s.per_rank[0][1], (Instr{Op::send_act, 0, 0, 1}));
  EXPECT_EQ(s.per_rank[1][0], (Instr{Op::recv_act, 0, 1, 0}));
  return s;
}

void erase(std::vector<Instr>& list, const Instr& instr) { list.erase(list.begin() + position(list, instr)); }

TEST(PipelineSchedule, ValidateRejectsBrokenMessages) {
  Schedule s = small();
  erase(s.per_rank[1], {Op::recv_act, 0, 1, 0});
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 0 position 1 (send-act 0@0 to 1): no matching recv-act 0@1 from 0 on rank 1 "
            "(a send without a receive)");

  s = small();
  erase(s.per_rank[0], {Op::send_act, 0, 0, 1});
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 1 position 0 (recv-act 0@1 from 0): no matching send-act 0@0 to 1 on rank 0 "
            "(a receive without a send)");

  s = small();
  erase(s.per_rank[0], {Op::send_act, 0, 0, 1});
  erase(s.per_rank[1], {Op::recv_act, 0, 1, 0});
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 1 position 0 (F0@1): before its input recv-act 0@1 from 0 "
            "(not in the list: the input never arrives)");

  s = small();
  s.per_rank[0][1].peer = 0;
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 0 position 1 (send-act 0@0 to 0): expected peer 1 (rank of stage 1), found 0");

  // The turn of ZB-V's V is on one rank: a message there is an error.
  s = make(Kind::zb_v, 2, 2);
  s.per_rank[1].insert(s.per_rank[1].begin() + position(s.per_rank[1], F(0, 1)) + 1, {Op::send_act, 0, 1, 1});
  EXPECT_NE(error_of([&] { validate(s); }).find("(send-act 0@1 to 1): expected no message: stages 1 and 2 are both on rank 1"),
            std::string::npos);
}

TEST(PipelineSchedule, ValidateRejectsBrokenComputeOrder) {
  Schedule s = small();
  s.per_rank[0].insert(s.per_rank[0].begin() + 3, F(1, 0));
  EXPECT_EQ(error_of([&] { validate(s); }), "schedule 1f1b: rank 0 position 3 (F1@0): duplicate (first at position 2)");

  s = small();
  erase(s.per_rank[0], W(1, 0));
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 0: no W1@0 in the list (expected one F, B and W per micro-batch of each of its stages)");

  s = small();
  s.per_rank[1][1] = F(0, 0);
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 1 position 1 (F0@0): expected a stage of rank 1, found stage 0 of rank 0");

  s = small();
  std::swap(s.per_rank[1][1], s.per_rank[1][2]);  // B0@1 before F0@1
  EXPECT_EQ(error_of([&] { validate(s); }), "schedule 1f1b: rank 1 position 1 (B0@1): before its F0@1 (at position 2)");

  s = small();
  std::swap(s.per_rank[0][5], s.per_rank[0][6]);  // W0@0 before B0@0
  EXPECT_EQ(error_of([&] { validate(s); }), "schedule 1f1b: rank 0 position 5 (W0@0): before its B0@0 (at position 6)");

  s = small();
  std::swap(s.per_rank[0][6], s.per_rank[0][9]);  // W1@0 before W0@0
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 0 position 6 (W1@0): out of micro-batch order: expected W0@0 first "
            "(a stage runs each of F, B and W in micro-batch order)");

  s = small();
  std::swap(s.per_rank[0][9], s.per_rank[0][10]);  // sync before W1@0
  EXPECT_EQ(error_of([&] { validate(s); }), "schedule 1f1b: rank 0 position 9 (sync): before the rank's W1@0 (at position 10)");

  s = small();
  std::swap(s.per_rank[1][10], s.per_rank[1][11]);  // opt before sync
  EXPECT_EQ(error_of([&] { validate(s); }),
            "schedule 1f1b: rank 1 position 10 (opt): before sync (expected the optimizer step after gradient sync)");
}

TEST(PipelineSchedule, ValidateFindsDeadlocks) {
  // Two ranks that each receive first: rank 0 waits for a gradient of a forward it has not run.
  Schedule s = make(Kind::one_f_one_b, 2, 1);
  std::vector<Instr>& rank0 = s.per_rank[0];
  const Instr recv{Op::recv_grad, 0, 0, 1};
  erase(rank0, recv);
  rank0.insert(rank0.begin(), recv);
  const std::string e = error_of([&] { validate(s); });
  EXPECT_EQ(e, "schedule 1f1b: deadlock: rank 0 waits at position 0 (recv-grad 0@0 from 1), rank 1 waits at position 0 "
               "(recv-act 0@1 from 0)");
  EXPECT_NE(error_of([&] { simulate(s, Costs::uniform(2, 1, 1, 1)); }).find("deadlock"), std::string::npos);
}

TEST(PipelineSchedule, ValidateBoundsActivationMemory) {
  const Schedule s = make(Kind::one_f_one_b, 4, 8);
  EXPECT_EQ(validate(s, {{}, 4}).peak_in_flight, std::vector<int>({4, 3, 2, 1}));
  EXPECT_EQ(error_of([&] { validate(s, {{}, 3}); }),
            "schedule 1f1b: rank 0 position 6 (F3@0): activations in flight peak at 4 micro-batch-stages, "
            "expected at most the limit 3");
  // Weighted: rank 1 holds 3 x 200 bytes, above 500; rank 0's 4 x 100 fits.
  const ScheduleCheck c = validate(s, {{100, 200, 150, 600}, 600});
  EXPECT_EQ(c.peak_bytes, std::vector<int64_t>({400, 600, 300, 600}));
  const std::string e = error_of([&] { validate(s, {{100, 200, 150, 600}, 500}); });
  EXPECT_EQ(e,
            "schedule 1f1b: rank 1 position 7 (F2@1): activations in flight peak at 600 bytes, expected at most the limit 500");
  EXPECT_EQ(error_of([&] { validate(s, {{1, 2}, 0}); }),
            "schedule 1f1b: memory bound: expected bytes for each of the 4 stages, found 2");
  for (Kind kind : kAllKinds) {
    const std::string message = error_of([&] { validate(make(kind, 4, 8), {{}, 1}); });
    EXPECT_NE(message.find("expected at most the limit 1"), std::string::npos) << message;
    EXPECT_EQ(testing::count_lines(message), 1);
  }
}

TEST(PipelineSchedule, SimulateReplaysWithCosts) {
  // rank 0: F0@0 [0, 1], then waits for the gradient: rank 1 gets the activation at 1.25, runs
  // F [1.25, 2.75] (stage 1 forwards cost 1.5), B [2.75, 4.75], W [4.75, 5.25]; the gradient
  // arrives on rank 0 at 5, B [5, 7], W [7, 7.5]; then sync 0.1 and optimizer 0.2 on each rank.
  Costs costs = Costs::uniform(2, 1, 2, 0.5, 0.25);
  costs.forward[1] = 1.5;
  costs.grad_sync = 0.1;
  costs.optimizer = 0.2;
  const Timeline t = simulate(make(Kind::one_f_one_b, 2, 1), costs);
  ASSERT_EQ(t.per_rank.size(), 2u);
  auto expect = [](const std::vector<Interval>& got, const std::vector<std::tuple<Op, double, double>>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].instr.op, std::get<0>(want[i])) << i;
      EXPECT_DOUBLE_EQ(got[i].start, std::get<1>(want[i])) << i;
      EXPECT_DOUBLE_EQ(got[i].end, std::get<2>(want[i])) << i;
    }
  };
  expect(t.per_rank[0], {{Op::forward, 0, 1}, {Op::backward_input, 5, 7}, {Op::backward_weight, 7, 7.5},
                         {Op::grad_sync, 7.5, 7.6}, {Op::optimizer, 7.6, 7.8}});
  expect(t.per_rank[1], {{Op::forward, 1.25, 2.75}, {Op::backward_input, 2.75, 4.75}, {Op::backward_weight, 4.75, 5.25},
                         {Op::grad_sync, 5.25, 5.35}, {Op::optimizer, 5.35, 5.55}});
  EXPECT_DOUBLE_EQ(t.makespan, 7.8);
  EXPECT_EQ(t.busy, std::vector<double>({3.5, 4}));
  EXPECT_DOUBLE_EQ(t.rank_bubble[0], 4.0 / 7.5);
  EXPECT_DOUBLE_EQ(t.rank_bubble[1], 3.5 / 7.5);
  EXPECT_DOUBLE_EQ(t.bubble, 7.5 / 15);

  EXPECT_EQ(error_of([] { simulate(make(Kind::gpipe, 2, 1), Costs::uniform(3, 1, 1, 1)); }),
            "schedule gpipe: costs: expected forward for each of the 2 stages, found 3");
}

TEST(PipelineSchedule, AccountBubbleOfMeasuredIntervals) {
  Timeline t;
  t.per_rank = {{{F(0, 0), 0, 2}, {B(0, 0), 3, 4}}, {{F(0, 1), 1, 3}, {{Op::grad_sync, -1, -1, -1}, 5, 6}}};
  account_bubble(t);
  EXPECT_DOUBLE_EQ(t.makespan, 6);
  EXPECT_EQ(t.busy, std::vector<double>({3, 2}));
  EXPECT_EQ(t.rank_bubble, std::vector<double>({0.25, 0.5}));
  EXPECT_DOUBLE_EQ(t.bubble, 3.0 / 8);
  Timeline empty;
  account_bubble(empty);
  EXPECT_EQ(empty.bubble, 0);
}

TEST(PipelineSchedule, GanttChart) {
  EXPECT_EQ(gantt(run(make(Kind::one_f_one_b, 1, 1), 1, 1, 1), 3), "rank 0 |FBW|\n");
  EXPECT_EQ(gantt(run(make(Kind::one_f_one_b, 1, 1), 1, 1, 1), 9), "rank 0 |F0-B0-W0-|\n");
  // rank 0: F [0, 1], B [3, 4], W [4, 5]; rank 1: F [1, 2], B [2, 3], W [3, 4].
  EXPECT_EQ(gantt(run(make(Kind::zb_h1, 2, 1), 1, 1, 1), 10), "rank 0 |F0....B0W0|\n"
                                                              "rank 1 |..F0B0W0..|\n");
  const std::string chart = gantt(run(make(Kind::zb_v, 8, 16), 1, 1, 1), 80);
  EXPECT_EQ(testing::count_lines(chart), 8);
  EXPECT_NE(chart.find("rank 7 |"), std::string::npos);
}

TEST(PipelineSchedule, ChromeTrace) {
  Costs costs = Costs::uniform(2, 1, 1, 1);
  costs.grad_sync = 0.5;
  const Timeline t = simulate(make(Kind::one_f_one_b, 2, 2), costs);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace(t, "1f1b P=2"));
  EXPECT_EQ(trace["displayTimeUnit"], "ms");
  EXPECT_EQ(trace["otherData"]["name"], "1f1b P=2");
  const nlohmann::json& events = trace["traceEvents"];
  EXPECT_EQ(events.size(), 2 + t.per_rank[0].size() + t.per_rank[1].size());
  int names = 0, found = 0;
  for (const nlohmann::json& e : events) {
    if (e["ph"] == "M") {
      EXPECT_EQ(e["name"], "process_name");
      EXPECT_EQ(e["args"]["name"], "rank " + std::to_string(e["pid"].get<int>()));
      ++names;
      continue;
    }
    EXPECT_EQ(e["ph"], "X");
    EXPECT_EQ(e["tid"], 0);
    if (e["name"] == "B0 s1") {  // rank 1: F0 [1, 2], B0 [2, 3]
      EXPECT_EQ(e["pid"], 1);
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 2000);
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 1000);
      EXPECT_EQ(e["args"]["micro"], 0);
      EXPECT_EQ(e["args"]["stage"], 1);
      ++found;
    }
    if (e["name"] == "sync") {
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 500);
    }
  }
  EXPECT_EQ(names, 2);
  EXPECT_EQ(found, 1);
}

}  // namespace
}  // namespace keel::pipeline
