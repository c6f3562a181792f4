#include "kernels/cpu/bf16.h"

#include <cblas.h>
#include <cpuid.h>
#include <omp.h>

#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

namespace keel {

namespace {

MatmulPrecision g_precision = MatmulPrecision::fp32;

// Rounds rows x cols of src (leading dimension ld) to bf16 into dst (compact, leading dimension
// cols), as float values or as bf16 bits. In parallel unless already inside a parallel region.
template <typename Out, typename Convert>
void pack(Out* dst, const float* src, int rows, int cols, int ld, Convert convert) {
  const bool outer = !omp_in_parallel();
#pragma omp parallel for schedule(static) if (outer)
  for (int r = 0; r < rows; ++r) {
    const float* s = src + static_cast<int64_t>(r) * ld;
    Out* d = dst + static_cast<int64_t>(r) * cols;
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

struct OneDnn {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::map<Key, std::shared_ptr<dnnl::matmul>> cache;  // null: no implementation for that key
};

OneDnn& onednn() {
  static OneDnn instance;
  return instance;
}

// The primitive for one shape and layout, created on first use (nullptr where oneDNN has none).
std::shared_ptr<dnnl::matmul> primitive(const Key& key, const dnnl::memory::desc& a, const dnnl::memory::desc& b,
                                        const dnnl::memory::desc& c, float alpha, float beta) {
  OneDnn& o = onednn();
  std::lock_guard<std::mutex> lock(o.mutex);
  const auto it = o.cache.find(key);
  if (it != o.cache.end()) return it->second;
  std::shared_ptr<dnnl::matmul> p;
  try {
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, o.engine);
    p = std::make_shared<dnnl::matmul>(pd);
  } catch (const dnnl::error&) {
    p = nullptr;
  }
  o.cache.emplace(key, p);
  return p;
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

void set_matmul_precision(MatmulPrecision p) { g_precision = p; }
MatmulPrecision matmul_precision() { return g_precision; }

bool cpu_has_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0) return false;
  return (a & (1u << 5)) != 0;  // AVX512_BF16
}

std::string bf16_engine() {
  return bf16_through_onednn() ? "oneDNN bf16 matmul (AVX512_BF16)"
                               : "emulated: operands rounded to bf16, float32 products and sums through SGEMM "
                                 "(this CPU has no bf16 instructions)";
}

bool onednn_gemm(const char* dt, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  using dnnl::memory;
  const bool bf16 = std::string(dt) == "bf16";
  const memory::data_type type = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  // bf16 operands are packed first (compact, in their stored orientation); f32 ones are used in place.
  const int a_ld = bf16 ? (trans_a ? M : K) : lda, b_ld = bf16 ? (trans_b ? K : N) : ldb;
  const memory::desc a_md({M, K}, type, trans_a ? memory::dims{1, a_ld} : memory::dims{a_ld, 1});
  const memory::desc b_md({K, N}, type, trans_b ? memory::dims{1, b_ld} : memory::dims{b_ld, 1});
  const memory::desc c_md({M, N}, memory::data_type::f32, memory::dims{ldc, 1});
  const Key key{dt, trans_a, trans_b, M, N, K, a_ld, b_ld, ldc, alpha, beta};
  const std::shared_ptr<dnnl::matmul> p = primitive(key, a_md, b_md, c_md, alpha, beta);
  if (!p) return false;
  const void* a_data = A;
  const void* b_data = B;
  if (bf16) {
    static thread_local std::vector<uint16_t> a_buf, b_buf;
    uint16_t* pa = scratch(a_buf, static_cast<size_t>(M) * K);
    uint16_t* pb = scratch(b_buf, static_cast<size_t>(K) * N);
    pack(pa, A, trans_a ? K : M, trans_a ? M : K, lda, to_bf16);
    pack(pb, B, trans_b ? N : K, trans_b ? K : N, ldb, to_bf16);
    a_data = pa, b_data = pb;
  }
  OneDnn& o = onednn();
  static thread_local dnnl::stream stream(onednn().engine);
  memory a_mem(a_md, o.engine, const_cast<void*>(a_data)), b_mem(b_md, o.engine, const_cast<void*>(b_data)),
      c_mem(c_md, o.engine, C);
  p->execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
  stream.wait();
  return true;
}

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc) {
  if (bf16_through_onednn() && onednn_gemm("bf16", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
    return;
  }
  static thread_local std::vector<float> a_buf, b_buf;
  const int a_rows = trans_a ? K : M, a_cols = trans_a ? M : K, b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  float* pa = scratch(a_buf, static_cast<size_t>(a_rows) * a_cols);
  float* pb = scratch(b_buf, static_cast<size_t>(b_rows) * b_cols);
  pack(pa, A, a_rows, a_cols, lda, round_to_bf16);
  pack(pb, B, b_rows, b_cols, ldb, round_to_bf16);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              pa, a_cols, pb, b_cols, beta, C, ldc);
}

}  // namespace keel
