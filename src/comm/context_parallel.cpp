#include "comm/context_parallel.h"

#include "core/error.h"
#include "store/placement.h"

namespace keel {

void MpiContextGroup::start_shift(const float* send, float* recv, int64_t count, int channel) {
  const int P = comm_.size(), r = comm_.rank();
  recvs_[channel] = comm_.irecv(recv, static_cast<size_t>(count), (r - 1 + P) % P, 700 + channel);
  sends_[channel] = comm_.isend(send, static_cast<size_t>(count), (r + 1) % P, 700 + channel);
}

void MpiContextGroup::finish_shift(int channel) {
  comm_.wait(sends_[channel]);
  comm_.wait(recvs_[channel]);
}

void validate_context_parallel_config(const Config& c, int world_size) {
  const int C = c.parallel.context;
  const std::string found = std::to_string(C);
  check(C >= 1, "config key 'parallel.context': expected >= 1, found " + found);
  if (C == 1) return;
  const int replica = std::max(1, c.parallel.pipeline) * std::max(1, c.parallel.tensor) * C;
  check(world_size % replica == 0, "config key 'parallel.context': expected pipeline x context x tensor (" +
                                       std::to_string(replica) + ") dividing the " + std::to_string(world_size) +
                                       " rank(s) of this job, found " + found);
  auto cuts = [&](int T, const std::string& where) {
    check(T % (2 * C) == 0, "config key 'parallel.context': expected a sequence length (" + where + " " +
                                std::to_string(T) + ") cut into 2 x context equal chunks, found " + found);
  };
  cuts(c.train.seq_len, "train.seq_len");
  for (const auto& [step, T] : c.train.seq_len_steps()) cuts(T, "train.seq_len_schedule");
  check(c.model.attention != Attention::dense,
        "config key 'model.attention': expected \"blockwise\" with parallel.context > 1 (ring attention passes "
        "key/value blocks; dense attention keeps the whole T x T), found \"dense\"");
  check(!c.clip.enabled(), "config key 'parallel.context': expected 1 with clip.image_tower, found " + found);
  check(!c.model.dynamic_window(), "config key 'model.attention_window': expected fixed windows with "
                                   "parallel.context > 1 (the dynamic window's probe reads a whole sequence), found "
                                   "\"dynamic\"");
  // Not yet combined with context parallelism (each a later piece of work, not a silent fallback).
  auto not_yet = [&](bool ok, const std::string& key, const std::string& value) {
    check(ok, "config key '" + key + "': expected its default with parallel.context > 1 (not yet supported "
              "together), found " + value);
  };
  not_yet(!tiering_enabled(c.tier), "tier.device_mib", std::to_string(c.tier.device_mib));
  // (A mixture of experts routes token by token; its counts and bias balancing's loads are sums
  // over the data group, and its balancing loss and capacity count each whole sequence's choices
  // over the context group: model/moe.h set_context_group.)
  not_yet(c.sync.codec == SyncCodec::none, "sync.codec", "\"" + std::string(to_string(c.sync.codec)) + "\"");
}

}  // namespace keel
