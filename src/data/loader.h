// Deterministic batches from an llm.c token shard. The shard is cut into non-overlapping global
// windows of world*B*T (+1) tokens; an epoch visits every window once, in an order drawn from
// (seed, epoch) when shuffling, or in file order when not. Data-parallel rank r reads sequences
// r*B .. r*B+B-1 of each global window, so N ranks with batch B see exactly the batch one rank
// with batch N*B would. The position (epoch, index) is all the state there is, the same on every
// rank: saving and restoring it resumes the exact stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/batch.h"

namespace keel {

struct LoaderPosition {
  uint64_t epoch = 0;
  uint64_t index = 0;  // next window within the epoch
};

class DataLoader {
 public:
  // Reads and validates the shard (every token must be < vocab_size). Throws keel::Error naming
  // the file if it is missing, corrupt, or too short for one B x T batch.
  DataLoader(const std::string& path, int B, int T, int vocab_size, bool shuffle, uint64_t seed, int rank = 0,
             int world = 1);

  // Fills the next batch (inputs and targets point into this loader; valid until the next call).
  Batch next();
  // The batch of window w in file order, without moving the position (for evaluation).
  Batch window(uint64_t w);

  LoaderPosition position() const { return position_; }
  void set_position(LoaderPosition p);
  uint64_t num_windows() const { return num_windows_; }
  uint64_t num_tokens() const { return tokens_.size(); }
  const std::string& path() const { return path_; }

 private:
  void fill(uint64_t w);
  void make_order(uint64_t epoch);

  std::string path_;
  int B_, T_;
  int rank_, world_;
  bool shuffle_;
  uint64_t seed_;
  std::vector<uint16_t> tokens_;
  uint64_t num_windows_ = 0;
  std::vector<uint64_t> order_;
  uint64_t order_epoch_ = UINT64_MAX;
  LoaderPosition position_;
  std::vector<int> inputs_, targets_;
};

}  // namespace keel
