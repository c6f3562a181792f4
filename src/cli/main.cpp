// The `keel` command. Every user mistake ends here as one line "keel: <what>" and exit code 2;
// a failure once training has started exits 1 (keel launch restarts the one, not the other); 3:
// the final checkpoint could not be written; 4: stopped at a non-finite step; 128+N: stopped by
// signal N after a checkpoint (runtime/launcher.h names them).
#include <omp.h>

#include <algorithm>
#include <unistd.h>

#include <chrono>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <span>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/hf.h"
#include "ckpt/llama2c.h"
#include "ckpt/llmc.h"
#include "ckpt/run_directory.h"
#include "core/clock.h"
#include "comm/communicator.h"
#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "data/corpus.h"
#include "data/loader.h"
#include "data/images.h"
#include "data/hf_tokenizer.h"
#include "data/text_codec.h"
#include "data/tokenizer.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/float_mode.h"
#include "model/gpt.h"
#include "pipeline/schedule_command.h"
#include "monitor/report.h"
#include "runtime/attention_choice.h"
#include "runtime/generate.h"
#include "runtime/job_config.h"
#include "runtime/kv_cache.h"
#include "runtime/launcher.h"
#include "runtime/trainer.h"
#include "sim/command.h"
#include "sim/probe.h"

namespace fs = std::filesystem;

namespace keel {
namespace {

constexpr const char* kUsage = R"(usage: keel <command> [options]

commands:
  train     [--config FILE.toml] [--set section.key=value ...]
            Train a GPT. With no config: a ~5M-parameter model on the fortunes corpus
            (tokenized on first use into data/fortunes/). Under mpirun/srun: data parallel.
  launch    -n N [--hostfile F] [--mca KEY VALUE ...] [--max-restarts R] -- SUBCOMMAND [ARGS ...]
            Run a subcommand on N MPI ranks (e.g. keel launch -n 2 -- train --config X.toml).
            --max-restarts R: when the job fails, run it again up to R times (default 0); a
            train job continues from the newest checkpoint in its run_dir. Not restarted: a
            job refused its input (exit 2) or stopped with Ctrl-C / SIGTERM.
  tokenize  [--input PATH ...] [--out DIR] [--vocab-size N | --tokenizer tokenizer.json] [--val-fraction F] [--seed S]
            Train a byte-level BPE tokenizer and write DIR/{tokenizer.json,train.bin,val.bin}
            (--tokenizer: encode with a Hugging Face tokenizer.json instead; uint32 shards above 65,536 tokens)
            (llm.c shard format). Default input: /usr/share/games/fortunes.
  eval      --checkpoint DIR | --llmc FILE.bin | --llama2c FILE.bin | --hf DIR  [--data SHARD] [--batch B] [--seq T] [--batches N]
            [--set model.rope_scaling=linear|ntk|llama3 --set model.rope_factor=F --set model.max_seq_len=T]
            Validation loss and perplexity; a llama model past its trained length with RoPE scaling.
  generate  --checkpoint DIR [--prompt TEXT | --prompts FILE [--batch B]] [--tokens N] [--temperature X] [--top-k K]
            [--seed S] [--tokenizer FILE] [--set generate.key=value ...]
            Sample text from a checkpoint, over a KV cache (generate.kv_cache = false: without).
            --prompts FILE (or - for standard input): one prompt per line, one JSON line each (text, prompt tokens, tokens
            reused from the cache's shared prefixes, ms since the start), in prompt order, then the cache's summary
            on stderr. --batch B: B prompts at a time over the cache (continuous batching); prompt i samples
            with seed S + i whatever B.
  score     --checkpoint DIR --documents DIR [--batch B] [--tokenizer FILE] [--set generate.key=value ...]
            Per-document loss of every file under DIR (sorted; longer than the context: scored in
            consecutive windows), through the KV cache: documents that share a prefix (whole
            blocks of generate.kv_block tokens) reuse its keys, values and losses. One JSON line
            per document, then a summary line (reuse hits, tokens reused, time saved). --batch B: B
            windows scored side by side in each pass.
  export    --checkpoint DIR --out FILE.bin [--format llmc|llama2c]
            Write the model in llm.c's GPT-2 format or llama2.c's format (default: the family's).
  export    --checkpoint DIR --hf OUT_DIR [--max-shard-size SIZE]
            Write the model as a Hugging Face directory (model.safetensors, config.json); above
            SIZE (default 5GB, as transformers) shards named by model.safetensors.index.json.
  export    --tokenizer FILE.json --out tokenizer.bin   A Keel tokenizer as llama2.c's tokenizer.bin.
  import    --llmc FILE.bin | --llama2c FILE.bin | --hf DIR  --out DIR [--set section.key=value ...]
            Make a Keel checkpoint from an llm.c GPT-2 model, a llama2.c model or a Hugging Face
            GPT2LMHeadModel / LlamaForCausalLM directory (config.json, safetensors).
  schedule  [--config FILE.toml] [--set section.key=value ...] [--trace FILE.json] [--width N]
            [--layer-costs FILE.json] [--json yes]
            Validate and simulate the pipeline schedule a config would run (parallel.pipeline,
            schedule, micro_batches, virtual_stages, stage_boundaries) with per-stage costs from
            the model's layer FLOPs, or measured ones (--layer-costs: a run's metrics.jsonl, its
            last layer_costs line, or {"forward": [ms per layer per micro-batch],
            "backward_input": [...], "backward_weight": [...], "comm": ms}), cut by
            --partitioner static | dp | qlearning (default dp with measured costs; qlearning:
            --decisions N from the static cut, or from --start-cut B: the cut a run had before
            its load shifted) within --stage-memory-mib (what if pipeline rank R computed F times
            slower: --set runtime.slow_rank=R --set runtime.slow_factor=F): the cut and its
            simulated span against the static FLOP cut's, bubble, activations in flight per rank,
            a text Gantt chart, with --trace a Chrome trace (Perfetto), with --json yes one JSON
            line instead of text.
  simulate  --cluster CLUSTER.toml [--nodes N] [--config FILE.toml] [--set section.key=value ...] [--tensor N]
            [--recompute yes] [--tiers yes] [--overlap-sync no] [--layer-costs RUN/metrics.jsonl] [--trace FILE.json]
            [--json yes] [--stack NAME [--stacks FILE.toml]] [--vocab N]
            Predict one training step of the config on a described cluster (configs/clusters/):
            data x pipeline (the config's) x tensor (modelled only) layout, Keel's schedule and
            stage cut on its schedule simulator, collectives over the cluster's links, GEMMs at the
            device's published rate for their shapes: the
            step's breakdown, samples/s, MFU, memory per device; --trace: a Chrome trace of it;
            --layer-costs: per-layer F, B, W a run measured instead of the FLOP model.
            --tiers yes: pages homed on device, host and NVMe by Keel's placement, the step's
            transfers, stalls and hit rates under the tier manager's policy. --overlap-sync no:
            the data-parallel sync after the backward, not under it (a peer that does so).
            --stack NAME: another software stack's run (configs/sim/stacks.toml, or --stacks FILE):
            its kernels' share of the GEMM rates, gradient reduction and memory layout (default
            keel). --vocab N: the model's vocabulary, any size (the simulator tokenizes nothing).
            --search yes [--top N]: the N fastest layouts (tensor x pipeline x data, ZeRO,
            schedule, micro-batches, sync codec, recomputation, memory tiers where device memory
            alone is short) with their breakdowns, for the config's model and step.
            --probe yes: this machine's memory bandwidth and HybridGC's codec throughput (one
            thread), as cluster-file TOML, for a cluster file describing it.
  data images --from DIR --out DATASET [--size N] [--val-fraction F] [--vocab-size V] [--strict yes]
            An image-caption dataset from a directory of named .png/.jpg images (an icon theme,
            a clipart collection): captions from file names and folders, images over white,
            centre-cropped and resized to N x N (default 32), split by caption hash
            (data/images.h documents the files), and the captions' tokenizer (a V-token BPE,
            default 512); unreadable images skipped and counted (--strict yes: an error).
  checkpoints --dir DIR [--verify yes]
            List the checkpoints under DIR (a run's ckpt/ or one checkpoint): step, kind, bytes,
            encodings; --verify yes decodes and checks every record.
  report    RUN_DIR [--out FILE.html]
            One self-contained HTML report of a run (finished or still going): summary, plots,
            events, the pipeline's Gantt chart. Default --out: RUN_DIR/report.html.
)";

// The lines of kUsage that describe `cmd` (its own `keel CMD --help`).
std::string command_usage(const std::string& cmd) {
  std::istringstream in(kUsage);
  std::string line, out;
  bool mine = false;
  while (std::getline(in, line)) {
    const bool starts_command = line.size() > 2 && line[0] == ' ' && line[1] == ' ' && line[2] != ' ';
    if (starts_command) mine = line.compare(2, cmd.size() + 1, cmd + " ") == 0;
    if (mine) out += (out.empty() ? "usage: keel " + line.substr(2) : line) + "\n";
  }
  return out.empty() ? kUsage : out;
}

constexpr const char* kFortunes = "/usr/share/games/fortunes";

// Set once the command has accepted its input and starts the work itself (train: the Trainer is
// built and the first step is next; launch: its arguments are parsed). A keel::Error before that
// is the input's fault (command line, config, data, checkpoint) and exits 2, which keel launch
// does not restart, since it would fail the same way again; any failure after it exits 1.
bool g_input_accepted = false;

// Parses "--flag value" pairs; flags in `repeatable` may appear many times.
class Args {
 public:
  Args(int argc, char** argv, int first, const std::vector<std::string>& known) {
    for (int i = first; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "-h" || flag == "--help") {
        help = true;
        continue;
      }
      check(flag.rfind("--", 0) == 0, std::string(argv[1]) + ": unexpected argument '" + flag + "'");
      check(std::find(known.begin(), known.end(), flag) != known.end(),
            std::string(argv[1]) + ": unknown option " + flag + " (see keel --help)");
      check(i + 1 < argc, std::string(argv[1]) + ": option " + flag + " needs a value");
      values_[flag].push_back(argv[++i]);
    }
  }
  bool has(const std::string& flag) const { return values_.count(flag) > 0; }
  std::string get(const std::string& flag, const std::string& fallback = "") const {
    auto it = values_.find(flag);
    return it == values_.end() ? fallback : it->second.back();
  }
  std::vector<std::string> all(const std::string& flag) const {
    auto it = values_.find(flag);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  long get_int(const std::string& flag, long fallback) const {
    if (!has(flag)) return fallback;
    const std::string v = get(flag);
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    check(!v.empty() && *end == '\0', "option " + flag + ": expected an integer, found '" + v + "'");
    return n;
  }
  double get_double(const std::string& flag, double fallback) const {
    if (!has(flag)) return fallback;
    const std::string v = get(flag);
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    check(!v.empty() && *end == '\0' && std::isfinite(x), "option " + flag + ": expected a number, found '" + v + "'");
    return x;
  }
  bool help = false;

 private:
  std::map<std::string, std::vector<std::string>> values_;
};

int cmd_tokenize(const Args& a) {
  std::vector<std::string> inputs = a.all("--input");
  if (inputs.empty()) inputs = {kFortunes};
  const std::string out = a.get("--out", "data/fortunes");
  check_output_path("tokenize --out", out);
  const int vocab = static_cast<int>(a.get_int("--vocab-size", 8192));
  const double val_fraction = a.get_double("--val-fraction", 0.05);
  check(val_fraction > 0 && val_fraction < 1, "option --val-fraction: expected 0 < F < 1, found " + a.get("--val-fraction"));
  std::vector<std::string> docs = read_documents(inputs);
  if (a.has("--tokenizer")) {  // a Hugging Face tokenizer.json: encode with it, train nothing
    check(!a.has("--vocab-size"), "tokenize: --vocab-size sizes a trained tokenizer; --tokenizer FILE brings its own");
    const HfTokenizer tok = HfTokenizer::load(a.get("--tokenizer"));
    check(tok.document_token() >= 0, "tokenizer " + a.get("--tokenizer") +
                                          ": no token to start documents with (expected a post_processor that puts a "
                                          "special token first, or an added token <|endoftext|>)");
    const DocumentEncoder encoder{[&](std::string_view text) { return tok.encode(text); }, tok.document_token(),
                                  tok.vocab_size()};
    const TokenizeResult r = encode_corpus(docs, out, encoder, val_fraction, static_cast<uint64_t>(a.get_int("--seed", 1337)));
    std::printf("keel tokenize: wrote %s/{train.bin,val.bin} (%s tokens, vocabulary %d): %zu train tokens, %zu val tokens\n",
                out.c_str(), r.vocab_size > 65536 ? "uint32" : "uint16", r.vocab_size, r.train_tokens, r.val_tokens);
    return 0;
  }
  std::printf("keel tokenize: %zu documents, training a %d-token byte-level BPE...\n", docs.size(), vocab);
  std::fflush(stdout);
  TokenizeResult r = tokenize_corpus(docs, out, vocab, val_fraction, static_cast<uint64_t>(a.get_int("--seed", 1337)));
  std::printf("keel tokenize: wrote %s/{tokenizer.json,train.bin,val.bin}: %zu train tokens, %zu val tokens\n",
              out.c_str(), r.train_tokens, r.val_tokens);
  return 0;
}

// model.attention = "auto" without a window: rank 0 measures which kernel is the faster for this
// job (runtime/attention_choice.h); every rank takes its decision. Returns the line that says so
// (rank 0), printed once the run has started: a job refused later still says one line only.
std::string choose_auto_attention(Config& config, Communicator& comm) {
  AttentionChoice choice;
  if (comm.is_root()) choice = choose_attention(config);
  config.model.attention = comm.broadcast(static_cast<int64_t>(choice.kernel)) == static_cast<int64_t>(Attention::dense)
                               ? Attention::dense
                               : Attention::blockwise;
  if (!comm.is_root()) return "";
  return std::string("keel train: attention = auto: ") +
         (config.model.attention == Attention::dense ? "dense" : "blockwise") + " (" + choice.reason + ")\n";
}

// A training job's configuration as `--config` and `--set` give it, with the model shape of a
// train.init = "hf:DIR" checkpoint filled in (not yet resolved).
Config load_train_config(const Args& a) {
  Config config = Config::load(a.get("--config"), a.all("--set"));
  if (const std::string hf = config.train.init_hf_dir(); !hf.empty() && !config.clip.enabled()) {
    take_hf_model_shape(config.model, read_hf_model_config(hf), hf);
    // The model's eos_token_id ends its generated text (training's samples, `keel generate`).
    if (config.generate.stop_tokens.empty()) config.generate.stop_tokens = stop_tokens_text(read_hf_eos_tokens(hf));
  }
  return config;
}

int cmd_train(const Args& a) {
  // A task of a Slurm job: what would fail inside MPI_Init or train the wrong job is refused before
  // MPI is joined, said once (by task 0) while every task exits 2.
  if (const SlurmTask slurm = slurm_task(); !slurm.job_id.empty()) {
    try {
      check_slurm_train_start(slurm, load_train_config(a));
    } catch (const Error&) {
      if (slurm.task != 0 && !slurm.under_mpirun) return kRefusedInputExit;
      throw;
    }
  }
  Config config = load_train_config(a);
  if (config.parallel.zero == 3 && config.parallel.zero3_progress_thread) Communicator::request_threads();
  Communicator& comm = Communicator::world();
  const bool auto_attention = config.model.attention == Attention::automatic;
  resolve_job_config(config, comm.size());
  std::string attention_line;
  if (attention_measured(config, auto_attention)) {
    attention_line = choose_auto_attention(config, comm);
  }
  // The default job tokenizes the default corpus on first use (rank 0; the others wait).
  const DataConfig defaults;
  if (comm.is_root() && !config.clip.enabled() && !fs::exists(config.data.train) && config.data.train == defaults.train &&
      fs::is_directory(kFortunes)) {
    std::printf("keel train: %s not found; tokenizing the fortunes corpus first\n", config.data.train.c_str());
    Args none(0, nullptr, 0, {});
    cmd_tokenize(none);
  }
  comm.barrier();
  Trainer trainer(config, comm);
  g_input_accepted = true;
  std::fputs(attention_line.c_str(), stdout);
  std::fflush(stdout);
  const RunSummary summary = trainer.run();
  // Stopped by SIGTERM / SIGINT after its checkpoint: the conventional status. The final state not
  // saved (a full disk?): not success, and not worth a blind restart.
  if (summary.stop_signal != 0) return summary.final_checkpoint_written ? 128 + summary.stop_signal : kFinalCheckpointNotWritten;
  return summary.final_checkpoint_written ? 0 : kFinalCheckpointNotWritten;
}

// A model of another project's format named on the command line: --llmc FILE.bin (llm.c's GPT-2),
// --llama2c FILE.bin (llama2.c's run.c format) or --hf DIR (Hugging Face safetensors + config.json).
struct ForeignModel {
  std::string flag, path;
};
std::optional<ForeignModel> foreign_model(const Args& a) {
  for (const char* flag : {"--llmc", "--llama2c", "--hf"}) {
    if (a.has(flag)) return ForeignModel{flag, a.get(flag)};
  }
  return std::nullopt;
}
ModelConfig read_foreign_config(const ForeignModel& f) {
  if (f.flag == "--llmc") return read_llmc_model_config(f.path);
  if (f.flag == "--llama2c") return read_llama2c_model_config(f.path);
  return read_hf_model_config(f.path);
}
void import_foreign(const ForeignModel& f, ChunkStore& store, const ModelConfig& model) {
  if (f.flag == "--llmc") import_llmc(f.path, store, model);
  else if (f.flag == "--llama2c") import_llama2c(f.path, store, model);
  else import_hf(f.path, store, model);
}

// Builds a model from a checkpoint (or another project's model) for evaluation and generation.
struct LoadedModel {
  Config config;
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<GPT> model;
};

// imports = false: --llmc, --llama2c and --hf name outputs (export), the model is --checkpoint's.
LoadedModel load_model(const Args& a, int B, int T, bool imports = true) {
  LoadedModel lm;
  const std::optional<ForeignModel> foreign = imports ? foreign_model(a) : std::nullopt;
  if (foreign) {
    lm.config.model = read_foreign_config(*foreign);
  } else {
    check(a.has("--checkpoint"), "missing --checkpoint DIR (or --llmc FILE.bin, --llama2c FILE.bin, --hf DIR)");
    lm.config = read_checkpoint_config(a.get("--checkpoint"));
  }
  // A trained model takes generate.* keys, and a llama model (no position table) RoPE's scaling
  // and a longer context: the weights are loaded by the checkpoint's own configuration.
  const Config saved = lm.config;
  for (const std::string& set : a.all("--set")) {
    const bool rope = set.rfind("model.rope_", 0) == 0 && set.rfind("model.rope_theta=", 0) != 0;
    const bool rope_or_length = rope || set.rfind("model.max_seq_len=", 0) == 0;
    check(set.rfind("generate.", 0) == 0 || (rope_or_length && lm.config.model.llama()),
          std::string("option --set ") + set + ": a trained model takes generate.* keys" +
              (lm.config.model.llama() ? " and model.rope_scaling, rope_factor, rope_low_freq_factor, "
                                         "rope_high_freq_factor, rope_original_max_seq_len, max_seq_len"
                                       : ""));
    lm.config.set(set);
  }
  validate(lm.config.generate);
  if (lm.config.model.max_seq_len != saved.model.max_seq_len || lm.config.model.rope_scaling != saved.model.rope_scaling ||
      lm.config.model.rope_factor != saved.model.rope_factor ||
      lm.config.model.rope_frequencies() != saved.model.rope_frequencies()) {
    Config check_model = lm.config;
    check_model.train.seq_len = std::min(check_model.train.seq_len, check_model.model.max_seq_len);
    check_model.resolve(1);  // validates the model section
  }
  T = std::min(T, lm.config.model.max_seq_len);
  // An imported model's attention kernel by the rule training resolves "auto" with (dense below
  // 256 tokens): an exported Keel model then evaluates with the kernel it trained with.
  if (lm.config.model.attention == Attention::automatic) {
    lm.config.model.attention = T >= 256 ? Attention::blockwise : Attention::dense;
  }
  // The command computes with the model's own setting (its run's, or the default for an import).
  set_flush_denormals(lm.config.runtime.flush_denormals);
  lm.store = std::make_unique<ChunkStore>(lm.config.store.chunk_bytes);
  lm.model = std::make_unique<GPT>(lm.config.model, *lm.store);
  lm.store->finalize();
  lm.model->allocate(B, T);
  if (foreign) {
    import_foreign(*foreign, *lm.store, lm.config.model);
  } else {
    Config load = saved;  // the checkpoint's shape
    load_checkpoint(a.get("--checkpoint"), *lm.store, load, LoadMode::params);
    const std::span<const float> params = lm.store->range_view(Plane::param, 0, lm.store->numel());
    const auto bad = std::find_if(params.begin(), params.end(), [](float v) { return !std::isfinite(v); });
    if (bad != params.end()) {
      throw Error("checkpoint " + a.get("--checkpoint") + ": its weights hold a non-finite value (" + std::to_string(*bad) +
                  ") at element " + std::to_string(bad - params.begin()));
    }
  }
  return lm;
}

int cmd_eval(const Args& a) {
  check_blas();
  const int B = static_cast<int>(a.get_int("--batch", 4));
  const int T = static_cast<int>(a.get_int("--seq", 64));
  check(B >= 1 && T >= 1, "options --batch and --seq: expected positive values");
  LoadedModel lm = load_model(a, B, T);
  check(T <= lm.config.model.max_seq_len, "option --seq: expected at most the model's max_seq_len " +
                                              std::to_string(lm.config.model.max_seq_len) + ", found " + std::to_string(T));
  const std::string shard = a.get("--data", lm.config.data.val);
  DataLoader data(shard, B, T, lm.config.model.vocab_size, false, 0);
  const long windows = static_cast<long>(data.num_windows());
  const long asked = a.get_int("--batches", windows);
  check(asked >= 1, "option --batches: expected >= 1");
  const long batches = std::min(asked, windows);
  if (asked > windows) {
    std::fprintf(stderr, "keel eval: --batches %ld capped to the %ld windows of %s\n", asked, windows, shard.c_str());
  }
  double sum = 0;
  for (long i = 0; i < batches; ++i) sum += lm.model->forward(data.window(i));
  const double loss = sum / batches;
  check(std::isfinite(loss), "eval: the loss is not finite (" + std::to_string(loss) + ") on " + shard);
  // (A perplexity past the largest double, e^709.8, is null: JSON has no infinity.)
  const nlohmann::ordered_json out = {{"loss", loss}, {"perplexity", std::exp(loss)}, {"batches", batches}, {"data", shard}};
  std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  return 0;
}

// The tokenizer a command reads text with: --tokenizer; else a Hugging Face model's own
// tokenizer.json (--hf DIR, or a checkpoint trained from train.init = "hf:DIR") unless the
// checkpoint's data.tokenizer is itself a tokenizer.json; else the checkpoint's data.tokenizer.
TextCodec load_tokenizer(const Args& a, const LoadedModel& lm, const char* cmd) {
  const std::string hf_dir = a.has("--hf") ? a.get("--hf") : lm.config.train.init_hf_dir();
  const std::string tok_path =
      a.has("--tokenizer") ? a.get("--tokenizer") : TextCodec::choose_path(lm.config.data.tokenizer, hf_dir);
  check(!tok_path.empty(), std::string(cmd) + ": no tokenizer (pass --tokenizer FILE)");
  TextCodec tok = TextCodec::load(tok_path);
  check(tok.vocab_size() <= lm.config.model.vocab_size,
        "tokenizer " + tok_path + ": vocabulary " + std::to_string(tok.vocab_size()) + " exceeds the model's " +
            std::to_string(lm.config.model.vocab_size));
  check(tok.document_token() >= 0, "tokenizer " + tok_path +
                                       ": no token to start documents with (expected a post_processor that puts a "
                                       "special token first, or an added token <|endoftext|>)");
  check(tok.can_encode(), "tokenizer " + tok_path + ": cannot encode text (an llm.c decoding table)");
  return tok;
}

std::string json_string(const std::string& text) { return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

int cmd_generate(const Args& a) {
  SampleOptions o;
  o.max_new_tokens = static_cast<int>(a.get_int("--tokens", 100));
  o.temperature = a.get_double("--temperature", 0.8);
  o.top_k = static_cast<int>(a.get_int("--top-k", 40));
  const int samples = static_cast<int>(a.get_int("--samples", 1));
  Rng rng(static_cast<uint64_t>(a.get_int("--seed", 42)));
  check(o.max_new_tokens >= 0 && o.top_k >= 0 && o.temperature >= 0 && samples >= 1,
        "generate: --tokens, --top-k and --temperature must not be negative, --samples at least 1");
  check(!(a.has("--prompt") && a.has("--prompts")), "generate: --prompt and --prompts exclude each other");
  check_blas();
  // The whole window per token without a cache; passes of up to prefill_chunk tokens with one.
  LoadedModel lm = load_model(a, 1, 1 << 30);
  const GenerateConfig& g = lm.config.generate;
  const int context = std::min(lm.config.model.max_seq_len, g.kv_cache ? lm.config.model.max_seq_len : 1024);
  if (g.kv_cache) lm.model->allocate(1, std::min(g.prefill_chunk, context));
  const TextCodec tok = load_tokenizer(a, lm, "generate");
  o.stop_token = tok.document_token();
  // generate.stop_tokens (an imported model's eos_token_id), else a Hugging Face model's own.
  std::string stops = lm.config.generate.stop_tokens;
  if (const std::string hf = a.has("--hf") ? a.get("--hf") : lm.config.train.init_hf_dir(); stops.empty() && !hf.empty()) {
    stops = stop_tokens_text(read_hf_eos_tokens(hf));
  }
  o.stop_tokens = stop_token_ids(stops);
  auto encode = [&](const std::string& text) {
    std::vector<int> prompt = {tok.document_token()};
    std::vector<int> ids = tok.encode(text);
    prompt.insert(prompt.end(), ids.begin(), ids.end());
    return prompt;
  };
  std::unique_ptr<KvCache> cache;
  if (g.kv_cache) {
    KvCacheOptions kv = KvCacheOptions::from(g);
    kv.all_logits = false;  // generation samples after each extension's last token only
    cache = std::make_unique<KvCache>(*lm.model, kv);
  }
  auto run = [&](const std::vector<int>& prompt, uint64_t* reused) {
    if (cache) return generate_cached(*cache, context, prompt, o, rng, reused);
    return generate(*lm.model, context, prompt, o, rng);
  };
  if (a.has("--prompts")) {
    const std::string path = a.get("--prompts");
    const int batch = static_cast<int>(a.get_int("--batch", 1));
    check(batch >= 1, "generate: --batch expected >= 1, found " + std::to_string(batch));
    check(cache || batch == 1, "generate: --batch above 1 needs the KV cache (generate.kv_cache = true)");
    // "-": prompts from standard input (a pipe), the one place a stream is asked for by name;
    // a path must be a regular file (a FIFO there would block, see open_regular_file).
    std::string text;
    if (path == "-") {
      std::ostringstream in;
      in << std::cin.rdbuf();
      text = in.str();
    } else {
      text = read_text_file(path);
    }
    std::istringstream lines(text);
    std::string line;
    std::vector<std::vector<int>> prompts;
    while (std::getline(lines, line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      prompts.push_back(encode(line));
      check(static_cast<int>(prompts.back().size()) <= context,
            "generate: --prompts " + path + ": prompt " + std::to_string(prompts.size() - 1) + " (" +
                std::to_string(prompts.back().size()) + " tokens) is longer than the model's context of " +
                std::to_string(context) + " tokens");
    }
    check(!prompts.empty(), "generate: --prompts " + path + " holds no prompt (one per line)");
    // Prompt i samples with Rng(--seed + i) (runtime/generate.h prompt_seed), whatever --batch.
    const uint64_t seed = static_cast<uint64_t>(a.get_int("--seed", 42));
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t new_tokens = 0;
    // Printed in prompt order: a prompt that finishes early waits for those before it.
    std::map<int, std::string> ready;
    int printed = 0;
    auto finished = [&](int index, const std::vector<int>& out, uint64_t reused) {
      const size_t n = prompts[index].size();
      new_tokens += out.size() - n;
      char head[256];
      std::snprintf(head, sizeof head,
                    "{\"prompt\": %d, \"prompt_tokens\": %zu, \"reused_tokens\": %llu, \"new_tokens\": %zu, \"ms\": %.1f, \"text\": ",
                    index, n, static_cast<unsigned long long>(reused), out.size() - n, ms_since(t0));
      ready[index] = head + json_string(tok.decode(std::vector<int>(out.begin() + 1, out.end()))) + "}";
      for (auto it = ready.find(printed); it != ready.end(); it = ready.find(printed)) {
        std::printf("%s\n", it->second.c_str());
        ready.erase(it);
        ++printed;
      }
      std::fflush(stdout);
    };
    if (cache) {
      generate_batched(*cache, context, prompts, batch, o, seed, finished);
    } else {
      for (int i = 0; i < static_cast<int>(prompts.size()); ++i) {
        Rng own(prompt_seed(seed, i));
        finished(i, generate(*lm.model, context, prompts[i], o, own), 0);
      }
    }
    const double ms = ms_since(t0);
    std::fprintf(stderr, "keel generate: %zu prompts, batch %d: %llu new tokens in %.1f ms (%.1f tokens/s)\n", prompts.size(),
                 batch, static_cast<unsigned long long>(new_tokens), ms, ms > 0 ? 1000.0 * static_cast<double>(new_tokens) / ms : 0.0);
    if (cache) std::fprintf(stderr, "keel generate: %s\n", cache->summary().c_str());
    return 0;
  }
  const std::vector<int> prompt = encode(a.get("--prompt"));
  if (static_cast<int>(prompt.size()) > context) {
    std::fprintf(stderr, "keel generate: the prompt (%zu tokens) is longer than the model's context of %d: it sees the last %d\n",
                 prompt.size(), context, context);
  }
  for (int s = 0; s < samples; ++s) {
    const std::vector<int> out = run(prompt, nullptr);
    std::printf("%s%s\n", s > 0 ? "---\n" : "", tok.decode(std::vector<int>(out.begin() + 1, out.end())).c_str());
  }
  return 0;
}

int cmd_score(const Args& a) {
  check(a.has("--documents"), "score: missing --documents DIR");
  const std::string dir = a.get("--documents");
  check(fs::is_directory(dir), "score: --documents " + dir + " is not a directory");
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path().string());  // symbolic links to files count
  }
  std::sort(files.begin(), files.end());
  check(!files.empty(), "score: --documents " + dir + " holds no files");
  check_blas();
  LoadedModel lm = load_model(a, 1, 1 << 30);
  const GenerateConfig& g = lm.config.generate;
  const int context = lm.config.model.max_seq_len;
  lm.model->allocate(1, std::min(g.prefill_chunk, context));
  const TextCodec tok = load_tokenizer(a, lm, "score");
  KvCache cache(*lm.model, KvCacheOptions::from(g));
  double total_nll = 0, total_ms = 0;
  uint64_t total_targets = 0, total_tokens = 0, total_reused = 0;
  const int batch = static_cast<int>(a.get_int("--batch", 1));
  check(batch >= 1, "score: --batch expected >= 1, found " + std::to_string(batch));
  // The documents' windows (consecutive, `context` tokens each), scored `batch` at a time side by
  // side (KvCache::extend_many); a document is printed once its last window is scored.
  struct Doc {
    std::vector<int> tokens;
    double nll = 0;
    uint64_t targets = 0, reused = 0;
    size_t windows = 0, scored = 0;
    std::chrono::steady_clock::time_point start;
    bool started = false;
  };
  std::vector<Doc> docs(files.size());
  struct Window {
    size_t doc, at, n;
  };
  std::vector<Window> windows;
  for (size_t d = 0; d < files.size(); ++d) {
    docs[d].tokens = {tok.document_token()};
    const std::vector<int> ids = tok.encode(read_text_file(files[d]));
    docs[d].tokens.insert(docs[d].tokens.end(), ids.begin(), ids.end());
    for (size_t w = 0; w < docs[d].tokens.size(); w += static_cast<size_t>(context)) {
      const size_t n = std::min(docs[d].tokens.size() - w, static_cast<size_t>(context));
      if (n < 2) break;
      windows.push_back(Window{d, w, n});
      docs[d].windows++;
    }
  }
  size_t next_print = 0;
  auto print_ready = [&]() {
    for (; next_print < docs.size() && docs[next_print].scored == docs[next_print].windows; ++next_print) {
      Doc& doc = docs[next_print];
      const std::string& file = files[next_print];
      const double ms = doc.started ? ms_since(doc.start) : 0.0;
      check(doc.targets > 0, "score: " + file + " holds too little text to score");
      check(std::isfinite(doc.nll), "score: the loss is not finite on " + file);
      std::printf("{\"document\": %s, \"tokens\": %zu, \"loss\": %.6f, \"reused_tokens\": %llu, \"ms\": %.1f}\n",
                  json_string(file).c_str(), doc.tokens.size(), doc.nll / static_cast<double>(doc.targets),
                  static_cast<unsigned long long>(doc.reused), ms);
      std::fflush(stdout);
      total_nll += doc.nll, total_targets += doc.targets, total_tokens += doc.tokens.size(), total_reused += doc.reused;
      total_ms += ms;
    }
  };
  print_ready();  // documents too short for a window: refused in order
  for (size_t g = 0; g < windows.size(); g += static_cast<size_t>(batch)) {
    const size_t end = std::min(windows.size(), g + static_cast<size_t>(batch));
    std::vector<std::unique_ptr<KvCache::Sequence>> seqs;
    std::vector<KvCache::Extension> ext;
    for (size_t i = g; i < end; ++i) {
      Doc& doc = docs[windows[i].doc];
      if (!doc.started) doc.start = std::chrono::steady_clock::now(), doc.started = true;
      seqs.push_back(cache.open());
      ext.push_back(KvCache::Extension{seqs.back().get(), std::span<const int>(doc.tokens).subspan(windows[i].at, windows[i].n)});
    }
    cache.extend_many(ext);
    for (size_t i = g; i < end; ++i) {
      Doc& doc = docs[windows[i].doc];
      const KvCache::Sequence& seq = *seqs[i - g];
      for (size_t p = 1; p < windows[i].n; ++p) doc.nll += seq.nll()[p];
      doc.targets += windows[i].n - 1;
      doc.reused += seq.reused_tokens();
      doc.scored++;
    }
    seqs.clear();
    print_ready();
  }
  const KvCacheStats& st = cache.stats();
  // Time saved: the reused tokens at the measured cost of a computed one.
  const double ms_per_token = st.computed_tokens ? st.compute_ms / static_cast<double>(st.computed_tokens) : 0.0;
  std::printf("{\"event\": \"summary\", \"documents\": %zu, \"tokens\": %llu, \"loss\": %.6f, \"reused_tokens\": %llu, "
              "\"computed_tokens\": %llu, \"block_hits\": %llu, \"block_lookups\": %llu, \"ms\": %.1f, "
              "\"ms_per_computed_token\": %.4f, \"saved_ms\": %.1f}\n",
              files.size(), static_cast<unsigned long long>(total_tokens), total_nll / static_cast<double>(total_targets),
              static_cast<unsigned long long>(total_reused), static_cast<unsigned long long>(st.computed_tokens),
              static_cast<unsigned long long>(st.hits), static_cast<unsigned long long>(st.lookups), total_ms, ms_per_token,
              ms_per_token * static_cast<double>(total_reused));
  std::fprintf(stderr, "keel score: %s\n", cache.summary().c_str());
  return 0;
}

// An output file may replace only a regular file, and never a run's own file nor one inside a
// checkpoint directory (its records may be what newer checkpoints point into).
void check_output_file(const std::string& what, const std::string& out) {
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  check(!fs::exists(st) || fs::is_regular_file(st),
        what + " " + out + ": exists and is not a regular file (a directory, device, pipe or socket): not replaced");
  check_output_path(what, out);
}

// A size as transformers' max_shard_size takes it: bytes, or a number with KB, MB or GB (decimal:
// 1 GB = 1e9 bytes) or KiB, MiB, GiB; at least one byte.
uint64_t parse_byte_size(const std::string& flag, const std::string& text) {
  static const std::vector<std::pair<std::string, double>> units = {{"KiB", 1024.0}, {"MiB", 1048576.0},
                                                                    {"GiB", 1073741824.0}, {"KB", 1e3},
                                                                    {"MB", 1e6}, {"GB", 1e9}, {"B", 1.0}};
  double scale = 1.0;
  std::string number = text;
  for (const auto& [suffix, bytes] : units) {
    if (number.size() > suffix.size() && number.compare(number.size() - suffix.size(), suffix.size(), suffix) == 0) {
      number.resize(number.size() - suffix.size());
      scale = bytes;
      break;
    }
  }
  char* end = nullptr;
  const double x = std::strtod(number.c_str(), &end);
  check(!number.empty() && *end == '\0' && std::isfinite(x) && x * scale >= 1.0 && x * scale < 1.8e19,
        "option " + flag + ": expected a size such as 5GB, 500MB or 100000 (bytes), found '" + text + "'");
  return static_cast<uint64_t>(x * scale);
}

int cmd_export(const Args& a) {
  if (a.has("--tokenizer")) {  // a Keel tokenizer as llama2.c's tokenizer.bin
    check(!a.has("--checkpoint") && a.has("--out"), "export: expected --tokenizer FILE.json --out tokenizer.bin");
    check_output_file("export --out", a.get("--out"));
    Tokenizer::load(a.get("--tokenizer")).save_llama2c(a.get("--out"));
    std::printf("keel export: wrote %s (llama2.c tokenizer.bin)\n", a.get("--out").c_str());
    return 0;
  }
  if (a.has("--hf")) {  // a Hugging Face directory: model.safetensors + config.json
    check(a.has("--checkpoint") && !a.has("--out") && !a.has("--format"), "export: expected --checkpoint DIR --hf OUT_DIR");
    check_output_path("export --hf", a.get("--hf"));
    const uint64_t max_shard = a.has("--max-shard-size") ? parse_byte_size("--max-shard-size", a.get("--max-shard-size"))
                                                          : kDefaultHfMaxShardBytes;
    LoadedModel lm = load_model(a, 1, 1, false);
    export_hf(a.get("--hf"), *lm.store, lm.config.model, max_shard, stop_token_ids(lm.config.generate.stop_tokens));
    std::printf("keel export: wrote %s/{%s,config.json} (%s)\n", a.get("--hf").c_str(),
                fs::exists(fs::path(a.get("--hf")) / "model.safetensors.index.json") ? "model.safetensors.index.json,shards"
                                                                                    : "model.safetensors",
                lm.config.model.llama() ? "LlamaForCausalLM" : "GPT2LMHeadModel");
    return 0;
  }
  check(a.has("--checkpoint") && a.has("--out"), "export: expected --checkpoint DIR --out FILE.bin [--format llmc|llama2c]");
  const std::string format = a.get("--format", "");
  check(format.empty() || format == "llmc" || format == "llama2c",
        "export --format: expected llmc (GPT-2) or llama2c (llama), found '" + format + "'");
  check_output_file("export --out", a.get("--out"));
  LoadedModel lm = load_model(a, 1, 1);
  // The model's own family's format unless --format names one (which must fit the family).
  const bool llama2c = format.empty() ? lm.config.model.llama() : format == "llama2c";
  if (llama2c) {
    export_llama2c(a.get("--out"), *lm.store, lm.config.model);
    std::printf("keel export: wrote %s (llama2.c run.c format)\n", a.get("--out").c_str());
  } else {
    export_llmc(a.get("--out"), *lm.store, lm.config.model);
    std::printf("keel export: wrote %s (llm.c GPT-2 format, version 3)\n", a.get("--out").c_str());
  }
  return 0;
}

int cmd_import(const Args& a) {
  const int sources = a.has("--llmc") + a.has("--llama2c") + a.has("--hf");
  check(sources == 1 && a.has("--out"),
        "import: expected one of --llmc FILE.bin (GPT-2), --llama2c FILE.bin (llama) or --hf DIR (Hugging Face), and --out DIR");
  check_output_path("import --out", a.get("--out"));
  Config config = Config::load("", a.all("--set"));
  const ForeignModel from = *foreign_model(a);
  const ModelConfig m = read_foreign_config(from);
  config.model = m;
  config.train.seq_len = std::min(config.train.seq_len, m.max_seq_len);
  resolve_job_config(config);
  ChunkStore store(config.store.chunk_bytes);
  register_layout(store, model_layout(config.model));  // the weights only: no layers needed
  store.finalize();
  import_foreign(from, store, config.model);
  // A Hugging Face directory's own tokenizer.json becomes the checkpoint's data.tokenizer:
  // `keel generate` and `keel score` read text with it.
  if (from.flag == "--hf" && config.data.tokenizer == DataConfig{}.tokenizer &&
      fs::is_regular_file(fs::path(from.path) / "tokenizer.json")) {
    config.data.tokenizer = fs::absolute(fs::path(from.path) / "tokenizer.json").lexically_normal().string();
  }
  // Its eos_token_id ends generated text (generate.stop_tokens; a --set value stays).
  if (from.flag == "--hf" && config.generate.stop_tokens.empty()) {
    config.generate.stop_tokens = stop_tokens_text(read_hf_eos_tokens(from.path));
  }
  const std::string dir = save_checkpoint(a.get("--out"), store, config, RankState{}, 0);
  std::printf("keel import: wrote checkpoint %s\n", dir.c_str());
  return 0;
}

int cmd_checkpoints(const Args& a) {
  check(a.has("--dir"), "checkpoints: missing --dir DIR");
  const std::string dir = a.get("--dir");
  const std::string verify = a.get("--verify", "no");
  check(verify == "yes" || verify == "no", "checkpoints --verify: expected yes or no, found '" + verify + "'");
  const std::vector<std::string> dirs = checkpoint_candidates(dir);
  g_input_accepted = true;
  std::printf("%-15s %8s %5s %-15s %6s %10s %10s %7s %6s %6s %9s %s\n", "checkpoint", "step", "kind", "base", "ranks",
              "state MB", "stored MB", "raw", "zstd", "xor", "elsewhere", verify == "yes" ? "verified" : "");
  int bad = 0;
  for (const std::string& d : dirs) {
    // A checkpoint whose manifest cannot be read is listed as failed; the others still are.
    CheckpointInfo c;
    try {
      c = describe_checkpoint(d);
    } catch (const Error& e) {
      bad++;
      std::printf("%-15s %8s %5s %-15s %6s %10s %10s %7s %6s %6s %9s FAILED: %s\n",
                  fs::path(d).lexically_normal().filename().string().c_str(), "?", "?", "?", "?", "?", "?", "?", "?",
                  "?", "?", e.what());
      continue;
    }
    std::string verdict;
    if (verify == "yes") {
      try {
        verify_checkpoint(d);
        verdict = "ok";
      } catch (const Error& e) {
        verdict = std::string("FAILED: ") + e.what();
        bad++;
      }
    }
    std::printf("%-15s %8lld %5s %-15s %3d/z%d %10.1f %10.1f %7d %6d %6d %9d %s\n", c.name.c_str(),
                static_cast<long long>(c.step), c.kind.c_str(), c.base.empty() ? "-" : c.base.c_str(), c.world, c.zero,
                c.raw_bytes / 1e6, c.own_bytes / 1e6, c.raw, c.zstd, c.xor_zstd, c.elsewhere, verdict.c_str());
  }
  return bad == 0 ? 0 : 1;
}

int cmd_report(const Args& a) {
  check(a.has("--dir"), "report: expected RUN_DIR [--out FILE.html]");
  const std::string dir = a.get("--dir");
  const std::string out = a.get("--out", dir + "/report.html");
  check_output_file("report --out", out);
  std::vector<std::string> skipped;
  const std::string html = render_report(dir, &skipped);
  g_input_accepted = true;
  write_file_atomic(out, {ByteRange{html.data(), html.size()}});
  for (size_t i = 0; i < skipped.size() && i < 5; ++i) std::fprintf(stderr, "keel report: %s\n", skipped[i].c_str());
  if (skipped.size() > 5) std::fprintf(stderr, "keel report: ... %zu skipped in all\n", skipped.size());
  std::printf("keel report: wrote %s (%zu KB, self-contained)%s\n", out.c_str(), html.size() / 1024,
              skipped.empty() ? "" : (", " + std::to_string(skipped.size()) + " values or lines skipped").c_str());
  return 0;
}

int cmd_simulate(const Args& a) {
  sim::SimulateOptions o;
  o.config = a.get("--config", "");
  o.sets = a.all("--set");
  o.cluster = a.get("--cluster", "");
  o.tensor = static_cast<int>(a.get_int("--tensor", 1));
  o.nodes = static_cast<int>(a.get_int("--nodes", 0));
  o.layer_costs = a.get("--layer-costs", "");
  o.trace = a.get("--trace", "");
  if (!o.trace.empty()) check_output_file("simulate --trace", o.trace);
  const std::string probe = a.get("--probe", "no");
  check(probe == "yes" || probe == "no", "simulate --probe: expected yes or no, found '" + probe + "'");
  if (probe == "yes") {
    const Config config = Config::load(o.config, o.sets);
    std::printf("%s", sim::probe_machine(config.sync).c_str());
    return 0;
  }
  const std::string recompute = a.get("--recompute", "no"), json = a.get("--json", "no"), search = a.get("--search", "no");
  check(search == "yes" || search == "no", "simulate --search: expected yes or no, found '" + search + "'");
  o.search = search == "yes";
  o.top = static_cast<int>(a.get_int("--top", 5));
  check(recompute == "yes" || recompute == "no", "simulate --recompute: expected yes or no, found '" + recompute + "'");
  check(json == "yes" || json == "no", "simulate --json: expected yes or no, found '" + json + "'");
  o.recompute = recompute == "yes";
  const std::string tiers = a.get("--tiers", "no");
  check(tiers == "yes" || tiers == "no", "simulate --tiers: expected yes or no, found '" + tiers + "'");
  o.tiers = tiers == "yes";
  const std::string overlap = a.get("--overlap-sync", "yes");
  check(overlap == "yes" || overlap == "no", "simulate --overlap-sync: expected yes or no, found '" + overlap + "'");
  o.overlap_sync = overlap == "yes";
  o.json = json == "yes";
  o.stack = a.get("--stack", "keel");
  o.stacks = a.get("--stacks", o.stack == "keel" ? "" : "configs/sim/stacks.toml");
  o.vocab = static_cast<int>(a.get_int("--vocab", 0));
  return sim::simulate_command(o);
}

int cmd_schedule(const Args& a) {
  if (a.has("--trace")) check_output_file("schedule --trace", a.get("--trace"));
  Config config = Config::load(a.get("--config", ""), a.all("--set"));
  resolve_job_config(config, config.parallel.pipeline);
  pipeline::ScheduleOptions o;
  o.width = static_cast<int>(a.get_int("--width", 100));
  check(o.width >= 20, "schedule --width: expected >= 20, found " + std::to_string(o.width));
  const std::string as_json = a.get("--json", "no");
  check(as_json == "yes" || as_json == "no", "schedule --json: expected yes or no, found '" + as_json + "'");
  o.json = as_json == "yes";
  if (a.has("--layer-costs")) config.parallel.layer_costs = a.get("--layer-costs");
  if (a.has("--stage-memory-mib")) config.parallel.stage_memory_mib = a.get_int("--stage-memory-mib", 0);
  check(config.parallel.stage_memory_mib >= 0,
        "schedule --stage-memory-mib: expected >= 0, found " + std::to_string(config.parallel.stage_memory_mib));
  // (--partitioner spells the choices as parallel.partitioner does.)
  if (a.has("--partitioner")) o.partitioner = parse_enum<PartitionerKind>(a.get("--partitioner"), "parallel.partitioner");
  if (a.has("--start-cut")) o.start_cut = a.get("--start-cut");
  o.decisions = static_cast<int>(a.get_int("--decisions", 50));
  o.trace = a.get("--trace", "");
  const pipeline::ScheduleChoice choice = pipeline::choose_schedule(config, o);
  g_input_accepted = true;
  pipeline::print_schedule(config, choice, o);
  return 0;
}

int cmd_data_images(const Args& a) {
  ImageDatasetOptions o;
  o.from = a.get("--from");
  o.out = a.get("--out");
  o.size = static_cast<int>(a.get_int("--size", 32));
  o.val_fraction = a.get_double("--val-fraction", 0.1);
  o.vocab_size = static_cast<int>(a.get_int("--vocab-size", 512));
  const std::string strict = a.get("--strict", "no");
  check(strict == "yes" || strict == "no", "data images --strict: expected yes or no, found '" + strict + "'");
  o.strict = strict == "yes";
  if (!o.out.empty()) check_output_path("data images --out", o.out);
  check(!o.from.empty(), "data images: missing --from DIR (a directory of named .png/.jpg images, e.g. /usr/share/icons/Tango)");
  const ImageDatasetResult r = build_image_dataset(o);
  g_input_accepted = true;
  std::printf("keel data images: %s -> %s: %lld train, %lld val images of %d x %d (%lld smaller copies of kept names, "
              "%zu files skipped)\n",
              o.from.c_str(), o.out.c_str(), static_cast<long long>(r.train), static_cast<long long>(r.val), o.size, o.size,
              static_cast<long long>(r.duplicates), r.skipped.size());
  for (size_t i = 0; i < r.skipped.size() && i < 5; ++i) std::printf("  skipped: %s\n", r.skipped[i].c_str());
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 1 : 0;
  }
  const std::string cmd = argv[1];
  if (cmd == "launch") {
    // Help for launch itself, not for the subcommand after "--".
    for (int i = 2; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
      if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
        std::fputs(command_usage(cmd).c_str(), stdout);
        return 0;
      }
    }
    LaunchOptions o = parse_launch_args(std::vector<std::string>(argv + 2, argv + argc));
    o.keel_binary = fs::read_symlink("/proc/self/exe").string();
    // A training job's configuration is checked here, once, for the rank count asked for: a bad
    // key is one line before any rank starts, not one line per rank and MPI's abort chatter.
    if (!o.command.empty() && o.command[0] == "train") {
      std::vector<std::string> words = {argv[0]};
      words.insert(words.end(), o.command.begin(), o.command.end());
      std::vector<char*> pointers;
      for (std::string& w : words) pointers.push_back(w.data());
      const Args a(static_cast<int>(pointers.size()), pointers.data(), 2, {"--config", "--set"});
      if (!a.help) {
        Config config = load_train_config(a);
        resolve_job_config(config, o.ranks);
      }
    }
    g_input_accepted = true;
    return launch(o);
  }
  if (cmd == "data") {
    // `keel data images --from DIR --out DATASET ...`: a subcommand, then options.
    check(argc > 2 && std::strcmp(argv[2], "images") == 0,
          "data: expected a subcommand: images (keel data images --from DIR --out DATASET)");
    Args a(argc, argv, 3, {"--from", "--out", "--size", "--val-fraction", "--vocab-size", "--strict"});
    if (a.help) {
      std::fputs(command_usage(cmd).c_str(), stdout);
      return 0;
    }
    return cmd_data_images(a);
  }
  const std::map<std::string, std::vector<std::string>> options = {
      {"train", {"--config", "--set"}},
      {"tokenize", {"--input", "--out", "--vocab-size", "--val-fraction", "--seed", "--tokenizer"}},
      {"eval", {"--checkpoint", "--llmc", "--llama2c", "--hf", "--data", "--batch", "--seq", "--batches", "--set"}},
      {"generate", {"--checkpoint", "--llmc", "--llama2c", "--hf", "--prompt", "--prompts", "--batch", "--tokens", "--temperature", "--top-k",
                    "--seed", "--tokenizer", "--samples", "--set"}},
      {"score", {"--checkpoint", "--llmc", "--llama2c", "--hf", "--documents", "--batch", "--tokenizer", "--set"}},
      {"export", {"--max-shard-size", "--checkpoint", "--out", "--format", "--tokenizer", "--hf"}},
      {"import", {"--llmc", "--llama2c", "--hf", "--out", "--set"}},
      {"checkpoints", {"--dir", "--verify"}},
      {"report", {"--dir", "--out"}},
      {"simulate", {"--config", "--set", "--cluster", "--nodes", "--layer-costs", "--tensor", "--recompute", "--tiers", "--overlap-sync", "--trace", "--json", "--probe", "--search", "--top", "--stack", "--stacks", "--vocab"}},
      {"schedule", {"--config", "--set", "--trace", "--width", "--layer-costs", "--json", "--partitioner", "--decisions",
                    "--stage-memory-mib", "--start-cut"}},
  };
  auto it = options.find(cmd);
  check(it != options.end(),
        "unknown command '" + cmd +
            "' (expected train, launch, tokenize, eval, generate, score, export, import, schedule, simulate, data, checkpoints or report)");
  // `keel report RUN_DIR`: the run directory may come first, without --dir.
  std::vector<char*> words(argv, argv + argc);
  static char dir_flag[] = "--dir";
  if (cmd == "report" && argc > 2 && argv[2][0] != '-') words.insert(words.begin() + 2, dir_flag);
  Args a(static_cast<int>(words.size()), words.data(), 2, it->second);
  if (a.help) {
    std::fputs(command_usage(cmd).c_str(), stdout);
    return 0;
  }
  if (cmd == "train") return cmd_train(a);
  if (cmd == "tokenize") return cmd_tokenize(a);
  if (cmd == "eval") return cmd_eval(a);
  if (cmd == "generate") return cmd_generate(a);
  if (cmd == "score") return cmd_score(a);
  if (cmd == "export") return cmd_export(a);
  if (cmd == "checkpoints") return cmd_checkpoints(a);
  if (cmd == "schedule") return cmd_schedule(a);
  if (cmd == "simulate") return cmd_simulate(a);
  if (cmd == "report") return cmd_report(a);
  return cmd_import(a);
}

}  // namespace
}  // namespace keel

int main(int argc, char** argv) {
  // The OpenMP wait policy and OpenBLAS's kernels are read when those libraries load: set them,
  // and re-execute once where needed (kernels/cpu/blas.h).
  keel::prepare_compute_environment(argv);
  std::string message;
  int code = 1;
  try {
    return keel::run(argc, argv);
  } catch (const keel::NonFiniteStep& e) {
    message = e.what();
    code = keel::kNonFiniteStepExit;
  } catch (const keel::Error& e) {
    message = e.what();
    code = keel::g_input_accepted ? 1 : 2;
  } catch (const std::filesystem::filesystem_error& e) {
    message = std::string("file system: ") + e.what();
  } catch (const std::bad_alloc&) {
    message = "out of memory";
  } catch (const std::exception& e) {
    message = std::string("internal error: ") + e.what();
  }
  int in_mpi = 0;
  MPI_Initialized(&in_mpi);
  if (in_mpi) {
    // Under MPI one failing rank must take the job down, or the others wait in a collective forever.
    int rank = 0, size = 1, finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_size(MPI_COMM_WORLD, &size);
    }
    std::fprintf(stderr, "keel: %s%s\n", size > 1 ? ("[rank " + std::to_string(rank) + "] ").c_str() : "",
                 message.c_str());
    std::fflush(stderr);
    if (!finalized && size > 1) MPI_Abort(MPI_COMM_WORLD, code);
    return code;
  }
  std::fprintf(stderr, "keel: %s\n", message.c_str());
  return code;
}
