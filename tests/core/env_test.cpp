#include <gtest/gtest.h>

#include "tdist/core/env.h"
#include "tdist/core/error.h"
#include "tests/harness/env_guard.h"
#include "tests/harness/expect.h"

namespace tdist {
namespace {

using test::EnvGuard;
using test::expect_invalid;
const std::nullopt_t unset = std::nullopt;

const std::map<std::string, std::optional<std::string>> kClean = {
    {"RANK", unset},
    {"WORLD_SIZE", unset},
    {"LOCAL_RANK", unset},
    {"LOCAL_WORLD_SIZE", unset},
    {"GROUP_RANK", unset},
    {"SLURM_PROCID", unset},
    {"SLURM_NTASKS", unset},
    {"SLURM_LOCALID", unset},
    {"SLURM_NTASKS_PER_NODE", unset},
    {"OMPI_COMM_WORLD_RANK", unset},
    {"OMPI_COMM_WORLD_SIZE", unset},
    {"OMPI_COMM_WORLD_LOCAL_RANK", unset},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", unset},
    {"MASTER_ADDR", unset},
    {"MASTER_PORT", unset},
    {"SLURM_STEP_NODELIST", unset},
    {"SLURM_JOB_NODELIST", unset},
    {"SLURM_JOB_ID", unset},
    {"SLURM_STEP_NUM_NODES", unset},
    {"SLURM_NODEID", unset}};

TEST(Env, ReadsTorchrunVariables) {
  EnvGuard clean(kClean);
  EnvGuard g({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  auto e = env::read_dist_env();
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.source, "env");
}

TEST(Env, RankOutOfRangeIsRejected) {
  EnvGuard clean(kClean);
  EnvGuard g({{"RANK", "5"}, {"WORLD_SIZE", "2"}});
  expect_invalid([] { env::read_dist_env(); }, {"RANK=5", "WORLD_SIZE=2"});
}

TEST(Env, NonNumericValuesAreRejected) {
  EnvGuard clean(kClean);
  {
    EnvGuard g({{"RANK", "one"}, {"WORLD_SIZE", "2"}});
    expect_invalid([] { env::read_dist_env(); }, {"RANK='one'", "not an integer"});
  }
  {
    EnvGuard g({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
    expect_invalid([] { env::read_dist_env(); }, {"WORLD_SIZE='0'"});
  }
  {
    EnvGuard g({{"MASTER_ADDR", "localhost"}, {"MASTER_PORT", "abc"}});
    expect_invalid([] { env::read_master_address(); }, {"MASTER_PORT='abc'", "65535"});
  }
  {
    EnvGuard g({{"MASTER_ADDR", "localhost"}, {"MASTER_PORT", "70000"}});
    expect_invalid([] { env::read_master_address(); }, {"MASTER_PORT='70000'"});
  }
}

TEST(Env, MissingVariablesAreNamed) {
  EnvGuard clean(kClean);
  expect_invalid([] { env::read_dist_env(); }, {"RANK is not set"});
  {
    EnvGuard g(test::EnvVars{{"RANK", "0"}});
    expect_invalid([] { env::read_dist_env(); }, {"WORLD_SIZE is not set"});
  }
  {
    EnvGuard g(test::EnvVars{{"MASTER_PORT", "29500"}});
    expect_invalid([] { env::read_master_address(); }, {"MASTER_ADDR is not set"});
  }
}

TEST(Env, FallsBackToSlurmThenOpenMpi) {
  EnvGuard clean(kClean);
  {
    EnvGuard g({{"SLURM_PROCID", "5"},
                {"SLURM_NTASKS", "8"},
                {"SLURM_LOCALID", "1"},
                {"SLURM_NTASKS_PER_NODE", "4(x2)"}});
    auto e = env::read_dist_env();
    EXPECT_EQ(e.source, "slurm");
    EXPECT_EQ(e.rank, 5);
    EXPECT_EQ(e.world_size, 8);
    EXPECT_EQ(e.local_rank, 1);
    EXPECT_EQ(e.local_world_size, 4);
    EXPECT_EQ(e.group_rank, 1);
  }
  {
    EnvGuard g({{"OMPI_COMM_WORLD_RANK", "1"},
                {"OMPI_COMM_WORLD_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
    auto e = env::read_dist_env();
    EXPECT_EQ(e.source, "openmpi");
    EXPECT_EQ(e.rank, 1);
    EXPECT_EQ(e.world_size, 2);
  }
  {
    EnvGuard g({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    expect_invalid([] { env::read_dist_env(); }, {"OMPI_COMM_WORLD_RANK=2"});
  }
}

TEST(Env, ExpandsSlurmNodeLists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(env::expand_slurm_nodelist("node[1-3,5]"), (V{"node1", "node2", "node3", "node5"}));
  EXPECT_EQ(env::expand_slurm_nodelist("gpu07,gpu08"), (V{"gpu07", "gpu08"}));
  EXPECT_EQ(env::expand_slurm_nodelist("rack[01-02]-ib,login"),
            (V{"rack01-ib", "rack02-ib", "login"}));
  EXPECT_EQ(env::expand_slurm_nodelist("n[08-10],m[9-11]"),
            (V{"n08", "n09", "n10", "m9", "m10", "m11"}));
  EXPECT_EQ(env::expand_slurm_nodelist("cn[003-004],x", 1), (V{"cn003"}));
  EXPECT_EQ(env::expand_slurm_nodelist("single"), (V{"single"}));
  expect_invalid([] { env::expand_slurm_nodelist("node[1-3"); }, {"node[1-3", "unclosed"});
  expect_invalid([] { env::expand_slurm_nodelist("node[3-1]"); }, {"backwards"});
  expect_invalid([] { env::expand_slurm_nodelist("node[a-b]"); }, {"'a-b'"});
  expect_invalid([] { env::expand_slurm_nodelist("a[1]b[2]"); }, {"more than one"});
  expect_invalid([] { env::expand_slurm_nodelist("a,,b"); }, {"empty name"});
  expect_invalid([] { env::expand_slurm_nodelist(""); }, {"no host"});
}

TEST(Env, MasterAddressFromSlurm) {
  EnvGuard clean(kClean);
  {
    EnvGuard g({{"SLURM_STEP_NODELIST", "cn[003-004]"},
                {"SLURM_JOB_NODELIST", "cn[001-004]"},
                {"SLURM_JOB_ID", "123456"}});
    auto m = env::read_master_address();
    EXPECT_EQ(m.host, "cn003") << "the step's first host";
    EXPECT_EQ(m.port, 20000 + 123456 % 20000);
  }
  {
    EnvGuard g(
        {{"SLURM_JOB_NODELIST", "cn[001-004]"}, {"SLURM_JOB_ID", "7"}, {"MASTER_PORT", "29500"}});
    auto m = env::read_master_address();
    EXPECT_EQ(m.host, "cn001") << "the job's first host when there is no step";
    EXPECT_EQ(m.port, 29500) << "MASTER_PORT wins over the derived port";
  }
  {
    EnvGuard g({{"SLURM_JOB_NODELIST", "cn1"}, {"SLURM_JOB_ID", "7"}, {"MASTER_ADDR", "10.0.0.9"}});
    EXPECT_EQ(env::read_master_address().host, "10.0.0.9") << "MASTER_ADDR wins";
  }
  {
    EnvGuard g(test::EnvVars{{"SLURM_JOB_NODELIST", "cn1"}});
    expect_invalid([] { env::read_master_address(); }, {"MASTER_PORT is not set"});
  }
}

TEST(Env, SlurmStepForOneLauncherPerNode) {
  EnvGuard clean(kClean);
  EXPECT_FALSE(env::read_slurm_step().has_value()) << "outside srun";
  EnvGuard g({{"SLURM_STEP_NUM_NODES", "3"},
              {"SLURM_NODEID", "2"},
              {"SLURM_STEP_NODELIST", "gpu[10-12]"},
              {"SLURM_JOB_ID", "42"}});
  auto s = env::read_slurm_step();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->num_nodes, 3);
  EXPECT_EQ(s->node_id, 2);
  EXPECT_EQ(s->first_host, "gpu10");
  EXPECT_EQ(s->port, 20042);
  EnvGuard bad(test::EnvVars{{"SLURM_NODEID", "3"}});
  expect_invalid([] { env::read_slurm_step(); }, {"SLURM_NODEID='3'"});
}

TEST(Env, Booleans) {
  EnvGuard g(test::EnvVars{{"TDIST_TEST_FLAG", "Yes"}});
  EXPECT_TRUE(env::get_bool("TDIST_TEST_FLAG", false));
  EnvGuard g2(test::EnvVars{{"TDIST_TEST_FLAG", "maybe"}});
  expect_invalid([] { env::get_bool("TDIST_TEST_FLAG", false); }, {"TDIST_TEST_FLAG='maybe'"});
  EnvGuard g3(test::EnvVars{{"TDIST_TEST_FLAG", unset}});
  EXPECT_FALSE(env::get_bool("TDIST_TEST_FLAG", false));
}

}  // namespace
}  // namespace tdist
