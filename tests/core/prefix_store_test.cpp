#include <gtest/gtest.h>

#include "tdist/core/error.h"
#include "tdist/core/hash_store.h"
#include "tdist/core/prefix_store.h"

namespace tdist {
namespace {

TEST(PrefixStore, ScopesKeysUnderItsPrefix) {
  auto base = std::make_shared<HashStore>(Millis(1000));
  PrefixStore a("a", base), b("b", base);
  a.set("k", "1");
  b.set("k", "2");
  EXPECT_EQ(a.get_string("k"), "1");
  EXPECT_EQ(b.get_string("k"), "2");
  EXPECT_EQ(base->get_string("a/k"), "1");
  EXPECT_TRUE(a.check({"k"}));
  EXPECT_FALSE(a.check({"missing"}));
  EXPECT_TRUE(b.delete_key("k"));
  EXPECT_FALSE(base->check({"b/k"}));
}

TEST(PrefixStore, GetUsesItsOwnTimeout) {
  auto base = std::make_shared<HashStore>(Millis(60000));
  PrefixStore p("group", base);
  p.set_timeout(Millis(100));
  try {
    p.get("never");
    FAIL() << "get returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("group/never"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("0.1 s"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tdist
