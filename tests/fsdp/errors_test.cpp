// Bad input to fully_shard and misuse of a sharded model: clear errors, raised before any
// collective where the input is at fault.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/device_mesh.h"
#include "tdist/core/error.h"
#include "tests/fsdp/fsdp_test_util.h"

namespace tdist::test {
namespace {

// Runs fn on one rank with a group of one.
void with_group(const std::function<void(std::shared_ptr<comm::ProcessGroup>)>& fn) {
  spawn(1, [&](int rank, std::shared_ptr<Store> store) { fn(make_group(store, rank, 1)); });
}

// fn() throws InvalidArgument whose message contains `needle`.
template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(FSDPErrors, UnitThatIsNotASubmodule) {
  with_group([](auto pg) {
    Net net;
    torch::nn::Linear stranger(2, 2);
    expect_invalid(
        [&] {
          fsdp::fully_shard(net, {net->fc1.ptr(), stranger.ptr()}, pg);
        },
        "is not a submodule of the root module");
  });
}

TEST(FSDPErrors, RootListedAsAUnit) {
  with_group([](auto pg) {
    Net net;
    expect_invalid([&] { fsdp::fully_shard(net, {net.ptr()}, pg); }, "is the root module itself");
  });
}

TEST(FSDPErrors, UnitListedTwiceOrNull) {
  with_group([](auto pg) {
    Net net;
    expect_invalid(
        [&] {
          fsdp::fully_shard(net, {net->fc1.ptr(), net->fc1.ptr()}, pg);
        },
        "unit fc1 is listed twice");
    expect_invalid([&] { fsdp::fully_shard(net, {nullptr}, pg); }, "unit 0 is null");
    expect_invalid([&] { fsdp::fully_shard(net, {}, nullptr); }, "process group is null");
  });
}

TEST(FSDPErrors, UnitAlreadySharded) {
  with_group([](auto pg) {
    Net net;
    auto model = fsdp::fully_shard(net, {net->fc1.ptr()}, pg);
    Net other;
    other->fc1 = net->fc1;
    other->replace_module("fc1", net->fc1.ptr());
    expect_invalid([&] { fsdp::fully_shard(other, {net->fc1.ptr()}, pg); },
                   "already sharded by another FullyShardedModule");
  });
}

TEST(FSDPErrors, ParameterSharedByTwoUnits) {
  with_group([](auto pg) {
    auto root = std::make_shared<torch::nn::Module>();
    auto a = root->register_module("a", std::make_shared<torch::nn::Module>());
    auto b = root->register_module("b", std::make_shared<torch::nn::Module>());
    auto tied = torch::randn({3});
    a->register_parameter("w", tied);
    b->register_parameter("w", tied);
    expect_invalid(
        [&] {
          fsdp::fully_shard(root, {a, b}, pg);
        },
        "parameter b.w is shared by units a and b");
  });
}

// A tied embedding in the root and output layer in a unit: the unit would free the weight the
// root's embedding reads outside the unit's forward. Refused at fully_shard, naming both (kept
// both in the root, the tie is supported: FSDPParity.TiedEmbeddingAndOutput...).
TEST(FSDPErrors, ParameterSharedByTheRootAndAUnit) {
  with_group([](auto pg) {
    auto root = std::make_shared<torch::nn::Module>();
    auto emb = root->register_module("emb", torch::nn::Embedding(5, 3));
    auto head = root->register_module("head", std::make_shared<torch::nn::Module>());
    head->register_parameter("weight", emb->weight);
    expect_invalid([&] { fsdp::fully_shard(root, {head}, pg); },
                   "parameter emb.weight is shared by units head and (root)");
  });
}

// Inside an outer unit, a module of its own tied to an inner unit's parameter.
TEST(FSDPErrors, ParameterSharedByANestedUnitAndItsOuterUnit) {
  with_group([](auto pg) {
    auto root = std::make_shared<torch::nn::Module>();
    auto outer = root->register_module("outer", std::make_shared<torch::nn::Module>());
    auto inner = outer->register_module("inner", std::make_shared<torch::nn::Module>());
    auto own = outer->register_module("own", std::make_shared<torch::nn::Module>());
    auto tied = torch::randn({4}, torch::requires_grad());
    inner->register_parameter("w", tied);
    own->register_parameter("w", tied);
    expect_invalid(
        [&] {
          fsdp::fully_shard(root, {outer, inner}, pg);
        },
        "parameter outer.own.w is shared by units outer.inner and outer");
  });
}

TEST(FSDPErrors, FrozenParameter) {
  with_group([](auto pg) {
    Net net;
    net->fc3->bias.set_requires_grad(false);
    expect_invalid([&] { fsdp::fully_shard(net, units_of(net), pg); },
                   "parameter fc3.bias of unit fc3 must be a leaf that requires grad");
  });
}

TEST(FSDPErrors, BadHybridSharding) {
  with_group([](auto pg) {
    Net net;
    fsdp::FSDPOptions opts;
    opts.shard_size = 2;
    expect_invalid([&] { fsdp::fully_shard(net, units_of(net), pg, opts); },
                   "shard_size 2 does not divide the process group's size 1");
    opts.shard_size = -1;
    expect_invalid([&] { fsdp::fully_shard(net, units_of(net), pg, opts); },
                   "shard_size is -1; it must be positive");
    comm::DeviceMesh flat(pg, {{"dp", 1}});
    expect_invalid([&] { fsdp::fully_shard(net, units_of(net), flat); },
                   "the mesh has no \"shard\" dimension");
    comm::DeviceMesh mesh(pg, {{"replicate", 1}, {"shard", 1}});
    opts.shard_size = 2;
    expect_invalid([&] { fsdp::fully_shard(net, units_of(net), mesh, opts); },
                   "shard_size 2 contradicts the mesh's \"shard\" dimension of 1");
    // Nothing was sharded: the same model shards over the mesh.
    auto model = fsdp::fully_shard(net, units_of(net), mesh);
    EXPECT_EQ(model.replicate_group(), nullptr);  // one replica is none
    torch::optim::SGD opt(model.parameters(), 0.1);
    model(torch::randn({2, 6})).sum().backward();
    opt.step();
  });
}

// A model whose forward runs one unit twice.
struct TwiceImpl : torch::nn::Module {
  TwiceImpl() : fc(register_module("fc", torch::nn::Linear(3, 3))) {}
  torch::Tensor forward(torch::Tensor x) { return fsdp::call(fc, fsdp::call(fc, x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Twice);

TEST(FSDPErrors, UnitRunTwiceInOneForward) {
  with_group([](auto pg) {
    Twice net;
    auto model = fsdp::fully_shard(net, {net->fc.ptr()}, pg);
    try {
      model(torch::randn({2, 3}));
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("unit fc ran forward twice"), std::string::npos)
          << e.what();
    }
    // Without autograd there is no backward to keep apart: allowed.
    torch::NoGradGuard no_grad;
    EXPECT_EQ(model(torch::randn({2, 3})).sizes(), (std::vector<int64_t>{2, 3}));
  });
}

// Gradients of an older forward would be accumulated but never reduce-scattered: an error.
TEST(FSDPErrors, SecondBackwardThroughOneForward) {
  with_group([](auto pg) {
    Net net;
    auto model = fsdp::fully_shard(net, units_of(net), pg);
    auto loss = model(torch::randn({2, 6})).sum();
    loss.backward({}, /*retain_graph=*/true);
    try {
      loss.backward();
      ADD_FAILURE() << "no error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("whose forward is not part of this step"),
                std::string::npos)
          << e.what();
    }
    // The next step works.
    torch::optim::SGD opt(model.parameters(), 0.1);
    opt.zero_grad();
    model(torch::randn({2, 6})).sum().backward();
    opt.step();
    EXPECT_EQ(model.unsharded_bytes(), 0u);
  });
}

// A unit called directly (not through fsdp::call) has no values: libtorch's own shape error.
TEST(FSDPErrors, UnitCalledWithoutFsdpCallFails) {
  with_group([](auto pg) {
    Net net;
    auto model = fsdp::fully_shard(net, units_of(net), pg);
    EXPECT_ANY_THROW(net->fc1(torch::randn({2, 6})));
  });
}

}  // namespace
}  // namespace tdist::test
