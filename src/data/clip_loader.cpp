#include "data/clip_loader.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace keel {

namespace {

constexpr float kMean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
constexpr float kStd[3] = {0.26862954f, 0.26130258f, 0.27577711f};

}  // namespace

CaptionedImages load_captioned_images(const std::string& dataset, const std::string& split, const Tokenizer& tokenizer,
                                      int context) {
  CaptionedImages out;
  out.split = read_image_split(dataset, split);
  out.context = context;
  check(out.split.channels == 3, "data " + dataset + "/" + split + ".img: expected 3 channels, found " +
                                     std::to_string(out.split.channels));
  out.tokens.reserve(out.split.captions.size());
  for (size_t i = 0; i < out.split.captions.size(); ++i) {
    std::vector<int> ids = tokenizer.encode(out.split.captions[i]);
    ids.push_back(tokenizer.eot_token());
    check(static_cast<int>(ids.size()) <= context,
          "data " + dataset + "/" + split + ".jsonl: caption " + std::to_string(i) + " (\"" + out.split.captions[i] +
              "\") is " + std::to_string(ids.size()) + " tokens with its end token; the text tower reads " +
              std::to_string(context) + " (train.seq_len)");
    out.tokens.push_back(std::move(ids));
  }
  return out;
}

ClipLoader::ClipLoader(const CaptionedImages& data, int B, int rank, int world, uint64_t seed, bool shuffle)
    : data_(data), B_(B), rank_(rank), world_(world), seed_(seed), shuffle_(shuffle) {
  check(B >= 1 && world >= 1 && rank >= 0 && rank < world, "clip loader: bad batch or rank");
  check(!shuffle || data.split.count >= B * world,
        "clip loader: " + std::to_string(data.split.count) + " samples cannot fill one global batch of " +
            std::to_string(B * world) + " (train.batch_size x data-parallel ranks)");
  const int H = data.split.height, W = data.split.width;
  images_.assign(static_cast<size_t>(B) * H * W * 3, 0.0f);
  tokens_.assign(static_cast<size_t>(B) * data.context, 0);
  lengths_.assign(B, 1);
  batch_ = ClipBatch{images_.data(), tokens_.data(), lengths_.data(), B, data.context};
}

const std::vector<int>& ClipLoader::order(int64_t epoch) {
  if (epoch_cached_ == epoch) return order_;
  order_.resize(data_.split.count);
  std::iota(order_.begin(), order_.end(), 0);
  if (shuffle_) {  // Fisher-Yates with Keel's portable generator: the same order everywhere
    Rng rng(seed_ ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(epoch + 1)));
    for (int i = static_cast<int>(order_.size()) - 1; i > 0; --i) {
      const int j = static_cast<int>(rng.next_u64() % static_cast<uint64_t>(i + 1));
      std::swap(order_[i], order_[j]);
    }
  }
  epoch_cached_ = epoch;
  return order_;
}

void ClipLoader::fill(const std::vector<int>& indices) {
  const int H = data_.split.height, W = data_.split.width, T = data_.context;
  const int64_t pixels = static_cast<int64_t>(H) * W;
  const int eot = data_.tokens.empty() ? 0 : data_.tokens[0].back();
  for (size_t b = 0; b < indices.size(); ++b) {
    const uint8_t* src = data_.split.pixels.data() + indices[b] * pixels * 3;
    float* dst = images_.data() + static_cast<int64_t>(b) * pixels * 3;
    for (int64_t p = 0; p < pixels; ++p) {
      for (int c = 0; c < 3; ++c) dst[p * 3 + c] = (src[p * 3 + c] / 255.0f - kMean[c]) / kStd[c];
    }
    const std::vector<int>& ids = data_.tokens[indices[b]];
    int* row = tokens_.data() + static_cast<int64_t>(b) * T;
    std::copy(ids.begin(), ids.end(), row);
    std::fill(row + ids.size(), row + T, eot);
    lengths_[b] = static_cast<int>(ids.size());
  }
  batch_.B = static_cast<int>(indices.size());
}

const ClipBatch& ClipLoader::next() {
  const int64_t global = static_cast<int64_t>(B_) * world_;
  const int64_t per_epoch = data_.split.count / global * global;
  const int64_t epoch = position_ / per_epoch, at = position_ % per_epoch;
  const std::vector<int>& o = order(epoch);
  std::vector<int> mine(B_);
  for (int b = 0; b < B_; ++b) mine[b] = o[at + static_cast<int64_t>(rank_) * B_ + b];
  fill(mine);
  position_ += global;
  return batch_;
}

const ClipBatch& ClipLoader::rows(int first, int count) {
  check(first >= 0 && count >= 1 && count <= B_ && first + count <= data_.split.count,
        "clip loader: rows " + std::to_string(first) + "+" + std::to_string(count) + " of " +
            std::to_string(data_.split.count));
  std::vector<int> idx(count);
  std::iota(idx.begin(), idx.end(), first);
  fill(idx);
  return batch_;
}

LoaderPosition ClipLoader::loader_position() const {
  const int64_t per_epoch = static_cast<int64_t>(data_.split.count) / (static_cast<int64_t>(B_) * world_) * B_ * world_;
  LoaderPosition p;
  p.epoch = static_cast<uint64_t>(position_ / per_epoch);
  p.index = static_cast<uint64_t>(position_ % per_epoch);
  return p;
}

void ClipLoader::set_loader_position(const LoaderPosition& p) {
  const int64_t per_epoch = static_cast<int64_t>(data_.split.count) / (static_cast<int64_t>(B_) * world_) * B_ * world_;
  check(p.offset == 0 && p.index < static_cast<uint64_t>(per_epoch) && p.index % (static_cast<uint64_t>(B_) * world_) == 0,
        "clip loader: a checkpoint's data position (epoch " + std::to_string(p.epoch) + ", sample " +
            std::to_string(p.index) + ") is not on a global batch of " + std::to_string(B_ * world_) + " of " +
            std::to_string(per_epoch) + " pairs per epoch");
  position_ = static_cast<int64_t>(p.epoch) * per_epoch + static_cast<int64_t>(p.index);
}

void ClipLoader::seek(int64_t position) {
  check(position >= 0, "clip loader: negative position");
  position_ = position;
}

}  // namespace keel
