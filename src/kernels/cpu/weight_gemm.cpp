#include "kernels/cpu/weight_gemm.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <dnnl.hpp>
#include <tuple>

#include "kernels/cpu/onednn_cache.h"

namespace keel {

namespace {

constexpr int kMinRows = 512;
constexpr int64_t kMaxWeightFloats = int64_t{4} << 20;

// One product's primitives: the weight's reorder from its row-major layout into the matmul's, and
// the matmul on the packed weight.
struct PackedProduct {
  dnnl::reorder reorder;
  dnnl::matmul matmul;
  dnnl::memory::desc packed_desc;
  size_t scratchpad_bytes = 0;  // the larger of the two primitives' (each run with the caller's)
};

// trans_w, M, N, K, lda, ldw, ldc, beta
using Key = std::tuple<bool, int, int, int, int, int, int, float>;

onednn::Cache<Key, PackedProduct>& cache() {
  static onednn::Cache<Key, PackedProduct> instance;
  return instance;
}

}  // namespace

bool packed_weight_route(int M, int N, int K) {
  return M >= kMinRows && static_cast<int64_t>(N) * K <= kMaxWeightFloats && !omp_in_parallel();
}

bool onednn_packed_weight_gemm(bool trans_w, int M, int N, int K, const float* A, int lda, const float* W, int ldw,
                               float beta, float* C, int ldc) {
  using dnnl::memory;
  const memory::desc a_md({M, K}, memory::data_type::f32, memory::dims{lda, 1});
  const memory::desc w_md({K, N}, memory::data_type::f32, trans_w ? memory::dims{1, ldw} : memory::dims{ldw, 1});
  const memory::desc c_md({M, N}, memory::data_type::f32, memory::dims{ldc, 1});
  const dnnl::engine& engine = onednn::engine();
  const auto p = cache().get(Key{trans_w, M, N, K, lda, ldw, ldc, beta}, [&] {
    const memory::desc any(w_md.dims(), memory::data_type::f32, memory::format_tag::any);
    const dnnl::matmul::primitive_desc mpd(dnnl::matmul::desc(a_md, any, c_md), onednn::product_attr(1.0f, beta),
                                           engine);
    dnnl::primitive_attr reorder_attr;
    reorder_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::reorder::primitive_desc rpd(engine, w_md, engine, mpd.weights_desc(), reorder_attr);
    return PackedProduct{dnnl::reorder(rpd), dnnl::matmul(mpd), mpd.weights_desc(),
                         std::max(mpd.scratchpad_desc().get_size(), rpd.scratchpad_desc().get_size())};
  });
  if (!p) return false;
  dnnl::stream& stream = onednn::thread_stream();
  static thread_local onednn::Buffer packed, pad;
  const memory pad_mem = onednn::scratchpad(pad, p->scratchpad_bytes);
  memory w_mem(w_md, engine, const_cast<float*>(W)),
      packed_mem(p->packed_desc, engine, packed.get(p->packed_desc.get_size())),
      a_mem(a_md, engine, const_cast<float*>(A)), c_mem(c_md, engine, C);
  p->reorder.execute(stream, {{DNNL_ARG_FROM, w_mem}, {DNNL_ARG_TO, packed_mem}, {DNNL_ARG_SCRATCHPAD, pad_mem}});
  p->matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, packed_mem}, {DNNL_ARG_DST, c_mem},
                             {DNNL_ARG_SCRATCHPAD, pad_mem}});
  stream.wait();
  return true;
}

}  // namespace keel
