#!/usr/bin/env bash
# A link taken down mid-training: two hosts made of network namespaces, one tdist-run each
# (2 nodes x 1 worker of tdist-train --timeout 3); once both train, host 2's link goes down.
# No packet says so (no reset, no FIN): each worker must fail with a timeout error naming the
# operation and the peer within its --timeout plus a slack, and each launcher must exit non-zero,
# never hang. Exits 77 (ctest: skipped) with the reason when namespaces cannot be made.
# The two workers talk over the link although namespace "hosts" share one /dev/shm: ranks in
# different network namespaces are different hosts to tdist (Note [Host key]).
#   link_down_test.sh <tdist-run> <tdist-train>
set -uo pipefail
run="$1"; train="$2"
source "$(dirname "$0")/../harness/netns_hosts.sh"
netns_test_begin tdl 218 2
fail() { echo "FAIL: $*"; for f in "$work"/*; do echo "--- $f"; cat "$f"; done; exit 1; }

netns_train_two_nodes "$run" "$train" 29733
pids=("${train_pids[@]}")

ip -n "${id}h2" link set "${id}v2" down
down=$(date +%s%N)
wait "${pids[0]}"; r1=$?
wait "${pids[1]}"; r2=$?
took_ms=$(( ($(date +%s%N) - down) / 1000000 ))
echo "both launchers exited ($r1, $r2) ${took_ms} ms after the link went down"
(( r1 != 0 && r2 != 0 )) || fail "a launcher exited 0 after its link went down ($r1, $r2)"
(( r1 != 124 && r2 != 124 )) || fail "a launcher hung until the test's own timeout"
# --timeout 3 per operation, then the launcher's stop grace (2 s) and process exit: 15 s is ample.
(( took_ms < 15000 )) || fail "the failure took ${took_ms} ms to surface"
for h in 1 2; do
  grep -qE "Timed out|timed out" "$work/node$h.err" || fail "worker on host $h gave no timeout error"
  grep -qE "allreduce(_coalesced)? \(seq [0-9]+\)" "$work/node$h.err" || fail "host $h's error does not name the operation"
  grep -qE "waiting for rank [01]" "$work/node$h.err" || fail "host $h's error does not name the peer"
done
echo "PASS: a link down mid-training gave each worker a timeout error within ${took_ms} ms"
