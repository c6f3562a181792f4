// model.attention = "auto" for a training job: whichever of Keel's two attention kernels (dense:
// the T x T probabilities kept; blockwise: 64 x 64 tiles, memory linear in T) runs a forward and a
// backward pass faster at the job's sequence length, head shape, precision and threads on this
// machine, measured at start-up rather than assumed. The decision is cached per machine and shape,
// so that later runs (a resume, a rerun of the same seed) take the same kernel and give the same
// bytes without measuring again.
#pragma once

#include <optional>
#include <string>

#include "core/config.h"

namespace keel {

struct AttentionChoice {
  Attention kernel = Attention::blockwise;
  std::string reason;  // one line: what was measured (or why nothing needed measuring), and where it is cached
};

// Jobs shorter than this are decided by the length rule without measuring (see choose_attention).
constexpr int kMeasuredFromTokens = 512;

// The rule where nothing measures (core/config.cpp's resolution of "auto", the same rule): dense
// below 256 tokens, blockwise from 256.
Attention attention_by_length(int seq_len);

// The decision from two measured passes at `seq_len` tokens: the faster kernel where one is more than
// 10 % faster than the other; closer than that the measurement is within the noise of a busy machine,
// and the length rule decides (attention_by_length), so that runs that measure anew agree.
Attention faster_attention(double dense_ms, double blockwise_ms, int seq_len);

// The kernel the checkpoint this job will resume from ran with (its manifest's resolved config),
// if there is one: train.resume (a checkpoint or a root: its newest), or the run's own checkpoints
// with train.resume = "auto" or on a restart (KEEL_RESTART). A resumed run keeps the kernel it was
// trained with (its bytes depend on it), on this machine or another. `from` receives the
// checkpoint's directory.
std::optional<Attention> recorded_attention(const Config& config, std::string* from);

// Decides for `config`, resolved, whose model.attention was asked as "auto" and which has no window
// (a window runs blockwise only). A run resuming from a checkpoint takes the kernel recorded there
// (recorded_attention) unless dense no longer fits (below). A job shorter than kMeasuredFromTokens
// takes the length rule. Else measures one layer's attention on synthetic data at the job's
// longest sequence, with a batch row of min(heads, threads) query heads (their key/value heads
// with them), unless the dense kernel's probabilities for the whole model would take more than half
// of this machine's memory (then blockwise, unmeasured). The result is kept in
// $XDG_CACHE_HOME/keel (else ~/.cache/keel), one file per CPU model, threads, precision and shape;
// the first file written wins, so concurrent runs agree. Multi-rank jobs decide on rank 0 and
// broadcast (cli's train command).
AttentionChoice choose_attention(const Config& config);

// Whether a job decides its attention kernel by choose_attention: model.attention was "auto"
// (`asked_auto`, before the configuration was resolved) without a window, a dual encoder or
// context parallelism. The train command and the training benches (bench/bench_train.cpp,
// bench/step_breakdown.cpp) decide alike.
bool attention_measured(const Config& resolved, bool asked_auto);

}  // namespace keel
