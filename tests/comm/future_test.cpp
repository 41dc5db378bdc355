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

// A future completed with one tensor lists it when first asked: wait(), value(), a continuation
// and Work::result() all see a list of that tensor, and a Work's wait() needs none of it.
TEST(Future, OneTensorResultIsListedWhenAskedFor) {
  const at::Tensor t = torch::arange(4);
  auto f = std::make_shared<Future>();
  auto next = f->then([](Future& self) { return Future::Value{self.value()[0] + 1}; });
  Work w(Work::StaticName{"allreduce"}, 1, f);
  f->set_result(Future::Result(t));
  EXPECT_TRUE(w.wait());
  EXPECT_TRUE(torch::equal(next->wait()[0], torch::arange(1, 5)));
  ASSERT_EQ(w.result().size(), 1u);
  EXPECT_TRUE(w.result()[0].is_same(t));
  EXPECT_EQ(&f->wait(), &f->value());                     // listed once
  EXPECT_THROW(f->set_result(Future::Result(t)), Error);  // completed twice

  // First looks from several threads at once all get the same list (TSan checks the listing).
  for (int round = 0; round < 20; ++round) {
    auto g = std::make_shared<Future>();
    std::vector<std::thread> lookers;
    std::vector<const Future::Value*> seen(4, nullptr);
    for (int i = 0; i < 4; ++i) {
      lookers.emplace_back([&, i] { seen[i] = &g->wait(Millis(10000)); });
    }
    g->set_result(Future::Result(t));
    for (auto& th : lookers) th.join();
    for (const auto* v : seen) {
      ASSERT_EQ(v, seen[0]);
      ASSERT_EQ(v->size(), 1u);
      EXPECT_TRUE((*v)[0].is_same(t));
    }
  }

  // A list result stays the list it was.
  auto h = std::make_shared<Future>();
  h->set_result(Future::Result(Future::Value{t, t}));
  EXPECT_EQ(h->value().size(), 2u);
}

}  // namespace
}  // namespace tdist::comm
