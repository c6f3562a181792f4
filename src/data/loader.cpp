#include "data/loader.h"

#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"

namespace keel {

DataLoader::DataLoader(const std::string& path, int B, int T, int vocab_size, bool shuffle, uint64_t seed, int rank,
                       int world)
    : path_(path), B_(B), T_(T), rank_(rank), world_(world), shuffle_(shuffle), seed_(seed) {
  tokens_ = read_token_shard(path, vocab_size - 1);
  const uint64_t window = static_cast<uint64_t>(world) * B * T;
  check(tokens_.size() >= window + 1, "shard " + path + ": expected at least " + std::to_string(window + 1) +
                                          " tokens for one " + std::to_string(world * B) + "x" + std::to_string(T) +
                                          " batch, found " + std::to_string(tokens_.size()));
  num_windows_ = (tokens_.size() - 1) / window;
  inputs_.resize(static_cast<size_t>(B) * T);
  targets_.resize(static_cast<size_t>(B) * T);
}

void DataLoader::make_order(uint64_t epoch) {
  if (order_epoch_ == epoch) return;
  order_.resize(num_windows_);
  for (uint64_t i = 0; i < num_windows_; ++i) order_[i] = i;
  if (shuffle_) {  // Fisher-Yates with a stream per epoch
    Rng rng(seed_ ^ (0x5851F42D4C957F2Dull * (epoch + 1)));
    for (uint64_t i = num_windows_ - 1; i > 0; --i) std::swap(order_[i], order_[rng.below(i + 1)]);
  }
  order_epoch_ = epoch;
}

void DataLoader::fill(uint64_t w) {
  const uint64_t local = static_cast<uint64_t>(B_) * T_;
  const uint16_t* src = tokens_.data() + w * local * world_ + local * rank_;
  for (uint64_t i = 0; i < local; ++i) {
    inputs_[i] = src[i];
    targets_[i] = src[i + 1];
  }
}

Batch DataLoader::next() {
  if (position_.index >= num_windows_) {
    position_.epoch++;
    position_.index = 0;
  }
  make_order(position_.epoch);
  fill(order_[position_.index]);
  position_.index++;
  return Batch{inputs_.data(), targets_.data(), B_, T_, 0.0f};
}

Batch DataLoader::window(uint64_t w) {
  check(w < num_windows_, "shard " + path_ + ": batch " + std::to_string(w) + " requested, it has " +
                              std::to_string(num_windows_));
  fill(w);
  return Batch{inputs_.data(), targets_.data(), B_, T_, 0.0f};
}

void DataLoader::set_position(LoaderPosition p) {
  check(p.index <= num_windows_, "data position " + std::to_string(p.index) + " is past the end of shard " + path_ +
                                     " (" + std::to_string(num_windows_) + " batches)");
  position_ = p;
}

}  // namespace keel
