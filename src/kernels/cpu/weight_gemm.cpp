#include "kernels/cpu/weight_gemm.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

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

struct Cache {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::map<Key, std::shared_ptr<PackedProduct>> products;  // null: no implementation for that key
};

Cache& cache() {
  static Cache instance;
  return instance;
}

std::shared_ptr<PackedProduct> product(const Key& key, const dnnl::memory::desc& a, const dnnl::memory::desc& w,
                                       const dnnl::memory::desc& c, float beta) {
  using dnnl::memory;
  Cache& k = cache();
  std::lock_guard<std::mutex> lock(k.mutex);
  const auto it = k.products.find(key);
  if (it != k.products.end()) return it->second;
  std::shared_ptr<PackedProduct> p;
  try {
    // Scratchpads are the caller's (one buffer per thread): oneDNN's library-managed one is not
    // safe to share between concurrent executions (models may run on concurrent threads).
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const memory::desc any(w.dims(), memory::data_type::f32, memory::format_tag::any);
    const dnnl::matmul::primitive_desc mpd(dnnl::matmul::desc(a, any, c), attr, k.engine);
    dnnl::primitive_attr reorder_attr;
    reorder_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::reorder::primitive_desc rpd(k.engine, w, k.engine, mpd.weights_desc(), reorder_attr);
    p = std::make_shared<PackedProduct>(PackedProduct{
        dnnl::reorder(rpd), dnnl::matmul(mpd), mpd.weights_desc(),
        std::max(mpd.scratchpad_desc().get_size(), rpd.scratchpad_desc().get_size())});
  } catch (const dnnl::error&) {
    p = nullptr;
  }
  k.products.emplace(key, p);
  return p;
}

// A per-thread buffer, 64-byte aligned, grown as needed (kept for the thread's next product).
class Buffer {
 public:
  ~Buffer() { std::free(data_); }
  void* get(size_t bytes) {
    if (bytes > bytes_) {
      std::free(data_);
      bytes_ = (bytes + 63) / 64 * 64;
      data_ = std::aligned_alloc(64, bytes_);
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

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
  const std::shared_ptr<PackedProduct> p = product(Key{trans_w, M, N, K, lda, ldw, ldc, beta}, a_md, w_md, c_md, beta);
  if (!p) return false;
  const dnnl::engine& engine = cache().engine;
  static thread_local dnnl::stream stream(cache().engine);
  static thread_local Buffer packed, pad;
  const memory::desc pad_md({static_cast<memory::dim>(std::max<size_t>(p->scratchpad_bytes, 1))},
                            memory::data_type::u8, memory::dims{1});
  memory w_mem(w_md, engine, const_cast<float*>(W)), packed_mem(p->packed_desc, engine, packed.get(p->packed_desc.get_size())),
      a_mem(a_md, engine, const_cast<float*>(A)), c_mem(c_md, engine, C),
      pad_mem(pad_md, engine, pad.get(pad_md.get_size()));
  p->reorder.execute(stream, {{DNNL_ARG_FROM, w_mem}, {DNNL_ARG_TO, packed_mem}, {DNNL_ARG_SCRATCHPAD, pad_mem}});
  p->matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, packed_mem}, {DNNL_ARG_DST, c_mem},
                             {DNNL_ARG_SCRATCHPAD, pad_mem}});
  stream.wait();
  return true;
}

}  // namespace keel
