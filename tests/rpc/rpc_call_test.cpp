// rpc_sync / rpc_async: every argument kind, nested calls, errors, timeouts, many outstanding
// calls, and the free-function API. Workers are agents on threads of this process (real TCP on
// 127.0.0.1), with the same-host fast path on and off.
#include <gtest/gtest.h>

#include "tests/rpc/rpc_test_util.h"

namespace tdist::rpc::test {
namespace {

class RpcCall : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
    RpcOptions o;
    o.same_host_fast_path = GetParam();
    o.rpc_timeout = 30s;
    a_ = start_agents(2, o);
  }
  void TearDown() override {
    if (!a_.agents.empty()) shutdown_all(a_);
  }
  Agents a_;
};

TEST_P(RpcCall, ArithmeticAndStrings) {
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w1", "add", int64_t{2}, int64_t{40}), 42);
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>(1, "add", int64_t{-5}, int64_t{5}), 0);
  EXPECT_EQ(a_[1]->rpc_sync<std::string>("w0", "concat", "ab", std::string("cd")), "abcd");
  EXPECT_EQ(a_[0]->rpc_sync<std::string>("w1", "whoami"), "w1");
  auto t = a_[0]->rpc_sync<std::tuple<bool, int8_t, uint16_t, int32_t, uint64_t, float>>(
      "w1", "small_types", true, int8_t{-3}, uint16_t{65534}, int32_t{7}, uint64_t{1} << 63, 1.5f);
  EXPECT_EQ(t, std::make_tuple(false, int8_t{-2}, uint16_t{65535}, int32_t{8},
                               (uint64_t{1} << 63) + 1, 3.0f));
  a_[0]->rpc_sync<void>("w1", "noop");
}

TEST_P(RpcCall, ContainersOptionalsAndStructs) {
  EXPECT_DOUBLE_EQ(a_[0]->rpc_sync<double>("w1", "sum", std::vector<double>{1.5, 2.5, 3}), 7.0);
  EXPECT_DOUBLE_EQ(a_[0]->rpc_sync<double>("w1", "sum", std::vector<double>{}), 0.0);
  std::map<std::string, int64_t> m{{"b", 2}, {"a", 1}};
  EXPECT_EQ(a_[0]->rpc_sync<std::vector<std::string>>("w1", "keys", m),
            (std::vector<std::string>{"a", "b"}));
  auto sw = a_[0]->rpc_sync<std::tuple<std::string, int64_t>>(
      "w1", "swap", std::make_tuple(int64_t{9}, std::string("nine")));
  EXPECT_EQ(sw, std::make_tuple(std::string("nine"), int64_t{9}));
  EXPECT_EQ(
      a_[0]->rpc_sync<std::optional<int64_t>>("w1", "maybe_double", std::optional<int64_t>(21)),
      std::optional<int64_t>(42));
  EXPECT_EQ(a_[0]->rpc_sync<std::optional<int64_t>>("w1", "maybe_double", std::optional<int64_t>()),
            std::nullopt);
  Point p = a_[0]->rpc_sync<Point>("w1", "mirror", Point{1, -2, "p"});
  EXPECT_EQ(p, (Point{-1, 2, "p'"}));
}

TEST_P(RpcCall, Tensors) {
  auto x = torch::arange(12, torch::kFloat32).reshape({3, 4});
  auto y = a_[0]->rpc_sync<at::Tensor>("w1", "scale", x, 2.0);
  EXPECT_TRUE(torch::equal(y, x * 2));
  // Non-contiguous, empty, 0-dim, integer, bool and large tensors; an undefined tensor.
  std::vector<at::Tensor> in{x.t(),
                             torch::empty({0, 5}),
                             torch::tensor(3.5, torch::kFloat64),
                             torch::arange(7, torch::kInt64),
                             torch::tensor({true, false, true}),
                             torch::rand({1 << 20}),  // 4 MiB: the fast path when on
                             at::Tensor()};
  auto out = a_[0]->rpc_sync<std::vector<at::Tensor>>("w1", "echo_tensors", in);
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i + 1 < in.size(); ++i) {
    EXPECT_EQ(out[i].scalar_type(), in[i].scalar_type()) << i;
    EXPECT_TRUE(torch::equal(out[i], in[i])) << i;
  }
  EXPECT_FALSE(out.back().defined());
  // The received tensor is the callee's own memory, not the sender's.
  auto big = torch::rand({1 << 20});
  auto back = a_[1]->rpc_sync<at::Tensor>("w0", "echo", big);
  EXPECT_NE(back.data_ptr(), big.data_ptr());
  EXPECT_TRUE(torch::equal(back, big));
}

TEST_P(RpcCall, CallsToSelf) {
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w0", "add", int64_t{1}, int64_t{1}), 2);
  auto t = torch::rand({1000});
  EXPECT_TRUE(torch::equal(a_[0]->rpc_sync<at::Tensor>(0, "echo", t), t));
}

TEST_P(RpcCall, AsyncFutureThenAndError) {
  auto f = a_[0]->rpc_async<int64_t>("w1", "add", int64_t{1}, int64_t{2});
  auto g = f.then([](Future<int64_t> r) { return r.value() * 100; });
  EXPECT_EQ(f.value(), 3);
  EXPECT_EQ(g.value(), 300);
  EXPECT_TRUE(f.done());
  EXPECT_EQ(f.error(), nullptr);

  auto bad = a_[0]->rpc_async<int64_t>("w1", "throws", std::string("x"));
  EXPECT_THROW(bad.wait(), RemoteError);
  EXPECT_NE(bad.error(), nullptr);
  auto chained = bad.then([](Future<int64_t> r) { return r.value(); });
  EXPECT_THROW(chained.wait(), RemoteError);
}

TEST_P(RpcCall, RemoteExceptionCarriesMessageAndWorker) {
  try {
    a_[0]->rpc_sync<int64_t>("w1", "throws", std::string("kaput"));
    FAIL() << "expected RemoteError";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.worker(), "w1");
    EXPECT_EQ(e.remote_message(), "boom: kaput");
    EXPECT_NE(std::string(e.what()).find("'throws'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("w1"), std::string::npos) << e.what();
  }
}

TEST_P(RpcCall, UnknownFunctionAndSignatureMismatch) {
  try {
    a_[0]->rpc_sync<int64_t>("w1", "no_such_function", int64_t{1});
    FAIL();
  } catch (const RemoteError& e) {
    EXPECT_NE(e.remote_message().find("unknown function 'no_such_function'"), std::string::npos)
        << e.what();
  }
  try {
    a_[0]->rpc_sync<int64_t>("w1", "add", 1, 2);  // int32 arguments: "add" takes int64
    FAIL();
  } catch (const RemoteError& e) {
    EXPECT_NE(e.remote_message().find("int64(int64,int64)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("int64(int32,int32)"), std::string::npos) << e.what();
  }
  try {
    a_[0]->rpc_sync<double>("w1", "add", int64_t{1}, int64_t{2});  // wrong result type
    FAIL();
  } catch (const RemoteError& e) {
    EXPECT_NE(e.remote_message().find("registered here as"), std::string::npos) << e.what();
  }
  // The agent still serves.
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), 3);
}

TEST_P(RpcCall, BadTargetsAndArgumentsThrowAtTheCaller) {
  EXPECT_THROW(a_[0]->rpc_async<int64_t>("nobody", "add", int64_t{1}, int64_t{2}), InvalidArgument);
  EXPECT_THROW(a_[0]->rpc_async<int64_t>(5, "add", int64_t{1}, int64_t{2}), InvalidArgument);
  auto meta = torch::empty({2}, torch::TensorOptions().device(torch::kMeta));
  EXPECT_THROW(a_[0]->rpc_async<at::Tensor>("w1", "echo", meta), InvalidArgument);
}

TEST_P(RpcCall, PerCallTimeout) {
  auto f = a_[0]->rpc_async<int64_t>("w1", "sleep_ms", Timeout{50ms}, int64_t{1000});
  try {
    f.wait();
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("sleep_ms"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("w1"), std::string::npos) << e.what();
  }
  // Future::wait's own timeout leaves the call pending.
  auto g = a_[0]->rpc_async<int64_t>("w1", "sleep_ms", int64_t{300});
  EXPECT_THROW(g.wait(10ms), TimeoutError);
  EXPECT_EQ(g.value(), 300);
  // Timeout{0}: no limit.
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w1", "sleep_ms", Timeout{0ms}, int64_t{20}), 20);
}

// A call that completes leaves the timeout thread asleep until that call's deadline (the agents'
// default timeout, a minute away): a later call with a shorter timeout must wake it, and so must
// one made while a call with a longer timeout is pending. Were either not woken, the call would
// return its value after the sleep instead of failing.
TEST_P(RpcCall, AShorterTimeoutWakesTheTimeoutThread) {
  EXPECT_EQ(a_[0]->rpc_sync<int64_t>("w1", "add", int64_t{1}, int64_t{2}), 3);
  auto f = a_[0]->rpc_async<int64_t>("w1", "sleep_ms", Timeout{100ms}, int64_t{2000});
  EXPECT_THROW(f.wait(), TimeoutError);
  auto slow = a_[0]->rpc_async<int64_t>("w1", "sleep_ms", Timeout{30s}, int64_t{2000});
  auto g = a_[0]->rpc_async<int64_t>("w1", "sleep_ms", Timeout{100ms}, int64_t{2000});
  EXPECT_THROW(g.wait(), TimeoutError);
  EXPECT_EQ(slow.value(), 2000);
}

TEST_P(RpcCall, ManyOutstandingCallsFromSeveralThreads) {
  constexpr int kThreads = 4;
  constexpr int kCalls = 1500;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Future<int64_t>> fs;
      fs.reserve(kCalls);
      auto& agent = a_[t % 2];
      for (int i = 0; i < kCalls; ++i) {
        fs.push_back(
            agent->rpc_async<int64_t>(t % 2 == 0 ? "w1" : "w0", "add", int64_t{i}, int64_t{t}));
      }
      for (int i = 0; i < kCalls; ++i) {
        if (fs[i].value() != i + t) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(a_[0]->num_pending(), 0u);
}

// Conjugate and negative views travel as the values they show: as arguments and as results,
// small (inline) and large (the same-host fast path when on).
TEST_P(RpcCall, ConjugateAndNegativeViewsTravelAsTheirValues) {
  static std::once_flag once;
  std::call_once(once, [] {
    register_function("conj_view", [](at::Tensor t) { return t.conj(); });
    register_function("neg_view", [](at::Tensor t) { return t._neg_view(); });
  });
  for (int64_t n : {int64_t{6}, int64_t{1} << 19}) {
    auto z = torch::complex(torch::arange(n, torch::kDouble), torch::arange(n, torch::kDouble) + 1)
                 .to(torch::kComplexFloat);
    auto want = z.conj().resolve_conj();
    auto echoed = a_[0]->rpc_sync<at::Tensor>("w1", "echo", z.conj());
    EXPECT_TRUE(torch::equal(echoed.resolve_conj(), want)) << "argument, n=" << n;
    auto returned = a_[0]->rpc_sync<at::Tensor>("w1", "conj_view", z);
    EXPECT_TRUE(torch::equal(returned.resolve_conj(), want)) << "result, n=" << n;
    auto f = torch::arange(n, torch::kFloat);
    auto negated = a_[0]->rpc_sync<at::Tensor>("w1", "neg_view", f);
    EXPECT_TRUE(torch::equal(negated.resolve_neg(), -f)) << "negative result, n=" << n;
    auto in_vector = a_[0]->rpc_sync<std::vector<at::Tensor>>(
        "w1", "echo_tensors", std::vector<at::Tensor>{z.conj(), f._neg_view()});
    ASSERT_EQ(in_vector.size(), 2u);
    EXPECT_TRUE(torch::equal(in_vector[0].resolve_conj(), want)) << "vector, n=" << n;
    EXPECT_TRUE(torch::equal(in_vector[1].resolve_neg(), -f)) << "vector, n=" << n;
  }
}

INSTANTIATE_TEST_SUITE_P(FastPath, RpcCall, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "SameHost" : "SocketOnly"; });

TEST(RpcNested, ThreeWorkersChainAndCycle) {
  auto a = start_agents(3);
  // A -> B -> C.
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "relay", std::string("w2"), int64_t{4}), 50);
  // A -> B -> C -> A -> B: each hop holds a worker thread of its callee while it waits.
  EXPECT_EQ(a[0]->rpc_sync<int64_t>("w1", "relay_chain", std::vector<std::string>{"w2", "w0", "w1"},
                                    int64_t{0}),
            3);
  shutdown_all(a);
}

TEST(RpcApi, InitRpcAndFreeFunctionsPerThread) {
  register_test_functions();
  auto store = std::make_shared<HashStore>(30000ms);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        RpcOptions o;
        o.store = store;
        init_rpc(r == 0 ? "trainer" : "ps", r, 2, o);
        if (get_worker_info().rank != r) throw std::runtime_error("wrong self");
        if (get_worker_info("ps").rank != 1 || get_worker_info(0).name != "trainer") {
          throw std::runtime_error("wrong worker info");
        }
        if (r == 0) {
          if (rpc_sync<int64_t>("ps", "add", int64_t{20}, int64_t{22}) != 42) {
            throw std::runtime_error("wrong sum");
          }
          if (rpc_async<std::string>(1, "whoami").value() != "ps") {
            throw std::runtime_error("wrong callee");
          }
          auto c = remote<Counter>("ps", "Counter", int64_t{5});
          if (c.rpc_sync<int64_t>("add", int64_t{1}) != 6) throw std::runtime_error("counter");
        }
        shutdown();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  // Both agents are gone: the free functions say so.
  EXPECT_THROW(current_agent(), Error);
}

}  // namespace
}  // namespace tdist::rpc::test
