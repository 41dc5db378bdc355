// Distributed autograd contexts: propagation, cleanup on every worker, concurrency,
// retain_graph, bad input, a worker that died before backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "tdist/autograd/detail/engine.h"

#include "tests/autograd/autograd_test_util.h"
#include "tests/harness/expect.h"

namespace tdist::autograd::test {
namespace {

using namespace std::chrono_literals;
using tdist::test::expect_contains;
using tdist::test::expect_throw;

class AutogradContext : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    clear_params();
    rpc::RpcOptions o;
    o.rpc_timeout = 10s;
    agents_ = start(3, o);
    rpc::set_current_agent(agents_[0]);
  }
  void TearDown() override {
    rpc::set_current_agent(nullptr);
    rpc::test::shutdown_all(agents_, !killed_);
    clear_params();
  }
  Agents agents_;
  bool killed_ = false;
};

TEST_F(AutogradContext, IdsCarryTheCreatorAndTravelWithCalls) {
  EXPECT_FALSE(current_context().has_value());
  int64_t id0 = 0;
  {
    Context ctx;
    id0 = ctx.id();
    EXPECT_EQ(current_context(), ctx.id());
    EXPECT_EQ(detail::context_creator(ctx.id()), 0);
    // The callee runs in the caller's context, nested calls too.
    EXPECT_EQ(rpc::rpc_sync<int64_t>("w1", "ag.context_here"), ctx.id());
    EXPECT_EQ(contexts_on(agents_[1]), std::vector<int64_t>{ctx.id()});
    expect_contains(expect_throw<InvalidArgument>([] { Context nested; }), "already current");
  }
  EXPECT_FALSE(current_context().has_value());
  EXPECT_EQ(rpc::rpc_sync<int64_t>("w1", "ag.context_here"), 0) << "no context outside";
  as_worker(agents_[2], [&] {
    Context ctx;
    EXPECT_EQ(detail::context_creator(ctx.id()), 2);
    EXPECT_NE(ctx.id(), id0);
    return 0;
  });
}

TEST_F(AutogradContext, ReleasedOnEveryWorkerAfterSuccess) {
  at::Tensor x = leaf({2, 3});
  param("w1", "b") = leaf({3, 3});
  param("w2", "c") = leaf({3, 3});
  {
    Context ctx;
    using Chain = std::vector<std::pair<std::string, std::string>>;
    at::Tensor z =
        rpc::rpc_sync<at::Tensor>("w1", "ag.chain", Chain{{"w2", "c"}}, std::string("b"), x);
    backward(ctx.id(), {z.sum()});
    for (auto& a : agents_.agents) EXPECT_EQ(contexts_on(a).size(), 1u) << a->info().name;
  }
  // The guard waited for every worker's answer: nothing is left anywhere (w2 only heard of the
  // context from w1, and was released through it).
  for (auto& a : agents_.agents) EXPECT_TRUE(contexts_on(a).empty()) << a->info().name;
}

TEST_F(AutogradContext, ReleasedOnEveryWorkerAfterAnExceptionInForward) {
  at::Tensor x = leaf({2, 3});
  param("w1", "b") = leaf({3, 3});
  {
    Context ctx;
    rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), x);
    EXPECT_THROW(rpc::rpc_sync<at::Tensor>("w2", "ag.fail", x), rpc::RemoteError);
    EXPECT_FALSE(contexts_on(agents_[2]).empty());
  }
  for (auto& a : agents_.agents) EXPECT_TRUE(contexts_on(a).empty()) << a->info().name;
}

TEST_F(AutogradContext, ConcurrentContextsDoNotMix) {
  param("w2", "c") = leaf({3, 3});
  const at::Tensor c = param("w2", "c");
  // Two trainers (w0 and w1) each run 5 iterations through w2's parameter at once.
  auto trainer = [&](int rank, double scale) {
    return as_worker(agents_[rank], [&] {
      for (int it = 0; it < 5; ++it) {
        at::Tensor x = torch::full({2, 3}, scale, torch::kFloat64).requires_grad_(true);
        Context ctx;
        at::Tensor y = rpc::rpc_sync<at::Tensor>("w2", "ag.stage", std::string("c"), x);
        backward(ctx.id(), {y.sum()});
        auto cr = c.detach().clone().requires_grad_(true);
        auto xr = x.detach().clone().requires_grad_(true);
        auto ref = torch::autograd::grad({stage(xr, cr).sum()}, {xr, cr});
        auto gx = get_gradients(ctx.id()).at(x);
        auto gc = gradients_on(agents_[2], ctx.id()).at(c);
        if (!torch::allclose(gx, ref[0], 0, 1e-9) || !torch::allclose(gc, ref[1], 0, 1e-9)) {
          return false;
        }
      }
      return true;
    });
  };
  bool ok0 = false, ok1 = false;
  std::thread t0([&] { ok0 = trainer(0, 0.5); });
  std::thread t1([&] { ok1 = trainer(1, -1.5); });
  t0.join();
  t1.join();
  EXPECT_TRUE(ok0);
  EXPECT_TRUE(ok1);
  EXPECT_TRUE(all_released(agents_));
}

TEST_F(AutogradContext, RetainGraphAllowsASecondBackward) {
  at::Tensor x = leaf({2, 3});
  param("w1", "b") = leaf({3, 3});
  const at::Tensor b = param("w1", "b");
  Context ctx;
  at::Tensor loss = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), x).sum();
  backward(ctx.id(), {loss}, /*retain_graph=*/true);
  at::Tensor gx1 = get_gradients(ctx.id()).at(x).clone();
  at::Tensor gb1 = gradients_on(agents_[1], ctx.id()).at(b).clone();
  backward(ctx.id(), {loss});  // accumulates into the same context
  EXPECT_TRUE(torch::allclose(get_gradients(ctx.id()).at(x), 2 * gx1));
  EXPECT_TRUE(torch::allclose(gradients_on(agents_[1], ctx.id()).at(b), 2 * gb1));
  // The second ran without retain_graph: a third is refused and changes nothing.
  expect_contains(expect_throw<InvalidArgument>([&] { backward(ctx.id(), {loss}); }),
                  "retain_graph");
  EXPECT_TRUE(torch::allclose(get_gradients(ctx.id()).at(x), 2 * gx1));
}

TEST_F(AutogradContext, BadInputGetsClearErrorsAndChangesNothing) {
  at::Tensor x = leaf({2, 3});
  param("w1", "b") = leaf({3, 3});
  int64_t expired = 0;
  {
    Context ctx;
    expired = ctx.id();
  }
  expect_contains(expect_throw<InvalidArgument>([] { backward(12345, {}); }),
                  "context 12345 is not known");
  expect_contains(expect_throw<InvalidArgument>([&] { get_gradients(expired); }), "not known");
  at::Tensor y = leaf({1});
  expect_contains(expect_throw<InvalidArgument>([&] { backward(expired, {y.sum()}); }),
                  "not known");

  Context ctx;
  at::Tensor loss = rpc::rpc_sync<at::Tensor>("w1", "ag.stage", std::string("b"), x).sum();
  // A context of another worker: w1 knows it, but only w0 may run its backward.
  expect_contains(expect_throw<InvalidArgument>(
                      [&] { as_worker(agents_[1], [&] { backward(ctx.id(), {loss}); }); }),
                  "created by worker rank 0");
  // Roots that do not require grad, or are not scalars.
  expect_contains(expect_throw<InvalidArgument>([&] {
                    backward(ctx.id(), {loss, torch::ones({1})});
                  }),
                  "root 1 does not require grad");
  expect_contains(expect_throw<InvalidArgument>([&] { backward(ctx.id(), {x * 2}); }),
                  "must be scalars");
  EXPECT_TRUE(get_gradients(ctx.id()).empty());
  EXPECT_TRUE(gradients_on(agents_[1], ctx.id()).empty());
  // The context still works.
  backward(ctx.id(), {loss});
  EXPECT_EQ(get_gradients(ctx.id()).count(x), 1u);
}

TEST_F(AutogradContext, AWorkerThatDiedFailsBackwardNamingIt) {
  at::Tensor x = leaf({2, 3});
  param("w1", "b") = leaf({3, 3});
  param("w2", "c") = leaf({3, 3});
  {
    Context ctx;
    using Chain = std::vector<std::pair<std::string, std::string>>;
    at::Tensor z =
        rpc::rpc_sync<at::Tensor>("w1", "ag.chain", Chain{{"w2", "c"}}, std::string("b"), x);
    agents_[2]->shutdown(false);  // w2 dies between forward and backward: its connections close
    killed_ = true;
    auto what = expect_throw<Error>([&] { backward(ctx.id(), {z.sum()}); });
    expect_contains(what, "w2");
  }
  // The survivors hold nothing for the context.
  EXPECT_TRUE(contexts_on(agents_[0]).empty());
  EXPECT_TRUE(rpc::test::eventually([&] { return contexts_on(agents_[1]).empty(); }));
}

// Issue 41 item 8: a peer cannot fill a worker with contexts, nor release a context it had no
// part in. Before, every context id a peer named was created, and RELEASE believed the rank its
// sender wrote into it.
TEST_F(AutogradContext, APeerCreatesBoundedContextsAndReleasesOnlyItsOwn) {
  auto& w1 = agents_[1];
  auto& w2 = agents_[2];
  std::atomic<size_t> answered{0};
  std::atomic<size_t> refused{0};
  const size_t limit = detail::Container::kMaxContextsPerPeer;
  for (size_t i = 0; i < limit + 20; ++i) {
    auto m =
        rpc::detail::encode_message(rpc::detail::MessageType::kCall, &w2->rref_context(), 1,
                                    std::make_tuple(rpc::detail::CallHeader{
                                        "ag.context_here", rpc::signature_of<int64_t>().hash}));
    detail::Header h;
    h.context_id = (int64_t{2} << detail::kContextRankShift) | static_cast<int64_t>(1000 + i);
    detail::prepend_header(m, h);
    w2->send_request(
        1, std::move(m), 10s,
        [&](rpc::detail::Message*, std::exception_ptr e) { ++(e ? refused : answered); },
        "a context per call");
  }
  ASSERT_TRUE(rpc::test::eventually([&] { return answered + refused == limit + 20; }));
  EXPECT_EQ(answered.load(), limit);
  EXPECT_EQ(contexts_on(w1).size(), limit);
  // w0's own contexts still reach w1.
  {
    Context ctx;
    EXPECT_EQ(rpc::rpc_sync<int64_t>("w1", "ag.context_here"), ctx.id());
    // w2 took no part in ctx: it cannot release it on w1, under its own rank or w0's.
    for (int32_t claimed : {2, 0}) {
      auto what = as_worker(w2, [&] {
        detail::ThreadContextScope outside(0);  // w2 calls outside ctx (it is w0's)
        return expect_throw<rpc::RemoteError>(
            [&] { rpc::rpc_sync<void>("w1", detail::kReleaseFn, ctx.id(), claimed); });
      });
      expect_contains(what, "did not take part");
    }
    const auto held = contexts_on(w1);
    EXPECT_NE(std::find(held.begin(), held.end(), ctx.id()), held.end());
  }
  // w0 releasing its context still frees it on w1; w2 releases its own.
  EXPECT_TRUE(rpc::test::eventually([&] { return contexts_on(w1).size() == limit; }));
  as_worker(w2, [&] {
    detail::ThreadContextScope outside(0);
    rpc::rpc_sync<void>("w1", detail::kReleaseFn,
                        (int64_t{2} << detail::kContextRankShift) | int64_t{1000}, int32_t{2});
    return 0;
  });
  EXPECT_EQ(contexts_on(w1).size(), limit - 1);
}

}  // namespace
}  // namespace tdist::autograd::test
