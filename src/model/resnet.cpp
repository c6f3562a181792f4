#include "model/resnet.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/conv.h"
#include "kernels/cpu/ops.h"

namespace keel {

namespace {

int groups_for(int channels) { return std::min(32, channels); }

// The residual blocks in order: torchvision's names, channels and strides, and whether the block
// has the shortcut convolution (where its shape changes). resnet_layout and the tower walk this.
struct BlockPlan {
  std::string name;  // "layer{stage}.{i}"
  int in_channels = 0, planes = 0, out_channels = 0, stride = 1;
  bool shortcut = false;
};

std::vector<BlockPlan> block_plan(const ResNetSpec& spec) {
  std::vector<BlockPlan> out;
  int channels = spec.width;
  for (int stage = 0; stage < 4; ++stage) {
    const int planes = spec.width << stage;
    for (int i = 0; i < spec.layers[stage]; ++i) {
      BlockPlan b;
      b.name = "layer" + std::to_string(stage + 1) + "." + std::to_string(i);
      b.in_channels = channels;
      b.planes = planes;
      b.out_channels = planes * spec.expansion();
      b.stride = stage > 0 && i == 0 ? 2 : 1;
      b.shortcut = b.stride != 1 || b.in_channels != b.out_channels;
      channels = b.out_channels;
      out.push_back(std::move(b));
    }
  }
  return out;
}

std::vector<float> buffer(int64_t n) { return std::vector<float>(static_cast<size_t>(std::max<int64_t>(n, 1))); }

// The tower's tensor ids in resnet_layout's order, taken one by one as the units are built (each
// convolution and norm, then the projection: the order resnet_layout lists them in).
class TensorCursor {
 public:
  TensorCursor(const ChunkStore& store, std::vector<TensorId> ids) : store_(store), ids_(std::move(ids)) {}
  TensorId take() {
    check(next_ < ids_.size(), "resnet: the tower asks for more tensors than its layout lists");
    return ids_[next_++];
  }
  const TensorSpec& spec(TensorId id) const { return store_.tensors()[id].spec; }
  bool done() const { return next_ == ids_.size(); }

 private:
  const ChunkStore& store_;
  std::vector<TensorId> ids_;
  size_t next_ = 0;
};

// A convolution without bias and the GroupNorm after it (with the ReLU fused where the unit has
// one). Keeps for the backward pass: the convolution's output c (GroupNorm's input), the norm's
// output y and statistics; the gradient dy of y is written here by whoever consumes y.
class ConvNorm {
 public:
  // The convolution's weight [K, C, kernel, kernel], then the norm's weight and bias, from `t`.
  ConvNorm(ChunkStore& store, TensorCursor& t, int stride, int H, bool relu)
      : store_(store), relu_(relu), w_(t.take()), gamma_(t.take()), beta_(t.take()) {
    const std::vector<int64_t>& w = t.spec(w_).shape;
    s_.H = s_.W = H;
    s_.K = static_cast<int>(w[0]);
    s_.C = static_cast<int>(w[1]);
    s_.R = s_.S = static_cast<int>(w[2]);
    s_.stride = stride;
    s_.pad = s_.R / 2;
    s_.N = 1;
    G_ = groups_for(s_.K);
    check(s_.K % G_ == 0, "resnet: " + t.spec(gamma_).name + ": " + std::to_string(s_.K) +
                              " channels do not split into " + std::to_string(G_) + " groups");
  }
  int out_size() const { return s_.P(); }
  int channels() const { return s_.K; }
  int64_t out_per_sample() const { return static_cast<int64_t>(s_.P()) * s_.Q() * s_.K; }
  double macs_per_sample() const { return static_cast<double>(out_per_sample()) * s_.C * s_.R * s_.S; }

  void allocate(int B) {
    const int64_t n = B * out_per_sample();
    c_ = buffer(n);
    y_ = buffer(n);
    dy_ = buffer(n);
    dc_ = buffer(n);
    mean_ = buffer(static_cast<int64_t>(B) * G_);
    rstd_ = buffer(static_cast<int64_t>(B) * G_);
  }
  int64_t activation_floats() const {
    return static_cast<int64_t>(c_.size() + y_.size() + dy_.size() + dc_.size() + mean_.size() + rstd_.size());
  }
  const float* y() const { return y_.data(); }
  float* dy() { return dy_.data(); }

  void forward(MatmulPrecision precision, const float* x, int B) {
    ops::ConvShape s = shape(B);
    ops::conv2d_forward(precision, c_.data(), x, P(w_), s);
    ops::groupnorm_forward(y_.data(), mean_.data(), rstd_.data(), c_.data(), P(gamma_), P(beta_), B, s.P() * s.Q(),
                           s.K, G_, relu_);
  }
  // dc from dy; then dx (= or +=) the convolution's input gradient (dx null: the images, none wanted).
  void backward_input(MatmulPrecision precision, float* dx, bool accumulate, int B) {
    ops::ConvShape s = shape(B);
    ops::groupnorm_backward_input(dc_.data(), dy_.data(), c_.data(), y_.data(), mean_.data(), rstd_.data(), P(gamma_),
                                  B, s.P() * s.Q(), s.K, G_, relu_, false);
    if (dx != nullptr) ops::conv2d_backward_input(precision, dx, dc_.data(), P(w_), s, accumulate);
  }
  void backward_weight(MatmulPrecision precision, const float* x, int B) {
    ops::ConvShape s = shape(B);
    ops::conv2d_backward_weight(precision, G(w_), dc_.data(), x, s);
    ops::groupnorm_backward_weight(G(gamma_), G(beta_), dy_.data(), c_.data(), y_.data(), mean_.data(), rstd_.data(),
                                   B, s.P() * s.Q(), s.K, G_, relu_);
  }

 private:
  ops::ConvShape shape(int B) const {
    ops::ConvShape s = s_;
    s.N = B;
    return s;
  }
  float* P(TensorId id) { return store_.data(id, Plane::param); }
  float* G(TensorId id) { return store_.data(id, Plane::grad); }

  ChunkStore& store_;
  bool relu_;
  ops::ConvShape s_;
  TensorId w_ = -1, gamma_ = -1, beta_ = -1;
  int G_ = 1;
  std::vector<float> c_, y_, dy_, dc_, mean_, rstd_;
};

// One layer of the tower: reads the previous unit's output (the images for the stem), leaves its
// own in out(); its output's gradient arrives in dout().
class Unit {
 public:
  virtual ~Unit() = default;
  virtual void allocate(int B) = 0;
  virtual void forward(MatmulPrecision precision, const float* x, int B) = 0;
  virtual const float* out() const = 0;
  virtual float* dout() = 0;
  virtual void backward_input(MatmulPrecision precision, const float* x, float* dx,
                              int B) = 0;  // dx null: no input gradient wanted
  virtual void backward_weight(MatmulPrecision precision, const float* x, int B) = 0;
  virtual double macs_per_sample() const = 0;
  virtual int64_t activation_floats() const = 0;
};

// conv1 7 x 7 / 2 -> GroupNorm -> ReLU -> max pool 3 x 3 / 2.
class Stem final : public Unit {
 public:
  Stem(ChunkStore& store, TensorCursor& t, const ResNetSpec& spec)
      : conv_(store, t, 2, spec.image_size, true),
        H_(conv_.out_size()),
        C_(spec.width),
        P_(ops::pool_out(H_, 3, 2, 1)) {}
  int out_size() const { return P_; }
  void allocate(int B) override {
    conv_.allocate(B);
    out_ = buffer(static_cast<int64_t>(B) * P_ * P_ * C_);
    dout_ = buffer(static_cast<int64_t>(B) * P_ * P_ * C_);
    arg_.assign(out_.size(), 0);
  }
  void forward(MatmulPrecision precision, const float* x, int B) override {
    conv_.forward(precision, x, B);
    ops::maxpool_forward(out_.data(), arg_.data(), conv_.y(), B, H_, H_, C_, 3, 2, 1);
  }
  const float* out() const override { return out_.data(); }
  float* dout() override { return dout_.data(); }
  void backward_input(MatmulPrecision precision, const float*, float* dx, int B) override {
    ops::maxpool_backward_input(conv_.dy(), dout_.data(), arg_.data(), B, H_, H_, C_, P_, P_);
    conv_.backward_input(precision, dx, false, B);
  }
  void backward_weight(MatmulPrecision precision, const float* x, int B) override {
    conv_.backward_weight(precision, x, B);
  }
  double macs_per_sample() const override { return conv_.macs_per_sample(); }
  int64_t activation_floats() const override {
    return conv_.activation_floats() + static_cast<int64_t>(out_.size() * 2 + arg_.size());
  }

 private:
  ConvNorm conv_;
  int H_, C_, P_;
  std::vector<float> out_, dout_;
  std::vector<int32_t> arg_;
};

// A residual block: basic (3 x 3 -> 3 x 3) or bottleneck (1 x 1 -> 3 x 3 (stride) -> 1 x 1, x4
// channels), the shortcut through a 1 x 1 convolution and GroupNorm where the shape changes;
// out = ReLU(main + shortcut).
class ResidualBlock final : public Unit {
 public:
  // `shortcut`: the block has the downsampling convolution (resnet_layout lists it last).
  ResidualBlock(ChunkStore& store, TensorCursor& t, const ResNetSpec& spec, int in_channels, int stride, int H,
                bool shortcut) {
    if (spec.block == "bottleneck") {
      units_.emplace_back(store, t, 1, H, true);
      units_.emplace_back(store, t, stride, H, true);
      const int H2 = units_.back().out_size();
      units_.emplace_back(store, t, 1, H2, false);
    } else {
      units_.emplace_back(store, t, stride, H, true);
      const int H2 = units_.back().out_size();
      units_.emplace_back(store, t, 1, H2, false);
    }
    if (shortcut) down_.emplace_back(store, t, stride, H, false);
    out_size_ = units_.back().out_size();
    in_floats_ = static_cast<int64_t>(H) * H * in_channels;
  }
  int out_size() const { return out_size_; }
  void allocate(int B) override {
    for (ConvNorm& u : units_) u.allocate(B);
    for (ConvNorm& u : down_) u.allocate(B);
    out_ = buffer(B * units_.back().out_per_sample());
    dout_ = buffer(B * units_.back().out_per_sample());
  }
  void forward(MatmulPrecision precision, const float* x, int B) override {
    const float* in = x;
    for (ConvNorm& u : units_) {
      u.forward(precision, in, B);
      in = u.y();
    }
    const float* shortcut = x;
    if (!down_.empty()) {
      down_[0].forward(precision, x, B);
      shortcut = down_[0].y();
    }
    ops::add_relu_forward(out_.data(), units_.back().y(), shortcut, B * units_.back().out_per_sample());
  }
  const float* out() const override { return out_.data(); }
  float* dout() override { return dout_.data(); }
  void backward_input(MatmulPrecision precision, const float* x, float* dx, int B) override {
    const int64_t n = B * units_.back().out_per_sample();
    float* dsum = units_.back().dy();  // the gradient of main + shortcut, before the ReLU
    ops::relu_backward(dsum, dout_.data(), out_.data(), n);
    if (!down_.empty()) std::memcpy(down_[0].dy(), dsum, sizeof(float) * static_cast<size_t>(n));
    for (size_t i = units_.size(); i-- > 1;) units_[i].backward_input(precision, units_[i - 1].dy(), false, B);
    units_[0].backward_input(precision, dx, false, B);
    if (!down_.empty()) {
      down_[0].backward_input(precision, dx, true, B);
    } else {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) dx[i] += dsum[i];
    }
    (void)x;
  }
  void backward_weight(MatmulPrecision precision, const float* x, int B) override {
    const float* in = x;
    for (ConvNorm& u : units_) {
      u.backward_weight(precision, in, B);
      in = u.y();
    }
    for (ConvNorm& u : down_) u.backward_weight(precision, x, B);
  }
  double macs_per_sample() const override {
    double m = 0;
    for (const ConvNorm& u : units_) m += u.macs_per_sample();
    for (const ConvNorm& u : down_) m += u.macs_per_sample();
    return m;
  }
  int64_t activation_floats() const override {
    int64_t n = static_cast<int64_t>(out_.size() + dout_.size());
    for (const ConvNorm& u : units_) n += u.activation_floats();
    for (const ConvNorm& u : down_) n += u.activation_floats();
    return n;
  }

 private:
  std::vector<ConvNorm> units_;
  std::vector<ConvNorm> down_;  // empty, or the shortcut's convolution and norm
  int out_size_ = 0;
  int64_t in_floats_ = 0;
  std::vector<float> out_, dout_;
};

// Global average pool -> projection (no bias) into the shared embedding: features[B, D].
class PoolProject final : public Unit {
 public:
  PoolProject(ChunkStore& store, TensorCursor& t, const ResNetSpec& spec, int H)
      : store_(store), HW_(H * H), C_(spec.out_channels()), D_(spec.embed_dim), proj_(t.take()) {}
  void allocate(int B) override {
    pooled_ = buffer(static_cast<int64_t>(B) * C_);
    dpooled_ = buffer(static_cast<int64_t>(B) * C_);
    out_ = buffer(static_cast<int64_t>(B) * D_);
    dout_ = buffer(static_cast<int64_t>(B) * D_);
  }
  void forward(MatmulPrecision precision, const float* x, int B) override {
    ops::avgpool_forward(pooled_.data(), x, B, HW_, C_);
    ops::linear_forward(precision, out_.data(), pooled_.data(), store_.data(proj_, Plane::param),
                        static_cast<const float*>(nullptr), B, C_, D_);
  }
  const float* out() const override { return out_.data(); }
  float* dout() override { return dout_.data(); }
  void backward_input(MatmulPrecision precision, const float*, float* dx, int B) override {
    ops::linear_backward_input(precision, dpooled_.data(), dout_.data(), store_.data(proj_, Plane::param), B, C_, D_,
                               false);
    ops::avgpool_backward_input(dx, dpooled_.data(), B, HW_, C_);
  }
  void backward_weight(MatmulPrecision precision, const float*, int B) override {
    ops::linear_backward_weight(precision, store_.data(proj_, Plane::grad), static_cast<float*>(nullptr), dout_.data(),
                                pooled_.data(), B, C_, D_);
  }
  double macs_per_sample() const override { return static_cast<double>(C_) * D_; }
  int64_t activation_floats() const override {
    return static_cast<int64_t>(pooled_.size() + dpooled_.size() + out_.size() + dout_.size());
  }

 private:
  ChunkStore& store_;
  int HW_, C_, D_;
  TensorId proj_;
  std::vector<float> pooled_, dpooled_, out_, dout_;
};

class ResNet final : public Tower {
 public:
  ResNet(const ResNetSpec& spec, ChunkStore& store, MatmulPrecision precision)
      : spec_(spec), store_(store), math_(visual_math(spec.quant, precision)) {
    validate_resnet(spec);
    check(!store.finalized(), "resnet: the chunk store is already finalized");
    TensorCursor t(store, register_layout(store, resnet_layout(spec)));
    auto stem = std::make_unique<Stem>(store, t, spec);
    int H = stem->out_size();
    units_.push_back(std::move(stem));
    for (const BlockPlan& b : block_plan(spec)) {
      auto block = std::make_unique<ResidualBlock>(store, t, spec, b.in_channels, b.stride, H, b.shortcut);
      H = block->out_size();
      units_.push_back(std::move(block));
    }
    units_.push_back(std::make_unique<PoolProject>(store, t, spec, H));
    check(t.done(), "resnet: the tower uses fewer tensors than its layout lists");
  }
  const char* name() const override { return "resnet"; }
  int first_layer() const override { return spec_.layer_base; }
  int num_layers() const override { return static_cast<int>(units_.size()); }
  int out_dim() const override { return spec_.embed_dim; }

  void init_weights(uint64_t seed) override {
    check(store_.finalized(), "resnet: init_weights before the store is finalized");
    for (int id = 0; id < static_cast<int>(store_.tensors().size()); ++id) {
      const TensorSpec& t = store_.tensors()[id].spec;
      if (t.name.compare(0, spec_.prefix.size(), spec_.prefix) != 0) continue;
      const PageLease use = store_.use_tensor(id, {}, {Plane::param});
      std::span<float> w = store_.view(id, Plane::param);
      if (t.kind == ChunkKind::norm) {  // GroupNorm: unit scale, zero shift
        const bool scale = t.name.size() > 7 && t.name.compare(t.name.size() - 7, 7, ".weight") == 0;
        std::fill(w.begin(), w.end(), scale ? 1.0f : 0.0f);
        continue;
      }
      // Convolutions: He's normal with fan-out (torchvision's); the projection: N(0, 1/C).
      const double std = t.kind == ChunkKind::head
                             ? 1.0 / std::sqrt(static_cast<double>(t.shape[1]))
                             : std::sqrt(2.0 / static_cast<double>(t.shape[0] * t.shape[2] * t.shape[3]));
      Rng rng(seed ^ hash_name(t.name));
      for (float& v : w) v = static_cast<float>(rng.normal() * std);
    }
  }

  void allocate(int B, int) override {
    check(B >= 1, "resnet: a micro-batch of at least one image");
    for (auto& u : units_) u->allocate(B);
    max_B_ = B;
  }

  const float* forward(const ClipBatch& b) override {
    check_batch(b);
    const float* x = b.images;
    for (size_t i = 0; i < units_.size(); ++i) {
      const PageLease use = store_.use_layer(first_layer() + static_cast<int>(i), {Plane::param});
      units_[i]->forward(math_.forward, x, b.B);
      x = units_[i]->out();
    }
    return x;
  }

  void backward(const ClipBatch& b, const float* dfeatures, BackwardObserver* observer) override {
    check_batch(b);
    std::memcpy(units_.back()->dout(), dfeatures, sizeof(float) * static_cast<size_t>(b.B) * spec_.embed_dim);
    for (size_t i = units_.size(); i-- > 0;) {
      const int layer = first_layer() + static_cast<int>(i);
      const float* x = i == 0 ? b.images : units_[i - 1]->out();
      {
        const PageLease use = store_.use_layer(layer, {Plane::param});
        units_[i]->backward_input(math_.backward, x, i == 0 ? nullptr : units_[i - 1]->dout(), b.B);
      }
      if (observer != nullptr) observer->after_backward_input(layer);
      {
        const PageLease use = store_.use_layer(layer, {}, {Plane::grad});
        units_[i]->backward_weight(math_.backward, x, b.B);
      }
      if (observer != nullptr) observer->after_backward_weight(layer);
    }
  }

  double train_flops_per_sample() const override {
    double macs = 0;
    for (size_t i = 0; i < units_.size(); ++i) macs += units_[i]->macs_per_sample() * (i == 0 ? 2 : 3);
    return 2 * macs;
  }
  int64_t activation_bytes() const override {
    int64_t n = 0;
    for (const auto& u : units_) n += u->activation_floats();
    return n * static_cast<int64_t>(sizeof(float));
  }

 private:
  void check_batch(const ClipBatch& b) const {
    check(b.images != nullptr && b.B >= 1 && b.B <= max_B_,
          "resnet: a micro-batch of " + std::to_string(b.B) + " images, allocated for " + std::to_string(max_B_));
  }

  ResNetSpec spec_;
  ChunkStore& store_;
  MathMode math_;  // its products' precision in F and in B, W (visual_math)
  std::vector<std::unique_ptr<Unit>> units_;
  int max_B_ = 0;
};

}  // namespace

ResNetSpec resnet_preset(ImageTower tower) {
  ResNetSpec s;
  switch (tower) {
    case ImageTower::resnet18: s.layers = {2, 2, 2, 2}; break;
    case ImageTower::resnet34: s.layers = {3, 4, 6, 3}; break;
    case ImageTower::resnet50: s.block = "bottleneck", s.layers = {3, 4, 6, 3}; break;
    case ImageTower::resnet101: s.block = "bottleneck", s.layers = {3, 4, 23, 3}; break;
    case ImageTower::resnet152: s.block = "bottleneck", s.layers = {3, 8, 36, 3}; break;
    case ImageTower::vit: throw Error("image tower 'vit': not a ResNet (expected resnet18, resnet34, resnet50, resnet101 or resnet152)");
  }
  return s;
}

void validate_resnet(const ResNetSpec& s) {
  check(s.block == "basic" || s.block == "bottleneck",
        "resnet: block \"" + s.block + "\": expected \"basic\" or \"bottleneck\"");
  check(s.layers.size() == 4, "resnet: expected 4 stages, found " + std::to_string(s.layers.size()));
  for (int n : s.layers) check(n >= 1 && n <= 64, "resnet: blocks per stage: expected 1..64, found " + std::to_string(n));
  check(s.width >= 1 && s.width <= 1024 && (s.width >= 32 ? s.width % 32 == 0 : 32 % s.width == 0),
        "clip.image_width: expected a divisor of 32 or a multiple of 32 up to 1024 (GroupNorm's min(32, C) groups "
        "must divide every stage's channels), found " + std::to_string(s.width));
  check(s.image_size >= 32 && s.image_size <= 1024,
        "clip.image_size: expected 32..1024 pixels for a ResNet (five halvings), found " + std::to_string(s.image_size));
  check(s.embed_dim >= 1 && s.embed_dim <= 8192, "clip.embed_dim: expected 1..8192, found " + std::to_string(s.embed_dim));
  check(s.quant != VisualQuant::int8,
        "config key 'clip.visual_quant': expected \"none\" or \"bf16\" for a ResNet (int8 is a ViT's), found \"" +
            std::string(to_string(s.quant)) + "\"");
}

ModelLayout resnet_layout(const ResNetSpec& spec) {
  validate_resnet(spec);
  ModelLayout out;
  const std::string& p = spec.prefix;
  // A convolution without bias [K, C, kernel, kernel] and its GroupNorm.
  auto conv_norm = [&](const std::string& conv, const std::string& norm, int layer, int C, int K, int kernel) {
    out.tensors.push_back(TensorSpec{p + conv, {K, C, kernel, kernel}, layer, ChunkKind::ffn, true});
    out.tensors.push_back(TensorSpec{p + norm + ".weight", {K}, layer, ChunkKind::norm, false});
    out.tensors.push_back(TensorSpec{p + norm + ".bias", {K}, layer, ChunkKind::norm, false});
  };
  int layer = spec.layer_base;
  conv_norm("conv1.weight", "bn1", layer++, 3, spec.width, 7);  // the stem
  for (const BlockPlan& b : block_plan(spec)) {
    const std::string n = b.name + ".";
    if (spec.block == "bottleneck") {
      conv_norm(n + "conv1.weight", n + "bn1", layer, b.in_channels, b.planes, 1);
      conv_norm(n + "conv2.weight", n + "bn2", layer, b.planes, b.planes, 3);
      conv_norm(n + "conv3.weight", n + "bn3", layer, b.planes, b.out_channels, 1);
    } else {
      conv_norm(n + "conv1.weight", n + "bn1", layer, b.in_channels, b.planes, 3);
      conv_norm(n + "conv2.weight", n + "bn2", layer, b.planes, b.out_channels, 3);
    }
    if (b.shortcut) conv_norm(n + "downsample.0.weight", n + "downsample.1", layer, b.in_channels, b.out_channels, 1);
    layer++;
  }
  out.tensors.push_back(TensorSpec{p + "proj.weight", {spec.embed_dim, spec.out_channels()}, layer, ChunkKind::head, true});
  return out;
}

std::unique_ptr<Tower> make_resnet(const ResNetSpec& spec, ChunkStore& store, MatmulPrecision precision) {
  return std::make_unique<ResNet>(spec, store, precision);
}

}  // namespace keel
