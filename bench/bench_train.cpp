// Trains a GPT of a given shape on random tokens for a fixed number of steps through Keel's real
// trainer (chunk store, B/W backward, AdamW, clipping) and prints one JSON line: tokens/s,
// ms/step, peak RSS, achieved model GFLOP/s, time share and rate of the dense GEMMs, and the
// SGEMM rate measured on this machine in the same run. bench/compare_pytorch.sh runs it
// side by side with the PyTorch peer.
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"
#include "kernels/cpu/blas.h"
#include "runtime/attention_choice.h"
#include "runtime/job_config.h"
#include "runtime/trainer.h"

using namespace keel;

int main(int argc, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {  // as the keel command does
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    ::execv("/proc/self/exe", argv);
  }
  try {
    std::vector<std::string> sets;
    int steps = 10, warmup = 2;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--set" && i + 1 < argc) sets.push_back(argv[++i]);
      else if (a == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
      else if (a == "--warmup-steps" && i + 1 < argc) warmup = std::stoi(argv[++i]);
      else throw Error("usage: keel_bench_train [--steps N] [--warmup-steps N] [--set section.key=value ...]");
    }
    Config config = Config::load("", sets);
    config.train.steps = steps + warmup;
    config.data.tokenizer = "";
    const std::string dir = (std::filesystem::temp_directory_path() / ("keel-bench-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir);
    config.train.run_dir = dir + "/run";
    config.data.train = dir + "/train.bin";
    config.data.val = dir + "/val.bin";
    const bool auto_attention = config.model.attention == Attention::automatic;
    resolve_job_config(config);
    // The attention kernel as `keel train` decides it (measured from 512 tokens).
    if (attention_measured(config, auto_attention)) config.model.attention = choose_attention(config).kernel;
    // Random tokens: the benchmark measures speed, not learning; same distribution as the peer's.
    const size_t window = static_cast<size_t>(config.train.batch_size) * config.train.seq_len;
    Rng rng(config.train.seed);
    std::vector<uint16_t> tokens(window * config.train.grad_accum * (config.train.steps + 1) + 1);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng.below(config.model.vocab_size));
    write_token_shard(config.data.train, tokens);
    write_token_shard(config.data.val, std::vector<uint16_t>(tokens.begin(), tokens.begin() + window + 1));

    const double sgemm_gflops = measure_sgemm_gflops();
    config.runtime.peak_gflops = sgemm_gflops;
    Trainer trainer(config);
    for (int i = 0; i < warmup; ++i) trainer.step();
    gemm_stats_reset();
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    for (int i = 0; i < steps; ++i) loss = trainer.step().loss;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const GemmStats g = gemm_stats();
    std::filesystem::remove_all(dir);

    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    const double tokens_per_s = static_cast<double>(window) * config.train.grad_accum * steps / seconds;
    const double model_gflops = trainer.model().train_flops_per_token(config.train.seq_len) * tokens_per_s * 1e-9;
    std::printf(
        "{\"tokens_per_s\": %.1f, \"ms_per_step\": %.1f, \"peak_rss_mb\": %.0f, \"params\": %lld, \"final_loss\": %.4f, "
        "\"threads\": %d, \"model_gflops\": %.1f, \"gemm_gflops\": %.1f, \"gemm_time_share\": %.3f, "
        "\"sgemm_gflops\": %.1f}\n",
        tokens_per_s, seconds * 1e3 / steps, usage.ru_maxrss / 1024.0,
        static_cast<long long>(trainer.store().param_count()), loss, omp_get_max_threads(), model_gflops,
        g.seconds > 0 ? g.flops / g.seconds * 1e-9 : 0.0, g.seconds / seconds, sgemm_gflops);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel_bench_train: %s\n", e.what());
    return 1;
  }
}
