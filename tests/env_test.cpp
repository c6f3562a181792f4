// The file-operation seam: the POSIX environment and the fault plans tests use to make a write
// fail, the disk fill up, or the process die at a chosen operation.
#include "core/env.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::TempDir;

// Restores the process's environment when a test ends.
struct ScopedEnv {
  explicit ScopedEnv(Env* env) { Env::set(env); }
  ~ScopedEnv() { Env::set(nullptr); }
};

TEST(Env, PosixWritesReadsRenamesAndLists) {
  TempDir dir;
  Env& env = Env::posix();
  env.create_dirs(dir / "a/b");
  auto f = env.create(dir / "a/b/x");
  f->append("hello ", 6);
  f->append("world", 5);
  f->sync();
  f->close();
  EXPECT_EQ(env.file_size(dir / "a/b/x"), 11u);
  const std::vector<char> part = env.read_range(dir / "a/b/x", 6, 5);
  EXPECT_EQ(std::string(part.begin(), part.end()), "world");
  EXPECT_THROW(env.read_range(dir / "a/b/x", 8, 5), Error);
  env.rename(dir / "a/b/x", dir / "a/y");
  EXPECT_EQ(env.list_dir(dir / "a"), (std::vector<std::string>{"b", "y"}));
  EXPECT_TRUE(env.list_dir(dir / "none").empty());
  env.sync_dir(dir / "a");
  env.remove(dir / "a");
  env.remove(dir / "a");  // nothing left: not an error
  EXPECT_FALSE(env.exists(dir / "a"));
  try {
    env.read(dir / "missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing: cannot open"), std::string::npos) << e.what();
  }
}

TEST(Env, FaultPlanSyntax) {
  const FaultPlan p = FaultPlan::parse("kill:op=7:path=ckpt:rank=1:once=/tmp/m");
  EXPECT_EQ(p.action, FaultPlan::Action::kill);
  EXPECT_EQ(p.at_op, 7);
  EXPECT_EQ(p.path_contains, "ckpt");
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.once, "/tmp/m");
  EXPECT_EQ(FaultPlan::parse("full:bytes=10").capacity, 10u);
  for (const char* bad : {"explode", "fail", "fail:op=x", "fail:op=0", "kill:op=1:colour=red", "fail:op"}) {
    try {
      FaultPlan::parse(bad);
      FAIL() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KEEL_FAULT="), std::string::npos) << e.what();
    }
  }
}

TEST(Env, InjectedWriteFailureLeavesNoFileBehind) {
  TempDir dir;
  FaultPlan plan = FaultPlan::parse("fail:op=3:path=ckpt");  // create, append, *sync*
  FaultEnv fault(Env::posix(), plan);
  ScopedEnv scoped(&fault);
  write_file(dir / "other", "not counted", 11);  // path does not match
  EXPECT_EQ(fault.ops(), 0);
  try {
    write_file_atomic(dir / "ckpt.json", {ByteRange{"abc", 3}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt.json.tmp: sync failed (injected I/O error)"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(Env::posix().exists(dir / "ckpt.json"));
  EXPECT_FALSE(Env::posix().exists(dir / "ckpt.json.tmp"));
  write_file_atomic(dir / "ckpt.json", {ByteRange{"abc", 3}});  // the plan is spent
  EXPECT_EQ(read_text_file(dir / "ckpt.json"), "abc");
}

TEST(Env, DiskFullFailsTheWriteThatOverflows) {
  TempDir dir;
  FaultEnv fault(Env::posix(), FaultPlan::parse("full:bytes=100"));
  ScopedEnv scoped(&fault);
  const std::string small(60, 'x');
  write_file(dir / "a", small.data(), small.size());
  try {
    write_file(dir / "b", small.data(), small.size());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(Env::posix().exists(dir / "b"));
}

TEST(Env, KillDiesAtTheChosenOperationOnce) {
  TempDir dir;
  const std::string marker = dir / "killed";
  for (int attempt = 0; attempt < 2; ++attempt) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      FaultEnv fault(Env::posix(), FaultPlan::parse("kill:op=2:once=" + marker));
      Env::set(&fault);
      try {
        write_file(dir / "f", "0123", 4);  // create (1), append (2): dies here the first time
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (attempt == 0) {
      ASSERT_TRUE(WIFSIGNALED(status));
      EXPECT_EQ(WTERMSIG(status), SIGKILL);
      EXPECT_TRUE(Env::posix().exists(marker));
    } else {
      ASSERT_TRUE(WIFEXITED(status));
      EXPECT_EQ(WEXITSTATUS(status), 0) << "the once-marker disarms the plan";
      EXPECT_EQ(read_text_file(dir / "f"), "0123");
    }
  }
}

}  // namespace
}  // namespace keel
