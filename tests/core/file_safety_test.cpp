// Files tdist writes or shares, against a local user who plants links or files (issue 41, item
// 11): a trace written whole through a fresh temporary file (never through a link planted at its
// name), files only their owner reads, and a FileStore that refuses a file someone else owns.

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "tdist/core/atomic_file.h"
#include "tdist/core/chrome_trace.h"
#include "tdist/core/error.h"
#include "tdist/core/file_store.h"
#include "tests/harness/expect.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {
namespace file_safety {

using test::expect_contains;
using test::expect_throw;

std::string contents(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

unsigned mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// Another user's file, planted where a trace's temporary file will be made (the name is
// predictable: the target, ".tmp.", the writer's pid): the writer must neither write through
// the link nor rename it into place.
TEST(FileSafety, ATraceIsNotWrittenThroughALinkPlantedAtItsTemporaryName) {
  const std::string dir = test::temp_dir("tdist-files");
  const std::string victim = dir + "/victim";
  const std::string path = dir + "/trace.json";
  write_text(victim, "keep");
  ASSERT_EQ(::symlink(victim.c_str(), (path + ".tmp." + std::to_string(::getpid())).c_str()), 0);
  write_chrome_trace(path, 1, "rank 0", {"main"}, {{"step", 0, 0, 10, ""}});
  EXPECT_EQ(contents(victim), "keep") << "the trace was written through the planted link";
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the planted link was renamed into place";
  expect_contains(contents(path), "\"step\"");
  EXPECT_EQ(mode_of(path), 0600u);
}

// Checkpoints, traces and the other files written whole are the owner's alone (0600), whatever
// the umask: a checkpoint holds the model and the run's fingerprint.
TEST(FileSafety, FilesWrittenWholeAreTheOwnersAlone) {
  const std::string dir = test::temp_dir("tdist-files");
  const mode_t saved = ::umask(022);
  write_file_atomically(dir + "/checkpoint.pt", {"header", "body"});
  ::umask(saved);
  EXPECT_EQ(contents(dir + "/checkpoint.pt"), "headerbody");
  EXPECT_EQ(mode_of(dir + "/checkpoint.pt"), 0600u);
}

// A FileStore file that another user created (a shared /tmp) is refused: its owner could read
// and change every key of the job. Needs root to make a file of another owner.
TEST(FileSafety, AFileStoreRefusesAFileThatSomeoneElseOwns) {
  if (::geteuid() != 0) GTEST_SKIP() << "only root can make a file of another owner here";
  const std::string dir = test::temp_dir("tdist-files");
  const std::string path = dir + "/store";
  write_text(path, "");
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  const std::string msg = expect_throw<Error>([&] { FileStore store(path); });
  expect_contains(msg, path);
  expect_contains(msg, "owned by uid 65534");
  // A file of our own is used.
  const std::string mine = dir + "/mine";
  FileStore store(mine);
  store.set("k", "v");
  EXPECT_EQ(store.get_string("k"), "v");
}

}  // namespace file_safety
}  // namespace
}  // namespace tdist
