#!/usr/bin/env bash
# Allreduce across two hosts made of network namespaces, several ranks each, their link shaped
# with tc tbf: tdist's hierarchical allreduce, tdist's flat ring and torch.distributed's Gloo on
# the same hosts in one run, each row beside the link's bound measured in the same run (a plain
# TCP stream between the hosts; Note [Collective bounds] in apps/bench/collective.cpp).
#
#   scripts/bench_hosts.sh [--build DIR] [--rate 1gbit] [--nproc 2] [-b 1M] [-e 64M] [-f 4]
#                          [-n 10] [-w 2] [--json FILE] [--check]
#
# --check (a test): small sizes, and fails unless every result is right and the hierarchical run
# really grouped 2 hosts of --nproc ranks. With --nproc 1 there is no hierarchy: both tdist runs
# are the flat algorithms (the TCP figure of one rank per host). Needs root (ip netns, tc); exits 77 where namespaces
# cannot be made.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
build="$root/build"; rate=1gbit; nproc=2; min=1M; max=64M; factor=4; iters=10; warmup=2
json=""; check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --nproc) nproc=$2; shift 2 ;;
    -b) min=$2; shift 2 ;;
    -e) max=$2; shift 2 ;;
    -f) factor=$2; shift 2 ;;
    -n) iters=$2; shift 2 ;;
    -w) warmup=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    --check) check=1; min=256K; max=1M; iters=3; warmup=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
run="$build/apps/tdist-run"
# Jobs across these hosts need a token (tdist-run refuses a multi-node job beyond loopback
# without one): both tdist-runs share this one, as --token-file would give it.
export TDIST_TOKEN="${TDIST_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
bench="$build/apps/bench/tdist-bench"
for f in "$run" "$bench"; do [ -x "$f" ] || { echo "not built: $f" >&2; exit 1; }; done

. "$root/tests/harness/netns_hosts.sh"
netns_test_begin tdh 214 2
world=$((2 * nproc))
for i in 1 2; do
  # Each host's side of its veth pair: all it sends to the other host leaves through it.
  ip netns exec "${id}h$i" tc qdisc add dev "${id}v$i" root tbf rate "$rate" burst 256kb latency 50ms ||
    { echo "cannot shape the link with tc tbf"; exit 1; }
done
port=$((20000 + $$ % 20000))

tdist_run() {  # ALGO: both hosts' tdist-run; rank 0's JSON in $work/ALGO.json
  local algo=$1 i pids=() rc=0
  port=$((port + 1))
  for i in 1 2; do
    ip netns exec "${id}h$i" env OMP_NUM_THREADS=1 TDIST_ALLREDUCE_ALGO="$algo" TDIST_LOG_LEVEL=debug \
      timeout 900 "$run" --nnodes 2 --nproc-per-node "$nproc" --node-rank $((i - 1)) \
      --master-addr "$net.1" --master-port "$port" \
      "$bench" collective --op allreduce -b "$min" -e "$max" -f "$factor" -n "$iters" -w "$warmup" \
      --json "$work/$algo.json" >"$work/$algo.$i.out" 2>"$work/$algo.$i.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ $rc -ne 0 ]; then echo "FAIL: tdist ($algo)"; cat "$work/$algo".*.out "$work/$algo".*.err; exit 1; fi
}

gloo_run() {  # torch.distributed's Gloo, the same ranks on the same hosts
  local i l rank pids=() rc=0
  port=$((port + 1))
  for i in 1 2; do
    for ((l = 0; l < nproc; ++l)); do
      rank=$(((i - 1) * nproc + l))
      ip netns exec "${id}h$i" env OMP_NUM_THREADS=1 RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$l \
        MASTER_ADDR="$net.1" MASTER_PORT="$port" GLOO_SOCKET_IFNAME="${id}v$i" \
        timeout 900 "$python" "$here/bench_gloo.py" --worker --op allreduce --min-bytes "$min" \
        --max-bytes "$max" --step-factor "$factor" --iters "$iters" --warmup "$warmup" \
        --json "$work/gloo.json" >"$work/gloo.$rank.out" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ $rc -ne 0 ]; then echo "FAIL: gloo"; cat "$work"/gloo.*.out; exit 1; fi
}

tdist_run hierarchical
tdist_run ring
[ $check -eq 1 ] || gloo_run

if [ "$nproc" -ge 2 ] && ! grep -q "2 hosts of $nproc ranks: hierarchical allreduce" "$work"/hierarchical.*.err; then
  echo "FAIL: the hierarchical run did not find 2 hosts of $nproc ranks"; cat "$work"/hierarchical.*.err; exit 1
fi
"$python" - "$work" "$rate" "$nproc" "$check" "$json" <<'EOF'
import json, os, sys
work, rate, nproc, check, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
load = lambda name: json.load(open(os.path.join(work, name + ".json")))
hier, ring = load("hierarchical"), load("ring")
gloo = None if check else load("gloo")
print(f"# allreduce float32 sum, 2 hosts x {nproc} ranks (network namespaces), link shaped to {rate} "
      f"each way; bound: {hier['bound']}, measured in this run")
head = ["bytes", "hier(us)", "hier_busbw", "bound", "hier/bound", "ring(us)", "hier/ring"]
if gloo: head += ["gloo(us)", "hier/gloo"]
print("#" + " ".join(f"{h:>11}" for h in head) + "  wrong")
wrong = 0
rows = []
for i, h in enumerate(hier["rows"]):
    r = ring["rows"][i]
    row = {"bytes": h["bytes"], "hier_us": h["time_us"], "hier_busbw_gbs": h["busbw_gbs"],
           "bound_gbs": h["bound_gbs"], "hier_over_bound": h["busbw_over_bound"],
           "ring_us": r["time_us"], "hier_over_ring": r["time_us"] / h["time_us"]}
    cells = [h["bytes"], h["time_us"], h["busbw_gbs"], h["bound_gbs"], h["busbw_over_bound"],
             r["time_us"], row["hier_over_ring"]]
    w = h["wrong"] + r["wrong"]
    if gloo:
        g = gloo["rows"][i]
        assert g["bytes"] == h["bytes"]
        row["gloo_us"] = g["time_us"]
        row["hier_over_gloo"] = g["time_us"] / h["time_us"]
        cells += [g["time_us"], row["hier_over_gloo"]]
        w += g.get("wrong", 0)
    wrong += w
    rows.append(row)
    print(" " + " ".join(f"{c:>11}" if isinstance(c, int) else f"{c:>11.3f}" for c in cells) + f"  {w}")
if out:
    json.dump({"rate": rate, "nproc": nproc, "bound": hier["bound"], "rows": rows}, open(out, "w"), indent=1)
if wrong:
    print(f"FAIL: {wrong} wrong results"); sys.exit(1)
if check:
    print("PASS: hierarchical and flat allreduce right across 2 hosts")
EOF
