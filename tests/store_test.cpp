#include "store/chunk_store.h"

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "kernels/cpu/bf16.h"
#include "model/gpt.h"
#include "optim/adamw.h"

namespace keel {
namespace {

ModelConfig tiny_model() {
  ModelConfig m;
  m.n_layer = 3;
  m.n_head = 2;
  m.n_embd = 32;
  m.vocab_size = 100;
  m.padded_vocab_size = 128;
  m.max_seq_len = 16;
  return m;
}

TEST(ChunkStore, ChunksRespectCapacityLayersAndKinds) {
  for (int64_t chunk_bytes : {4096, 8192, 1 << 20}) {
    ChunkStore store(chunk_bytes);
    GPT model(tiny_model(), store);
    store.finalize();
    int64_t expected_offset = 0;
    for (const Chunk& c : store.chunks()) {
      EXPECT_GE(c.offset, expected_offset);
      EXPECT_LE(c.numel * 4, chunk_bytes) << "chunk " << c.id;
      EXPECT_EQ(c.offset % 16, 0);
      for (const Segment& s : c.segments) {
        const TensorSpec& spec = store.tensors()[s.tensor].spec;
        EXPECT_EQ(spec.layer, c.layer) << spec.name;
        EXPECT_EQ(spec.kind, c.kind) << spec.name;
        EXPECT_GE(s.offset, c.offset);
        EXPECT_LE(s.offset + s.numel, c.offset + c.numel);
      }
      expected_offset = c.offset + c.numel;
    }
  }
}

TEST(ChunkStore, SegmentsCoverEveryTensorExactlyOnce) {
  ChunkStore store(4096);  // small: the 128x32 embedding spans several chunks
  GPT model(tiny_model(), store);
  store.finalize();
  std::map<int, int64_t> covered;
  for (const Chunk& c : store.chunks()) {
    for (const Segment& s : c.segments) {
      const TensorInfo& t = store.tensors()[s.tensor];
      EXPECT_EQ(s.offset, t.offset + s.tensor_offset);
      EXPECT_EQ(s.tensor_offset, covered[s.tensor]) << t.spec.name << " pieces out of order";
      covered[s.tensor] += s.numel;
    }
  }
  int64_t total = 0;
  for (size_t i = 0; i < store.tensors().size(); ++i) {
    EXPECT_EQ(covered[static_cast<int>(i)], store.tensors()[i].numel) << store.tensors()[i].spec.name;
    total += store.tensors()[i].numel;
  }
  EXPECT_EQ(total, store.param_count());
  EXPECT_GT(store.chunks().size(), 3u * 4);  // at least 4 per block (2 norm, attention, ffn)
}

TEST(ChunkStore, ViewsAreAlignedAndDistinctPerPlane) {
  ChunkStore store(8192);
  GPT model(tiny_model(), store);
  store.finalize();
  for (size_t i = 0; i < store.tensors().size(); ++i) {
    for (Plane p : {Plane::param, Plane::grad, Plane::adam_m, Plane::adam_v}) {
      auto v = store.view(static_cast<TensorId>(i), p);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 64, 0u);
      EXPECT_EQ(static_cast<int64_t>(v.size()), store.tensors()[i].numel);
    }
  }
  store.view(0, Plane::param)[0] = 1.0f;
  EXPECT_EQ(store.view(0, Plane::grad)[0], 0.0f);
}

TEST(ChunkStore, KindsAndDecayFollowTheModel) {
  ChunkStore store(1 << 20);
  GPT model(tiny_model(), store);
  store.finalize();
  EXPECT_EQ(store.tensors()[store.find("wte")].spec.kind, ChunkKind::embedding);
  EXPECT_EQ(store.tensors()[store.find("h.0.attn.qkv.w")].spec.kind, ChunkKind::attention);
  EXPECT_EQ(store.tensors()[store.find("h.2.mlp.fc.w")].spec.kind, ChunkKind::ffn);
  EXPECT_EQ(store.tensors()[store.find("h.1.ln2.w")].spec.kind, ChunkKind::norm);
  EXPECT_EQ(store.tensors()[store.find("lnf.b")].spec.layer, 4);
  EXPECT_TRUE(store.tensors()[store.find("h.0.mlp.proj.w")].spec.decay);
  EXPECT_FALSE(store.tensors()[store.find("h.0.mlp.proj.b")].spec.decay);
  EXPECT_FALSE(store.tensors()[store.find("h.0.ln1.w")].spec.decay);
  EXPECT_THROW(store.find("nope"), Error);
}

TEST(ChunkStore, AccessCountsAndVersions) {
  ChunkStore store(4096);
  GPT model(tiny_model(), store);
  store.finalize();
  (void)store.use_layer(1, {Plane::param});
  for (const Chunk& c : store.chunks()) EXPECT_EQ(c.accesses, c.layer == 1 ? 1u : 0u);
  store.bump_version(0);
  store.bump_version(0);
  EXPECT_EQ(store.chunks()[0].version, 2u);
}

TEST(ChunkStore, RejectsBadChunkSizeAndLateTensors) {
  EXPECT_THROW(ChunkStore(1000), Error);
  ChunkStore store(4096);
  store.add(TensorSpec{"a", {4}, 0, ChunkKind::norm, false});
  store.finalize();
  EXPECT_THROW(store.add(TensorSpec{"b", {4}, 0, ChunkKind::norm, false}), Error);
}

// Pages of [begin, end) that are resident, by mincore().
int64_t resident_pages(const float* begin, const float* end) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) / page * page;
  const size_t length = reinterpret_cast<uintptr_t>(end) - first;
  std::vector<unsigned char> vec((length + page - 1) / page);
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(first), length, vec.data()), 0);
  int64_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

TEST(ChunkStore, DiscardZeroesTheRangeAndReturnsItsPages) {
  ChunkStore store(1 << 22);
  const TensorId t = store.add(TensorSpec{"w", {1 << 21}, 0, ChunkKind::ffn, true});  // 8 MiB
  store.finalize();
  std::span<float> g = store.view(t, Plane::grad);
  EXPECT_EQ(resident_pages(g.data(), g.data() + g.size()), 0) << "gradients are mapped lazily";
  std::fill(g.begin(), g.end(), 1.0f);
  const int64_t page_floats = ::sysconf(_SC_PAGESIZE) / 4;
  const int64_t lo = 100, hi = static_cast<int64_t>(g.size()) - 300;  // not page aligned
  store.discard(Plane::grad, store.tensors()[t].offset + lo, hi - lo);
  // Whole pages inside the range are gone before anything reads them...
  const int64_t inner = (hi / page_floats) - (lo / page_floats + 1);
  EXPECT_EQ(resident_pages(g.data() + (lo / page_floats + 1) * page_floats, g.data() + (hi / page_floats) * page_floats), 0);
  EXPECT_GT(inner, 1000);
  // ...and every element reads as it should: zero inside, untouched outside.
  for (int64_t i = 0; i < static_cast<int64_t>(g.size()); ++i) {
    ASSERT_EQ(g[i], (i >= lo && i < hi) ? 0.0f : 1.0f) << i;
  }
  // A discarded range is written again like any other memory.
  g[lo + 5000] = 2.0f;
  EXPECT_EQ(g[lo + 5000], 2.0f);
  EXPECT_THROW(store.discard(Plane::grad, -1, 10), Error);
}

// The bf16 copy of a tensor's parameters is to_bf16 of their current values whatever wrote them:
// the optimizer (which writes the copy in its own pass), a write under a lease, a version set
// from outside (a checkpoint's) after a write without a lease; never a copy made before.
TEST(ChunkStore, Bf16CopiesFollowEveryWriteOfTheParameters) {
  ChunkStore store(4096);
  const TensorId w = store.add(TensorSpec{"w", {40, 50}, 0, ChunkKind::ffn, true});  // spans chunks
  const TensorId b = store.add(TensorSpec{"b", {50}, 0, ChunkKind::ffn, false});
  store.finalize();
  auto set = [&](TensorId id, float scale) {
    std::span<float> p = store.view(id, Plane::param);
    for (size_t i = 0; i < p.size(); ++i) p[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  };
  auto expect_current = [&](const std::string& when) {
    const uint16_t* bits = store.bf16_params(w);
    ASSERT_NE(bits, nullptr) << when;
    const std::span<const float> p = store.view(w, Plane::param);
    for (size_t i = 0; i < p.size(); ++i) ASSERT_EQ(bits[i], to_bf16(p[i])) << when << ": element " << i;
  };
  ASSERT_GT(store.chunks().size(), 1u);
  set(w, 1.0f);
  set(b, 1.0f);
  expect_current("first use");

  // AdamW writes the copy of the chunks that feed products in its own pass: the plane holds the
  // new bits before anything asks for them.
  for (float& g : store.range_view(Plane::grad, 0, store.numel())) g = 0.5f;
  AdamW(OptimConfig{}).step(store, 1e-2, 1, 1.0f);
  const std::span<const float> p = store.view(w, Plane::param);
  const int64_t first = store.tensors()[w].offset;
  for (const Chunk& c : store.chunks()) {
    const bool holds_w =
        std::any_of(c.segments.begin(), c.segments.end(), [&](const Segment& s) { return s.tensor == w; });
    const uint16_t* plane = store.bf16_chunk_to_write(c.id);
    EXPECT_EQ(plane != nullptr, holds_w) << "chunk " << c.id << ": a copy kept only where a product reads one";
    if (plane == nullptr) continue;
    for (const Segment& s : c.segments) {
      if (s.tensor != w) continue;
      for (int64_t i = 0; i < s.numel; ++i) {
        ASSERT_EQ(plane[s.offset - c.offset + i], to_bf16(p[s.offset - first + i])) << "chunk " << c.id << " " << i;
      }
    }
  }
  expect_current("after an optimizer step");

  {  // a write under a lease
    const PageLease use = store.use_tensor(w, {}, {Plane::param});
    set(w, 2.0f);
  }
  expect_current("after a write under a lease");

  // A write without a lease, then the chunks' versions set to what they were (a checkpoint
  // loaded at the copy's own version).
  set(w, 3.0f);
  for (const Chunk& c : store.chunks()) store.set_version(c.id, c.version);
  expect_current("after set_version");

  store.discard(Plane::param, 0, store.numel());
  expect_current("after a discard");

  store.set_bf16_copies(false);
  EXPECT_EQ(store.bf16_params(w), nullptr);
}

}  // namespace
}  // namespace keel
