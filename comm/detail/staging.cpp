#include "tdist/comm/detail/staging.h"

#include <ATen/ATen.h>

#include "tdist/core/error.h"
#include "tdist/core/tensor_wire.h"

namespace tdist::comm::detail {

void check_stageable(const at::Tensor& t, const char* op, const char* what) {
  TDIST_CHECK_ARG(t.defined(), op, ": ", what, " is undefined");
  TDIST_CHECK_ARG(t.device().is_cpu() || t.device().is_cuda(), op, ": ", what, " is a ",
                  t.device().str(), " tensor; the ring backend serves CPU and CUDA tensors");
  TDIST_CHECK_ARG(t.layout() == c10::kStrided, op, ": ", what, " is sparse; only dense tensors "
                  "are supported");
}

at::Tensor host_values(const at::Tensor& t) {
  if (t.device().is_cpu()) return contiguous_values(t);
  at::Tensor values = contiguous_values(t);  // resolved on the device
  at::Tensor host = at::empty(values.sizes(), values.options()
                                                  .device(at::kCPU)
                                                  .pinned_memory(values.device().is_cuda()));
  host.copy_(values);
  return host;
}

}  // namespace tdist::comm::detail
