#include <cstdlib>

#include "tdist/comm/algorithms/context.h"
#include "tdist/core/error.h"

namespace tdist::comm::algorithms {

char* Scratch::get(size_t bytes) {
  if (bytes > capacity_) {
    size_t cap = (bytes + 63) / 64 * 64;
    char* p = static_cast<char*>(std::aligned_alloc(64, cap));
    if (p == nullptr) TDIST_THROW(Error, "cannot allocate ", cap, " bytes of scratch memory");
    data_.reset(p);
    capacity_ = cap;
  }
  return data_.get();
}

}  // namespace tdist::comm::algorithms
