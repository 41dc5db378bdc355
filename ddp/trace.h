#pragma once
// Trace: a Chrome-trace (Perfetto-viewable) JSON of one rank's DDP iterations, so that the
// overlap of backward and each bucket's allreduce can be seen.
//
// Enabled by TDIST_TRACE=FILE: rank R writes FILE with "{rank}" replaced by R, or, when FILE has
// no "{rank}", FILE with ".rankR" inserted before its extension (trace.json -> trace.rank0.json).
// Events are "complete" events (ph "X") on two tracks: "compute" (forward, backward, the final
// wait) and "comm" (each bucket's communication, from launch to completion). The file is
// written whole (temporary file, then rename) by flush() and by the destructor; at most
// kMaxEvents are kept (later ones are counted and dropped).
//
// Thread safe: events may be added from any thread.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tdist::ddp {

class Trace {
 public:
  enum class Track : int { kCompute = 0, kComm = 1 };
  static constexpr size_t kMaxEvents = 1'000'000;

  // From TDIST_TRACE; nullptr when it is unset or empty.
  static std::shared_ptr<Trace> from_env(int rank);
  // The file rank `rank` writes for TDIST_TRACE=pattern (see the class comment).
  static std::string path_for_rank(const std::string& pattern, int rank);

  Trace(std::string path, int rank);
  ~Trace();
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  // Microseconds on a steady clock shared by all Trace objects of the process.
  static int64_t now_us();

  void add(std::string name, Track track, int64_t begin_us, int64_t end_us, std::string args = {});
  // Writes the file now (throws Error when it cannot be written).
  void flush();

  const std::string& path() const { return path_; }

 private:
  struct Event {
    std::string name;
    Track track;
    int64_t begin_us;
    int64_t end_us;
    std::string args;  // a JSON object body, e.g. "\"bytes\": 4096", or empty
  };

  // Constant after construction:
  const std::string path_;
  const int rank_;

  std::mutex mu_;
  std::vector<Event> events_;  // guarded by mu_
  uint64_t dropped_ = 0;       // guarded by mu_
};

}  // namespace tdist::ddp
