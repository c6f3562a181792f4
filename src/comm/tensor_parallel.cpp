#include "comm/tensor_parallel.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>

#include "core/error.h"
#include "model/model_layout.h"
#include "store/placement.h"

namespace keel {

void MpiTensorGroup::count_ms(std::chrono::steady_clock::time_point start) {
  if (counting_) ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

void MpiTensorGroup::allreduce_sum(float* data, int64_t count) {
  if (counting_) bytes_ += count * static_cast<int64_t>(sizeof(float));
  const auto start = std::chrono::steady_clock::now();
  comm_.allreduce_sum(data, static_cast<size_t>(count));
  count_ms(start);
}

void MpiTensorGroup::allreduce_max(float* data, int64_t count) {
  if (counting_) bytes_ += count * static_cast<int64_t>(sizeof(double));
  scratch_.assign(data, data + count);
  const auto start = std::chrono::steady_clock::now();
  comm_.allreduce_max(scratch_.data(), static_cast<size_t>(count));
  count_ms(start);
  std::copy(scratch_.begin(), scratch_.end(), data);  // (maxima of floats: exact in double)
}

void MpiTensorGroup::allgather(float* data, int64_t count) {
  const int T = comm_.size();
  if (counting_) gather_bytes_ += T * count * static_cast<int64_t>(sizeof(float));
  check(T * count <= std::numeric_limits<int>::max(), "tensor parallelism: an all-gather too large for one MPI call");
  std::vector<int> counts(T, static_cast<int>(count)), displs(T);
  for (int r = 0; r < T; ++r) displs[r] = r * static_cast<int>(count);
  const auto start = std::chrono::steady_clock::now();
  comm_.allgatherv(data, counts, displs);
  count_ms(start);
}

void MpiTensorGroup::reduce_scatter_sum(float* data, int64_t count) {
  const int T = comm_.size();
  if (counting_) scatter_bytes_ += T * count * static_cast<int64_t>(sizeof(float));
  check(T * count <= std::numeric_limits<int>::max(),
        "tensor parallelism: a reduce-scatter too large for one MPI call");
  const auto start = std::chrono::steady_clock::now();
  Communicator::Request request = comm_.ireduce_scatter_sum(data, std::vector<int>(T, static_cast<int>(count)));
  comm_.wait(request);
  count_ms(start);
}

void validate_tensor_parallel_config(const Config& c) {
  const int T = c.parallel.tensor;
  check(!c.parallel.sequence_parallel || T > 1, "config key 'parallel.sequence_parallel': expected false with "
                                                "parallel.tensor = 1 (it shards the tensor group's rows), found true");
  if (T <= 1) return;
  const std::string found = std::to_string(T);
  check(!c.clip.enabled(), "config key 'parallel.tensor': expected 1 with clip.image_tower (a dual encoder's towers "
                           "are not split over ranks), found " + found);
  const std::string problem = tensor_parallel_problem(c.model, T);
  check(problem.empty(), "config key 'parallel.tensor': " + problem + ", found " + found);
  // Not yet combined with tensor parallelism (each a later piece of work, not a silent fallback).
  auto not_yet = [&](bool ok, const std::string& key, const std::string& value) {
    check(ok, "config key '" + key + "': expected its default with parallel.tensor > 1 (not yet supported together), "
              "found " + value);
  };
  if (c.parallel.pipeline > 1) {
    // A pipeline of tensor groups: the gradient predictor's per-element state is not built for
    // shards yet. (A re-cut moves each tensor rank's shards between the ranks of its pipeline
    // group; post-validation copies and restores a rank's own shards.)
    not_yet(c.parallel.predict_gradients == PredictGradients::off, "parallel.predict_gradients",
            "\"" + std::string(to_string(c.parallel.predict_gradients)) + "\"");
  }
  if (c.parallel.sequence_parallel) {
    // Every micro-batch's B x T token rows cut into T equal parts (a curriculum's every length;
    // with context parallelism the rank's B x T / context rows, its chunks of each sequence).
    const int context = std::max(1, c.parallel.context);
    std::vector<int> lengths{c.train.seq_len};
    for (const auto& [step, len] : c.train.seq_len_steps()) lengths.push_back(len);
    for (int len : lengths) {
      check(static_cast<int64_t>(c.train.batch_size) * (len / context) % T == 0,
            "config key 'train.batch_size': expected batch_size x seq_len" +
                (context > 1 ? " / parallel.context (" + std::to_string(c.train.batch_size) + " x " +
                                   std::to_string(len) + " / " + std::to_string(context) + ")"
                             : " (" + std::to_string(c.train.batch_size) + " x " + std::to_string(len) + ")") +
                " divisible by parallel.tensor with parallel.sequence_parallel, found " +
                std::to_string(c.train.batch_size));
    }
  }
}

double tensor_grad_squares(GPT& model, Communicator& tensor, Communicator* experts) {
  ChunkStore& store = model.store();
  const ModelLayout& layout = model.layout();
  double sums[3] = {0, 0, 0};  // split tensors (this rank's shard), routed experts' (with `experts`), replicated ones
  for (size_t k = 0; k < layout.tensors.size(); ++k) {
    if (layout.tensors[k].replica) continue;  // counted at home
    const PageLease use = store.use_tensor(model.tensor_ids()[k], {Plane::grad});
    double s = 0;
    for (float g : store.view(model.tensor_ids()[k], Plane::grad)) s += static_cast<double>(g) * g;
    sums[!layout.shards[k].split()                                    ? 2
         : experts != nullptr && layout.tensors[k].expert >= 0 ? 1
                                                                : 0] += s;
  }
  if (experts == nullptr) return tensor.allreduce_sum(sums[0]) + sums[2];
  tensor.allreduce_sum(sums, 2);
  return sums[0] + experts->allreduce_sum(sums[1]) + sums[2];
}

void tensor_share_replicated_grads(GPT& model, Communicator& tensor) {
  ChunkStore& store = model.store();
  const ModelLayout& layout = model.layout();
  std::vector<size_t> replicated;
  int64_t total = 0;
  for (size_t k = 0; k < layout.tensors.size(); ++k) {
    if (layout.shards[k].split()) continue;
    replicated.push_back(k);
    total += store.tensors()[model.tensor_ids()[k]].numel;
  }
  std::vector<float> buffer(static_cast<size_t>(total));
  auto each = [&](bool into_buffer) {
    int64_t at = 0;
    for (size_t k : replicated) {
      const TensorId id = model.tensor_ids()[k];
      const PageLease use = into_buffer ? store.use_tensor(id, {Plane::grad}) : store.use_tensor(id, {}, {Plane::grad});
      const std::span<float> g = store.view(id, Plane::grad);
      if (into_buffer) {
        std::copy(g.begin(), g.end(), buffer.begin() + at);
      } else {
        std::copy_n(buffer.begin() + at, g.size(), g.begin());
      }
      at += static_cast<int64_t>(g.size());
    }
  };
  if (tensor.rank() == 0) each(true);
  tensor.broadcast(buffer.data(), buffer.size(), 0);
  if (tensor.rank() != 0) each(false);
}

double tensor_grad_share(GPT& model, int tensor_rank, const std::function<bool(int chunk)>& owned) {
  ChunkStore& store = model.store();
  const ModelLayout& layout = model.layout();
  std::vector<signed char> split(store.tensors().size(), 0);  // by store tensor id
  for (size_t k = 0; k < layout.tensors.size(); ++k) split[model.tensor_ids()[k]] = layout.shards[k].split() ? 1 : 0;
  double share = 0;
  for (const Chunk& chunk : store.chunks()) {
    const int c = chunk.id;
    if (chunk.replica || !owned(c)) continue;  // (replicas: counted at home)
    const PageLease use = store.use_chunk(c, {Plane::grad});
    for (const Segment& seg : chunk.segments) {
      if (!split[seg.tensor] && tensor_rank != 0) continue;
      double s = 0;
      for (float g : std::as_const(store).range_view(Plane::grad, seg.offset, seg.numel)) s += static_cast<double>(g) * g;
      share += s;
    }
  }
  return share;
}

WholeModelState::WholeModelState(const Config& config, Communicator& tensor, GPT& model, Communicator* data,
                                 const ChunkPartition* moments, ExpertPlace experts)
    : tensor_(tensor),
      model_(model),
      data_(moments != nullptr ? data : nullptr),
      moments_(data != nullptr ? moments : nullptr),
      params_sharded_(moments_ != nullptr && config.parallel.zero == 3),
      params_from_owners_(params_sharded_ || (moments_ != nullptr && config.runtime.param_dtype == StateDtype::bf16)),
      whole_(std::make_unique<ChunkStore>(config.store.chunk_bytes)) {
  // The unsplit tensors of this rank's layers (a pipeline stage's: the whole model's chunks of
  // its layers, as a stage's checkpoints are written; sharded experts: its own experts').
  whole_ids_ = register_layout(*whole_, model_layout(config.model, model.ranges(), {}, experts));
  whole_->finalize(/*touch_params=*/false);
  if (moments_ != nullptr && moments_->experts_apart()) {
    const int P = moments_->expert_group;
    if (data_->size() > P) holders_ = data_->split(data_->rank() % P, data_->rank() / P);
  }
}

void WholeModelState::copy_owned(Plane plane, std::vector<float>& flat, bool into_flat) {
  ChunkStore& shards = model_.store();
  for (const Chunk& c : shards.chunks()) {
    if (!moments_->owns(data_->rank(), c)) continue;
    const PageLease use = shards.use_range(plane, c.offset, c.numel, /*write=*/!into_flat);
    const std::span<float> own = shards.range_view(plane, c.offset, c.numel);
    if (into_flat) {
      std::copy(own.begin(), own.end(), flat.begin() + c.offset);
    } else {
      std::copy_n(flat.begin() + c.offset, own.size(), own.begin());
    }
  }
}

void WholeModelState::gather_experts_apart(std::vector<float>& flat) {
  // `flat` holds this rank's owned chunks of both kinds (copy_owned). Each rank's range of the
  // data group's tiling holds the chunks of no expert it owns, so one all-gather over the data
  // group completes them; the expert chunks it brings are the range owners' experts, not
  // necessarily this rank's: those come from their owners among the holders (expert tiling),
  // or are all this rank's own when it alone holds them (data == P).
  std::vector<float> experts = flat;
  data_->allgatherv(flat.data(), moments_->counts(), moments_->displs());
  if (holders_) {
    const std::vector<int64_t>& begin = moments_->expert_begin;
    std::vector<int> counts(begin.size() - 1), displs(begin.size() - 1);
    for (size_t q = 0; q + 1 < begin.size(); ++q) {
      counts[q] = static_cast<int>(begin[q + 1] - begin[q]);
      displs[q] = static_cast<int>(begin[q]);
    }
    holders_->allgatherv(experts.data(), counts, displs);
  }
  for (const Chunk& c : model_.store().chunks()) {
    if (c.expert >= 0) std::copy_n(experts.begin() + c.offset, c.numel, flat.begin() + c.offset);
  }
}

namespace {
int plane_slot(Plane plane) { return plane == Plane::adam_m ? 0 : plane == Plane::adam_v ? 1 : 2; }
}  // namespace

float* WholeModelState::gathered_plane(Plane plane, bool params) {
  if (moments_ == nullptr || (plane == Plane::param && !params)) return nullptr;
  return planes_[plane_slot(plane)].data();
}

void WholeModelState::gather() {
  ChunkStore& shards = model_.store();
  shards.apply_pending();
  const ModelLayout& layout = model_.layout();
  const int T = tensor_.size();
  // ZeRO: first every chunk's moments from their owners, and (ZeRO-3; bf16 parameters, whose
  // float32 masters only the owner keeps) its parameters: read under a lease that is not a layer's,
  // an owned chunk's bf16 state gives its master (store/bf16_state.h), so checkpoints hold masters.
  if (moments_ != nullptr) {
    const int me = data_->rank();
    for (Plane plane : {Plane::adam_m, Plane::adam_v, Plane::param}) {
      if (plane == Plane::param && !params_from_owners_) continue;
      std::vector<float>& all = planes_[plane_slot(plane)];
      all.assign(static_cast<size_t>(moments_->begin.back()), 0.0f);
      if (moments_->experts_apart()) {  // (not one range: comm/zero.h)
        copy_owned(plane, all, /*into_flat=*/true);
        gather_experts_apart(all);
        continue;
      }
      const PageLease use = shards.use_range(plane, moments_->begin[me], moments_->size(me), false);
      const std::span<const float> own = std::as_const(shards).range_view(plane, moments_->begin[me], moments_->size(me));
      std::copy(own.begin(), own.end(), all.begin() + moments_->begin[me]);
      data_->allgatherv(all.data(), moments_->counts(), moments_->displs());
    }
  }
  for (size_t k = 0; k < layout.tensors.size(); ++k) {
    const TensorShard& shard = layout.shards[k];
    const TensorId mine = model_.tensor_ids()[k];
    // The planes read from the store, through its residency (under memory tiers a page may be
    // homed on the host or NVMe tier; under bf16 state an owned chunk's parameters are its master);
    // under ZeRO the moments come from the gathered planes, under ZeRO-3 (a rank may not touch
    // other ranks' chunks outside a layer's pass) and with bf16 parameters the parameters too.
    const PageLease use = params_from_owners_ ? PageLease()
                          : moments_ != nullptr ? shards.use_tensor(mine, {Plane::param})
                                                : shards.use_tensor(mine, {Plane::param, Plane::adam_m, Plane::adam_v});
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      const float* gathered = gathered_plane(plane, params_from_owners_);
      const TensorInfo& info = shards.tensors()[mine];
      std::span<const float> part = gathered != nullptr ? std::span<const float>(gathered + info.offset, info.numel)
                                                        : std::as_const(shards).view(mine, plane);
      std::span<float> whole = whole_->view(whole_ids_[k], plane);
      if (!shard.split()) {
        std::copy(part.begin(), part.end(), whole.begin());
        continue;
      }
      const int n = static_cast<int>(part.size());
      buffer_.resize(static_cast<size_t>(n) * T);
      std::copy(part.begin(), part.end(), buffer_.begin() + static_cast<int64_t>(n) * tensor_.rank());
      std::vector<int> counts(T, n), displs(T);
      for (int r = 0; r < T; ++r) displs[r] = r * n;
      tensor_.allgatherv(buffer_.data(), counts, displs);
      for (int r = 0; r < T; ++r) place_shard(shard, TensorPlace{r, T}, buffer_.data() + displs[r], whole.data());
    }
  }
  // Replicated tensors (norms, biases of row-parallel products, the position table) see the same
  // gradients on every rank of the group by construction, hence the same updates: checked here,
  // at every checkpoint, on a hash of their bits (two 32-bit halves: exact in double).
  uint64_t hash = 1469598103934665603ull;
  const float* params = gathered_plane(Plane::param, params_from_owners_);  // (the gathered parameters)
  for (size_t k = 0; k < layout.tensors.size(); ++k) {
    if (layout.shards[k].split()) continue;
    const TensorInfo& info = shards.tensors()[model_.tensor_ids()[k]];
    const PageLease use = params != nullptr ? PageLease() : shards.use_tensor(model_.tensor_ids()[k], {Plane::param});
    for (float v : params != nullptr ? std::span<const float>(params + info.offset, info.numel)
                                     : std::as_const(shards).view(model_.tensor_ids()[k], Plane::param)) {
      hash = (hash ^ std::bit_cast<uint32_t>(v)) * 1099511628211ull;
    }
  }
  double halves[4] = {static_cast<double>(hash >> 32), static_cast<double>(hash & 0xffffffffu),
                      -static_cast<double>(hash >> 32), -static_cast<double>(hash & 0xffffffffu)};
  tensor_.allreduce_max(halves, 4);
  check(halves[0] == -halves[2] && halves[1] == -halves[3],
        "tensor parallelism: the replicated parameters (norms, biases, position table) differ between the ranks of a "
        "tensor group");
  uint64_t version = 0;
  for (const Chunk& c : shards.chunks()) version = std::max(version, c.version);
  for (const Chunk& c : whole_->chunks()) whole_->set_version(c.id, version);
}

void WholeModelState::scatter() {
  ChunkStore& shards = model_.store();
  const ModelLayout& layout = model_.layout();
  // ZeRO: the moments (ZeRO-3: and parameters) are sliced into planes of the whole flat space, of
  // which this rank keeps its own chunks'.
  if (moments_ != nullptr) {
    for (int k = 0; k < (params_sharded_ ? 3 : 2); ++k) {
      planes_[k].assign(static_cast<size_t>(moments_->begin.back()), 0.0f);
    }
  }
  for (size_t k = 0; k < layout.tensors.size(); ++k) {
    const TensorId mine = model_.tensor_ids()[k];
    const PageLease use = params_sharded_     ? PageLease()
                          : moments_ != nullptr ? shards.use_tensor(mine, {}, {Plane::param})
                                                : shards.use_tensor(mine, {}, {Plane::param, Plane::adam_m, Plane::adam_v});
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      std::span<const float> whole = std::as_const(*whole_).view(whole_ids_[k], plane);
      // (ZeRO-1/2 with bf16 parameters: every chunk written here, an owned one's master exactly,
      // the others' as their bf16 rounding, the bits their owner's update broadcasts.)
      float* gathered = gathered_plane(plane, params_sharded_);
      float* out = gathered != nullptr ? gathered + shards.tensors()[mine].offset : shards.view(mine, plane).data();
      slice_shard(layout.shards[k], layout.place, whole.data(), out);
    }
  }
  if (moments_ != nullptr) {
    const int me = data_->rank();
    for (Plane plane : {Plane::adam_m, Plane::adam_v, Plane::param}) {
      if (plane == Plane::param && !params_sharded_) continue;
      if (moments_->experts_apart()) {
        copy_owned(plane, planes_[plane_slot(plane)], /*into_flat=*/false);
        continue;
      }
      const PageLease use = shards.use_range(plane, moments_->begin[me], moments_->size(me), true);
      const std::span<float> own = shards.range_view(plane, moments_->begin[me], moments_->size(me));
      std::copy_n(planes_[plane_slot(plane)].begin() + moments_->begin[me], own.size(), own.begin());
    }
  }
  uint64_t version = 0;
  for (const Chunk& c : whole_->chunks()) version = std::max(version, c.version);
  for (const Chunk& c : shards.chunks()) shards.set_version(c.id, version);
}

}  // namespace keel
