# Sourced by tests: "hosts" made of network namespaces on one bridge (the bridge in a namespace
# of its own, so nothing touches the machine's network). The test owns what it creates:
#   netns_hosts ID NET N   creates namespaces ${ID}h1..${ID}hN with addresses NET.1..NET.N/24,
#                          loopback up; exits 77 (ctest: skipped) with the reason when
#                          namespaces or veth pairs cannot be made here
#   netns_host_names I LINE...
#                          /etc/hosts as processes in host I see it (ip netns exec mounts
#                          /etc/netns/<namespace>/hosts over /etc/hosts)
#   netns_cleanup          kills every process left in the hosts and removes them (trap it)
#   netns_test_begin TAG SUBNET N
#                          what a test script does first: sets id (TAG + the script's pid), net
#                          (10.SUBNET.x, x from the pid) and work (a temporary directory), traps
#                          the clean-up of both, and makes N hosts
#   netns_train_two_nodes RUN TRAIN PORT
#                          one tdist-run per host of hosts 1 and 2 (2 nodes x 1 worker of
#                          tdist-train --timeout 3, the store at host 1's PORT) in the background,
#                          output in $work/node<h>.{out,err}, pids in train_pids; returns once
#                          host 1 logged step 30 (exits 1 when it does not within 60 s)
netns_ids=()
netns_cleanup() {
  for ns in "${netns_ids[@]}"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
}
netns_hosts() {
  local id=$1 net=$2 n=$3 err i ns
  # Jobs across these hosts need a token (tdist-run refuses a multi-node job beyond loopback
  # without one): every process started here shares this one, as --token-file would give it.
  export TDIST_TOKEN="${TDIST_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
  if ! err=$(ip netns add "${id}hub" 2>&1); then
    echo "SKIP: cannot create network namespaces here: $err"; exit 77
  fi
  netns_ids+=("${id}hub")
  ip -n "${id}hub" link add br0 type bridge && ip -n "${id}hub" link set br0 up || exit 1
  for (( i = 1; i <= n; i++ )); do
    ns="${id}h$i"
    ip netns add "$ns" || exit 1
    netns_ids+=("$ns")
    if ! err=$(ip link add "${id}v$i" netns "$ns" type veth peer name "${id}b$i" netns "${id}hub" 2>&1); then
      echo "SKIP: cannot create a veth pair here: $err"; exit 77
    fi
    ip -n "${id}hub" link set "${id}b$i" master br0 up || exit 1
    ip -n "$ns" addr add "$net.$i/24" dev "${id}v$i" || exit 1
    ip -n "$ns" link set "${id}v$i" up && ip -n "$ns" link set lo up || exit 1
  done
}
netns_host_names() {
  local i=$1; shift  # netns_ids[0] is the hub, [i] host i
  mkdir -p "/etc/netns/${netns_ids[$i]}"
  printf '%s\n' "127.0.0.1 localhost" "$@" > "/etc/netns/${netns_ids[$i]}/hosts"
}
netns_test_begin() {
  id="$1$$"
  net=10.$2.$(( $$ % 250 ))
  work=$(mktemp -d)
  trap 'netns_cleanup; rm -rf "$work"' EXIT
  netns_hosts "$id" "$net" "$3"
}

netns_train_two_nodes() {
  local run=$1 train=$2 port=$3 h i
  train_pids=()
  for h in 1 2; do
    OMP_NUM_THREADS=1 TDIST_TRAIN_STEP_SLEEP_MS=10 timeout -k 5 120 \
      ip netns exec "${id}h$h" \
      "$run" --nnodes 2 --node-rank $(( h - 1 )) --nproc-per-node 1 --master-addr "$net.1" \
      --master-port "$port" --stop-grace 2 \
      "$train" --steps 100000 --hidden 32 --layers 1 --train-samples 2000 --test-samples 100 \
      --threads 1 --timeout 3 --progress log --log-every 10 >"$work/node$h.out" 2>"$work/node$h.err" &
    train_pids+=($!)
  done
  for (( i = 0; i < 600; i++ )); do grep -q "\] step 30/" "$work/node1.out" && return 0; sleep 0.1; done
  echo "FAIL: training never reached step 30"; cat "$work"/node*; exit 1
}
