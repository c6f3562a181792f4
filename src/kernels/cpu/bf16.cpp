#include "kernels/cpu/bf16.h"

#include <cblas.h>
#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <dnnl.hpp>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/onednn_cache.h"

namespace keel {

namespace {

// Converts rows x cols of src (leading dimension ld) into dst (compact, leading dimension cols).
// In parallel unless already inside a parallel region.
template <typename Out, typename In, typename Convert>
void pack(Out* dst, const In* src, int rows, int cols, int ld, Convert convert) {
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int r = 0; r < rows; ++r) {
    const In* s = src + static_cast<int64_t>(r) * ld;
    Out* d = dst + static_cast<int64_t>(r) * cols;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = convert(s[c]);
  }
}

// Scratch per thread (attention's products run inside a parallel region, one head per thread).
template <typename T>
T* scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

using Key = std::tuple<std::string, bool, bool, int, int, int, int, int, int, float, float>;

// A cached primitive (kernels/cpu/onednn_cache.h) and the scratchpad bytes it needs. Its
// scratchpad is the caller's (one buffer per thread): primitives run concurrently from attention's
// per-head threads.
struct Primitive {
  dnnl::matmul matmul;
  size_t scratchpad_bytes = 0;
};

onednn::Cache<Key, Primitive>& primitives() {
  static onednn::Cache<Key, Primitive> instance;
  return instance;
}

// The primitive for one shape and layout, created on first use (nullptr where oneDNN has none).
std::shared_ptr<const Primitive> primitive(const Key& key, const dnnl::memory::desc& a, const dnnl::memory::desc& b,
                                           const dnnl::memory::desc& c, float alpha, float beta) {
  return primitives().get(key, [&] {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), onednn::product_attr(alpha, beta),
                                          onednn::engine());
    return Primitive{dnnl::matmul(pd), pd.scratchpad_desc().get_size()};
  });
}

bool bf16_through_onednn() {
  static const bool yes = [] {
    if (!cpu_has_bf16()) return false;
    // A probe: some oneDNN builds lack bf16 kernels even where the CPU has the instructions.
    std::vector<float> a(16 * 16, 1.0f), b(a), c(a.size());
    return onednn_gemm("bf16", false, false, 16, 16, 16, 1.0f, a.data(), 16, b.data(), 16, 0.0f, c.data(), 16);
  }();
  return yes;
}

}  // namespace

bool cpu_has_bf16() {
  // Asked once: CPUID is slow (in a virtual machine, a trip to the hypervisor) and the convolutions
  // ask on every call.
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0) return false;
    return (a & (1u << 5)) != 0;  // AVX512_BF16
  }();
  return yes;
}

std::string bf16_engine() {
  if (!bf16_through_onednn()) {
    return "emulated: operands rounded to bf16, float32 products and sums through SGEMM "
           "(this CPU has no bf16 instructions)";
  }
  // The widest instruction set oneDNN dispatches to here (the CPU's, less what ONEDNN_MAX_CPU_ISA
  // withholds): with AMX its bf16 products run on the tile units (brgemm avx512_core_amx_bf16).
  const unsigned isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const unsigned amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (isa & amx) == amx ? "oneDNN bf16 matmul (AMX-BF16)" : "oneDNN bf16 matmul (AVX512_BF16)";
}

namespace {

// oneDNN's matmul on operands of type `dt`: float32 ones used in place; for bf16, operands
// already in bf16 used in place, float32 ones rounded into compact per-thread buffers first.
bool onednn_run(const char* dt, bool trans_a, bool trans_b, int M, int N, int K, float alpha, Operand A, int lda,
                Operand B, int ldb, float beta, float* C, int ldc) {
  using dnnl::memory;
  const bool bf16 = std::string(dt) == "bf16";
  if (!bf16 && (A.bf16 != nullptr || B.bf16 != nullptr)) return false;
  const memory::data_type type = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  const bool pack_a = bf16 && A.bf16 == nullptr, pack_b = bf16 && B.bf16 == nullptr;
  const int a_ld = pack_a ? (trans_a ? M : K) : lda, b_ld = pack_b ? (trans_b ? K : N) : ldb;
  const memory::desc a_md({M, K}, type, trans_a ? memory::dims{1, a_ld} : memory::dims{a_ld, 1});
  const memory::desc b_md({K, N}, type, trans_b ? memory::dims{1, b_ld} : memory::dims{b_ld, 1});
  const memory::desc c_md({M, N}, memory::data_type::f32, memory::dims{ldc, 1});
  const Key key{dt, trans_a, trans_b, M, N, K, a_ld, b_ld, ldc, alpha, beta};
  const std::shared_ptr<const Primitive> p = primitive(key, a_md, b_md, c_md, alpha, beta);
  if (!p) return false;
  const void* a_data = A.bf16 != nullptr ? static_cast<const void*>(A.bf16) : A.f32;
  const void* b_data = B.bf16 != nullptr ? static_cast<const void*>(B.bf16) : B.f32;
  static thread_local std::vector<uint16_t> a_buf, b_buf;
  if (pack_a) {
    uint16_t* pa = scratch(a_buf, static_cast<size_t>(M) * K);
    pack(pa, A.f32, trans_a ? K : M, trans_a ? M : K, lda, [](float x) { return to_bf16(x); });
    a_data = pa;
  }
  if (pack_b) {
    uint16_t* pb = scratch(b_buf, static_cast<size_t>(K) * N);
    pack(pb, B.f32, trans_b ? N : K, trans_b ? K : N, ldb, [](float x) { return to_bf16(x); });
    b_data = pb;
  }
  const dnnl::engine& engine = onednn::engine();
  dnnl::stream& stream = onednn::thread_stream();
  static thread_local onednn::Buffer pad;
  memory a_mem(a_md, engine, const_cast<void*>(a_data)), b_mem(b_md, engine, const_cast<void*>(b_data)),
      c_mem(c_md, engine, C);
  p->matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem},
                             {DNNL_ARG_SCRATCHPAD, onednn::scratchpad(pad, p->scratchpad_bytes)}});
  stream.wait();
  return true;
}

// One operand as compact float32 bf16 values for the emulation: rounded, or widened from bits.
const float* emulated_operand(std::vector<float>& buffer, Operand x, int rows, int cols, int ld) {
  float* d = scratch(buffer, static_cast<size_t>(rows) * cols);
  if (x.bf16 != nullptr) {
    pack(d, x.bf16, rows, cols, ld, [](uint16_t b) { return from_bf16(b); });
  } else {
    pack(d, x.f32, rows, cols, ld, [](float v) { return round_to_bf16(v); });
  }
  return d;
}

// One product (or one K panel of one) in bf16: oneDNN where it can, else the emulation.
void gemm_bf16_panel(bool trans_a, bool trans_b, int M, int N, int K, float alpha, Operand A, int lda, Operand B,
                     int ldb, float beta, float* C, int ldc) {
  if (bf16_through_onednn() && onednn_run("bf16", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
    return;
  }
  static thread_local std::vector<float> a_buf, b_buf;
  const int a_rows = trans_a ? K : M, a_cols = trans_a ? M : K, b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  const float* pa = emulated_operand(a_buf, A, a_rows, a_cols, lda);
  const float* pb = emulated_operand(b_buf, B, b_rows, b_cols, ldb);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              pa, a_cols, pb, b_cols, beta, C, ldc);
}

}  // namespace

void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  const bool outer = !omp_in_parallel();
#pragma omp parallel for simd schedule(static) if (outer)
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

bool onednn_gemm(const char* dt, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  return onednn_run(dt, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, Operand A, int lda, Operand B, int ldb,
               float beta, float* C, int ldc) {
  // The products run in K panels where the operands rounded into per-thread buffers would
  // exceed a limit. Only the operands that are rounded count: one already in bf16 (a weight's bf16
  // copy) is read in place, and cutting it into K panels would hand oneDNN a strided weight, which
  // its AMX matmul (brgemm) declines (the GPT-2 LM head's forward then ran on gemm:jit at a
  // quarter of the rate: 930 of a 5,700 ms step at B=8 T=512). 32 M bf16 elements (64 MB a buffer)
  // leave a step's activations at GPT-2 124M 8x512 whole (8 M cut the MLP's and qkv's gradients
  // into two panels each: ~1 % of the step, two interleaved pairs on the AMX Xeon); the emulation
  // widens both operands into float buffers and keeps 8 M.
  const bool onednn = bf16_through_onednn();
  const int64_t limit = onednn ? int64_t{32} << 20 : int64_t{8} << 20;
  const int64_t rounded = (onednn && A.bf16 != nullptr ? 0 : int64_t{M}) + (onednn && B.bf16 != nullptr ? 0 : int64_t{N});
  const int64_t fit = rounded == 0 ? K : limit / rounded;
  const int kc = fit >= K ? K : static_cast<int>(std::max<int64_t>(fit, 256));
  for (int k0 = 0; k0 < K; k0 += kc) {
    const int k = std::min(kc, K - k0);
    const Operand a = A.offset(trans_a ? static_cast<int64_t>(k0) * lda : k0);
    const Operand b = B.offset(trans_b ? k0 : static_cast<int64_t>(k0) * ldb);
    gemm_bf16_panel(trans_a, trans_b, M, N, k, alpha, a, lda, b, ldb, k0 == 0 ? beta : 1.0f, C, ldc);
  }
}

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc) {
  gemm_bf16(trans_a, trans_b, M, N, K, alpha, Operand(A), lda, Operand(B), ldb, beta, C, ldc);
}

}  // namespace keel
