#!/usr/bin/env bash
# Slurm's environment on two hosts made of network namespaces, named node1 and node2 in each
# host's /etc/hosts, with nothing but Slurm's variables (no MASTER_ADDR, RANK, ...):
#   1. srun --nodes 2 --ntasks-per-node 2 tdist-train ...: four tasks, two per host;
#   2. srun --nodes 2 --ntasks-per-node 1 tdist-run --nproc-per-node 2 tdist-train ...: one
#      launcher per host.
# The job token netns_hosts exports is passed on (a job beyond loopback needs one).
# Each time the four ranks train together (rank 0 on node1, found from SLURM_STEP_NODELIST
# "node[1-2]") and end with the same parameters. Exits 77 (ctest: skipped) with the reason
# when namespaces cannot be made.
#   slurm_netns_test.sh <tdist-run> <tdist-train>
set -uo pipefail
run="$1"; train="$2"
source "$(dirname "$0")/../harness/netns_hosts.sh"
netns_test_begin tds 217 2
for h in 1 2; do netns_host_names $h "$net.1 node1" "$net.2 node2"; done

train_args=(--steps 10 --hidden 32 --layers 1 --test-samples 200 --train-samples 2000 --progress none)
# task <host> <output> VAR=VALUE... -- command...: one Slurm task in that host, in the background
task() {
  local host=$1 out=$2; shift 2
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  env -i PATH="$PATH" TDIST_TOKEN="$TDIST_TOKEN" OMP_NUM_THREADS=1 SLURM_STEP_NODELIST="node[1-2]" SLURM_JOB_NODELIST="node[1-2]" \
    SLURM_STEP_NUM_NODES=2 "${vars[@]}" timeout -k 5 120 ip netns exec "${id}h$host" "$@" \
    >"$out" 2>&1 &
}
# check <what> <files...>: ranks 0-3 each trained 10 steps in a world of 4, with one parameter hash
check() {
  local what=$1; shift
  for r in 0 1 2 3; do
    grep -q "rank $r of 4: trained 10 steps" "$@" || { echo "FAIL ($what): no rank $r"; cat "$@"; exit 1; }
  done
  local n
  n=$(cat "$@" | grep -oE "parameters fnv1a64 [0-9a-f]+" | sort -u | wc -l)
  (( n == 1 )) || { echo "FAIL ($what): the ranks ended with $n different parameter sets"; cat "$@"; exit 1; }
}

# 1. Four tdist-train tasks (job 4101: port 20000 + 4101 on node1).
pids=()
for r in 0 1 2 3; do
  task $(( r / 2 + 1 )) "$work/task$r.out" SLURM_JOB_ID=4101 SLURM_PROCID=$r SLURM_NTASKS=4 \
    SLURM_LOCALID=$(( r % 2 )) SLURM_NTASKS_PER_NODE=2 SLURM_NODEID=$(( r / 2 )) -- "$train" "${train_args[@]}"
  pids+=($!)
done
for r in 0 1 2 3; do wait "${pids[$r]}" || { echo "FAIL: task $r exited $?"; cat "$work"/task*.out; exit 1; }; done
check "srun tdist-train" "$work"/task{0,1,2,3}.out
grep -q "rank 2 of 4" "$work/task2.out" || { echo "FAIL: task 2 is not rank 2"; exit 1; }

# 2. One tdist-run per host (job 4102), two workers each.
pids=()
for n in 0 1; do
  task $(( n + 1 )) "$work/node$n.out" SLURM_JOB_ID=4102 SLURM_PROCID=$n SLURM_NTASKS=2 \
    SLURM_LOCALID=0 SLURM_NODEID=$n -- "$run" --nproc-per-node 2 "$train" "${train_args[@]}"
  pids+=($!)
done
for n in 0 1; do wait "${pids[$n]}" || { echo "FAIL: node $n exited $?"; cat "$work"/node*.out; exit 1; }; done
check "srun tdist-run" "$work"/node{0,1}.out
grep -q "^\[rank 0\]" "$work/node0.out" && grep -q "^\[rank 3\]" "$work/node1.out" ||
  { echo "FAIL: ranks 0-1 belong on node1, 2-3 on node2"; cat "$work"/node*.out; exit 1; }
echo "PASS: srun tdist-train and srun tdist-run across two namespace hosts from Slurm's variables"
