"""`pip install --no-build-isolation .` of the PyTorch backend, as a user runs it, then the backend
used from the environment it went into.

  pip_install_test.py --scenario install --source DIR --work DIR --build-dir DIR
                      [--build-type T] [--define NAME=VALUE ...]
  pip_install_test.py --scenario no-torch --source DIR --work DIR

install    A fresh virtual environment with --system-site-packages (the pip torch and
           scikit-build-core of the Python running this are visible, nothing of tdist), pip
           installs the repository into it offline (--no-index) without PYTHONPATH, and then,
           with that environment's Python and no PYTHONPATH:
           - the wheel put tdist_c10d, its libraries and the torch.backends entry point there;
           - two ranks `import tdist_c10d`, init_process_group("tdist") (env://), allreduce, and
             one DDP step that must equal single-process SGD on both ranks' data; the process
             maps tdist's libraries from the environment, not from a build tree;
           - two ranks started by the venv's torchrun init_process_group("tdist") without
             importing tdist_c10d (torch loads it through the entry point) and allreduce;
           - with TORCH_DEVICE_BACKEND_AUTOLOAD=0 and no import, "tdist" is unknown to torch.
           The wheel is built in --build-dir (persistent: a second run rebuilds nothing) with
           --build-type, --cxx and the --define'd CMake variables of the test's own build, so
           that ccache serves the objects that build compiled.
no-torch   What pip's default isolated build meets (a Python that cannot import torch): the
           configure fails at once saying to use --no-build-isolation.

Exit code 0 passed, 1 failed, 77 skipped (with the reason).
"""

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import check  # noqa: E402

SCRIPT = os.path.abspath(__file__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=["install", "no-torch"])
    p.add_argument("--source")
    p.add_argument("--work")
    p.add_argument("--build-dir")
    p.add_argument("--build-type", default="")
    p.add_argument("--define", action="append", default=[])
    p.add_argument("--cxx", default="", help="the C++ compiler (CXX) of the wheel build")
    # Internal: run inside the virtual environment.
    p.add_argument("--in-venv", choices=["installed", "ranks-import", "ranks-autoload",
                                         "autoload-off"])
    p.add_argument("--child", action="store_true")
    return p.parse_args()


def clean_env(**extra):
    """The environment of a user's shell: no PYTHONPATH (ctest's Python tests set one)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env.update(extra)
    return env


def run(cmd, what, env, timeout):
    """Runs cmd; returns its output; fails with the output's tail when it exits non-zero."""
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise SystemExit("FAILED: %s did not finish in %d s\n%s" % (
            what, timeout, (e.stdout or "")[-6000:] if isinstance(e.stdout, str) else ""))
    if out.returncode != 0:
        raise SystemExit("FAILED: %s exited %d\n$ %s\n%s" % (
            what, out.returncode, " ".join(cmd), out.stdout[-8000:]))
    print("%s: %.1f s" % (what, time.monotonic() - started))
    return out.stdout


def make_venv(path, system_site_packages):
    shutil.rmtree(path, ignore_errors=True)
    # --without-pip: the base interpreter's pip is visible through --system-site-packages and
    # installs into the environment it runs in; copying pip in would only take time.
    cmd = [sys.executable, "-m", "venv", "--without-pip"]
    if system_site_packages:
        cmd.append("--system-site-packages")
    run(cmd + [path], "python -m venv", clean_env(), 120)
    return os.path.join(path, "bin", "python")


def scenario_install(args):
    for mod in ("torch", "pip", "scikit_build_core"):
        try:
            __import__(mod)
        except ImportError:
            print("SKIPPED: %s cannot import %s (scripts/setup.sh installs it)" % (
                sys.executable, mod))
            sys.exit(harness.SKIP)
    venv_python = make_venv(os.path.join(args.work, "venv"), system_site_packages=True)
    cmd = [venv_python, "-m", "pip", "install", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--no-cache-dir",
           "--config-settings=build-dir=%s" % args.build_dir]
    if args.build_type:
        cmd.append("--config-settings=cmake.build-type=%s" % args.build_type)
    for d in args.define:
        name, _, value = d.partition("=")
        cmd.append("--config-settings=cmake.define.%s=%s" % (name, value))
    cmd.append(args.source)
    # scikit-build-core sets CXX to Python's compiler (g++) unless CXX is set; ccache hashes the
    # compiler as named, so /usr/bin/c++ and /usr/bin/g++ would not share objects.
    env = clean_env(**({"CXX": args.cxx} if args.cxx else {}))
    run(cmd, "pip install --no-build-isolation --no-index (wheel build and install)", env, 1500)

    for case in ("installed", "ranks-import", "ranks-autoload", "autoload-off"):
        print(run([venv_python, SCRIPT, "--in-venv", case], "in the venv: %s" % case,
                  clean_env(), 300).rstrip())
    print("PASSED: pip install into a fresh venv, then the backend from it")


def scenario_no_torch(args):
    # No --system-site-packages: this Python sees no torch, as in pip's isolated build.
    bare_python = make_venv(os.path.join(args.work, "bare-venv"), system_site_packages=False)
    build = os.path.join(args.work, "no-torch-build")
    shutil.rmtree(build, ignore_errors=True)
    # The variables scikit-build-core configures with (SKBUILD, the Python running pip).
    out = subprocess.run(["cmake", "-S", args.source, "-B", build, "-G", "Ninja",
                          "-DSKBUILD=2", "-DPython3_EXECUTABLE=%s" % bare_python,
                          "-DTDIST_BUILD_TESTS=OFF", "-DTDIST_BUILD_APPS=OFF"],
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=120)
    shutil.rmtree(build, ignore_errors=True)
    check(out.returncode != 0, "the configure without torch succeeded:\n" + out.stdout[-4000:])
    text = " ".join(out.stdout.split())  # CMake wraps its messages
    check("cannot import torch" in text and "pip install --no-build-isolation ." in text,
          "the configure failed without saying why:\n" + out.stdout[-4000:])
    print("error: %s" % text[text.find("tdist: "):text.find("Call Stack")].strip())
    print("PASSED: a build with no torch in its Python fails at configure, naming the fix")


# ---- inside the virtual environment (sys.executable is its Python; no PYTHONPATH) ----

def in_venv(path):
    return os.path.realpath(path).startswith(os.path.realpath(sys.prefix) + os.sep)


def check_in_venv():
    check(sys.prefix != sys.base_prefix, "not in a virtual environment:", sys.prefix)
    check("PYTHONPATH" not in os.environ, "PYTHONPATH is set:", os.environ.get("PYTHONPATH"))


def case_installed():
    check_in_venv()
    import importlib.metadata as md
    dist = md.distribution("tdist-c10d")
    files = [str(f) for f in dist.files]
    check(any(f.startswith("tdist_c10d.") and f.endswith(".so") for f in files),
          "no tdist_c10d module in the wheel's files:", files)
    libs = sorted(f for f in files if f.startswith("tdist_c10d.libs/"))
    check(any("libtdist_comm.so" in f for f in libs) and any("libtdist_core.so" in f for f in libs),
          "the wheel lacks tdist's libraries:", files)
    check(not any(f.endswith((".cpp", ".h")) for f in files), "sources in the wheel:", files)
    points = [e for e in md.entry_points(group="torch.backends") if e.dist.name == "tdist-c10d"]
    check(len(points) == 1 and points[0].value == "tdist_c10d:_autoload",
          "no torch.backends entry point for tdist_c10d:", points)
    print("wheel %s %s: %s, entry point torch.backends %s = %s" % (
        dist.metadata["Name"], dist.version, ", ".join(libs), points[0].name, points[0].value))


def mapped_tdist_libraries():
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libtdist_" in line or "tdist_c10d" in line}
    return sorted(p for p in paths if p.startswith("/"))


def child_body(explicit_import):
    def body(rank, world_size):
        import torch
        torch.set_num_threads(1)
        if explicit_import:
            import tdist_c10d  # noqa: F401 - registers "tdist"
        import torch.distributed as dist
        dist.init_process_group("tdist", timeout=datetime.timedelta(seconds=60))  # env://
        check(dist.get_backend() == "tdist", "backend is", dist.get_backend())
        module = sys.modules.get("tdist_c10d")
        check(module is not None, "tdist_c10d was not loaded")
        check(in_venv(module.__file__), "tdist_c10d came from outside the venv:", module.__file__)
        for lib in mapped_tdist_libraries():
            check(in_venv(lib), "a tdist library mapped from outside the venv:", lib)

        x = torch.arange(4, dtype=torch.float32) + rank
        dist.all_reduce(x)
        expected = sum(torch.arange(4, dtype=torch.float32) + r for r in range(world_size))
        harness.check_equal(x, expected, "all_reduce")

        if explicit_import:
            ddp_step(torch, dist, rank, world_size)
        dist.destroy_process_group()
        how = "import tdist_c10d" if explicit_import else "no import (entry point)"
        print("rank %d: %s, all_reduce %s%s" % (rank, how, x.tolist(),
                                                 ", DDP step equals SGD on all data"
                                                 if explicit_import else ""))
    return body


def ddp_step(torch, dist, rank, world_size):
    """One step of PyTorch's DDP over tdist equals one SGD step on every rank's batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(10 + rank)  # different on every rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = DDP(model)
    start = [p.detach().clone() for p in model.parameters()]

    def batch(r):
        g = torch.Generator().manual_seed(100 + r)
        return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

    x, y = batch(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()

    # The reference: the same start, the gradient of the mean loss over all ranks' batches.
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p, s in zip(ref.parameters(), start):
            p.copy_(s)
    xs, ys = zip(*(batch(r) for r in range(world_size)))
    torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        harness.check_close(p.detach(), q.detach(), "parameter %d after the DDP step" % i,
                            atol=1e-6, rtol=1e-5)
    check(any(not torch.equal(p.detach(), s) for p, s in zip(model.parameters(), start)),
          "the DDP step changed no parameter")


def case_ranks(explicit_import):
    check_in_venv()
    if explicit_import:
        harness.run_ranks(SCRIPT, 2, args=["--in-venv", "ranks-import"], timeout=120,
                          what="two ranks in the venv, import tdist_c10d")
        return
    # As the README runs it: torchrun of the venv's Python starts the workers.
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", SCRIPT, "--in-venv", "ranks-autoload", "--child"],
              "torchrun, two ranks without the import", clean_env(OMP_NUM_THREADS="1"), 180)
    for rank in range(2):
        check("rank %d: no import" % rank in out, "rank %d did not report:\n%s" % (rank, out))
    print("\n".join(l for l in out.splitlines() if l.startswith("rank ")))


def case_autoload_off():
    check_in_venv()
    check(os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0", "autoload is on")
    import torch.distributed as dist
    check("tdist_c10d" not in sys.modules, "tdist_c10d loaded with autoload off")
    try:
        dist.init_process_group("tdist", init_method="tcp://127.0.0.1:%d" % harness.free_port(),
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    except (ValueError, RuntimeError, AssertionError) as e:  # 2.11: AssertionError
        check("tdist" in str(e), "the error does not name the backend:", e)
        print("autoload off, no import: init_process_group(\"tdist\") raises %s: %s" % (
            type(e).__name__, e))
        return
    raise AssertionError("init_process_group(\"tdist\") worked with autoload off and no import")


def main():
    args = parse()
    if args.in_venv:
        if args.child:
            body = child_body(explicit_import=(args.in_venv == "ranks-import"))
            harness.child_main(body)
        elif args.in_venv == "installed":
            case_installed()
        elif args.in_venv == "autoload-off":
            # Re-run with the switch set before torch is imported.
            if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") != "0":
                sys.exit(subprocess.run([sys.executable, SCRIPT, "--in-venv", "autoload-off"],
                                        env=clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
                                        timeout=120).returncode)
            case_autoload_off()
        else:
            case_ranks(explicit_import=(args.in_venv == "ranks-import"))
        return
    for name in ("source", "work"):
        check(getattr(args, name), "--%s is required" % name.replace("_", "-"))
    os.makedirs(args.work, exist_ok=True)
    if args.scenario == "install":
        check(args.build_dir, "--build-dir is required")
        scenario_install(args)
    else:
        scenario_no_torch(args)


if __name__ == "__main__":
    main()
