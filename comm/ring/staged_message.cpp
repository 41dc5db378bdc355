#include "tdist/comm/ring/staged_message.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace tdist::comm::detail {

bool StagedMessage::wanted(const at::Tensor& t, int size, size_t piece_bytes) {
  return t.nbytes() > P2PEngine::kEagerMax &&
         StagedTensors::wanted({t}, size, piece_bytes, /*once_dense=*/true);
}

StagedMessage::StagedMessage(const at::Tensor& t, bool send, size_t window_bytes,
                             size_t piece_bytes)
    : bytes_(flat_bytes(t)), send_(send), window_(window_bytes), piece_(piece_bytes) {
  if (t.nbytes() > window_) issue_ = StagedTensors::mark_issue({t});
  cur_ = stage(0);
}

size_t StagedMessage::size_of(size_t begin) const {
  return std::min(window_, static_cast<size_t>(bytes_.numel()) - begin);
}

std::shared_ptr<StagedTensors> StagedMessage::stage(size_t begin) const {
  const size_t n = size_of(begin);
  const at::Tensor part = bytes_.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(n));
  std::vector<StagedTensors::Slot> slots{send_ ? StagedTensors::Slot{part, at::Tensor()}
                                               : StagedTensors::Slot{at::Tensor(), part}};
  return std::make_shared<StagedTensors>(
      std::move(slots),
      send_ ? ascending_pieces(0, n, piece_) : std::vector<algorithms::ByteRange>{}, piece_,
      begin == 0 ? nullptr : issue_);
}

void StagedMessage::advance() {
  begin_ += size_of(begin_);
  if (send_) {
    // Every byte of the current window was written: its host memory is free.
    cur_ = next_ ? std::move(next_) : stage(begin_);  // next_ is empty after either
  } else {
    if (prev_) prev_->complete();  // its copies out are done: its memory may be taken again
    prev_ = std::move(cur_);
    cur_ = stage(begin_);
  }
}

size_t StagedMessage::span(size_t offset, char** at) {
  while (offset >= begin_ + size_of(begin_)) advance();
  const size_t n = size_of(begin_), rel = offset - begin_;
  *at = cur_->data() + rel;
  if (!send_) return n - rel;
  const size_t total = static_cast<size_t>(bytes_.numel());
  if (!next_ && begin_ + n < total) next_ = stage(begin_ + n);  // copies in while this one goes
  // The pieces from rel's on that have arrived (they arrive in order).
  size_t end = rel;
  while (end < n && cur_->arrived(end / piece_)) end = std::min(n, (end / piece_ + 1) * piece_);
  return end - rel;
}

void StagedMessage::moved(size_t end) {
  if (send_) return;
  cur_->finished(landed_ - begin_, end - begin_);
  landed_ = end;
}

void StagedMessage::complete() {
  if (prev_) prev_->complete();
  cur_->complete();
}

}  // namespace tdist::comm::detail
