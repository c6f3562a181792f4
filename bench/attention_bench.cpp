// Times Keel's attention kernels alone, forward + backward, at one shape and prints one JSON line;
// bench/long_context.sh runs it side by side with PyTorch's scaled_dot_product_attention
// (bench/torch_long_context.py --attention-only) on the same shape.
//   keel_bench_attention --kind blockwise|dense|ring --precision fp32|bf16 --batch B --seq T --heads NH
//                        [--kv-heads NKV] --head-size HS [--window W] [--repeats N] [--threads N] [--parts P]
// --kind ring times one context-parallel rank's attention (kernels/cpu/ring_attention.h): rank 0 of
// P, holding chunks 0 and 2P-1 of the sequence cut into 2P, meeting every rank's key/value block
// in ring order, forward then backward (no communication: the kernels alone). Its work is about
// 1/P of blockwise attention over the whole sequence, so P x its time against --kind blockwise's
// says how efficient the ring's kernels are.
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/float_mode.h"
#include "kernels/cpu/ring_attention.h"

using namespace keel;

namespace {

// Rank 0 of P's ring attention, forward and backward: the least of `repeats` timed passes after
// one untimed (as ops::time_attention).
ops::AttentionTiming time_ring(MatmulPrecision precision, int B, int T, int NH, int NKV, int hs, int window, int P,
                               int repeats) {
  const int C = NH * hs, kv = NKV * hs, C3 = C + 2 * kv, Tl = T / P, chunk = T / (2 * P);
  auto positions = [&](int r) {
    std::vector<int> pos;
    for (int t = r * chunk; t < (r + 1) * chunk; ++t) pos.push_back(t);
    for (int t = (2 * P - 1 - r) * chunk; t < (2 * P - r) * chunk; ++t) pos.push_back(t);
    return pos;
  };
  std::vector<std::vector<int>> pos(P);
  for (int r = 0; r < P; ++r) pos[r] = positions(r);
  const size_t rows = static_cast<size_t>(B) * Tl;
  std::vector<float> qkv(rows * C3), blk(rows * 2 * kv), dout(rows * C), out(rows * C), lse(rows * NH),
      acc(rows * C), m(rows * NH), l(rows * NH), delta(rows * NH), dqkv(rows * C3), dkv(rows * 2 * kv);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>((i * 2654435761u) % 2000) / 1000.0f - 1.0f;
  for (size_t i = 0; i < blk.size(); ++i) blk[i] = static_cast<float>((i * 97u) % 2000) / 1000.0f - 1.0f;
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<float>((i * 40503u) % 2000) / 100000.0f - 0.01f;
  ops::RingBlock s;
  s.B = B, s.Tq = Tl, s.Tk = Tl, s.C = C, s.NH = NH, s.NKV = NKV, s.window = window, s.ldq = C3, s.ldkv = 2 * kv;
  s.qpos = pos[0].data();
  using clock = std::chrono::steady_clock;
  auto ms = [](clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  ops::AttentionTiming best{std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int rep = 0; rep <= repeats; ++rep) {
    const auto t0 = clock::now();
    ops::ring_attention_begin(acc.data(), m.data(), l.data(), s);
    for (int step = 0; step < P; ++step) {
      s.kpos = pos[(P - step) % P].data();  // the blocks of ranks 0, P-1, ..., 1 (one buffer stands for each)
      if (ops::ring_block_visible(s))
        ops::ring_attention_forward_block(precision, acc.data(), m.data(), l.data(), qkv.data(), blk.data(),
                                          blk.data() + kv, s);
    }
    ops::ring_attention_finish(out.data(), lse.data(), acc.data(), m.data(), l.data(), s);
    const auto t1 = clock::now();
    ops::ring_attention_delta(delta.data(), dout.data(), out.data(), s);
    std::fill(dqkv.begin(), dqkv.end(), 0.0f);
    for (int step = 0; step < P; ++step) {
      s.kpos = pos[(P - step) % P].data();
      std::fill(dkv.begin(), dkv.end(), 0.0f);
      if (ops::ring_block_visible(s))
        ops::ring_attention_backward_block(precision, dqkv.data(), dkv.data(), dkv.data() + kv, dout.data(),
                                           lse.data(), delta.data(), qkv.data(), blk.data(), blk.data() + kv, s);
    }
    const auto t2 = clock::now();
    if (rep == 0) continue;
    best.forward_ms = std::min(best.forward_ms, ms(t1 - t0));
    best.backward_ms = std::min(best.backward_ms, ms(t2 - t1));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_compute_environment(argv);
  try {
    std::string kind = "blockwise", precision = "fp32";
    int B = 1, T = 4096, NH = 4, NKV = 0, hs = 64, window = 0, repeats = 2, threads = 0, parts = 2;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--kind" && has_value) kind = argv[++i];
      else if (a == "--precision" && has_value) precision = argv[++i];
      else if (a == "--batch" && has_value) B = std::stoi(argv[++i]);
      else if (a == "--seq" && has_value) T = std::stoi(argv[++i]);
      else if (a == "--heads" && has_value) NH = std::stoi(argv[++i]);
      else if (a == "--kv-heads" && has_value) NKV = std::stoi(argv[++i]);
      else if (a == "--head-size" && has_value) hs = std::stoi(argv[++i]);
      else if (a == "--window" && has_value) window = std::stoi(argv[++i]);
      else if (a == "--repeats" && has_value) repeats = std::stoi(argv[++i]);
      else if (a == "--threads" && has_value) threads = std::stoi(argv[++i]);
      else if (a == "--parts" && has_value) parts = std::stoi(argv[++i]);
      else throw Error("keel_bench_attention: unknown or incomplete option '" + a + "' (see the file's header)");
    }
    if (NKV == 0) NKV = NH;
    check(kind == "blockwise" || kind == "dense" || kind == "ring",
          "--kind: expected blockwise, dense or ring, found '" + kind + "'");
    check(kind != "ring" || (parts >= 1 && T % (2 * parts) == 0),
          "--parts: expected >= 1 with --seq cut into 2 x parts equal chunks");
    check(precision == "fp32" || precision == "bf16", "--precision: expected fp32 or bf16, found '" + precision + "'");
    check(B >= 1 && T >= 1 && NH >= 1 && NKV >= 1 && NH % NKV == 0 && hs >= 1 && window >= 0 && repeats >= 1,
          "keel_bench_attention: expected positive sizes, --kv-heads dividing --heads, --window >= 0");
    check(kind != "dense" || window == 0, "--window: the dense kernel has no window");
    if (threads > 0) omp_set_num_threads(threads);
    set_flush_denormals(true);
    const MatmulPrecision p = precision == "bf16" ? MatmulPrecision::bf16 : MatmulPrecision::fp32;
    const ops::AttentionTiming t =
        kind == "ring" ? time_ring(p, B, T, NH, NKV, hs, window, parts, repeats)
                       : ops::time_attention(kind == "dense", p, B, T, NH * hs, NH, NKV, window, repeats);
    std::printf("{\"kind\": \"%s\", \"precision\": \"%s\", \"seq\": %d, \"window\": %d, \"parts\": %d, "
                "\"forward_ms\": %.2f, \"backward_ms\": %.2f, \"ms\": %.2f, \"threads\": %d}\n",
                kind.c_str(), precision.c_str(), T, window, kind == "ring" ? parts : 1, t.forward_ms, t.backward_ms,
                t.total_ms(), omp_get_max_threads());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
