#include "ckpt/memory_checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ckpt/manifest.h"
#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"

namespace keel {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'M', 'E', 'M', '1'};
constexpr int64_t kTrailerBytes = 24;  // footer length, footer checksum, magic
constexpr int kFormat = 1;
// The buddies' transfers, on a communicator of their own: a size message, then pieces.
constexpr int kSizeTag = 31001, kPieceTag = 31002;
constexpr int64_t kPieceBytes = int64_t{64} << 20;

uint64_t checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

std::string step_digits(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%08lld", static_cast<long long>(step));
  return buf;
}

// "r1-step-00000015.bin" (own), "buddy-r1-step-00000015.bin" (held by rank 2 mod world); ".tmp"
// while being written.
std::string copy_name(int rank, int64_t step, bool buddy, bool temporary = false) {
  return std::string(buddy ? "buddy-" : "") + "r" + std::to_string(rank) + "-step-" + step_digits(step) +
         (temporary ? ".tmp" : ".bin");
}

bool parse_copy_name(const std::string& name, int* rank, int64_t* step, bool* buddy, bool* temporary) {
  std::string rest = name;
  *buddy = rest.rfind("buddy-", 0) == 0;
  if (*buddy) rest = rest.substr(6);
  const bool bin = rest.size() > 4 && rest.compare(rest.size() - 4, 4, ".bin") == 0;
  *temporary = rest.size() > 4 && rest.compare(rest.size() - 4, 4, ".tmp") == 0;
  if (!bin && !*temporary) return false;
  rest.resize(rest.size() - 4);
  int r = -1, used = 0;
  long long s = -1;
  if (std::sscanf(rest.c_str(), "r%d-step-%lld%n", &r, &s, &used) != 2 || used != static_cast<int>(rest.size())) {
    return false;
  }
  if (r < 0 || s < 0) return false;
  *rank = r;
  *step = s;
  return true;
}

// A regular file mapped read-only (a FIFO or device in its place is refused, not waited on).
// `whole`: every page is about to be read, so the page tables are filled in one call
// (MAP_POPULATE) rather than by one fault per 4 KiB page as the reads go: a 1.5 GB copy is
// 390,000 faults otherwise, much of a resume's time.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path, bool whole = false) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    check(fd >= 0, "memory copy " + path + ": cannot open (" + std::strerror(errno) + ")");
    struct stat st = {};
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    if (!regular) ::close(fd);
    check(regular, "memory copy " + path + ": not a regular file");
    size_ = static_cast<int64_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED | (whole ? MAP_POPULATE : 0), fd, 0);
      ::close(fd);
      check(p != MAP_FAILED, "memory copy " + path + ": cannot map (" + std::strerror(errno) + ")");
      data_ = static_cast<const char*>(p);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<char*>(data_), static_cast<size_t>(size_));
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  const char* data_ = nullptr;
  int64_t size_ = 0;
};

// The footer of a copy's bytes (trailer, magic and checksum checked); throws naming `what`.
std::string footer_of(const char* bytes, int64_t size, const std::string& what) {
  check(size >= kTrailerBytes && std::memcmp(bytes + size - 8, kMagic, 8) == 0,
        what + ": not a complete memory copy (no trailer)");
  uint64_t length = 0, sum = 0;
  std::memcpy(&length, bytes + size - kTrailerBytes, 8);
  std::memcpy(&sum, bytes + size - kTrailerBytes + 8, 8);
  check(length <= static_cast<uint64_t>(size - kTrailerBytes), what + ": footer length " + std::to_string(length) +
                                                                  " past the start of the file");
  const char* footer = bytes + size - kTrailerBytes - static_cast<int64_t>(length);
  check(checksum(footer, length) == sum, what + ": footer is corrupt (checksum " + hex64(checksum(footer, length)) +
                                             ", trailer says " + hex64(sum) + ")");
  return std::string(footer, length);
}

// Posts the sends of a copy's `bytes` (size first; -1: none) to `peer`; `size_slot` and the bytes
// must outlive the requests.
std::vector<Communicator::Request> post_stream(Communicator& c, const char* bytes, int64_t size, int peer,
                                               int64_t* size_slot) {
  std::vector<Communicator::Request> sends;
  *size_slot = size;
  sends.push_back(c.isend(reinterpret_cast<const float*>(size_slot), 2, peer, kSizeTag));
  for (int64_t at = 0; at < size; at += kPieceBytes) {
    const int64_t n = std::min(kPieceBytes, size - at);
    sends.push_back(c.isend(reinterpret_cast<const float*>(bytes + at), static_cast<size_t>(n / 4), peer, kPieceTag));
  }
  return sends;
}

int64_t receive_size(Communicator& c, int peer) {
  int64_t size = -1;
  Communicator::Request r = c.irecv(reinterpret_cast<float*>(&size), 2, peer, kSizeTag);
  c.wait(r);
  return size;
}

// Receives the pieces of a `size`-byte stream from `peer` into `buffer` (resized to one piece),
// handing each to `piece`.
void receive_pieces(Communicator& c, int peer, int64_t size, std::vector<char>& buffer,
                    const std::function<void(const char*, size_t)>& piece) {
  buffer.resize(static_cast<size_t>(std::min(kPieceBytes, std::max<int64_t>(size, 0))));
  for (int64_t at = 0; at < size; at += kPieceBytes) {
    const int64_t n = std::min(kPieceBytes, size - at);
    Communicator::Request r = c.irecv(reinterpret_cast<float*>(buffer.data()), static_cast<size_t>(n / 4), peer, kPieceTag);
    c.wait(r);
    piece(buffer.data(), static_cast<size_t>(n));
  }
}

// Copies `n` bytes and returns the XXH3 checksum of the copy, taken block by block while the block
// is still in cache: the source is read once (a verify pass before the copy would read 1.5 GB
// twice for GPT-2 124M). The destination's pages are faulted in with one call first (where the
// kernel cannot, the copy faults them page by page): a restarted process's planes are fresh memory,
// and one fault per 4 KiB page costs more than the copy.
uint64_t copy_and_checksum(char* to, const char* from, size_t n) {
  if (n == 0) return checksum(to, 0);
  populate_for_write(to, n);  // a hint: where it fails, the copy faults the pages in
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(), XXH3_freeState);
  check(state != nullptr && XXH3_64bits_reset(state.get()) == XXH_OK, "memory copy: cannot start a checksum");
  constexpr size_t kBlockBytes = size_t{256} << 10;
  for (size_t at = 0; at < n; at += kBlockBytes) {
    const size_t m = std::min(kBlockBytes, n - at);
    std::memcpy(to + at, from + at, m);
    XXH3_64bits_update(state.get(), to + at, m);
  }
  return XXH3_64bits_digest(state.get());
}

void remove_quietly(const std::string& path) {
  try {
    Env::get().remove(path);
  } catch (const Error&) {
  }
}

}  // namespace

std::string memory_checkpoint_dir(const std::string& run_dir) {
  std::error_code ec;
  const std::string canonical = fs::weakly_canonical(fs::path(run_dir), ec).string();
  const std::string run = ec ? run_dir : canonical;
  return "/dev/shm/keel-" + hex64(checksum(run.data(), run.size()));
}

std::string memory_layout_hash(const ChunkStore& store) {
  std::string s;
  for (const Chunk& c : store.chunks()) {
    s += std::to_string(c.offset) + ',' + std::to_string(c.numel) + ',' + std::to_string(c.layer) + ',' +
         (c.replica ? "r" : "") + (c.segments.empty() ? "" : store.tensors()[c.segments.front().tensor].spec.name) + ';';
  }
  const auto [first, last] = store.moment_chunks();
  s += "moments " + std::to_string(first) + ".." + std::to_string(last);
  return hex64(checksum(s.data(), s.size()));
}

MemoryCheckpoint::MemoryCheckpoint(const Config& config, Communicator& world)
    : world_(world), rank_(world.rank()), world_size_(world.size()) {
  exchange_ = world.duplicate();
  const char* job = std::getenv("KEEL_JOB_ID");
  // Without a launcher's job id, rank 0's clock names this job (every rank the same).
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const int64_t named = world.broadcast(now_ns);
  job_ = job != nullptr && *job != '\0' ? std::string(job) : "run-" + std::to_string(named);
  trajectory_ = hex64(config.trajectory_hash(world_size_));
  check(fs::is_directory("/dev/shm"), "checkpoint.memory_every: /dev/shm is not a directory (memory checkpoints "
                                      "need a tmpfs there); set checkpoint.memory_every = 0");
  dir_ = memory_checkpoint_dir(config.train.run_dir);
}

MemoryCheckpoint::~MemoryCheckpoint() = default;

std::vector<MemoryCheckpoint::Copy> MemoryCheckpoint::list_copies(std::vector<std::string>* temporary) const {
  std::vector<Copy> out;
  const int prev = (rank_ + world_size_ - 1) % world_size_;
  for (const std::string& name : Env::get().list_dir(dir_)) {
    Copy c;
    bool temp = false;
    if (!parse_copy_name(name, &c.rank, &c.step, &c.buddy, &temp)) continue;
    const bool mine = c.buddy ? world_size_ > 1 && c.rank == prev : c.rank == rank_;
    if (!mine) continue;
    c.path = dir_ + "/" + name;
    if (temp) {
      if (temporary != nullptr) temporary->push_back(c.path);
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string MemoryCheckpoint::read_footer(const std::string& path, int64_t* file_bytes) const {
  const MappedFile file(path);
  if (file_bytes != nullptr) *file_bytes = file.size();
  return footer_of(file.data(), file.size(), "memory copy " + path);
}

std::string MemoryCheckpoint::foreign(const std::string& footer_json, int rank) const {
  const json f = json::parse(footer_json, nullptr, false);
  if (f.is_discarded() || !f.is_object()) return "an unreadable footer";
  try {
    if (f.value("format", 0) != kFormat) return "another format";
    if (f.value("job", "") != job_) return "job " + f.value("job", std::string("?")) + ", this job " + job_;
    if (f.value("world", 0) != world_size_) return "another world size";
    if (f.value("rank", -1) != rank) return "another rank";
    if (f.value("trajectory", "") != trajectory_) return "another trajectory (model, optimizer, seed or tokens per step)";
  } catch (const json::exception&) {
    return "a footer with fields of the wrong types";
  }
  return "";
}

void MemoryCheckpoint::report_failure(const std::string& what) {
  if (failures_++ > 0) return;  // a full /dev/shm fails every step: said once
  std::fprintf(stderr, "keel: [rank %d] %s (training goes on; further failures of memory copies are not reported)\n",
               rank_, what.c_str());
}

void MemoryCheckpoint::drop_before(int64_t step) {
  for (const Copy& c : list_copies(nullptr)) {
    if (c.step < step) Env::get().remove(c.path);
  }
}

double MemoryCheckpoint::save(int64_t step, const ChunkStore& store, const RankState& state,
                              const std::vector<float>& residual, const std::vector<float>& carried) {
  const auto t0 = std::chrono::steady_clock::now();
  Env& env = Env::get();
  const std::string own = dir_ + "/" + copy_name(rank_, step, false);
  const std::string own_tmp = dir_ + "/" + copy_name(rank_, step, false, true);
  int64_t own_bytes = -1;
  bool kept = false, buddy_kept = false;  // this step's own copy, and the buddy copy this rank holds
  try {
    env.create_dirs(dir_);
    std::unique_ptr<WritableFile> out = env.create(own_tmp);
    json sections = json::array();
    uint64_t at = 0;
    auto section = [&](int chunk, const char* plane, const float* data, size_t numel) {
      const size_t bytes = numel * sizeof(float);
      out->append(data, bytes);
      sections.push_back({{"chunk", chunk}, {"plane", plane}, {"at", at}, {"bytes", bytes},
                          {"sum", hex64(checksum(data, bytes))}});
      at += bytes;
    };
    const auto [mfirst, mlast] = store.moment_chunks();
    json versions = json::array();
    for (const Chunk& c : store.chunks()) {
      versions.push_back(c.version);
      const bool moments = c.id >= mfirst && c.id < mlast;
      const PageLease use = moments ? store.use_chunk(c.id, {Plane::param, Plane::adam_m, Plane::adam_v})
                                    : store.use_chunk(c.id, {Plane::param});
      for (Plane p : kSavedPlanes) {
        if (p != Plane::param && !moments) continue;
        const std::span<const float> view = store.chunk_view(c.id, p);
        section(c.id, saved_plane_key(p), view.data(), view.size());
      }
    }
    json footer = {{"format", kFormat},
                   {"job", job_},
                   {"rank", rank_},
                   {"world", world_size_},
                   {"step", step},
                   {"trajectory", trajectory_},
                   {"layout", memory_layout_hash(store)},
                   {"data", {{"epoch", state.data.epoch}, {"index", state.data.index}, {"offset", state.data.offset}}},
                   {"versions", std::move(versions)}};
    if (state.has_residual) {
      section(-1, "residual", residual.data(), residual.size());
      footer["residual_layout"] = state.residual_layout;
      footer["residual_keys"] = state.residual_keys;
    }
    if (state.has_carried) {
      section(-1, "carried", carried.data(), carried.size());
      footer["carried_layout"] = state.carried_layout;
    }
    footer["sections"] = std::move(sections);
    std::string text = footer.dump();
    text.append((4 - text.size() % 4) % 4, ' ');  // the whole file in floats (the buddies' transfer)
    const uint64_t length = text.size(), sum = checksum(text.data(), text.size());
    char trailer[kTrailerBytes];
    std::memcpy(trailer, &length, 8);
    std::memcpy(trailer + 8, &sum, 8);
    std::memcpy(trailer + 16, kMagic, 8);
    out->append(text.data(), text.size());
    out->append(trailer, sizeof trailer);
    out->close();
    env.rename(own_tmp, own);
    own_bytes = static_cast<int64_t>(at + length) + kTrailerBytes;
    kept = true;
  } catch (const std::exception& e) {
    remove_quietly(own_tmp);
    report_failure("memory copy of step " + std::to_string(step) + " not kept: " + e.what());
  }
  if (world_size_ > 1) {
    // The buddy copy: this rank's bytes to rank + 1, rank - 1's to this rank.
    const int next = (rank_ + 1) % world_size_, prev = (rank_ + world_size_ - 1) % world_size_;
    std::unique_ptr<MappedFile> mine;
    if (own_bytes > 0) {
      try {
        mine = std::make_unique<MappedFile>(own, /*whole=*/true);
      } catch (const Error& e) {
        report_failure("memory copy of step " + std::to_string(step) + " not sent to rank " + std::to_string(next) +
                       ": " + e.what());
      }
    }
    int64_t size_slot = 0;
    std::vector<Communicator::Request> sends =
        post_stream(*exchange_, mine ? mine->data() : nullptr, mine ? mine->size() : -1, next, &size_slot);
    const int64_t incoming = receive_size(*exchange_, prev);
    if (incoming > 0) {
      const std::string held = dir_ + "/" + copy_name(prev, step, true);
      const std::string held_tmp = dir_ + "/" + copy_name(prev, step, true, true);
      std::unique_ptr<WritableFile> out;
      std::string failure;
      try {
        env.create_dirs(dir_);
        out = env.create(held_tmp);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      receive_pieces(*exchange_, prev, incoming, receive_buffer_, [&](const char* bytes, size_t n) {
        if (!failure.empty()) return;  // the rest of the stream is still received
        try {
          out->append(bytes, n);
        } catch (const std::exception& e) {
          failure = e.what();
        }
      });
      try {
        if (failure.empty()) {
          out->close();
          env.rename(held_tmp, held);
          buddy_kept = true;
        }
      } catch (const std::exception& e) {
        failure = e.what();
      }
      if (!failure.empty()) {
        remove_quietly(held_tmp);
        report_failure("buddy copy of rank " + std::to_string(prev) + "'s step " + std::to_string(step) +
                       " not kept: " + failure);
      }
    }
    for (Communicator::Request& r : sends) exchange_->wait(r);
    kept = kept && (incoming <= 0 || buddy_kept);
  }
  // Once every rank has kept this step (its own copy and the buddy copy it holds), the older
  // copies are not needed: one generation stays between saves, two while one is written.
  try {
    if (exchange_->allreduce_max(kept ? 0.0 : 1.0) == 0) drop_before(step);
  } catch (const Error& e) {
    report_failure(std::string("older memory copies not removed: ") + e.what());
  }
  return ms_since(t0);
}

json MemoryCheckpoint::checked_footer(const char* bytes, int64_t size, const std::string& what, const ChunkStore& store,
                                     GradSync& sync) const {
  try {
    const std::string text = footer_of(bytes, size, what);
    json f = json::parse(text, nullptr, false);
    check(!f.is_discarded() && f.is_object(), what + ": footer is not JSON");
    const std::string why = foreign(text, rank_);
    check(why.empty(), what + ": of " + why);
    check(f.value("layout", "") == memory_layout_hash(store),
          what + ": saved under another layout of the store's chunks (layout " + f.value("layout", std::string("?")) +
              ", this run " + memory_layout_hash(store) + ")");
    check(f.contains("versions") && f["versions"].is_array() && f["versions"].size() == store.chunks().size(),
          what + ": versions of another number of chunks");
    check(f.contains("sections") && f["sections"].is_array(), what + ": no sections");
    const int64_t data_end = size - kTrailerBytes - static_cast<int64_t>(text.size());
    const bool wants_residual = sync.residual_size() > 0;
    check(!wants_residual || f.value("residual_layout", "") == sync.residual_layout(),
          what + ": compression residuals of another layout (" + f.value("residual_layout", std::string("none")) +
              ", this run " + sync.residual_layout() + ")");
    const auto [mfirst, mlast] = store.moment_chunks();
    const bool has_carried = f.contains("carried_layout");  // (its size is the step engine's to check)
    const size_t expected = store.chunks().size() + 2 * static_cast<size_t>(mlast - mfirst) + (wants_residual ? 1 : 0) +
                            (has_carried ? 1 : 0);
    check(f["sections"].size() == expected, what + ": " + std::to_string(f["sections"].size()) +
                                                " sections, expected " + std::to_string(expected));
    for (const json& s : f["sections"]) {
      const int64_t at = s.value("at", int64_t{-1}), n = s.value("bytes", int64_t{-1});
      const int chunk = s.value("chunk", -2);
      const std::string plane = s.value("plane", "");
      check(at >= 0 && n >= 0 && at + n <= data_end, what + ": section of chunk " + std::to_string(chunk) + " " +
                                                         plane + " lies outside the file");
      const bool saved_plane = std::any_of(std::begin(kSavedPlanes), std::end(kSavedPlanes),
                                           [&](Plane p) { return plane == saved_plane_key(p); });
      const int64_t want = plane == "residual" ? static_cast<int64_t>(sync.residual_size() * sizeof(float))
                           : plane == "carried" && has_carried ? n - n % static_cast<int64_t>(sizeof(float))
                           : saved_plane && chunk >= 0 && chunk < static_cast<int>(store.chunks().size())
                               ? store.chunks()[static_cast<size_t>(chunk)].numel * static_cast<int64_t>(sizeof(float))
                               : -1;
      check(n == want, what + ": section of chunk " + std::to_string(chunk) + " " + plane + " has " +
                           std::to_string(n) + " bytes, expected " + std::to_string(want));
      check(s.contains("sum") && s["sum"].is_string(), what + ": section of chunk " + std::to_string(chunk) + " " +
                                                           plane + " has no checksum");
    }
    for (const json& v : f["versions"]) check(v.is_number_unsigned(), what + ": a chunk version that is not a count");
    for (const char* key : {"epoch", "index", "offset"}) {
      check(f.contains("data") && f["data"].contains(key) && f["data"][key].is_number_unsigned(),
            what + ": footer field data." + key + " missing or not a count");
    }
    check(f.contains("step") && f["step"].is_number_integer(), what + ": footer field step missing or not a number");
    return f;
  } catch (const json::exception& e) {
    throw Error(what + ": footer field of the wrong type (" + e.what() + ")");
  }
}

void MemoryCheckpoint::restore(const char* bytes, int64_t size, const std::string& what, ChunkStore& store,
                               GradSync& sync, Restored* out, bool* written) const {
  const json f = checked_footer(bytes, size, what, store, sync);
  out->residual.clear();
  out->carried.clear();
  for (const json& s : f["sections"]) {
    const int chunk = s["chunk"].get<int>();
    const std::string plane = s["plane"].get<std::string>();
    const char* from = bytes + s["at"].get<int64_t>();
    const size_t n = s["bytes"].get<size_t>();
    std::string sum;
    if (plane == "residual" || plane == "carried") {
      std::vector<float>& into = plane == "residual" ? out->residual : out->carried;
      into.resize(n / sizeof(float));
      sum = hex64(copy_and_checksum(reinterpret_cast<char*>(into.data()), from, n));
    } else {
      Plane p = Plane::param;
      for (Plane q : kSavedPlanes) {
        if (plane == saved_plane_key(q)) p = q;
      }
      const PageLease use = store.use_chunk(chunk, {}, {p});
      const std::span<float> to = store.chunk_view(chunk, p);
      *written = true;
      sum = hex64(copy_and_checksum(reinterpret_cast<char*>(to.data()), from, n));
    }
    check(sum == s["sum"].get<std::string>(), what + ": chunk " + std::to_string(chunk) + " " + plane +
                                                  " is corrupt (checksum " + sum + ", footer says " +
                                                  s["sum"].get<std::string>() + ")");
  }
  out->versions = f["versions"].get<std::vector<uint64_t>>();
  RankState mine;
  mine.rank = rank_;
  mine.data.epoch = f["data"]["epoch"].get<uint64_t>();
  mine.data.index = f["data"]["index"].get<uint64_t>();
  mine.data.offset = f["data"]["offset"].get<uint64_t>();
  mine.has_residual = !out->residual.empty();
  mine.residual_layout = f.value("residual_layout", "");
  mine.residual_keys = f.value("residual_keys", "");
  mine.has_carried = f.contains("carried_layout");
  mine.carried_layout = f.value("carried_layout", "");
  out->state.step = f["step"].get<int64_t>();
  out->state.data = mine.data;
  out->state.ranks = {mine};
}

std::optional<MemoryResume> MemoryCheckpoint::resume(ChunkStore& store, GradSync& sync, int64_t disk_step,
                                                     bool eligible, std::string* why_not) {
  const auto t0 = std::chrono::steady_clock::now();
  // Temporary files are writes a kill interrupted: never a copy.
  std::vector<std::string> temporary;
  std::vector<Copy> copies = list_copies(&temporary);
  for (const std::string& path : temporary) remove_quietly(path);
  // Copies of another job, trajectory or world size (or, when this start does not resume, any)
  // are removed; the rest are candidates.
  std::vector<Copy> usable;
  double stale = 0;
  std::string stale_why;
  for (const Copy& c : copies) {
    std::string why;
    try {
      why = foreign(read_footer(c.path, nullptr), c.rank);
    } catch (const Error& e) {
      why = e.what();
    }
    if (why.empty() && eligible) {
      usable.push_back(c);
      continue;
    }
    if (!why.empty()) {
      stale++;
      if (stale_why.empty()) stale_why = why;
    }
    remove_quietly(c.path);
  }
  stale = world_.allreduce_sum(stale);
  if (stale > 0 && world_.is_root()) {
    std::fprintf(stderr, "keel: ignored %.0f memory copies in %s that are not this run's (%s): removed\n", stale,
                 dir_.c_str(), stale_why.empty() ? "found by another rank" : stale_why.c_str());
  }
  if (!eligible) return std::nullopt;

  // The steps for which every rank has a copy, own or held by its buddy, newer than the disk's.
  std::string mine;
  for (const Copy& c : usable) mine += (c.buddy ? "b" : "o") + std::to_string(c.step) + " ";
  const std::vector<std::string> all = world_.gather_strings(mine);
  std::vector<int64_t> candidates;
  if (world_.is_root()) {
    std::vector<std::set<int64_t>> own(world_size_), held(world_size_);  // held[r]: buddy copies of r
    for (int r = 0; r < world_size_; ++r) {
      std::istringstream in(all[static_cast<size_t>(r)]);
      for (std::string word; in >> word;) {
        const int64_t s = std::atoll(word.c_str() + 1);
        if (word[0] == 'o') own[r].insert(s);
        else held[(r + world_size_ - 1) % world_size_].insert(s);
      }
    }
    std::set<int64_t> steps;
    for (int r = 0; r < world_size_; ++r) {
      steps.insert(own[r].begin(), own[r].end());
      steps.insert(held[r].begin(), held[r].end());
    }
    for (auto it = steps.rbegin(); it != steps.rend() && *it > disk_step; ++it) {
      bool complete = true;
      for (int r = 0; r < world_size_ && complete; ++r) complete = own[r].count(*it) > 0 || held[r].count(*it) > 0;
      if (complete) candidates.push_back(*it);
    }
  }
  candidates.resize(static_cast<size_t>(world_.broadcast(static_cast<int64_t>(candidates.size()))));
  for (int64_t& s : candidates) s = world_.broadcast(s);

  const int next = (rank_ + 1) % world_size_, prev = (rank_ + world_size_ - 1) % world_size_;
  bool written = false;  // whether a restore wrote into the store's planes (then cleared if none succeeds)
  for (const int64_t step : candidates) {
    auto find = [&](bool buddy) -> std::string {
      for (const Copy& c : usable) {
        if (c.step == step && c.buddy == buddy) return c.path;
      }
      return "";
    };
    Restored restored;
    // This rank's own copy, restored into the store and verified in one pass.
    bool own = false;
    std::string own_error = "none";
    const std::string own_path = find(false);
    if (!own_path.empty()) {
      try {
        const MappedFile file(own_path, /*whole=*/true);
        restore(file.data(), file.size(), "memory copy " + own_path, store, sync, &restored, &written);
        own = true;
        own_error.clear();
      } catch (const Error& e) {
        own_error = e.what();
      }
    }
    // Ranks without one get theirs from their buddy.
    std::vector<double> need(static_cast<size_t>(world_size_), 0.0);
    need[static_cast<size_t>(rank_)] = own ? 0.0 : 1.0;
    world_.allreduce_max(need.data(), need.size());
    std::unique_ptr<MappedFile> held_file;
    std::vector<Communicator::Request> sends;
    int64_t size_slot = 0;
    if (world_size_ > 1 && need[static_cast<size_t>(prev)] > 0) {
      const std::string held_path = find(true);
      try {
        if (!held_path.empty()) held_file = std::make_unique<MappedFile>(held_path, /*whole=*/true);
      } catch (const Error&) {
        held_file.reset();  // the receiver says why it has no copy
      }
      sends = post_stream(*exchange_, held_file ? held_file->data() : nullptr, held_file ? held_file->size() : -1,
                          prev, &size_slot);
    }
    std::string buddy_error;
    if (!own) {
      buddy_error = world_size_ > 1 ? "none" : "no buddy in a world of one";
      const int64_t size = world_size_ > 1 ? receive_size(*exchange_, next) : -1;
      if (size > 0) {
        std::vector<char> received;
        received.reserve(static_cast<size_t>(size));
        receive_pieces(*exchange_, next, size, receive_buffer_,
                       [&](const char* bytes, size_t n) { received.insert(received.end(), bytes, bytes + n); });
        try {
          restore(received.data(), size, "buddy copy of rank " + std::to_string(rank_) + " (held by rank " +
                                              std::to_string(next) + ")", store, sync, &restored, &written);
          buddy_error.clear();
        } catch (const Error& e) {
          buddy_error = e.what();
        }
      }
    }
    for (Communicator::Request& r : sends) exchange_->wait(r);
    receive_buffer_.clear();
    receive_buffer_.shrink_to_fit();
    const bool have = own || buddy_error.empty();
    if (world_.allreduce_max(have ? 0.0 : 1.0) > 0) {
      if (!have) {
        std::fprintf(stderr, "keel: [rank %d] memory copy of step %lld unusable: own copy: %s; buddy copy: %s\n", rank_,
                     static_cast<long long>(step), own_error.c_str(), buddy_error.c_str());
      }
      continue;
    }
    // Every rank holds its planes of this step: now its versions and residuals.
    for (size_t c = 0; c < restored.versions.size(); ++c) store.set_version(static_cast<int>(c), restored.versions[c]);
    if (!restored.residual.empty()) sync.restore_residuals(restored.residual);
    MemoryResume out;
    out.where = dir_;
    out.state = std::move(restored.state);
    out.carried = std::move(restored.carried);
    out.state.dir = "memory (step " + std::to_string(step) + ")";
    double counts[2] = {own ? 1.0 : 0.0, own ? 0.0 : 1.0};
    world_.allreduce_sum(counts, 2);
    out.from_own = static_cast<int>(counts[0]);
    out.from_buddy = static_cast<int>(counts[1]);
    // Copies of other steps (older, or an abandoned attempt's) are not needed again.
    for (const Copy& c : usable) {
      if (c.step != step) remove_quietly(c.path);
    }
    out.load_s = world_.allreduce_max(ms_since(t0) / 1e3);
    return out;
  }
  if (why_not != nullptr) {
    *why_not = candidates.empty()
                   ? "no step newer than the newest disk checkpoint has a memory copy of every rank"
                   : "no memory copy newer than the newest disk checkpoint is complete on every rank";
  }
  // A restore that was not used on every rank leaves no trace: the disk or a fresh start follows.
  if (written) clear_loaded_state(store);
  for (const Copy& c : usable) remove_quietly(c.path);
  return std::nullopt;
}

void MemoryCheckpoint::remove_all() {
  std::vector<std::string> temporary;
  for (const Copy& c : list_copies(&temporary)) remove_quietly(c.path);
  for (const std::string& path : temporary) remove_quietly(path);
  std::error_code ec;
  fs::remove(dir_, ec);  // only once empty: the last rank on this host removes it
}

}  // namespace keel
