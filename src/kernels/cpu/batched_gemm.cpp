#include "kernels/cpu/batched_gemm.h"

#include <tuple>

#include "kernels/cpu/onednn_cache.h"

namespace keel {

namespace {

struct BatchedProduct {
  dnnl::matmul matmul;
  dnnl::memory::desc a, b, c;
  size_t scratchpad_bytes = 0;
};

using Strides = std::tuple<int64_t, int64_t, int64_t, int64_t>;
// B, H, M, N, K, alpha, beta, the three operands' strides
using Key = std::tuple<int, int, int, int, int, float, float, Strides, Strides, Strides>;

Strides strides(const HeadMatrices& m) { return {m.batch_stride, m.head_stride, m.row_stride, m.col_stride}; }

dnnl::memory::desc desc(int B, int H, int rows, int cols, const HeadMatrices& m) {
  using dnnl::memory;
  return memory::desc({B, H, rows, cols}, memory::data_type::f32,
                      memory::dims{m.batch_stride, m.head_stride, m.row_stride, m.col_stride});
}

onednn::Cache<Key, BatchedProduct>& cache() {
  static onednn::Cache<Key, BatchedProduct> instance;
  return instance;
}

}  // namespace

bool batched_head_gemm(int B, int H, int M, int N, int K, float alpha, const HeadMatrices& A, const HeadMatrices& Bm,
                       float beta, const HeadMatrices& C) {
  const Key key{B, H, M, N, K, alpha, beta, strides(A), strides(Bm), strides(C)};
  const auto p = cache().get(key, [&] {
    const dnnl::memory::desc a = desc(B, H, M, K, A), b = desc(B, H, K, N, Bm), c = desc(B, H, M, N, C);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), onednn::product_attr(alpha, beta),
                                          onednn::engine());
    return BatchedProduct{dnnl::matmul(pd), a, b, c, pd.scratchpad_desc().get_size()};
  });
  if (!p) return false;
  const dnnl::engine& engine = onednn::engine();
  static thread_local onednn::Buffer pad;
  dnnl::memory a_mem(p->a, engine, const_cast<float*>(A.data)), b_mem(p->b, engine, const_cast<float*>(Bm.data)),
      c_mem(p->c, engine, const_cast<float*>(C.data));
  dnnl::stream& stream = onednn::thread_stream();
  p->matmul.execute(stream, {{DNNL_ARG_SRC, a_mem},
                             {DNNL_ARG_WEIGHTS, b_mem},
                             {DNNL_ARG_DST, c_mem},
                             {DNNL_ARG_SCRATCHPAD, onednn::scratchpad(pad, p->scratchpad_bytes)}});
  stream.wait();
  return true;
}

}  // namespace keel
