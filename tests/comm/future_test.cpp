#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "tdist/comm/work.h"
#include "tdist/core/error.h"

namespace tdist::comm {
namespace {

TEST(Future, ValueAndContinuations) {
  auto f = std::make_shared<Future>();
  EXPECT_FALSE(f->completed());
  auto doubled = f->then([](Future& self) { return Future::Value{self.value()[0] * 2}; });
  std::thread t([f] { f->set_value({torch::ones({3})}); });
  EXPECT_TRUE(torch::equal(f->wait(Millis(10000))[0], torch::ones({3})));
  t.join();
  EXPECT_TRUE(torch::equal(doubled->wait(Millis(10000))[0], torch::full({3}, 2.0)));
  // A continuation added after completion runs at once.
  bool ran = false;
  f->add_callback([&](Future&) { ran = true; });
  EXPECT_TRUE(ran);
}

TEST(Future, ErrorPropagatesThroughThen) {
  auto f = std::make_shared<Future>();
  bool called = false;
  auto next = f->then([&](Future&) {
    called = true;
    return Future::Value{};
  });
  f->set_error(std::make_exception_ptr(NetworkError("peer gone")));
  EXPECT_FALSE(called);
  EXPECT_TRUE(next->has_error());
  EXPECT_THROW(next->wait(), NetworkError);
  EXPECT_THROW(f->value(), NetworkError);
}

TEST(Future, ThrowingContinuationFailsItsFuture) {
  auto f = Future::completed({});
  auto next = f->then([](Future&) -> Future::Value { throw InvalidArgument("bad"); });
  EXPECT_THROW(next->wait(), InvalidArgument);
}

TEST(Future, WaitTimesOut) {
  auto f = std::make_shared<Future>();
  EXPECT_THROW(f->wait(Millis(20)), TimeoutError);
  Work w("allreduce", 3, f);
  EXPECT_FALSE(w.is_completed());
  EXPECT_THROW(w.wait(Millis(20)), TimeoutError);
  f->set_value({});
  EXPECT_TRUE(w.wait());
  EXPECT_TRUE(w.is_success());
  EXPECT_EQ(w.sequence_number(), 3u);
  EXPECT_THROW(f->set_value({}), Error);  // completed twice
}

}  // namespace
}  // namespace tdist::comm
