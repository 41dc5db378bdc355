#!/usr/bin/env bash
# The elastic scenario of Note [Elastic rendezvous] with tdist-train on four "hosts" made of
# network namespaces on one bridge, one tdist-run --nnodes 2:4 per host:
#   1. hosts 1-3 start (host 1 serves the rendezvous store); training runs at world size 3;
#   2. host 3 dies (every process in it SIGKILLed): hosts 1-2 go on at world size 2 from the
#      last checkpoint;
#   3. host 4 joins: the next round has 3 workers and resumes from the checkpoint again;
#   4. every final worker ends with the same parameters, and those equal a replay of the same
#      world-size history (3 up to the first resumed step, 2 up to the second, then 3) by
#      single-node runs on loopback that stop at those steps (Note [Elastic resume]).
# Exits 77 (ctest: skipped) with the reason when namespaces cannot be made.
#   elastic_netns_test.sh <tdist-run> <tdist-train>
set -uo pipefail
run="$1"; train="$2"
source "$(dirname "$0")/../harness/netns_hosts.sh"
port=29711
fail() { echo "FAIL: $*"; for f in "$work"/*.out "$work"/*.err; do echo "--- $f"; cat "$f"; done; exit 1; }
netns_test_begin tde 216 4

train_args=(--hidden 32 --layers 1 --train-samples 2400 --test-samples 200 --batch-size 8
            --epochs 2 --threads 1 --progress log --log-every 5 --checkpoint-every 5 --resume)
node() {  # node <host number>: one launcher in that host, in the background
  OMP_NUM_THREADS=1 TDIST_TRAIN_STEP_SLEEP_MS=20 timeout -k 5 150 \
    ip netns exec "${id}h$1" "$run" --nnodes 2:4 --nproc-per-node 1 \
      --rdzv-endpoint "$net.1:$port" --rdzv-id netns --rdzv-last-call 1 \
      --rdzv-keep-alive-interval 0.2 --rdzv-keep-alive-timeout 2 --stop-grace 2 \
      --rdzv-join-timeout 60 --max-restarts 3 \
      "$train" "${train_args[@]}" --checkpoint-dir "$work/ckpt" >"$work/node$1.out" 2>"$work/node$1.err" &
}
# wait_for <seconds> <command...>: polls the command every 0.1 s until it succeeds
wait_for() {
  local limit=$(( $1 * 10 )); shift
  for (( i = 0; i < limit; i++ )); do "$@" && return 0; sleep 0.1; done
  return 1
}
# The last step rank 0 reported in node 1's output since the workers last started (0: none).
last_step() {
  local s
  s=$(tac "$work/node1.out" | sed '/resumed from\|no checkpoint in/q' | grep -oE '\] step [0-9]+' |
      head -1 | grep -oE '[0-9]+$')
  echo "${s:-0}"
}
reached() { [ "$(last_step)" -ge "$1" ]; }
# The steps the workers resumed at, in order.
resumed_steps() { grep -oE "\] resumed from [^ ]+ at step [0-9]+" "$work/node1.out" | grep -oE '[0-9]+$'; }

node 1; p1=$!
wait_for 30 ip netns exec "${id}h2" bash -c "exec 3<>/dev/tcp/$net.1/$port" 2>/dev/null ||
  fail "host 1 never served the rendezvous store"
node 2; p2=$!
node 3; disown $!  # killed below: no job report
wait_for 60 grep -q "of 3 (world size 3)" "$work/node1.err" || fail "no round of 3 nodes"
wait_for 60 reached 20 || fail "the 3-node round never reached step 20"

# Host 3 dies.
ip netns pids "${id}h3" | xargs -r kill -9
wait_for 60 grep -q "continuing at world size 2" "$work/node1.out" || fail "no resume at world size 2"
first=$(resumed_steps | tail -1)
wait_for 60 reached $(( first + 20 )) || fail "the 2-node round never made 20 steps"

# Host 4 joins.
node 4; p4=$!
wait_for 60 grep -q "continuing at world size 3" "$work/node1.out" || fail "no resume at world size 3"

wait $p1; r1=$?; wait $p2; r2=$?; wait $p4; r4=$?
(( r1 == 0 && r2 == 0 && r4 == 0 )) || fail "launchers exited $r1 $r2 $r4 (hosts 1, 2, 4)"

steps=($(resumed_steps))
(( ${#steps[@]} == 2 )) || fail "expected two resumes, saw ${#steps[@]}: ${steps[*]}"
s1=${steps[0]}; s2=${steps[1]}
cat "$work"/node{1,2,4}.out | grep -E "\] rank [0-9] of 3: trained" > "$work/final"
(( $(wc -l < "$work/final") == 3 )) || fail "expected 3 final workers: $(cat "$work/final")"
hashes=$(grep -oE "fnv1a64 [0-9a-f]+" "$work/final" | sort -u)
(( $(echo "$hashes" | wc -l) == 1 )) || fail "the final workers differ: $hashes"
grep -q "round 1: node rank 0 of 2 (world size 2)" "$work/node1.err" || fail "no round of the 2 survivors"
echo "elastic: world 3 -> 2 at step $s1 -> 3 at step $s2; final $hashes"

# The same history on loopback: world 3 stopped at step s1, world 2 from s1 to s2, 3 to the end.
# With the same reduction: processes of one host would share DDP's buckets (symmetric memory,
# Note [DDP bucketing] 12), whose allreduce adds in another order than the ring's across hosts.
standalone() {  # standalone <nproc> [env...]
  local n=$1; shift
  env OMP_NUM_THREADS=1 TDIST_SINGLE_COPY=0 "$@" timeout -k 5 120 "$run" --standalone \
    --nproc-per-node "$n" \
    --stop-grace 2 "$train" "${train_args[@]}" --checkpoint-dir "$work/replay"
}
# Rank 0 is the one that stops: it has written the checkpoint of that step by then (another rank
# could die before rank 0 wrote it, and the launcher would stop rank 0 before it does).
standalone 3 TDIST_TRAIN_FAIL_AT_STEP=$s1 TDIST_TRAIN_FAIL_RANK=0 >"$work/replay1.out" 2>&1
standalone 2 TDIST_TRAIN_FAIL_AT_STEP=$s2 TDIST_TRAIN_FAIL_RANK=0 >"$work/replay2.out" 2>&1
grep -q "resumed from [^ ]* at step $s1 " "$work/replay2.out" || fail "the replay did not resume at step $s1"
standalone 3 >"$work/replay3.out" 2>&1 || fail "the replay's last run failed"
grep -q "at step $s2 " "$work/replay3.out" || fail "the replay did not resume at step $s2"
want=$(grep -oE "fnv1a64 [0-9a-f]+" "$work/replay3.out" | sort -u)
[ "$want" = "$hashes" ] || fail "elastic run ended with $hashes, its history replayed with $want"
echo "PASS: 3 hosts -> host 3 killed -> 2 -> host 4 joins -> 3; parameters equal the replay's"
