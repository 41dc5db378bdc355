#include "tdist/python/tdist_c10d/backend.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <utility>

#include "tdist/core/error.h"
#include "tdist/python/tdist_c10d/store_adapter.h"
#include "tdist/python/tdist_c10d/work.h"

namespace tdist::c10d_backend {
namespace {

using ::c10d::OpType;

comm::ReduceOp to_tdist(const ::c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case ::c10d::ReduceOp::SUM:
      return comm::ReduceOp::SUM;
    case ::c10d::ReduceOp::AVG:
      return comm::ReduceOp::AVG;
    case ::c10d::ReduceOp::PRODUCT:
      return comm::ReduceOp::PRODUCT;
    case ::c10d::ReduceOp::MIN:
      return comm::ReduceOp::MIN;
    case ::c10d::ReduceOp::MAX:
      return comm::ReduceOp::MAX;
    case ::c10d::ReduceOp::BAND:
      return comm::ReduceOp::BAND;
    case ::c10d::ReduceOp::BOR:
      return comm::ReduceOp::BOR;
    case ::c10d::ReduceOp::BXOR:
      return comm::ReduceOp::BXOR;
    case ::c10d::ReduceOp::PREMUL_SUM:
      C10_THROW_ERROR(Error, c10::str("tdist: ", name,
                                      " with ReduceOp.PREMUL_SUM is not supported (supported: "
                                      "SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)"));
    default:
      break;
  }
  C10_THROW_ERROR(Error,
                  c10::str("tdist: ", name, ": unknown ReduceOp ", static_cast<int>(op.op_)));
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "tdist: ", op, " got an undefined tensor");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "tdist: ", op, " got a tensor on ",
              t.device(),
              "; the tdist backend serves CPU and CUDA tensors (CUDA staged through "
              "host memory; for NCCL on CUDA: init_process_group(\"cpu:tdist,cuda:nccl\"))");
  TORCH_CHECK(t.layout() == at::kStrided, "tdist: ", op,
              " supports dense (strided) tensors only, got layout ", t.layout());
}

void check_tensors(const std::vector<at::Tensor>& ts, const char* op) {
  for (const auto& t : ts) check_tensor(t, op);
}

// c10d passes one tensor per rank in a vector (the multi-device form is gone from PyTorch 2.x).
at::Tensor& single(std::vector<at::Tensor>& ts, const char* op) {
  TORCH_CHECK(ts.size() == 1, "tdist: ", op, " takes exactly one tensor per rank, got ", ts.size());
  check_tensor(ts[0], op);
  return ts[0];
}

template <typename T>
T& single_list(std::vector<T>& lists, const char* op) {
  TORCH_CHECK(lists.size() == 1, "tdist: ", op, " takes exactly one tensor list per rank, got ",
              lists.size());
  return lists[0];
}

void check_count(const std::vector<at::Tensor>& ts, int size, const char* op, const char* what) {
  TORCH_CHECK(static_cast<int64_t>(ts.size()) == size, "tdist: ", op, " needs one ", what,
              " tensor per rank of the group (", size, "), got ", ts.size());
}

void check_rank(int64_t r, int size, const char* op, const char* what) {
  TORCH_CHECK(r >= 0 && r < size, "tdist: ", op, ": ", what, " ", r,
              " is not a rank of this group of size ", size);
}

// Issues a tdist operation. An error from the call itself becomes a c10 error that names the
// operation: bad arguments a c10::Error (RuntimeError in Python), anything else (an aborted or
// broken group) a c10::DistBackendError, as errors from the operation's Work are.
template <typename Fn>
auto issue(const char* op, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error&) {
    throw;
  } catch (const InvalidArgument& e) {
    C10_THROW_ERROR(Error, c10::str("tdist: ", op, ": ", e.what()));
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, c10::str("tdist: ", op, ": ", e.what()));
  }
}

// Sparse COO allreduce (SUM), as Gloo does it: every rank's coalesced indices and values are
// gathered (padded to the largest nnz, since tdist's allgather takes equal sizes) and summed into
// one coalesced tensor that replaces the input's contents. The sizes decide what the second
// round sends, so it runs on the calling thread and returns the (completed) works.
std::vector<std::shared_ptr<comm::Work>> allreduce_sparse_coo(comm::ProcessGroup& pg, at::Tensor& t,
                                                              comm::Millis timeout) {
  const int n = pg.size();
  comm::AllgatherOptions o;
  o.timeout = timeout;
  at::Tensor in = t.coalesce();
  at::Tensor indices = in._indices().t().contiguous();  // [nnz, sparse_dim]
  at::Tensor values = in._values().contiguous();        // [nnz, dense sizes...]
  at::Tensor counts = at::empty({n}, at::kLong);
  auto gather = [&](const at::Tensor& mine, std::vector<at::Tensor> outs) {
    auto w = pg.allgather(outs, mine, o);
    w->wait();
    return w;
  };
  std::vector<std::shared_ptr<comm::Work>> works;
  works.push_back(gather(at::full({1}, in._nnz(), at::kLong), counts.chunk(n)));
  const int64_t max_nnz = counts.max().item<int64_t>();
  auto padded = [&](const at::Tensor& x) {
    auto sizes = x.sizes().vec();
    sizes[0] = max_nnz;
    at::Tensor p = at::zeros(sizes, x.options());
    p.narrow(0, 0, x.size(0)).copy_(x);
    return p;
  };
  at::Tensor my_indices = padded(indices), my_values = padded(values);
  at::Tensor all_indices = at::empty({n * max_nnz, indices.size(1)}, indices.options());
  auto value_sizes = values.sizes().vec();
  value_sizes[0] = n * max_nnz;
  at::Tensor all_values = at::empty(value_sizes, values.options());
  works.push_back(gather(my_indices, all_indices.chunk(n)));
  works.push_back(gather(my_values, all_values.chunk(n)));
  std::vector<at::Tensor> kept_indices, kept_values;
  for (int r = 0; r < n; ++r) {
    const int64_t c = counts[r].item<int64_t>();
    kept_indices.push_back(all_indices.narrow(0, r * max_nnz, c));
    kept_values.push_back(all_values.narrow(0, r * max_nnz, c));
  }
  at::Tensor sum =
      at::sparse_coo_tensor(at::cat(kept_indices).t(), at::cat(kept_values), t.sizes(), t.options())
          .coalesce();
  t.copy_(sum);
  return works;
}

}  // namespace

c10::intrusive_ptr<::c10d::Backend> TdistBackend::create(
    const ::c10d::DistributedBackendOptions& o) {
  TORCH_CHECK(o.store, "tdist: the backend needs a store");
  TORCH_CHECK(o.group_size >= 1 && o.group_rank >= 0 && o.group_rank < o.group_size, "tdist: rank ",
              o.group_rank, " is not in a group of size ", o.group_size);
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(o.timeout);
  TORCH_CHECK(timeout.count() > 0, "tdist: the timeout must be positive, got ", timeout.count(),
              " ms");

  comm::ProcessGroup::Options pg_opts;
  pg_opts.timeout = timeout;
  std::shared_ptr<comm::ProcessGroup> pg;
  try {
    auto store = std::make_shared<StoreAdapter>(o.store, timeout);
    pg = comm::create_process_group(std::move(store), o.group_rank, o.group_size, pg_opts);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("tdist: creating process group '", o.group_id, "' (rank ",
                             o.group_rank, " of ", o.group_size, ") failed: ", e.what()));
  }

  auto options = c10::make_intrusive<Options>(kBackendName, timeout);
  options->group_name = o.group_id;
  options->global_ranks_in_group.assign(o.global_ranks_in_group.begin(),
                                        o.global_ranks_in_group.end());
  return c10::make_intrusive<TdistBackend>(std::move(pg), std::move(options));
}

TdistBackend::TdistBackend(std::shared_ptr<comm::ProcessGroup> pg,
                           c10::intrusive_ptr<Options> options)
    : ::c10d::Backend(pg->rank(), pg->size()),
      options_(std::move(options)),
      pg_(std::move(pg)),
      timeout_ms_(options_->timeout.count()) {
  init();
}

TdistBackend::~TdistBackend() = default;

void TdistBackend::setTimeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "tdist: setTimeout needs a positive timeout, got ",
              timeout.count(), " ms");
  timeout_ms_.store(timeout.count());
  options_->timeout = timeout;
}

void TdistBackend::abort() {
  if (auto pg = [&] {
        std::lock_guard<std::mutex> lock(mu_);
        return pg_;
      }()) {
    pg->abort();
  }
}

void TdistBackend::shutdown() {
  std::shared_ptr<comm::ProcessGroup> pg;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pg = std::move(pg_);
  }
  // Destroyed here, outside the lock, unless a work or an operation in flight still holds it.
  pg.reset();
}

void TdistBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!coalescing_, "tdist: startCoalescing called again before endCoalescing");
  coalescing_ = true;
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::endCoalescing() {
  std::vector<std::shared_ptr<comm::Work>> works;
  std::vector<at::Tensor> outputs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(coalescing_, "tdist: endCoalescing called without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_works_);
    outputs.swap(coalesced_outputs_);
  }
  return c10::make_intrusive<WorkAdapter>(rank_, OpType::COALESCED, std::move(works),
                                          std::move(outputs));
}

std::shared_ptr<comm::ProcessGroup> TdistBackend::group(const char* op) const {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(pg_, "tdist: ", op, " on a process group that was shut down");
  return pg_;
}

comm::Millis TdistBackend::timeout(std::chrono::milliseconds requested) const {
  return requested.count() >= 0 ? requested : comm::Millis(timeout_ms_.load());
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::make_work(
    OpType type, std::vector<std::shared_ptr<comm::Work>> works, std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> keep_alive, int source_rank) {
  issued_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (coalescing_) {
      coalesced_works_.insert(coalesced_works_.end(), works.begin(), works.end());
      coalesced_outputs_.insert(coalesced_outputs_.end(), outputs.begin(), outputs.end());
    }
  }
  return c10::make_intrusive<WorkAdapter>(rank_, type, std::move(works), std::move(outputs),
                                          std::move(keep_alive), source_rank);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const ::c10d::BroadcastOptions& opts) {
  auto& t = single(tensors, "broadcast");
  TORCH_CHECK(opts.rootTensor == 0,
              "tdist: broadcast has one tensor per rank; rootTensor must "
              "be 0, got ",
              opts.rootTensor);
  check_rank(opts.rootRank, size_, "broadcast", "root");
  comm::BroadcastOptions o;
  o.root = static_cast<int>(opts.rootRank);
  o.timeout = timeout(opts.timeout);
  auto w = issue("broadcast", [&] { return group("broadcast")->broadcast(t, o); });
  return make_work(OpType::BROADCAST, {w}, tensors);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const ::c10d::AllreduceOptions& opts) {
  TORCH_CHECK(!opts.sparseIndices.has_value(),
              "tdist: allreduce of sparse tensors (allreduce_sparse) is not supported");
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse() &&
      tensors[0].device().is_cpu()) {
    TORCH_CHECK(opts.reduceOp == ::c10d::ReduceOp::SUM,
                "tdist: allreduce of a sparse tensor supports ReduceOp.SUM only");
    auto pg = group("allreduce");
    auto works = issue("allreduce (sparse)", [&] {
      return allreduce_sparse_coo(*pg, tensors[0], timeout(opts.timeout));
    });
    return make_work(OpType::ALLREDUCE, std::move(works), tensors);
  }
  auto& t = single(tensors, "allreduce");
  comm::AllreduceOptions o;
  o.op = to_tdist(opts.reduceOp, "allreduce");
  o.timeout = timeout(opts.timeout);
  auto w = issue("allreduce", [&] { return group("allreduce")->allreduce(t, o); });
  return make_work(OpType::ALLREDUCE, {w}, tensors);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const ::c10d::AllreduceCoalescedOptions& opts) {
  check_tensors(tensors, "allreduce_coalesced");
  comm::AllreduceCoalescedOptions o;
  o.op = to_tdist(opts.reduceOp, "allreduce_coalesced");
  o.timeout = timeout(opts.timeout);
  auto w = issue("allreduce_coalesced",
                 [&] { return group("allreduce_coalesced")->allreduce_coalesced(tensors, o); });
  return make_work(OpType::ALLREDUCE_COALESCED, {w}, tensors);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::reduce(std::vector<at::Tensor>& tensors,
                                                      const ::c10d::ReduceOptions& opts) {
  auto& t = single(tensors, "reduce");
  TORCH_CHECK(opts.rootTensor == 0,
              "tdist: reduce has one tensor per rank; rootTensor must be "
              "0, got ",
              opts.rootTensor);
  check_rank(opts.rootRank, size_, "reduce", "root");
  comm::ReduceOptions o;
  o.op = to_tdist(opts.reduceOp, "reduce");
  o.root = static_cast<int>(opts.rootRank);
  o.timeout = timeout(opts.timeout);
  auto w = issue("reduce", [&] { return group("reduce")->reduce(t, o); });
  return make_work(OpType::REDUCE, {w}, tensors);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  auto& in = single(inputs, "allgather");
  auto& outs = single_list(outputs, "allgather");
  check_count(outs, size_, "allgather", "output");
  check_tensors(outs, "allgather");
  comm::AllgatherOptions o;
  o.timeout = timeout(opts.timeout);
  auto w = issue("allgather", [&] { return group("allgather")->allgather(outs, in, o); });
  return make_work(OpType::ALLGATHER, {w}, outs, inputs);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::AllgatherOptions& opts) {
  check_tensor(output, "_allgather_base");
  check_tensor(input, "_allgather_base");
  comm::AllgatherOptions o;
  o.timeout = timeout(opts.timeout);
  auto w = issue("_allgather_base",
                 [&] { return group("_allgather_base")->allgather_into_tensor(output, input, o); });
  return make_work(OpType::_ALLGATHER_BASE, {w}, {output}, {input});
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  // c10d's contract (Gloo's): one output list per rank, outputs[r][i] receives rank r's
  // inputs[i].
  TORCH_CHECK(!inputs.empty(), "tdist: allgather_coalesced needs at least one input tensor");
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) == size_,
              "tdist: allgather_coalesced needs "
              "one output list per rank of the group (",
              size_, "), got ", outputs.size());
  check_tensors(inputs, "allgather_coalesced");
  for (const auto& list : outputs) {
    TORCH_CHECK(list.size() == inputs.size(),
                "tdist: allgather_coalesced needs one output "
                "tensor per input (",
                inputs.size(), ") in each rank's list, got ", list.size());
    check_tensors(list, "allgather_coalesced");
  }
  comm::AllgatherOptions o;
  o.timeout = timeout(opts.timeout);
  auto pg = group("allgather_coalesced");
  std::vector<std::shared_ptr<comm::Work>> works;
  std::vector<at::Tensor> flat;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> per_rank;
    for (auto& list : outputs) per_rank.push_back(list[i]);
    works.push_back(
        issue("allgather_coalesced", [&] { return pg->allgather(per_rank, inputs[i], o); }));
  }
  for (auto& list : outputs) flat.insert(flat.end(), list.begin(), list.end());
  return make_work(OpType::ALLGATHER_COALESCED, std::move(works), std::move(flat), inputs);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(),
              "tdist: allgather_into_tensor_coalesced needs one "
              "output per input, got ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  check_tensors(inputs, "allgather_into_tensor_coalesced");
  check_tensors(outputs, "allgather_into_tensor_coalesced");
  comm::AllgatherOptions o;
  o.timeout = timeout(opts.timeout);
  auto pg = group("allgather_into_tensor_coalesced");
  std::vector<std::shared_ptr<comm::Work>> works;
  for (size_t i = 0; i < inputs.size(); ++i) {
    works.push_back(issue("allgather_into_tensor_coalesced",
                          [&] { return pg->allgather_into_tensor(outputs[i], inputs[i], o); }));
  }
  return make_work(OpType::COALESCED, std::move(works), outputs, inputs);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const ::c10d::GatherOptions& opts) {
  auto& in = single(inputs, "gather");
  const bool root = opts.rootRank == rank_;
  // c10d passes the output list on the root only.
  TORCH_CHECK(outputs.size() == (root ? 1u : 0u), "tdist: gather takes ",
              root ? "one output list on the root" : "no output list off the root", ", got ",
              outputs.size());
  std::vector<at::Tensor> outs = root ? outputs[0] : std::vector<at::Tensor>{};
  if (root) check_count(outs, size_, "gather", "output");
  check_tensors(outs, "gather");
  check_rank(opts.rootRank, size_, "gather", "root");
  comm::GatherOptions o;
  o.root = static_cast<int>(opts.rootRank);
  o.timeout = timeout(opts.timeout);
  auto w = issue("gather", [&] { return group("gather")->gather(outs, in, o); });
  return make_work(OpType::GATHER, {w}, outs, inputs);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const ::c10d::ScatterOptions& opts) {
  auto& out = single(outputs, "scatter");
  const bool root = opts.rootRank == rank_;
  TORCH_CHECK(inputs.size() == (root ? 1u : 0u), "tdist: scatter takes ",
              root ? "one input list on the root" : "no input list off the root", ", got ",
              inputs.size());
  std::vector<at::Tensor> ins = root ? inputs[0] : std::vector<at::Tensor>{};
  if (root) check_count(ins, size_, "scatter", "input");
  check_tensors(ins, "scatter");
  check_rank(opts.rootRank, size_, "scatter", "root");
  comm::ScatterOptions o;
  o.root = static_cast<int>(opts.rootRank);
  o.timeout = timeout(opts.timeout);
  auto w = issue("scatter", [&] { return group("scatter")->scatter(out, ins, o); });
  return make_work(OpType::SCATTER, {w}, outputs, ins);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  auto& out = single(outputs, "reduce_scatter");
  auto& ins = single_list(inputs, "reduce_scatter");
  check_count(ins, size_, "reduce_scatter", "input");
  check_tensors(ins, "reduce_scatter");
  comm::ReduceScatterOptions o;
  o.op = to_tdist(opts.reduceOp, "reduce_scatter");
  o.timeout = timeout(opts.timeout);
  auto w =
      issue("reduce_scatter", [&] { return group("reduce_scatter")->reduce_scatter(out, ins, o); });
  return make_work(OpType::REDUCE_SCATTER, {w}, outputs, ins);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) {
  check_tensor(output, "_reduce_scatter_base");
  check_tensor(input, "_reduce_scatter_base");
  comm::ReduceScatterOptions o;
  o.op = to_tdist(opts.reduceOp, "_reduce_scatter_base");
  o.timeout = timeout(opts.timeout);
  auto w = issue("_reduce_scatter_base", [&] {
    return group("_reduce_scatter_base")->reduce_scatter_tensor(output, input, o);
  });
  return make_work(OpType::_REDUCE_SCATTER_BASE, {w}, {output}, {input});
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(),
              "tdist: reduce_scatter_tensor_coalesced needs one "
              "output per input, got ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  check_tensors(inputs, "reduce_scatter_tensor_coalesced");
  check_tensors(outputs, "reduce_scatter_tensor_coalesced");
  comm::ReduceScatterOptions o;
  o.op = to_tdist(opts.reduceOp, "reduce_scatter_tensor_coalesced");
  o.timeout = timeout(opts.timeout);
  auto pg = group("reduce_scatter_tensor_coalesced");
  std::vector<std::shared_ptr<comm::Work>> works;
  for (size_t i = 0; i < inputs.size(); ++i) {
    works.push_back(issue("reduce_scatter_tensor_coalesced",
                          [&] { return pg->reduce_scatter_tensor(outputs[i], inputs[i], o); }));
  }
  return make_work(OpType::COALESCED, std::move(works), outputs, inputs);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& output_splits,
                                                             std::vector<int64_t>& input_splits,
                                                             const ::c10d::AllToAllOptions& opts) {
  check_tensor(output, "alltoall_base");
  check_tensor(input, "alltoall_base");
  comm::AllToAllOptions o;
  o.timeout = timeout(opts.timeout);
  auto w = issue("alltoall_base", [&] {
    return group("alltoall_base")->alltoall_base(output, input, output_splits, input_splits, o);
  });
  return make_work(OpType::ALLTOALL_BASE, {w}, {output}, {input});
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const ::c10d::AllToAllOptions& opts) {
  check_count(outputs, size_, "alltoall", "output");
  check_count(inputs, size_, "alltoall", "input");
  check_tensors(outputs, "alltoall");
  check_tensors(inputs, "alltoall");
  comm::AllToAllOptions o;
  o.timeout = timeout(opts.timeout);
  auto w = issue("alltoall", [&] { return group("alltoall")->alltoall(outputs, inputs, o); });
  return make_work(OpType::ALLTOALL, {w}, outputs, inputs);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::barrier(const ::c10d::BarrierOptions& opts) {
  comm::BarrierOptions o;
  o.timeout = timeout(opts.timeout);
  auto w = issue("barrier", [&] { return group("barrier")->barrier(o); });
  return make_work(OpType::BARRIER, {w}, {});
}

void TdistBackend::monitoredBarrier(const ::c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const auto limit = timeout(opts.timeout);
  const auto start = std::chrono::steady_clock::now();
  auto pg = group("monitoredBarrier");
  comm::SendRecvOptions o;
  at::Tensor token = at::zeros({1}, at::kInt);
  auto left = [&] {
    auto spent = std::chrono::duration_cast<comm::Millis>(std::chrono::steady_clock::now() - start);
    return limit - spent;
  };
  if (rank_ != 0) {
    try {
      o.timeout = limit;
      pg->send(token, 0, kMonitoredBarrierTag, o)->wait();
      o.timeout = left();
      pg->recv(token, 0, kMonitoredBarrierTag, o)->wait();
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str("Rank ", rank_,
                               " successfully reached monitoredBarrier, but "
                               "received errors while waiting for send/recv from rank 0. Please "
                               "check rank 0 logs for faulty rank. (",
                               e.what(), ")"));
    }
    return;
  }
  if (left().count() <= 0) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("Rank 0 timed out in monitoredBarrier after ", limit.count(), " ms."));
  }
  // All receives share one deadline: a rank that arrived in time is never reported because an
  // earlier one did not.
  o.timeout = left();
  std::vector<std::shared_ptr<comm::Work>> arrivals;
  std::vector<at::Tensor> tokens;
  for (int r = 1; r < size_; ++r) {
    tokens.push_back(at::zeros({1}, at::kInt));
    arrivals.push_back(issue("monitoredBarrier",
                             [&] { return pg->recv(tokens.back(), r, kMonitoredBarrierTag, o); }));
  }
  std::vector<int> missing;
  for (int r = 1; r < size_; ++r) {
    try {
      arrivals[r - 1]->wait();
    } catch (const std::exception& e) {
      if (!wait_all_ranks) {
        C10_THROW_ERROR(DistBackendError,
                        c10::str("Rank ", r, " failed to pass monitoredBarrier in ", limit.count(),
                                 " ms (", e.what(), ")"));
      }
      missing.push_back(r);
    }
  }
  if (!missing.empty()) {
    std::string ranks;
    for (int r : missing) ranks += c10::str(ranks.empty() ? "" : ", ", r);
    C10_THROW_ERROR(DistBackendError,
                    c10::str(missing.size() == 1 ? "Rank " : "Ranks ", ranks,
                             " failed to pass monitoredBarrier in ", limit.count(), " ms"));
  }
  for (int r = 1; r < size_; ++r) {
    o.timeout = limit;
    issue("monitoredBarrier", [&] { return pg->send(token, r, kMonitoredBarrierTag, o); })->wait();
  }
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::send(std::vector<at::Tensor>& tensors, int dst,
                                                    int tag) {
  auto& t = single(tensors, "send");
  check_rank(dst, size_, "send", "destination");
  comm::SendRecvOptions o;
  o.timeout = timeout(::c10d::kUnsetTimeout);
  auto w = issue("send", [&] { return group("send")->send(t, dst, tag, o); });
  return make_work(OpType::SEND, {w}, tensors);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                    int tag) {
  auto& t = single(tensors, "recv");
  check_rank(src, size_, "recv", "source");
  comm::SendRecvOptions o;
  o.timeout = timeout(::c10d::kUnsetTimeout);
  auto w = issue("recv", [&] { return group("recv")->recv(t, src, tag, o); });
  return make_work(OpType::RECV, {w}, tensors, {}, src);
}

c10::intrusive_ptr<::c10d::Work> TdistBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                             int tag) {
  auto& t = single(tensors, "recvAnysource");
  comm::SendRecvOptions o;
  o.timeout = timeout(::c10d::kUnsetTimeout);
  auto w =
      issue("recvAnysource", [&] { return group("recvAnysource")->recv_any_source(t, tag, o); });
  return make_work(OpType::RECVANYSOURCE, {w}, tensors);
}

}  // namespace tdist::c10d_backend
