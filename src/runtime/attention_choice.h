// model.attention = "auto" for a training job: whichever of Keel's two attention kernels (dense:
// the T x T probabilities kept; blockwise: 64 x 64 tiles, memory linear in T) runs a forward and a
// backward pass faster at the job's sequence length, head shape, precision and threads on this
// machine, measured at start-up rather than assumed. The decision is cached per machine and shape,
// so that later runs (a resume, a rerun of the same seed) take the same kernel and give the same
// bytes without measuring again.
#pragma once

#include <string>

#include "core/config.h"

namespace keel {

struct AttentionChoice {
  Attention kernel = Attention::blockwise;
  std::string reason;  // one line: what was measured (or why nothing needed measuring), and where it is cached
};

// The faster of two measured passes; within 2 % of each other, blockwise (its memory is linear in T).
Attention faster_attention(double dense_ms, double blockwise_ms);

// Decides for `config`, resolved, whose model.attention was asked as "auto" and which has no window
// (a window runs blockwise only). Measures one layer's attention on synthetic data at the job's
// longest sequence, with a batch row of min(heads, threads) query heads (their key/value heads
// with them), unless the dense kernel's probabilities for the whole model would take more than half
// of this machine's memory (then blockwise, unmeasured). The result is kept in
// $XDG_CACHE_HOME/keel (else ~/.cache/keel), one file per CPU model, threads, precision and shape;
// the first file written wins, so concurrent runs agree. Multi-rank jobs decide on rank 0 and
// broadcast (cli's train command).
AttentionChoice choose_attention(const Config& config);

}  // namespace keel
