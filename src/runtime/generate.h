// Sampling text from a model: temperature and top-k over the next-token distribution.
#pragma once

#include <vector>

#include "core/rng.h"
#include "model/gpt.h"

namespace keel {

struct SampleOptions {
  int max_new_tokens = 64;
  double temperature = 0.8;  // 0 = greedy
  int top_k = 40;            // 0 = whole vocabulary
  int stop_token = -1;       // stop after emitting this token (e.g. end-of-text); -1 = never
};

// Extends `prompt` (non-empty) by up to max_new_tokens tokens. The model must be allocated for
// at least one sequence; contexts longer than its allocated length keep the most recent tokens.
// Deterministic for a given rng state.
std::vector<int> generate(GPT& model, int allocated_T, std::vector<int> prompt, const SampleOptions& options, Rng& rng);

}  // namespace keel
