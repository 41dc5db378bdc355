"""Runs PyTorch's own backend conformance suite (the wheel's
torch.testing._internal.distributed.distributed_test, DistributedTest._DistTestBase) against
tdist, or against gloo for the reference outcomes on the same machine.

    pytorch_suite.py --backend tdist --world-size 2 --mode plugin
    pytorch_suite.py --backend tdist --world-size 3 --mode widened -k all_reduce -k broadcast
    pytorch_suite.py --backend gloo --world-size 2            # the reference
    pytorch_suite.py --backend tdist --world-size 2 --list tests/python/pytorch_suite_fast.txt

Modes (for --backend tdist):
  plugin   tdist is declared as a plugin backend with gloo's CPU features ("plugin", "subgroup",
           "ddp"): the suite as it stands for a third-party backend.
  widened  tdist is declared with every feature gloo is declared with, and the suite's file is
           loaded with its guards that name gloo widened to tdist too (`BACKEND != "gloo"`,
           `BACKEND == "gloo"`, `require_backend_is_available({"gloo"})`): the tests of what a
           gloo user relies on. Calls that create a gloo group explicitly stay gloo.

Each rank is a real process (forked per test, as the suite's MultiProcessTestCase does), the
rendezvous is the suite's own (file://). Prints one line per test ("PASS name", "FAIL name",
"SKIP name: reason", "ERROR name") and a summary line "N passed, N failed, N skipped"; --out
writes the per-test lines to a file too. Exit code 0 when nothing failed (and, with --strict,
nothing was skipped) (77 when torch's test
modules are missing, which ctest reports as skipped).
"""

import argparse
import os
import re
import secrets
import sys
import tempfile
import time
import unittest

SKIP = 77

# Tests whose subject is a gloo-only internal or gloo's own name, never tdist's behaviour. They
# are run all the same; the summary lists them apart so a reader sees why they differ.
OUTSIDE_TDIST = {
    "test_monitored_barrier_gloo":
        "torch.distributed.monitored_barrier() raises 'only implemented for GLOO backend' for "
        "any other backend before it reaches the backend (PyTorch's Python layer)",
    "test_monitored_barrier_gloo_subgroup":
        "torch.distributed.monitored_barrier() refuses every backend but gloo (PyTorch's Python "
        "layer)",
    "test_ddp_logging_data_cpu":
        "DDP's logger reads the name from c10d's ProcessGroup::getBackendName(), which is "
        "\"custom\" for every plugin backend (PyTorch's side)",
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="tdist", choices=["tdist", "gloo"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mode", default="plugin", choices=["plugin", "widened"])
    p.add_argument("-k", action="append", default=[],
                   help="run only tests whose name contains this (repeatable)")
    p.add_argument("--list", help="a file of test names (one per line, # comments) to run")
    p.add_argument("--out", help="also write the per-test lines here")
    p.add_argument("--strict", action="store_true",
                   help="a skipped test fails the run (for lists of tests that gloo passes here)")
    return p.parse_args()


def widen(source):
    """The suite's source with its gloo-only guards also admitting tdist."""
    rules = [
        (r'BACKEND != "gloo"', 'BACKEND not in ("gloo", "tdist")'),
        (r'BACKEND == "gloo"', 'BACKEND in ("gloo", "tdist")'),
        (r'require_backend_is_available\(\{"gloo"\}\)',
         'require_backend_is_available({"gloo", "tdist"})'),
    ]
    for pattern, replacement in rules:
        source, n = re.subn(pattern, replacement, source)
        if n == 0:
            raise RuntimeError("pytorch_suite: the suite no longer contains %r; update widen()"
                               % pattern)
    return source


def load_suite(args):
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="tdist-suite."))
    # The suite's rendezvous is file://, which names no host: its groups listen beyond loopback,
    # which needs the job's token (secure by default), as tdist-run would give it.
    if "TDIST_TOKEN_FILE" not in os.environ:
        os.environ.setdefault("TDIST_TOKEN", secrets.token_hex(16))
    try:
        import torch.testing._internal.common_distributed as common
    except ImportError as e:
        print("SKIP: PyTorch's distributed test modules cannot be imported: %s" % e)
        sys.exit(SKIP)
    if args.backend == "tdist":
        import tdist_c10d  # noqa: F401  (registers "tdist")
        features = common.DistTestCases.backend_feature
        declared = ["plugin", "subgroup", "ddp"]
        if args.mode == "widened":
            declared += [name for name, backends in features.items() if "gloo" in backends]
        for name in declared:
            features.setdefault(name, set()).add("tdist")
    import torch.testing._internal.distributed.distributed_test as stock
    if args.backend != "tdist" or args.mode == "plugin":
        return stock
    # Load a widened copy under its own name; the decorators run at import, so the guards must
    # be widened in the source.
    import types
    with open(stock.__file__) as f:
        source = widen(f.read())
    module = types.ModuleType("tdist_widened_distributed_test")
    module.__file__ = stock.__file__
    sys.modules[module.__name__] = module
    exec(compile(source, stock.__file__, "exec"), module.__dict__)
    return module


class LineResult(unittest.TextTestResult):
    """One line per test, collected for the summary."""

    lines = []

    def _line(self, text):
        self.lines.append(text)
        self.stream.write(text + "\n")
        self.stream.flush()

    def addSuccess(self, test):
        super().addSuccess(test)
        self._line("PASS %s" % test._testMethodName)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._line("FAIL %s" % test._testMethodName)

    def addError(self, test, err):
        super().addError(test, err)
        self._line("ERROR %s" % test._testMethodName)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._line("SKIP %s: %s" % (test._testMethodName, str(reason).splitlines()[0]))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._line("XFAIL %s" % test._testMethodName)

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._line("FAIL %s (unexpected success)" % test._testMethodName)


def selected(names, args):
    wanted = None
    if args.list:
        with open(args.list) as f:
            wanted = {line.split("#")[0].strip() for line in f} - {""}
        unknown = wanted - set(names)
        if unknown:
            print("pytorch_suite: not in the suite: %s" % ", ".join(sorted(unknown)))
            sys.exit(2)
    out = []
    for n in names:
        if wanted is not None and n not in wanted:
            continue
        if args.k and not any(k in n for k in args.k):
            continue
        out.append(n)
    return out


def main():
    args = parse_args()
    suite_module = load_suite(args)
    base = suite_module.TestDistBackend
    dist_base = suite_module.DistributedTest._DistTestBase

    class TestTdistSuite(base, dist_base):
        def setUp(self):
            super().setUp()
            # Forked ranks (nothing to re-import: a rank starts in well under a second).
            import torch.multiprocessing
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    names = selected(unittest.TestLoader().getTestCaseNames(TestTdistSuite), args)
    suite = unittest.TestSuite(TestTdistSuite(n) for n in names)
    label = "%s world %d%s" % (args.backend, args.world_size,
                               (" " + args.mode) if args.backend == "tdist" else "")
    print("pytorch_suite: %s: %d tests" % (label, len(names)), flush=True)
    start = time.monotonic()
    runner = unittest.TextTestRunner(stream=sys.stdout, resultclass=LineResult, verbosity=0)
    result = runner.run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    passed = result.testsRun - failed - len(result.skipped) - len(result.expectedFailures)
    outside = [n for n in OUTSIDE_TDIST
               if any(line.split()[1] == n for line in LineResult.lines
                      if line.startswith(("FAIL", "ERROR")))]
    for n in outside:
        print("outside tdist: %s: %s" % (n, OUTSIDE_TDIST[n]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("# %s\n" % label)
            f.write("\n".join(LineResult.lines) + "\n")
    print("pytorch_suite: %s in %.0f s" % (label, time.monotonic() - start))
    print("%d passed, %d failed, %d skipped" % (passed, failed, len(result.skipped)))
    if args.strict and result.skipped:
        print("pytorch_suite: --strict: %d listed tests were skipped" % len(result.skipped))
        return 1
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
