// A llama block's mixture of experts (model.moe_experts > 0, every model.moe_every-th block): in
// place of the SwiGLU MLP, out = sum_j p[choice j] expert_{choice j}(x) + shared(x), where p =
// softmax(x Wr^T) over the E routed experts, the k most probable chosen per token (their weights
// the probabilities themselves, not renormalised), each expert a SwiGLU MLP of moe_hidden units,
// `shared` one SwiGLU MLP of moe_shared_experts x moe_hidden units every token passes through.
//
// The experts' products are grouped: the micro-batch's (token, choice) pairs are sorted by expert
// (kernels/cpu/moe.h plan_routing), the tokens gathered in that order, and each expert multiplies
// all of its rows in one product. Dropless by default; with model.moe_capacity an expert takes at
// most ceil(c T k / E) of a sequence's pairs and the rest are dropped (the token keeps its other
// choices and the residual). Balancing: the Switch/GShard loss, per sequence, weighted by
// model.moe_aux_weight, enters the router's gradient directly (its value is reported in
// MoeStats, not added to the cross-entropy the head reports); with model.moe_balance = "bias" a
// per-expert bias joins the probabilities in the top-k choice only (kernels/cpu/moe.h
// update_balance_bias moves it between steps: comm/moe_balance.h).
//
// Tensor parallelism (a tensor group of T ranks): the router is replicated and every tensor rank
// routes the same N rows the same way (its input, the normalised residual, is the same on every
// rank: under sequence parallelism the block gathers it first), so no rows move between tensor
// ranks. Each routed expert and the shared experts are split as the dense MLP is: a rank holds
// Hm / T of every expert's units (gate_up column-parallel, proj row-parallel), so its outputs are
// partial sums, weighted and combined as they are into a partial block output that the caller sums
// over the group once (an all-reduce, or a reduce-scatter under sequence parallelism), with the
// input gradient likewise. The router's probability gradient dot(dout, ye) is a partial sum too:
// all-reduced over the group ([N, E] floats) before the balancing loss's gradient joins it, so the
// router's gradients are the same on every rank; its input gradient is added on the group's first
// rank only (the caller's sum adds it once). With an expert group as well, the exchanged rows are
// C wide as without tensor parallelism, and each rank's experts run on its units only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "model/context_group.h"
#include "model/expert_group.h"
#include "model/layer.h"
#include "model/layer_util.h"
#include "model/model_layout.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel {

// What a mixture-of-experts block measured over the training micro-batches since the last
// reset (runtime/moe_report.h sums them over the data-parallel ranks and resets them once per
// optimizer step).
struct MoeStats {
  int layer = 0;                     // the store's layer of the block
  std::vector<double> tokens;        // per routed expert: (token, choice) pairs routed to it (dropped ones too)
  double pairs = 0;                  // all (token, choice) pairs
  double dropped = 0;                // pairs over capacity (0 dropless)
  double entropy_sum = 0;            // sum over tokens of the router's entropy (nats)
  double token_count = 0;            // tokens
  double aux_sum = 0, sequences = 0; // the balancing loss summed over sequences, and their count
  void reset() {
    std::fill(tokens.begin(), tokens.end(), 0.0);
    pairs = dropped = entropy_sum = token_count = aux_sum = sequences = 0;
  }
};

// What a mixture of experts keeps per micro-batch (ints stored in float slots): router
// probabilities [N, E]; the routing plan's choice and slot [N, k], rows [N k], offsets [E + 1];
// the sorted rows' inputs [M, C], gate_up [M, 2 Hm], hidden [M, Hm], outputs [M, C]; the shared
// MLP's gate_up [N, 2 S] and hidden [N, S]; from B for W: dgate_up [M, 2 Hm], dye [M, C], the
// router's dlogits [N, E], the shared dgate_up [N, 2 S]; and B's working rows.
//
// With an expert group of P ranks (E_l = E / P experts each) the sorted rows xs, ye, dye stay on
// the rank that routed them, and the experts' side holds the rows every rank of the group sent
// to this rank's experts, in expert order (up to P N k of them): their inputs xr [Mr, C], gu, h,
// dgu, dh as above but over Mr rows, outputs yr [Mr, C] and received output gradients dyr
// [Mr, C]; the counts received, recv_counts [P, E_l] (from rank p for local expert e), their
// offsets local_offsets [E_l + 1]; `wire` [P N k, C] stages rows in rank order for the exchanges.
// The experts' side is not carved from the slot's activations: the block keeps it per slot as
// address space for the dropless worst case (Mr = P N k rows), whose pages a micro-batch touches
// only as far as the rows it received (the counts' all-to-all precedes the rows), so a rank's
// memory follows the counts received rather than the worst case.
struct MoeActivations {
  float *probs = nullptr, *xs = nullptr, *gu = nullptr, *h = nullptr, *ye = nullptr, *dgu = nullptr, *dye = nullptr,
        *dh = nullptr, *dlogits = nullptr, *tmp = nullptr, *gus = nullptr, *hs = nullptr, *dgus = nullptr;
  int32_t *choice = nullptr, *slot = nullptr, *rows = nullptr, *offsets = nullptr;
  float *xr = nullptr, *yr = nullptr, *dyr = nullptr, *wire = nullptr;
  int32_t *recv_counts = nullptr, *local_offsets = nullptr;
};

class MoeFeedForward {
 public:
  // ids: the block's tensors (layout::MoeBlock order); `layer`: the store's layer; `tensor`: the
  // tensor group whose shards of the experts `ids` hold (null: none).
  MoeFeedForward(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids, MathMode math,
                 TensorGroup* tensor = nullptr);

  // Carves what it keeps from forward to backward for micro-batches of up to B x T tokens (over
  // a counting Carver: null pointers, only the size).
  MoeActivations carve(model_detail::Carver& kept, int B, int T) const;
  // out[N, C] (overwritten) from x[N, C] (the block's normalised residual), under the caller's
  // parameter lease; with a tensor group this rank's part of out (the caller sums it over the
  // group). A training micro-batch (grad_scale != 0) is counted in stats() and step_load(), unless
  // `count` is false (its recomputation under train.recompute).
  void forward(const MoeActivations& a, const Batch& b, const float* x, float* out, bool count = true);
  // dx[N, C] (overwritten) from dout[N, C] (with a tensor group: dout whole, dx this rank's part, the
  // caller sums it over the group); keeps what backward_weight needs. The balancing loss's
  // gradient (moe_aux_weight / sequences of the step x each sequence's loss) joins the router's here.
  void backward_input(const MoeActivations& a, const Batch& b, const float* dout, float* dx);
  // Accumulates the router's, the experts' and the shared experts' weight gradients.
  void backward_weight(const MoeActivations& a, const Batch& b, const float* x, const float* dout);
  MoeStats& stats() { return stats_; }
  // Expert parallelism: the experts' products of this rank's share of the experts only, for the
  // rows every rank of `group` routes to them (exchanged there and back; its size divides the
  // experts). Before the activations are carved; null (the default): every expert here. The
  // block holds this rank's experts' tensors only (model_layout's ExpertPlace) or every expert's
  // (parallel.zero >= 1: the others' weight gradients then stay zero here).
  void set_expert_group(ExpertGroup* group);
  ExpertGroup* expert_group() const { return ep_; }
  // Context parallelism: this rank's rows are chunks of the group's sequences (model/context_group.h);
  // the balancing loss, taken per whole sequence, sums each sequence's choice counts and router
  // probabilities over the group first, and a capacity (model.moe_capacity) counts the whole
  // sequence's pairs in position order: each rank's chunks start from what the sequence's earlier
  // chunks kept (their counts summed over the group), so the group drops the pairs one rank holding
  // the sequence drops. Null (the default): whole sequences here.
  void set_context_group(ContextGroup* group) { cp_ = group; }
  // The lease a pass of the block takes as a whole, in one plane (read, or `write`): its pages
  // outside the routed experts (attention, norms, router, shared experts). Each routed expert's
  // pages are leased apart by the passes above, one expert at a time and only for the experts
  // some row of the micro-batch chose, after a hint to the store's residency for all of those
  // (the memory tiers fetch them while the first chosen expert's products run). With an expert
  // group: this rank's experts that rows of the group's ranks were sent to (hinted as soon as the
  // counts' all-to-all is in). After lease_whole_layer(): the block's whole layer (every expert it holds).
  PageLease lease_block(Plane plane, bool write);
  // ZeRO-3 (comm/sharded_params.h) gathers a layer's parameters under its layer lease, every rank
  // of the data group taking the same leases: from here on every pass of the block leases its
  // whole layer as one (every expert's pages, gathered with the layer; the chosen experts' own
  // leases then find them present). Before the first pass.
  void lease_whole_layer() { whole_layer_ = true; }
  // ZeRO-3 where several ranks hold each of the block's experts (`holders`: those holding the same
  // ones as this rank; comm/expert_parallel.h gather_experts_apart), instead of lease_whole_layer:
  // each training micro-batch's forward sums over the holders a flag per held expert, whether this
  // rank routed (with an expert group: was sent) rows to it, right after the router (the counts'
  // all-to-all), and every pass of the micro-batch then leases, one at a time as layer leases (so
  // gathered over the holders), exactly the experts some holder flagged, in the same order on
  // every holder; a rank runs products only for its experts that have rows of its own. An
  // evaluation or sampling pass leases every held expert so (no agreement: a sample runs on one
  // rank). The layer's lease takes the pages outside the experts. Before the first pass.
  void gather_experts_apart(ExpertHolders* holders) { holders_ = holders; }
  // model.moe_balance = "bias": the routing bias [E] (zeros at the start), and the pairs routed to
  // each expert [E] by the training micro-batches since the balancer last took them (dropped too).
  // Empty otherwise.
  std::vector<float>& routing_bias() { return bias_; }
  std::vector<double>& step_load() { return load_; }
  // The routed experts (all E, by index) whose weight gradients backward_weight adds to for the
  // micro-batch `inputs` (its Batch::inputs; one of the last few whose backward_input ran after
  // record_experts_written(), else refused in one line): those some of its rows chose, with an
  // expert group this rank's experts that its group's rows chose. backward_weight leaves every
  // other expert's gradient as it is, so gradient prediction predicts nothing for them
  // (pipeline/gradient_prediction.h).
  std::vector<bool> experts_written(const int* inputs) const;
  // From here on backward_input records what experts_written() answers (gradient prediction's
  // asker turns it on; unasked, the backward pass records nothing).
  void record_experts_written() { record_written_ = true; }
  // Expert parallelism: the bytes of every slot's experts' side resident now (mincore: the rows
  // received so far, to whole pages), and the address space kept for them (the worst case).
  int64_t expert_side_resident_bytes() const;
  int64_t expert_side_reserved_bytes() const;

 private:
  ChunkStore& store_;
  MathMode math_;
  TensorGroup* tp_;         // null: no tensor group
  int C_, E_, K_, Hm_, S_;  // width, experts, top-k, expert units, shared units (0: none): this tensor rank's
  double capacity_factor_, aux_weight_;
  std::vector<TensorId> t_;
  std::vector<TensorId> expert_ids_;  // each held expert's tensors (layout::MoeExpert order), expert order
  int held_experts_ = 0;
  MoeStats stats_;
  std::vector<float> bias_;
  std::vector<double> load_;
  // experts_written() of the micro-batches (their inputs) of the latest backward_input passes, newest
  // last (only after record_experts_written())
  std::vector<std::pair<const int*, std::vector<bool>>> written_;
  bool record_written_ = false;
  ExpertGroup* ep_ = nullptr;
  ContextGroup* cp_ = nullptr;
  // Context parallelism: each sequence's [E] shares of its whole T k choices into `f` [B, E], and
  // with `mean_p` its whole router probabilities' mean per expert [B, E] (sums over the group).
  void whole_sequence_shares(const MoeActivations& a, const Batch& b, std::vector<double>& f,
                             std::vector<double>* mean_p) const;
  // Context parallelism at a capacity of `capacity` pairs: per sequence and per of this rank's two
  // chunks, the pairs of each expert the whole sequence's earlier chunks keep [B, 2, E]
  // (kernels/cpu/moe.h plan_routing's kept_before).
  std::vector<int32_t> kept_before_chunks(const MoeActivations& a, const Batch& b, int capacity) const;
  bool whole_layer_ = false;  // lease_whole_layer()
  ExpertHolders* holders_ = nullptr;  // gather_experts_apart()
  // gather_experts_apart: per slot (keyed as sides_), the last training forward's sum over the
  // holders of each held expert's flag [local_experts_]; empty after an evaluation forward (every
  // held expert leased).
  std::map<const float*, std::vector<float>> agreed_;
  // Sums the flags of this rank's experts with rows in `offsets` over the holders (a training
  // micro-batch), or marks every held expert to lease (not training): kept for the slot's passes.
  void agree_experts(const MoeActivations& a, const int32_t* offsets, bool training);
  int local_experts_, first_expert_;  // this rank's experts: first_expert_ .. + local_experts_ - 1
  std::vector<int32_t> expert_counts_;  // rows routed to each expert by this micro-batch [E]
  std::vector<int> send_bytes_, send_displs_, recv_bytes_, recv_displs_;  // per rank of the group
  // Each slot's experts' side (an anonymous mapping, touched row by row), keyed by the slot's
  // carved activations (carve() gives a slot the same one on every bind).
  struct ExpertSide;
  mutable std::map<const float*, std::shared_ptr<ExpertSide>> sides_;

  // Expert parallelism's passes (ep_ set): rows[M, width] in `a`'s sorted order out to the
  // experts' ranks, landing in expert order in `local` [Mr, width]; and back.
  void exchange_counts(const MoeActivations& a);
  void start_dispatch(const MoeActivations& a, const float* rows, int width);
  void finish_dispatch(const MoeActivations& a, float* local, int width);
  void combine_back(const MoeActivations& a, const float* local, float* rows, int width);
  // The byte counts and offsets of a dispatch of `a`'s rows (combine_back's the other way round).
  void plan_exchange(const MoeActivations& a, int width);
  void backward_input_expert_parallel(const MoeActivations& a, const Batch& b, const float* dout, float* dx);
  // dx[N, C] (overwritten) = the router's input gradient, or zeros on a tensor rank other than the first.
  void router_backward_input(const MoeActivations& a, int N, float* dx);
  // The `plane` matrices of tensor `t` of the experts this rank runs (all E without a group), in expert order.
  std::vector<float*> expert_matrices(layout::MoeExpert t, Plane plane) const;
  // Routing-aware leases. Flat element ranges of the block's tensors outside the routed experts,
  // and of each held expert's two matrices (their chunks are the expert's own),
  // found on first use (the store is finalized after the blocks are built).
  int64_t block_begin_ = -1, block_end_ = 0;
  std::vector<std::pair<int64_t, int64_t>> expert_range_;
  void find_ranges();
  // The held index of this rank's first expert (holding every expert under ZeRO: first_expert_).
  int held_first() const { return held_experts_ == E_ ? first_expert_ : 0; }
  // Runs the deferred optimizer update (ChunkStore::defer_update) of every expert the block holds.
  void apply_expert_updates();
  // This rank's experts (local index) with rows in `offsets` [local_experts_ + 1]: a.offsets
  // without a group, a.local_offsets (the rows received) with one; ascending, or descending.
  std::vector<int> chosen_experts(const int32_t* offsets, bool descending) const;
  // The experts a pass of the micro-batch `a` leases in `plane`: chosen_experts, or (parameters,
  // gather_experts_apart) those the holders agreed on, in the same order.
  std::vector<int> leased_experts(const MoeActivations& a, const int32_t* offsets, bool descending, Plane plane) const;
  // Hints the residency with the `plane` pages of experts order[first..], nearest first (no tiers: nothing).
  void hint_experts(const std::vector<int>& order, size_t first, Plane plane);
  // Hints the residency with the `plane` pages of every expert leased_experts(a, offsets, ...)
  // names (`hinted`: the caller already hinted that list, in that order), then runs run(e) for each
  // of them with rows in `offsets` under a lease of its pages (`write`: released modified), in
  // ascending expert order, or descending with `descending`.
  template <typename Run>
  void for_chosen_experts(const MoeActivations& a, const int32_t* offsets, Plane plane, bool write, bool descending,
                          Run run, bool hinted = false);
};

}  // namespace keel
