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

namespace {

// Fills inputs and targets with rank `rank`'s B sequences of length t of a window of world * B
// sequences of T tokens (+1), the window's q-th starting at token first_token(q), read from
// token `offset` of the window on (a curriculum's shorter lengths: t divides T, so each of its
// sequences lies within one of the window's). Under context parallelism (context_size > 1) each
// of its sequences gives chunks context_rank and 2C-1-context_rank of 2C (model/context_group.h).
template <typename FirstToken>
void read_window(const std::vector<uint32_t>& tokens, FirstToken first_token, uint64_t offset, int T, int t, int B,
                 int rank, int context_rank, int context_size, int* inputs, int* targets) {
  const int C = context_size, r = context_rank, chunk = t / (2 * C), rows = t / C;
  for (int b = 0; b < B; ++b) {
    const uint64_t p = offset + (static_cast<uint64_t>(rank) * B + b) * t;  // within the window
    const uint32_t* seq = tokens.data() + first_token(p / T) + p % T;
    int* in = inputs + static_cast<size_t>(b) * rows;
    int* out = targets + static_cast<size_t>(b) * rows;
    if (C == 1) {
      for (int i = 0; i < t; ++i) {
        in[i] = static_cast<int>(seq[i]);
        out[i] = static_cast<int>(seq[i + 1]);
      }
      continue;
    }
    for (int i = 0; i < rows; ++i) {
      const int pos = i < chunk ? r * chunk + i : (2 * C - 1 - r) * chunk + (i - chunk);
      in[i] = static_cast<int>(seq[pos]);
      out[i] = static_cast<int>(seq[pos + 1]);
    }
  }
}

}  // namespace

void DataLoader::make_order(uint64_t epoch) {
  if (order_epoch_ == epoch) return;
  // Shuffling permutes the shard's sequences of T tokens (not its windows): a batch then holds
  // sequences from all over the shard, as one drawn at random offsets does, rather than one
  // stretch of world * B * T consecutive tokens (neighbouring text, whose gradients agree more
  // than independent sequences' do). Window i of the epoch is the order's sequences
  // i * world * B .. (i + 1) * world * B - 1; those past the last whole window sit out the epoch.
  const uint64_t sequences = (tokens_.size() - 1) / T_;
  order_.resize(sequences);
  for (uint64_t i = 0; i < sequences; ++i) order_[i] = i;
  Rng rng(seed_ ^ (0x5851F42D4C957F2Dull * (epoch + 1)));  // Fisher-Yates with a stream per epoch
  for (uint64_t i = sequences - 1; i > 0; --i) std::swap(order_[i], order_[rng.below(i + 1)]);
  order_epoch_ = epoch;
}

void DataLoader::fill(uint64_t w, uint64_t offset, int T) {
  // Window w in file order: its sequences are consecutive.
  const uint64_t first = w * static_cast<uint64_t>(world_) * B_ * T_;
  read_window(
      tokens_, [&](uint64_t q) { return first + q * T_; }, offset, T_, T, B_, rank_, context_rank_, context_size_,
      inputs_.data(), targets_.data());
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
  if (shuffle_) {
    make_order(position_.epoch);
    const uint64_t* seqs = order_.data() + position_.index * world_ * B_;
    read_window(
        tokens_, [&](uint64_t q) { return seqs[q] * T_; }, position_.offset, T_, T, B_, rank_, context_rank_,
        context_size_, inputs_.data(), targets_.data());
  } else {
    fill(position_.index, position_.offset, T);
  }
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
