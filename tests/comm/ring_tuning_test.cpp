// The ring backend's tunables (comm/ring/ring_tuning.h): an Options field wins over its
// environment variable, which wins over the default; a bad value of either is a clear error
// naming it; and a group built with the fields uses them.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm/ring/ring_process_group.h"
#include "tdist/comm/ring/ring_tuning.h"
#include "tests/comm/comm_test_util.h"

namespace tdist::comm {
namespace {

using detail::resolve_ring_tuning;
using Tuning = ProcessGroup::Options::RingTuning;

// No ring variable set, whatever the test runner's environment holds.
tdist::test::EnvVars no_ring_variables() {
  tdist::test::EnvVars vars;
  for (const char* v :
       {"TDIST_CHUNK_BYTES", "TDIST_SMALL_ALLREDUCE_BYTES", "TDIST_ALLREDUCE_ALGO",
        "TDIST_ALLGATHER_ALGO", "TDIST_WINDOW_BYTES", "TDIST_STAGING_PIECE_BYTES", "TDIST_DEBUG",
        "TDIST_RUN_ON_WAITER", "TDIST_TRANSPORT", "TDIST_SHM_BYTES", "TDIST_SPIN_US",
        "TDIST_BUSY_POLL_NS", "TDIST_SHM_FUTEX", "TDIST_SINGLE_COPY", "TDIST_SINGLE_COPY_BYTES"}) {
    vars[v] = std::nullopt;
  }
  return vars;
}

TEST(RingTuning, DefaultsWhenNeitherFieldNorVariableIsSet) {
  tdist::test::EnvGuard env(no_ring_variables());
  const auto v = resolve_ring_tuning(Tuning{});
  EXPECT_EQ(v.chunk_bytes, size_t{256} << 10);
  EXPECT_EQ(v.small_allreduce_bytes, size_t{64} << 10);
  EXPECT_EQ(v.allreduce_algo, detail::AllreduceChoice::kAuto);
  EXPECT_EQ(v.window_bytes, size_t{64} << 20);
  EXPECT_EQ(v.staging_piece_bytes, size_t{1} << 20);
  EXPECT_FALSE(v.debug_detail);
  EXPECT_TRUE(v.shared_memory);
  EXPECT_FALSE(v.spin_us.has_value());  // chosen from the channels later
  EXPECT_FALSE(v.busy_poll_ns.has_value());
  EXPECT_TRUE(v.single_copy);
}

TEST(RingTuning, TheVariableFillsAnUnsetFieldAndASetFieldWins) {
  auto vars = no_ring_variables();
  vars["TDIST_CHUNK_BYTES"] = "4096";
  vars["TDIST_TRANSPORT"] = "tcp";
  vars["TDIST_SPIN_US"] = "0";
  vars["TDIST_ALLREDUCE_ALGO"] = "ring";
  vars["TDIST_DEBUG"] = "DETAIL";
  tdist::test::EnvGuard env(vars);
  auto v = resolve_ring_tuning(Tuning{});
  EXPECT_EQ(v.chunk_bytes, 4096u);
  EXPECT_FALSE(v.shared_memory);
  EXPECT_EQ(v.spin_us, 0);
  EXPECT_EQ(v.allreduce_algo, detail::AllreduceChoice::kRing);
  EXPECT_TRUE(v.debug_detail);

  Tuning set;
  set.chunk_bytes = 8192;
  set.shared_memory = true;
  set.spin_us = 7;
  set.allreduce_algo = "recursive_doubling";
  set.debug_detail = false;
  v = resolve_ring_tuning(set);
  EXPECT_EQ(v.chunk_bytes, 8192u);
  EXPECT_TRUE(v.shared_memory);
  EXPECT_EQ(v.spin_us, 7);
  EXPECT_EQ(v.allreduce_algo, detail::AllreduceChoice::kRecursiveDoubling);
  EXPECT_FALSE(v.debug_detail);
}

TEST(RingTuning, EachAllreduceAlgorithmNameParsesToItsChoice) {
  using detail::AllreduceChoice;
  tdist::test::EnvGuard env(no_ring_variables());
  const std::pair<const char*, AllreduceChoice> names[] = {
      {"auto", AllreduceChoice::kAuto},
      {"ring", AllreduceChoice::kRing},
      {"recursive_doubling", AllreduceChoice::kRecursiveDoubling},
      {"halving_doubling", AllreduceChoice::kHalvingDoubling},
      {"hierarchical", AllreduceChoice::kHierarchical},
      {"single_copy", AllreduceChoice::kSingleCopy}};
  for (const auto& [name, choice] : names) {
    Tuning set;
    set.allreduce_algo = name;
    EXPECT_EQ(resolve_ring_tuning(set).allreduce_algo, choice) << name;
  }
  Tuning set;
  set.allreduce_algo = "Ring";  // names are exact
  EXPECT_THROW(resolve_ring_tuning(set), InvalidArgument);
}

TEST(RingTuning, EachAllgatherAlgorithmNameParsesToItsChoice) {
  using detail::AllgatherChoice;
  tdist::test::EnvGuard env(no_ring_variables());
  EXPECT_EQ(resolve_ring_tuning(Tuning{}).allgather_algo, AllgatherChoice::kAuto);
  const std::pair<const char*, AllgatherChoice> names[] = {
      {"auto", AllgatherChoice::kAuto},
      {"ring", AllgatherChoice::kRing},
      {"single_copy", AllgatherChoice::kSingleCopy}};
  for (const auto& [name, choice] : names) {
    Tuning set;
    set.allgather_algo = name;
    EXPECT_EQ(resolve_ring_tuning(set).allgather_algo, choice) << name;
    tdist::test::EnvGuard var(tdist::test::EnvVars{{"TDIST_ALLGATHER_ALGO", name}});
    EXPECT_EQ(resolve_ring_tuning(Tuning{}).allgather_algo, choice) << name;
  }
  // The group takes the largest of its ranks' choices (agree_group_values): the ring wins over
  // auto, and auto over single copy.
  EXPECT_LT(AllgatherChoice::kSingleCopy, AllgatherChoice::kAuto);
  EXPECT_LT(AllgatherChoice::kAuto, AllgatherChoice::kRing);
}

void expect_invalid(const Tuning& set, const std::string& names) {
  try {
    resolve_ring_tuning(set);
    ADD_FAILURE() << "accepted; expected an error naming " << names;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
  }
}

TEST(RingTuning, BadValuesNameTheFieldOrTheVariable) {
  auto vars = no_ring_variables();
  {
    Tuning set;
    set.chunk_bytes = 0;
    expect_invalid(set, "ring.chunk_bytes");
    set = Tuning{};
    set.allreduce_algo = "tree";
    expect_invalid(set, "ring.allreduce_algo='tree'");
    set = Tuning{};
    set.allgather_algo = "Ring";  // names are exact; the error lists them
    expect_invalid(set, "ring.allgather_algo='Ring' is not one of auto, ring, single_copy");
    set = Tuning{};
    set.shm_bytes = 16;
    expect_invalid(set, "ring.shm_bytes");
    set = Tuning{};
    set.spin_us = -1;
    expect_invalid(set, "ring.spin_us");
  }
  for (const auto& [var, value] :
       std::vector<std::pair<std::string, std::string>>{{"TDIST_CHUNK_BYTES", "0"},
                                                        {"TDIST_TRANSPORT", "udp"},
                                                        {"TDIST_ALLREDUCE_ALGO", "tree"},
                                                        {"TDIST_ALLGATHER_ALGO", "direct"},
                                                        {"TDIST_WINDOW_BYTES", "lots"}}) {
    auto bad = vars;
    bad[var] = value;
    tdist::test::EnvGuard env(bad);
    expect_invalid(Tuning{}, var);
  }
  // A field that is set is used even when its variable is bad: the variable is never read.
  auto bad = vars;
  bad["TDIST_CHUNK_BYTES"] = "0";
  tdist::test::EnvGuard env(bad);
  Tuning set;
  set.chunk_bytes = 1024;
  EXPECT_EQ(resolve_ring_tuning(set).chunk_bytes, 1024u);
}

TEST(RingTuning, AGroupUsesItsFields) {
  tdist::test::EnvGuard env(no_ring_variables());
  tdist::test::spawn(2, [&](int rank, std::shared_ptr<Store> store) {
    auto opts = test::test_options();
    opts.ring.window_bytes = 4096;
    opts.ring.chunk_bytes = 64;
    opts.ring.shared_memory = false;
    auto pg = create_process_group(store, rank, 2, opts);
    auto* ring = dynamic_cast<detail::RingProcessGroup*>(pg.get());
    ASSERT_NE(ring, nullptr);
    EXPECT_EQ(ring->window_bytes(), 4096u);
    auto x = torch::full({3000}, static_cast<float>(rank + 1));  // several windows and chunks
    pg->allreduce(x)->wait();
    EXPECT_TRUE(torch::equal(x, torch::full({3000}, 3.0f)));
  });
}

}  // namespace
}  // namespace tdist::comm
