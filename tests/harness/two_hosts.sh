#!/usr/bin/env bash
# Two "hosts" made of network namespaces joined by a veth pair, PER_HOST processes of COMMAND on
# each: rank r runs on host A when r < PER_HOST, else on host B. Each rank gets RANK, WORLD_SIZE,
# TDIST_TEST_HOST_A (host A's address: where a tcp:// store lives), TDIST_TEST_HOST_ADDR (the
# address of its own host) and TDIST_TEST_SHARED (a directory both hosts see, for file://), and
# runs with MASTER_ADDR, MASTER_PORT, TDIST_SOCKET_HOST, TDIST_SOCKET_IFNAME and
# GLOO_SOCKET_IFNAME unset: every rank must find the address it publishes by itself.
# Passes when every rank exits 0 within TIMEOUT seconds (each rank's output is printed, prefixed
# with its rank). The namespaces are created and removed here. Exits 77 (ctest: skipped) with
# the reason when namespaces cannot be made.
#   two_hosts.sh PER_HOST TIMEOUT COMMAND [ARGS...]
set -uo pipefail
per_host="$1"; limit="$2"; shift 2
id="td2h$$"
a="${id}a"; b="${id}b"
net=10.214.$(( $$ % 250 ))
addr_a=$net.1; addr_b=$net.2
shared=$(mktemp -d)
# A job across hosts needs its token (a store beyond loopback refuses to start without one):
# one random token for every rank, as a launcher with --token-file would give them.
export TDIST_TOKEN="${TDIST_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; rm -rf "$shared"; }
trap cleanup EXIT

if ! err=$(ip netns add "$a" 2>&1); then
  echo "SKIP: cannot create network namespaces here: $err"; exit 77
fi
ip netns add "$b" || exit 1
if ! err=$(ip link add "${id}x" netns "$a" type veth peer name "${id}y" netns "$b" 2>&1); then
  echo "SKIP: cannot create a veth pair here: $err"; exit 77
fi
ip -n "$a" addr add "$addr_a/24" dev "${id}x" || exit 1
ip -n "$b" addr add "$addr_b/24" dev "${id}y" || exit 1
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "${id}x" up && ip -n "$b" link set "${id}y" up || exit 1

world=$(( 2 * per_host ))
pids=()
for (( r = 0; r < world; r++ )); do
  if (( r < per_host )); then ns=$a; host=$addr_a; else ns=$b; host=$addr_b; fi
  env -u MASTER_ADDR -u MASTER_PORT -u TDIST_SOCKET_HOST -u TDIST_SOCKET_IFNAME \
      -u GLOO_SOCKET_IFNAME RANK=$r WORLD_SIZE=$world TDIST_TEST_HOST_A=$addr_a \
      TDIST_TEST_HOST_ADDR=$host TDIST_TEST_SHARED="$shared" \
      timeout -k 5 "$limit" ip netns exec "$ns" "$@" >"$shared/rank$r.log" 2>&1 &
  pids+=($!)
done
failed=0
for (( r = 0; r < world; r++ )); do
  wait "${pids[$r]}"; rc=$?
  sed "s/^/[rank $r] /" "$shared/rank$r.log"
  if (( rc == 124 || rc == 137 )); then
    echo "FAIL: rank $r did not finish within $limit s"; failed=1
  elif (( rc != 0 )); then
    echo "FAIL: rank $r exited with code $rc"; failed=1
  fi
done
(( failed == 0 )) || exit 1
echo "PASS: $world ranks on 2 hosts ($per_host per host)"
