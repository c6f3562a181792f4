#include "kernels/cpu/blas.h"

#include <cblas.h>
#include <omp.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <mutex>
#include <vector>

#include "core/cpu.h"
#include "core/error.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/int8_gemm.h"
#include "kernels/cpu/weight_gemm.h"

extern "C" {
char* openblas_get_config(void);
char* openblas_get_corename(void);
int openblas_get_parallel(void);
}

namespace keel {

namespace {
// Updated from the serial part of each thread that runs a model: two models on two threads add
// at once.
GemmStats g_stats;
std::mutex g_stats_mutex;
}  // namespace

GemmStats gemm_stats() {
  const std::lock_guard<std::mutex> lock(g_stats_mutex);
  return g_stats;
}
void gemm_stats_reset() {
  const std::lock_guard<std::mutex> lock(g_stats_mutex);
  g_stats = GemmStats{};
}

namespace {

// Runs a float GEMM, counting it in the statistics when it is called outside a parallel region.
template <typename Run>
void counted(int M, int N, int K, Run run) {
  const bool serial = !omp_in_parallel();
  const auto t0 = serial ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  run();
  if (serial) {
    const std::lock_guard<std::mutex> lock(g_stats_mutex);
    g_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g_stats.flops += 2.0 * M * N * K;
    g_stats.calls++;
  }
}

}  // namespace

template <>
void gemm<float>(MatmulPrecision precision, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                 const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  counted(M, N, K, [&] {
    if (precision == MatmulPrecision::bf16) {
      gemm_bf16(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else if (precision == MatmulPrecision::int8) {
      gemm_int8_dynamic(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {
      cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                  alpha, A, lda, B, ldb, beta, C, ldc);
    }
  });
}

void gemm_operands(MatmulPrecision precision, bool trans_a, bool trans_b, int M, int N, int K, float alpha, Operand A,
                   int lda, Operand B, int ldb, float beta, float* C, int ldc) {
  if (A.bf16 == nullptr && B.bf16 == nullptr) {
    gemm<float>(precision, trans_a, trans_b, M, N, K, alpha, A.f32, lda, B.f32, ldb, beta, C, ldc);
    return;
  }
  counted(M, N, K, [&] { gemm_bf16(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
}

template <>
void gemm<double>(MatmulPrecision, bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A,
                  int lda, const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
              alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm_weight<float>(MatmulPrecision precision, bool trans_w, int M, int N, int K, const float* A, int lda,
                        const float* W, int ldw, float beta, float* C, int ldc) {
  if (precision != MatmulPrecision::fp32 || !packed_weight_route(M, N, K)) {
    gemm<float>(precision, false, trans_w, M, N, K, 1.0f, A, lda, W, ldw, beta, C, ldc);
    return;
  }
  counted(M, N, K, [&] {
    if (!onednn_packed_weight_gemm(trans_w, M, N, K, A, lda, W, ldw, beta, C, ldc)) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_w ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda, W, ldw,
                  beta, C, ldc);
    }
  });
}

template <>
void gemm_weight<double>(MatmulPrecision precision, bool trans_w, int M, int N, int K, const double* A, int lda,
                         const double* W, int ldw, double beta, double* C, int ldc) {
  gemm<double>(precision, false, trans_w, M, N, K, 1.0, A, lda, W, ldw, beta, C, ldc);
}

std::string check_blas() {
  const std::string config = openblas_get_config();
  const int parallel = openblas_get_parallel();  // 0 sequential, 1 pthreads, 2 OpenMP
  check(parallel == 2, "BLAS: expected OpenBLAS built with OpenMP (libopenblas0-openmp), found " +
                           std::string(parallel == 1 ? "the pthreads build" : "a sequential build") + " (" +
                           config + "); run scripts/setup.sh");
  return config;
}

std::string blas_core() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  return std::string(openblas_get_corename()) + (forced != nullptr && *forced != '\0' ? " (OPENBLAS_CORETYPE)" : "");
}

std::string default_openmp_wait(const char* command) {
  const std::string c = command != nullptr ? command : "";
  return c == "generate" || c == "score" ? "GOMP_SPINCOUNT=10000" : "OMP_WAIT_POLICY=PASSIVE";
}

void prepare_compute_environment(char** argv) {
  bool changed = false;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    const std::string wait = default_openmp_wait(argv != nullptr && argv[0] != nullptr ? argv[1] : nullptr);
    const size_t eq = wait.find('=');
    ::setenv(wait.substr(0, eq).c_str(), wait.substr(eq + 1).c_str(), 1);
    changed = true;
  }
  // OpenBLAS's kernels for CPUs without AVX2 (what it falls back to on a CPU it does not know).
  static const std::set<std::string> kOlder = {"Katmai",  "Coppermine", "Northwood", "Prescott", "Banias",
                                               "Atom",    "Core2",      "Penryn",    "Dunnington", "Nehalem",
                                               "Opteron", "Opteron(SSE3)", "Barcelona", "Nano", "Sandybridge",
                                               "Bobcat",  "Bulldozer",  "Piledriver"};
  const std::string family = vector_kernel_family();
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && !family.empty() && kOlder.count(openblas_get_corename()) > 0) {
    ::setenv("OPENBLAS_CORETYPE", family.c_str(), 1);
    changed = true;
  }
  if (changed) ::execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
}

double measure_sgemm_gflops(int n, int repeats) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  // warm-up
  gemm<float>(MatmulPrecision::fp32, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  double best_s = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    gemm<float>(MatmulPrecision::fp32, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * n / best_s * 1e-9;
}

}  // namespace keel
