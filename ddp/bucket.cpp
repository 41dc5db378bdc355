#include "tdist/ddp/bucket.h"

#include <ATen/ATen.h>
#include <c10/util/strides.h>

#include <map>
#include <tuple>

#include "tdist/comm/process_group.h"
#include "tdist/core/error.h"

namespace tdist::ddp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                const std::vector<size_t>& order,
                                                size_t first_cap_bytes, size_t cap_bytes) {
  TDIST_CHECK_ARG(order.size() == params.size(), "bucket order has ", order.size(), " entries for ",
                  params.size(), " parameters");
  struct Open {
    std::vector<size_t> params;
    size_t bytes = 0;
    bool first = true;  // the first bucket of this dtype/device is still open
  };
  // Key: (dtype, device); buckets of different keys fill side by side.
  std::map<std::tuple<int, std::string>, Open> open;
  std::vector<std::vector<size_t>> done;
  std::vector<bool> seen(params.size(), false);
  for (size_t i : order) {
    TDIST_CHECK_ARG(i < params.size() && !seen[i], "bucket order is not a permutation of 0..",
                    params.size() - 1, " (entry ", i, ")");
    seen[i] = true;
    const at::Tensor& p = params[i];
    TDIST_CHECK_ARG(p.defined(), "parameter ", i, " is undefined");
    TDIST_CHECK_ARG(!p.is_sparse(), "parameter ", i, " is sparse; DDP supports dense parameters");
    auto key = std::make_tuple(static_cast<int>(p.scalar_type()), p.device().str());
    Open& b = open[key];
    b.params.push_back(i);
    b.bytes += static_cast<size_t>(p.numel()) * p.element_size();
    size_t cap = b.first ? std::min(first_cap_bytes, cap_bytes) : cap_bytes;
    if (b.bytes >= cap) {
      done.push_back(std::move(b.params));
      b.params.clear();
      b.bytes = 0;
      b.first = false;
    }
  }
  for (auto& [key, b] : open) {
    if (!b.params.empty()) done.push_back(std::move(b.params));
  }
  // Launch order follows readiness order: sort buckets by the position of their first entry.
  std::vector<size_t> pos(params.size());
  for (size_t k = 0; k < order.size(); ++k) pos[order[k]] = k;
  std::stable_sort(done.begin(), done.end(),
                   [&](const auto& a, const auto& b) { return pos[a.front()] < pos[b.front()]; });
  return done;
}

void Bucket::allocate(const std::vector<at::Tensor>& all_params, comm::ProcessGroup* pg) {
  offsets.clear();
  lengths.clear();
  views.clear();
  int64_t total = 0;
  for (size_t i : params) {
    offsets.push_back(total);
    lengths.push_back(all_params[i].numel());
    total += all_params[i].numel();
  }
  const at::Tensor& first = all_params[params.front()];
  if (pg != nullptr && first.is_cpu()) {
    buffer = pg->symmetric_empty({total}, first.scalar_type()).zero_();
    symmetric = pg->is_symmetric(buffer);
  } else {
    buffer = at::zeros({total}, first.options().requires_grad(false));
  }
  for (size_t k = 0; k < params.size(); ++k) {
    // Built with set_ rather than narrow/view: the result shares the buffer's storage but is not
    // an autograd view, so that .grad set to it survives libtorch's Optimizer::zero_grad (which
    // detach_()es gradients, and detach_ refuses views).
    const at::Tensor& p = all_params[params[k]];
    at::Tensor v = at::empty({0}, buffer.options());
    v.set_(buffer.storage(), offsets[k], p.sizes(), c10::contiguous_strides(p.sizes()));
    views.push_back(v);
  }
  targets = views;
}

size_t Bucket::bytes() const {
  return buffer.defined() ? static_cast<size_t>(buffer.numel()) * buffer.element_size() : 0;
}

}  // namespace tdist::ddp
