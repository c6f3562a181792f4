#include "runtime/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>

#include "core/error.h"

namespace keel {

int sample_next(const float* logits, int V, const SampleOptions& o, Rng& rng) {
  if (o.temperature <= 0) return static_cast<int>(std::max_element(logits, logits + V) - logits);
  static thread_local std::vector<double> probs;
  static thread_local std::vector<int> order;
  probs.resize(V);
  order.resize(V);
  std::iota(order.begin(), order.end(), 0);
  const int k = (o.top_k > 0 && o.top_k < V) ? o.top_k : V;
  // Ties broken by token id so the choice does not depend on the sort's internals.
  auto better = [&](int a, int b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  const double mx = logits[order[0]];
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += probs[j] = std::exp((logits[order[j]] - mx) / o.temperature);
  double r = rng.uniform() * sum;
  for (int j = 0; j < k; ++j) {
    r -= probs[j];
    if (r < 0) return order[j];
  }
  return order[k - 1];
}

std::vector<int> stop_token_ids(const std::string& text) {
  std::vector<int> ids;
  for (size_t at = 0; !text.empty() && at <= text.size();) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    ids.push_back(std::stoi(text.substr(at, end - at)));
    at = end + 1;
  }
  return ids;
}

std::vector<int> generate(GPT& model, int allocated_T, std::vector<int> prompt, const SampleOptions& o, Rng& rng) {
  check(!prompt.empty(), "generate: the prompt encodes to no tokens");
  const int V = model.config().vocab_size, Vp = model.config().padded_vocab_size;
  for (int i = 0; i < o.max_new_tokens; ++i) {
    const int T = std::min<int>(static_cast<int>(prompt.size()), allocated_T);
    const int* context = prompt.data() + prompt.size() - T;
    model.forward(Batch{context, nullptr, 1, T, 0.0f});
    const int next = sample_next(model.logits() + static_cast<int64_t>(T - 1) * Vp, V, o, rng);
    prompt.push_back(next);
    if (o.stops(next)) break;
  }
  return prompt;
}

std::vector<int> generate_cached(KvCache& cache, int context, std::vector<int> prompt, const SampleOptions& o, Rng& rng,
                                 uint64_t* reused) {
  check(!prompt.empty(), "generate: the prompt encodes to no tokens");
  check(context >= 2, "generate: a context of at least 2 tokens is needed, found " + std::to_string(context));
  auto seq = cache.open();
  const int start = std::max<int>(0, static_cast<int>(prompt.size()) - context);
  cache.extend(*seq, std::span<const int>(prompt).subspan(start));
  if (reused != nullptr) *reused = seq->reused_tokens();
  for (int i = 0; i < o.max_new_tokens; ++i) {
    const std::vector<float>& logits = seq->last_logits();
    const int next = sample_next(logits.data(), static_cast<int>(logits.size()), o, rng);
    prompt.push_back(next);
    if (o.stops(next) || i + 1 == o.max_new_tokens) break;
    if (seq->length() + 1 > context) {  // full: start again from the most recent half
      seq.reset();
      seq = cache.open();
      const size_t keep = static_cast<size_t>(context / 2);
      cache.extend(*seq, std::span<const int>(prompt).subspan(prompt.size() - keep));
    } else {
      const int token = next;
      cache.extend(*seq, std::span<const int>(&token, 1));
    }
  }
  return prompt;
}

void generate_batched(KvCache& cache, int context, const std::vector<std::vector<int>>& prompts, int batch,
                      const SampleOptions& o, uint64_t seed,
                      const std::function<void(int, const std::vector<int>&, uint64_t)>& done) {
  check(batch >= 1, "generate: --batch expected >= 1, found " + std::to_string(batch));
  check(context >= 2, "generate: a context of at least 2 tokens is needed, found " + std::to_string(context));
  for (size_t i = 0; i < prompts.size(); ++i) {
    check(!prompts[i].empty(), "generate: prompt " + std::to_string(i) + " encodes to no tokens");
    check(static_cast<int>(prompts[i].size()) <= context, "generate: prompt " + std::to_string(i) + " (" +
                                                              std::to_string(prompts[i].size()) +
                                                              " tokens) is longer than the context of " +
                                                              std::to_string(context) + " tokens");
  }
  struct Running {
    int index = -1;
    std::vector<int> tokens;  // the prompt, then what was sampled
    std::unique_ptr<KvCache::Sequence> seq;
    Rng rng;
    int made = 0;
    uint64_t reused = 0;
    std::vector<int> pending;  // to append in the next pass
    bool first = true;         // pending is the prompt
  };
  std::vector<Running> running;
  size_t next_prompt = 0;
  std::vector<KvCache::Extension> pass;
  while (true) {
    // Admit prompts into free places.
    while (static_cast<int>(running.size()) < batch && next_prompt < prompts.size()) {
      Running r;
      r.index = static_cast<int>(next_prompt);
      r.tokens = prompts[next_prompt];
      r.seq = cache.open();
      r.rng = Rng(prompt_seed(seed, r.index));
      r.pending = r.tokens;
      ++next_prompt;
      running.push_back(std::move(r));
    }
    if (running.empty()) break;
    pass.clear();
    for (Running& r : running) pass.push_back(KvCache::Extension{r.seq.get(), r.pending});
    cache.extend_many(pass);
    // Sample each sequence's next token; finished ones leave, in prompt order of their places.
    std::vector<Running> still;
    for (Running& r : running) {
      if (r.first) {
        r.reused = r.seq->reused_tokens();
        r.first = false;
      }
      bool finished = o.max_new_tokens == 0;
      if (!finished) {
        const std::vector<float>& logits = r.seq->last_logits();
        const int next = sample_next(logits.data(), static_cast<int>(logits.size()), o, r.rng);
        r.tokens.push_back(next);
        ++r.made;
        finished = o.stops(next) || r.made == o.max_new_tokens;
        if (!finished) {
          if (r.seq->length() + 1 > context) {  // full: start again from the most recent half (as generate_cached)
            r.seq.reset();
            r.seq = cache.open();
            const size_t keep = static_cast<size_t>(context / 2);
            r.pending.assign(r.tokens.end() - static_cast<std::ptrdiff_t>(keep), r.tokens.end());
          } else {
            r.pending.assign(1, next);
          }
        }
      }
      if (finished) {
        r.seq.reset();  // its blocks go back to the pool before the next prompt takes its place
        done(r.index, r.tokens, r.reused);
      } else {
        still.push_back(std::move(r));
      }
    }
    running = std::move(still);
  }
}

}  // namespace keel
