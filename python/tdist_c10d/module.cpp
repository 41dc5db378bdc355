// The Python module `tdist_c10d`: importing it registers tdist as the torch.distributed backend
// "tdist" (for CPU and CUDA tensors, CUDA staged through host memory), so that
//
//   import torch.distributed as dist, tdist_c10d
//   dist.init_process_group("tdist", ...)            # or "cpu:tdist,cuda:nccl"
//
// runs torch.distributed's collectives on tdist. See docs/pytorch.md.

#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include <utility>

#include "tdist/core/cpu_memory.h"
#include "tdist/python/tdist_c10d/backend.h"

namespace py = pybind11;

namespace tdist::c10d_backend {
namespace {

// The holder for backend objects in Python. It owns one reference, like c10::intrusive_ptr, and
// gives it up without the GIL: the last reference may go from Python (the ProcessGroup being
// collected), and destroying the tdist group closes connections and joins its threads. Its shape
// (one intrusive pointer) is that of the holder torch's bindings give c10d.Backend, which a
// subclass registered with pybind11 must share.
template <typename T>
class GilFreeReleasePtr {
 public:
  GilFreeReleasePtr() = default;
  // pybind11 builds holders from raw pointers to objects that already have owners (`true` in
  // PYBIND11_DECLARE_HOLDER_TYPE below): take a new reference.
  explicit GilFreeReleasePtr(T* raw)
      : ptr_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(raw)) {}
  GilFreeReleasePtr(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}  // NOLINT: implicit
  GilFreeReleasePtr(const GilFreeReleasePtr&) = default;
  GilFreeReleasePtr(GilFreeReleasePtr&&) noexcept = default;
  GilFreeReleasePtr& operator=(const GilFreeReleasePtr&) = default;
  GilFreeReleasePtr& operator=(GilFreeReleasePtr&&) noexcept = default;
  ~GilFreeReleasePtr() {
    if (ptr_ && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      ptr_.reset();
    }
  }

  T* get() const { return ptr_.get(); }
  T& operator*() const { return *ptr_; }
  T* operator->() const { return ptr_.get(); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

}  // namespace
}  // namespace tdist::c10d_backend

PYBIND11_DECLARE_HOLDER_TYPE(T, tdist::c10d_backend::GilFreeReleasePtr<T>, true)

namespace tdist::c10d_backend {
namespace {

using BackendPtr = GilFreeReleasePtr<TdistBackend>;

// The creator torch.distributed calls with extended_api=True: (c10d's DistributedBackendOptions,
// the backend options given to init_process_group / new_group, or None).
BackendPtr create_backend(const ::c10d::DistributedBackendOptions& opts,
                          const py::object& backend_options) {
  if (!backend_options.is_none()) {
    throw py::value_error(
        "tdist: the tdist backend takes no backend options (pg_options / backend_options); "
        "pass timeout=... to init_process_group or new_group instead");
  }
  c10::intrusive_ptr<::c10d::Backend> backend;
  {
    // The rendezvous blocks, and the store may be implemented in Python.
    py::gil_scoped_release no_gil;
    backend = TdistBackend::create(opts);
  }
  return BackendPtr(c10::static_intrusive_pointer_cast<TdistBackend>(std::move(backend)));
}

}  // namespace
}  // namespace tdist::c10d_backend

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tdist::c10d_backend;
  m.doc() =
      "tdist as a torch.distributed backend. Importing this module registers the backend "
      "\"tdist\" for CPU and CUDA tensors: dist.init_process_group(\"tdist\", ...), "
      "dist.new_group(backend=\"tdist\"), or per device: \"cpu:tdist,cuda:nccl\".";

  auto dist = py::module_::import("torch.distributed");
  if (!dist.attr("is_available")().cast<bool>()) {
    throw py::import_error("tdist_c10d: this torch was built without torch.distributed");
  }
  // Loads torch._C._distributed_c10d, which registers c10d.Backend with pybind11.
  py::module_::import("torch._C._distributed_c10d");

  py::class_<TdistBackend, ::c10d::Backend, GilFreeReleasePtr<TdistBackend>>(
      m, "TdistBackend",
      "The c10d backend object of a group that runs on tdist (see "
      "ProcessGroup._get_backend(torch.device(\"cpu\"))).")
      .def_property_readonly(
          "group_timeout", [](TdistBackend& self) { return self.getBackendOptions()->timeout; },
          "Timeout of the group's operations (a datetime.timedelta).")
      .def(
          "set_timeout",
          [](TdistBackend& self, std::chrono::milliseconds timeout) { self.setTimeout(timeout); },
          py::arg("timeout"),
          "Sets the timeout of the group's later operations (a positive datetime.timedelta).");

  m.def("_create_backend", &create_backend, py::arg("dist_backend_opts"),
        py::arg("backend_options"),
        "The creator torch.distributed calls for backend \"tdist\" (extended API).");
  m.attr("BACKEND_NAME") = kBackendName;

  // The counting CPU allocator of core/cpu_memory.h, so that a Python program's CPU tensors are
  // measured as tdist-train measures its own (tdist-bench fsdp compares the two).
  m.def("track_cpu_memory", &tdist::track_cpu_memory,
        "Counts CPU tensors' bytes from now on (wraps libtorch's CPU allocator; once per "
        "process).");
  m.def(
      "cpu_memory_stats",
      [] {
        const tdist::CpuMemoryStats s = tdist::cpu_memory_stats();
        py::dict d;
        d["allocated_bytes"] = s.allocated_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["allocations"] = s.allocations;
        d["tracked"] = tdist::cpu_memory_tracked();
        return d;
      },
      "Bytes of counted CPU tensors held now (allocated_bytes) and at most at once (peak_bytes).");
  m.def("reset_peak_cpu_memory", &tdist::reset_peak_cpu_memory,
        "Sets the peak to what is held now.");

  py::list devices;
  devices.append("cpu");
  devices.append("cuda");  // staged through host memory (Note [Staging device tensors])
  dist.attr("Backend").attr("register_backend")(kBackendName, m.attr("_create_backend"),
                                                py::arg("extended_api") = true,
                                                py::arg("devices") = devices);

  // The wheel (pyproject.toml) names this in torch's "torch.backends" entry point group, which
  // `import torch` loads and calls: loading the module registered the backend above, so a
  // script need not import tdist_c10d. TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns that off.
  m.def(
      "_autoload", [] {},
      "Called by `import torch` through the torch.backends entry point of the installed wheel; "
      "importing this module has registered \"tdist\" already.");
}
