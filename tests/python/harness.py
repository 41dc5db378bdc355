"""Multi-process harness for the tdist_c10d tests: runs a script as N ranks (real processes on
127.0.0.1), always reaps them, and reports each rank's exit status and output on failure.

A test script calls `run_ranks(...)` in its parent mode; each child is the same script run with
`--child` and the variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (what
env:// reads; tcp:// tests pass the port on the command line instead).
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77  # ctest's SKIP_RETURN_CODE for these tests


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankResult:
    def __init__(self, rank, returncode, output):
        self.rank = rank
        self.returncode = returncode
        self.output = output

    def describe(self):
        if self.returncode is None:
            status = "did not finish in time (killed)"
        elif self.returncode < 0:
            status = "killed by signal %d" % -self.returncode
        else:
            status = "exit code %d" % self.returncode
        return "rank %d: %s\n---- output of rank %d ----\n%s" % (
            self.rank, status, self.rank, self.output.rstrip())


class Ranks:
    """N child processes of `script`. Use as a context manager: leaving it kills and reaps them."""

    def __init__(self, script, world_size, args=(), env=None, port=None):
        self.port = port or free_port()
        self.token = secrets.token_hex(16)
        self.procs = []
        self.logs = []
        for rank in range(world_size):
            child_env = dict(os.environ)
            child_env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            })
            child_env.update(env or {})
            if "TDIST_TOKEN" not in child_env and "TDIST_TOKEN_FILE" not in child_env:
                # The job's token, as tdist-run would give it: a group over file:// (which names
                # no host) listens beyond loopback, which needs one (secure by default).
                child_env["TDIST_TOKEN"] = self.token
            log = tempfile.NamedTemporaryFile(
                mode="w+", prefix="%s.rank%d." % (os.path.basename(script), rank),
                suffix=".log", delete=False)
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, script, "--child"] + [str(a) for a in args],
                env=child_env, stdout=log, stderr=subprocess.STDOUT))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill_all()
        for log in self.logs:
            log.close()
            try:
                os.unlink(log.name)
            except OSError:
                pass

    def kill(self, rank, sig=signal.SIGKILL):
        self.procs[rank].send_signal(sig)

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def output(self, rank):
        self.logs[rank].flush()
        with open(self.logs[rank].name) as f:
            return f.read()

    def wait_all(self, timeout, ranks=None):
        """Waits up to `timeout` seconds for `ranks` (default: all), then kills every rank still
        running; returns a RankResult per waited-for rank (returncode None: it did not finish)."""
        ranks = list(range(len(self.procs))) if ranks is None else list(ranks)
        deadline = time.monotonic() + timeout
        codes = {}
        for r in ranks:
            try:
                codes[r] = self.procs[r].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[r] = None
        self.kill_all()
        return [RankResult(r, codes[r], self.output(r)) for r in ranks]


def check_all_succeeded(results, what):
    failed = [r for r in results if r.returncode != 0]
    if failed:
        raise SystemExit("FAILED: %s\n%s" % (what, "\n".join(r.describe() for r in failed)))
    for r in results:  # what each rank reported (lines starting with "rank ")
        for line in r.output.splitlines():
            if line.startswith("rank "):
                print(line)
    print("PASSED: %s" % what)


def skip_without_gpus(count, what):
    """Exits with SKIP, saying why, unless torch sees `count` GPUs and has NCCL (`what` needs them)."""
    import torch
    import torch.distributed as dist
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < count:
        print("SKIPPED: %s needs %d visible GPU(s); %d visible" % (what, count, seen))
        sys.exit(SKIP)
    if not dist.is_nccl_available():
        print("SKIPPED: this torch has no NCCL (%s)" % what)
        sys.exit(SKIP)


def run_ranks(script, world_size, args=(), env=None, timeout=90, what=None):
    """Runs `script --child args` as `world_size` ranks; fails (SystemExit) unless all exit 0."""
    what = what or "%s %s on %d ranks" % (os.path.basename(script), " ".join(map(str, args)),
                                           world_size)
    with Ranks(script, world_size, args, env) as ranks:
        results = ranks.wait_all(timeout)
    check_all_succeeded(results, what)
    return results


def child_main(body):
    """Runs body(rank, world_size) in a child; any exception is printed and exits 1."""
    import traceback
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        body(rank, world_size)
    except BaseException:  # noqa: B902 - report everything, including SystemExit from asserts
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def check(cond, *msg):
    if not cond:
        raise AssertionError(" ".join(str(m) for m in msg))


def check_close(actual, expected, what, atol=0.0, rtol=0.0):
    import torch
    if not torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol):
        raise AssertionError("%s: got %s, expected %s" % (what, actual, expected))


def check_equal(actual, expected, what):
    import torch
    if actual.dtype != expected.dtype or not torch.equal(actual, expected):
        raise AssertionError("%s: got %s (%s), expected %s (%s)" % (
            what, actual, actual.dtype, expected, expected.dtype))


def expect_raises(fn, exc_type, *substrings):
    """Calls fn; fails unless it raises exc_type with every substring in its message."""
    try:
        fn()
    except exc_type as e:
        text = str(e)
        for s in substrings:
            if s not in text:
                raise AssertionError("error %r does not mention %r" % (text, s))
        return e
    raise AssertionError("expected %s mentioning %s; nothing was raised" % (
        exc_type.__name__, substrings))
