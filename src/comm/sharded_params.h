// ZeRO-3: sharded parameters as residency. Each parameter page (one chunk's parameter plane) has
// its home on the chunk's owner in the data-parallel group (the same ChunkPartition that owns
// the chunk's moments and reduced gradient); other ranks hold it only while a layer uses it.
//
// A layer's lease (ChunkStore::use_layer, Residency::acquire_layer) gathers the layer's chunks it
// does not hold: every rank takes the same layer leases in the same order (forward, backward,
// evaluation), so the owners' broadcasts match on every rank. The leases of each pass are
// recorded, a training step's and an evaluation batch's apart (begin_pass: an evaluation between
// two steps neither shifts the steps' schedule nor follows it); in the next pass of the same kind,
// when a lease is the one recorded at the same place, the recorded next lease's chunks are
// broadcast ahead (non-blocking). MPI moves a non-blocking broadcast only inside MPI calls, and
// forward makes none between two layers' leases: a progress thread of the rank tests the
// broadcasts ahead every 200 us while the layers compute, until the lease that needs them claims
// them (where MPI grants MPI_THREAD_MULTIPLE and parallel.zero3_progress_thread is on; otherwise
// the gradient sync's tests between backward's layers are what drives them). When the last lease
// of a chunk ends, another rank's chunk is given back (zeroed, MADV_DONTNEED, as ZeRO-2's
// gradient discard does) unless `parallel.zero3_keep` keeps it until the optimizer step. A rank's
// parameter memory is therefore its own shard plus the layers in flight; both are measured
// (mincore), not assumed.
//
// It wraps the residency the store had: its own (every page present), the memory tiers' (a
// rank's shard homed by the tier policy, gathered layers broadcast into leased pages: ZeRO-
// Infinity's layout) or the bf16 state's (gathers move the owners' bf16 bits, widened under the
// lease). Every other plane behaves as the wrapped residency (gradients are reduce-scattered to
// the owners by GradSync, moments sharded by the optimizer). In a pipeline the group is a
// stage's replicas.
//
// Sharded experts (parallel.expert = P, comm/zero.h experts apart: a rank's store holds its E / P
// routed experts beside every chunk of no expert, at the same offsets on every rank): the chunks
// of no expert are homed over the data group as above, each expert chunk on one of the data / P
// ranks holding the same experts (data ranks with the same rank % P). A rank's own chunks are then
// not one range: its parameter home is their span (ChunkStore::home_params), into which the
// weights are drawn or loaded; once they settle, the pages of the chunks in it that it does not
// own go back (the span is flagged with the own ones, so memory tiers home those alone). A gather
// broadcasts a chunk of no expert over the data group and an expert chunk over its holders (none
// when data = P: a rank owns its experts' chunks); every rank of the data group still takes the
// same leases, so each holder group joins the same broadcasts. A lease of chunks a rank alone
// holds (data = P: a MoE block leases its experts apart from the layer, comm/expert_parallel.h
// experts_gathered_with_layers) is its own: passed to the wrapped residency, neither gathered nor
// recorded. Where several ranks hold each expert and the blocks gather their experts apart
// (comm/expert_parallel.h gather_experts_apart: the holders agree on the experts any of them
// routed rows to), a lease of one expert's chunks alone is gathered over its holders and pinned as
// a layer's, but not recorded nor ordered after the broadcasts ahead: holders of other experts
// take other such leases.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/zero.h"
#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

class Bf16State;  // store/bf16_state.h

// ZeRO-3's combinations, checked with the job's configuration: one line naming the key for each
// that is refused. `data_ranks`: the data-parallel group's size.
void validate_zero3_config(const Config& c, int data_ranks);

class ShardedParams final : public Residency {
 public:
  // Attaches itself to `store` (finalized, its own residency attached, the parameter plane not
  // touched) for `owners`' rank `dp.rank()`, and makes the rank's own chunks the store's parameter
  // home (ChunkStore::home_params): the weights are drawn or loaded into them alone, and another
  // rank's chunk is present only under a layer's lease. Collective over `dp` (the group's figures).
  // `progress_thread`: test the broadcasts ahead from a thread of its own (where MPI allows it).
  ShardedParams(Communicator& dp, ChunkStore& store, const ChunkPartition& owners, Zero3Keep keep,
                bool progress_thread);
  ~ShardedParams() override;  // stops the progress thread; gives the store back its own residency

  // The residency the store was given after this one was attached (the memory tiers', built
  // later) becomes the one this wraps, and this is attached again in its place. Local.
  void wrap_attached();
  // bf16 working parameters (runtime.param_dtype = "bf16", `state` wrapped as above): a gather
  // broadcasts the owner's bf16 bits into `state` (half the bytes of float32), which widens
  // them under the layer's lease as for any chunk. Local.
  void gather_bits_into(Bf16State* state) { bits_ = state; }
  // After the weights were drawn or loaded on every rank: the leases recorded from here on are
  // the training's (the schedule that broadcasts ahead). Local.
  void settled();
  // The layer leases from here on are a pass of this kind, every rank alike (a training step's
  // start; each evaluation batch's): the leases recorded since the last call become the schedule
  // of that pass's kind, and this pass follows its own kind's (the last step's, the last
  // evaluation batch's). Local.
  void begin_pass(LeasePass pass);
  // After the owners updated their chunks (the optimizer step): every gathered copy of another
  // rank's chunk is dropped (stale). Requires no layer lease open. Local.
  void drop_gathered();
  // Collective: every chunk gathered and kept until drop_gathered() (a sample drawn on one rank).
  void gather_whole();

  // Figures of this rank, in bytes.
  int64_t shard_bytes() const { return shard_bytes_; }  // its own chunks' parameter pages
  int64_t whole_bytes() const;                          // the whole parameter plane
  int64_t gathered_bytes() const { return gathered_bytes_; }  // other ranks' pages held now
  // Since the last call: the largest gathered_bytes() and resident parameter bytes measured
  // (mincore) at the same moments, after each lease's gather and before the next broadcast ahead
  // starts; the most bytes broadcast ahead at once; the bytes received, by training steps and by
  // evaluation batches (LeasePass).
  struct Peaks {
    int64_t gathered_bytes = 0, resident_bytes = 0, ahead_bytes = 0, received_bytes = 0, evaluation_received_bytes = 0;
  };
  Peaks take_peaks();
  // The largest any one layer's lease (or the head's with the tied embedding) gathers from others:
  // what keep = "none" holds in flight at most, without what is broadcast ahead.
  int64_t largest_layer_gather_bytes() const;
  // The largest any one layer's lease (or the head's with the tied embedding) holds in float32,
  // its own chunks' pages included: what bf16 working parameters widen under one lease.
  int64_t largest_layer_bytes() const;
  // The largest shard, largest_layer_gather_bytes() and largest_layer_bytes() over the group (the
  // start-up line's).
  int64_t group_max_shard_bytes() const { return group_max_[0]; }
  int64_t group_max_layer_gather_bytes() const { return group_max_[1]; }
  int64_t group_max_layer_bytes() const { return group_max_[2]; }

  // Residency.
  // As the wrapped residency: the store's own keeps this rank's shard present (whole-plane work
  // reads it); the tiers' move its pages, and every use goes page by page under leases.
  bool always_present() const override { return inner_->always_present(); }
  void acquire(std::span<const PageRef> pages) override;
  void acquire_layer(std::span<const PageRef> pages) override;
  void release(std::span<const PageRef> pages, bool modified) override { inner_->release(pages, modified); }
  void release_layer(std::span<const PageRef> pages, bool modified) override;
  // Passed on for this rank's own pages (its shard, gathered chunks, the other planes): another
  // rank's parameter page arrives by broadcast, not from a tier.
  int hint(std::span<const PageRef> pages) override;
  uint64_t version(PageRef p) const override { return inner_->version(p); }
  void zero(PageRef p, bool zeroed_in_place) override { inner_->zero(p, zeroed_in_place); }
  void discard(Plane plane, int64_t offset, int64_t numel) override { inner_->discard(plane, offset, numel); }
  bool updates_at_home(PageRef p) const override { return inner_->updates_at_home(p); }
  void update_at_home(PageRef p, const std::function<void(float*, size_t)>& update) override {
    inner_->update_at_home(p, update);
  }
  bool known_sum_squares(PageRef p, double* out) const override { return inner_->known_sum_squares(p, out); }
  void step_shape_changed() override { inner_->step_shape_changed(); }

 private:
  bool own(int chunk) const { return own_.empty() ? chunk >= own_first_ && chunk < own_last_ : own_[chunk] != 0; }
  // Where a chunk's broadcast runs, and its root there: the data group and the chunk's owner, or
  // (an expert chunk, experts apart) its holders and the holder owning it.
  Communicator& comm_of(int chunk) const;
  int root_of(int chunk) const;
  // An expert chunk this rank alone holds (experts apart with data = P): never broadcast.
  bool alone(int chunk) const;
  // Whether the parameter pages among `pages` are some, and all of chunks this rank alone holds.
  bool alone_only(std::span<const PageRef> pages) const;
  // Whether the parameter pages among `pages` are some, and all of expert chunks.
  bool experts_only(std::span<const PageRef> pages) const;
  // Gathers an expert's chunks leased apart from its layer (acquire_layer): their broadcasts over
  // the holders, started and waited for, the broadcasts ahead left in flight.
  void gather_apart(std::span<const PageRef> pages);
  // The flat range a chunk's pages span: from its start to the next chunk's (alignment included).
  int64_t extent(int chunk) const;
  void gather(std::span<const PageRef> pages);
  // Marks a chunk gathered and starts its broadcast from its owner (every rank alike).
  Communicator::Request start_gather(int chunk);
  // Starts the broadcasts of these chunks that are not gathered (the recorded next lease's).
  void start_ahead(const std::vector<int>& chunks);
  void wait_ahead();
  void written(const std::vector<int>& chunks);
  void give_back(int chunk);
  // The bytes a gather moves per element: bf16 bits or float32.
  int64_t element_bytes() const { return bits_ != nullptr ? 2 : static_cast<int64_t>(sizeof(float)); }
  void count_gather(int chunk);  // marks it gathered (every rank alike) and counts its bytes
  void note_peaks();
  void progress_loop();

 public:
  // Whether a thread of this rank tests the broadcasts ahead (else only MPI calls move them).
  bool progress_thread_running() const { return progress_.joinable(); }

 private:

  std::unique_ptr<Communicator> comm_;  // its own: gathers never interleave with other collectives
  ChunkStore& store_;
  // The store's own (every page present at its address), or the memory tiers' (pages fetched
  // from their homes under leases): a gather broadcasts into pages it holds leased.
  Residency* inner_;
  ChunkPartition owners_;
  Zero3Keep keep_;
  int own_first_ = 0, own_last_ = 0;  // the parameter home's chunks: the own ones, or (experts apart) their span
  // Experts apart (owners_.experts_apart()): whether this rank owns each chunk, and the data
  // ranks holding its experts (null when data = P).
  std::vector<uint8_t> own_;
  std::unique_ptr<Communicator> holders_;
  int last_layer_ = 0;
  bool started_ = false;  // settled() done
  bool whole_ = false;    // gather_whole() holds every chunk
  // Per chunk, the same on every rank: whether its pages are gathered (own chunks included, so
  // that owners join the broadcasts the others wait for), and the layer leases holding it.
  std::vector<uint8_t> gathered_;
  std::vector<int> pins_;
  // The layer leases' parameter chunks, in order: this pass's (of kind pass_) and the last
  // recorded pass's of each kind (by LeasePass).
  LeasePass pass_ = LeasePass::step;
  std::vector<std::vector<int>> this_round_, last_round_[2];
  // The broadcasts started ahead: shared with the progress thread (which tests them) under mutex_
  // until wait_ahead() takes them back.
  std::vector<Communicator::Request> ahead_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread progress_;  // not started without MPI_THREAD_MULTIPLE or with the key off
  std::vector<int> ahead_chunks_;
  int64_t ahead_bytes_ = 0;
  Bf16State* bits_ = nullptr;  // where gathers write under bf16 working parameters (else the float32 plane)
  int64_t shard_bytes_ = 0, gathered_bytes_ = 0;
  int64_t group_max_[3] = {};
  Peaks peaks_;
};

}  // namespace keel
