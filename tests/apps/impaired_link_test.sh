#!/usr/bin/env bash
# Delay and loss on the link between two hosts keep training correct, only slower. Two hosts made
# of network namespaces, each link bridged (in a hub namespace) to a TAP device of
# tests/harness/impaired_link.py, which forwards every frame between the two after a delay and
# drops some at random (the kernel here has no netem). 2 workers of tdist-train per host (DDP's
# gradients take the hierarchical allreduce across the link) train once over a plain forwarder,
# once with 10 ms each way and 1% of the frames dropped: both runs must end with the same
# parameters on every rank, and the forwarder must really have dropped frames.
# Exits 77 (ctest: skipped) with the reason when namespaces or TAP devices cannot be made.
#   impaired_link_test.sh <tdist-run> <tdist-train> <python>
set -uo pipefail
run="$1"; train="$2"; python="$3"
here=$(cd "$(dirname "$0")" && pwd)
id="tdi$$"
net=10.220.$(( $$ % 250 ))
work=$(mktemp -d)
fwd_pid=""
cleanup() {
  [ -n "$fwd_pid" ] && kill "$fwd_pid" 2>/dev/null
  for ns in "${id}h1" "${id}h2" "${id}hub"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT
# Jobs across these hosts need a token (tdist-run refuses a multi-node job beyond loopback
# without one): both tdist-runs share this one, as --token-file would give it.
export TDIST_TOKEN="${TDIST_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
fail() { { echo "FAIL: $*"; for f in "$work"/*; do echo "--- $f"; cat "$f"; done; } >&2; exit 1; }

if ! err=$(ip netns add "${id}hub" 2>&1); then echo "SKIP: cannot create network namespaces here: $err"; exit 77; fi
[ -c /dev/net/tun ] || { echo "SKIP: no /dev/net/tun"; exit 77; }
for i in 1 2; do
  ip netns add "${id}h$i" || exit 1
  ip link add "${id}v$i" netns "${id}h$i" type veth peer name "${id}b$i" netns "${id}hub" ||
    { echo "SKIP: cannot create a veth pair here"; exit 77; }
  ip -n "${id}h$i" addr add "$net.$i/24" dev "${id}v$i"
  ip -n "${id}h$i" link set "${id}v$i" up
  ip -n "${id}h$i" link set lo up
done

start_link() {  # DELAY_MS LOSS: the forwarder, and each host's link bridged to one of its TAPs
  ip netns exec "${id}hub" "$python" "$here/../harness/impaired_link.py" "${id}ta" "${id}tb" \
    --delay-ms "$1" --loss "$2" >"$work/link.out" 2>&1 &
  fwd_pid=$!
  for (( k = 0; k < 100; k++ )); do grep -q ready "$work/link.out" && break; sleep 0.05; done
  grep -q ready "$work/link.out" || { echo "SKIP: cannot create TAP devices: $(cat "$work/link.out")"; exit 77; }
  local i tap
  for i in 1 2; do
    tap=$([ $i = 1 ] && echo "${id}ta" || echo "${id}tb")
    ip -n "${id}hub" link add "br$i" type bridge 2>/dev/null || true
    ip -n "${id}hub" link set "${id}b$i" master "br$i" up
    ip -n "${id}hub" link set "$tap" master "br$i" up
    ip -n "${id}hub" link set "br$i" up
  done
}
stop_link() {  # sets link_counts to the forwarder's counts (not in a subshell: it waits for it)
  kill -TERM "$fwd_pid"; wait "$fwd_pid" 2>/dev/null; fwd_pid=""
  link_counts=$(grep -oE "forwarded [0-9]+ dropped [0-9]+" "$work/link.out")
}

port=29933
train_once() {  # NAME: both hosts' launchers; prints the run's one parameter hash
  local name=$1 h pids=() rc=0 hashes
  port=$((port + 1))
  for h in 1 2; do
    OMP_NUM_THREADS=1 timeout -k 5 240 ip netns exec "${id}h$h" \
      "$run" --nnodes 2 --node-rank $((h - 1)) --nproc-per-node 2 --master-addr "$net.1" \
      --master-port "$port" \
      "$train" --steps 30 --hidden 256 --layers 2 --train-samples 2000 --test-samples 200 \
      --threads 1 --timeout 60 >"$work/$name.$h.out" 2>"$work/$name.$h.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  (( rc == 0 )) || fail "the $name run failed"
  hashes=$(cat "$work/$name".*.out | grep -oE "parameters fnv1a64 [0-9a-f]+" | sort | uniq -c)
  [ "$(wc -l <<<"$hashes")" = 1 ] && grep -q "^ *4 " <<<"$hashes" ||
    fail "the $name run's 4 ranks do not end with one parameter hash: $hashes"
  awk '{print $4}' <<<"$hashes"
}

start_link 0 0
t0=$(date +%s%N)
clean=$(train_once clean) || exit 1
t1=$(date +%s%N)
stop_link; clean_counts=$link_counts
start_link 10 0.01
t2=$(date +%s%N)
impaired=$(train_once impaired) || exit 1
t3=$(date +%s%N)
stop_link; impaired_counts=$link_counts
echo "plain link: $(( (t1 - t0) / 1000000 )) ms ($clean_counts); 10 ms each way and 1% loss: $(( (t3 - t2) / 1000000 )) ms ($impaired_counts)"
dropped=$(awk '{print $4}' <<<"$impaired_counts")
(( ${dropped:-0} > 0 )) || fail "the forwarder dropped no frame"
[ "$clean" = "$impaired" ] || fail "the impaired run ended with other parameters ($impaired) than the clean one ($clean)"
echo "PASS: 10 ms delay and 1% loss: training ended with the same parameters ($clean), only slower"
