#!/usr/bin/env bash
# Open MPI's mpirun starts PROGRAM on 2 processes without tdist-run: the workers find their rank
# and size from OMPI_COMM_WORLD_* and meet at MASTER_ADDR/MASTER_PORT.
# Both must print a line matching the expected regex; when they print "parameters fnv1a64 H"
# (tdist-train), both H must be the same. Exits 77 (ctest: skipped) when mpirun is not installed.
#   mpirun_test.sh <program> <expected line regex> [program args...]
set -uo pipefail
prog="$1"; expect="$2"; shift 2
command -v mpirun >/dev/null || { echo "SKIP: mpirun not installed"; exit 77; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
out=$(timeout 180 mpirun --allow-run-as-root --oversubscribe -np 2 \
  -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" -x OMP_NUM_THREADS=1 "$prog" "$@" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL: mpirun exit $rc"; exit 1; }
n=$(grep -cE "$expect" <<<"$out")
[ "$n" -eq 2 ] || { echo "FAIL: expected 2 lines matching '$expect', got $n"; exit 1; }
hashes=$(grep -oE "parameters fnv1a64 [0-9a-f]+" <<<"$out" | sort -u | wc -l)
[ "$hashes" -le 1 ] || { echo "FAIL: the ranks ended with different parameters"; exit 1; }
echo PASS
