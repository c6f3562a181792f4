// Sampling text from a model: temperature and top-k over the next-token distribution, either by
// re-running the whole window for every new token or over a KV cache (runtime/kv_cache.h).
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/gpt.h"
#include "runtime/kv_cache.h"

namespace keel {

struct SampleOptions {
  int max_new_tokens = 64;
  double temperature = 0.8;  // 0 = greedy
  int top_k = 40;            // 0 = whole vocabulary
  int stop_token = -1;       // stop after emitting this token (e.g. end-of-text); -1 = never
  std::vector<int> stop_tokens;  // ... or one of these (generate.stop_tokens: a model's eos_token_id)
  bool stops(int token) const {
    return token == stop_token || std::find(stop_tokens.begin(), stop_tokens.end(), token) != stop_tokens.end();
  }
};

// generate.stop_tokens's ids ("2,5" -> {2, 5}; "" -> none; the text validated by validate()).
std::vector<int> stop_token_ids(const std::string& text);

// Extends `prompt` (non-empty) by up to max_new_tokens tokens. The model must be allocated for
// at least one sequence; contexts longer than its allocated length keep the most recent tokens.
// Deterministic for a given rng state.
std::vector<int> generate(GPT& model, int allocated_T, std::vector<int> prompt, const SampleOptions& options, Rng& rng);

// The same over a KV cache: the prompt is prefilled (its cached prefix reused), then each new
// token is one pass over that token. Greedy, it gives the tokens generate() gives while the
// context fits `context` tokens (at most the model's max_seq_len); when the context is full it
// starts again from its most recent half (generate() slides by one token instead). `reused`, if
// given, receives the prompt tokens taken from the cache.
std::vector<int> generate_cached(KvCache& cache, int context, std::vector<int> prompt, const SampleOptions& options,
                                 Rng& rng, uint64_t* reused = nullptr);

// Batched generation over a KV cache (continuous batching): up to `batch` sequences at once, each
// step one pass over every running sequence's next token (new prompts' prefills packed beside
// them, KvCache::extend_many); a finished sequence's place goes to the next prompt at once.
// Prompt i samples with its own Rng(prompt_seed(seed, i)), so that it gets the tokens
// generate_cached gives it alone with that rng, whatever the batch and the other prompts (to
// within float rounding of the packed passes). `done(i, tokens, reused)` is called as prompt i
// finishes (prompts finish out of order). Prompts must be non-empty and at most `context` tokens.
void generate_batched(KvCache& cache, int context, const std::vector<std::vector<int>>& prompts, int batch,
                      const SampleOptions& options, uint64_t seed,
                      const std::function<void(int index, const std::vector<int>& tokens, uint64_t reused)>& done);
// The seed of prompt `index` in a batched run seeded `seed`: seed + index.
inline uint64_t prompt_seed(uint64_t seed, int index) { return seed + static_cast<uint64_t>(index); }

// The next token from logits[V]: greedy at temperature 0, else sampled from the top-k (ties broken
// by token id).
int sample_next(const float* logits, int V, const SampleOptions& options, Rng& rng);

}  // namespace keel
