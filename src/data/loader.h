// Deterministic batches from an llm.c token shard (uint16 or uint32 tokens), in global windows of world*B
// sequences of T (+1) tokens. Unshuffled, window w is the shard's tokens w*world*B*T .. (+1), in file order
// (llm.c's); shuffled, an epoch permutes the shard's sequences of T tokens by (seed, epoch) and window i is its
// i*world*B .. -th: each batch from all over the shard. Data-parallel rank r reads sequences r*B .. r*B+B-1 of
// each global window, so N ranks with batch B see exactly the batch one rank with batch N*B would. The position
// (epoch, index) is all the state there is, the same on every rank: saving and restoring it resumes the exact stream.
//
// A sequence-length curriculum (train.seq_len_schedule) reads shorter sequences from the same
// windows, cut at the longest length T: at length t (a divisor of T) a window is T / t batches, read in
// order. Batch j holds the window's tokens (its sequences end to end) j*world*B*t .. (j+1)*world*B*t (+1), rank r
// sequences r*B .. r*B+B-1 of them; the position's `offset` says how many of the window's tokens
// are read. A length that does not fit what is left of a window (or does not align with what was
// read: a change of length mid-window) starts at its next aligned part, or at the next window.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/batch.h"

namespace keel {

struct LoaderPosition {
  uint64_t epoch = 0;
  uint64_t index = 0;   // next window within the epoch
  uint64_t offset = 0;  // tokens of window `index` already read (a curriculum's shorter batches)
};

class DataLoader {
 public:
  // Reads and validates the shard (every token must be < vocab_size). Throws keel::Error naming
  // the file if it is missing, corrupt, or too short for one B x T batch. T: the longest length
  // it will be asked for (its windows' length).
  // Context parallelism (parallel.context = context_size > 1): the ranks of a context group share
  // a data rank's sequences; each reads T / context_size tokens of every sequence, chunks
  // context_rank and 2 context_size - 1 - context_rank of the sequence cut into 2 context_size
  // (model/context_group.h), so its batches are B x (T / context_size).
  DataLoader(const std::string& path, int B, int T, int vocab_size, bool shuffle, uint64_t seed, int rank = 0,
             int world = 1, int context_rank = 0, int context_size = 1);

  // Fills the next batch of B x T (0: the windows' length; else a divisor of it; under context
  // parallelism the batch holds this rank's T / context_size of each sequence). Inputs and
  // targets point into this loader, valid until the next call.
  Batch next(int T = 0);
  // The batch of window w in file order (its first part at length T), without moving the
  // position (for evaluation).
  Batch window(uint64_t w, int T = 0);

  LoaderPosition position() const { return position_; }
  void set_position(LoaderPosition p);
  uint64_t num_windows() const { return num_windows_; }
  uint64_t num_tokens() const { return tokens_.size(); }
  const std::string& path() const { return path_; }

 private:
  void fill(uint64_t w, uint64_t offset, int T);
  int length(int T) const;  // T checked (0: the windows' length)
  void make_order(uint64_t epoch);

  std::string path_;
  int B_, T_;
  int rank_, world_;
  int context_rank_, context_size_;
  bool shuffle_;
  uint64_t seed_;
  std::vector<uint32_t> tokens_;  // uint16 shards widened
  uint64_t num_windows_ = 0;
  std::vector<uint64_t> order_;
  uint64_t order_epoch_ = UINT64_MAX;
  LoaderPosition position_;
  std::vector<int> inputs_, targets_;
};

}  // namespace keel
