// bf16 training state (runtime.param_dtype / runtime.grad_dtype = "bf16") as residency: the
// model's working parameters and its gradients are held as bf16 bits, 2 bytes an element instead
// of the chunk store's 4, and a chunk's float32 page exists only while an operation leases it.
//
// Where each copy lives:
//   - bf16 bits of every chunk's parameters (param_dtype) and gradients (grad_dtype), always held:
//     the working state. A layer's lease widens the bits of its pages into the store's float32
//     planes at their usual addresses (the kernels are unchanged: they read and write float32);
//     when the last lease of a page ends, a written page is rounded back into the bits (round to
//     nearest even) and the float32 page is given back (zeroed, MADV_DONTNEED).
//   - float32 master weights of the chunks this rank updates (all of them without ZeRO; its
//     ZeRO-1/2 shard otherwise, the moments' chunks: the distributed-optimizer layout; with sharded
//     experts under ZeRO, comm/zero.h experts apart, a set of chunks spread over the store: its
//     share of the chunks of no expert and of its experts' chunks), held here beside the bits, one
//     run of consecutive owned chunks after another. AdamW updates a master in place
//     (update_at_home) and rounds it into the bits in the same pass. Every other rank's copy of
//     the chunk is its bits.
//   - A lease that is not a layer's (a checkpoint's write, a ZeRO owner's broadcast) widens an
//     owned parameter page from its master, so checkpoints hold float32 masters; a layer's lease
//     always reads the bits, so every rank computes with the same bf16 weights.
//   - A write to an owned parameter page under any lease (a loaded checkpoint) sets the master to
//     the written float32 values exactly (resume is exact) and the bits to their rounding.
// Gradients accumulate in bf16: every micro-batch's backward widens the page, adds in float32,
// and rounds once when the lease ends (PyTorch's bf16 .grad behaves so). Under ZeRO-2/3 the bits
// of the parts reduce-scattered to other ranks are given back (discard, MADV_DONTNEED), so that
// between steps a rank holds its own chunks' gradient bits only. Moments stay float32 in
// the store's planes (sharded by ZeRO-1/2 as before).
//
// Until settle() the float32 planes are the state (a model's initialisation and a checkpoint's
// load write them in place, leased or not); settle() turns them into bits and masters and gives
// the float32 pages back. Under ZeRO-3 the sharded parameters (comm/sharded_params.h) wrap this
// residency: a gather broadcasts the owner's bits into bits() before the layer's lease widens
// them, and another rank's bits are zeroed again when it is given back (discard).
//
// The planes it does not hold (the moments; float32 gradients under param_dtype alone) belong to
// the residency it wraps: the store's own, or the memory tiers' (wrap_attached), which then home
// and move the moments' pages (NVMe, host) while the bits and masters stay in this rank's memory
// (the tiers neither home nor count the held planes: TierOptions::absent_planes). In a pipeline
// each stage's ranks hold their stage's chunks so, and with tensor groups each rank its store of
// shards and replicated tensors (checkpoints gather the owners' masters into the whole model:
// comm/tensor_parallel.h WholeModelState). Not combined with a pipeline's re-cut, nor a mixture of
// experts over tensor groups (validate_bf16_state_config refuses them in one line each).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// bf16 state's combinations, checked with the job's configuration: one line naming the key for
// each that is refused (nothing to check when both dtypes are fp32).
void validate_bf16_state_config(const Config& c, int data_ranks);

class Bf16State final : public Residency {
 public:
  // Attaches itself to `store` (finalized, its own residency attached). `params`, `grads`: the
  // planes held in bf16. `master_chunks`: the ids, ascending, of the chunks whose float32 masters
  // this rank keeps (the chunks it updates; not necessarily consecutive). Holds nothing until
  // settle().
  Bf16State(ChunkStore& store, bool params, bool grads, const std::vector<int>& master_chunks);
  ~Bf16State() override;  // gives the store back its own residency

  // The residency the store was given after this one was attached (the memory tiers', built
  // later) becomes the one this wraps for the planes it does not hold, and this is attached
  // again in its place. Local.
  void wrap_attached();
  // The planes held (bit p: plane p), for TierOptions::absent_planes.
  uint8_t held_planes() const {
    return static_cast<uint8_t>((params_ ? 1 << static_cast<int>(Plane::param) : 0) |
                                (grads_ ? 1 << static_cast<int>(Plane::grad) : 0));
  }

  // The float32 planes as written so far (drawn, imported or loaded weights; zero gradients)
  // become the state: masters copied, bits rounded, the float32 pages given back. Once, after the
  // weights are in place and before the first step.
  void settle();
  bool settled() const { return settled_; }

  // Whether `plane` is held in bf16.
  bool holds(Plane plane) const {
    return (plane == Plane::param && params_) || (plane == Plane::grad && grads_);
  }
  // The bits of elements [offset, ...) of a held plane (every element has one, alignment gaps
  // included). They are current while no lease of the page is open.
  uint16_t* bits(Plane plane, int64_t offset) { return bits_of(plane).data() + offset; }
  // The bits of chunk `chunk` in `plane` were written from outside (a ZeRO owner's broadcast, a
  // ZeRO-3 gather, a reduction in bf16): its version moves on. Requires no lease of the page open.
  void bits_written(PageRef p) { versions_[index(p)]++; }
  // Bytes held: bf16 bits of a plane (0 when not held), and this rank's float32 masters.
  int64_t held_bytes(Plane plane) const { return holds(plane) ? static_cast<int64_t>(bits_of(plane).size()) * 2 : 0; }
  int64_t master_bytes() const { return static_cast<int64_t>(master_.size()) * 4; }
  // The bytes of a held plane's bits resident now (mincore; under ZeRO-3 the parameters' are a
  // rank's own chunks' and the gathered ones', not held_bytes()).
  int64_t resident_bytes(Plane plane) const;
  // The most float32 bytes of a held plane widened under leases at once since the last call (a
  // layer's lease: its pages, own and gathered), then restarted from what is widened now.
  int64_t take_peak_widened_bytes(Plane plane);

  // Residency: the held planes' pages as above; every other page as the wrapped residency.
  bool always_present() const override { return false; }
  void acquire(std::span<const PageRef> pages) override { take(pages, /*layer=*/false); }
  void acquire_layer(std::span<const PageRef> pages) override { take(pages, /*layer=*/true); }
  void release(std::span<const PageRef> pages, bool modified) override { put(pages, modified, /*layer=*/false); }
  void release_layer(std::span<const PageRef> pages, bool modified) override { put(pages, modified, /*layer=*/true); }
  int hint(std::span<const PageRef> pages) override;
  uint64_t version(PageRef p) const override { return holds(p.plane) ? versions_.at(index(p)) : inner_->version(p); }
  void zero(PageRef p, bool zeroed_in_place) override;
  void discard(Plane plane, int64_t offset, int64_t numel) override;
  bool updates_at_home(PageRef p) const override {
    if (!holds(p.plane)) return inner_->updates_at_home(p);
    return settled_ && p.plane == Plane::param && owned(p.chunk);
  }
  void update_at_home(PageRef p, const std::function<void(float* data, size_t n)>& update) override;
  bool known_sum_squares(PageRef p, double* out) const override {
    return !holds(p.plane) && inner_->known_sum_squares(p, out);
  }
  void step_shape_changed() override { inner_->step_shape_changed(); }

  // What it holds between steps (the bits of the held planes, the masters), copied out and put
  // back: a pipeline's post-validation keeps it before its optimistic step and restores it when
  // the step must be redone (with `grads`: the gradient bits too). Requires no lease open.
  struct Copy {
    std::vector<uint16_t> param_bits, grad_bits;
    std::vector<float> master;
  };
  void copy_into(Copy& copy) const;
  void restore(const Copy& copy, bool grads);

 private:
  static size_t index(PageRef p) { return static_cast<size_t>(p.chunk) * kNumPlanes + static_cast<size_t>(p.plane); }
  bool owned(int chunk) const { return master_at_[static_cast<size_t>(chunk)] >= 0; }
  // Zeroed bits (calloc): a large array is fresh pages that take no memory until written, so a
  // chunk whose float32 values are all zero at settle() (gradients, other ranks' ZeRO-3 chunks)
  // costs nothing.
  struct Bits {
    struct Free {
      void operator()(uint16_t* p) const { std::free(p); }
    };
    std::unique_ptr<uint16_t, Free> p;
    size_t n = 0;
    uint16_t* data() const { return p.get(); }
    size_t size() const { return n; }
    bool empty() const { return n == 0; }
    void allocate(size_t count);
  };
  Bits& bits_of(Plane plane) { return plane == Plane::param ? param_bits_ : grad_bits_; }
  const Bits& bits_of(Plane plane) const { return plane == Plane::param ? param_bits_ : grad_bits_; }
  float* master_of(int chunk);
  void take(std::span<const PageRef> pages, bool layer);
  void put(std::span<const PageRef> pages, bool modified, bool layer);
  // The page's float32 values into its bits (and, for an owned parameter page, its master).
  void store_page(PageRef p);
  void give_back(PageRef p);  // the float32 page zeroed and its memory returned

  ChunkStore& store_;
  Residency* inner_;  // the planes not held: the store's own residency, or the memory tiers'
  bool params_ = false, grads_ = false;
  // Where each chunk's master starts in master_ (-1: not this rank's). A run of consecutive owned
  // chunks is laid out as in the flat space (alignment gaps included), the runs one after another.
  std::vector<int64_t> master_at_;
  int64_t master_numel_ = 0;
  bool settled_ = false;
  Bits param_bits_, grad_bits_;
  std::vector<float> master_;
  std::vector<int> leases_;  // open leases per page
  int64_t widened_bytes_[2] = {}, peak_widened_bytes_[2] = {};  // float32 bytes leased, by plane (param, grad)
  std::vector<uint64_t> versions_;
};

}  // namespace keel
