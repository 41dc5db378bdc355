#pragma once
// The Chrome-trace JSON writer (viewable in Perfetto or chrome://tracing) that DDP's TDIST_TRACE
// and the pipeline's timelines share: one process (a rank) with named tracks (threads) of
// "complete" events (ph "X"). The file is written whole: a temporary file, then a rename.
// No libtorch; stateless (thread safe).

#include <cstdint>
#include <string>
#include <vector>

namespace tdist {

struct ChromeTraceEvent {
  std::string name;
  int track = 0;  // index into the track names
  int64_t begin_us = 0;
  int64_t end_us = 0;
  std::string args;  // a JSON object body, e.g. "\"bytes\": 4096", or empty
};

// Writes `path`. `other_data` is a JSON object body for "otherData" (e.g. "\"rank\": 0").
// Throws Error when the file cannot be written or renamed.
void write_chrome_trace(const std::string& path, int pid, const std::string& process_name,
                        const std::vector<std::string>& track_names,
                        const std::vector<ChromeTraceEvent>& events,
                        const std::string& other_data = {});

// `pattern` with "{rank}" replaced by rank, else ".rankR" inserted before the file's extension
// (trace.json -> trace.rank0.json), else appended.
std::string trace_path_for_rank(const std::string& pattern, int rank);

}  // namespace tdist
