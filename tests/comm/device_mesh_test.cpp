// DeviceMesh: coordinates and subgroups of a world laid out in named dimensions (Note [Device
// mesh layout] in comm/device_mesh.h), with ranks as threads over a TCPStore server the test
// starts; each subgroup is checked by a collective (its sum names exactly its members).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <iostream>
#include <thread>

#include "tdist/comm/device_mesh.h"
#include "tdist/core/tcp_store.h"
#include "tests/comm/comm_test_util.h"
#include "tests/harness/expect.h"

namespace tdist::comm {
namespace {

using tdist::test::contains;

// Runs fn(rank, world group) on `world` threads, each a client of one TCPStore server.
void with_world(int world, Millis timeout,
                const std::function<void(int, std::shared_ptr<ProcessGroup>)>& fn) {
  auto server = std::make_shared<TCPStore>("127.0.0.1", 0, /*is_server=*/true, Millis(30000));
  const uint16_t port = server->port();
  tdist::test::spawn(world, [&](int rank, std::shared_ptr<Store>) {
    auto store = std::make_shared<TCPStore>("127.0.0.1", port, false, Millis(30000));
    fn(rank, create_process_group(store, rank, world, test::test_options(timeout)));
  });
}

// Checks this rank's place in `mesh` against the row-major layout, and each of its groups by an
// allreduce of the members' world ranks.
void expect_layout(const DeviceMesh& mesh, int rank) {
  std::vector<int> want(mesh.ndim());
  int rest = rank;
  for (int d = mesh.ndim() - 1; d >= 0; --d) {
    want[d] = rest % mesh.dims()[d].size;
    rest /= mesh.dims()[d].size;
  }
  EXPECT_EQ(mesh.coordinates(), want) << "rank " << rank;
  EXPECT_EQ(mesh.rank_of(want), rank);
  EXPECT_EQ(mesh.coordinates_of(rank), want);
  for (int d = 0; d < mesh.ndim(); ++d) {
    const auto& dim = mesh.dims()[d];
    const auto& group = mesh.group(dim.name);
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group, mesh.group(d));
    EXPECT_EQ(group->size(), dim.size) << dim.name;
    EXPECT_EQ(group->rank(), mesh.coordinate(dim.name)) << dim.name;
    const std::vector<int> members = mesh.group_ranks(dim.name);
    ASSERT_EQ(static_cast<int>(members.size()), dim.size);
    EXPECT_EQ(members[group->rank()], rank) << dim.name;
    double sum = 0;
    for (size_t k = 0; k < members.size(); ++k) {
      std::vector<int> c = want;
      c[d] = static_cast<int>(k);
      EXPECT_EQ(members[k], mesh.rank_of(c)) << dim.name;
      sum += members[k];
    }
    auto t = torch::full({3}, double(rank));
    group->allreduce(t)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({3}, sum))) << dim.name << " rank " << rank;
  }
}

TEST(DeviceMesh, ReplicateByShardAtWorld4) {
  with_world(4, Millis(30000), [](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh mesh(world, {{"replicate", 2}, {"shard", 2}});
    EXPECT_EQ(mesh.ndim(), 2);
    EXPECT_EQ(mesh.size(), 4);
    EXPECT_EQ(mesh.rank(), rank);
    EXPECT_EQ(mesh.size("shard"), 2);
    // Note [Device mesh layout]: the last dimension varies fastest.
    EXPECT_EQ(mesh.coordinate("replicate"), rank / 2);
    EXPECT_EQ(mesh.coordinate("shard"), rank % 2);
    EXPECT_EQ(mesh.group_ranks("shard"), (std::vector<int>{rank / 2 * 2, rank / 2 * 2 + 1}));
    EXPECT_EQ(mesh.group_ranks("replicate"), (std::vector<int>{rank % 2, rank % 2 + 2}));
    expect_layout(mesh, rank);
    // The world group still works beside its subgroups.
    auto t = torch::ones({2});
    world->allreduce(t)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({2}, 4.0)));
  });
}

TEST(DeviceMesh, PipelineByDataAndOtherShapesAtWorld4) {
  with_world(4, Millis(30000), [](int rank, std::shared_ptr<ProcessGroup> world) {
    DeviceMesh pp_dp(world, {{"pp", 2}, {"dp", 2}});
    EXPECT_EQ(pp_dp.coordinate("pp"), rank / 2);
    expect_layout(pp_dp, rank);
    DeviceMesh flat(world, {{"dp", 4}});
    EXPECT_EQ(flat.group_ranks("dp"), (std::vector<int>{0, 1, 2, 3}));
    expect_layout(flat, rank);
    DeviceMesh three(world, {{"pp", 2}, {"tp", 1}, {"dp", 2}});
    EXPECT_EQ(three.group("tp")->size(), 1);
    expect_layout(three, rank);
    DeviceMesh columns(world, {{"a", 1}, {"b", 4}});
    expect_layout(columns, rank);
  });
}

template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), needle)) << e.what();
  }
}

// Bad dimensions fail on every rank before any group is created, so the world is unchanged: a
// good mesh made afterwards works.
TEST(DeviceMesh, BadDimensionsAtWorld3) {
  with_world(3, Millis(30000), [](int rank, std::shared_ptr<ProcessGroup> world) {
    using Dims = std::vector<DeviceMesh::Dim>;
    expect_invalid(
        [&] {
          DeviceMesh(world, Dims{{"replicate", 2}, {"shard", 2}});
        },
        "the sizes of {\"replicate\": 2, \"shard\": 2} multiply to 4, not to the "
        "world size 3");
    expect_invalid(
        [&] {
          DeviceMesh(world, Dims{{"dp", 2}});
        },
        "multiply to 2, not to the "
        "world size 3");
    expect_invalid(
        [&] {
          DeviceMesh(world, Dims{{"a", 3}, {"a", 1}});
        },
        "dimension \"a\" is named twice");
    expect_invalid(
        [&] {
          DeviceMesh(world, Dims{{"a", 3}, {"b", 0}});
        },
        "dimension \"b\" has size 0");
    expect_invalid([&] { DeviceMesh(world, Dims{{"", 3}}); }, "a dimension has an empty name");
    expect_invalid([&] { DeviceMesh(world, Dims{}); }, "no dimensions");
    expect_invalid([&] { DeviceMesh(nullptr, Dims{{"dp", 3}}); }, "world process group is null");

    DeviceMesh mesh(world, {{"dp", 3}});
    expect_layout(mesh, rank);
    expect_invalid([&] { mesh.group("shard"); }, "no dimension \"shard\"; the mesh is {\"dp\": 3}");
    expect_invalid([&] { mesh.coordinate("replicate"); }, "no dimension \"replicate\"");
    expect_invalid([&] { mesh.group(1); }, "dimension 1 is not in [0, 1)");
    expect_invalid([&] { mesh.rank_of({3}); }, "coordinate 3 of \"dp\" is not in [0, 3)");
    expect_invalid([&] { mesh.rank_of({0, 0}); }, "2 coordinates for a mesh of 1 dimensions");
    EXPECT_FALSE(mesh.has_dim("shard"));
    EXPECT_TRUE(mesh.has_dim("dp"));
  });
}

// A rank that never builds the mesh: the others' construction fails within the world's timeout
// naming it, instead of hanging.
TEST(DeviceMesh, MissingRankFailsConstructionWithinTheTimeout) {
  std::atomic<int> failed{0};
  with_world(3, Millis(1500), [&](int rank, std::shared_ptr<ProcessGroup> world) {
    if (rank == 2) {  // alive, but not taking part until both others have failed
      while (failed < 2) std::this_thread::sleep_for(Millis(10));
      return;
    }
    try {
      DeviceMesh mesh(world, {{"replicate", 1}, {"shard", 3}});
      ADD_FAILURE() << "rank " << rank << ": no error";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(contains(e.what(), "rank(s) 2 did not connect")) << e.what();
      std::cout << "rank " << rank << ": " << e.what() << "\n";
    }
    ++failed;
  });
}

}  // namespace
}  // namespace tdist::comm
