#include "model/llama.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "model/context_attention.h"
#include "model/kv_context.h"
#include "model/layer_util.h"
#include "model/model_layout.h"
#include "model/moe.h"

namespace keel {

using model_detail::Carver;
using model_detail::padded;
using model_detail::Stash;

namespace {

// ---- layers 1..L: RMSNorm, rotary grouped-query attention, RMSNorm, SwiGLU ---------------------
class LlamaBlock final : public Layer {
 public:
  LlamaBlock(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids, bool bf16,
             MathMode math, Recompute recompute, TensorGroup* tensor, ContextGroup* context)
      : store_(store),
        m_(m),
        layer_(m.layer_base + layer),
        bf16_(bf16),
        math_(math),
        mode_(recompute),
        tp_(tensor),
        cp_(context),
        seq_(tensor),
        C_(m.n_embd),
        A_(m.n_embd / parts()),
        NH_(m.n_head / parts()),
        KVH_(m.n_kv_head / parts()),
        QKV_(m.qkv_dim() / parts()),
        H_(m.ffn_hidden / parts()),
        t_(ids),
        rope_freq_(m.rope_frequencies()) {
    if (m.moe_block(layer - 1)) {
      moe_ = std::make_shared<MoeFeedForward>(m, store, layer_, ids, math, tensor);
      moe_->set_context_group(context);
    } else {
      check(ids.size() == layout::down_w + 1, "GPT: llama block " + std::to_string(layer) + " without its tensors");
    }
    probe_.window = m.window_of(layer_ - 1);
    probe_.mass.assign(static_cast<size_t>(m.n_head) * AttentionProbe::kBuckets, 0.0);
  }
  AttentionProbe* attention_probe() override { return &probe_; }
  MoeStats* moe_stats() override { return moe_ ? &moe_->stats() : nullptr; }
  MoeFeedForward* moe() override { return moe_.get(); }
  const char* name() const override { return "block"; }

  int64_t activation_floats(int B, int T) const override { return model_detail::carved(*this, B, T).kept.used(); }
  int64_t recomputed_floats(int B, int T) const override { return model_detail::carved(*this, B, T).shared.used(); }
  void set_recomputed(float* shared) override { shared_ = shared; }
  int64_t scratch_floats(int B, int T) const override {
    const int64_t N = static_cast<int64_t>(B) * T;
    // o / down outputs, dh, datty; under bf16 also the staging of gate_up and h (side by side);
    // under sequence parallelism a gathered or partial [N, C] (after the staging: a product may read
    // one while writing the other) and the norms' partial weight gradients
    return padded(N * std::max(C_, H_)) + (bf16_ ? padded(N * 2 * H_) + padded(N * H_) : 0) +
           (seq_.on() ? padded(N * C_) + 2 * C_ : 0);
  }
  void bind(float* activations, float* scratch, int B, int T) override {
    const int64_t N = static_cast<int64_t>(B) * T;
    model_detail::RecomputeCarver a{Carver(activations), Carver(shared_)};
    carve(a, B, T);
    scratch_ = scratch;
    stage_ = scratch + padded(N * std::max(C_, H_));
    stage_h_ = stage_ + padded(N * 2 * H_);
    whole_ = bf16_ ? stage_h_ + padded(N * H_) : stage_;
    norm_grads_ = whole_ + padded(N * C_);
  }

  void forward(const Batch& b, const float* x, float* x_out) override {
    const PageLease use = lease(Plane::param, false);
    run_forward(b, x, x_out, true);
  }

  // The block's lease for a pass in one plane: its layer's pages, or with a mixture of experts
  // the pages outside the routed experts (each chosen expert is leased apart: model/moe.h).
  PageLease lease(Plane plane, bool write) {
    if (moe_) return moe_->lease_block(plane, write);
    return write ? store_.use_layer(layer_, {}, {plane}) : store_.use_layer(layer_, {plane});
  }

  // Selective: attention from the kept (rotated) qkv, and SwiGLU from the kept gate_up (a
  // mixture of experts keeps all of its own activations: nothing of it is recomputed). Full: the
  // whole forward again (a mixture of experts routes the same tokens again, not counted twice).
  void recompute(const Batch& b, const float* x_in) override {
    if (moe_ && mode_ == Recompute::full) {  // (its leases as the forward's)
      const PageLease use = lease(Plane::param, false);
      run_forward(b, x_in, sink_, false);
      return;
    }
    model_detail::recompute_block(
        mode_, bf16_, store_, layer_, [&] { run_forward(b, x_in, sink_, false); }, [&] { attend(b); },
        [&] {
          if (!moe_) ops::swiglu_forward(h_.writable(stage_h_), gu_.writable(stage_), b.B * b.T, H_);
        });
  }

  // The forward pass under the caller's parameter lease; `first`: the micro-batch's forward
  // (probes attention), not its recomputation.
  // Under sequence parallelism x and x_out are this rank's R of the N rows (model/tensor_group.h):
  // the norms and residuals run on them, the products and attention on all N.
  void run_forward(const Batch& b, const float* x, float* x_out, bool first) {
    const int N = b.B * b.T, C = C_, H = H_, R = static_cast<int>(seq_.rows(N));
    auto P = [&](int t) { return store_.data(t_[t], Plane::param); };  // t: layout::LlamaBlock
    auto W = [&](int t) { return model_detail::weight_operand(store_, t_[t], math_.forward); };
    const float* none = nullptr;
    const int64_t NC = static_cast<int64_t>(R) * C, NH = static_cast<int64_t>(N) * H;  // (NC: this rank's rows)
    float* n1 = n1_.writable(stage_);
    ops::rmsnorm_forward(n1, rstd1_, x, P(layout::attn_norm_w), R, C);
    n1_.seal(n1, NC);
    ops::linear_forward(math_.forward, qkv_, whole_rows(n1_, N), W(layout::llama_qkv_w), none, N, C, QKV_);
    if (cp_ != nullptr && b.kv == nullptr) {
      rotate_at_global_positions(qkv_, b, false);
    } else {  // (a packed pass: each row at its own position, b.kv->positions())
      ops::rope_forward(qkv_, b.B, b.T, NH_, KVH_, m_.head_size(), rope_freq_, b.kv ? b.kv->pos0() : 0,
                        b.kv ? b.kv->positions() : nullptr, false, m_.rope_position_scale());
    }
    if (first) model_detail::probe_attention(probe_, b, qkv_, A_, NH_, KVH_, tp_ ? tp_->rank() * NH_ : 0);
    attend(b);
    float* o = scratch_;  // [N, C], consumed at once by the residual
    ops::linear_forward(math_.forward, o, atty_, W(layout::llama_proj_w), none, N, A_, C);
    reduce(o, N);  // row-parallel: the heads' parts of the output
    float* n2 = n2_.writable(stage_);
    ops::residual_rmsnorm_forward(res2_, n2, rstd2_, x, o, P(layout::mlp_norm_w), R, C);
    n2_.seal(n2, NC);
    if (moe_) {  // a mixture of experts in place of the MLP (model/moe.h); n2 kept in float32
      // (It routes all N rows: under sequence parallelism gathered. Its output is row-parallel's.)
      float* down = scratch_;
      moe_->forward(moe_act_, b, whole_rows(n2_, N).f32, down, first);
      reduce(down, N);
      ops::residual_forward(x_out, res2_, down, NC);
      return;
    }
    float* gu = gu_.writable(stage_);
    ops::linear_forward(math_.forward, gu, whole_rows(n2_, N), W(layout::gate_up_w), none, N, C, 2 * H);
    if (gu_.bits() != nullptr && h_.bits() != nullptr) {  // both stashes' bits in one pass
      ops::swiglu_forward_rounded(gu_.bits(), h_.bits(), gu, N, H);
    } else {
      gu_.seal(gu, 2 * NH);
      float* h = h_.writable(stage_h_);
      ops::swiglu_forward(h, gu, N, H);
      h_.seal(h, NH);
    }
    float* down = scratch_;
    ops::linear_forward(math_.forward, down, h_.read(), W(layout::down_w), none, N, H, C);
    reduce(down, N);
    ops::residual_forward(x_out, res2_, down, NC);
  }

  // A kept norm output as the operand of a column-parallel product: its N rows (under sequence
  // parallelism this rank's rows all-gathered into whole_, which the next gather overwrites; under
  // bf16 as the bits it keeps).
  Operand whole_rows(const Stash& kept, int N) {
    if (!seq_.on()) return kept.read();
    return seq_.gather(whole_, kept.read(), N, C_);
  }

  // Context parallelism: each of the batch's rows of q and k rotated at its token's position in
  // the whole sequence (model/context_group.h), or back (`inverse`: a gradient).
  // A rank's rows of a sequence are two runs of consecutive positions (its two chunks).
  void rotate_at_global_positions(float* rows, const Batch& b, bool inverse) {
    const int chunk = b.T / 2;
    for (int r = 0; r < b.B * 2; ++r) {
      const int t0 = (r % 2) * chunk;
      ops::rope_forward(rows + (static_cast<int64_t>(r / 2) * b.T + t0) * QKV_, 1, chunk, NH_, KVH_, m_.head_size(),
                        rope_freq_, cp_->position(t0, b.T), nullptr, inverse, m_.rope_position_scale());
    }
  }

  // atty_ (and att_) from the rotated qkv_.
  void attend(const Batch& b) {
    if (b.kv) {
      b.kv->attend(math_.forward, layer_ - 1, qkv_, QKV_, atty_, b.T, probe_.window);
    } else if (cp_ != nullptr) {
      context_ring_attention().forward(*cp_, math_.forward, atty_, att_, qkv_, b.B, b.T, A_, NH_, KVH_, probe_.window);
    } else if (m_.attention == Attention::dense) {
      ops::attention_forward(math_.forward, atty_, att_, qkv_, b.B, b.T, A_, NH_, KVH_);
    } else {
      ops::flash_attention_forward(math_.forward, atty_, att_, qkv_, b.B, b.T, A_, NH_, KVH_, probe_.window);
    }
  }

  // Under sequence parallelism dx_out, dx_in and the norms' gradients are this rank's R rows; the
  // row-parallel outputs' gradients (dx_out's, dres2's) are gathered to all N rows and kept so for W.
  void backward_input(const Batch& b, const float* x_in, const float* dx_out, float* dx_in) override {
    const PageLease use = lease(Plane::param, false);
    const int N = b.B * b.T, C = C_, H = H_, R = static_cast<int>(seq_.rows(N));
    auto P = [&](int t) { return store_.data(t_[t], Plane::param); };  // t: layout::LlamaBlock
    auto W = [&](int t) { return model_detail::weight_operand(store_, t_[t], math_.backward); };
    // MLP branch: d(down out) = dx_out
    if (moe_) {  // (as the dense MLP: dout of all N rows, dn2's partial sums over the group)
      const float* dout = seq_.on() ? seq_.gather(dout_, dx_out, N, C) : dx_out;
      float* dn2 = seq_.on() ? whole_ : dn2_;
      moe_->backward_input(moe_act_, b, dout, dn2);
      column_parallel_input_grad(dn2, dn2_, N);
    } else {
      const float* dout = seq_.on() ? seq_.gather(dout_, dx_out, N, C) : dx_out;
      float* dh = scratch_;
      ops::linear_backward_input(math_.backward, dh, dout, W(layout::down_w), N, H, C, false);
      float* dn2 = seq_.on() ? whole_ : dn2_;  // (the partial sums of all N rows)
      if (dgu_.bits() != nullptr) {  // rounded straight into the stash, which both products read
        ops::swiglu_backward_rounded(dgu_.bits(), dh, gu_.read(), N, H);
        ops::linear_backward_input(math_.backward, dn2, dgu_.read(), W(layout::gate_up_w), N, C, 2 * H, false);
      } else {
        float* dgu = dgu_.writable(stage_);
        ops::swiglu_backward_input(dgu, dh, gu_.read(), N, H);
        dgu_.seal(dgu, static_cast<int64_t>(N) * 2 * H);
        ops::linear_backward_input(math_.backward, dn2, dgu, W(layout::gate_up_w), N, C, 2 * H, false);
      }
      column_parallel_input_grad(dn2, dn2_, N);
    }
    float* dres2 = dres2_ + seq_.first(N) * C;  // this rank's rows of it
    std::memcpy(dres2, dx_out, sizeof(float) * R * C);
    ops::rmsnorm_backward_input(dres2, dn2_, res2_, rstd2_, P(layout::mlp_norm_w), R, C, true);
    if (seq_.on()) seq_.gather(dres2_, dres2, N, C);
    // Attention branch: d(o out) = dres2; attention's gradient is w.r.t. the rotated q and k,
    // rotated back before the qkv projection.
    float* datty = scratch_;
    ops::linear_backward_input(math_.backward, datty, dres2_, W(layout::llama_proj_w), N, A_, C, false);
    if (cp_ != nullptr) {
      context_ring_attention().backward(*cp_, math_.backward, dqkv_, datty, atty_, att_, qkv_, b.B, b.T, A_, NH_, KVH_,
                                probe_.window);
      rotate_at_global_positions(dqkv_, b, true);
    } else {
      if (m_.attention == Attention::dense) {
        ops::attention_backward_input(math_.backward, dqkv_, datty, att_, qkv_, b.B, b.T, A_, NH_, KVH_);
      } else {
        ops::flash_attention_backward_input(math_.backward, dqkv_, datty, atty_, att_, qkv_, b.B, b.T, A_, NH_, KVH_,
                                            probe_.window);
      }
      ops::rope_forward(dqkv_, b.B, b.T, NH_, KVH_, m_.head_size(), rope_freq_, 0, nullptr, true, m_.rope_position_scale());
    }
    float* dn1 = seq_.on() ? whole_ : dn1_;
    ops::linear_backward_input(math_.backward, dn1, dqkv_, W(layout::llama_qkv_w), N, C, QKV_, false);
    column_parallel_input_grad(dn1, dn1_, N);
    std::memcpy(dx_in, dres2, sizeof(float) * R * C);
    ops::rmsnorm_backward_input(dx_in, dn1_, x_in, rstd1_, P(layout::attn_norm_w), R, C, true);
  }

  // Under sequence parallelism the norm outputs are gathered again for the products' weight
  // gradients, and the norms' weight gradients (from this rank's rows) summed over the group.
  void backward_weight(const Batch& b, const float* x_in, const float* dx_out) override {
    const PageLease use = lease(Plane::grad, true);
    const int N = b.B * b.T, C = C_, H = H_, R = static_cast<int>(seq_.rows(N));
    auto G = [&](int t) { return store_.data(t_[t], Plane::grad); };
    float* none = nullptr;
    float* partial = norm_grads_;  // [attention norm, MLP norm] of this rank's rows
    if (seq_.on()) std::fill(partial, partial + 2 * C, 0.0f);
    if (moe_) {
      moe_->backward_weight(moe_act_, b, whole_rows(n2_, N).f32, seq_.on() ? dout_ : dx_out);
    } else {
      ops::linear_backward_weight(math_.backward, G(layout::down_w), none, seq_.on() ? dout_ : dx_out, h_.read(), N, H, C);
      ops::linear_backward_weight(math_.backward, G(layout::gate_up_w), none, dgu_.read(), whole_rows(n2_, N), N, C,
                                  2 * H);
    }
    ops::rmsnorm_backward_weight(seq_.on() ? partial + C : G(layout::mlp_norm_w), dn2_, res2_, rstd2_, R, C);
    ops::linear_backward_weight(math_.backward, G(layout::llama_proj_w), none, dres2_, atty_, N, A_, C);
    ops::linear_backward_weight(math_.backward, G(layout::llama_qkv_w), none, dqkv_, whole_rows(n1_, N), N, C, QKV_);
    ops::rmsnorm_backward_weight(seq_.on() ? partial : G(layout::attn_norm_w), dn1_, x_in, rstd1_, R, C);
    if (seq_.on()) seq_.sum_into(partial, {G(layout::attn_norm_w), G(layout::mlp_norm_w)}, C);
  }

 public:
  // Carves the block's tensors for micro-batches of up to B x T: what the mode keeps into
  // a.kept, what it recomputes into a.shared (as GPT-2's block: model/gpt.cpp Block::carve).
  // Under sequence parallelism the norms' outputs, row statistics and gradients, the residual and
  // a full recomputation's output take this rank's R rows; B keeps the gathered output gradients
  // (dres2_ of all N rows, dout_) for W (as GPT-2's block). A mixture of experts gathers n2 into the
  // scratch for its passes, as the dense MLP's products do.
  void carve(model_detail::RecomputeCarver& a, int B, int T) {
    const int64_t N = static_cast<int64_t>(B) * T, R = seq_.rows(N);
    const bool full = mode_ == Recompute::full, any = mode_ != Recompute::none;
    n1_.carve(a.at(full), R * C_, bf16_);
    qkv_ = a.at(full).take(N * QKV_);
    const int64_t rows = static_cast<int64_t>(B) * NH_ * T;  // this rank's heads: probabilities, or log-sum-exp
    att_ = a.at(any).take(m_.attention == Attention::dense ? rows * T : rows);
    atty_ = a.at(any).take(N * A_);
    res2_ = a.at(full).take(R * C_);
    n2_.carve(a.at(full), R * C_, bf16_ && !moe_);  // a mixture of experts gathers rows of it: float32
    const int64_t NH = moe_ ? 0 : N * H_;             // (no dense MLP in a mixture-of-experts block)
    gu_.carve(a.at(full), 2 * NH, bf16_);
    h_.carve(a.at(full || (any && !bf16_)), NH, bf16_);
    rstd1_ = a.at(full).take(R);
    rstd2_ = a.at(full).take(R);
    dn1_ = a.at(any).take(R * C_);
    dqkv_ = a.at(any).take(N * QKV_);
    dres2_ = a.at(any).take(N * C_);
    dn2_ = a.at(any).take(R * C_);
    dgu_.carve(a.at(any), 2 * NH, bf16_);
    dout_ = seq_.on() ? a.at(any).take(N * C_) : nullptr;
    if (moe_) moe_act_ = moe_->carve(a.kept, B, T);  // kept under every train.recompute
    sink_ = full ? a.shared.take(R * C_) : nullptr;
  }

 private:
  ChunkStore& store_;
  ModelConfig m_;
  int layer_;
  bool bf16_;  // stashes in bf16 (Stash)
  MathMode math_;         // its products' precision in F and in B, W
  Recompute mode_;        // train.recompute for this block
  AttentionProbe probe_;  // its window (0 = none) and the dynamic window's probe
  // Tensor parallel (tp_ not null): the block holds its heads' q, k, v rows (its KV heads' too) and
  // its units' gate and up rows (column-parallel), the matching columns of the output and down
  // projections (row-parallel, their outputs all-reduced), the norms whole.
  TensorGroup* tp_;
  ContextGroup* cp_;  // null: no context parallelism
  model_detail::SequenceRows seq_;  // sequence parallelism (off without it)
  int parts() const { return tp_ ? tp_->size() : 1; }
  // A row-parallel product's partial output data[N, C], summed over the group: all N rows
  // (all-reduced), or under sequence parallelism this rank's R rows at data's start (reduce-scattered).
  void reduce(float* data, int N) {
    if (seq_.on()) {
      seq_.scatter(data, data, N, C_);
    } else if (tp_) {
      tp_->allreduce_sum(data, static_cast<int64_t>(N) * C_);
    }
  }
  // The gradient of a column-parallel product's input, partial[N, C] (this rank's columns' part),
  // summed over the group into grad: all N rows (all-reduced in place: partial is grad), or under
  // sequence parallelism this rank's rows (reduce-scattered).
  void column_parallel_input_grad(float* partial, float* grad, int N) {
    if (seq_.on()) {
      seq_.scatter(partial, grad, N, C_);
    } else if (tp_) {
      tp_->allreduce_sum(grad, static_cast<int64_t>(N) * C_);
    }
  }
  // The residual width, this rank's attention columns (q), heads, KV heads, qkv rows and MLP units.
  int C_, A_, NH_, KVH_, QKV_, H_;
  std::vector<TensorId> t_;  // the block's tensors, indexed by layout::LlamaBlock
  std::vector<double> rope_freq_;  // RoPE's pair frequencies (ModelConfig::rope_frequencies)
  Stash n1_, n2_, gu_, h_, dgu_;
  // A mixture-of-experts block's experts (null: the dense MLP), shared by the copies that size
  // activations (model_detail::carved), and the micro-batch's activations of them.
  std::shared_ptr<MoeFeedForward> moe_;
  MoeActivations moe_act_;
  float *qkv_ = nullptr, *att_ = nullptr, *atty_ = nullptr, *res2_ = nullptr, *rstd1_ = nullptr, *rstd2_ = nullptr,
        *dn1_ = nullptr, *dqkv_ = nullptr, *dres2_ = nullptr, *dn2_ = nullptr, *scratch_ = nullptr,
        *stage_ = nullptr, *stage_h_ = nullptr;
  // Sequence parallelism: the output gradient of all N rows (kept from B for W); in the scratch,
  // a gathered or partial [N, C] and the norms' partial weight gradients [2, C].
  float *dout_ = nullptr, *whole_ = nullptr, *norm_grads_ = nullptr;
  float* shared_ = nullptr;  // the shared recomputed set (Layer::set_recomputed)
  float* sink_ = nullptr;    // full: the recomputed forward's output (its bytes are already x_out)
};


}  // namespace

std::unique_ptr<Layer> make_llama_block(const ModelConfig& m, ChunkStore& store, int layer,
                                        const std::vector<TensorId>& ids, bool bf16, MathMode math,
                                        Recompute recompute, TensorGroup* tensor, ContextGroup* context) {
  return std::make_unique<LlamaBlock>(m, store, layer, ids, bf16, math, recompute, tensor, context);
}

}  // namespace keel
