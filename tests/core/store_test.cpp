// The one Store suite every implementation must pass: HashStore, FileStore, TCPStore (a really
// started server on 127.0.0.1, port 0) and PrefixStore over TCPStore.

#include <sys/stat.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <thread>

#include "tdist/core/error.h"
#include "tdist/core/file_store.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/prefix_store.h"
#include "tdist/core/tcp_store.h"
#include "tdist/core/wire.h"
#include "tests/core/store_worker.h"
#include "tests/harness/expect.h"
#include "tests/harness/process.h"

namespace tdist {
namespace {

using test::expect_contains;
using test::expect_throw;

using namespace std::chrono_literals;

// One backing store (a map, a file, a server) and a way to open more clients of it.
class StoreBacking {
 public:
  virtual ~StoreBacking() = default;
  // The first client.
  virtual std::shared_ptr<Store> store() = 0;
  // Another client of the same data (for HashStore: the same object), as a second thread or
  // process would open it.
  virtual std::shared_ptr<Store> peer() = 0;
};

class HashBacking : public StoreBacking {
 public:
  explicit HashBacking(Millis timeout) : store_(std::make_shared<HashStore>(timeout)) {}
  std::shared_ptr<Store> store() override { return store_; }
  std::shared_ptr<Store> peer() override { return store_; }

 private:
  std::shared_ptr<HashStore> store_;
};

class FileBacking : public StoreBacking {
 public:
  explicit FileBacking(Millis timeout)
      : dir_(test::temp_dir("tdist-filestore")),
        timeout_(timeout),
        store_(std::make_shared<FileStore>(dir_ + "/store", -1, timeout)) {}
  ~FileBacking() override {
    store_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::shared_ptr<Store> store() override { return store_; }
  std::shared_ptr<Store> peer() override {
    return std::make_shared<FileStore>(dir_ + "/store", -1, timeout_);
  }

 private:
  std::string dir_;
  Millis timeout_;
  std::shared_ptr<FileStore> store_;
};

class TCPBacking : public StoreBacking {
 public:
  explicit TCPBacking(Millis timeout)
      : timeout_(timeout),
        server_(std::make_shared<TCPStore>("127.0.0.1", 0, /*is_server=*/true, timeout)) {}
  std::shared_ptr<Store> store() override { return server_; }
  std::shared_ptr<Store> peer() override {
    return std::make_shared<TCPStore>("127.0.0.1", server_->port(), false, timeout_);
  }

 protected:
  Millis timeout_;
  std::shared_ptr<TCPStore> server_;
};

class PrefixTCPBacking : public TCPBacking {
 public:
  explicit PrefixTCPBacking(Millis timeout)
      : TCPBacking(timeout), store_(std::make_shared<PrefixStore>("group0", server_)) {}
  std::shared_ptr<Store> store() override { return store_; }
  std::shared_ptr<Store> peer() override {
    return std::make_shared<PrefixStore>("group0", TCPBacking::peer());
  }

 private:
  std::shared_ptr<PrefixStore> store_;
};

struct Backend {
  std::string name;
  std::function<std::unique_ptr<StoreBacking>(Millis timeout)> make;
};

std::ostream& operator<<(std::ostream& os, const Backend& b) { return os << b.name; }

const Backend kBackends[] = {
    {"HashStore", [](Millis t) { return std::make_unique<HashBacking>(t); }},
    {"FileStore", [](Millis t) { return std::make_unique<FileBacking>(t); }},
    {"TCPStore", [](Millis t) { return std::make_unique<TCPBacking>(t); }},
    {"PrefixStoreOverTCPStore", [](Millis t) { return std::make_unique<PrefixTCPBacking>(t); }},
};

using test::kTimeout;
// For the tests that expect a timeout.
constexpr Millis kShortTimeout = 500ms;

class StoreSuite : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    backing_ = GetParam().make(kTimeout);
    store_ = backing_->store();
  }
  std::unique_ptr<StoreBacking> backing_;
  std::shared_ptr<Store> store_;
};

TEST_P(StoreSuite, SetThenGetReturnsTheLatestValue) {
  store_->set("k", "first");
  EXPECT_EQ(store_->get_string("k"), "first");
  store_->set("k", "second");
  EXPECT_EQ(store_->get_string("k"), "second");
  // Binary values with zero bytes, and the empty value, survive as they are.
  Bytes binary = {0, 1, 2, 0, 255, 0};
  store_->set("bin", binary);
  EXPECT_EQ(store_->get("bin"), binary);
  store_->set("empty", Bytes{});
  EXPECT_EQ(store_->get("empty"), Bytes{});
  EXPECT_EQ(backing_->peer()->get("bin"), binary);
}

TEST_P(StoreSuite, GetBlocksUntilAnotherThreadSets) {
  auto peer = backing_->peer();
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    peer->set("late", "here");
  });
  EXPECT_EQ(store_->get_string("late"), "here");
  setter.join();
}

TEST_P(StoreSuite, GetTimeoutNamesTheKeyAndTheSeconds) {
  auto backing = GetParam().make(kShortTimeout);
  auto store = backing->store();
  store->set("other", "x");
  std::string msg = expect_throw<TimeoutError>([&] { store->get("absent-key"); });
  expect_contains(msg, "absent-key");
  expect_contains(msg, "0.5 s");
  // The store is still usable afterwards.
  EXPECT_EQ(store->get_string("other"), "x");
}

TEST_P(StoreSuite, AddCountsFromZeroAndGetReturnsText) {
  EXPECT_EQ(store_->add("counter", 5), 5);
  EXPECT_EQ(store_->add("counter", 2), 7);
  EXPECT_EQ(store_->add("counter", -10), -3);
  EXPECT_EQ(store_->get_string("counter"), "-3");
  EXPECT_EQ(store_->add("counter", 0), -3);
  store_->set("preset", "40");
  EXPECT_EQ(store_->add("preset", 2), 42);
}

TEST_P(StoreSuite, AddOnANonIntegerValueIsInvalidAndChangesNothing) {
  store_->set("text", "hello");
  std::string msg = expect_throw<InvalidArgument>([&] { store_->add("text", 1); });
  expect_contains(msg, "text");
  EXPECT_EQ(store_->get_string("text"), "hello");
  store_->set("partial", "12abc");
  expect_throw<InvalidArgument>([&] { store_->add("partial", 1); });
  EXPECT_EQ(store_->get_string("partial"), "12abc");
  // The store still works after the refused add.
  EXPECT_EQ(store_->add("fine", 1), 1);
}

TEST_P(StoreSuite, CompareSetFollowsTheRules) {
  // Missing key, empty expected: stores desired and returns it.
  EXPECT_EQ(to_string(store_->compare_set("cs", {}, to_bytes("v1"))), "v1");
  EXPECT_EQ(store_->get_string("cs"), "v1");
  // Present key, expected matches: swaps.
  EXPECT_EQ(to_string(store_->compare_set("cs", to_bytes("v1"), to_bytes("v2"))), "v2");
  EXPECT_EQ(store_->get_string("cs"), "v2");
  // Present key, expected does not match: returns the current value, changes nothing.
  EXPECT_EQ(to_string(store_->compare_set("cs", to_bytes("nope"), to_bytes("v3"))), "v2");
  EXPECT_EQ(store_->get_string("cs"), "v2");
  // Missing key, non-empty expected: returns expected, the key stays missing.
  EXPECT_EQ(to_string(store_->compare_set("missing", to_bytes("e"), to_bytes("d"))), "e");
  EXPECT_FALSE(store_->check({"missing"}));
  // Present key, empty expected: does not match a non-empty value.
  EXPECT_EQ(to_string(store_->compare_set("cs", {}, to_bytes("v4"))), "v2");
}

TEST_P(StoreSuite, CompareSetWakesAWaiter) {
  auto peer = backing_->peer();
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    peer->compare_set("cs-wake", {}, to_bytes("up"));
  });
  store_->wait({"cs-wake"});
  EXPECT_EQ(store_->get_string("cs-wake"), "up");
  setter.join();
}

TEST_P(StoreSuite, WaitReturnsOnceEveryKeyExists) {
  store_->set("a", "1");
  store_->wait({"a"});
  store_->wait({});
  auto peer = backing_->peer();
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    peer->set("b", "2");
    std::this_thread::sleep_for(20ms);
    peer->add("c", 1);
  });
  store_->wait({"a", "b", "c"}, kTimeout);
  EXPECT_TRUE(store_->check({"a", "b", "c"}));
  setter.join();
}

TEST_P(StoreSuite, WaitTimeoutNamesTheMissingKeysAndTheSeconds) {
  store_->set("present", "1");
  std::string msg = expect_throw<TimeoutError>([&] {
    store_->wait({"present", "missing-one", "missing-two"}, kShortTimeout);
  });
  expect_contains(msg, "missing-one");
  expect_contains(msg, "missing-two");
  expect_contains(msg, "0.5 s");
  EXPECT_EQ(msg.find("'present'"), std::string::npos) << msg;
  // A timed-out wait leaves the store usable.
  store_->set("after", "ok");
  EXPECT_EQ(store_->get_string("after"), "ok");
}

TEST_P(StoreSuite, CheckNeverBlocks) {
  EXPECT_FALSE(store_->check({"x"}));
  store_->set("x", "1");
  EXPECT_TRUE(store_->check({"x"}));
  EXPECT_FALSE(store_->check({"x", "y"}));
  EXPECT_TRUE(store_->check({}));
}

TEST_P(StoreSuite, DeleteKeyReportsWhetherItExisted) {
  store_->set("d", "1");
  EXPECT_TRUE(store_->delete_key("d"));
  EXPECT_FALSE(store_->check({"d"}));
  EXPECT_FALSE(store_->delete_key("d"));
  EXPECT_FALSE(store_->delete_key("never-set"));
  // A deleted counter starts again from zero.
  store_->add("n", 3);
  EXPECT_TRUE(store_->delete_key("n"));
  EXPECT_EQ(store_->add("n", 1), 1);
}

TEST_P(StoreSuite, NumKeysCountsSetAddAndDelete) {
  EXPECT_EQ(store_->num_keys(), 0);
  store_->set("k1", "v");
  store_->add("k2", 1);
  store_->compare_set("k3", {}, to_bytes("v"));
  EXPECT_EQ(store_->num_keys(), 3);
  store_->set("k1", "again");
  EXPECT_EQ(store_->num_keys(), 3);
  store_->delete_key("k2");
  EXPECT_EQ(store_->num_keys(), 2);
  EXPECT_EQ(backing_->peer()->num_keys(), 2);
}

TEST_P(StoreSuite, ConcurrentAddsFromSeveralClientsAllCount) {
  constexpr int kThreads = 4;
  constexpr int kAdds = 50;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      try {
        auto client = backing_->peer();
        for (int i = 0; i < kAdds; ++i) client->add("shared", 1);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        failures++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store_->get_string("shared"), std::to_string(kThreads * kAdds));
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreSuite, ::testing::ValuesIn(kBackends),
                         [](const auto& info) { return info.param.name; });

// ---- FileStore specifics --------------------------------------------------------------------

class FileStoreTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_ = test::temp_dir("tdist-filestore");
  std::string path_ = dir_ + "/store";
};

TEST_F(FileStoreTest, TheLastOfNumWorkersRemovesTheFile) {
  auto a = std::make_unique<FileStore>(path_, 2, kTimeout);
  auto b = std::make_unique<FileStore>(path_, 2, kTimeout);
  a->set("k", "v");
  a.reset();
  EXPECT_TRUE(std::filesystem::exists(path_));
  EXPECT_EQ(b->get_string("k"), "v");
  b.reset();
  EXPECT_FALSE(std::filesystem::exists(path_));
}

TEST_F(FileStoreTest, WithoutNumWorkersTheLastAliveRemovesTheFile) {
  auto a = std::make_unique<FileStore>(path_, -1, kTimeout);
  {
    FileStore brief(path_, -1, kTimeout);
    brief.set("k", "v");
  }
  EXPECT_TRUE(std::filesystem::exists(path_));
  EXPECT_EQ(a->get_string("k"), "v");
  a.reset();
  EXPECT_FALSE(std::filesystem::exists(path_));
  // A new store on the same path starts empty.
  FileStore fresh(path_, -1, kTimeout);
  EXPECT_EQ(fresh.num_keys(), 0);
}

TEST_F(FileStoreTest, ATornRecordFromADeadWriterIsSkippedAndReplaced) {
  FileStore store(path_, -1, kTimeout);
  store.set("a", "1");
  {
    // What a writer killed in the middle of a record leaves: a length with too few bytes.
    Bytes torn;
    wire::Writer(torn).u64(100);
    torn.push_back(1);
    std::ofstream out(path_, std::ios::binary | std::ios::app);
    out.write(reinterpret_cast<const char*>(torn.data()),
              static_cast<std::streamsize>(torn.size()));
  }
  FileStore other(path_, -1, kTimeout);
  EXPECT_EQ(other.get_string("a"), "1");
  other.set("b", "2");
  EXPECT_EQ(store.get_string("b"), "2");
  FileStore third(path_, -1, kTimeout);
  EXPECT_EQ(third.num_keys(), 2);
  EXPECT_EQ(third.get_string("a"), "1");
}

TEST_F(FileStoreTest, ACorruptRecordIsAProtocolErrorNamingTheFile) {
  FileStore store(path_, -1, kTimeout);
  {
    Bytes payload = {9, 0, 0, 0, 0, 0, 0, 0, 0};  // op 9, empty key
    Bytes record;
    wire::Writer(record).blob(payload);
    std::ofstream out(path_, std::ios::binary | std::ios::app);
    out.write(reinterpret_cast<const char*>(record.data()),
              static_cast<std::streamsize>(record.size()));
  }
  std::string msg = expect_throw<ProtocolError>([&] { FileStore reader(path_, -1, kTimeout); });
  expect_contains(msg, path_);
  expect_contains(msg, "unknown record op 9");
}

TEST_F(FileStoreTest, AnUnopenablePathIsAnErrorNamingIt) {
  const std::string bad = dir_ + "/no-such-dir/store";
  std::string msg = expect_throw<Error>([&] { FileStore store(bad, -1, kTimeout); });
  expect_contains(msg, bad);
}

TEST_F(FileStoreTest, TheFileIsReadableByItsUserOnly) {
  FileStore store(path_, -1, kTimeout);
  store.set("k", "v");
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(FileStoreTest, ASymbolicLinkAtThePathIsRefusedAndItsTargetUntouched) {
  const std::string target = dir_ + "/precious";
  { std::ofstream(target) << "keep me"; }
  std::filesystem::create_symlink(target, path_);
  std::string msg = expect_throw<Error>([&] { FileStore store(path_, -1, kTimeout); });
  expect_contains(msg, path_);
  expect_contains(msg, "symbolic link");
  std::ifstream in(target);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "keep me");
}

TEST_F(FileStoreTest, AFifoAtThePathIsRefused) {
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  std::string msg = expect_throw<Error>([&] { FileStore store(path_, -1, kTimeout); });
  expect_contains(msg, "not a regular file");
}

TDIST_TEST_CHILD(file_store_worker) {
  FileStore store(std::getenv("TDIST_TEST_FILE_STORE"), -1, 30s);
  return test::exercise_store(store, rank, world_size, 50);
}

TEST_F(FileStoreTest, FourProcessesShareOneFile) {
  FileStore store(path_, -1, kTimeout);
  test::Processes procs("file_store_worker", 4, {{"TDIST_TEST_FILE_STORE", path_}});
  auto results = procs.wait_all(60s);
  ASSERT_EQ(test::Processes::failures(results), "");
  EXPECT_EQ(store.get_string("counter"), "200");
  const std::string leader = store.get_string("leader");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(store.get_string("leader_seen/" + std::to_string(r)), leader);
  }
  // 4 rank keys, 4 leader_seen keys, counter, leader.
  EXPECT_EQ(store.num_keys(), 10);
}

}  // namespace
}  // namespace tdist
