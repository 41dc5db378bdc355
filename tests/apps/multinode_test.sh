#!/usr/bin/env bash
# Two "hosts" made of network namespaces joined by a veth pair, one tdist-run per host meeting at
# host A's address: 2 nodes x 2 workers run PROGRAM ARGS, and every rank r must print a line
# matching EXPECT with {r} replaced by r (a world of 4). When the ranks print "parameters
# fnv1a64 H" (tdist-train), every rank's H must be the same. The namespaces are created and
# removed by this test. Exits 77 (ctest: skipped) with the reason when namespaces cannot be made.
#   multinode_test.sh <tdist-run> <expect> <program> [args...]
set -uo pipefail
run="$1"; expect="$2"; prog="$3"; shift 3
id="tdist$$"
a="${id}a"; b="${id}b"
addr_a=10.213.$(( $$ % 200 )).1; addr_b=10.213.$(( $$ % 200 )).2
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; }
trap cleanup EXIT
# Jobs across these hosts need a token (tdist-run refuses a multi-node job beyond loopback
# without one): both tdist-runs share this one, as --token-file would give it.
export TDIST_TOKEN="${TDIST_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

if ! ip netns add "$a" 2>/tmp/"$id".err; then
  echo "SKIP: cannot create network namespaces here: $(cat /tmp/"$id".err)"; rm -f /tmp/"$id".err
  exit 77
fi
rm -f /tmp/"$id".err
ip netns add "$b" || exit 1
ip link add "${id}x" netns "$a" type veth peer name "${id}y" netns "$b" || { echo "SKIP: no veth"; exit 77; }
ip -n "$a" addr add "$addr_a/24" dev "${id}x"
ip -n "$b" addr add "$addr_b/24" dev "${id}y"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "${id}x" up
ip -n "$b" link set "${id}y" up

out=$(mktemp -d)
common=(--nnodes 2 --nproc-per-node 2 --master-addr "$addr_a" --master-port 29533)
timeout 120 ip netns exec "$a" "$run" "${common[@]}" --node-rank 0 "$prog" "$@" >"$out/a.out" 2>"$out/a.err" &
pa=$!
timeout 120 ip netns exec "$b" "$run" "${common[@]}" --node-rank 1 "$prog" "$@" >"$out/b.out" 2>"$out/b.err" &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
cat "$out"/a.out "$out"/b.out
if [ $ra -ne 0 ] || [ $rb -ne 0 ]; then
  echo "FAIL: node 0 exit $ra, node 1 exit $rb"; cat "$out"/a.err "$out"/b.err; exit 1
fi
for r in 0 1 2 3; do
  if ! grep -qE "^\[rank $r\] ${expect//\{r\}/$r}" "$out"/a.out "$out"/b.out; then
    echo "FAIL: rank $r printed no line matching '${expect//\{r\}/$r}'"; exit 1
  fi
done
hashes=$(cat "$out"/a.out "$out"/b.out | grep -oE "parameters fnv1a64 [0-9a-f]+" | sort -u | wc -l)
[ "$hashes" -le 1 ] || { echo "FAIL: the ranks ended with different parameters"; exit 1; }
# Ranks 0-1 ran on host A, 2-3 on host B.
grep -q "^\[rank 2\]" "$out/b.out" && grep -q "^\[rank 0\]" "$out/a.out" || { echo "FAIL: ranks on the wrong host"; exit 1; }
echo "PASS: 2 hosts x 2 workers"
