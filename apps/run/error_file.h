#pragma once
// The error files of torch.distributed.elastic (Note [Worker error files] in error_file.cpp):
// each worker is told a path in TORCHELASTIC_ERROR_FILE; a Python worker whose main is wrapped
// in `@record` writes its uncaught exception there; when workers fail, the launcher reports them
// in torchrun's ChildFailedError layout.
//
// Plain functions; nothing here is shared between threads.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tdist::run {

// One failed worker as torchrun's ProcessFailure describes it.
struct ProcessFailure {
  int rank = -1;
  int local_rank = -1;
  pid_t pid = -1;
  // torchrun's convention: the exit code, or minus the signal number.
  int exitcode = 0;
  std::string error_file;  // "<N/A>" when the worker wrote none
  // From the error file: the traceback (py_callstack) or its message; otherwise torchrun's text
  // for a signal or for a worker that recorded nothing.
  std::string message;
  int64_t timestamp = 0;  // seconds since the epoch: the file's, or when the failure was seen
};

// Reads the error file `path` (if the worker wrote one) into a ProcessFailure. A file that is
// not torchrun's JSON is reported in `message` by what is wrong with it, never thrown: the report
// of a failed worker must not fail itself.
ProcessFailure read_process_failure(int rank, int local_rank, pid_t pid, int exitcode,
                                    const std::string& path);

// torchrun's ChildFailedError text: "<name> FAILED", the other failures, then the root cause
// (the failure with the smallest timestamp, the first one given on a tie). `failures` is not
// empty.
std::string format_child_failed(const std::string& name,
                                const std::vector<ProcessFailure>& failures);

}  // namespace tdist::run
