#include "model/moe.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "core/error.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "model/model_layout.h"

namespace keel {

MoeFeedForward::MoeFeedForward(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids,
                               MathMode math, TensorGroup* tensor)
    : store_(store),
      math_(math),
      tp_(tensor),
      C_(m.n_embd),
      E_(m.moe_experts),
      K_(m.moe_top_k),
      Hm_(m.moe_hidden / (tensor ? tensor->size() : 1)),
      S_(m.moe_shared_experts * m.moe_hidden / (tensor ? tensor->size() : 1)),
      capacity_factor_(m.moe_capacity),
      aux_weight_(m.moe_aux_weight),
      t_(ids),
      local_experts_(m.moe_experts),
      first_expert_(0) {
  const size_t experts_at = layout::moe_expert_tensor(S_ > 0, 0, layout::expert_gate_up_w);
  // Every expert's tensors, or (an expert group's rank: set_expert_group) its share's.
  const size_t held = ids.size() > experts_at ? (ids.size() - experts_at) / layout::expert_tensors : 0;
  check(held >= 1 && ids.size() == experts_at + held * layout::expert_tensors && E_ % held == 0 &&
            m.moe_hidden % (tensor ? tensor->size() : 1) == 0,
        "GPT: mixture-of-experts block " + std::to_string(layer) + " without its tensors");
  held_experts_ = static_cast<int>(held);
  expert_ids_.assign(ids.begin() + static_cast<std::ptrdiff_t>(experts_at), ids.end());
  stats_.layer = layer;
  stats_.tokens.assign(E_, 0.0);
  if (m.moe_balance == MoeBalance::bias) {
    bias_.assign(E_, 0.0f);
    load_.assign(E_, 0.0);
  }
}

void MoeFeedForward::set_expert_group(ExpertGroup* group) {
  ep_ = group;
  const int P = group ? group->size() : 1;
  check(E_ % P == 0, "mixture of experts: " + std::to_string(E_) + " experts over an expert group of " +
                         std::to_string(P) + " ranks (parallel.expert must divide model.moe_experts)");
  local_experts_ = E_ / P;
  first_expert_ = group ? group->rank() * local_experts_ : 0;
  check(held_experts_ == local_experts_ || held_experts_ == E_,
        "mixture of experts: a block holding " + std::to_string(held_experts_) + " experts in an expert group of " +
            std::to_string(P) + " ranks (expected " + std::to_string(local_experts_) + " or all " +
            std::to_string(E_) + ")");
  expert_counts_.assign(E_, 0);
  for (auto* v : {&send_bytes_, &send_displs_, &recv_bytes_, &recv_displs_}) v->assign(P, 0);
}

// An anonymous mapping: its pages take memory only once written (MAP_NORESERVE: the worst case
// is address space, not a commitment).
struct MoeFeedForward::ExpertSide {
  float* base = nullptr;
  size_t bytes = 0;
  explicit ExpertSide(size_t n) : bytes(n) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    check(p != MAP_FAILED, "mixture of experts: could not map " + std::to_string(bytes) + " bytes for the experts' rows");
    base = static_cast<float*>(p);
  }
  ~ExpertSide() { ::munmap(base, bytes); }
  ExpertSide(const ExpertSide&) = delete;
  ExpertSide& operator=(const ExpertSide&) = delete;
};

MoeActivations MoeFeedForward::carve(model_detail::Carver& kept, int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T, M = N * K_;
  auto ints = [&](int64_t n) { return reinterpret_cast<int32_t*>(kept.take(n)); };
  static_assert(sizeof(int32_t) == sizeof(float));
  MoeActivations a;
  a.probs = kept.take(N * E_);
  a.choice = ints(N * K_);
  a.slot = ints(N * K_);
  a.rows = ints(M);
  a.offsets = ints(E_ + 1);
  a.xs = kept.take(M * C_);
  a.ye = kept.take(M * C_);
  a.dye = kept.take(M * C_);  // with an expert group, then the sorted rows' input gradient
  a.dlogits = kept.take(N * E_);
  a.tmp = kept.take(N * std::max(C_, S_));  // the shared MLP's hidden gradient
  a.gus = kept.take(N * 2 * S_);
  a.hs = kept.take(N * S_);
  a.dgus = kept.take(N * 2 * S_);
  // The rows the experts' products run over: this rank's M sorted rows, or with an expert group
  // the experts' side, up to every rank's rows (Mr = P N k), in the slot's own mapping.
  auto rows = [&](model_detail::Carver& at, int64_t R) {
    a.gu = at.take(R * 2 * Hm_);
    a.h = at.take(R * Hm_);
    a.dgu = at.take(R * 2 * Hm_);
    a.dh = at.take(R * std::max(Hm_, C_));  // dh, then the (expert group: this rank's) rows' input gradient
  };
  if (!ep_) {
    rows(kept, M);
    return a;
  }
  a.recv_counts = ints(static_cast<int64_t>(ep_->size()) * local_experts_);
  a.local_offsets = ints(local_experts_ + 1);
  const int64_t Mr = M * ep_->size();
  auto side_rows = [&](model_detail::Carver& at) {
    rows(at, Mr);
    a.xr = at.take(Mr * C_);
    a.yr = at.take(Mr * C_);
    a.dyr = at.take(Mr * C_);
    a.wire = at.take(Mr * C_);
  };
  model_detail::Carver count(nullptr);
  side_rows(count);
  if (a.probs == nullptr) {  // (sizing the slot: the experts' side is not part of it)
    a.gu = a.h = a.dgu = a.dh = a.xr = a.yr = a.dyr = a.wire = nullptr;
    return a;
  }
  const size_t bytes = static_cast<size_t>(count.used()) * sizeof(float);
  std::shared_ptr<ExpertSide>& side = sides_[a.probs];
  if (!side || side->bytes != bytes) side = std::make_shared<ExpertSide>(bytes);
  model_detail::Carver at(side->base);
  side_rows(at);
  return a;
}

int64_t MoeFeedForward::expert_side_resident_bytes() const {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  int64_t resident = 0;
  for (const auto& [slot, side] : sides_) {
    std::vector<unsigned char> in_core((side->bytes + page - 1) / page);
    check(::mincore(side->base, side->bytes, in_core.data()) == 0, "mixture of experts: mincore failed");
    for (unsigned char c : in_core) resident += (c & 1) * static_cast<int64_t>(page);
  }
  return resident;
}

int64_t MoeFeedForward::expert_side_reserved_bytes() const {
  int64_t bytes = 0;
  for (const auto& [slot, side] : sides_) bytes += static_cast<int64_t>(side->bytes);
  return bytes;
}

// ---- expert parallelism: the sorted rows out to their experts' ranks and back ----------------------
// Rank q of the group holds experts q El .. (q + 1) El - 1, so the rows a rank sends to q are the
// contiguous rows of those experts in its sorted order. What q receives from rank p arrives in p's
// order (by expert) after the rows of ranks before p; q's products want them by expert: expert e's
// rows from rank 0, then rank 1, ... (local_offsets). Row order within an expert changes nothing a
// row's products compute; the weight gradients sum an expert's rows in that order.

void MoeFeedForward::exchange_counts(const MoeActivations& a) {
  const int P = ep_->size(), El = local_experts_;
  for (int e = 0; e < E_; ++e) expert_counts_[e] = a.offsets[e + 1] - a.offsets[e];
  std::vector<int> bytes(P, El * static_cast<int>(sizeof(int32_t))), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = q * bytes[q];
  ep_->start_exchange(expert_counts_.data(), bytes, displs, a.recv_counts, bytes, displs);
  ep_->finish_exchange();
  a.local_offsets[0] = 0;
  for (int e = 0; e < El; ++e) {
    int32_t rows = 0;
    for (int p = 0; p < P; ++p) rows += a.recv_counts[p * El + e];
    a.local_offsets[e + 1] = a.local_offsets[e] + rows;
  }
}

namespace {

// Copies rows between rank order (rank p's rows of expert e after all rows of ranks before p and
// p's rows of experts before e) and expert order (local_offsets), `width` floats a row.
void reorder_rows(float* dst, const float* src, const int32_t* counts, const int32_t* local_offsets, int P, int El,
                  int width, bool to_expert_order) {
  std::vector<int64_t> filled(El, 0);  // rows of each expert placed so far (ranks before p)
  int64_t at = 0;                     // rank order's row
  for (int p = 0; p < P; ++p) {
    for (int e = 0; e < El; ++e) {
      const int64_t n = counts[p * El + e], expert_row = local_offsets[e] + filled[e];
      const int64_t from = to_expert_order ? at : expert_row, to = to_expert_order ? expert_row : at;
      std::memcpy(dst + to * width, src + from * width, sizeof(float) * n * width);
      filled[e] += n;
      at += n;
    }
  }
}

int byte_count(int64_t rows, int width) {
  const int64_t bytes = rows * width * static_cast<int64_t>(sizeof(float));
  check(bytes <= INT32_MAX, "mixture of experts: an expert exchange of " + std::to_string(bytes) +
                                " bytes (MPI counts stop at 2^31; use smaller micro-batches)");
  return static_cast<int>(bytes);
}

}  // namespace

void MoeFeedForward::plan_exchange(const MoeActivations& a, int width) {
  const int P = ep_->size(), El = local_experts_;
  int64_t received = 0;
  for (int q = 0; q < P; ++q) {
    send_displs_[q] = byte_count(a.offsets[q * El], width);
    send_bytes_[q] = byte_count(a.offsets[(q + 1) * El] - a.offsets[q * El], width);
    int64_t from_q = 0;
    for (int e = 0; e < El; ++e) from_q += a.recv_counts[q * El + e];
    recv_displs_[q] = byte_count(received, width);
    recv_bytes_[q] = byte_count(from_q, width);
    received += from_q;
  }
}

void MoeFeedForward::start_dispatch(const MoeActivations& a, const float* rows, int width) {
  plan_exchange(a, width);
  ep_->start_exchange(rows, send_bytes_, send_displs_, a.wire, recv_bytes_, recv_displs_);
}

void MoeFeedForward::finish_dispatch(const MoeActivations& a, float* local, int width) {
  ep_->finish_exchange();
  reorder_rows(local, a.wire, a.recv_counts, a.local_offsets, ep_->size(), local_experts_, width, true);
}

void MoeFeedForward::combine_back(const MoeActivations& a, const float* local, float* rows, int width) {
  reorder_rows(a.wire, local, a.recv_counts, a.local_offsets, ep_->size(), local_experts_, width, false);
  plan_exchange(a, width);  // the dispatch's counts, the other way round
  ep_->start_exchange(a.wire, recv_bytes_, recv_displs_, rows, send_bytes_, send_displs_);
  ep_->finish_exchange();
}

// ---- leases: the block's own pages as a whole, each chosen expert's apart ---------------------------

void MoeFeedForward::find_ranges() {
  if (block_begin_ >= 0) return;
  const std::vector<TensorInfo>& info = store_.tensors();
  const size_t experts_at = t_.size() - expert_ids_.size();
  block_begin_ = info.at(static_cast<size_t>(t_[0])).offset;
  const TensorInfo& last = info.at(static_cast<size_t>(t_[experts_at - 1]));
  block_end_ = last.offset + last.numel;
  for (int h = 0; h < held_experts_; ++h) {
    const TensorInfo& first = info.at(static_cast<size_t>(expert_ids_[static_cast<size_t>(h) * layout::expert_tensors]));
    const TensorInfo& end = info.at(
        static_cast<size_t>(expert_ids_[static_cast<size_t>(h) * layout::expert_tensors + layout::expert_tensors - 1]));
    expert_range_.emplace_back(first.offset, end.offset + end.numel);
  }
}

PageLease MoeFeedForward::lease_block(Plane plane, bool write) {
  if (whole_layer_) return write ? store_.use_layer(stats_.layer, {}, {plane}) : store_.use_layer(stats_.layer, {plane});
  find_ranges();
  // A layer's pass (compute): a bf16 state widens its working bits here, as for any layer, not a
  // rank's float32 masters of the chunks it owns (those are for the optimizer and checkpoints).
  return store_.use_range(plane, block_begin_, block_end_ - block_begin_, write, /*layer=*/true);
}

void MoeFeedForward::apply_expert_updates() {
  find_ranges();
  for (const auto& [begin, end] : expert_range_)
    for (const Chunk& c : store_.chunks_overlapping(begin, end - begin)) store_.use_chunk(c.id, {});
}

std::vector<int> MoeFeedForward::chosen_experts(const int32_t* offsets, bool descending) const {
  std::vector<int> order;
  for (int k = 0; k < local_experts_; ++k) {
    const int e = descending ? local_experts_ - 1 - k : k;
    if (offsets[e + 1] != offsets[e]) order.push_back(e);  // no rows: its pages are not touched
  }
  return order;
}

void MoeFeedForward::hint_experts(const std::vector<int>& order, size_t first, Plane plane) {
  if (store_.residency().always_present()) return;  // (no tiers: nothing to fetch)
  find_ranges();
  std::vector<PageRef> soon;
  for (size_t j = first; j < order.size(); ++j) {
    const auto [begin, end] = expert_range_[static_cast<size_t>(held_first() + order[j])];
    for (const Chunk& c : store_.chunks_overlapping(begin, end - begin)) soon.push_back({c.id, plane});
  }
  if (!soon.empty()) store_.residency().hint(soon);
}

void MoeFeedForward::agree_experts(const MoeActivations& a, const int32_t* offsets, bool training) {
  if (holders_ == nullptr) return;
  std::vector<float>& agreed = agreed_[a.probs];
  if (!training) {  // (evaluation, sampling: every held expert, no collective)
    agreed.clear();
    return;
  }
  agreed.assign(static_cast<size_t>(local_experts_), 0.0f);
  for (int e = 0; e < local_experts_; ++e) agreed[static_cast<size_t>(e)] = offsets[e + 1] != offsets[e] ? 1.0f : 0.0f;
  holders_->allreduce_sum(agreed.data(), local_experts_);
}

std::vector<int> MoeFeedForward::leased_experts(const MoeActivations& a, const int32_t* offsets, bool descending,
                                                Plane plane) const {
  if (holders_ == nullptr || plane != Plane::param) return chosen_experts(offsets, descending);
  const std::vector<float>& agreed = agreed_.at(a.probs);
  std::vector<int> order;
  for (int k = 0; k < local_experts_; ++k) {
    const int e = descending ? local_experts_ - 1 - k : k;
    if (agreed.empty() || agreed[static_cast<size_t>(e)] > 0) order.push_back(e);
  }
  return order;
}

template <typename Run>
void MoeFeedForward::for_chosen_experts(const MoeActivations& a, const int32_t* offsets, Plane plane, bool write,
                                        bool descending, Run run, bool hinted) {
  find_ranges();
  const std::vector<int> order = leased_experts(a, offsets, descending, plane);  // in the order they run
  // Hints the pages of the experts from order[first] on, nearest first. The tiers fetch as many as
  // the compute tier has room for; the rest are hinted again as each expert's lease ends and its
  // room can take the next ones (a sliding window over the chosen experts).
  if (!hinted) hint_experts(order, 0, plane);
  for (size_t j = 0; j < order.size(); ++j) {
    const auto [begin, end] = expert_range_[static_cast<size_t>(held_first() + order[j])];
    {
      // Inside the whole layer's lease (ZeRO-3: gathered collectively) a rank's own; else a
      // layer's pass, as lease_block's.
      const PageLease use = store_.use_range(plane, begin, end - begin, write, /*layer=*/!whole_layer_);
      // (gather_experts_apart: an expert another holder's rows chose, gathered here for them)
      if (offsets[order[j] + 1] != offsets[order[j]]) run(order[j]);
    }
    if (j + 1 < order.size()) hint_experts(order, j + 1, plane);
  }
}

std::vector<float*> MoeFeedForward::expert_matrices(layout::MoeExpert t, Plane plane) const {
  std::vector<float*> out(local_experts_);
  for (int e = 0; e < local_experts_; ++e) {
    out[e] = store_.data(expert_ids_[static_cast<size_t>(held_first() + e) * layout::expert_tensors + t], plane);
  }
  return out;
}

void MoeFeedForward::forward(const MoeActivations& a, const Batch& b, const float* x, float* out, bool count) {
  const int N = b.B * b.T;
  // Every held expert's deferred optimizer update (memory tiers) runs here, in expert order, chosen
  // or not: the same point every step (the tiers' schedule prefetches it), and before the hints
  // below, whose pages an update at home would otherwise leave behind their owner's version.
  apply_expert_updates();
  auto P = [&](int t) { return store_.data(t_[t], Plane::param); };  // t: layout::MoeBlock
  const MatmulPrecision f = math_.forward;
  // The router multiplies in float32 at every precision: its choices are discrete.
  ops::linear_forward<float>(MatmulPrecision::fp32, a.probs, x, P(layout::moe_router_w), nullptr, N, C_, E_);
  moe::router_softmax_forward(a.probs, a.probs, N, E_);
  moe::top_k(a.choice, a.probs, N, E_, K_, bias_.empty() ? nullptr : bias_.data());
  const int T = b.T * (cp_ != nullptr ? cp_->size() : 1);  // the whole sequence's tokens
  const int capacity =
      capacity_factor_ > 0 ? static_cast<int>(std::ceil(capacity_factor_ * T * K_ / static_cast<double>(E_))) : 0;
  int64_t dropped = 0;
  if (capacity > 0 && cp_ != nullptr) {  // this rank's two chunks, each counting on from the sequence's earlier ones
    const std::vector<int32_t> kept_before = kept_before_chunks(a, b, capacity);
    dropped = moe::plan_routing(a.offsets, a.rows, a.slot, a.choice, b.B, b.T, K_, E_, capacity, kept_before.data(), 2);
  } else {
    dropped = moe::plan_routing(a.offsets, a.rows, a.slot, a.choice, b.B, b.T, K_, E_, capacity);
  }
  const int M = a.offsets[E_];
  moe::gather_rows(a.xs, x, a.rows, M, K_, C_);
  auto shared = [&] {
    if (S_ > 0) {
      ops::linear_forward<float>(f, a.gus, x, P(layout::shared_gate_up_w), nullptr, N, C_, 2 * S_);
      ops::swiglu_forward(a.hs, a.gus, N, S_);
      ops::linear_forward<float>(f, out, a.hs, P(layout::shared_down_w), nullptr, N, S_, C_);
    } else {
      std::memset(out, 0, sizeof(float) * N * C_);
    }
  };
  const std::vector<float*> gate_up = expert_matrices(layout::expert_gate_up_w, Plane::param),
                            down = expert_matrices(layout::expert_down_w, Plane::param);
  const bool training = b.grad_scale != 0.0f;
  if (ep_ == nullptr) {  // expert by expert, each under its own lease (the same products, row for row)
    agree_experts(a, a.offsets, training);
    for_chosen_experts(a, a.offsets, Plane::param, false, false, [&](int e) {
      const int64_t at = a.offsets[e], rows = a.offsets[e + 1] - at;
      moe::grouped_linear_forward(f, a.gu, a.xs, &gate_up[e], a.offsets + e, 1, C_, 2 * Hm_);
      ops::swiglu_forward(a.h + at * Hm_, a.gu + at * 2 * Hm_, static_cast<int>(rows), Hm_);
      moe::grouped_linear_forward(f, a.ye, a.h, &down[e], a.offsets + e, 1, Hm_, C_);
    });
    shared();
  } else {  // the rows out to their experts' ranks (the shared experts run meanwhile), this rank's experts, back
    // (The experts the group's rows came for are known once the counts are in: their pages are
    // hinted then, to arrive while the rows and the shared experts' products do.)
    exchange_counts(a);
    agree_experts(a, a.local_offsets, training);
    hint_experts(leased_experts(a, a.local_offsets, false, Plane::param), 0, Plane::param);
    start_dispatch(a, a.xs, C_);
    shared();
    finish_dispatch(a, a.xr, C_);
    // This rank's experts that received rows, each under its own lease (row for row the grouped products).
    for_chosen_experts(a, a.local_offsets, Plane::param, false, false, [&](int e) {
      const int64_t at = a.local_offsets[e], rows = a.local_offsets[e + 1] - at;
      moe::grouped_linear_forward(f, a.gu, a.xr, &gate_up[e], a.local_offsets + e, 1, C_, 2 * Hm_);
      ops::swiglu_forward(a.h + at * Hm_, a.gu + at * 2 * Hm_, static_cast<int>(rows), Hm_);
      moe::grouped_linear_forward(f, a.yr, a.h, &down[e], a.local_offsets + e, 1, Hm_, C_);
    }, /*hinted=*/true);
    combine_back(a, a.yr, a.ye, C_);
  }
  moe::combine_forward(out, a.ye, a.probs, a.choice, a.slot, N, K_, E_, C_);
  if (b.grad_scale != 0.0f && count) {  // a training micro-batch: measured for monitoring (and balancing)
    for (int64_t p = 0; p < static_cast<int64_t>(N) * K_; ++p) stats_.tokens[a.choice[p]] += 1.0;
    if (!load_.empty()) {
      for (int64_t p = 0; p < static_cast<int64_t>(N) * K_; ++p) load_[a.choice[p]] += 1.0;
    }
    stats_.pairs += static_cast<double>(N) * K_;
    stats_.dropped += static_cast<double>(dropped);
    for (int n = 0; n < N; ++n) {
      double h = 0;
      for (int e = 0; e < E_; ++e) {
        const double p = a.probs[static_cast<int64_t>(n) * E_ + e];
        h -= p > 0 ? p * std::log(p) : 0.0;
      }
      stats_.entropy_sum += h;
    }
    stats_.token_count += N;
    if (cp_ == nullptr) {
      stats_.aux_sum += moe::aux_loss_forward(a.probs, a.choice, b.B, b.T, E_, K_);
    } else {  // every rank of the group adds each whole sequence's loss (the report's mean is per sequence)
      std::vector<double> f, mean_p;
      whole_sequence_shares(a, b, f, &mean_p);
      for (size_t i = 0; i < f.size(); ++i) stats_.aux_sum += E_ * f[i] * mean_p[i];
    }
    stats_.sequences += b.B;
  }
}

void MoeFeedForward::backward_input(const MoeActivations& a, const Batch& b, const float* dout, float* dx) {
  const int N = b.B * b.T;
  if (record_written_) {  // the experts backward_weight(a) will write, kept for the last few micro-batches
    std::vector<bool> written(static_cast<size_t>(E_), false);
    const int32_t* o = ep_ == nullptr ? a.offsets : a.local_offsets;
    for (int e = 0; e < (ep_ == nullptr ? E_ : local_experts_); ++e) {
      written[static_cast<size_t>(e + (ep_ == nullptr ? 0 : first_expert_))] = o[e + 1] != o[e];
    }
    std::erase_if(written_, [&](const auto& w) { return w.first == b.inputs; });
    written_.emplace_back(b.inputs, std::move(written));
    if (written_.size() > 8) written_.erase(written_.begin());
  }
  auto P = [&](int t) { return store_.data(t_[t], Plane::param); };
  const MatmulPrecision bw = math_.backward;
  float* dprobs = a.dlogits;
  std::memset(dprobs, 0, sizeof(float) * N * E_);
  moe::combine_backward(a.dye, dprobs, dout, a.ye, a.probs, a.choice, a.slot, N, K_, E_, C_);
  // (Tensor parallel: dot(dout, ye) of this rank's units' part of ye; summed over the group.)
  if (tp_ != nullptr) tp_->allreduce_sum(dprobs, static_cast<int64_t>(N) * E_);
  // d(w / S sum_s aux_s)/dp with grad_scale = 1 / (S T): w x grad_scale x E f_e (moe::aux_loss_backward's T folded in).
  if (aux_weight_ > 0 && cp_ == nullptr) {
    moe::aux_loss_backward(dprobs, a.choice, b.B, b.T, E_, K_, static_cast<float>(aux_weight_ * b.grad_scale * b.T));
  } else if (aux_weight_ > 0) {  // (as moe::aux_loss_backward, with the whole sequence's shares)
    std::vector<double> f;
    whole_sequence_shares(a, b, f, nullptr);
    moe::aux_loss_backward_shares(dprobs, f.data(), b.B, b.T, E_, static_cast<float>(aux_weight_ * b.grad_scale * b.T));
  }
  moe::router_softmax_backward(a.dlogits, dprobs, a.probs, N, E_);
  if (ep_ != nullptr) {
    backward_input_expert_parallel(a, b, dout, dx);
    return;
  }
  // Expert by expert under its lease: dh, the SwiGLU gradient, then the rows' input gradient dxs
  // over dh's memory. Expert e's dh rows [o_e Hm, o_e+1 Hm) never overlap an input gradient
  // [o_e' C, o_e'+1 C) of an expert done before it: ascending order when Hm >= C, descending when not.
  const std::vector<float*> gate_up = expert_matrices(layout::expert_gate_up_w, Plane::param),
                            down = expert_matrices(layout::expert_down_w, Plane::param);
  float* dxs = a.dh;
  for_chosen_experts(a, a.offsets, Plane::param, false, Hm_ < C_, [&](int e) {
    const int64_t at = a.offsets[e], rows = a.offsets[e + 1] - at;
    moe::grouped_linear_backward_input(bw, a.dh, a.dye, &down[e], a.offsets + e, 1, Hm_, C_);
    ops::swiglu_backward_input(a.dgu + at * 2 * Hm_, a.dh + at * Hm_, a.gu + at * 2 * Hm_, static_cast<int>(rows), Hm_);
    moe::grouped_linear_backward_input(bw, dxs, a.dgu, &gate_up[e], a.offsets + e, 1, C_, 2 * Hm_);
  });
  router_backward_input(a, N, dx);
  moe::scatter_add_rows(dx, dxs, a.slot, N, K_, C_);
  if (S_ > 0) {
    float* dhs = a.tmp;
    ops::linear_backward_input<float>(bw, dhs, dout, P(layout::shared_down_w), N, S_, C_, false);
    ops::swiglu_backward_input(a.dgus, dhs, a.gus, N, S_);
    ops::linear_backward_input<float>(bw, dx, a.dgus, P(layout::shared_gate_up_w), N, C_, 2 * S_, true);
  }
}

// backward_input's experts and what follows them with an expert group: the output gradients out to
// the experts' ranks (the shared experts' hidden gradient computed meanwhile), this rank's
// experts' input gradients, back, then as without one.
void MoeFeedForward::backward_input_expert_parallel(const MoeActivations& a, const Batch& b, const float* dout,
                                                    float* dx) {
  const int N = b.B * b.T;
  auto P = [&](int t) { return store_.data(t_[t], Plane::param); };
  const MatmulPrecision bw = math_.backward;
  hint_experts(leased_experts(a, a.local_offsets, Hm_ < C_, Plane::param), 0, Plane::param);  // (fetched while the rows travel)
  start_dispatch(a, a.dye, C_);
  if (S_ > 0) {
    float* dhs = a.tmp;
    ops::linear_backward_input<float>(bw, dhs, dout, P(layout::shared_down_w), N, S_, C_, false);
    ops::swiglu_backward_input(a.dgus, dhs, a.gus, N, S_);
  }
  finish_dispatch(a, a.dyr, C_);
  // The received rows' experts one at a time under their leases, dh then the rows' input gradient
  // dxr over dh's memory, in the order that never overwrites a row still needed (as without a group).
  const std::vector<float*> gate_up = expert_matrices(layout::expert_gate_up_w, Plane::param),
                            down = expert_matrices(layout::expert_down_w, Plane::param);
  float* dxr = a.dh;
  for_chosen_experts(a, a.local_offsets, Plane::param, false, Hm_ < C_, [&](int e) {
    const int64_t at = a.local_offsets[e], rows = a.local_offsets[e + 1] - at;
    moe::grouped_linear_backward_input(bw, a.dh, a.dyr, &down[e], a.local_offsets + e, 1, Hm_, C_);
    ops::swiglu_backward_input(a.dgu + at * 2 * Hm_, a.dh + at * Hm_, a.gu + at * 2 * Hm_, static_cast<int>(rows), Hm_);
    moe::grouped_linear_backward_input(bw, dxr, a.dgu, &gate_up[e], a.local_offsets + e, 1, C_, 2 * Hm_);
  }, /*hinted=*/true);
  float* dxs = a.dye;  // (sent: free) the sorted rows' input gradient
  combine_back(a, dxr, dxs, C_);
  router_backward_input(a, N, dx);
  moe::scatter_add_rows(dx, dxs, a.slot, N, K_, C_);
  if (S_ > 0) ops::linear_backward_input<float>(bw, dx, a.dgus, P(layout::shared_gate_up_w), N, C_, 2 * S_, true);
}

void MoeFeedForward::router_backward_input(const MoeActivations& a, int N, float* dx) {
  if (tp_ != nullptr && tp_->rank() != 0) {  // (the same on every tensor rank: the group's sum takes one)
    std::memset(dx, 0, sizeof(float) * N * C_);
    return;
  }
  const float* router = store_.data(t_[layout::moe_router_w], Plane::param);
  ops::linear_backward_input<float>(MatmulPrecision::fp32, dx, a.dlogits, router, N, C_, E_, false);
}

void MoeFeedForward::whole_sequence_shares(const MoeActivations& a, const Batch& b, std::vector<double>& f,
                                           std::vector<double>* mean_p) const {
  // Per sequence: choices per expert [E], then (with mean_p) probabilities summed per expert [E].
  const size_t E = static_cast<size_t>(E_), width = mean_p != nullptr ? 2 * E : E;
  std::vector<double> sums(static_cast<size_t>(b.B) * width, 0.0);
  for (int s = 0; s < b.B; ++s) {
    double* row = sums.data() + static_cast<size_t>(s) * width;
    for (int t = 0; t < b.T; ++t) {
      const int64_t n = static_cast<int64_t>(s) * b.T + t;
      for (int j = 0; j < K_; ++j) row[a.choice[n * K_ + j]] += 1.0;
      if (mean_p != nullptr) {
        for (int e = 0; e < E_; ++e) row[E + static_cast<size_t>(e)] += a.probs[n * E_ + e];
      }
    }
  }
  cp_->allreduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  const double T = static_cast<double>(b.T) * cp_->size();  // the whole sequence's tokens
  f.assign(static_cast<size_t>(b.B) * E, 0.0);
  if (mean_p != nullptr) mean_p->assign(f.size(), 0.0);
  for (size_t s = 0; s < static_cast<size_t>(b.B); ++s) {
    for (size_t e = 0; e < E; ++e) {
      f[s * E + e] = sums[s * width + e] / (T * K_);
      if (mean_p != nullptr) (*mean_p)[s * E + e] = sums[s * width + E + e] / T;
    }
  }
}

std::vector<int32_t> MoeFeedForward::kept_before_chunks(const MoeActivations& a, const Batch& b, int capacity) const {
  // Every sequence's pairs per chunk of the 2P and expert [B, 2P, E]: this rank's two chunks (local
  // rows [0, T/2) and [T/2, T): chunks r and 2P-1-r), summed over the group.
  const int P = cp_->size(), r = cp_->rank(), chunks = 2 * P, half = b.T / 2;
  const int mine[2] = {r, chunks - 1 - r};
  const size_t E = static_cast<size_t>(E_);
  std::vector<double> counts(static_cast<size_t>(b.B) * chunks * E, 0.0);
  for (int s = 0; s < b.B; ++s) {
    for (int t = 0; t < b.T; ++t) {
      const int64_t n = static_cast<int64_t>(s) * b.T + t;
      double* row = counts.data() + (static_cast<size_t>(s) * chunks + mine[t < half ? 0 : 1]) * E;
      for (int j = 0; j < K_; ++j) row[a.choice[n * K_ + j]] += 1.0;
    }
  }
  cp_->allreduce_sum(counts.data(), static_cast<int64_t>(counts.size()));
  // What a chunk starts from: the pairs of the chunks before it in position order, capped at the
  // capacity (an expert keeps pairs until it holds `capacity`, so what it kept is min(capacity, routed)).
  std::vector<int32_t> kept(static_cast<size_t>(b.B) * 2 * E, 0);
  for (size_t s = 0; s < static_cast<size_t>(b.B); ++s) {
    for (int g = 0; g < 2; ++g) {
      for (size_t e = 0; e < E; ++e) {
        double routed = 0;
        for (int c = 0; c < mine[g]; ++c) routed += counts[(s * chunks + static_cast<size_t>(c)) * E + e];
        kept[(s * 2 + static_cast<size_t>(g)) * E + e] = static_cast<int32_t>(routed < capacity ? routed : capacity);
      }
    }
  }
  return kept;
}

std::vector<bool> MoeFeedForward::experts_written(const int* inputs) const {
  for (const auto& [of, written] : written_) {
    if (of == inputs && inputs != nullptr) return written;
  }
  if (!record_written_) {
    throw Error("MoE block of layer " + std::to_string(stats_.layer) +
                ": the experts a weight pass writes are asked, but their recording is off (record_experts_written)");
  }
  throw Error("MoE block of layer " + std::to_string(stats_.layer) +
              ": the experts a weight pass writes are asked of a micro-batch none of its latest backward passes ran");
}

void MoeFeedForward::backward_weight(const MoeActivations& a, const Batch& b, const float* x, const float* dout) {
  const int N = b.B * b.T;
  auto G = [&](int t) { return store_.data(t_[t], Plane::grad); };
  const MatmulPrecision bw = math_.backward;
  const std::vector<float*> dgate_up = expert_matrices(layout::expert_gate_up_w, Plane::grad),
                            ddown = expert_matrices(layout::expert_down_w, Plane::grad);
  if (ep_ == nullptr) {  // the chosen experts' gradients, each under its own lease
    for_chosen_experts(a, a.offsets, Plane::grad, true, false, [&](int e) {
      moe::grouped_linear_backward_weight(bw, &ddown[e], a.dye, a.h, a.offsets + e, 1, Hm_, C_);
      moe::grouped_linear_backward_weight(bw, &dgate_up[e], a.dgu, a.xs, a.offsets + e, 1, C_, 2 * Hm_);
    });
  } else {  // this rank's experts that ran rows, each under its own lease, over those rows (expert order)
    for_chosen_experts(a, a.local_offsets, Plane::grad, true, false, [&](int e) {
      moe::grouped_linear_backward_weight(bw, &ddown[e], a.dyr, a.h, a.local_offsets + e, 1, Hm_, C_);
      moe::grouped_linear_backward_weight(bw, &dgate_up[e], a.dgu, a.xr, a.local_offsets + e, 1, C_, 2 * Hm_);
    });
  }
  ops::linear_backward_weight<float>(MatmulPrecision::fp32, G(layout::moe_router_w), nullptr, a.dlogits, x, N, C_, E_);
  if (S_ > 0) {
    ops::linear_backward_weight<float>(bw, G(layout::shared_down_w), nullptr, dout, a.hs, N, S_, C_);
    ops::linear_backward_weight<float>(bw, G(layout::shared_gate_up_w), nullptr, a.dgus, x, N, C_, 2 * S_);
  }
}

}  // namespace keel
