#!/usr/bin/env bash
# A lossy link keeps training correct, only slower: two hosts made of network namespaces, 2
# workers of tdist-train each (so DDP's gradients take the hierarchical allreduce across the
# link), trained once over a clean link and once with nftables dropping 1% of the packets each
# host sends to the other (a random drop per packet: TCP's retransmissions must repair it). Both
# runs must end with the same parameters on every rank, and the rule must really have dropped
# packets. (Delay cannot be injected here: the kernel has no netem or fq queueing discipline.)
# Exits 77 (ctest: skipped) with the reason when namespaces or nftables are missing.
#   lossy_link_test.sh <tdist-run> <tdist-train>
set -uo pipefail
run="$1"; train="$2"
source "$(dirname "$0")/../harness/netns_hosts.sh"
command -v nft >/dev/null || { echo "SKIP: nft (nftables) is not installed"; exit 77; }
netns_test_begin tdo 219 2
fail() { { echo "FAIL: $*"; for f in "$work"/*; do echo "--- $f"; cat "$f"; done; } >&2; exit 1; }

port=29833
train_once() {  # NAME: both hosts' launchers; prints the run's one parameter hash
  local name=$1 h pids=() rc=0
  port=$((port + 1))
  for h in 1 2; do
    OMP_NUM_THREADS=1 timeout -k 5 150 ip netns exec "${id}h$h" \
      "$run" --nnodes 2 --node-rank $((h - 1)) --nproc-per-node 2 --master-addr "$net.1" \
      --master-port "$port" \
      "$train" --steps 80 --hidden 256 --layers 2 --train-samples 4000 --test-samples 500 \
      --threads 1 --timeout 60 >"$work/$name.$h.out" 2>"$work/$name.$h.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  (( rc == 0 )) || fail "the $name run failed"
  local hashes
  hashes=$(cat "$work/$name".*.out | grep -oE "parameters fnv1a64 [0-9a-f]+" | sort | uniq -c)
  [ "$(wc -l <<<"$hashes")" = 1 ] && grep -q "^ *4 " <<<"$hashes" ||
    fail "the $name run's 4 ranks do not end with one parameter hash: $hashes"
  awk '{print $4}' <<<"$hashes"
}

t0=$(date +%s%N)
clean=$(train_once clean) || exit 1
t1=$(date +%s%N)
for h in 1 2; do
  ip netns exec "${id}h$h" nft -f - <<EOF || fail "cannot add the nftables rule"
table inet tdist_loss {
  chain out {
    type filter hook output priority 0;
    oifname "${id}v$h" numgen random mod 100 < 1 counter drop
  }
}
EOF
done
lossy=$(train_once lossy) || exit 1
t2=$(date +%s%N)
dropped=0
for h in 1 2; do
  n=$(ip netns exec "${id}h$h" nft list chain inet tdist_loss out | grep -oE "counter packets [0-9]+" | awk '{print $3}')
  dropped=$((dropped + ${n:-0}))
done
echo "clean run $(( (t1 - t0) / 1000000 )) ms, lossy run $(( (t2 - t1) / 1000000 )) ms, $dropped packets dropped"
(( dropped > 0 )) || fail "the rule dropped no packet"
[ "$clean" = "$lossy" ] || fail "the lossy run ended with other parameters ($lossy) than the clean one ($clean)"
echo "PASS: 1% packet loss: training ended with the same parameters ($clean), only slower"
