# Read by ctest when it starts (a TEST_INCLUDE_FILES script that tdist_add_test writes for each
# test binary's unit tier, tests/CMakeLists.txt): registers that tier's cases either one ctest
# entry per case (gtest_discover_tests' list, the default: `ctest -R <Case>` finds a case) or,
# when TDIST_TEST_SHARD_CASES=N is in the environment (scripts/test.sh sets it), as GoogleTest
# shards of about N cases each, so that a process start (about 0.25 s of CPU, mostly loading
# libtorch) is paid per shard rather than per case. A shard is named <binary>.unit/<i>of<n>; each
# case in it keeps its own time limit (TDIST_TEST_CASE_TIMEOUT, Note [Case time limit] in
# tests/harness/case_time_limit.h) and the shard's TIMEOUT, three case limits, is the backstop.
#
# Set by the including script: exe (the test binary), per_case (gtest_discover_tests' include
# file), filter (the tier's GoogleTest filter), name (the target), dir (its working directory),
# timeout (a case's limit in seconds), count_file (where the case count is kept).
set(cases_per_shard "$ENV{TDIST_TEST_SHARD_CASES}")
if(cases_per_shard STREQUAL "" OR cases_per_shard STREQUAL "0")
  include("${per_case}")
  return()
endif()
if(NOT cases_per_shard MATCHES "^[0-9]+$")
  message(FATAL_ERROR "TDIST_TEST_SHARD_CASES must be a number of cases, not '${cases_per_shard}'")
endif()
if(NOT EXISTS "${exe}")
  add_test(${name}_NOT_BUILT ${name}_NOT_BUILT)
  return()
endif()

# The tier's case count, listed again only when the binary changed.
if(NOT EXISTS "${count_file}" OR NOT "${count_file}" IS_NEWER_THAN "${exe}")
  execute_process(COMMAND "${exe}" --gtest_list_tests "--gtest_filter=${filter}"
                  WORKING_DIRECTORY "${dir}" TIMEOUT 60
                  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "listing the cases of ${exe} failed (${rc}):\n${listing}${errors}")
  endif()
  # A case's line starts with two spaces, its suite's line with none.
  string(REGEX MATCHALL "\n  [^\n]+" cases "\n${listing}")
  list(LENGTH cases count)
  file(WRITE "${count_file}" "${count}")
endif()
file(READ "${count_file}" count)
if(count EQUAL 0)
  return()
endif()

math(EXPR shards "(${count} + ${cases_per_shard} - 1) / ${cases_per_shard}")
math(EXPR shard_timeout "3 * ${timeout}")
math(EXPR last "${shards} - 1")
foreach(index RANGE ${last})
  math(EXPR number "${index} + 1")
  set(test "${name}.unit/${number}of${shards}")
  add_test("${test}" "${exe}" "--gtest_filter=${filter}")
  set_tests_properties("${test}" PROPERTIES
    WORKING_DIRECTORY "${dir}" LABELS unit PROCESSORS 1 TIMEOUT ${shard_timeout}
    ENVIRONMENT "OMP_NUM_THREADS=1;GTEST_SHARD_INDEX=${index};GTEST_TOTAL_SHARDS=${shards};TDIST_TEST_CASE_TIMEOUT=${timeout}")
endforeach()
