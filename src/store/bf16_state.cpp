#include "store/bf16_state.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <utility>

#include <sys/mman.h>
#include <unistd.h>

#include "core/error.h"
#include "kernels/cpu/bf16.h"

namespace keel {

void validate_bf16_state_config(const Config& c, int /*data_ranks: every ZeRO stage combines*/) {
  const bool params = c.runtime.param_dtype == StateDtype::bf16, grads = c.runtime.grad_dtype == StateDtype::bf16;
  if (!params && !grads) return;
  const std::string key = params ? "runtime.param_dtype" : "runtime.grad_dtype";
  auto refuse = [&](bool bad, const std::string& what) {
    if (bad) throw Error("config key '" + key + "': \"bf16\" is not combined with " + what + " (not yet supported); use \"fp32\"");
  };
  refuse(c.clip.enabled(), "a dual encoder ([clip])");
  // A pipeline's re-cut builds the stages' state anew and migrates float32 planes into it.
  refuse(c.parallel.pipeline > 1 && c.parallel.repartition_every > 0, "a pipeline's re-cut (parallel.repartition_every > 0)");
  // Tensor groups: each rank's store holds its shards and the replicated tensors, leased by its
  // layers as any store's (WholeModelState gathers the owners' masters for checkpoints). A mixture
  // of experts over tensor groups is not built with bf16 state yet (experts_sharded's fallback).
  refuse(c.parallel.tensor > 1 && c.model.moe(),
         "parallel.tensor > 1 with a mixture of experts (model.moe_experts > 0)");
  // Compressed sync's codecs and error-feedback residuals work on float32 gradients; gradient
  // prediction reads and writes the whole float32 gradient plane outside any lease.
  refuse(c.sync.codec != SyncCodec::none,
         "sync.codec (compressed gradient sync: its codecs and residuals work on float32 gradients)");
  refuse(c.parallel.predict_gradients != PredictGradients::off,
         "parallel.predict_gradients (the predictor reads the float32 gradient plane whole)");
}

Bf16State::Bf16State(ChunkStore& store, bool params, bool grads, const std::vector<int>& master_chunks)
    // The store's own residency, whatever is attached now (ZeRO-3's sharded parameters, built
    // first, wrap this one: wrapping them back would be a cycle).
    : store_(store), inner_(store.own_residency_.get()), params_(params), grads_(grads) {
  check(store.finalized(), "bf16 state: a chunk store not finalized");
  const std::vector<Chunk>& chunks = store.chunks();
  leases_.assign(chunks.size() * kNumPlanes, 0);
  versions_.assign(chunks.size() * kNumPlanes, 0);
  master_at_.assign(chunks.size(), -1);
  for (size_t i = 0; i < master_chunks.size();) {
    size_t j = i + 1;  // the run of consecutive chunks [master_chunks[i], master_chunks[j - 1]]
    while (j < master_chunks.size() && master_chunks[j] == master_chunks[j - 1] + 1) ++j;
    check(master_chunks[i] >= 0 && master_chunks[j - 1] < static_cast<int>(chunks.size()) &&
              (j == master_chunks.size() || master_chunks[j] > master_chunks[j - 1]),
          "bf16 state: master chunks not ascending chunk ids of the store");
    const Chunk& first = chunks[static_cast<size_t>(master_chunks[i])];
    const Chunk& last = chunks[static_cast<size_t>(master_chunks[j - 1])];
    for (size_t k = i; k < j; ++k) {
      const int c = master_chunks[k];
      master_at_[static_cast<size_t>(c)] = master_numel_ + chunks[static_cast<size_t>(c)].offset - first.offset;
    }
    master_numel_ += last.offset + last.numel - first.offset;
    i = j;
  }
  store_.attach_residency(this);
}

Bf16State::~Bf16State() { store_.attach_residency(nullptr); }

void Bf16State::wrap_attached() {
  if (&store_.residency() == this) return;
  inner_ = &store_.residency();
  store_.attach_residency(this);
}

int Bf16State::hint(std::span<const PageRef> pages) {
  std::vector<PageRef> others;
  for (const PageRef& p : pages)
    if (!holds(p.plane)) others.push_back(p);
  return others.empty() ? 0 : inner_->hint(others);
}

int64_t Bf16State::resident_bytes(Plane plane) const {
  const Bits& b = bits_of(plane);
  if (b.empty()) return 0;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(b.data()) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(b.data() + b.size()) + page - 1) / page * page;
  std::vector<unsigned char> in_core((end - begin) / page);
  check(::mincore(reinterpret_cast<void*>(begin), end - begin, in_core.data()) == 0, "bf16 state: mincore failed");
  int64_t pages = 0;
  for (unsigned char c : in_core) pages += c & 1;
  return pages * static_cast<int64_t>(page);
}

int64_t Bf16State::take_peak_widened_bytes(Plane plane) {
  const int i = plane == Plane::param ? 0 : 1;
  const int64_t peak = peak_widened_bytes_[i];
  peak_widened_bytes_[i] = widened_bytes_[i];
  return peak;
}

float* Bf16State::master_of(int chunk) { return master_.data() + master_at_[static_cast<size_t>(chunk)]; }

void Bf16State::settle() {
  check(!settled_, "bf16 state: settled twice");
  const std::vector<Chunk>& chunks = store_.chunks();
  if (params_) {
    param_bits_.allocate(static_cast<size_t>(store_.numel()));
    master_.assign(static_cast<size_t>(master_numel_), 0.0f);
  }
  if (grads_) grad_bits_.allocate(static_cast<size_t>(store_.numel()));
  settled_ = true;
  for (const Chunk& c : chunks) {
    for (Plane plane : {Plane::param, Plane::grad}) {
      if (!holds(plane)) continue;
      // A page of zeros (gradients before the first step; under ZeRO-3 another rank's chunk,
      // never drawn here) has its bits and master already: neither is touched, so the start-up
      // holds bits of the chunks with values only. (Reading untouched float32 pages maps nothing.)
      const std::span<const float> f = std::as_const(store_).chunk_view(c.id, plane);
      const bool zeros = std::all_of(f.begin(), f.end(), [](float x) { return std::bit_cast<uint32_t>(x) == 0; });
      if (!zeros) store_page({c.id, plane});
      give_back({c.id, plane});
    }
  }
}

void Bf16State::Bits::allocate(size_t count) {
  p.reset(static_cast<uint16_t*>(std::calloc(std::max<size_t>(count, 1), sizeof(uint16_t))));
  check(p != nullptr, "bf16 state: out of memory for " + std::to_string(count) + " bf16 elements");
  n = count;
}

void Bf16State::store_page(PageRef p) {
  const Chunk& c = store_.chunks()[p.chunk];
  const float* f = store_.chunk_view(p.chunk, p.plane).data();
  uint16_t* b = bits(p.plane, c.offset);
  if (p.plane == Plane::param && owned(p.chunk)) std::memcpy(master_of(p.chunk), f, static_cast<size_t>(c.numel) * 4);
  to_bf16(b, f, c.numel);
}

void Bf16State::give_back(PageRef p) {
  const Chunk& c = store_.chunks()[p.chunk];
  store_.zero_and_release(p.plane, c.offset, c.numel);
}

void Bf16State::take(std::span<const PageRef> pages, bool layer) {
  std::vector<PageRef> others;
  for (const PageRef& p : pages)
    if (!holds(p.plane)) others.push_back(p);
  if (!others.empty()) layer ? inner_->acquire_layer(others) : inner_->acquire(others);
  if (!settled_) return;  // the float32 planes are the state until settle()
  for (const PageRef& p : pages) {
    if (!holds(p.plane) || leases_[index(p)]++ > 0) continue;
    const Chunk& c = store_.chunks()[p.chunk];
    const int w = p.plane == Plane::param ? 0 : 1;
    widened_bytes_[w] += c.numel * static_cast<int64_t>(sizeof(float));
    peak_widened_bytes_[w] = std::max(peak_widened_bytes_[w], widened_bytes_[w]);
    float* f = store_.chunk_view(p.chunk, p.plane).data();
    if (!layer && p.plane == Plane::param && owned(p.chunk)) {
      std::memcpy(f, master_of(p.chunk), static_cast<size_t>(c.numel) * 4);
      continue;
    }
    const uint16_t* b = bits(p.plane, c.offset);
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < c.numel; ++i) f[i] = from_bf16(b[i]);
  }
}

void Bf16State::put(std::span<const PageRef> pages, bool modified, bool layer) {
  std::vector<PageRef> others;
  for (const PageRef& p : pages)
    if (!holds(p.plane)) others.push_back(p);
  if (!others.empty()) layer ? inner_->release_layer(others, modified) : inner_->release(others, modified);
  for (const PageRef& p : pages) {
    if (!holds(p.plane)) continue;
    if (modified) versions_[index(p)]++;
    if (!settled_) continue;
    int& open = leases_[index(p)];
    check(open > 0, "bf16 state: a page released that was not acquired");
    // Written pages are stored when their last lease ends (the float32 page holds every write).
    if (modified) store_page(p);
    if (--open == 0) {
      give_back(p);
      const int64_t bytes = store_.chunks()[p.chunk].numel * static_cast<int64_t>(sizeof(float));
      widened_bytes_[p.plane == Plane::param ? 0 : 1] -= bytes;
    }
  }
}

void Bf16State::zero(PageRef p, bool zeroed_in_place) {
  if (!holds(p.plane)) {
    inner_->zero(p, zeroed_in_place);
    return;
  }
  versions_[index(p)]++;
  const Chunk& c = store_.chunks()[p.chunk];
  if (settled_) {
    uint16_t* b = bits(p.plane, c.offset);
    if (p.plane == Plane::grad && !owned(p.chunk)) {
      // Another rank's gradient under ZeRO-2/3 (its share was reduce-scattered away): its pages
      // go back until a backward writes them again.
      zero_and_give_back(b, static_cast<size_t>(c.numel) * sizeof(uint16_t));
    } else {
      std::fill(b, b + c.numel, uint16_t{0});
    }
    if (p.plane == Plane::param && owned(p.chunk)) std::fill(master_of(p.chunk), master_of(p.chunk) + c.numel, 0.0f);
    if (leases_[index(p)] == 0) return;  // no float32 page to clear
  }
  if (!zeroed_in_place) {
    std::span<float> v = store_.chunk_view(p.chunk, p.plane);
    std::fill(v.begin(), v.end(), 0.0f);
  }
}

void Bf16State::discard(Plane plane, int64_t offset, int64_t numel) {
  if (!holds(plane)) {
    inner_->discard(plane, offset, numel);
    return;
  }
  store_.zero_and_release(plane, offset, numel);
  for (const Chunk& c : store_.chunks_overlapping(offset, numel)) versions_[index({c.id, plane})]++;
  if (!settled_) return;
  // Parameters: ZeRO-3's other ranks' chunks, held only while gathered; gradients: the parts of a
  // bucket reduce-scattered to other ranks (ZeRO-2/3), or a skipped step's. Either way the pages
  // go back (zero when touched again: a gather, the next backward).
  zero_and_give_back(bits(plane, offset), static_cast<size_t>(numel) * sizeof(uint16_t));
  if (plane != Plane::param || master_.empty()) return;
  for (const Chunk& c : store_.chunks_overlapping(offset, numel)) {
    if (!owned(c.id)) continue;
    const int64_t lo = std::max(offset, c.offset), hi = std::min(offset + numel, c.offset + c.numel);
    if (lo < hi) std::fill(master_of(c.id) + (lo - c.offset), master_of(c.id) + (hi - c.offset), 0.0f);
  }
}

void Bf16State::copy_into(Copy& copy) const {
  check(settled_, "bf16 state: copied before it settled");
  auto bits = [](const Bits& b, std::vector<uint16_t>& out) { out.assign(b.data(), b.data() + b.size()); };
  if (params_) bits(param_bits_, copy.param_bits);
  if (grads_) bits(grad_bits_, copy.grad_bits);
  copy.master = master_;
}

void Bf16State::restore(const Copy& copy, bool grads) {
  check(std::all_of(leases_.begin(), leases_.end(), [](int open) { return open == 0; }),
        "bf16 state: restored with a lease open");
  for (Plane plane : {Plane::param, Plane::grad}) {
    if (!holds(plane) || (plane == Plane::grad && !grads)) continue;
    const std::vector<uint16_t>& from = plane == Plane::param ? copy.param_bits : copy.grad_bits;
    check(from.size() == bits_of(plane).size(), "bf16 state: a copy of another layout restored");
    std::copy(from.begin(), from.end(), bits_of(plane).data());
    for (const Chunk& c : store_.chunks()) versions_[index({c.id, plane})]++;
  }
  if (params_) master_ = copy.master;
}

void Bf16State::update_at_home(PageRef p, const std::function<void(float* data, size_t n)>& update) {
  if (!holds(p.plane)) {
    inner_->update_at_home(p, update);
    return;
  }
  versions_[index(p)]++;
  const Chunk& c = store_.chunks()[p.chunk];
  if (!updates_at_home(p)) {
    std::span<float> v = store_.chunk_view(p.chunk, p.plane);
    update(v.data(), v.size());
    return;
  }
  float* m = master_of(p.chunk);
  update(m, static_cast<size_t>(c.numel));
  to_bf16(bits(Plane::param, c.offset), m, c.numel);
  // A float32 page leased meanwhile (none is, in the optimizer's pass) would be stale: refresh it.
  if (leases_[index(p)] > 0) {
    float* f = store_.chunk_view(p.chunk, Plane::param).data();
    const uint16_t* b = bits(Plane::param, c.offset);
    for (int64_t i = 0; i < c.numel; ++i) f[i] = from_bf16(b[i]);
  }
}

}  // namespace keel
