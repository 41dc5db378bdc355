#pragma once
// Tensors on other devices through a CPU backend (Note [Staging device tensors]).
//
// Note [Staging device tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring backend serves CUDA tensors as well as CPU ones, so every operation works on GPUs
// without NCCL, and with several ranks sharing one GPU (which NCCL refuses). An operation copies
// each CUDA tensor it reads into host memory on the caller's thread when it is issued
// (host_values: a blocking copy on the caller's current stream, so every kernel queued before the
// call that wrote the tensor is done first; a tensor it only writes, such as an allgather's
// outputs or a receive's or a non-root broadcast's buffer, gets host memory without a copy:
// host_output), runs on the host copies, and copies the results back into the
// caller's tensors (Contig::write_back in ring_process_group_ops.cpp, a blocking copy) before the
// Work completes. The Work's completion therefore means the results are on the device: a caller
// that waits on it may use them from any stream. Host copies of CUDA tensors are pinned, from
// PyTorch's caching host allocator, so the memory of one step is reused by the next.
// The ranks need not agree on devices: a CPU tensor on one rank meets a CUDA tensor on another.
// Large ring allreduces, allgathers, reduce-scatters, broadcasts, reduces, gathers, scatters and
// alltoalls overlap their copies with the transfers instead, window by window (StagedTensors,
// Note [Overlapped staging] in algorithms/overlapped_staging.h, Note [Windows] in
// algorithms/context.h), and so do large sends
// and receives (Note [Staged messages] in staged_message.h); a CUDA tensor that is not contiguous
// goes through a contiguous stand-in on its device (Note [Strided device tensors]).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <vector>

#include "tdist/comm/algorithms/overlapped_staging.h"
#include "tdist/comm/ring/ring_tuning.h"
#include "tdist/comm/work.h"

namespace tdist::comm::detail {

struct IssueMark;  // staging.cpp

// Throws InvalidArgument (naming `op` and `what`) unless `t` is a defined dense tensor on the CPU
// or a CUDA device.
void check_stageable(const at::Tensor& t, const char* op, const char* what);

// A contiguous CPU tensor with t's values (conjugate and negative views resolved): t itself when
// it already is one, else a copy (pinned host memory for a CUDA tensor).
at::Tensor host_values(const at::Tensor& t);
// The same for a tensor the operation only writes: its current values are not copied (new
// memory, pinned for a CUDA tensor, unless t already is a contiguous CPU tensor).
at::Tensor host_output(const at::Tensor& t);

// Tensors' bytes staged through host memory piece by piece (Note [Overlapped staging]): host
// memory holds the slots one after the other; the copies in are queued on the caller's current
// stream at construction, in `order`; finished ranges are coalesced and copied out on a side
// stream (which first waits for the point the copies in start from, so no copy out overtakes a
// kernel queued before the operation); complete() waits for all of it.
class StagedTensors final : public algorithms::Staging {
 public:
  // Whether an operation over a group of `size` ranks stages `ts` (every tensor it reads or
  // writes) in pieces of `piece_bytes`: contiguous CUDA tensors of one device (CPU ones under the
  // testing hook) without a conjugate or negative bit, of at least two pieces together, with a
  // peer. A piece size of 0 stages nothing this way. `once_dense`: whether it would, were every
  // tensor contiguous without those bits (Note [Strided device tensors]).
  static bool wanted(at::ArrayRef<at::Tensor> ts, int size, size_t piece_bytes,
                     bool once_dense = false);
  // False when no list that holds `t` is staged (neither by wanted nor by StandIns::wanted): t
  // is a host tensor and the testing hook is off. Asked before building a list for wanted, so
  // that a host operation builds none (Note [Small operations]).
  static bool may_stage(const at::Tensor& t);
  // The default piece size (a group's ring.staging_piece_bytes or TDIST_STAGING_PIECE_BYTES
  // overrides it).
  static constexpr size_t kPieceBytes = kDefaultStagingPieceBytes;

  // A part of the host buffer: the tensor its values are copied in from (the pieces of `order`
  // that fall in it) and the tensor finished ranges are copied out to. Either may be undefined
  // (an output only written, an input only read); both are contiguous, of the same bytes.
  struct Slot {
    at::Tensor in;
    at::Tensor out;
  };
  // Each tensor both: copied in (as far as `order` says) and out again.
  static std::vector<Slot> in_and_out(const std::vector<at::Tensor>& ts);

  // Finished ranges are copied out once `piece_bytes` of them are pending (or at complete()).
  // The copies in go on the caller's current stream, or, with `issue`, on a side stream after the
  // point `issue` marked: so a window made later, on another thread, still copies what the
  // kernels queued before the operation's issue produced.
  StagedTensors(std::vector<Slot> slots, std::vector<algorithms::ByteRange> order,
                size_t piece_bytes, std::shared_ptr<const IssueMark> issue = nullptr);
  // The current point of the caller's stream for ts' device (nothing for CPU tensors).
  static std::shared_ptr<const IssueMark> mark_issue(const std::vector<at::Tensor>& ts);
  ~StagedTensors() override;
  StagedTensors(const StagedTensors&) = delete;
  StagedTensors& operator=(const StagedTensors&) = delete;

  char* data() const { return static_cast<char*>(host_.data_ptr()); }

  bool arrived(size_t piece) override;
  void finished(size_t begin, size_t end) override;
  // Copies out what is pending and waits until every copy is done: the tensors then hold the
  // host buffer's values.
  void complete();

  // A slot's bytes at `offset` in the host buffer: its tensors as flat byte tensors.
  struct Part {
    size_t offset;
    size_t size;
    at::Tensor in;
    at::Tensor out;
  };
  // How the bytes move: device copies and events, or the testing hook's copy thread.
  class Engine {
   public:
    virtual ~Engine() = default;
    virtual bool arrived(size_t piece) = 0;
    virtual void copy_out(size_t begin, size_t end) = 0;
    virtual void drain() = 0;
  };

 private:
  StagedTensors(at::Tensor host, std::vector<Part> parts, c10::Device dev,
                std::vector<algorithms::ByteRange> order, size_t piece_bytes,
                std::shared_ptr<const IssueMark> issue);
  void flush();

  at::Tensor host_;
  std::unique_ptr<Engine> engine_;
  size_t piece_;
  size_t known_ = 0;                     // pieces 0..known_-1 have arrived
  algorithms::ByteRange pending_{0, 0};  // finished, not yet copied out
};

// Note [Strided device tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The windows of a staged operation are byte ranges of its tensors, so it wants them contiguous.
// A CUDA tensor that is not (strided, or a conjugate or negative view) gets a contiguous stand-in
// on its device: a copy of its values, queued on the caller's current stream, when the operation
// reads it; new memory when it only writes it. The operation runs on the stand-ins, window by
// window like any other, and once it finished, the stand-ins of what it wrote are copied back
// into the caller's tensors (on the finishing thread's current stream, which it then waits for)
// before its Work completes. The cost is device memory of the tensors' size and a device copy
// each way; the host memory stays bounded by the windows, where the whole tensor would otherwise
// be copied to the host and back (Contig in ring_process_group_ops.cpp).
class StandIns {
 public:
  // Whether an operation over `size` ranks in pieces of `piece_bytes` would stage `ts` if they
  // were contiguous, and some are not.
  static bool wanted(at::ArrayRef<at::Tensor> ts, int size, size_t piece_bytes);
  // A contiguous tensor with t's values (t itself when it is one).
  at::Tensor read(const at::Tensor& t);
  // Contiguous memory for t's new values, copied back into t at the end (t itself when it is
  // contiguous).
  at::Tensor written(const at::Tensor& t);
  // Both: t's values, and copied back.
  at::Tensor updated(const at::Tensor& t);
  std::vector<at::Tensor> read(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> written(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> updated(const std::vector<at::Tensor>& ts);
  // The Work of the operation `inner` runs on the stand-ins as the caller sees it: it completes
  // with `value` (the caller's tensors) once `inner` succeeded and the stand-ins are copied back,
  // or with inner's error. Its name and sequence number are inner's; waiting on it is waiting on
  // inner (Note [Waiter runs the operation] in op_queue.cpp).
  std::shared_ptr<Work> finish(const std::shared_ptr<Work>& inner, Future::Value value) const;
  // Copies the stand-ins of what was written into the caller's tensors and waits for it.
  void copy_back() const;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (the caller's tensor, its stand-in)
};

// Testing hook: stage CPU tensors too, through a thread that copies each piece after `delay`
// (so that a transfer that ran ahead of its piece would read the garbage the host buffer starts
// with), in the group's pieces; `strided`: give strided CPU tensors stand-ins as CUDA ones get
// (Note [Strided device tensors]; without it they are copied whole, so that tests can mix staged
// and unstaged ranks). `device_like`: the copies complete as a device's do, late and unordered:
// each copy in after a random delay of up to `delay`, the pieces in a random order; each copy
// out queued to another thread that runs it after a random delay of up to `delay`, reading the
// host buffer then rather than when it was asked for (so an algorithm that changed finished
// bytes, or freed the buffer before complete(), shows). The default turns it off. Process-wide;
// set it while no operation runs.
struct StagingForTests {
  bool cpu = false;
  bool strided = false;
  bool device_like = false;
  std::chrono::microseconds delay{0};
};
void set_staging_for_tests(const StagingForTests& s);
// How many buffers were staged in pieces in this process so far (one per window), and
// the most host memory they held at once since the last reset_staged_peak_for_tests().
size_t staged_buffers_for_tests();
size_t staged_peak_bytes_for_tests();
void reset_staged_peak_for_tests();

// [begin, begin + n) in pieces of `piece` bytes, in ascending order.
std::vector<algorithms::ByteRange> ascending_pieces(size_t begin, size_t n, size_t piece);
// t's memory as flat bytes (t contiguous).
at::Tensor flat_bytes(const at::Tensor& t);
// Views of the elements [begin, end) of ts taken as one flat sequence (contiguous tensors).
std::vector<at::Tensor> element_range(const std::vector<at::Tensor>& ts, size_t begin, size_t end);

}  // namespace tdist::comm::detail
