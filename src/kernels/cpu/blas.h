// Thin typed wrappers over CBLAS (OpenBLAS, OpenMP build) so kernels can be templated on
// float (training) and double (finite-difference tests), plus the start-up check that the fast
// BLAS is the one in use.
#pragma once

#include <string>

#include "kernels/cpu/bf16.h"

namespace keel {

// Row-major C[M,N] = alpha * op(A) * op(B) + beta * C, op = transpose when trans_* is true, in
// the arithmetic `precision` names for float (kernels/cpu/bf16.h). double (the finite-difference
// references) always multiplies in float64; its callers pass MatmulPrecision::fp32.
template <typename T>
void gemm(MatmulPrecision precision, bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda,
          const T* B, int ldb, T beta, T* C, int ldc);

// float GEMM whose operands may be bf16 bits (activations stored in bf16, model/layer_util.h):
// with a bf16 operand, the bf16 product (kernels/cpu/bf16.h) whatever `precision` says;
// with two float32 operands, gemm<float> at `precision`.
void gemm_operands(MatmulPrecision precision, bool trans_a, bool trans_b, int M, int N, int K, float alpha, Operand A,
                   int lda, Operand B, int ldb, float beta, float* C, int ldc);

// Time and FLOPs spent in GEMM calls made outside OpenMP parallel regions (the dense layers;
// attention's per-head products run inside a parallel region and are not counted). For benchmarks.
struct GemmStats {
  double flops = 0;
  double seconds = 0;
  long long calls = 0;
};
GemmStats gemm_stats();
void gemm_stats_reset();

// Throws keel::Error unless the linked BLAS is OpenBLAS built with OpenMP (a netlib or pthread
// build is 40x slower or fights our OpenMP threads). Returns OpenBLAS's configuration string.
std::string check_blas();

// The kernels OpenBLAS runs on (its core name, e.g. "SkylakeX"), and whether Keel chose them
// (OPENBLAS_CORETYPE, set by prepare_compute_environment) or OpenBLAS did.
std::string blas_core();

// Sets what the OpenMP runtime and OpenBLAS read only when they load, and re-executes the process
// once (execv of /proc/self/exe with the same argv) when anything was set; call it first thing in
// main (keel's, and the tests'):
//   - unless the environment names a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT), the one
//     default_openmp_wait gives for the command;
//   - OPENBLAS_CORETYPE, unless set, when OpenBLAS chose kernels older than the CPU's vector
//     units (core/cpu.h vector_kernel_family): OpenBLAS 0.3.21 runs its SSE3 "Prescott" kernels on
//     CPUs it does not know (seen: an Intel Xeon of family 6, model 207, with AVX-512 and bf16,
//     SGEMM 6.5 GFLOP/s on one core against 37 with its SkylakeX kernels).
// Returns only when nothing needed setting (or the re-execution failed: then it runs as it is).
void prepare_compute_environment(char** argv);

// The OpenMP wait setting ("NAME=VALUE") Keel starts `command` (argv[1], or null) with when the
// environment names none: "GOMP_SPINCOUNT=10000" for generate and score (a decode step is many
// short parallel regions: threads that sleep at once pay a futex wake and a context switch per
// region, measured 6.5x slower at batch 32), else "OMP_WAIT_POLICY=PASSIVE" (threads that spin
// while waiting halve training throughput on a busy machine; a spin of 10,000 rounds is bounded).
std::string default_openmp_wait(const char* command);

// Measures single-precision GEMM throughput (GFLOP/s) on an n^3 product with the current threads.
double measure_sgemm_gflops(int n = 1024, int repeats = 3);

}  // namespace keel
