// The data-parallel communicator: every byte between ranks goes through MPI (OpenMPI). A process
// started by mpirun or srun joins MPI_COMM_WORLD; a process started on its own is a world of one
// and makes no MPI calls at all, so the single-process trainer needs no launcher.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace keel {

class Communicator {
 public:
  // The process-wide communicator. The first call initialises MPI when the process was started
  // by an MPI launcher (mpirun, srun); MPI is finalised at exit.
  static Communicator& world();

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool is_root() const { return rank_ == 0; }
  bool uses_mpi() const { return uses_mpi_; }
  // Whether MPI lets any thread call it at any time (MPI_THREAD_MULTIPLE was granted): a second
  // thread may then test requests while the main thread makes other calls.
  static bool threads_may_call();
  // Asks, before world()'s first call, for MPI_THREAD_MULTIPLE instead of MPI_THREAD_FUNNELED
  // (only a job with a thread that calls MPI pays for the library's locking).
  static void request_threads() { threads_requested_ = true; }

  // A communicator over the same ranks whose collectives are independent of this one's (MPI_Comm_dup;
  // a world of one without MPI stays one). MPI orders the non-blocking collectives of one
  // communicator by the order ranks start them: operations whose steps start at moments that
  // differ between ranks (the phases of a compressed all-reduce) need a communicator each.
  // Collective: every rank calls it, in the same order.
  std::unique_ptr<Communicator> duplicate();
  // The ranks of this communicator that pass the same `color`, ranked by `key` (MPI_Comm_split):
  // a job's data-parallel group of one pipeline stage, or its pipeline of one replica. Collective.
  // A world of one without MPI returns a world of one.
  std::unique_ptr<Communicator> split(int color, int key);
  // The number of this communicator's ranks on this rank's host (sharing its memory). Collective.
  int local_size();
  ~Communicator();

  // In-place sum over all ranks. Deterministic for a given world size and layout.
  void allreduce_sum(float* data, size_t count);
  void allreduce_sum(double* data, size_t count);
  double allreduce_sum(double value);
  double allreduce_max(double value);
  void allreduce_max(double* data, size_t count);
  double allreduce_min(double value) { return -allreduce_max(-value); }

  // A non-blocking in-place sum. Progress happens only inside test()/wait() calls (and other MPI
  // calls), so the caller tests regularly while computing.
  struct Request {
    MPI_Request handle = MPI_REQUEST_NULL;
    bool done = true;
  };
  Request iallreduce_sum(float* data, size_t count);
  Request iallreduce_sum(double* data, size_t count);
  // A non-blocking in-place reduce-scatter of data[0 .. sum(counts)): rank r receives the sum of
  // its counts[r] elements, placed at data[0 .. counts[r]) (MPI's in-place convention).
  Request ireduce_scatter_sum(float* data, const std::vector<int>& counts);
  // The same two on bf16 values (their bits; bf16 gradients, store/bf16_state.h): each addition
  // in float32, its result rounded to bf16 (nearest even). Deterministic for a given world size
  // and layout, like the float32 sums; half the bytes on the wire.
  Request iallreduce_sum_bf16(uint16_t* data, size_t count);
  Request ireduce_scatter_sum_bf16(uint16_t* data, const std::vector<int>& counts);
  // Non-blocking exchanges of bytes (compressed gradients): rank r sends send[send_displs[j] ..
  // + send_counts[j]) to rank j and receives rank j's into recv[recv_displs[j] ..).
  Request ialltoallv(const uint8_t* send, const std::vector<int>& send_counts, const std::vector<int>& send_displs,
                     uint8_t* recv, const std::vector<int>& recv_counts, const std::vector<int>& recv_displs);
  // Every rank's send[0 .. counts[rank]) lands at recv[displs[r] ..) on every rank.
  Request iallgatherv(const uint8_t* send, uint8_t* recv, const std::vector<int>& counts, const std::vector<int>& displs);
  // Point to point (pipeline activations and their gradients): `count` floats to or from rank
  // `peer` with `tag`; the buffer belongs to MPI until the request completes.
  Request isend(const float* data, size_t count, int peer, int tag);
  Request irecv(float* data, size_t count, int peer, int tag);
  bool test(Request& request);  // true once complete
  void wait(Request& request);

  // In-place all-gather: rank r contributes data[displs[r] .. + counts[r]); afterwards every rank
  // holds every contribution.
  void allgatherv(float* data, const std::vector<int>& counts, const std::vector<int>& displs);
  // `count` floats from rank `root` to every rank, in place.
  void broadcast(float* data, size_t count, int root);
  // `count` bf16 values (their bits) from rank `root` to every rank, in place.
  void broadcast(uint16_t* data, size_t count, int root);
  // A non-blocking broadcast of `count` floats from `root` (ZeRO-3's gather of a chunk).
  Request ibroadcast(float* data, size_t count, int root);
  // Gathers to rank 0: rank r's `send` (counts[r] floats) lands at root_buffer[displs[r]] on rank 0
  // (root_buffer is used on rank 0 only; rank 0's own part must already be in place there).
  void gatherv_to_root(const float* send, float* root_buffer, const std::vector<int>& counts,
                       const std::vector<int>& displs);

  // Every rank's string, in rank order, on rank 0 (an empty vector elsewhere).
  std::vector<std::string> gather_strings(const std::string& mine);
  // Rank 0's value on every rank.
  int64_t broadcast(int64_t value);

  void barrier();

 private:
  static inline bool threads_requested_ = false;
  Communicator();
  Communicator(MPI_Comm comm, int rank, int size);
  Communicator(const Communicator&) = default;
  bool uses_mpi_ = false;
  bool owned_ = false;  // a duplicate: freed on destruction
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

// True when this process was started by an MPI launcher (mpirun/mpiexec, srun with PMI/PMIx).
bool launched_by_mpi();

}  // namespace keel
