#!/usr/bin/env bash
# The store's host dies mid-training: two hosts made of network namespaces, one tdist-run each
# (2 nodes x 1 worker of tdist-train --timeout 3; host 1's launcher serves the store). Once both
# train, every process on host 1 is killed (SIGKILL: the launcher with its store and its worker).
# The worker on host 2 must fail with an error naming the operation and the lost peer within its
# --timeout plus a slack, and its launcher must exit non-zero, never hang.
# Exits 77 (ctest: skipped) with the reason when namespaces cannot be made.
#   store_host_dies_test.sh <tdist-run> <tdist-train>
set -uo pipefail
run="$1"; train="$2"
source "$(dirname "$0")/../harness/netns_hosts.sh"
netns_test_begin tds 221 2
fail() { echo "FAIL: $*"; for f in "$work"/*; do echo "--- $f"; cat "$f"; done; exit 1; }

netns_train_two_nodes "$run" "$train" 29833
pids=("${train_pids[@]}")

ip netns pids "${id}h1" | xargs -r kill -9
killed=$(date +%s%N)
wait "${pids[1]}"; r2=$?
took_ms=$(( ($(date +%s%N) - killed) / 1000000 ))
wait "${pids[0]}" 2>/dev/null
echo "host 2's launcher exited ($r2) ${took_ms} ms after host 1 was killed"
(( r2 != 0 )) || fail "host 2's launcher exited 0 after the store's host died"
(( r2 != 124 )) || fail "host 2's launcher hung until the test's own timeout"
# --timeout 3 per operation, then the launcher's stop grace (2 s) and process exit: 15 s is ample.
(( took_ms < 15000 )) || fail "the failure took ${took_ms} ms to surface"
grep -qE "allreduce(_coalesced)? \(seq [0-9]+\)|broadcast \(seq [0-9]+\)" "$work/node2.err" ||
  fail "host 2's error does not name the operation"
grep -qE "rank 0" "$work/node2.err" || fail "host 2's error does not name the lost peer (rank 0)"
echo "host 2: $(grep -m1 -iE "error|failed" "$work/node2.err")"
echo "PASS: the store's host died; host 2's worker failed naming the peer within ${took_ms} ms"
