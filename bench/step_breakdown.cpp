// Where one training step's time goes, beside what each part would take at this machine's limits:
// the dense GEMMs, attention, elementwise work, the optimizer and communication. Trains a model
// through Keel's real trainer on random tokens (as keel_bench_train) and prints one JSON line.
//
// Measured:
//   - step: the mean of `--steps` trainer steps after `--warmup-steps`;
//   - GEMMs: the time and FLOPs of the dense layers' products inside those steps (gemm_stats);
//   - attention: the layer's attention kernel (dense or blockwise, as the run resolved it), forward
//     and backward on the step's shapes, run alone n_layer times (a probe, outside the step);
//   - optimizer: the global gradient norm and one AdamW pass over the trainer's store (a probe);
//   - communication: none (one rank);
//   - elementwise: what remains of the step (norms, activations, residuals, loss, embedding).
// Bounds (the time at this machine's limits):
//   - GEMMs and attention: their FLOPs at the rate a 1024^3 GEMM probe reaches at the run's
//     precision (SGEMM, or oneDNN's bf16 matmul on operands already in bf16), attention counting
//     the causal half of its score and value products (forward 2, backward 4 products);
//   - elementwise: bytes at the bandwidth a triad probe measures, counting each elementwise pass
//     reading its inputs and writing its outputs once: 48 floats per token and channel per block
//     (18 forward, 30 backward; 2 bytes for the activations a bf16 run stores in bf16 are not
//     credited) and 3 passes over the logits;
//   - optimizer: bytes at the same bandwidth: parameter, gradient and both moments read and
//     written, the gradient read once more for its norm, the bf16 copies written under bf16.
// The matrix engine: oneDNN's bf16 matmul (AVX512_BF16) or the emulation, and whether the CPU has
// AMX (whose tile unit oneDNN would pick where present).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/gemm_probe.h"
#include "kernels/cpu/ops.h"
#include "optim/adamw.h"
#include "runtime/attention_choice.h"
#include "runtime/job_config.h"
#include "runtime/trainer.h"

using namespace keel;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Memory bandwidth (GB/s) of a triad a = b + s c over three arrays of `mb` MB, the best of `repeats`.
double bandwidth_probe_gbs(int mb, int repeats) {
  const int64_t n = static_cast<int64_t>(mb) * (1 << 20) / 4;
  std::vector<float> a(static_cast<size_t>(n), 0.0f), b(a.size(), 1.0f), c(a.size(), 2.0f);
  double best = 0;
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    const double s = seconds_since(t0);
    if (r > 0) best = std::max(best, 3.0 * 4.0 * static_cast<double>(n) / s * 1e-9);
  }
  return best + 0.0 * a[static_cast<size_t>(n / 2)];
}

// Seconds for one layer's attention forward and backward on B x T (the kernel the run resolved).
double attention_probe_seconds(const ModelConfig& m, MatmulPrecision precision, int B, int T, int repeats) {
  const int C = m.n_embd, NH = m.n_head, NKV = m.n_kv_head > 0 ? m.n_kv_head : m.n_head;
  const int qkv_cols = C + 2 * NKV * (C / NH);
  const int64_t N = static_cast<int64_t>(B) * T;
  std::vector<float> qkv(static_cast<size_t>(N * qkv_cols)), out(static_cast<size_t>(N * C)), dout(out.size()),
      dqkv(qkv.size());
  Rng rng(7);
  for (float& x : qkv) x = static_cast<float>(rng.normal());
  for (float& x : dout) x = static_cast<float>(rng.normal() * 0.01);
  const bool dense = m.attention == Attention::dense;
  std::vector<float> att(dense ? static_cast<size_t>(B) * NH * T * T : static_cast<size_t>(B) * NH * T);
  auto once = [&] {
    if (dense) {
      ops::attention_forward(precision, out.data(), att.data(), qkv.data(), B, T, C, NH, NKV, true);
      ops::attention_backward_input(precision, dqkv.data(), dout.data(), att.data(), qkv.data(), B, T, C, NH, NKV,
                                    true);
    } else {
      ops::flash_attention_forward(precision, out.data(), att.data(), qkv.data(), B, T, C, NH, NKV, 0);
      ops::flash_attention_backward_input(precision, dqkv.data(), dout.data(), out.data(), att.data(), qkv.data(), B,
                                          T, C, NH, NKV, 0);
    }
  };
  once();
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

bool cpu_has_amx() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) return line.find(" amx_bf16") != std::string::npos;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_compute_environment(argv);
  try {
    std::vector<std::string> sets;
    int steps = 3, warmup = 1;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--set" && i + 1 < argc) sets.push_back(argv[++i]);
      else if (a == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
      else if (a == "--warmup-steps" && i + 1 < argc) warmup = std::stoi(argv[++i]);
      else throw Error("usage: keel_step_breakdown [--steps N] [--warmup-steps N] [--set section.key=value ...]");
    }
    Config config = Config::load("", sets);
    config.train.steps = steps + warmup + 1;
    config.data.tokenizer = "";
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("keel-breakdown-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir);
    config.train.run_dir = dir + "/run";
    config.data.train = dir + "/train.bin";
    config.data.val = dir + "/val.bin";
    const bool auto_attention = config.model.attention == Attention::automatic;
    resolve_job_config(config);
    // The attention kernel as `keel train` decides it (measured from 512 tokens).
    if (attention_measured(config, auto_attention)) config.model.attention = choose_attention(config).kernel;
    const int B = config.train.batch_size, T = config.train.seq_len;
    const size_t window = static_cast<size_t>(B) * T;
    Rng rng(config.train.seed);
    std::vector<uint16_t> tokens(window * config.train.grad_accum * (config.train.steps + 1) + 1);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng.below(config.model.vocab_size));
    write_token_shard(config.data.train, tokens);
    write_token_shard(config.data.val, std::vector<uint16_t>(tokens.begin(), tokens.begin() + window + 1));

    Trainer trainer(config);
    const MatmulPrecision precision = trainer.model().math().forward;
    const ModelConfig& m = trainer.model().config();
    for (int i = 0; i < warmup; ++i) trainer.step();
    gemm_stats_reset();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) trainer.step();
    const double step_s = seconds_since(t0) / steps;
    const GemmStats g = gemm_stats();
    const double gemm_s = g.seconds / steps, gemm_flops = g.flops / steps;

    // Probes (after the steps, on the same threads).
    const double attention_s = m.n_layer * attention_probe_seconds(m, precision, B, T, 2);
    ChunkStore& store = trainer.store();
    AdamW adamw(config.optim);
    double optimizer_s = 1e30;
    for (int r = 0; r < 3; ++r) {
      const auto o0 = std::chrono::steady_clock::now();
      const double norm = std::sqrt(grad_sum_squares(store));  // the gradients the last step left (zero)
      const double clip = config.optim.grad_clip;
      adamw.step(store, 1e-6, 1000 + r, clip > 0 && norm > clip ? static_cast<float>(clip / norm) : 1.0f);
      optimizer_s = std::min(optimizer_s, seconds_since(o0));
    }
    std::filesystem::remove_all(dir);
    const double gemm_probe = measure_gemm_gflops(precision, 1024, 3);
    const double bandwidth = bandwidth_probe_gbs(256, 3);

    const double C = m.n_embd, N = static_cast<double>(B) * T, L = m.n_layer;
    const double hs = C / m.n_head;
    const double attention_flops = L * 6.0 * B * m.n_head * (static_cast<double>(T) * T / 2) * hs * 2;
    const double elementwise_bytes = L * 48.0 * N * C * 4 + 3.0 * N * m.padded_vocab_size * 4;
    const double params = static_cast<double>(store.param_count());
    const double optimizer_bytes = params * (32 + 4 + (precision == MatmulPrecision::bf16 ? 2 : 0));
    const double bound_gemm = gemm_flops / (gemm_probe * 1e9), bound_attention = attention_flops / (gemm_probe * 1e9);
    const double bound_elementwise = elementwise_bytes / (bandwidth * 1e9);
    const double bound_optimizer = optimizer_bytes / (bandwidth * 1e9);
    const double elementwise_s = std::max(0.0, step_s - gemm_s - attention_s - optimizer_s);
    const double bound = bound_gemm + bound_attention + bound_elementwise + bound_optimizer;
    const std::string engine =
        precision == MatmulPrecision::bf16 ? bf16_engine() : "OpenBLAS SGEMM (" + blas_core() + ")";
    std::printf(
        "{\"model\": \"%s\", \"precision\": \"%s\", \"B\": %d, \"T\": %d, \"threads\": %d, \"engine\": \"%s\", "
        "\"amx\": %s, \"gemm_probe_gflops\": %.1f, \"bandwidth_gbs\": %.1f, \"step_ms\": %.1f, "
        "\"gemm_ms\": %.1f, \"gemm_bound_ms\": %.1f, \"attention_ms\": %.1f, \"attention_bound_ms\": %.1f, "
        "\"elementwise_ms\": %.1f, \"elementwise_bound_ms\": %.1f, \"optimizer_ms\": %.1f, "
        "\"optimizer_bound_ms\": %.1f, "
        "\"communication_ms\": 0.0, \"communication_bound_ms\": 0.0, \"bound_ms\": %.1f, \"step_over_bound\": %.2f, "
        "\"tokens_per_s\": %.1f}\n",
        config.model.preset.c_str(), precision == MatmulPrecision::bf16 ? "bf16" : "fp32", B, T, omp_get_max_threads(),
        engine.c_str(), cpu_has_amx() ? "true" : "false", gemm_probe, bandwidth, step_s * 1e3, gemm_s * 1e3,
        bound_gemm * 1e3, attention_s * 1e3, bound_attention * 1e3, elementwise_s * 1e3, bound_elementwise * 1e3,
        optimizer_s * 1e3, bound_optimizer * 1e3, bound * 1e3, step_s / bound, N / step_s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel_step_breakdown: %s\n", e.what());
    return 1;
  }
}
