#!/usr/bin/env bash
# The store, the collective mesh and RPC over IPv6 and host names, with tdist-train (DDP) and
# tdist-rpc-seed (RPC, distributed autograd) under tdist-run:
#   1. a host whose loopback has no IPv4 address (a network namespace), MASTER_ADDR=::1;
#   2. two IPv6-only hosts (namespaces on a bridge, fd00:: addresses), one tdist-run each,
#      MASTER_ADDR = host 1's IPv6 address: every rank must find and publish its own;
#   3. MASTER_ADDR=localhost on this host.
# Each time the DDP workers train together and end with the same parameters, and the RPC worker
# A trains the Net on worker B. Exits 77 (ctest: skipped) with the reason when namespaces cannot
# be made.
#   ipv6_test.sh <tdist-run> <tdist-train> <tdist-rpc-seed>
set -uo pipefail
run="$1"; train="$2"; rpc_seed="$3"
source "$(dirname "$0")/../harness/netns_hosts.sh"
net6="fd00:$(printf '%x' $(( $$ % 65000 )))"
train_args=(--steps 10 --hidden 16 --layers 1 --train-samples 500 --test-samples 50 --threads 1
            --progress none)
# same_parameters <world> <files...>: ranks 0..world-1 trained, all with one parameter hash
same_parameters() {
  local world=$1; shift
  for (( r = 0; r < world; r++ )); do
    grep -q "rank $r of $world: trained 10 steps" "$@" || { echo "FAIL: no rank $r"; cat "$@"; exit 1; }
  done
  (( $(cat "$@" | grep -oE "fnv1a64 [0-9a-f]+" | sort -u | wc -l) == 1 )) ||
    { echo "FAIL: the ranks ended with different parameters"; cat "$@"; exit 1; }
}
# rpc_trained <what> <files...>: worker A (rank 0) finished training over RPC
rpc_trained() {
  local what=$1; shift
  grep -q "\[rank 0\] trained weight" "$@" || { echo "FAIL: RPC with $what"; cat "$@"; exit 1; }
}

# Hosts 1 and 2 without any IPv4 address, host 3 for case 1.
netns_test_begin td6 219 3
for i in 1 2 3; do
  ip -n "${id}h$i" addr flush dev "${id}v$i"
  ip -n "${id}h$i" addr del 127.0.0.1/8 dev lo
  ip -n "${id}h$i" addr add "$net6::$i/64" dev "${id}v$i" nodad || exit 1
done

# 1. IPv6 loopback only.
OMP_NUM_THREADS=1 timeout -k 5 90 ip netns exec "${id}h3" "$run" --nproc-per-node 2 \
  --master-addr ::1 --master-port 29755 "$train" "${train_args[@]}" >"$work/loopback6.out" 2>&1 ||
  { echo "FAIL: MASTER_ADDR=::1 on an IPv6-only host"; cat "$work/loopback6.out"; exit 1; }
same_parameters 2 "$work/loopback6.out"
OMP_NUM_THREADS=1 timeout -k 5 90 ip netns exec "${id}h3" "$run" --nproc-per-node 2 \
  --master-addr ::1 --master-port 29757 "$rpc_seed" >"$work/rpc_loopback6.out" 2>&1 ||
  { echo "FAIL: RPC with MASTER_ADDR=::1 on an IPv6-only host"; cat "$work/rpc_loopback6.out"; exit 1; }
rpc_trained "MASTER_ADDR=::1 on an IPv6-only host" "$work/rpc_loopback6.out"
echo "ok: ::1 on a host without IPv4"

# 2. Two IPv6-only hosts.
pids=()
for h in 1 2; do
  OMP_NUM_THREADS=1 timeout -k 5 90 ip netns exec "${id}h$h" "$run" --nnodes 2 --node-rank $(( h - 1 )) \
    --nproc-per-node 1 --master-addr "$net6::1" --master-port 29756 "$train" "${train_args[@]}" \
    >"$work/node$h.out" 2>&1 &
  pids+=($!)
done
for h in 1 2; do wait "${pids[$(( h - 1 ))]}" || { echo "FAIL: host $h"; cat "$work"/node*.out; exit 1; }; done
same_parameters 2 "$work/node1.out" "$work/node2.out"
pids=()
for h in 1 2; do
  OMP_NUM_THREADS=1 timeout -k 5 90 ip netns exec "${id}h$h" "$run" --nnodes 2 --node-rank $(( h - 1 )) \
    --nproc-per-node 1 --master-addr "$net6::1" --master-port 29758 "$rpc_seed" \
    >"$work/rpc_node$h.out" 2>&1 &
  pids+=($!)
done
for h in 1 2; do
  wait "${pids[$(( h - 1 ))]}" || { echo "FAIL: RPC on host $h"; cat "$work"/rpc_node*.out; exit 1; }
done
rpc_trained "two IPv6-only hosts" "$work/rpc_node1.out"
echo "ok: two IPv6-only hosts meeting at $net6::1"

# 3. A host name.
OMP_NUM_THREADS=1 timeout -k 5 90 "$run" --nproc-per-node 2 --master-addr localhost --master-port 0 \
  "$train" "${train_args[@]}" >"$work/localhost.out" 2>&1 ||
  { echo "FAIL: MASTER_ADDR=localhost"; cat "$work/localhost.out"; exit 1; }
same_parameters 2 "$work/localhost.out"
OMP_NUM_THREADS=1 timeout -k 5 90 "$run" --nproc-per-node 2 --master-addr localhost --master-port 0 \
  "$rpc_seed" >"$work/rpc_localhost.out" 2>&1 ||
  { echo "FAIL: RPC with MASTER_ADDR=localhost"; cat "$work/rpc_localhost.out"; exit 1; }
rpc_trained "MASTER_ADDR=localhost" "$work/rpc_localhost.out"
echo "PASS: the store, the mesh and RPC over ::1, across IPv6-only hosts, and at localhost"
