#pragma once
// The exact arithmetic of tdist-test-elastic-worker (elastic_worker.cpp), shared with the tests
// that predict its result: the parameters after a job whose world size followed a schedule.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tdist/core/hash.h"

namespace tdist::test {

inline constexpr int64_t kElasticParams = 4;
inline constexpr int64_t kElasticModulus = 1000000007;

// (from samples, world size) pairs in increasing order of samples.
using ElasticSchedule = std::vector<std::pair<int64_t, int>>;

// "0:3,30:2,60:3"
inline ElasticSchedule parse_schedule(const std::string& text) {
  ElasticSchedule s;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(pos, comma - pos);
    const size_t colon = item.find(':');
    if (colon == std::string::npos) throw std::invalid_argument("bad schedule item " + item);
    s.emplace_back(std::stoll(item.substr(0, colon)), std::stoi(item.substr(colon + 1)));
    pos = comma + 1;
  }
  return s;
}

inline int world_for(const ElasticSchedule& s, int64_t samples) {
  int w = s.empty() ? 1 : s.front().second;
  for (const auto& [from, world] : s)
    if (samples >= from) w = world;
  return w;
}

inline int64_t sample_gradient(int64_t index, int64_t j) {
  return (index * 1000003 + j * 7919 + index * index) % 65521;
}

// state = [samples, params...]; grad = the allreduced sum over the step's `world` samples.
inline void apply_step(int64_t* state, const int64_t* grad, int world) {
  for (int64_t j = 0; j < kElasticParams; ++j)
    state[1 + j] = (state[1 + j] * 31 + grad[j]) % kElasticModulus;
  state[0] += world;
}

inline uint64_t params_hash(const int64_t* state) {
  return fnv1a64(state + 1, kElasticParams * sizeof(int64_t));
}

// What the job ends with when every step runs on the schedule's world (one sample per rank).
inline uint64_t elastic_model(const ElasticSchedule& s, int64_t total) {
  int64_t state[1 + kElasticParams] = {};
  while (state[0] < total) {
    const int world = world_for(s, state[0]);
    int64_t grad[kElasticParams] = {};
    for (int r = 0; r < world; ++r)
      for (int64_t j = 0; j < kElasticParams; ++j) grad[j] += sample_gradient(state[0] + r, j);
    apply_step(state, grad, world);
  }
  return params_hash(state);
}

}  // namespace tdist::test
