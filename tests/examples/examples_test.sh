#!/usr/bin/env bash
# The examples as a user builds and runs them: tdist installed into a prefix once, then each
# example configured against that prefix (find_package(tdist)), built, and run with the commands
# of its README.
#   examples_test.sh install <build dir> <work dir>          cmake --install into <work dir>/prefix
#   examples_test.sh deb <build dir> <work dir> <version>    cpack -G DEB from the build (no
#                                                            compiling), checked and unpacked with
#                                                            dpkg -x into <work dir>/root
#   examples_test.sh run <example> <source dir> <work dir> [prefix]
#                                                            configure, build and run one example
#                                                            against <work dir>/prefix or [prefix]
set -euo pipefail

fail() { echo "FAILED: $*" >&2; exit 1; }

# Runs "$@" with its output in $log; prints the output when it fails.
logged() {
  "$@" >"$log" 2>&1 || { cat "$log"; fail "$*"; }
}

# Output of a command that must exit with status $1 (the rest is the command); printed either way.
expect_status() {
  local want="$1"; shift
  local rc=0
  out="$("$@" 2>&1)" || rc=$?
  echo "$out"
  [[ "$rc" == "$want" ]] || fail "exit status $rc (expected $want): $*"
}

# Fails unless $out has exactly $1 lines matching the regex $2.
expect_lines() {
  local n
  n="$(grep -cE -- "$2" <<<"$out" || true)"
  [[ "$n" == "$1" ]] || fail "$n lines match '$2' (expected $1)"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The inference service run by hand (tdist-run would stop everybody when one worker dies):
# client2 kills itself with requests pending; the server and client1 must finish normally.
inference_with_dead_client() {
  local port requests=100
  port="$(free_port)"
  export MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" WORLD_SIZE=3
  RANK=0 timeout -s KILL 120 ./inference_service --requests "$requests" >server.log 2>&1 & local server=$!
  RANK=1 timeout -s KILL 120 ./inference_service --requests "$requests" >client1.log 2>&1 & local client1=$!
  RANK=2 timeout -s KILL 120 ./inference_service --requests "$requests" --die-after 20 >client2.log 2>&1 & local client2=$!
  local rc2=0 rc1=0 rc0=0
  wait "$client2" || rc2=$?
  wait "$client1" || rc1=$?
  wait "$server" || rc0=$?
  head -n 20 server.log client1.log client2.log
  [[ "$rc2" == 137 ]] || fail "the dying client exited with status $rc2 (expected 137, SIGKILL)"
  [[ "$rc1" == 0 ]] || fail "the surviving client exited with status $rc1"
  [[ "$rc0" == 0 ]] || fail "the server exited with status $rc0"
  out="$(cat client1.log server.log)"
  expect_lines 1 "^client1: $requests answers, 0 differ from local inference"
  expect_lines 1 "^server: served $requests requests of client1$"
  expect_lines 1 "^server: served [0-9]+ requests of client2$"
}

# The Debian package as `apt install ./tdist_<version>_amd64.deb` would put it, unpacked into
# <work>/root instead of /: its name, its declared dependencies, its files.
make_deb() {
  local build="$1" work="$2" version="$3"
  rm -rf "$work"
  mkdir -p "$work"
  log="$work/cpack.log"
  logged cpack -G DEB --config "$build/CPackConfig.cmake" -B "$work"
  local arch deb
  arch="$(dpkg --print-architecture)"
  deb="$work/tdist_${version}_${arch}.deb"
  [[ -f "$deb" ]] || { ls "$work"; fail "no $deb"; }
  out="$(dpkg-deb --field "$deb" Package Version Architecture Depends)"
  echo "$out"
  expect_lines 1 "^Package: tdist$"
  expect_lines 1 "^Version: ${version}$"
  expect_lines 1 "^Depends: .*libboost-dev.*libcereal-dev"
  logged dpkg -x "$deb" "$work/root"
  local p="$work/root/usr"
  for f in bin/tdist-run bin/tdist-train bin/tdist-bench lib/cmake/tdist/tdistConfig.cmake \
           include/tdist/core/store.h include/tdist/ddp/distributed_data_parallel.h; do
    [[ -e "$p/$f" ]] || fail "the package has no /usr/$f"
  done
  ls "$p/lib"/libtdist_core.so* >/dev/null || fail "the package has no libtdist_core"
  if find "$p" -name 'tdist_c10d*' | grep -q .; then fail "the Python module is in the package"; fi
  # The packaged launcher runs from the unpacked tree.
  expect_status 0 "$p/bin/tdist-run" --nproc-per-node 2 --master-port 0 sh -c 'echo rank $RANK'
  expect_lines 2 "^\[rank [01]\] rank [01]$"
}

run_example() {
  local ex="$1" src="$2" work="$3"
  local prefix="${4:-$work/prefix}" dir="$work/$ex"
  local log="$work/$ex.log"
  [[ -d "$prefix" ]] || fail "no installed tdist at $prefix (run the install step first)"
  # What the example's README says; ccache only speeds up the test's repeated builds.
  local launcher=()
  if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
  logged cmake -S "$src/examples/$ex" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}"
  logged cmake --build "$dir"
  cd "$dir"
  local run="$prefix/bin/tdist-run"
  case "$ex" in
    embed)
      expect_status 0 ./embed_example
      expect_lines 1 "tensor round trip ok"
      # The installed tree holds the headers as consumers include them.
      test -f "$prefix/include/tdist/core/store.h"
      ;;
    ddp)
      expect_status 0 "$run" --standalone --nproc-per-node 2 ./ddp_example
      expect_lines 2 "parameters differ across ranks by 0$"
      ;;
    fsdp)
      expect_status 0 "$run" --standalone --nproc-per-node 2 ./fsdp_example
      expect_lines 2 "max difference from ddp: fsdp [0-9.e-]+, zero1 [0-9.e-]+$"
      ;;
    model_parallel)
      expect_status 0 "$run" --standalone --nproc-per-node 2 ./model_parallel_example
      expect_lines 1 "local reference differs by"
      ;;
    inference_service)
      expect_status 0 "$run" --standalone --nproc-per-node 3 ./inference_service --requests 100
      expect_lines 2 "client[12]: 100 answers, 0 differ from local inference"
      expect_lines 1 "server: served 200 requests in"
      inference_with_dead_client
      ;;
    *) fail "unknown example '$ex'" ;;
  esac
}

case "${1:-}" in
  install)
    rm -rf "$3/prefix"
    log="$3/install.log"
    mkdir -p "$3"
    logged cmake --install "$2" --prefix "$3/prefix"
    test -f "$3/prefix/lib/cmake/tdist/tdistConfig.cmake"
    ;;
  deb) make_deb "$2" "$3" "$4" ;;
  run) run_example "$2" "$3" "$4" "${5:-}" ;;
  *) fail "usage: $0 install <build dir> <work dir> | deb <build dir> <work dir> <version> | run <example> <source dir> <work dir> [prefix]" ;;
esac
