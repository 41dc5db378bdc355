#pragma once
// StagedMessage: a point-to-point message of a CUDA tensor through host memory, window by window.
//
// Note [Staged messages]
// ~~~~~~~~~~~~~~~~~~~~~~
// A send or receive of a CUDA tensor larger than an eager message (P2PEngine::kEagerMax) and of
// at least two staging pieces (StagedTensors::wanted; a tensor that is not contiguous goes
// through a stand-in, Note [Strided device tensors]) is not copied whole to the host: the engine
// moves it as one DATA frame (Note [Streamed payloads]) whose bytes come from, or land in, one
// window of the group's TDIST_WINDOW_BYTES at a time.
// - Sending, a window's copies in are queued piece by piece (the first window's on the caller's
//   stream when the send is issued, later ones on a side stream after that point), each piece is
//   written once it arrived, and the next window is staged while one is written.
// - Receiving, each piece is copied out to the tensor once it landed; before a window's host
//   memory is taken for the one after next, the engine thread waits for its copies out (which
//   started while the next window's bytes arrived, so the wait is short). The receive completes
//   once the last copies out are done.
// So a message holds host memory for two windows at most, however large. The peer sees one
// message of the tensor's bytes either way: a staged rank, an unstaged one and a CPU one exchange
// messages as before.

#include <ATen/core/Tensor.h>

#include <memory>

#include "tdist/comm/engine/p2p_engine.h"
#include "tdist/comm/ring/staging.h"

namespace tdist::comm::detail {

class StagedMessage final : public P2PEngine::Payload {
 public:
  // Whether a message of `t` goes this way over a group of `size` ranks in pieces of
  // `piece_bytes`, once t is contiguous (a stand-in when it is not).
  static bool wanted(const at::Tensor& t, int size, size_t piece_bytes);
  // `t`: the tensor sent or received, contiguous. Stages the first window (a send's copies in
  // start now, on the caller's current stream).
  StagedMessage(const at::Tensor& t, bool send, size_t window_bytes, size_t piece_bytes);

  size_t span(size_t offset, char** at) override;
  void moved(size_t end) override;
  // A receive's last copies out, waited for: the tensor then holds the message.
  void complete();

 private:
  std::shared_ptr<StagedTensors> stage(size_t begin) const;
  size_t size_of(size_t begin) const;
  // Makes the window after the current one current.
  void advance();

  const at::Tensor bytes_;  // the tensor's flat bytes
  const bool send_;
  const size_t window_;
  const size_t piece_;
  std::shared_ptr<const IssueMark> issue_;  // the caller's stream at the call, for later windows
  // A send: the window being written and the next one copying in. A receive: the one landing
  // and the one before it, copying out.
  std::shared_ptr<StagedTensors> cur_, next_, prev_;
  size_t begin_ = 0;   // cur_'s first byte in the message
  size_t landed_ = 0;  // a receive's bytes landed so far
};

}  // namespace tdist::comm::detail
