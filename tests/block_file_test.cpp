// The NVMe tier's block file: O_DIRECT I/O through io_uring and through the thread pool, the same
// bytes either way, and clear refusals (unaligned requests, an existing or uncreatable path, a
// disk without room), with nothing left behind.
#include "store/block_file.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::error_of;

namespace fs = std::filesystem;
constexpr size_t kA = BlockFile::kAlign;

class BlockFileEngines : public ::testing::TestWithParam<IoEngine> {};

// Many requests in flight at once, waited for out of order, give back exactly what was written.
TEST_P(BlockFileEngines, WritesThenReadsTheSameBytes) {
  testing::TempDir dir;
  const std::string path = dir / "tier.bin";
  const size_t blocks = 64, block = 4 * kA;
  auto f = BlockFile::create(path, blocks * block, GetParam());
  if (GetParam() != IoEngine::automatic) {
    EXPECT_EQ(f->engine(), GetParam());
  }
  EXPECT_EQ(f->size(), blocks * block);
  EXPECT_EQ(fs::file_size(path), blocks * block);
  std::vector<AlignedBuffer> out, in;
  std::vector<uint64_t> tickets;
  for (size_t b = 0; b < blocks; ++b) {
    out.emplace_back(block);
    auto* p = static_cast<uint32_t*>(out.back().data);
    for (size_t i = 0; i < block / 4; ++i) p[i] = static_cast<uint32_t>(b * 1000003u + i * 7u);
    tickets.push_back(f->write(out.back().data, block, b * block));
  }
  for (size_t b = blocks; b-- > 0;) f->wait(tickets[b]);  // the reverse order of submission
  tickets.clear();
  for (size_t b = 0; b < blocks; ++b) {
    in.emplace_back(block);
    std::memset(in.back().data, 0xAB, block);
    tickets.push_back(f->read(in.back().data, block, b * block));
  }
  for (size_t b = 0; b < blocks; ++b) {
    while (!f->done(tickets[b])) {
    }
    f->wait(tickets[b]);
    ASSERT_EQ(std::memcmp(in[b].data, out[b].data, block), 0) << "block " << b;
  }
  EXPECT_NE(error_of([&] { f->wait(tickets[0]); }).find("unknown or already waited"), std::string::npos);
  f.reset();
  EXPECT_FALSE(fs::exists(path)) << "the tier's file outlives it";
}

INSTANTIATE_TEST_SUITE_P(Engines, BlockFileEngines,
                         ::testing::Values(IoEngine::automatic, IoEngine::io_uring, IoEngine::threads),
                         [](const auto& info) { return std::string(info.param == IoEngine::io_uring ? "io_uring" : info.param == IoEngine::threads ? "threads" : "automatic"); });

TEST(BlockFile, RefusesUnalignedAndOutOfRangeRequests) {
  testing::TempDir dir;
  auto f = BlockFile::create(dir / "t.bin", 8 * kA, IoEngine::threads);
  AlignedBuffer buf(2 * kA);
  char* p = static_cast<char*>(buf.data);
  EXPECT_NE(error_of([&] { f->read(p + 8, kA, 0); }).find("unaligned"), std::string::npos);
  EXPECT_NE(error_of([&] { f->read(p, kA + 1, 0); }).find("unaligned"), std::string::npos);
  EXPECT_NE(error_of([&] { f->read(p, kA, 100); }).find("unaligned"), std::string::npos);
  EXPECT_NE(error_of([&] { f->write(p, 2 * kA, 7 * kA); }).find("outside"), std::string::npos);
}

TEST(BlockFile, RefusesAPathThatExistsOrCannotBeCreated) {
  testing::TempDir dir;
  const std::string path = dir / "taken.bin";
  { std::ofstream(path) << "user data"; }
  std::string e = error_of([&] { BlockFile::create(path, kA, IoEngine::automatic); });
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("File exists"), std::string::npos) << e;
  EXPECT_EQ(fs::file_size(path), 9u) << "an existing file was touched";
  const std::string nowhere = dir / "no-such-dir/t.bin";
  e = error_of([&] { BlockFile::create(nowhere, kA, IoEngine::automatic); });
  EXPECT_NE(e.find(nowhere), std::string::npos) << e;
  EXPECT_NE(e.find("No such file or directory"), std::string::npos) << e;
  EXPECT_THROW(parse_enum<IoEngine>("aio", "tier.engine"), Error);
  EXPECT_EQ(parse_enum<IoEngine>("io_uring", "tier.engine"), IoEngine::io_uring);
}

// A tmpfs of 1 MiB stands in for a full disk: the reservation fails up front, and the file goes.
TEST(BlockFile, ADiskWithoutRoomIsRefusedAtCreationAndLeavesNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  testing::TempDir dir;
  const fs::path mnt = dir / "small";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  struct Unmount {
    fs::path at;
    ~Unmount() { ::umount(at.c_str()); }
  } unmount{mnt};
  const std::string path = (mnt / "tier.bin").string();
  const std::string e = error_of([&] { BlockFile::create(path, 8u << 20, IoEngine::automatic); });
  EXPECT_NE(e.find("no room"), std::string::npos) << e;
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(path));
  // What fits is fine.
  auto f = BlockFile::create(path, 256u << 10, IoEngine::automatic);
  EXPECT_TRUE(fs::exists(path));
  f.reset();
  EXPECT_TRUE(fs::is_empty(mnt));
}

}  // namespace
}  // namespace keel
