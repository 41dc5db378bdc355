#!/usr/bin/env bash
# Soak with faults: a job runs under `tdist-run --max-restarts` while one of its workers is
# killed (SIGKILL) again and again; each kill restarts the group. Before each kill, the script
# prints what the launcher (the one process that lives through every restart) and each worker
# hold: resident memory (VmRSS), descriptors and threads; and the /dev/shm/tdist-<pid>-* files of
# the workers killed so far. Two workloads, one after the other:
#   train: tdist-train, 2 workers, DDP over shared memory, a checkpoint every 20 steps, --resume
#          (each restart resumes from the last checkpoint);
#   rpc:   tdist-rpc-ps, a parameter server and 2 trainers calling it in a loop over RPC.
# Restart 1 warms up (the launcher's first allocations); with --check, every later restart must
# hold whin run 2 held: the launcher the same descriptors and threads and at most
# --rss-slack-kib more memory, each worker rank the same descriptors and at most --worker-slack
# percent more memory; no killed worker's /dev/shm file is left; and once the launcher is stopped
# no worker of any restart still runs. Exits 1 naming what grew.
#
#   scripts/soak.sh [--seconds S | --restarts N] [--workload train|rpc|both] [--check]
#                   [--settle S] [--build DIR] [--rss-slack-kib K] [--worker-slack P]
#
# --seconds S runs each workload for about S seconds (default: --restarts 5 each); --settle is how
# long each run's workers run before they are measured and one is killed (default 2 s).
# Binaries come from --build (default build/) or TDIST_RUN, TDIST_TRAIN, TDIST_RPC_PS. The CI
# version is `ctest -R Soak` (scripts/soak.sh --restarts 4 --check, about 30 s).
set -uo pipefail

seconds=0; restarts=5; workload=both; check=0; settle=2; build=build
rss_slack_kib=1024; worker_slack=10
while (( $# )); do
  case "$1" in
    --seconds) seconds="$2"; restarts=0; shift 2 ;;
    --restarts) restarts="$2"; seconds=0; shift 2 ;;
    --workload) workload="$2"; shift 2 ;;
    --check) check=1; shift ;;
    --settle) settle="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --rss-slack-kib) rss_slack_kib="$2"; shift 2 ;;
    --worker-slack) worker_slack="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$workload" in train|rpc|both) ;; *) echo "soak.sh: --workload train|rpc|both" >&2; exit 2 ;; esac
run_bin="${TDIST_RUN:-$build/apps/tdist-run}"
train_bin="${TDIST_TRAIN:-$build/apps/tdist-train}"
ps_bin="${TDIST_RPC_PS:-$build/apps/rpc_demos/tdist-rpc-ps}"
for b in "$run_bin" "$train_bin" "$ps_bin"; do
  [[ -x "$b" ]] || { echo "soak.sh: no executable $b (build it, or set --build)" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/tdist-soak-XXXXXX")
launcher=""
cleanup() {
  if [[ -n "$launcher" ]] && kill -0 "$launcher" 2>/dev/null; then
    kill -TERM "$launcher" 2>/dev/null; wait "$launcher" 2>/dev/null
  fi
  rm -rf "$work"
}
trap cleanup EXIT
failed=0
fail() { echo "FAIL: $*"; failed=1; }

status_kib() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status" 2>/dev/null; }
fd_count() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }
# For each pid, one line "rss fds threads": the least of 5 readings 0.1 s apart, i.e. what it
# holds for good, not for a moment (a checkpoint being written, a connection being made).
held() {
  local -a rss fds thr; local i j r f t
  for (( i = 0; i < 5; i++ )); do
    j=0
    for p in "$@"; do
      r=$(status_kib "$p" VmRSS); f=$(fd_count "$p"); t=$(status_kib "$p" Threads)
      r=${r:-0}; t=${t:-0}
      if (( i == 0 || r < rss[j] )); then rss[j]=$r; fi
      if (( i == 0 || f < fds[j] )); then fds[j]=$f; fi
      if (( i == 0 || t < thr[j] )); then thr[j]=$t; fi
      j=$(( j + 1 ))
    done
    sleep 0.1
  done
  for (( j = 0; j < $#; j++ )); do echo "${rss[j]} ${fds[j]} ${thr[j]}"; done
}
children() { cat /proc/"$1"/task/*/children 2>/dev/null | tr ' ' '\n' | grep -v '^$' | sort -n; }

# The launcher's children once there are `n` of them, none of the previous restart, each
# running `exe` (not a fork still on its way to exec).
wait_for_workers() {
  local n="$1" exe="$2" prev="$3" deadline=$(( SECONDS + 60 ))
  while (( SECONDS < deadline )); do
    kill -0 "$launcher" 2>/dev/null || return 1
    local kids=($(children "$launcher")) ok=1
    if (( ${#kids[@]} == n )); then
      for k in "${kids[@]}"; do
        [[ " $prev " == *" $k "* ]] && ok=0
        [[ "$(readlink "/proc/$k/exe" 2>/dev/null)" == "$exe" ]] || ok=0
      done
      (( ok )) && { echo "${kids[*]}"; return 0; }
    fi
    sleep 0.05
  done
  return 1
}

# soak_one NAME NPROC EXE ARGS...: runs the job, kills a worker per restart, prints and checks.
soak_one() {
  local name="$1" nproc="$2" exe; exe=$(readlink -f "$3"); shift 3
  local out="$work/$name.out" err="$work/$name.err"
  echo "== $name: $nproc workers under tdist-run --max-restarts; SIGKILL one per restart"
  OMP_NUM_THREADS=1 "$run_bin" --nproc-per-node "$nproc" --master-port 0 --max-restarts 100000 \
    --stop-grace 1 "$exe" "$@" >"$out" 2>"$err" &
  launcher=$!
  local start=$SECONDS gen=0 prev="" all_workers="" killed="" base_l="" base_w=()
  while :; do
    gen=$(( gen + 1 ))
    local pids
    if ! pids=$(wait_for_workers "$nproc" "$exe" "$prev"); then
      fail "$name: the workers of run $gen did not start"; tail -20 "$err"; break
    fi
    sleep "$settle"
    local kids=($pids) line="" wl="" ok=1
    for k in "${kids[@]}"; do kill -0 "$k" 2>/dev/null || ok=0; done
    if (( ! ok )); then fail "$name: a worker of run $gen ended by itself"; tail -20 "$err"; break; fi
    local l_rss l_fd l_thr shm=0 h w_rss=() w_fd=() i=0
    while read -r -a h; do
      if (( i == 0 )); then l_rss=${h[0]}; l_fd=${h[1]}; l_thr=${h[2]}
      else w_rss+=("${h[0]}"); w_fd+=("${h[1]}"); fi
      i=$(( i + 1 ))
    done < <(held "$launcher" "${kids[@]}")
    for k in $killed; do shm=$(( shm + $(ls /dev/shm 2>/dev/null | grep -c "^tdist-$k-") )); done
    printf 'run %d (%ds): launcher %s KiB, %s fds, %s threads | workers %s KiB, %s fds | /dev/shm files of killed workers: %d\n' \
      "$gen" $(( SECONDS - start )) "$l_rss" "$l_fd" "$l_thr" "$(IFS=,; echo "${w_rss[*]}")" \
      "$(IFS=,; echo "${w_fd[*]}")" "$shm"
    if (( gen == 2 )); then
      base_l="$l_rss $l_fd $l_thr"; base_w=("${w_rss[@]}" "${w_fd[@]}")
    elif (( gen > 2 && check )); then
      local b=($base_l)
      (( l_fd == b[1] )) || fail "$name run $gen: the launcher holds $l_fd descriptors, ${b[1]} in run 2"
      (( l_thr == b[2] )) || fail "$name run $gen: the launcher runs $l_thr threads, ${b[2]} in run 2"
      (( l_rss - b[0] <= rss_slack_kib )) ||
        fail "$name run $gen: the launcher's RSS grew from ${b[0]} to $l_rss KiB (slack $rss_slack_kib)"
      for (( r = 0; r < nproc; r++ )); do
        (( w_fd[r] == base_w[nproc + r] )) ||
          fail "$name run $gen: rank $r holds ${w_fd[r]} descriptors, ${base_w[nproc + r]} in run 2"
        (( w_rss[r] * 100 <= base_w[r] * (100 + worker_slack) )) ||
          fail "$name run $gen: rank $r's RSS is $((w_rss[r])) KiB, ${base_w[r]} in run 2 (slack $worker_slack%)"
      done
    fi
    (( check && shm > 0 )) && fail "$name run $gen: $shm /dev/shm files of killed workers are left"
    all_workers="$all_workers $pids"; prev="$pids"
    local done_=0
    if (( seconds > 0 )); then (( SECONDS - start >= seconds )) && done_=1
    else (( gen > restarts )) && done_=1; fi
    if (( done_ )); then break; fi
    # Kill the ranks in turn: 0, 1, ..., so that every role dies (the store host and the server
    # on rank 0 too).
    local victim=${kids[$(( (gen - 1) % nproc ))]}
    kill -KILL "$victim"; killed="$killed $victim"
  done
  kill -TERM "$launcher" 2>/dev/null; wait "$launcher" 2>/dev/null; launcher=""
  for k in $all_workers; do
    if kill -0 "$k" 2>/dev/null && [[ "$(readlink "/proc/$k/exe" 2>/dev/null)" == "$exe" ]]; then
      fail "$name: worker pid $k still runs after its launcher ended"
    fi
  done
  grep -c "restarting all workers" "$err" | sed "s/^/$name: restarts seen by the launcher: /"
}

if [[ "$workload" == train || "$workload" == both ]]; then
  soak_one train 2 "$train_bin" --steps 100000000 --hidden 64 --layers 1 --test-samples 100 \
    --threads 1 --progress log --log-every 100 --checkpoint-dir "$work/ckpt" \
    --checkpoint-every 20 --resume
fi
if [[ "$workload" == rpc || "$workload" == both ]]; then
  soak_one rpc 3 "$ps_bin" --steps 1000000000 --dim 64
fi
if (( failed )); then echo "soak: FAILED"; exit 1; fi
echo "soak: PASS$( (( check )) || echo ' (nothing checked; --check compares the restarts)')"
