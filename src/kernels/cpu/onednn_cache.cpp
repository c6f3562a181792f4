#include "kernels/cpu/onednn_cache.h"

#include <algorithm>
#include <cstdlib>

namespace keel::onednn {

const dnnl::engine& engine() {
  static const dnnl::engine instance(dnnl::engine::kind::cpu, 0);
  return instance;
}

dnnl::stream& thread_stream() {
  static thread_local dnnl::stream stream(engine());
  return stream;
}

Buffer::~Buffer() { std::free(data_); }

void* Buffer::get(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  if (bytes > bytes_) {
    std::free(data_);
    bytes_ = (bytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, bytes_);
  }
  return data_;
}

dnnl::primitive_attr product_attr(float alpha, float beta) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  return attr;
}

dnnl::memory scratchpad(Buffer& buffer, size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  const dnnl::memory::desc md({static_cast<dnnl::memory::dim>(bytes)}, dnnl::memory::data_type::u8,
                              dnnl::memory::dims{1});
  return dnnl::memory(md, engine(), buffer.get(bytes));
}

}  // namespace keel::onednn
