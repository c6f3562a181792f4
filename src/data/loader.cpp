#include "data/loader.h"

#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"

namespace keel {

DataLoader::DataLoader(const std::string& path, int B, int T, int vocab_size, bool shuffle, uint64_t seed, int rank,
                       int world, int context_rank, int context_size)
    : path_(path),
      B_(B),
      T_(T),
      rank_(rank),
      world_(world),
      context_rank_(context_rank),
      context_size_(context_size),
      shuffle_(shuffle),
      seed_(seed) {
  check(context_size == 1 || (context_size > 1 && T % (2 * context_size) == 0),
        "config key 'parallel.context': expected a sequence length (" + std::to_string(T) +
            ") cut into 2 x context equal chunks, found " + std::to_string(context_size));
  tokens_ = read_tokens(path, vocab_size - 1);
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

void DataLoader::fill(uint64_t w, uint64_t offset, int T) {
  const uint64_t local = static_cast<uint64_t>(B_) * T;
  const uint32_t* src = tokens_.data() + w * static_cast<uint64_t>(B_) * T_ * world_ + offset + local * rank_;
  if (context_size_ == 1) {
    for (uint64_t i = 0; i < local; ++i) {
      inputs_[i] = src[i];
      targets_[i] = src[i + 1];
    }
    return;
  }
  // Context parallelism: of each sequence, chunks r and 2C-1-r of 2C (model/context_group.h).
  const int C = context_size_, r = context_rank_, chunk = T / (2 * C), rows = T / C;
  for (int b = 0; b < B_; ++b) {
    const uint32_t* seq = src + static_cast<uint64_t>(b) * T;
    for (int t = 0; t < rows; ++t) {
      const int pos = t < chunk ? r * chunk + t : (2 * C - 1 - r) * chunk + (t - chunk);
      inputs_[static_cast<size_t>(b) * rows + t] = seq[pos];
      targets_[static_cast<size_t>(b) * rows + t] = seq[pos + 1];
    }
  }
}

int DataLoader::length(int T) const {
  if (T == 0 || T == T_) return T_;
  if (T < 0 || T > T_ || T_ % T != 0) {  // (the message is built only then: this runs every micro-batch)
    throw Error("shard " + path_ + ": sequences of " + std::to_string(T) + " tokens requested from windows of " +
                std::to_string(T_) + " (a divisor of it is readable)");
  }
  if (T % (2 * context_size_) != 0 && context_size_ > 1) {
    throw Error("config key 'parallel.context': expected a sequence length (" + std::to_string(T) +
                ") cut into 2 x context equal chunks, found " + std::to_string(context_size_));
  }
  return T;
}

Batch DataLoader::next(int T) {
  T = length(T);
  const uint64_t part = static_cast<uint64_t>(world_) * B_ * T, whole = static_cast<uint64_t>(world_) * B_ * T_;
  position_.offset = (position_.offset + part - 1) / part * part;  // aligned to this length's parts
  if (position_.offset + part > whole) {
    position_.index++;
    position_.offset = 0;
  }
  if (position_.index >= num_windows_) {
    position_.epoch++;
    position_.index = 0;
  }
  make_order(position_.epoch);
  fill(order_[position_.index], position_.offset, T);
  position_.offset += part;
  if (position_.offset == whole) {  // (a whole window read: the position is at the next one)
    position_.index++;
    position_.offset = 0;
  }
  return Batch{inputs_.data(), targets_.data(), B_, T / context_size_, 0.0f};
}

Batch DataLoader::window(uint64_t w, int T) {
  T = length(T);
  check(w < num_windows_, "shard " + path_ + ": batch " + std::to_string(w) + " requested, it has " +
                              std::to_string(num_windows_));
  fill(w, 0, T);
  return Batch{inputs_.data(), targets_.data(), B_, T / context_size_, 0.0f};
}

void DataLoader::set_position(LoaderPosition p) {
  check(p.index <= num_windows_, "data position " + std::to_string(p.index) + " is past the end of shard " + path_ +
                                     " (" + std::to_string(num_windows_) + " batches)");
  check(p.offset < static_cast<uint64_t>(world_) * B_ * T_,
        "data position: offset " + std::to_string(p.offset) + " within a window of " +
            std::to_string(static_cast<uint64_t>(world_) * B_ * T_) + " tokens of shard " + path_);
  position_ = p;
}

}  // namespace keel
