// core/token.h: the token from TDIST_TOKEN or TDIST_TOKEN_FILE, and the file checks.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <vector>
#include <string>

#include "tdist/core/error.h"
#include "tdist/core/token.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"

namespace tdist {
namespace {

using test::EnvGuard;
using test::expect_invalid;

// A private temporary directory, removed with what the test put in it.
class TokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tdist_token_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const auto& p : created_) ::unlink(p.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string write(const std::string& name, const std::string& content, mode_t mode) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << content;
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    created_.push_back(path);
    return path;
  }
  std::string dir_;
  std::vector<std::string> created_;
};

TEST(Token, NoneWhenNeitherVariableIsSet) {
  EnvGuard env({{"TDIST_TOKEN", std::nullopt}, {"TDIST_TOKEN_FILE", std::nullopt}});
  Token t = load_token();
  EXPECT_TRUE(t.value.empty());
  EXPECT_TRUE(t.source.empty());
}

TEST(Token, FromTheEnvironment) {
  EnvGuard env({{"TDIST_TOKEN", "s3cret"}, {"TDIST_TOKEN_FILE", std::nullopt}});
  Token t = load_token();
  EXPECT_EQ(t.value, "s3cret");
  EXPECT_EQ(t.source, "TDIST_TOKEN");
}

TEST_F(TokenFile, FromAPrivateFile) {
  const std::string path = write("token", "from-a-file\n", 0600);
  EnvGuard env({{"TDIST_TOKEN", std::nullopt}, {"TDIST_TOKEN_FILE", path}});
  Token t = load_token();
  EXPECT_EQ(t.value, "from-a-file");  // the trailing newline is not part of it
  EXPECT_EQ(t.source, "TDIST_TOKEN_FILE=" + path);
  EXPECT_EQ(read_token_file(write("owner-only-read", "x", 0400)), "x");
}

TEST_F(TokenFile, AFileOthersCanReadIsRefusedWithItsPathAndMode) {
  const std::string path = write("token", "s3cret", 0644);
  EnvGuard env({{"TDIST_TOKEN", std::nullopt}, {"TDIST_TOKEN_FILE", path}});
  expect_invalid([] { load_token(); }, {path, "0644", "group or others"});
  expect_invalid([&] { read_token_file(write("group-writable", "s3cret", 0620)); }, {"0620"});
}

TEST_F(TokenFile, SymlinksDirectoriesAndEmptyFilesAreRefused) {
  const std::string target = write("target", "s3cret", 0600);
  const std::string link = dir_ + "/link";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  created_.push_back(link);
  expect_invalid([&] { read_token_file(link); }, {link, "symbolic link"});
  expect_invalid([&] { read_token_file(dir_); }, {dir_, "not a regular file"});
  expect_invalid([&] { read_token_file(write("empty", "", 0600)); }, {"empty"});
  expect_invalid([&] { read_token_file(dir_ + "/missing"); }, {"missing", "cannot open"});
  expect_invalid([&] { read_token_file(write("huge", std::string(5000, 'x'), 0600)); },
                 {"5000 bytes"});
}

TEST_F(TokenFile, BothVariablesSetIsRefused) {
  const std::string path = write("token", "s3cret", 0600);
  EnvGuard env({{"TDIST_TOKEN", "other"}, {"TDIST_TOKEN_FILE", path}});
  expect_invalid([] { load_token(); }, {"TDIST_TOKEN", "TDIST_TOKEN_FILE", "only one"});
}

}  // namespace
}  // namespace tdist
