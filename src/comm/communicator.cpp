#include "comm/communicator.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/bf16.h"

namespace keel {

namespace {

void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(std::string("MPI ") + what + " failed: " + std::string(text, len));
}

// MPI counts are int: large buffers go in pieces of at most 1 GiB.
constexpr size_t kMaxCount = size_t{1} << 28;

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

Communicator& Communicator::world() {
  static Communicator instance;
  return instance;
}

Communicator::Communicator() {
  if (!launched_by_mpi()) return;
  // MULTIPLE where a job asked for it and the library gives it (ZeRO-3's progress thread tests its
  // broadcasts while the main thread computes and communicates); else every call comes from the
  // main thread.
  int provided = 0;
  mpi_check(MPI_Init_thread(nullptr, nullptr, threads_requested_ ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED, &provided),
            "init");
  // Errors come back as codes (turned into keel::Error) instead of aborting the job silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  uses_mpi_ = true;
  comm_ = MPI_COMM_WORLD;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

bool Communicator::threads_may_call() {
  int provided = 0;
  return world().uses_mpi() && MPI_Query_thread(&provided) == MPI_SUCCESS && provided == MPI_THREAD_MULTIPLE;
}

Communicator::Communicator(MPI_Comm comm, int rank, int size)
    : uses_mpi_(true), owned_(true), comm_(comm), rank_(rank), size_(size) {}

std::unique_ptr<Communicator> Communicator::duplicate() {
  if (!uses_mpi_) return std::unique_ptr<Communicator>(new Communicator(*this));
  MPI_Comm dup = MPI_COMM_NULL;
  mpi_check(MPI_Comm_dup(comm_, &dup), "comm_dup");
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return std::unique_ptr<Communicator>(new Communicator(dup, rank_, size_));
}

Communicator::~Communicator() {
  if (owned_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    return;
  }
  if (uses_mpi_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
}

void Communicator::allreduce_sum(float* data, size_t count) {
  if (!uses_mpi_) return;
  for (size_t off = 0; off < count; off += kMaxCount) {
    const int n = static_cast<int>(std::min(kMaxCount, count - off));
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, data + off, n, MPI_FLOAT, MPI_SUM, comm_), "allreduce");
  }
}

void Communicator::allreduce_sum(double* data, size_t count) {
  if (!uses_mpi_) return;
  for (size_t off = 0; off < count; off += kMaxCount) {
    const int n = static_cast<int>(std::min(kMaxCount, count - off));
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, data + off, n, MPI_DOUBLE, MPI_SUM, comm_), "allreduce");
  }
}

double Communicator::allreduce_sum(double value) {
  allreduce_sum(&value, 1);
  return value;
}

double Communicator::allreduce_max(double value) {
  allreduce_max(&value, 1);
  return value;
}

void Communicator::allreduce_max(double* data, size_t count) {
  if (!uses_mpi_) return;
  check(count <= kMaxCount, "allreduce_max: too many values for one MPI call");
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_DOUBLE, MPI_MAX, comm_),
            "allreduce");
}

Communicator::Request Communicator::iallreduce_sum(float* data, size_t count) {
  Request r;
  if (!uses_mpi_ || count == 0) return r;
  check(count <= std::numeric_limits<int>::max(), "gradient bucket too large for one MPI call");
  r.done = false;
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, comm_, &r.handle),
            "iallreduce");
  return r;
}

Communicator::Request Communicator::iallreduce_sum(double* data, size_t count) {
  Request r;
  if (!uses_mpi_ || count == 0) return r;
  r.done = false;
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_DOUBLE, MPI_SUM, comm_, &r.handle),
            "iallreduce");
  return r;
}

Communicator::Request Communicator::ireduce_scatter_sum(float* data, const std::vector<int>& counts) {
  Request r;
  if (!uses_mpi_) return r;
  r.done = false;
  mpi_check(MPI_Ireduce_scatter(MPI_IN_PLACE, data, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &r.handle),
            "ireduce_scatter");
  return r;
}

namespace {

// MPI's reduction of bf16 bits: a + b in float32, rounded to bf16. Commutative (float addition
// is), so MPI may order the operands as it likes and every rank still gets the same bits.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}

MPI_Op bf16_sum_op() {
  static MPI_Op op = [] {
    MPI_Op made;
    mpi_check(MPI_Op_create(&bf16_sum, /*commute=*/1, &made), "MPI_Op_create (bf16 sum)");
    return made;
  }();
  return op;
}

}  // namespace

Communicator::Request Communicator::iallreduce_sum_bf16(uint16_t* data, size_t count) {
  Request r;
  if (!uses_mpi_ || count == 0) return r;
  check(count <= std::numeric_limits<int>::max(), "gradient bucket too large for one MPI call");
  r.done = false;
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_UINT16_T, bf16_sum_op(), comm_, &r.handle),
            "iallreduce (bf16)");
  return r;
}

Communicator::Request Communicator::ireduce_scatter_sum_bf16(uint16_t* data, const std::vector<int>& counts) {
  Request r;
  if (!uses_mpi_) return r;
  r.done = false;
  mpi_check(MPI_Ireduce_scatter(MPI_IN_PLACE, data, counts.data(), MPI_UINT16_T, bf16_sum_op(), comm_, &r.handle),
            "ireduce_scatter (bf16)");
  return r;
}

void Communicator::allgatherv(float* data, const std::vector<int>& counts, const std::vector<int>& displs) {
  if (!uses_mpi_) return;
  mpi_check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(), displs.data(), MPI_FLOAT,
                           comm_),
            "allgatherv");
}

void Communicator::broadcast(float* data, size_t count, int root) {
  if (!uses_mpi_) return;
  mpi_check(MPI_Bcast(data, static_cast<int>(count), MPI_FLOAT, root, comm_), "broadcast");
}

void Communicator::broadcast(uint16_t* data, size_t count, int root) {
  if (!uses_mpi_) return;
  check(count <= std::numeric_limits<int>::max(), "broadcast too large for one MPI call");
  mpi_check(MPI_Bcast(data, static_cast<int>(count), MPI_UINT16_T, root, comm_), "broadcast");
}

Communicator::Request Communicator::ibroadcast(float* data, size_t count, int root) {
  Request r;
  if (!uses_mpi_ || count == 0) return r;
  check(count <= std::numeric_limits<int>::max(), "broadcast too large for one MPI call");
  r.done = false;
  mpi_check(MPI_Ibcast(data, static_cast<int>(count), MPI_FLOAT, root, comm_, &r.handle), "ibroadcast");
  return r;
}

void Communicator::gatherv_to_root(const float* send, float* root_buffer, const std::vector<int>& counts,
                                   const std::vector<int>& displs) {
  if (!uses_mpi_) return;
  if (is_root()) {
    mpi_check(MPI_Gatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, root_buffer, counts.data(), displs.data(), MPI_FLOAT, 0,
                          comm_),
              "gatherv");
  } else {
    mpi_check(MPI_Gatherv(send, counts[rank_], MPI_FLOAT, nullptr, nullptr, nullptr, MPI_FLOAT, 0, comm_),
              "gatherv");
  }
}

std::vector<std::string> Communicator::gather_strings(const std::string& mine) {
  if (!uses_mpi_) return {mine};
  check(mine.size() <= static_cast<size_t>(std::numeric_limits<int>::max()), "gather_strings: string too long");
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(is_root() ? size_ : 0);
  mpi_check(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, comm_), "gather");
  std::vector<int> displs(lengths.size());
  int64_t total = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    displs[r] = static_cast<int>(total);
    total += lengths[r];
  }
  check(total <= std::numeric_limits<int>::max(), "gather_strings: strings too long together");
  std::vector<char> all(static_cast<size_t>(total));
  mpi_check(MPI_Gatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), displs.data(), MPI_CHAR, 0,
                        comm_),
            "gatherv");
  std::vector<std::string> out;
  for (size_t r = 0; r < lengths.size(); ++r) out.emplace_back(all.data() + displs[r], static_cast<size_t>(lengths[r]));
  return out;
}

int64_t Communicator::broadcast(int64_t value) {
  if (!uses_mpi_) return value;
  mpi_check(MPI_Bcast(&value, 1, MPI_INT64_T, 0, comm_), "bcast");
  return value;
}

Communicator::Request Communicator::ialltoallv(const uint8_t* send, const std::vector<int>& send_counts,
                                               const std::vector<int>& send_displs, uint8_t* recv,
                                               const std::vector<int>& recv_counts,
                                               const std::vector<int>& recv_displs) {
  Request r;
  if (!uses_mpi_) {  // a world of one sends to itself
    std::memcpy(recv + recv_displs[0], send + send_displs[0], static_cast<size_t>(send_counts[0]));
    return r;
  }
  r.done = false;
  mpi_check(MPI_Ialltoallv(send, send_counts.data(), send_displs.data(), MPI_BYTE, recv, recv_counts.data(),
                           recv_displs.data(), MPI_BYTE, comm_, &r.handle),
            "ialltoallv");
  return r;
}

Communicator::Request Communicator::iallgatherv(const uint8_t* send, uint8_t* recv, const std::vector<int>& counts,
                                                const std::vector<int>& displs) {
  Request r;
  if (!uses_mpi_) {
    std::memcpy(recv + displs[0], send, static_cast<size_t>(counts[0]));
    return r;
  }
  r.done = false;
  mpi_check(MPI_Iallgatherv(send, counts[rank_], MPI_BYTE, recv, counts.data(), displs.data(), MPI_BYTE,
                            comm_, &r.handle),
            "iallgatherv");
  return r;
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  if (!uses_mpi_) return std::unique_ptr<Communicator>(new Communicator(*this));
  MPI_Comm part = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split(comm_, color, key, &part), "comm_split");
  MPI_Comm_set_errhandler(part, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(part, &rank);
  MPI_Comm_size(part, &size);
  return std::unique_ptr<Communicator>(new Communicator(part, rank, size));
}

int Communicator::local_size() {
  if (!uses_mpi_) return 1;
  MPI_Comm local = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local), "comm_split_type");
  int size = 1;
  MPI_Comm_size(local, &size);
  MPI_Comm_free(&local);
  return size;
}

Communicator::Request Communicator::isend(const float* data, size_t count, int peer, int tag) {
  Request r;
  r.done = false;
  mpi_check(MPI_Isend(data, static_cast<int>(count), MPI_FLOAT, peer, tag, comm_, &r.handle), "isend");
  return r;
}

Communicator::Request Communicator::irecv(float* data, size_t count, int peer, int tag) {
  Request r;
  r.done = false;
  mpi_check(MPI_Irecv(data, static_cast<int>(count), MPI_FLOAT, peer, tag, comm_, &r.handle), "irecv");
  return r;
}

bool Communicator::test(Request& r) {
  if (r.done) return true;
  int flag = 0;
  mpi_check(MPI_Test(&r.handle, &flag, MPI_STATUS_IGNORE), "test");
  r.done = flag != 0;
  return r.done;
}

void Communicator::wait(Request& r) {
  if (r.done) return;
  mpi_check(MPI_Wait(&r.handle, MPI_STATUS_IGNORE), "wait");
  r.done = true;
}

void Communicator::barrier() {
  if (uses_mpi_) mpi_check(MPI_Barrier(comm_), "barrier");
}

}  // namespace keel
