#include "apps/common/device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>
#include <torch/cuda.h>

#include "tdist/core/env.h"
#include "tdist/core/error.h"

namespace tdist::apps {
namespace {

// dlopen's error for libtorch_cuda, or "" once it is loaded.
const std::string& load_torch_cuda() {
  static const std::string error = [] {
    // The name first (the executable's run path holds libtorch's directory), then the file
    // CMake found beside the libtorch this build uses (cmake/TdistTorch.cmake).
    std::string err;
    for (const char* path : {
             "libtorch_cuda.so",
#ifdef TDIST_TORCH_CUDA_LIBRARY
             TDIST_TORCH_CUDA_LIBRARY,
#endif
         }) {
      if (::dlopen(path, RTLD_NOW | RTLD_GLOBAL) != nullptr) return std::string();
      const char* e = ::dlerror();
      err = e ? e : "dlopen failed";
    }
    return err;
  }();
  return error;
}

int local_rank() {
  if (env::has_dist_env()) return env::read_dist_env().local_rank;
  return static_cast<int>(env::get_int("LOCAL_RANK", 0, 0, 1 << 20));
}

}  // namespace

bool cuda_available(std::string* why) {
  const std::string& load_error = load_torch_cuda();
  if (!load_error.empty()) {
    if (why)
      *why = "this libtorch has no CUDA (libtorch_cuda could not be loaded: " + load_error + ")";
    return false;
  }
  if (torch::cuda::is_available()) return true;
  if (why) {
    const auto visible = env::get("CUDA_VISIBLE_DEVICES");
    *why = "no GPU is visible (torch::cuda::is_available() is false" +
           (visible ? "; CUDA_VISIBLE_DEVICES='" + *visible + "'" : std::string()) + ")";
  }
  return false;
}

c10::Device resolve_device(const std::string& flag, const std::string& choice, bool share_gpus) {
  TDIST_CHECK_ARG(choice == "cpu" || choice == "cuda" || choice == "auto", flag,
                  " must be cpu, cuda or auto (got '", choice, "')");
  if (choice == "cpu") return c10::Device(c10::kCPU);
  std::string why;
  if (!cuda_available(&why)) {
    if (choice == "auto") return c10::Device(c10::kCPU);
    throw InvalidArgument(str(flag, " cuda: ", why, "; use ", flag, " cpu or ", flag, " auto"));
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  const int rank = share_gpus ? static_cast<int>(local_rank() % count) : local_rank();
  TDIST_CHECK_ARG(rank < count, flag, " ", choice, ": this process's local rank is ", rank,
                  " but only ", count, " GPU(s) are visible (one GPU per process on a host)");
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
  // The current device too, so that nothing of this process (CUDA's context, libraries that use
  // the current device) lands on GPU 0.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  return device;
}

}  // namespace tdist::apps
