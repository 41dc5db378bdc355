#pragma once
// The programs the apps tests start; CMake gives their paths (tests/apps/CMakeLists.txt).
#include <string>

namespace tdist::test {

inline const std::string kRun = TDIST_RUN_BIN;
inline const std::string kTrain = TDIST_TRAIN_BIN;

}  // namespace tdist::test
