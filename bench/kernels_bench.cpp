// Micro-benchmarks of Keel's CPU kernels at GPT-2 124M shapes (B=4, T=64, C=768, H=12) with
// Google Benchmark. Each reports GFLOP/s (or GB/s for memory-bound ops) as counters; the SGEMM
// benchmark at the top is the machine's ceiling measured in the same run, to read them against.
//   build/bench/keel_kernels_bench [--benchmark_filter=Attention]
#include <benchmark/benchmark.h>

#include <vector>

#include "core/rng.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/ops.h"

namespace {

constexpr int B = 4, T = 64, C = 768, NH = 12, N = B * T, V = 50257, Vp = 50304;

std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  keel::Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal()) * scale;
  return v;
}

void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Sgemm1024(benchmark::State& state) {
  const int n = 1024;
  auto a = random_floats(n * n, 1), b = random_floats(n * n, 2), c = random_floats(n * n, 3);
  for (auto _ : state)
    keel::gemm<float>(keel::MatmulPrecision::fp32, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                      c.data(), n);
  set_flops(state, 2.0 * n * n * n);
}
BENCHMARK(BM_Sgemm1024)->Unit(benchmark::kMillisecond);

// state.range(0): output channels (3C qkv, C proj, 4C fc)
void BM_LinearForward(benchmark::State& state) {
  const int OC = static_cast<int>(state.range(0));
  auto inp = random_floats(N * C, 1), w = random_floats(OC * C, 2, 0.02f), bias = random_floats(OC, 3),
       out = std::vector<float>(N * OC);
  for (auto _ : state)
    keel::ops::linear_forward(keel::MatmulPrecision::fp32, out.data(), inp.data(), w.data(), bias.data(), N, C, OC);
  set_flops(state, 2.0 * N * C * OC);
}
BENCHMARK(BM_LinearForward)->Arg(3 * C)->Arg(C)->Arg(4 * C)->Unit(benchmark::kMicrosecond);

void BM_LinearBackwardWeight(benchmark::State& state) {
  const int OC = static_cast<int>(state.range(0));
  auto inp = random_floats(N * C, 1), dout = random_floats(N * OC, 2), dw = std::vector<float>(OC * C),
       db = std::vector<float>(OC);
  for (auto _ : state)
    keel::ops::linear_backward_weight(keel::MatmulPrecision::fp32, dw.data(), db.data(), dout.data(), inp.data(), N, C,
                                      OC);
  set_flops(state, 2.0 * N * C * OC);
}
BENCHMARK(BM_LinearBackwardWeight)->Arg(3 * C)->Arg(4 * C)->Unit(benchmark::kMicrosecond);

void BM_AttentionForward(benchmark::State& state) {
  auto qkv = random_floats(N * 3 * C, 1), out = std::vector<float>(N * C), att = std::vector<float>(B * NH * T * T);
  for (auto _ : state)
    keel::ops::attention_forward(keel::MatmulPrecision::fp32, out.data(), att.data(), qkv.data(), B, T, C, NH);
  set_flops(state, 4.0 * B * T * T * C);
}
BENCHMARK(BM_AttentionForward)->Unit(benchmark::kMicrosecond);

void BM_AttentionBackward(benchmark::State& state) {
  auto qkv = random_floats(N * 3 * C, 1), out = std::vector<float>(N * C), att = std::vector<float>(B * NH * T * T);
  auto dout = random_floats(N * C, 2), dqkv = std::vector<float>(N * 3 * C);
  keel::ops::attention_forward(keel::MatmulPrecision::fp32, out.data(), att.data(), qkv.data(), B, T, C, NH);
  for (auto _ : state)
    keel::ops::attention_backward_input(keel::MatmulPrecision::fp32, dqkv.data(), dout.data(), att.data(), qkv.data(),
                                        B, T, C, NH);
  set_flops(state, 8.0 * B * T * T * C);
}
BENCHMARK(BM_AttentionBackward)->Unit(benchmark::kMicrosecond);

// Attention forward + backward at sequence length T (arg), d4's heads (C 256, 4 heads of 64), the
// tokens of a 4 x 256 batch: dense (T x T probabilities) against blockwise (64 x 64 tiles).
void attention_step(benchmark::State& state, bool dense) {
  const int Tn = static_cast<int>(state.range(0)), Bn = std::max(1, 1024 / Tn), Cn = 256, heads = 4;
  std::vector<float> qkv(static_cast<size_t>(Bn) * Tn * 3 * Cn, 0.1f), out(static_cast<size_t>(Bn) * Tn * Cn),
      dout(out.size(), 0.01f), dqkv(qkv.size());
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  std::vector<float> att(dense ? static_cast<size_t>(Bn) * heads * Tn * Tn : static_cast<size_t>(Bn) * heads * Tn);
  for (auto _ : state) {
    if (dense) {
      keel::ops::attention_forward(keel::MatmulPrecision::fp32, out.data(), att.data(), qkv.data(), Bn, Tn, Cn, heads);
      keel::ops::attention_backward_input(keel::MatmulPrecision::fp32, dqkv.data(), dout.data(), att.data(), qkv.data(),
                                          Bn, Tn, Cn, heads);
    } else {
      keel::ops::flash_attention_forward(keel::MatmulPrecision::fp32, out.data(), att.data(), qkv.data(), Bn, Tn, Cn,
                                         heads, heads, 0);
      keel::ops::flash_attention_backward_input(keel::MatmulPrecision::fp32, dqkv.data(), dout.data(), out.data(),
                                                att.data(), qkv.data(), Bn, Tn, Cn, heads, heads, 0);
    }
  }
  state.counters["tokens"] = Bn * Tn;
  state.counters["saved_MB"] = static_cast<double>(att.size()) * 4 / 1e6;
}
void BM_AttentionDense(benchmark::State& s) { attention_step(s, true); }
void BM_AttentionBlockwise(benchmark::State& s) { attention_step(s, false); }
BENCHMARK(BM_AttentionDense)->Arg(64)->Arg(128)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionBlockwise)->Arg(64)->Arg(128)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);

void BM_LayernormForward(benchmark::State& state) {
  auto inp = random_floats(N * C, 1), w = random_floats(C, 2), b = random_floats(C, 3), out = std::vector<float>(N * C);
  std::vector<float> mean(N), rstd(N);
  for (auto _ : state) keel::ops::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  state.counters["GB/s"] = benchmark::Counter(2.0 * N * C * 4 * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LayernormForward)->Unit(benchmark::kMicrosecond);

void BM_GeluBackward(benchmark::State& state) {
  const int64_t n = static_cast<int64_t>(N) * 4 * C;
  auto inp = random_floats(n, 1), dout = random_floats(n, 2), dinp = std::vector<float>(n);
  for (auto _ : state) keel::ops::gelu_backward_input(dinp.data(), dout.data(), inp.data(), n);
  state.counters["GB/s"] = benchmark::Counter(3.0 * n * 4 * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_GeluBackward)->Unit(benchmark::kMicrosecond);

void BM_CrossEntropyWithGradient(benchmark::State& state) {
  auto logits0 = random_floats(static_cast<size_t>(N) * Vp, 1);
  std::vector<float> logits(logits0.size()), losses(N);
  std::vector<int> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = (i * 7919) % V;
  for (auto _ : state) {
    state.PauseTiming();
    logits = logits0;
    state.ResumeTiming();
    keel::ops::crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp, 1.0f / N);
  }
  state.counters["GB/s"] = benchmark::Counter(2.0 * N * Vp * 4 * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_CrossEntropyWithGradient)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
