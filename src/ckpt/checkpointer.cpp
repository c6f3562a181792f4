#include "ckpt/checkpointer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "comm/expert_parallel.h"
#include "model/model_layout.h"

namespace keel {

namespace {

// A pipeline stage's checkpoints are written in the whole model's layout: its chunks are the
// whole model's chunks of its layers (chunks never span layers), found by their first tensor
// piece. The replica of a tied tensor is not written (its home's copy is the same bytes).
std::vector<ChunkTarget> whole_model_targets(const ChunkStore& stage, const ChunkStore& whole) {
  std::map<std::pair<std::string, int64_t>, int> by_first_piece;
  for (const Chunk& c : whole.chunks()) {
    if (!c.segments.empty()) {
      by_first_piece[{whole.tensors()[c.segments.front().tensor].spec.name, c.segments.front().tensor_offset}] = c.id;
    }
  }
  std::vector<ChunkTarget> targets;
  for (const Chunk& c : stage.chunks()) {
    if (c.replica || c.segments.empty()) {
      targets.push_back(ChunkTarget{});
      continue;
    }
    const Segment& first = c.segments.front();
    const auto it = by_first_piece.find({stage.tensors()[first.tensor].spec.name, first.tensor_offset});
    // The same pieces of the same tensors at the same places (the last chunk of a store runs on
    // to an alignment boundary, so sizes may differ by padding).
    bool same = it != by_first_piece.end() && whole.chunks()[it->second].segments.size() == c.segments.size();
    for (size_t k = 0; same && k < c.segments.size(); ++k) {
      const Segment &a = c.segments[k], &b = whole.chunks()[it->second].segments[k];
      same = stage.tensors()[a.tensor].spec.name == whole.tensors()[b.tensor].spec.name &&
             a.tensor_offset == b.tensor_offset && a.numel == b.numel &&
             a.offset - c.offset == b.offset - whole.chunks()[it->second].offset;
    }
    check(same, "checkpoint: stage chunk " + std::to_string(c.id) + " is not a chunk of the whole model");
    targets.push_back(ChunkTarget{it->second, whole.chunks()[it->second].numel});
  }
  return targets;
}

}  // namespace

namespace {

int writer_index(int rank, const ParallelConfig& p) {
  const int P = std::max(1, p.pipeline), Cx = std::max(1, p.context), T = std::max(1, p.tensor);
  const int q = rank / T, c = q % Cx, replica = q / Cx / P;
  return (replica * Cx + c) * T + rank % T;
}

}  // namespace

Checkpointer::Checkpointer(const Config& config, Communicator& world, ChunkStore& store, GradSync& sync,
                           double peak_gflops, std::function<void(const nlohmann::json&)> log_event)
    : config_(config),
      comm_(world),
      run_dir_(config, world),
      store_(&store),
      sync_(&sync),
      peak_gflops_(peak_gflops),
      log_event_(std::move(log_event)),
      // Among the ranks holding this rank's layers (its stage's replicas, context and tensor ranks;
      // world rank = ((replica x P + stage) x Cx + context rank) x T + tensor rank, comm/process_groups.h):
      // (replica x Cx + context rank) x T + tensor rank.
      writer_index_(writer_index(comm_.rank(), config.parallel)),
      root_(config.train.run_dir + "/ckpt") {
  if (config.parallel.pipeline > 1 || experts_sharded(config)) {
    whole_ = std::make_unique<ChunkStore>(config.store.chunk_bytes);
    register_layout(*whole_, model_layout(config.model));  // the whole model's tensors; nothing allocated
    whole_->finalize_layout();
  }
  make_writer(/*at_restart=*/std::getenv("KEEL_RESTART") != nullptr);
  last_timed_ = std::chrono::steady_clock::now();
  if (config.checkpoint.memory_every > 0) memory_ = std::make_unique<MemoryCheckpoint>(config, comm_);
}

void Checkpointer::make_writer(bool at_restart) {
  // A stage's chunks are written by its replicas (the ZeRO shards of its moments, when sharded),
  // and with tensor parallelism by every rank of their tensor groups (each holds the stage's whole
  // copy, comm/tensor_parallel.h WholeModelState).
  writers_ = ChunkPartition::balanced(*store_, comm_.size() / std::max(1, config_.parallel.pipeline));
  std::vector<ChunkTarget> targets;
  if (whole_) targets = whole_model_targets(*store_, *whole_);
  int first = writers_.first_chunk[writer_index_], last = writers_.first_chunk[writer_index_ + 1];
  bool experts_apart = false;  // ZeRO-1/2/3 with sharded experts
  if (experts_sharded(config_)) {
    // Sharded experts (comm/expert_parallel.h; every rank's chunks alike but for which experts
    // they hold): the chunks of no expert as the data ranks share them out, each expert's by the
    // rank of the first expert group holding it (data ranks 0 .. P - 1, writer index = data rank x
    // T + tensor rank). With tensor parallelism each rank of a tensor group holds its experts'
    // whole copy (WholeModelState): their chunks are shared out over the group's T ranks.
    const int T = std::max(1, config_.parallel.tensor);
    const bool first_group = writer_index_ / T < config_.parallel.expert;
    // Under ZeRO-1/2/3 each chunk by the rank owning its moments (comm/zero.h, experts apart; the
    // writer index is then the data rank; under ZeRO-3 also its parameters' home), streamed: a
    // rank's moments are not one flat range.
    // (In a pipeline the data ranks are a stage's replicas, sharing out the stage's chunks.)
    // With tensor groups (ZeRO-1/2/3) every rank holds the whole copy of its experts and of the
    // chunks of no expert: the latter shared out over the data x tensor writers, each expert's
    // chunks over the D / P x T writers holding it (holder index = data rank / P x T + tensor rank).
    const int stage_replicas = comm_.size() / std::max(1, config_.parallel.pipeline);
    const int P = config_.parallel.expert;
    experts_apart = config_.parallel.zero > 0 && stage_replicas > 1;
    const ChunkPartition owners =
        experts_apart ? ChunkPartition::balanced_experts_apart(*store_, stage_replicas, P) : ChunkPartition{};
    const int holder = writer_index_ / T / P * T + writer_index_ % T;
    for (const Chunk& c : store_->chunks()) {
      const bool mine = experts_apart && c.expert >= 0 ? c.id >= owners.expert_first_chunk[holder] &&
                                                             c.id < owners.expert_first_chunk[holder + 1]
                        : experts_apart                ? owners.owns(writer_index_, c)
                        : c.expert >= 0                ? first_group && c.id % T == writer_index_ % T
                                                       : c.id >= first && c.id < last;
      if (!mine) targets[c.id].id = -1;
    }
    first = 0;
    last = static_cast<int>(store_->chunks().size());
  }
  // A run that checkpoints periodically touches its snapshot buffers now, not in its first
  // checkpoints' steps; a restarted job does not: its start-up is down time (up to 1.5 GB per
  // rank to fault in for GPT-2 124M), and its first checkpoint allocates them.
  const bool periodic = config_.train.checkpoint_every > 0 || config_.train.checkpoint_every_minutes > 0;
  // Under ZeRO-3 a rank's chunks (parameters and both moments) are most of what it holds: a
  // snapshot copy of them would not fit beside them (tinyllama-1.1b on 2 ranks: 6.6 GB more per
  // rank), so its checkpoints stream from the store, chunk by chunk.
  const int data_ranks = comm_.size() / std::max(1, config_.parallel.pipeline * config_.parallel.tensor);
  const bool stream = (config_.parallel.zero == 3 && data_ranks > 1) || experts_apart;
  writer_ = std::make_unique<CheckpointWriter>(*store_, config_.checkpoint, comm_.rank(), first, last,
                                               periodic && !at_restart,
                                               std::move(targets), stream);
  writer_->set_run_id(run_dir_.run_id());
}

void Checkpointer::relayout(ChunkStore& store, GradSync& sync) {
  finish_in_flight();
  store_ = &store;
  sync_ = &sync;
  make_writer();
}

Checkpointer::~Checkpointer() = default;

std::string Checkpointer::last_name() const { return writer_->name(); }

double Checkpointer::buffer_bytes() const {
  // Where the store's pages move (tiers), and under ZeRO-3, checkpoints stream under leases: no
  // snapshot buffers. Otherwise one snapshot of the writer's range (three planes), and a second,
  // the base XOR deltas are taken against, once a differential checkpoint follows a committed one:
  // only where checkpoints are periodic (a run whose one checkpoint is the end-of-run one takes one).
  const bool periodic = config_.train.checkpoint_every > 0 || config_.train.checkpoint_every_minutes > 0;
  const int copies = writer_->streams()                                                         ? 0
                     : periodic && config_.checkpoint.delta && config_.checkpoint.full_every > 1 ? 2
                                                                                                 : 1;
  return copies * 3.0 * static_cast<double>(writers_.size(writer_index_)) * sizeof(float);
}

ResumeSource resume_source(const Config& config) {
  ResumeSource source;
  const std::string root = config.train.run_dir + "/ckpt";
  const bool restarted = std::getenv("KEEL_RESTART") != nullptr;
  source.has_own = !list_checkpoints(root).empty() || Env::get().exists(root + "/manifest.json");
  source.automatic = config.train.resume_auto() || (restarted && source.has_own);
  if (!source.automatic) {
    source.path = config.train.resume;
  } else if (source.has_own) {
    source.path = root;
  }
  return source;
}

std::vector<std::string> ResumeSource::candidates() const {
  return path.empty() ? std::vector<std::string>{} : checkpoint_candidates(path);
}

std::optional<TrainState> Checkpointer::resume() {
  const TrainConfig& t = config_.train;
  // When the state load began, and how long it took (`event: resume`; recovery's breakdown).
  const auto started = std::chrono::system_clock::now();
  const auto stamp = [&] {
    resume_event_["started_ns"] =
        std::chrono::duration_cast<std::chrono::nanoseconds>(started.time_since_epoch()).count();
    resume_event_["load_s"] = std::chrono::duration<double>(std::chrono::system_clock::now() - started).count();
    resume_event_["process_start_ns"] = process_start_ns();
  };
  const int world = comm_.size();
  // A checkpoint directory without a manifest: what a crash during one of this run's writes
  // leaves behind is removed; anything else is left alone (and never used).
  if (comm_.is_root()) {
    const IncompleteCheckpoints found = remove_interrupted_checkpoints(root_, run_dir_.run_id());
    for (const std::string& name : found.removed) {
      std::fprintf(stderr, "keel: removed %s/%s: an incomplete checkpoint (no manifest; a write of this run was "
                   "interrupted)\n", root_.c_str(), name.c_str());
    }
    for (const auto& [name, why] : found.kept) {
      std::fprintf(stderr, "keel: left %s/%s alone (no manifest; %s): not known as an interrupted write of this run, "
                   "and not used\n", root_.c_str(), name.c_str(), why.c_str());
    }
  }
  // A job restarted by `keel launch --max-restarts` continues from its own newest checkpoint when
  // it has one, whatever train.resume says (that was where the first attempt started).
  const bool restarted = std::getenv("KEEL_RESTART") != nullptr;
  const ResumeSource source = resume_source(config_);
  const bool automatic = source.automatic;
  const std::string& resume = source.path;
  if (std::optional<TrainState> state = resume_from_memory(restarted || t.resume_auto())) {
    settle_run_id();
    stamp();
    return state;
  }
  const std::vector<std::string> candidates = source.candidates();
  std::string last_why;
  std::vector<std::string> rejections;  // said when an older candidate is used, or with "auto"
  for (size_t i = 0; i < candidates.size(); ++i) {
    std::string why;
    TrainState state;
    std::vector<float> residual;
    std::vector<GradSync::ResidualPart> residual_parts;
    std::string residual_note, carried_layout;
    std::vector<float> carried;
    // Another run's checkpoint found among this run's own (copied into its ckpt/) is never taken
    // by "auto" or a restart: that would continue the other run's trajectory under this one's name.
    if (automatic || restarted) {
      const std::string writer = run_dir_.foreign_writer(candidates[i]);
      if (!writer.empty()) {
        last_why = "checkpoint " + candidates[i] + ": written by run " + writer + ", not by this directory's run " +
                   run_dir_.run_id() + " (another run's checkpoint is resumed only by naming it in train.resume, " +
                   "into its own train.run_dir); not resumed";
        if (comm_.is_root()) rejections.push_back("keel: checkpoint rejected: " + last_why);
        continue;
      }
    }
    try {
      state = load_checkpoint(candidates[i], *store_, config_, LoadMode::resume, world);
      residual_note = load_residuals(state, residual, residual_parts);
      load_carried(state, carried_layout, carried);
    } catch (const Error& e) {
      why = e.what();
    }
    // Every rank must load the same checkpoint: a candidate is used only if it verified on all ranks.
    if (comm_.allreduce_max(why.empty() ? 0.0 : 1.0) == 0.0) {
      // Another run's checkpoint never continues in a directory holding a run (a restarted job's
      // first attempt was checked).
      if (!automatic && !restarted) run_dir_.check_resume_from(resume, candidates[i]);
      if (whole_state_ != nullptr) whole_state_->scatter();
      for (const std::string& r : rejections) std::fprintf(stderr, "%s\n", r.c_str());
      if (!residual.empty()) sync_->restore_residuals(residual);
      if (carried_ != nullptr) carried_->restore(carried_layout, carried);
      // Residuals carried by key (another layout): how many of this run's buckets they fill.
      double keyed[3] = {static_cast<double>(sync_->restore_residual_parts(residual_parts)),
                         static_cast<double>(sync_->num_compressed_buckets()), residual_parts.empty() ? 0.0 : 1.0};
      comm_.allreduce_sum(keyed, 3);
      if (keyed[2] > 0 && comm_.is_root() && keyed[0] == 0) {
        std::fprintf(stderr, "keel: checkpoint %s: compression residuals dropped (saved under another layout, no bucket's "
                     "key matches one of this run's %.0f: another codec, bucket size or layer): error feedback starts "
                     "from zero\n", candidates[i].c_str(), keyed[1]);
      } else if (keyed[2] > 0 && comm_.is_root()) {
        std::fprintf(stderr, "keel: checkpoint %s: compression residuals saved under another layout carried by key into "
                     "%.0f of %.0f buckets%s\n", candidates[i].c_str(), keyed[0], keyed[1],
                     keyed[0] < keyed[1] ? " (the others' residuals dropped: their error feedback starts from zero)" : "");
      }
      if (!residual_note.empty() && comm_.is_root()) std::fprintf(stderr, "keel: %s\n", residual_note.c_str());
      state.dir = candidates[i];
      note_other_data(state);
      settle_run_id();
      if (memory_ && comm_.is_root()) {
        std::printf("keel: resumed from disk (checkpoint %s, step %lld)\n", state.dir.c_str(),
                    static_cast<long long>(state.step));
      }
      resume_event_ = {{"event", "resume"}, {"source", "disk"}, {"step", state.step}, {"from", state.dir}};
      stamp();
      return state;
    }
    last_why = why.empty() ? "checkpoint " + candidates[i] + ": rejected by another rank" : why;
    if (!why.empty()) {
      rejections.push_back("keel: " + (world > 1 ? "[rank " + std::to_string(comm_.rank()) + "] " : std::string()) +
                           "checkpoint rejected: " + why);
    }
  }
  // An explicit resume that cannot be used is one line (below), however many candidates it had.
  if (automatic) {
    for (const std::string& r : rejections) std::fprintf(stderr, "%s\n", r.c_str());
  }
  // An explicit resume must succeed; "auto" starts afresh when nothing usable is there.
  check(automatic || candidates.empty(),
        candidates.size() == 1 ? last_why : "checkpoint " + resume + ": no usable checkpoint (" + last_why + ")");
  run_dir_.check_fresh_start(restarted);
  if (!candidates.empty()) {
    if (comm_.is_root()) std::fprintf(stderr, "keel: no usable checkpoint under %s: starting from step 0\n", resume.c_str());
    // A failed load may have written into the store: start from a clean state.
    clear_loaded_state(*store_);
  }
  settle_run_id();
  return std::nullopt;
}

void Checkpointer::settle_run_id() {
  run_dir_.settle_run_id();
  writer_->set_run_id(run_dir_.run_id());
}

std::optional<TrainState> Checkpointer::resume_from_memory(bool eligible) {
  if (!memory_) return std::nullopt;
  int64_t disk_step = -1;
  if (comm_.is_root()) {
    const std::vector<std::string> own = list_checkpoints(root_);
    try {
      if (!own.empty()) disk_step = describe_checkpoint(own.front()).step;
    } catch (const Error&) {
      // an unreadable newest checkpoint: the disk resume below reports it
    }
  }
  disk_step = comm_.broadcast(disk_step);
  std::string why_not;
  std::optional<MemoryResume> m = memory_->resume(*store_, *sync_, disk_step, eligible, &why_not);
  const std::string disk = disk_step < 0 ? "none" : "step " + std::to_string(disk_step);
  if (!m) {
    if (!why_not.empty() && comm_.is_root()) {
      std::printf("keel: not resuming from memory: %s (newest disk checkpoint: %s)\n", why_not.c_str(), disk.c_str());
    }
    return std::nullopt;
  }
  if (comm_.is_root()) {
    std::printf("keel: resumed from memory (step %lld) in %.2f s: %d rank(s) from their own copy, %d from their "
                "buddy's, in %s; newest disk checkpoint: %s\n",
                static_cast<long long>(m->state.step), m->load_s, m->from_own, m->from_buddy, m->where.c_str(),
                disk.c_str());
    std::fflush(stdout);
  }
  if (whole_state_ != nullptr) whole_state_->scatter();  // the whole model's copy into this rank's shards
  // The step engine's carried state, as a disk resume restores it (the copy is this run's own: its
  // trajectory and layout were checked, so a copy without one has nothing to restore).
  const RankState& mine = m->state.ranks.front();
  if (carried_ != nullptr && mine.has_carried) {
    const std::string why = carried_->check_resume(mine.carried_layout, m->carried.size());
    check(why.empty(), "memory copy of step " + std::to_string(m->state.step) + ": " + why);
    carried_->restore(mine.carried_layout, m->carried);
  }
  resume_event_ = {{"event", "resume"}, {"source", "memory"},  {"step", m->state.step},  {"from", m->where},
                   {"own", m->from_own}, {"buddy", m->from_buddy}, {"disk_step", disk_step}};
  return m->state;
}

void Checkpointer::remove_memory_copies() {
  if (memory_) memory_->remove_all();
}

void Checkpointer::note_other_data(const TrainState& state) const {
  if (!comm_.is_root()) return;
  Config writer;
  try {
    writer = Config::parse(state.config_toml, "checkpoint " + state.dir + " config");
  } catch (const Error&) {
    return;  // an old checkpoint's config: nothing to compare
  }
  // The loader's position counts windows of (data ranks x batch) sequences: in windows of
  // another width the same position is another place in the stream.
  // (A replica spans pipeline x context x tensor ranks.)
  const int64_t theirs_wide =
      static_cast<int64_t>(writer.train.batch_size) *
      (static_cast<int64_t>(state.ranks.size()) /
       std::max(1, writer.parallel.pipeline * writer.parallel.tensor * writer.parallel.context));
  const int64_t ours_wide =
      static_cast<int64_t>(config_.train.batch_size) *
      (comm_.size() / std::max(1, config_.parallel.pipeline * config_.parallel.tensor * config_.parallel.context));
  if (theirs_wide != ours_wide) {
    std::fprintf(stderr,
                 "keel: resuming with data windows of %lld sequences (data ranks x train.batch_size) where the "
                 "checkpoint's run read windows of %lld: the data position carries over as a window count, so the "
                 "sequences from here on are not those the checkpoint's run would have read next\n",
                 static_cast<long long>(ours_wide), static_cast<long long>(theirs_wide));
  }
  const std::string theirs = writer.data.train;
  if (theirs == config_.data.train) return;
  std::fprintf(stderr,
               "keel: resuming onto a different training set (the checkpoint's run read %s, this run reads %s): its "
               "data position (epoch %llu, window %llu) carries over to the new set\n",
               theirs.c_str(), config_.data.train.c_str(), static_cast<unsigned long long>(state.data.epoch),
               static_cast<unsigned long long>(state.data.index));
}

std::string Checkpointer::load_residuals(const TrainState& state, std::vector<float>& out,
                                         std::vector<GradSync::ResidualPart>& parts) {
  out.clear();
  parts.clear();
  if (sync_->residual_size() == 0) return "";
  const RankState* mine = nullptr;
  for (const RankState& r : state.ranks) {
    if (r.rank == comm_.rank()) mine = &r;
  }
  const std::string layout = sync_->residual_layout();
  if (state.ranks.size() == static_cast<size_t>(comm_.size()) && mine != nullptr && mine->has_residual &&
      mine->residual_layout == layout) {
    out = read_rank_residual(state.dir, comm_.rank());
    check(out.size() == sync_->residual_size(), "checkpoint " + state.dir + ": residual of rank " +
                                                   std::to_string(comm_.rank()) + " has the wrong size");
    return "";
  }
  // Another layout of the same data-parallel ranks (another pipeline cut or depth): each bucket's
  // residual by key, from the saved ranks of this rank's replica (world rank = replica x P + stage).
  const int P = std::max(1, config_.parallel.pipeline), D = comm_.size() / P;
  const std::string ranks_tag = ":D" + std::to_string(D);
  const bool keyed = std::all_of(state.ranks.begin(), state.ranks.end(), [&](const RankState& r) {
    return r.has_residual && !r.residual_keys.empty() && r.residual_keys.find(ranks_tag) != std::string::npos;
  });
  if (keyed && state.ranks.size() % static_cast<size_t>(D) == 0) {
    const int saved_P = static_cast<int>(state.ranks.size()) / D;
    for (const RankState& r : state.ranks) {
      if (r.rank / saved_P != comm_.rank() / P) continue;
      const std::vector<float> flat = read_rank_residual(state.dir, r.rank);
      for (GradSync::ResidualPart& part : GradSync::split_residuals(r.residual_keys, flat)) parts.push_back(std::move(part));
    }
    return "";
  }
  return "checkpoint " + state.dir + ": compression residuals dropped (saved by " + std::to_string(state.ranks.size()) +
         " rank(s)" + (mine != nullptr && mine->has_residual ? " for " + mine->residual_layout : "") + "; this run has " +
         layout + "): error feedback starts from zero";
}

void Checkpointer::load_carried(const TrainState& state, std::string& layout, std::vector<float>& floats) {
  layout.clear();
  floats.clear();
  const RankState *mine = nullptr, *any = nullptr;
  for (const RankState& r : state.ranks) {
    if (r.has_carried && any == nullptr) any = &r;
    if (r.has_carried && r.rank == comm_.rank()) mine = &r;
  }
  if (any == nullptr) return;  // none saved: the engine's state starts afresh
  // A rank the writer did not have compares the layout of one it had (and is refused: another layout).
  const std::string& saved = (mine != nullptr ? mine : any)->carried_layout;
  if (carried_ == nullptr) {
    std::string what;
    try {
      what = nlohmann::json::parse(saved).at("what").get<std::string>();
    } catch (const nlohmann::json::exception&) {
      what = "an unreadable description";
    }
    throw Error("checkpoint " + state.dir + ": its ranks saved state each step carries into the next (" + what +
                "), which this run has no place for (another layout or step engine): resume it with the config "
                "that wrote it");
  }
  // (Replicated state: a rank the writer did not have takes the first saved rank's.)
  const RankState* source = mine != nullptr ? mine : carried_->replicated() ? any : nullptr;
  if (source != nullptr) floats = read_rank_carried(state.dir, source->rank);
  const std::string why = carried_->check_resume(saved, source != nullptr ? floats.size() : 0);
  check(why.empty(), "checkpoint " + state.dir + ": " + why);
  layout = saved;
}

void Checkpointer::report_recovery(int64_t step, const std::string& from) {
  if (!resume_event_.is_null() && comm_.is_root()) log_event_(resume_event_);
  resume_event_ = nullptr;
  const char* restart = std::getenv("KEEL_RESTART");
  if (restart == nullptr || !comm_.is_root()) return;
  const char* noticed = std::getenv("KEEL_FAILURE_NOTICED_NS");
  const char* failure = std::getenv("KEEL_FAILURE");
  const int64_t now_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const double seconds = noticed != nullptr ? (now_ns - std::atoll(noticed)) / 1e9 : -1.0;
  const std::string source = from.empty() ? "scratch" : from;
  std::printf("keel: recovered from failure %s (%s) in %.2f s: training resumes at step %lld from %s\n", restart,
              failure != nullptr ? failure : "unknown", seconds, static_cast<long long>(step), source.c_str());
  std::fflush(stdout);
  log_event_({{"event", "recovery"}, {"restart", std::atoi(restart)}, {"failure", failure ? failure : ""},
              {"recovery_s", seconds}, {"step", step}, {"from", source},
              {"noticed_ns", noticed != nullptr ? std::atoll(noticed) : 0}, {"resumed_ns", now_ns}});
}

void Checkpointer::after_step(int64_t steps_done, const LoaderPosition& data) {
  // A background write still running on any rank keeps the checkpoint in flight.
  const bool writing = writer_->in_flight() && !writer_->done();
  const bool any_writing = comm_.size() > 1 ? comm_.allreduce_max(writing ? 1.0 : 0.0) > 0 : writing;
  if (writer_->in_flight() && !any_writing) commit();  // every rank has written its part
  // A periodic checkpoint begins here, so the step's time includes what it costs training (the
  // snapshot copy; with checkpoint.async = false the whole write). The last step's checkpoint is
  // the final save of the run.
  const int every = config_.train.checkpoint_every;
  const bool by_steps = every > 0 && steps_done % every == 0;
  const bool by_clock = due_by_clock();  // (a collective when timed checkpoints are on)
  if ((by_steps || by_clock) && steps_done != config_.train.steps) begin(root_, steps_done, data);
  // The memory copy: the same state, to /dev/shm and the buddy rank (the last step's state goes to
  // disk as the final checkpoint).
  if (memory_ && steps_done % config_.checkpoint.memory_every == 0 && steps_done != config_.train.steps) {
    store_->apply_pending();
    // Tensor parallel: the copy is of the whole model's state, as the disk's (every rank of the
    // tensor group gathers: a collective; a disk checkpoint begun this step gathered already).
    if (whole_state_ != nullptr && !(by_steps || by_clock)) whole_state_->gather();
    RankState state = rank_state(data, memory_residual_);
    std::vector<float> carried;  // (the step engine's: bias balancing's routing biases)
    if (carried_ != nullptr) {
      state.carried_layout = carried_->save(steps_done, carried);
      state.has_carried = true;
    }
    stall_ms_ += memory_->save(steps_done, *store_, state, memory_residual_, carried);
  }
}

bool Checkpointer::due_by_clock() {
  const double minutes = config_.train.checkpoint_every_minutes;
  if (minutes <= 0) return false;
  const auto now = std::chrono::steady_clock::now();
  const bool due = comm_.is_root() && now - last_timed_ >= std::chrono::duration<double, std::ratio<60>>(minutes);
  if (comm_.broadcast(due ? 1 : 0) == 0) return false;
  last_timed_ = now;
  return true;
}

bool Checkpointer::save(const std::string& root, int64_t steps_done, const LoaderPosition& data) {
  if (writer_->in_flight() && inflight_step_ == steps_done && inflight_root_ == root) {
    return commit();  // this very state is being written already
  }
  begin(root, steps_done, data);
  return !writer_->in_flight() ? last_ok_ : commit();
}

std::string Checkpointer::save_final(int64_t steps_done, const LoaderPosition& data) {
  if (!save(root_, steps_done, data)) return "";
  return root_ + "/" + last_name();
}

void Checkpointer::finish_in_flight() {
  if (writer_->in_flight()) commit();
}

std::string Checkpointer::newest_verified() {
  std::string newest;
  if (comm_.is_root()) {
    for (const std::string& dir : list_checkpoints(root_)) {
      try {
        verify_checkpoint(dir);
        newest = dir;
        break;
      } catch (const Error& e) {
        std::fprintf(stderr, "keel: %s does not verify: %s\n", dir.c_str(), e.what());
      }
    }
  }
  return newest;
}

double Checkpointer::take_stall_ms() {
  const double ms = stall_ms_;
  stall_ms_ = 0;
  return ms;
}

RankState Checkpointer::rank_state(const LoaderPosition& data, std::vector<float>& residual) const {
  RankState state;
  state.rank = comm_.rank();
  state.data = data;
  if (sync_->residual_size() > 0) {
    sync_->copy_residuals(residual);
    state.has_residual = true;
    state.residual_layout = sync_->residual_layout();
    state.residual_keys = sync_->residual_keys();
  }
  return state;
}

void Checkpointer::begin(const std::string& root, int64_t step, const LoaderPosition& data) {
  const auto t0 = std::chrono::steady_clock::now();
  store_->apply_pending();  // the checkpoint holds the state after the step's update
  if (writer_->in_flight()) commit();  // one checkpoint in flight at a time
  if (whole_state_ != nullptr) whole_state_->gather();  // (every rank: a collective over the tensor group)
  RankState state = rank_state(data, residual_scratch_);
  // Rank 0 names the checkpoint (a later attempt at a step that already has one gets a new name).
  const int attempt = static_cast<int>(comm_.broadcast(comm_.is_root() ? next_checkpoint_attempt(root, step) : 0));
  if (carried_ != nullptr) {
    carried_scratch_.clear();
    state.carried_layout = carried_->save(step, carried_scratch_);
    state.has_carried = true;
  }
  writer_->begin(root, step, state, attempt, &residual_scratch_, &carried_scratch_);
  inflight_step_ = step;
  inflight_root_ = root;
  inflight_config_ = config_;  // as of the snapshot (a component may move its state on meanwhile)
  begin_ms_ = ms_since(t0);
  stall_ms_ += begin_ms_;
  if (!config_.checkpoint.async) commit();
}

bool Checkpointer::commit() {
  const auto t0 = std::chrono::steady_clock::now();
  // Each rank's part reaches rank 0 as its binary encoding (one gather), decoded there.
  const std::vector<std::string> encoded = comm_.gather_strings(encode_part(writer_->finish()));
  int64_t ok = 0;
  if (comm_.is_root()) {
    CheckpointStats st;
    std::string failure;
    try {
      std::vector<CheckpointPart> parts;
      for (const std::string& bytes : encoded) parts.push_back(decode_part(bytes));
      failure = publish_checkpoint(inflight_root_, parts, whole_ ? *whole_ : *store_, inflight_config_, comm_.size(),
                                   peak_gflops_, config_.checkpoint.keep, run_dir_.run_id(), &st);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    ok = failure.empty() ? 1 : 0;
    const double stall = begin_ms_ + ms_since(t0);
    const std::string name = writer_->name();
    if (ok) {
      std::printf("keel: checkpoint %s: %s, %.1f MB written for %.1f MB of state (%.0f %%)", name.c_str(),
                  st.full ? "full" : "differential", st.written_bytes / 1e6, st.raw_bytes / 1e6,
                  st.raw_bytes > 0 ? 100.0 * st.written_bytes / st.raw_bytes : 0.0);
      if (!st.full) std::printf(", %d of %d chunk planes unchanged, %d as XOR deltas", st.unchanged, st.records, st.xor_records);
      std::printf("; step stall %.1f ms, background write %.0f ms\n", stall, st.write_ms);
    } else {
      const std::vector<std::string> kept = list_checkpoints(inflight_root_);
      std::printf("keel: checkpoint %s not written: %s; newest checkpoint: %s\n", name.c_str(), failure.c_str(),
                  kept.empty() ? "none" : kept.front().c_str());
    }
    std::fflush(stdout);
    nlohmann::json event = {{"event", "checkpoint"}, {"step", inflight_step_}, {"name", name}, {"ok", ok != 0},
                            {"full", st.full}, {"raw_bytes", st.raw_bytes}, {"written_bytes", st.written_bytes},
                            {"records", st.records}, {"unchanged", st.unchanged}, {"xor_records", st.xor_records},
                            {"stall_ms", stall}, {"write_ms", st.write_ms}};
    if (!ok) event["error"] = failure;
    log_event_(event);
  }
  ok = comm_.broadcast(ok);
  writer_->committed(ok != 0);
  stall_ms_ += ms_since(t0);
  last_ok_ = ok != 0;
  return last_ok_;
}

}  // namespace keel
