// Ring attention's pieces (kernels/cpu/ring_attention.h) against the blockwise kernel they split:
// keys cut into parts and merged one part at a time give flash_attention_forward's output and
// log-sum-exp, and the per-part backward gives flash_attention_backward_input's gradients, for
// contiguous parts and for context parallelism's mirrored chunks (rank r of C holds chunks r and
// 2C-1-r of 2C), causal and windowed, grouped-query heads, lengths off the 64-row tile.
#include "kernels/cpu/ring_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/ops.h"

namespace keel::ops {
namespace {

struct Case {
  int B, T, NH, NKV, hs, window;
  int C() const { return NH * hs; }
  int kv() const { return NKV * hs; }
  int C3() const { return C() + 2 * kv(); }
};

template <typename T>
struct Data {
  std::vector<T> qkv, dout;
};

template <typename T>
Data<T> make_data(const Case& c, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  Data<T> d;
  d.qkv.resize(static_cast<size_t>(c.B) * c.T * c.C3());
  d.dout.resize(static_cast<size_t>(c.B) * c.T * c.C());
  for (auto& x : d.qkv) x = static_cast<T>(n(gen));
  for (auto& x : d.dout) x = static_cast<T>(n(gen));
  return d;
}

// A rank's rows: the positions it holds, in order.
using Rows = std::vector<int>;

// Contiguous parts: part r holds positions [r T / P, (r + 1) T / P).
std::vector<Rows> contiguous_parts(int T, int P) {
  std::vector<Rows> parts(P);
  for (int r = 0; r < P; ++r)
    for (int t = r * T / P; t < (r + 1) * T / P; ++t) parts[r].push_back(t);
  return parts;
}
// Context parallelism's layout: T cut into 2P equal chunks, rank r holds chunks r and 2P-1-r.
std::vector<Rows> mirrored_chunks(int T, int P) {
  const int chunk = T / (2 * P);
  std::vector<Rows> parts(P);
  for (int r = 0; r < P; ++r) {
    for (int t = r * chunk; t < (r + 1) * chunk; ++t) parts[r].push_back(t);
    for (int t = (2 * P - 1 - r) * chunk; t < (2 * P - r) * chunk; ++t) parts[r].push_back(t);
  }
  return parts;
}

// Rows `rows` of x[B, T, width] into [B, rows, width].
template <typename T>
std::vector<T> gather(const std::vector<T>& x, int B, int Tn, int width, const Rows& rows) {
  std::vector<T> out(static_cast<size_t>(B) * rows.size() * width);
  for (int b = 0; b < B; ++b)
    for (size_t t = 0; t < rows.size(); ++t)
      std::copy_n(x.begin() + (static_cast<int64_t>(b) * Tn + rows[t]) * width, width,
                  out.begin() + (b * rows.size() + t) * width);
  return out;
}

template <typename T>
struct Result {
  std::vector<T> out, lse, dqkv;  // whole-sequence layouts, as the blockwise kernel's
  int skipped = 0;                // (rank, block) steps with nothing allowed
};

// Every rank's queries against every rank's block, in ring order (rank r first meets its own
// block, then r-1, r-2, ... as a ring passing blocks forward delivers them), then the backward
// with each block's dk, dv returned to its owner.
template <typename T>
Result<T> run_ring(MatmulPrecision precision, const Case& c, const Data<T>& d, const std::vector<Rows>& parts) {
  const int P = static_cast<int>(parts.size()), C = c.C(), C3 = c.C3(), kv = c.kv();
  Result<T> res;
  res.out.resize(static_cast<size_t>(c.B) * c.T * C);
  res.lse.resize(static_cast<size_t>(c.B) * c.NH * c.T);
  res.dqkv.assign(d.qkv.size(), T(0));
  std::vector<std::vector<T>> qkv(P), outs(P), lses(P), dkv(P);
  for (int r = 0; r < P; ++r) {
    qkv[r] = gather(d.qkv, c.B, c.T, C3, parts[r]);
    dkv[r].assign(qkv[r].size(), T(0));  // the block's dk, dv at their qkv columns
  }
  auto block = [&](int r, int owner) {
    RingBlock s;
    s.B = c.B, s.Tq = static_cast<int>(parts[r].size()), s.Tk = static_cast<int>(parts[owner].size());
    s.C = C, s.NH = c.NH, s.NKV = c.NKV, s.window = c.window, s.ldq = C3, s.ldkv = C3;
    s.qpos = parts[r].data(), s.kpos = parts[owner].data();
    return s;
  };
  for (int r = 0; r < P; ++r) {
    const RingBlock own = block(r, r);
    const int64_t rows = static_cast<int64_t>(c.B) * own.Tq;
    std::vector<T> acc(rows * C), m(rows * c.NH), l(rows * c.NH);
    ring_attention_begin(acc.data(), m.data(), l.data(), own);
    for (int step = 0; step < P; ++step) {
      const int owner = (r - step + P) % P;
      const RingBlock s = block(r, owner);
      if (!ring_block_visible(s)) {
        ++res.skipped;
        continue;
      }
      ring_attention_forward_block(precision, acc.data(), m.data(), l.data(), qkv[r].data(), qkv[owner].data() + C,
                                   qkv[owner].data() + C + kv, s);
    }
    outs[r].resize(rows * C);
    lses[r].resize(rows * c.NH);
    ring_attention_finish(outs[r].data(), lses[r].data(), acc.data(), m.data(), l.data(), own);
  }
  for (int r = 0; r < P; ++r) {
    const RingBlock own = block(r, r);
    const std::vector<T> dout = gather(d.dout, c.B, c.T, C, parts[r]);
    std::vector<T> delta(static_cast<size_t>(c.B) * c.NH * own.Tq), dq(qkv[r].size(), T(0));
    ring_attention_delta(delta.data(), dout.data(), outs[r].data(), own);
    for (int step = 0; step < P; ++step) {
      const int owner = (r - step + P) % P;
      const RingBlock s = block(r, owner);
      if (!ring_block_visible(s)) continue;
      // The block's gradient as it travels: zeroed, filled by this rank, added in at its owner.
      std::vector<T> travelling(qkv[owner].size(), T(0));
      ring_attention_backward_block(precision, dq.data(), travelling.data() + C, travelling.data() + C + kv,
                                    dout.data(), lses[r].data(), delta.data(), qkv[r].data(), qkv[owner].data() + C,
                                    qkv[owner].data() + C + kv, s);
      for (size_t i = 0; i < travelling.size(); ++i) dkv[owner][i] += travelling[i];
    }
    for (size_t i = 0; i < dq.size(); ++i) {
      if (static_cast<int>(i % C3) < C) dkv[r][i] += dq[i];
    }
  }
  for (int r = 0; r < P; ++r) {
    const int Tq = static_cast<int>(parts[r].size());
    for (int b = 0; b < c.B; ++b) {
      for (int t = 0; t < Tq; ++t) {
        const int pos = parts[r][t];
        std::copy_n(outs[r].begin() + (static_cast<int64_t>(b) * Tq + t) * C, C,
                    res.out.begin() + (static_cast<int64_t>(b) * c.T + pos) * C);
        std::copy_n(dkv[r].begin() + (static_cast<int64_t>(b) * Tq + t) * C3, C3,
                    res.dqkv.begin() + (static_cast<int64_t>(b) * c.T + pos) * C3);
        for (int h = 0; h < c.NH; ++h)
          res.lse[(static_cast<int64_t>(b) * c.NH + h) * c.T + pos] = lses[r][(static_cast<int64_t>(b) * c.NH + h) * Tq + t];
      }
    }
  }
  return res;
}

template <typename T>
Result<T> run_blockwise(MatmulPrecision precision, const Case& c, const Data<T>& d) {
  Result<T> res;
  res.out.resize(d.dout.size());
  res.lse.resize(static_cast<size_t>(c.B) * c.NH * c.T);
  res.dqkv.resize(d.qkv.size());
  flash_attention_forward<T>(precision, res.out.data(), res.lse.data(), d.qkv.data(), c.B, c.T, c.C(), c.NH, c.NKV,
                             c.window);
  flash_attention_backward_input<T>(precision, res.dqkv.data(), d.dout.data(), res.out.data(), res.lse.data(),
                                    d.qkv.data(), c.B, c.T, c.C(), c.NH, c.NKV, c.window);
  return res;
}

template <typename T, typename U>
double max_abs_diff(const std::vector<T>& a, const std::vector<U>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

std::string name(const Case& c, int P, bool mirrored) {
  return "B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " heads " + std::to_string(c.NH) + "/" +
         std::to_string(c.NKV) + " hs " + std::to_string(c.hs) + " window " + std::to_string(c.window) + " parts " +
         std::to_string(P) + (mirrored ? " mirrored" : " contiguous");
}

// Head sizes of 16, 32 and 64 take the vector path on AVX-512 machines (8: the BLAS tiles); T = 200
// cuts into chunks of 50 or 25, so tiles straddle two chunks' positions.
const std::vector<Case> kCases = {{2, 256, 4, 2, 16, 0},  {1, 200, 2, 2, 8, 0},   {2, 256, 4, 4, 16, 40},
                                  {1, 384, 4, 1, 32, 64},  {2, 96, 2, 1, 16, 1},   {1, 512, 2, 2, 16, 100},
                                  {1, 200, 4, 2, 16, 30},  {1, 1024, 4, 2, 64, 0}};

TEST(RingAttention, MergedPartsEqualBlockwiseInDouble) {
  for (const Case& c : kCases) {
    const Data<double> d = make_data<double>(c, 4300 + c.T + c.window);
    const Result<double> want = run_blockwise(MatmulPrecision::fp32, c, d);
    for (const int P : {1, 2, 3, 4}) {
      for (const bool mirrored : {false, true}) {
        if (mirrored && c.T % (2 * P) != 0) continue;
        SCOPED_TRACE(name(c, P, mirrored));
        const auto parts = mirrored ? mirrored_chunks(c.T, P) : contiguous_parts(c.T, P);
        const Result<double> got = run_ring(MatmulPrecision::fp32, c, d, parts);
        EXPECT_LT(max_abs_diff(got.out, want.out), 1e-12);
        EXPECT_LT(max_abs_diff(got.lse, want.lse), 1e-12);
        EXPECT_LT(max_abs_diff(got.dqkv, want.dqkv), 1e-11);
        // Causal contiguous parts: rank r sees only blocks 0..r (P (P - 1) / 2 steps skipped).
        if (!mirrored && c.window == 0) {
          EXPECT_EQ(got.skipped, P * (P - 1) / 2);
        }
      }
    }
  }
}

// A narrow window over many parts leaves whole (rank, block) steps outside every query's window.
TEST(RingAttention, WindowSkipsStepsWhollyOutside) {
  const Case c{1, 512, 2, 2, 16, 50};
  const Data<double> d = make_data<double>(c, 4399);
  const Result<double> want = run_blockwise(MatmulPrecision::fp32, c, d);
  const Result<double> got = run_ring(MatmulPrecision::fp32, c, d, mirrored_chunks(c.T, 4));
  EXPECT_LT(max_abs_diff(got.out, want.out), 1e-12);
  EXPECT_LT(max_abs_diff(got.dqkv, want.dqkv), 1e-11);
  // Chunks of 64 with a window of 50: a query meets keys of its own chunk and the one before it.
  // Rank r holds chunks r and 7-r, so it needs the blocks holding chunks r-1 and 6-r: ranks
  // 0..3 see 2, 3, 3, 2 of the 4 blocks; 6 of the 16 (rank, block) steps are skipped.
  EXPECT_EQ(got.skipped, 6);
}

TEST(RingAttention, FloatEqualsDoubleBlockwise) {
  for (const Case& c : kCases) {
    const Data<double> d = make_data<double>(c, 4300 + c.T + c.window);
    Data<float> f;
    f.qkv.assign(d.qkv.begin(), d.qkv.end());
    f.dout.assign(d.dout.begin(), d.dout.end());
    const Result<double> want = run_blockwise(MatmulPrecision::fp32, c, d);
    for (const int P : {2, 4}) {
      if (c.T % (2 * P) != 0) continue;
      SCOPED_TRACE(name(c, P, true));
      const Result<float> got = run_ring(MatmulPrecision::fp32, c, f, mirrored_chunks(c.T, P));
      const Result<float> whole = run_blockwise(MatmulPrecision::fp32, c, f);
      EXPECT_LT(max_abs_diff(got.out, want.out), 2e-5);
      EXPECT_LT(max_abs_diff(got.lse, want.lse), 2e-6);
      EXPECT_LT(max_abs_diff(got.dqkv, want.dqkv), 2e-4);
      EXPECT_LT(max_abs_diff(got.out, whole.out), 2e-5);  // and the float blockwise kernel itself
    }
  }
}

// bf16 products (the vector path's AVX512_BF16 dot products): the ring rounds the same operands
// as the blockwise kernel (q, k, v, dout, each tile's probabilities and score gradients), so the
// two agree to bf16's precision; the probabilities differ only by which running maximum they were
// taken against.
TEST(RingAttention, Bf16MatchesBlockwiseBf16) {
  if (!blockwise_attention_vectorized(MatmulPrecision::bf16, 16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  for (const Case& c : kCases) {
    if (c.hs % 16 != 0) continue;
    const Data<double> d = make_data<double>(c, 4500 + c.T + c.window);
    Data<float> f;
    f.qkv.assign(d.qkv.begin(), d.qkv.end());
    f.dout.assign(d.dout.begin(), d.dout.end());
    const Result<float> whole = run_blockwise(MatmulPrecision::bf16, c, f);
    const Result<double> exact = run_blockwise(MatmulPrecision::fp32, c, d);
    for (const int P : {2, 4}) {
      if (c.T % (2 * P) != 0) continue;
      SCOPED_TRACE(name(c, P, true));
      const Result<float> got = run_ring(MatmulPrecision::bf16, c, f, mirrored_chunks(c.T, P));
      // Against the float64 function, the ring's bf16 error is the blockwise kernel's, within 1.2x.
      const double out_err = max_abs_diff(got.out, exact.out), whole_out_err = max_abs_diff(whole.out, exact.out);
      const double grad_err = max_abs_diff(got.dqkv, exact.dqkv), whole_grad_err = max_abs_diff(whole.dqkv, exact.dqkv);
      EXPECT_LT(out_err, 1.2 * whole_out_err + 1e-4);
      EXPECT_LT(grad_err, 1.2 * whole_grad_err + 1e-4);
      EXPECT_LT(max_abs_diff(got.out, whole.out), 5e-3);
      EXPECT_LT(max_abs_diff(got.lse, whole.lse), 5e-3);
    }
  }
}

}  // namespace
}  // namespace keel::ops
