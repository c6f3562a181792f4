#include "model/gpt.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>

#include <omp.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/ops.h"
#include "model/context_attention.h"
#include "model/head.h"
#include "model/kv_context.h"
#include "model/layer_util.h"
#include "model/llama.h"
#include "model/moe.h"

namespace keel {

using model_detail::Carver;
using model_detail::OutputLayer;
using model_detail::padded;
using model_detail::Stash;

namespace {

// ---- layer 0: token + position embedding (llama: token embedding alone; RoPE adds positions) ---
class Embedding final : public Layer {
 public:
  // ids: the layer's tensors in model_layout's order (layout::Embedding).
  // tensor: the tensor group (null: unsplit); wte then holds its rows of the vocabulary.
  // context: the context group (null: none); the batch's rows are then this rank's two chunks of
  // each sequence, and take the position table's rows of their global positions.
  Embedding(const ModelConfig& m, ChunkStore& store, const std::vector<TensorId>& ids, TensorGroup* tensor,
            ContextGroup* context)
      : store_(store),
        m_(m),
        wte_(ids.at(layout::wte)),
        wpe_(m.llama() ? -1 : ids.at(layout::wpe)),
        tp_(tensor),
        cp_(context) {
    if (tp_) {
      rows_ = m.padded_vocab_size / tp_->size();
      vocab_begin_ = tp_->rank() * rows_;
    }
  }
  const char* name() const override { return "embedding"; }
  int64_t activation_floats(int, int) const override { return 0; }
  // Sequence parallelism: every token's row of this rank's vocabulary (forward), the gathered
  // output gradient (backward).
  int64_t scratch_floats(int B, int T) const override {
    return model_detail::SequenceRows(tp_).on() ? static_cast<int64_t>(B) * T * m_.n_embd : 0;
  }
  void bind(float*, float* scratch, int, int) override { scratch_ = scratch; }

  // x_out[B,T,C] = wte[inputs] + wpe[t] (over a KV cache: wpe[pos0 + t])
  void forward(const Batch& b, const float*, float* x_out) override {
    const PageLease use = store_.use_layer(m_.layer_base, {Plane::param});
    const int pos0 = b.kv ? b.kv->pos0() : 0;
    const bool packed = b.kv != nullptr && b.kv->positions() != nullptr;  // checked row by row below
    if (wpe_ >= 0 && !packed && pos0 + b.T > m_.max_seq_len) {
      throw Error("the model's position table ends at " + std::to_string(m_.max_seq_len) + " tokens: position " +
                  std::to_string(pos0 + b.T - 1) + " asked for");
    }
    if (tp_) {
      check(!b.kv || b.kv->positions() == nullptr, "model: a packed KV-cached pass over a tensor-parallel embedding is not built");
      vocab_parallel_embedding_forward(*tp_, x_out, b, store_.data(wte_, Plane::param),
                                       wpe_ >= 0 ? store_.data(wpe_, Plane::param) : nullptr, pos0, rows_, vocab_begin_,
                                       m_.n_embd, scratch_, chunk_positions(b));
      return;
    }
    if (const int* pos = b.kv ? b.kv->positions() : nullptr) {  // a packed pass: each row at its own position
      check(b.B == 1, "model: a packed KV-cached pass runs as one batch row");
      const int C = m_.n_embd;
      for (int r = 0; r < b.T; ++r) {
        if (wpe_ >= 0 && pos[r] >= m_.max_seq_len) {
          throw Error("the model's position table ends at " + std::to_string(m_.max_seq_len) + " tokens: position " +
                      std::to_string(pos[r]) + " asked for");
        }
        const float* wpe = wpe_ >= 0 ? store_.data(wpe_, Plane::param) + static_cast<int64_t>(pos[r]) * C : nullptr;
        ops::encoder_forward(x_out + static_cast<int64_t>(r) * C, b.inputs + r, store_.data(wte_, Plane::param), wpe, 1, 1, C);
      }
      return;
    }
    if (cp_ != nullptr) {  // each batch row's two chunks, each a run of consecutive positions
      const int C = m_.n_embd, chunk = b.T / 2;
      for (int r = 0; r < 2 * b.B; ++r) {
        const int t0 = (r % 2) * chunk;
        const int64_t row = static_cast<int64_t>(r / 2) * b.T + t0;
        const float* wpe =
            wpe_ >= 0 ? store_.data(wpe_, Plane::param) + static_cast<int64_t>(cp_->position(t0, b.T)) * C : nullptr;
        ops::encoder_forward(x_out + row * C, b.inputs + row, store_.data(wte_, Plane::param), wpe, 1, chunk, C);
      }
      return;
    }
    const float* wpe = wpe_ >= 0 ? store_.data(wpe_, Plane::param) + static_cast<int64_t>(pos0) * m_.n_embd : nullptr;
    ops::encoder_forward(x_out, b.inputs, store_.data(wte_, Plane::param), wpe, b.B, b.T, m_.n_embd);
  }
  void backward_input(const Batch&, const float*, const float*, float*) override {}  // tokens have no gradient
  void backward_weight(const Batch& b, const float*, const float* dx_out) override {
    const PageLease use = store_.use_layer(m_.layer_base, {}, {Plane::grad});
    float* dwpe = wpe_ >= 0 ? store_.data(wpe_, Plane::grad) : nullptr;
    if (tp_) {
      // Sequence parallelism: every token's gradient, gathered from the ranks' rows (each rank then
      // adds the whole batch's to the position table, as without it).
      const model_detail::SequenceRows seq(tp_);
      if (seq.on()) dx_out = seq.gather(scratch_, dx_out, static_cast<int64_t>(b.B) * b.T, m_.n_embd);
      vocab_parallel_embedding_backward(store_.data(wte_, Plane::grad), dwpe, dx_out, b, rows_, vocab_begin_, m_.n_embd,
                                        chunk_positions(b));
      return;
    }
    if (cp_ != nullptr) {
      const int C = m_.n_embd, chunk = b.T / 2;
      for (int r = 0; r < 2 * b.B; ++r) {
        const int t0 = (r % 2) * chunk;
        const int64_t row = static_cast<int64_t>(r / 2) * b.T + t0;
        ops::encoder_backward_weight(store_.data(wte_, Plane::grad),
                                     dwpe ? dwpe + static_cast<int64_t>(cp_->position(t0, b.T)) * C : nullptr,
                                     dx_out + row * C, b.inputs + row, 1, chunk, C);
      }
      return;
    }
    ops::encoder_backward_weight(store_.data(wte_, Plane::grad), dwpe, dx_out, b.inputs, b.B, b.T, m_.n_embd);
  }

 private:
  // Context parallelism: the global position of each of a sequence's b.T local rows (its two
  // chunks, model/context_group.h), for the vocabulary-parallel embedding's position table; null
  // without it.
  const int* chunk_positions(const Batch& b) {
    if (cp_ == nullptr) return nullptr;
    chunk_positions_.resize(b.T);
    for (int t = 0; t < b.T; ++t) chunk_positions_[t] = cp_->position(t, b.T);
    return chunk_positions_.data();
  }

  ChunkStore& store_;
  ModelConfig m_;
  TensorId wte_, wpe_ = -1;  // wpe_ < 0: no position table
  TensorGroup* tp_ = nullptr;
  ContextGroup* cp_ = nullptr;
  int rows_ = 0, vocab_begin_ = 0;  // tensor parallel: this rank's vocabulary rows
  float* scratch_ = nullptr;        // [N, C] under sequence parallelism
  std::vector<int> chunk_positions_;
};

// ---- layers 1..L: transformer block ------------------------------------------------------------
// x_out = res2 + proj(gelu(fc(ln2(res2)))),  res2 = x_in + attn_proj(attention(qkv(ln1(x_in))))
class Block final : public Layer {
 public:
  // ids: the block's tensors in model_layout's order (layout::Gpt2Block).
  // tensor: the tensor group (null: unsplit), over which the block holds its heads' q, k, v rows
  // and its share of fc's (column-parallel), the matching columns of both output projections
  // (row-parallel, their outputs all-reduced), and the norms and those projections' biases whole.
  Block(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids, bool bf16, MathMode math,
        Recompute recompute, TensorGroup* tensor, ContextGroup* context = nullptr)
      : store_(store), m_(m), layer_(m.layer_base + layer), bf16_(bf16), math_(math), mode_(recompute), t_(ids),
        tp_(tensor), seq_(tensor), cp_(context), A_(m.n_embd / (tensor ? tensor->size() : 1)),
        NH_(m.n_head / (tensor ? tensor->size() : 1)),
        F_(4 * A_) {
    check(ids.size() == layout::fc_proj_b + 1, "GPT: block " + std::to_string(layer) + " without its tensors");
    check(m.causal || m.attention == Attention::dense, "model: attention that is not causal runs on the dense kernel only");
    probe_.window = m.window_of(layer_ - 1);
    probe_.mass.assign(static_cast<size_t>(m.n_head) * AttentionProbe::kBuckets, 0.0);
  }
  AttentionProbe* attention_probe() override { return &probe_; }
  const char* name() const override { return "block"; }

  int64_t activation_floats(int B, int T) const override { return model_detail::carved(*this, B, T).kept.used(); }
  int64_t recomputed_floats(int B, int T) const override { return model_detail::carved(*this, B, T).shared.used(); }
  void set_recomputed(float* shared) override { shared_ = shared; }
  int64_t scratch_floats(int B, int T) const override {
    // dfch_gelu (also datty); under bf16 also the staging of the stashed tensors; under sequence
    // parallelism a gathered or partial [N, C] (after the staging: a product may read one while
    // writing the other) and the norms' partial weight gradients
    const int64_t N = static_cast<int64_t>(B) * T, main = padded(N * 4 * m_.n_embd);
    return main * (bf16_ ? 2 : 1) + (seq_.on() ? padded(N * m_.n_embd) + 4 * m_.n_embd : 0);
  }
  void bind(float* activations, float* scratch, int B, int T) override {
    model_detail::RecomputeCarver a{Carver(activations), Carver(shared_)};
    carve(a, B, T);
    scratch_ = scratch;
    const int64_t N = static_cast<int64_t>(B) * T;
    stage_ = scratch + padded(N * 4 * m_.n_embd);
    whole_ = stage_ + (bf16_ ? padded(N * 4 * m_.n_embd) : 0);
    norm_grads_ = whole_ + padded(N * m_.n_embd);
  }

  void forward(const Batch& b, const float* x, float* x_out) override {
    const PageLease use = store_.use_layer(layer_, {Plane::param});
    run_forward(b, x, x_out, true);
  }

  // Selective: attention's probabilities (or log-sum-exp) and output rows, and GELU.
  void recompute(const Batch& b, const float* x_in) override {
    const int64_t n = static_cast<int64_t>(b.B) * b.T * F_;
    model_detail::recompute_block(
        mode_, bf16_, store_, layer_, [&] { run_forward(b, x_in, sink_, false); }, [&] { attend(b); },
        [&] { ops::gelu_forward(fch_gelu_.writable(stage_), fch_.writable(stage_), n); });
  }

  // The forward pass under the caller's parameter lease; `first`: the micro-batch's forward
  // (probes attention), not its recomputation.
  // Under sequence parallelism x and x_out are this rank's R of the N rows (model/tensor_group.h):
  // the norms and residuals run on them, the products and attention on all N.
  void run_forward(const Batch& b, const float* x, float* x_out, bool first) {
    const int N = b.B * b.T, C = m_.n_embd, R = static_cast<int>(seq_.rows(N));
    auto P = [&](int t) { return store_.data(t_[t], Plane::param); };  // t: layout::Gpt2Block
    auto W = [&](int t) { return model_detail::weight_operand(store_, t_[t], math_.forward); };
    const int64_t RC = static_cast<int64_t>(R) * C;
    float* ln1 = ln1_.writable(stage_);
    ops::layernorm_forward(ln1, ln1_mean_, ln1_rstd_, x, P(layout::ln1_w), P(layout::ln1_b), R, C);
    ln1_.seal(ln1, RC);
    ops::linear_forward(math_.forward, qkv_, whole_rows(ln1_, N), W(layout::qkv_w), P(layout::qkv_b), N, C, 3 * A_);
    if (first) model_detail::probe_attention(probe_, b, qkv_, A_, NH_, NH_, tp_ ? tp_->rank() * NH_ : 0);
    attend(b);
    float* attproj = scratch_;  // [N, C], consumed immediately by the residual
    row_parallel_forward(attproj, atty_, W(layout::proj_w), P(layout::proj_b), N, A_);
    float* ln2 = ln2_.writable(stage_);
    ops::residual_layernorm_forward(res2_, ln2, ln2_mean_, ln2_rstd_, x, attproj, P(layout::ln2_w), P(layout::ln2_b), R,
                                    C);
    ln2_.seal(ln2, RC);
    float* fch = fch_.writable(stage_);
    const int64_t NF = static_cast<int64_t>(N) * F_;
    ops::linear_forward(math_.forward, fch, whole_rows(ln2_, N), W(layout::fc_w), P(layout::fc_b), N, C, F_);
    if (fch_.bits() != nullptr && fch_gelu_.bits() != nullptr) {  // both stashes' bits in one pass
      ops::gelu_forward_rounded(fch_.bits(), fch_gelu_.bits(), fch, NF);
    } else {
      fch_.seal(fch, NF);
      float* fch_gelu = fch_gelu_.writable(stage_);  // (under bf16: in place over the staged fch)
      ops::gelu_forward(fch_gelu, fch, NF);
      fch_gelu_.seal(fch_gelu, NF);
    }
    float* fcproj = scratch_;
    row_parallel_forward(fcproj, fch_gelu_.read(), W(layout::fc_proj_w), P(layout::fc_proj_b), N, F_);
    ops::residual_forward(x_out, res2_, fcproj, RC);
  }

  // A kept norm output as the operand of a column-parallel product: its N rows (under sequence
  // parallelism this rank's rows all-gathered into whole_, which the next gather overwrites; under
  // bf16 as the bits it keeps).
  Operand whole_rows(const Stash& kept, int N) {
    if (!seq_.on()) return kept.read();
    return seq_.gather(whole_, kept.read(), N, m_.n_embd);
  }
  // The gradient of a column-parallel product's input, partial[N, C] (this rank's columns' part),
  // summed over the tensor group into grad: all N rows (all-reduced in place: partial is grad),
  // or under sequence parallelism this rank's rows (reduce-scattered).
  void column_parallel_input_grad(float* partial, float* grad, int N) {
    if (seq_.on()) {
      seq_.scatter(partial, grad, N, m_.n_embd);
    } else if (tp_) {
      tp_->allreduce_sum(grad, static_cast<int64_t>(N) * m_.n_embd);
    }
  }

  // out[N, C] = in[N, K] . w[C, K]^T + bias: a row-parallel product (K: this rank's share of the
  // input columns) whose partial sums are all-reduced over the tensor group before the bias (kept
  // whole on every rank) is added once. Under sequence parallelism they are reduce-scattered:
  // out[0 .. R) holds this rank's R rows, with the bias.
  void row_parallel_forward(float* out, Operand in, Operand w, const float* bias, int N, int K) {
    const int C = m_.n_embd;
    if (!tp_) {
      ops::linear_forward(math_.forward, out, in, w, bias, N, K, C);
      return;
    }
    ops::linear_forward(math_.forward, out, in, w, static_cast<const float*>(nullptr), N, K, C);
    if (seq_.on()) {
      seq_.scatter(out, out, N, C);
      N = static_cast<int>(seq_.rows(N));
    } else {
      tp_->allreduce_sum(out, static_cast<int64_t>(N) * C);
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      float* row = out + static_cast<int64_t>(n) * C;
      for (int c = 0; c < C; ++c) row[c] += bias[c];
    }
  }

  // atty_ (and att_) from qkv_: this rank's NH_ heads (A_ columns of q, k and v each).
  void attend(const Batch& b) {
    if (b.kv) {
      b.kv->attend(math_.forward, layer_ - 1, qkv_, 3 * A_, atty_, b.T, probe_.window);
    } else if (cp_ != nullptr) {  // ring attention over the context group (att_: log-sum-exp)
      context_ring_attention().forward(*cp_, math_.forward, atty_, att_, qkv_, b.B, b.T, A_, NH_, NH_, probe_.window);
    } else if (m_.attention == Attention::dense) {
      ops::attention_forward(math_.forward, atty_, att_, qkv_, b.B, b.T, A_, NH_, 0, m_.causal);
    } else {  // att_ holds the rows' log-sum-exp
      ops::flash_attention_forward(math_.forward, atty_, att_, qkv_, b.B, b.T, A_, NH_, NH_, probe_.window);
    }
  }

  // Under sequence parallelism dx_out, dx_in and the norms' gradients are this rank's R rows; the
  // row-parallel outputs' gradients (dx_out's, dres2's) are gathered to all N rows and kept so for W.
  void backward_input(const Batch& b, const float* x_in, const float* dx_out, float* dx_in) override {
    const PageLease use = store_.use_layer(layer_, {Plane::param});
    const int N = b.B * b.T, C = m_.n_embd, R = static_cast<int>(seq_.rows(N));
    auto P = [&](int t) { return store_.data(t_[t], Plane::param); };  // t: layout::Gpt2Block
    auto W = [&](int t) { return model_detail::weight_operand(store_, t_[t], math_.backward); };
    const float* dout = seq_.on() ? seq_.gather(dout_, dx_out, N, C) : dx_out;
    // MLP branch: d(fcproj out) = dx_out
    float* dfch_gelu = scratch_;
    ops::linear_backward_input(math_.backward, dfch_gelu, dout, W(layout::fc_proj_w), N, F_, C, false);
    float* dln2 = seq_.on() ? whole_ : dln2_;  // (the partial sums of all N rows)
    if (dfch_.bits() != nullptr) {  // rounded straight into the stash, which both products read
      ops::gelu_backward_rounded(dfch_.bits(), dfch_gelu, fch_.read(), static_cast<int64_t>(N) * F_);
      ops::linear_backward_input(math_.backward, dln2, dfch_.read(), W(layout::fc_w), N, C, F_, false);
    } else {
      float* dfch = dfch_.writable(stage_);
      ops::gelu_backward_input(dfch, dfch_gelu, fch_.read(), static_cast<int64_t>(N) * F_);
      dfch_.seal(dfch, static_cast<int64_t>(N) * F_);
      ops::linear_backward_input(math_.backward, dln2, dfch, W(layout::fc_w), N, C, F_, false);
    }
    column_parallel_input_grad(dln2, dln2_, N);
    float* dres2 = dres2_ + seq_.first(N) * C;  // this rank's rows of it
    std::memcpy(dres2, dx_out, sizeof(float) * R * C);
    ops::layernorm_backward_input(dres2, dln2_, res2_, ln2_mean_, ln2_rstd_, P(layout::ln2_w), R, C, true);
    if (seq_.on()) seq_.gather(dres2_, dres2, N, C);
    // Attention branch: d(attproj out) = dres2
    float* datty = scratch_;
    ops::linear_backward_input(math_.backward, datty, dres2_, W(layout::proj_w), N, A_, C, false);
    if (cp_ != nullptr) {
      context_ring_attention().backward(*cp_, math_.backward, dqkv_, datty, atty_, att_, qkv_, b.B, b.T, A_, NH_, NH_,
                              probe_.window);
    } else if (m_.attention == Attention::dense) {
      ops::attention_backward_input(math_.backward, dqkv_, datty, att_, qkv_, b.B, b.T, A_, NH_, 0, m_.causal);
    } else {
      ops::flash_attention_backward_input(math_.backward, dqkv_, datty, atty_, att_, qkv_, b.B, b.T, A_, NH_, NH_,
                                          probe_.window);
    }
    float* dln1 = seq_.on() ? whole_ : dln1_;
    ops::linear_backward_input(math_.backward, dln1, dqkv_, W(layout::qkv_w), N, C, 3 * A_, false);
    column_parallel_input_grad(dln1, dln1_, N);
    std::memcpy(dx_in, dres2, sizeof(float) * R * C);
    ops::layernorm_backward_input(dx_in, dln1_, x_in, ln1_mean_, ln1_rstd_, P(layout::ln1_w), R, C, true);
  }

  // Under sequence parallelism the norm outputs are gathered again for the products' weight
  // gradients, and the norms' weight gradients (from this rank's rows) summed over the group.
  void backward_weight(const Batch& b, const float* x_in, const float* dx_out) override {
    const PageLease use = store_.use_layer(layer_, {}, {Plane::grad});
    const int N = b.B * b.T, C = m_.n_embd, R = static_cast<int>(seq_.rows(N));
    auto G = [&](int t) { return store_.data(t_[t], Plane::grad); };
    // The norms' weight gradients: straight into the gradients, or this rank's rows' part of them.
    float* partial = norm_grads_;
    if (seq_.on()) std::fill(partial, partial + 4 * C, 0.0f);
    auto NG = [&](int t, int k) { return seq_.on() ? partial + k * C : G(t); };
    ops::linear_backward_weight(math_.backward, G(layout::fc_proj_w), G(layout::fc_proj_b), seq_.on() ? dout_ : dx_out,
                                fch_gelu_.read(), N, F_, C);
    ops::linear_backward_weight(math_.backward, G(layout::fc_w), G(layout::fc_b), dfch_.read(), whole_rows(ln2_, N), N,
                                C, F_);
    ops::layernorm_backward_weight(NG(layout::ln2_w, 2), NG(layout::ln2_b, 3), dln2_, res2_, ln2_mean_, ln2_rstd_, R, C);
    ops::linear_backward_weight(math_.backward, G(layout::proj_w), G(layout::proj_b), dres2_, atty_, N, A_, C);
    ops::linear_backward_weight(math_.backward, G(layout::qkv_w), G(layout::qkv_b), dqkv_, whole_rows(ln1_, N), N, C,
                                3 * A_);
    ops::layernorm_backward_weight(NG(layout::ln1_w, 0), NG(layout::ln1_b, 1), dln1_, x_in, ln1_mean_, ln1_rstd_, R, C);
    if (seq_.on()) seq_.sum_into(partial, {G(layout::ln1_w), G(layout::ln1_b), G(layout::ln2_w), G(layout::ln2_b)}, C);
  }

 public:
  // Carves the block's tensors for micro-batches of up to B x T (kernels index with the actual B
  // and T): what the mode keeps into a.kept, what it recomputes into a.shared. Selective
  // recomputes attention's tensors and (float32) the GELU output; full everything. What B keeps
  // for W is in the shared set under either (W follows B at once but in zero-bubble schedules,
  // where W recomputes and re-runs B: GPT::backward_weight).
  // Under sequence parallelism the norms' outputs, row statistics and gradients, the residual and
  // a full recomputation's output take this rank's R rows; B keeps the gathered output gradients
  // (dres2_ of all N rows, dout_) for W, in the shared set under recomputation (a deferred W
  // re-runs B, its gathers and reduce-scatters with it, on every rank of the group alike).
  void carve(model_detail::RecomputeCarver& a, int B, int T) {
    const int64_t N = static_cast<int64_t>(B) * T, C = m_.n_embd, R = seq_.rows(N);
    const bool full = mode_ == Recompute::full, any = mode_ != Recompute::none;
    ln1_.carve(a.at(full), R * C, bf16_);
    qkv_ = a.at(full).take(N * 3 * A_);
    const int64_t rows = static_cast<int64_t>(B) * NH_ * T;  // attention_floats over this rank's heads
    att_ = a.at(any).take(m_.attention == Attention::dense ? rows * T : rows);
    atty_ = a.at(any).take(N * A_);
    res2_ = a.at(full).take(R * C);
    ln2_.carve(a.at(full), R * C, bf16_);
    fch_.carve(a.at(full), N * F_, bf16_);
    fch_gelu_.carve(a.at(full || (any && !bf16_)), N * F_, bf16_);
    ln1_mean_ = a.at(full).take(R);
    ln1_rstd_ = a.at(full).take(R);
    ln2_mean_ = a.at(full).take(R);
    ln2_rstd_ = a.at(full).take(R);
    dln1_ = a.at(any).take(R * C);
    dqkv_ = a.at(any).take(N * 3 * A_);
    dres2_ = a.at(any).take(N * C);
    dln2_ = a.at(any).take(R * C);
    dfch_.carve(a.at(any), N * F_, bf16_);
    dout_ = seq_.on() ? a.at(any).take(N * C) : nullptr;
    sink_ = full ? a.shared.take(R * C) : nullptr;
  }

 private:
  ChunkStore& store_;
  ModelConfig m_;
  int layer_;
  bool bf16_;             // stashes in bf16 (Stash)
  MathMode math_;         // its products' precision in F and in B, W
  Recompute mode_;        // train.recompute for this block
  AttentionProbe probe_;  // its window (0 = none) and the dynamic window's probe
  std::vector<TensorId> t_;  // the block's tensors, indexed by layout::Gpt2Block
  TensorGroup* tp_;          // null: unsplit
  model_detail::SequenceRows seq_;  // sequence parallelism (off without it)
  ContextGroup* cp_;         // null: no context parallelism
  int A_, NH_, F_;           // this rank's attention columns (of q, k, v each), heads and MLP units
  float* shared_ = nullptr;  // the shared recomputed set (Layer::set_recomputed)
  float* sink_ = nullptr;    // full: the recomputed forward's output (its bytes are already x_out)
  // att_: the dense kernel's probabilities [B, NH, T, T], or the blockwise kernel's log-sum-exp [B, NH, T].
  Stash ln1_, ln2_, fch_, fch_gelu_, dfch_;
  float *qkv_ = nullptr, *att_ = nullptr, *atty_ = nullptr, *res2_ = nullptr, *ln1_mean_ = nullptr,
        *ln1_rstd_ = nullptr, *ln2_mean_ = nullptr, *ln2_rstd_ = nullptr, *dln1_ = nullptr, *dqkv_ = nullptr,
        *dres2_ = nullptr, *dln2_ = nullptr, *scratch_ = nullptr, *stage_ = nullptr;
  // Sequence parallelism: the output gradient of all N rows (kept from B for W); in the scratch,
  // a gathered or partial [N, C] and the norms' partial weight gradients [4, C].
  float *dout_ = nullptr, *whole_ = nullptr, *norm_grads_ = nullptr;
};


}  // namespace

GPT::GPT(const ModelConfig& config, ChunkStore& store, std::vector<LayerRange> ranges, bool bf16_activations,
         MathMode math, RecomputePlan recompute, TensorGroup* tensor, ContextGroup* context, ExpertGroup* experts)
    : config_(config),
      store_(store),
      ranges_(std::move(ranges)),
      bf16_(bf16_activations),
      recompute_(recompute),
      math_(math),
      tensor_(tensor),
      context_(context) {
  validate_model(config, "model");
  check(!store.finalized(), "GPT: the chunk store is already finalized");
  const int L = config.n_layer + 2;
  local_ = local_layers(config, ranges_);
  if (ranges_.empty()) ranges_.push_back({0, L - 1});
  layers_.resize(L);
  times_ = LayerTimes{std::vector<double>(L, 0.0), std::vector<double>(L, 0.0), std::vector<double>(L, 0.0)};
  // The layout names every tensor; the layers find theirs by index (model/model_layout.h).
  layout_ = model_layout(config, ranges_, tensor ? TensorPlace{tensor->rank(), tensor->size()} : TensorPlace{},
                         experts ? ExpertPlace{experts->rank(), experts->size()} : ExpertPlace{});
  const ModelLayout& layout = layout_;
  ids_ = register_layout(store, layout);
  const std::vector<TensorId>& ids = ids_;
  tied_ = layout.tied;
  auto of = [&](int layer) { return layer_tensors(layout, ids, config.layer_base + layer); };
  if (local_[0]) layers_[0] = std::make_unique<Embedding>(config, store, of(0), tensor, context);
  for (int l = 1; l <= config.n_layer; ++l) {
    if (!local_[l]) continue;
    const Recompute mode = recompute_.at_layer(l);
    layers_[l] = config.llama() ? make_llama_block(config, store, l, of(l), bf16_, math_, mode, tensor, context)
                                : std::make_unique<Block>(config, store, l, of(l), bf16_, math_, mode, tensor, context);
  }
  if (local_[L - 1]) {
    // A tied head reads wte: the embedding's, or (a rank without it) the replica in the layout.
    const TensorId wte = tied_.empty() ? -1 : ids[layout.index(config.tensor_prefix + "wte")];
    layers_[L - 1] = make_head(config, store, L - 1, of(L - 1), wte, bf16_, math_, tensor);
  }
  if (experts != nullptr) {
    for (auto& layer : layers_) {
      if (MoeFeedForward* moe = layer ? layer->moe() : nullptr) moe->set_expert_group(experts);
    }
  }
}

GPT::~GPT() = default;

bool GPT::holds_any(const std::vector<int>& layers) const {
  return std::any_of(layers.begin(), layers.end(), [&](int l) { return l >= 0 && l < num_layers() && local_[l]; });
}

bool GPT::whole() const { return ranges_.size() == 1 && ranges_[0].first == 0 && ranges_[0].last == num_layers() - 1; }

void GPT::init_weights(uint64_t seed) {
  check(store_.finalized(), "GPT::init_weights: the chunk store is not finalized");
  const double residual_std = 0.02 / std::sqrt(2.0 * config_.n_layer);
  const std::string& prefix = config_.tensor_prefix;  // a shared store: only this model's tensors
  // Only the elements whose home is this store are written (ZeRO-3: this rank's shard; the whole
  // model otherwise). Each tensor's values come from its own stream, so a rank holding part of a
  // tensor draws the values before its part and drops them: every element gets the value one
  // rank holding the whole model gives it.
  const auto [home_first, home_last] = store_.param_home_elements();
  // Every tensor of this model's prefix: the layout's, and any a tower adds to it (a CLIP text
  // tower's head norm), which are never tensor shards.
  std::vector<const TensorShard*> shard_of(store_.tensors().size(), nullptr);
  for (size_t k = 0; k < layout_.tensors.size(); ++k) shard_of[ids_[k]] = &layout_.shards[k];
  const TensorShard whole_tensor;
  for (int id = 0; id < static_cast<int>(store_.tensors().size()); ++id) {
    const TensorInfo& info = store_.tensors()[id];
    const TensorSpec& spec = info.spec;
    if (spec.name.compare(0, prefix.size(), prefix) != 0) continue;
    const TensorShard& shard = shard_of[id] != nullptr ? *shard_of[id] : whole_tensor;
    const int64_t lo = std::clamp<int64_t>(home_first - info.offset, 0, info.numel);
    const int64_t hi = std::clamp<int64_t>(home_last - info.offset, 0, info.numel);
    if (lo >= hi) continue;
    // A part of a tensor split over tensor ranks (one tensor rank holds its tensors whole).
    const int64_t whole_numel =
        shard.split() ? std::accumulate(shard.whole_shape.begin(), shard.whole_shape.end(), int64_t{1}, std::multiplies<>())
                      : info.numel;
    const bool tensor_part = whole_numel > info.numel;
    // With tiers: fetched, then written home.
    const PageLease use = store_.use_range(Plane::param, info.offset + lo, hi - lo, /*write=*/true);
    std::span<float> w = store_.range_view(Plane::param, info.offset, info.numel);
    // The stream its values come from (TensorShard::stream: a routed expert's is its stack's).
    const std::string& stream = shard.stream.empty() ? spec.name : shard.stream;
    const std::string n = stream.substr(prefix.size());
    auto ends_with = [&](const char* suffix) {
      const size_t k = std::strlen(suffix);
      return n.size() >= k && n.compare(n.size() - k, k, suffix) == 0;
    };
    if (spec.kind == ChunkKind::norm) {
      std::fill(w.begin() + lo, w.begin() + hi, ends_with(".w") ? 1.0f : 0.0f);
    } else if (spec.shape.size() == 1) {
      std::fill(w.begin() + lo, w.begin() + hi, 0.0f);  // biases
    } else if (tensor_part) {
      // A tensor shard draws the whole tensor's stream and keeps its part: the same weights as
      // the whole model's, on any number of tensor ranks (a routed expert's: its part of its stack's).
      Rng rng(seed ^ hash_name(stream));
      for (int64_t i = 0; i < 2 * shard.stream_first; ++i) rng.next_u64();
      const double std = (ends_with("attn.proj.w") || ends_with("mlp.proj.w")) ? residual_std : 0.02;
      std::vector<float> whole(static_cast<size_t>(whole_numel));
      // Only real vocabulary rows of wte (and of an untied head) are drawn; padded rows stay zero.
      const int64_t used = n == "wte" || n == "lm_head.w" ? static_cast<int64_t>(config_.vocab_size) * config_.n_embd
                                                          : static_cast<int64_t>(whole.size());
      for (int64_t i = 0; i < used; ++i) whole[i] = static_cast<float>(rng.normal() * std);
      std::fill(whole.begin() + used, whole.end(), 0.0f);
      if (lo == 0 && hi == info.numel) {
        slice_shard(shard, layout_.place, whole.data(), w.data());
      } else {  // ZeRO-3 over a tensor shard: only the shard's home elements
        std::vector<float> part(static_cast<size_t>(info.numel));
        slice_shard(shard, layout_.place, whole.data(), part.data());
        std::copy(part.begin() + lo, part.begin() + hi, w.begin() + lo);
      }
    } else {
      Rng rng(seed ^ hash_name(stream));
      const double std = (ends_with("attn.proj.w") || ends_with("mlp.proj.w")) ? residual_std : 0.02;
      const int64_t used = n == "wte" || n == "lm_head.w" ? static_cast<int64_t>(config_.vocab_size) * config_.n_embd
                                                          : static_cast<int64_t>(w.size());
      // The stream's values before this tensor's (each normal() draws two words).
      for (int64_t i = 0; i < 2 * shard.stream_first; ++i) rng.next_u64();
      for (int64_t i = 0; i < std::min(lo, used); ++i) rng.normal();  // another rank's part
      for (int64_t i = lo; i < std::min(hi, used); ++i) w[i] = static_cast<float>(rng.normal() * std);
      if (hi > used) std::fill(w.begin() + std::max(lo, used), w.begin() + hi, 0.0f);
    }
  }
}

void GPT::allocate(int B, int T, int slots) {
  check(B >= 1 && T >= 1 && T <= config_.max_seq_len,
        "model: sequence length " + std::to_string(T) + " exceeds max_seq_len " + std::to_string(config_.max_seq_len));
  check(slots >= 1, "model: at least one activation slot");
  max_B_ = B;
  max_T_ = T;
  // (Under sequence parallelism the layers' outputs and their gradients are this rank's rows.)
  const int64_t N = model_detail::SequenceRows(tensor_).rows(static_cast<int64_t>(B) * T), C = config_.n_embd;
  const int L = num_layers();
  // Per slot: each local layer's activations, its output and the output's gradient, and the
  // input (and its gradient) of each range that does not start at the embedding.
  std::vector<bool> io(L, false);
  for (const LayerRange& r : ranges_) {
    for (int i = r.first; i <= r.last; ++i) io[i] = true;
    if (r.first > 0) io[r.first - 1] = true;
  }
  int64_t scratch = 0, slot = 0;
  for (int i = 0; i < L; ++i) {
    if (layers_[i]) {
      slot += padded(layers_[i]->activation_floats(B, T));
      scratch = std::max(scratch, layers_[i]->scratch_floats(B, T));
    }
    if (io[i]) slot += 2 * padded(N * C);
  }
  slot_floats_ = slot;
  recomputed_floats_ = recomputed_floats_for(B, T);
  activation_floats_ = padded(scratch) + recomputed_floats_ + slots * slot;
  memory_.reset(new float[activation_floats_]);
  std::memset(memory_.get(), 0, sizeof(float) * activation_floats_);
  Carver carve(memory_.get());
  scratch_ = carve.take(scratch);
  if (recomputed_floats_ > 0) {
    float* set = carve.take(recomputed_floats_ - padded(N * C));
    recompute_sink_ = carve.take(N * C);
    for (int i = 0; i < L; ++i) {
      if (layers_[i]) layers_[i]->set_recomputed(set);
    }
  }
  shared_owner_ = SharedOwner{};
  act_.assign(slots, std::vector<float*>(L, nullptr));
  x_.assign(slots, std::vector<float*>(L, nullptr));
  dx_.assign(slots, std::vector<float*>(L, nullptr));
  for (int k = 0; k < slots; ++k) {
    for (int i = 0; i < L; ++i) {
      if (layers_[i]) act_[k][i] = carve.take(layers_[i]->activation_floats(B, T));
      if (io[i]) {
        x_[k][i] = carve.take(N * C);
        dx_[k][i] = carve.take(N * C);
      }
    }
  }
  bound_.assign(L, -1);
  for (int i = 0; i < L; ++i) {
    if (layers_[i]) bind(0, i);
  }
}

int64_t GPT::slot_bytes_for(const ModelConfig& config, const LayerRange& range, int B, int T, bool bf16_activations,
                            RecomputePlan recompute) {
  ChunkStore registry(1 << 20);  // holds tensor specs only: never finalized, so nothing is allocated
  const GPT stage(config, registry, {range}, bf16_activations, {}, recompute);
  const int64_t N = static_cast<int64_t>(B) * T;
  int64_t floats = range.first > 0 ? 2 * padded(N * config.n_embd) : 0;
  for (int i = range.first; i <= range.last; ++i) {
    floats += padded(stage.layers_[i]->activation_floats(B, T)) + 2 * padded(N * config.n_embd);
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

int64_t GPT::recomputed_floats_for(int B, int T) const {
  int64_t shared = 0;
  for (const std::unique_ptr<Layer>& layer : layers_) {
    if (layer) shared = std::max(shared, padded(layer->recomputed_floats(B, T)));
  }
  // (the re-run B's input gradient: this rank's rows under sequence parallelism)
  const int64_t rows = model_detail::SequenceRows(tensor_).rows(static_cast<int64_t>(B) * T);
  return shared > 0 ? shared + padded(rows * config_.n_embd) : 0;
}

int64_t GPT::recomputed_bytes_for(const ModelConfig& config, const LayerRange& range, int B, int T,
                                  bool bf16_activations, RecomputePlan recompute) {
  ChunkStore registry(1 << 20);  // (as slot_bytes_for)
  const GPT stage(config, registry, {range}, bf16_activations, {}, recompute);
  return stage.recomputed_floats_for(B, T) * static_cast<int64_t>(sizeof(float));
}

void GPT::bind(int slot, int layer) {
  if (bound_[layer] == slot) return;
  layers_[layer]->bind(act_[slot][layer], scratch_, max_B_, max_T_);
  bound_[layer] = slot;
}

void GPT::rebuild(int slot, int i, const Batch& batch) {
  if (shared_owner_.slot == slot && shared_owner_.layer == i) return;
  layers_[i]->recompute(batch, input(slot, i));
  shared_owner_ = SharedOwner{slot, i, false};
}

void GPT::check_batch(const Batch& batch, int slot) const {
  check(batch.B <= max_B_ && batch.T <= max_T_, "model: batch " + std::to_string(batch.B) + "x" +
                                                    std::to_string(batch.T) + " exceeds the allocated " +
                                                    std::to_string(max_B_) + "x" + std::to_string(max_T_));
  check(slot >= 0 && slot < slots(), "model: activation slot " + std::to_string(slot) + " of " + std::to_string(slots()));
  if (batch.kv != nullptr && batch.B != 1) throw Error("model: a KV-cached pass runs one sequence (batch of 1)");
  if (model_detail::SequenceRows(tensor_).on()) {
    const int T = tensor_->size();
    check(batch.kv == nullptr, "model: a KV-cached pass under sequence parallelism is not built");
    check(static_cast<int64_t>(batch.B) * batch.T % T == 0,
          "model: sequence parallelism needs a batch's B x T tokens (" + std::to_string(batch.B) + " x " +
              std::to_string(batch.T) + ") divisible by the " + std::to_string(T) + " tensor ranks");
  }
}

double GPT::timed(std::chrono::steady_clock::time_point t0) const {
  if (slowdown_ > 1) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>((slowdown_ - 1) * ms_since(t0)));
  }
  return ms_since(t0);
}

float GPT::forward(const Batch& batch) {
  check(whole(), "model: forward of the whole model on a pipeline stage");
  return forward(LayerRange{0, num_layers() - 1}, 0, batch);
}

float GPT::forward(const LayerRange& range, int slot, const Batch& batch) {
  check_batch(batch, slot);
  const std::vector<float*>& x = x_[slot];
  for (int i = range.first; i <= range.last; ++i) {
    bind(slot, i);
    const auto t0 = std::chrono::steady_clock::now();
    layers_[i]->forward(batch, i == 0 ? nullptr : x[i - 1], x[i]);
    times_.forward[i] += timed(t0);
    if (recompute_.at_layer(i) != Recompute::none) shared_owner_ = SharedOwner{slot, i, false};
  }
  return range.last == num_layers() - 1 ? static_cast<OutputLayer&>(*layers_.back()).mean_loss() : 0.0f;
}

void GPT::backward_input(const LayerRange& range, int slot, const Batch& batch, BackwardObserver* observer) {
  check_batch(batch, slot);
  for (int i = range.last; i >= range.first; --i) {
    if (i >= frozen_) {  // below a frozen layer every layer is frozen: no gradient is wanted there
      bind(slot, i);
      const auto t0 = std::chrono::steady_clock::now();
      const bool recomputing = recompute_.at_layer(i) != Recompute::none;
      if (recomputing) rebuild(slot, i, batch);
      layers_[i]->backward_input(batch, input(slot, i), output_grad(slot, i), i == 0 ? nullptr : dx_[slot][i - 1]);
      if (recomputing) shared_owner_.backward = true;
      times_.backward_input[i] += timed(t0);
    }
    if (observer != nullptr) observer->after_backward_input(config_.layer_base + i);
  }
}

void GPT::backward_weight(const LayerRange& range, int slot, const Batch& batch, BackwardObserver* observer) {
  check_batch(batch, slot);
  for (int i = range.last; i >= range.first; --i) {
    if (i >= frozen_) {
      bind(slot, i);
      const auto t0 = std::chrono::steady_clock::now();
      const SharedOwner mine{slot, i, true};
      if (recompute_.at_layer(i) != Recompute::none &&
          (shared_owner_.slot != slot || shared_owner_.layer != i || !shared_owner_.backward)) {
        rebuild(slot, i, batch);
        layers_[i]->backward_input(batch, input(slot, i), output_grad(slot, i), recompute_sink_);
        shared_owner_ = mine;
      }
      layers_[i]->backward_weight(batch, input(slot, i), output_grad(slot, i));
      times_.backward_weight[i] += timed(t0);
    }
    if (observer != nullptr) observer->after_backward_weight(config_.layer_base + i);
  }
}

void GPT::backward(const LayerRange& range, int slot, const Batch& batch, BackwardObserver* input_observer,
                   BackwardObserver* weight_observer) {
  for (int i = range.last; i >= range.first; --i) {
    backward_input(LayerRange{i, i}, slot, batch, input_observer);
    backward_weight(LayerRange{i, i}, slot, batch, weight_observer);
  }
}

void GPT::backward(const Batch& batch, bool defer_weight_grads, BackwardObserver* observer) {
  check(whole(), "model: backward of the whole model on a pipeline stage");
  const int L = num_layers();
  if (defer_weight_grads) {
    backward_input(LayerRange{0, L - 1}, 0, batch, observer);
    backward_weight(LayerRange{0, L - 1}, 0, batch, observer);
    return;
  }
  backward(LayerRange{0, L - 1}, 0, batch, observer, observer);
}

GPT::LayerTimes GPT::take_layer_times() {
  LayerTimes out = times_;
  for (std::vector<double>* v : {&times_.forward, &times_.backward_input, &times_.backward_weight}) {
    std::fill(v->begin(), v->end(), 0.0);
  }
  return out;
}

int64_t GPT::layer_activation_bytes(int i, int B, int T) const {
  const int64_t io = 2 * padded(model_detail::SequenceRows(tensor_).rows(static_cast<int64_t>(B) * T) * config_.n_embd);
  return (layers_[i] ? padded(layers_[i]->activation_floats(B, T)) + io : 0) * static_cast<int64_t>(sizeof(float));
}

const float* GPT::logits() {
  bind(0, num_layers() - 1);
  return static_cast<const OutputLayer&>(*layers_.back()).logits();
}

double GPT::train_flops_per_token(int T) const {
  const double C = config_.n_embd, L = config_.n_layer, Vp = config_.padded_vocab_size;
  if (config_.llama()) {
    // per token, forward: qkv 2*C*(C + 2kv), proj 2C^2, gate+up 2*C*2H, down 2*H*C, attention 4TC, head 2*C*Vp
    const double H = config_.ffn_hidden, QKV = config_.qkv_dim();
    return 3 * (L * (2 * C * QKV + 2 * C * C + 6 * C * H + 4.0 * T * C) + 2 * C * Vp);
  }
  // per token, forward: qkv 2*3C^2, proj 2C^2, fc 2*4C^2, fcproj 2*4C^2, attention 2*2*T*C, head 2*C*Vp
  const double forward = L * (2 * 12 * C * C + 4.0 * T * C) + 2 * C * Vp;
  return 3 * forward;  // backward = 2x forward (B and W)
}

}  // namespace keel
