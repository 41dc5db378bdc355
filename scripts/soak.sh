#!/usr/bin/env bash
# Soak with faults: a job runs under `tdist-run --max-restarts` while one of its workers is
# killed (SIGKILL) again and again; each kill restarts the group. Before each kill, the script
# prints what the launcher (the one process that lives through every restart) and each worker
# hold: resident memory (VmRSS), descriptors and threads; and the /dev/shm/tdist-<pid>-* files of
# the workers killed so far. Two workloads, one after the other:
#   train: tdist-train, 2 workers, DDP over shared memory, a checkpoint every 20 steps, --resume
#          (each restart resumes from the last checkpoint);
#   rpc:   tdist-rpc-ps, a parameter server and 2 trainers calling it in a loop over RPC.
# A third workload, flood (never part of "both"), kills nothing: strangers flood every port while
# jobs train. With a token (TDIST_TOKEN, a fresh one when unset), it runs the train job for the
# whole time, rpc jobs one after the other (a parameter server's call to a trainer lasts its whole
# loop, so one job cannot outlive the RPC timeout; each runs 5000 steps per trainer and what its
# workers hold 3 s in is recorded) and short train jobs one after the other (each forms a new
# store and a new mesh, so the mesh's port, open only while a group forms, is flooded too), while
# scripts/flood.py connects to every port any of their processes listens on: connect-and-hold,
# garbage bytes, half handshakes and HELLOs that cannot verify. It prints what every process of
# the train job holds (VmRSS, descriptors, threads, CPU time) at the start and at the end, its
# progress, what the first and the last rpc job's workers held, how many rpc and short jobs ran
# and failed (with their errors), and the flood's counts. With --check: the train job still runs
# at the end and made progress in the second half, no rpc or short job failed, and no process
# grew past the slacks (descriptors and threads: --flood-slack, default 64,
# as many as the strangers may hold open on one port at a time; RSS: the two slacks below).
# The start is measured --settle seconds after the workers started (use 20 or more, so that the
# flood has reached its steady state first).
# Restart 1 warms up (the launcher's first allocations); with --check, every later restart must
# hold whin run 2 held: the launcher the same descriptors and threads and at most
# --rss-slack-kib more memory, each worker rank the same descriptors and at most --worker-slack
# percent more memory; no killed worker's /dev/shm file is left; and once the launcher is stopped
# no worker of any restart still runs. Exits 1 naming what grew.
#
#   scripts/soak.sh [--seconds S | --restarts N] [--workload train|rpc|both|flood] [--check]
#                   [--settle S] [--build DIR] [--rss-slack-kib K] [--worker-slack P]
#                   [--flood-slack N]
#
# --seconds S runs each workload for about S seconds (default: --restarts 5 each); --settle is how
# long each run's workers run before they are measured and one is killed (default 2 s).
# Binaries come from --build (default build/) or TDIST_RUN, TDIST_TRAIN, TDIST_RPC_PS. The CI
# version is `ctest -R Soak` (scripts/soak.sh --restarts 4 --check, about 30 s).
set -uo pipefail

seconds=0; restarts=5; workload=both; check=0; settle=2; build=build
rss_slack_kib=1024; worker_slack=10; flood_slack=64
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
    --flood-slack) flood_slack="$2"; shift 2 ;;
    -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$workload" in train|rpc|both|flood) ;; *) echo "soak.sh: --workload train|rpc|both|flood" >&2; exit 2 ;; esac
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
  if (( failed )); then echo "soak: logs kept in $work"; else rm -rf "$work"; fi
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

# CPU seconds (user + system) a process has run.
cpu_s() { awk '{ printf "%.1f", ($14 + $15) / 100 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
# "pid role rss fds threads cpu" for each process of a long job: its launcher, then its workers.
measure_job() {
  local name="$1" l="$2"; shift 2
  local pids=("$l" "$@") i=0 h role
  while read -r -a h; do
    role=worker; (( i == 0 )) && role=launcher
    echo "$name $role ${pids[i]} ${h[0]} ${h[1]} ${h[2]} $(cpu_s "${pids[i]}")"
    i=$(( i + 1 ))
  done < <(held "$l" "$@")
}

# The flood workload (see the top of the file).
flood_soak() {
  local secs=$(( seconds > 0 ? seconds : 120 )) train_exe ps_exe
  train_exe=$(readlink -f "$train_bin"); ps_exe=$(readlink -f "$ps_bin")
  [[ -n "${TDIST_TOKEN:-}${TDIST_TOKEN_FILE:-}" ]] || export TDIST_TOKEN="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
  echo "== flood: a train job (2 workers) for ${secs} s, rpc jobs (3 workers) and short train jobs one after the other, strangers on every port"
  OMP_NUM_THREADS=1 "$run_bin" --nproc-per-node 2 --master-port 0 "$train_exe" --steps 100000000 \
    --hidden 64 --layers 1 --test-samples 100 --threads 1 --progress log --log-every 100 \
    --checkpoint-dir "$work/ckpt" --checkpoint-every 200 >"$work/train.out" 2>"$work/train.err" &
  local train_l=$!
  # RPC jobs one after the other (a parameter server's call to a trainer lasts its whole loop, so
  # one job cannot outlive the RPC timeout); 3 s into each, what its 3 workers hold is recorded.
  ( local n=0 l kids
    while :; do
      n=$(( n + 1 ))
      OMP_NUM_THREADS=1 "$run_bin" --nproc-per-node 3 --master-port 0 "$ps_exe" --steps 5000 \
        --dim 64 >"$work/rpc.out" 2>"$work/rpc.err" &
      l=$!
      launcher=$l
      if kids=$(wait_for_workers 3 "$ps_exe" ""); then
        sleep 3
        echo "$n $(held $kids | tr '\n' ' ')" >>"$work/rpc.runs"
      fi
      if wait "$l"; then
        echo ok >>"$work/rpc.results"
      else
        { echo "rpc job $n failed:"; grep -iE 'error|fail|timed? ?out' "$work/rpc.err" | grep -vE 'refused the connection|rejected a connection' | head -12; } >>"$work/rpc.failures"
        echo failed >>"$work/rpc.results"
      fi
      sleep 2
    done ) &
  local rpc_l=$!
  # Short jobs: each forms a store and a mesh under the flood; a failed one is kept for the report.
  ( local n=0
    while :; do
      n=$(( n + 1 ))
      if OMP_NUM_THREADS=1 "$run_bin" --nproc-per-node 2 --master-port 0 "$train_exe" --steps 20 \
           --hidden 16 --layers 1 --test-samples 50 --threads 1 >"$work/short.out" 2>"$work/short.err"; then
        echo ok >>"$work/short.results"
      else
        { echo "short job $n failed:"; grep -iE 'error|fail|timed? ?out' "$work/short.err" | grep -vE 'refused the connection|rejected a connection' | head -12; } >>"$work/short.failures"
        echo failed >>"$work/short.results"
      fi
      sleep 2
    done ) &
  local short=$!
  python3 "$(dirname "$0")/flood.py" --pids "$train_l,$rpc_l,$short" --report 300 >"$work/flood.out" 2>&1 &
  local flood=$!
  local train_w rpc_w
  launcher=$train_l; train_w=$(wait_for_workers 2 "$train_exe" "") || fail "flood: the train job's workers did not start"
  launcher=""
  sleep "$settle"
  local t0=$SECONDS
  measure_job train "$train_l" $train_w >"$work/start.txt"
  local steps0; steps0=$(grep -c '^step\|step [0-9]' "$work/train.err" "$work/train.out" | awk -F: '{ s += $2 } END { print s }')
  sleep $(( secs / 2 ))
  local mid_steps mid_cpu=()
  mid_steps=$(grep -c 'step [0-9]' "$work/train.err" "$work/train.out" | awk -F: '{ s += $2 } END { print s }')
  for p in $train_w; do
    mid_cpu+=("$(cpu_s "$p")")
    kill -0 "$p" 2>/dev/null || echo "half-way ($(( SECONDS - t0 )) s): worker $p has ended"
  done
  sleep $(( secs - secs / 2 ))
  measure_job train "$train_l" $train_w >"$work/end.txt"
  local end_steps; end_steps=$(grep -c 'step [0-9]' "$work/train.err" "$work/train.out" | awk -F: '{ s += $2 } END { print s }')
  kill -TERM "$flood" 2>/dev/null; wait "$flood" 2>/dev/null
  kill -TERM "$short" "$rpc_l" 2>/dev/null; wait "$short" "$rpc_l" 2>/dev/null
  echo "after $(( SECONDS - t0 )) s (process role pid: RSS KiB, descriptors, threads, CPU s at the start -> at the end):"
  local a b i=0
  while read -r -a a && read -r -a b <&3; do
    printf '  %-5s %-8s %7s: %6s -> %6s KiB, %3s -> %3s fds, %2s -> %2s threads, %6s -> %6s CPU s\n' \
      "${a[0]}" "${a[1]}" "${a[2]}" "${a[3]}" "${b[3]}" "${a[4]}" "${b[4]}" "${a[5]}" "${b[5]}" "${a[6]}" "${b[6]}"
    if [[ "${a[1]}" == worker ]]; then
      if ! kill -0 "${a[2]}" 2>/dev/null; then
        fail "flood: ${a[0]} worker ${a[2]} ended; its job's errors:"
        grep -iE 'error|fail|timed? ?out|lost' "$work/${a[0]}.err" | grep -vE 'refused the connection|rejected a connection' | head -8
      elif (( check )) && awk -v m="${mid_cpu[i]}" -v e="${b[6]}" 'BEGIN { exit !(e <= m) }'; then
        fail "flood: ${a[0]} worker ${a[2]} made no progress in the second half (CPU ${mid_cpu[i]} -> ${b[6]} s)"
      fi
      i=$(( i + 1 ))
    fi
    if (( check )); then
      # The strangers' connections come and go: a server holds up to --hold of each kind per port
      # at any moment, so equal counts are not expected; growth past that is a leak.
      (( b[4] - a[4] <= flood_slack )) || fail "flood: ${a[0]} ${a[1]} ${a[2]} holds ${b[4]} descriptors, ${a[4]} at the start (slack $flood_slack)"
      (( b[5] - a[5] <= flood_slack )) || fail "flood: ${a[0]} ${a[1]} ${a[2]} runs ${b[5]} threads, ${a[5]} at the start (slack $flood_slack)"
      local slack=$rss_slack_kib
      [[ "${a[1]}" == worker ]] && slack=$(( a[3] * worker_slack / 100 ))
      (( b[3] - a[3] <= slack )) || fail "flood: ${a[0]} ${a[1]} ${a[2]}'s RSS grew from ${a[3]} to ${b[3]} KiB (slack $slack)"
    fi
  done <"$work/start.txt" 3<"$work/end.txt"
  echo "train job: $steps0 -> $mid_steps -> $end_steps progress lines (one per 100 steps) at the start, half-way, the end"
  local ok_n fail_n
  ok_n=$(grep -c '^ok' "$work/short.results" 2>/dev/null); fail_n=$(grep -c '^failed' "$work/short.results" 2>/dev/null)
  echo "short train jobs: ${ok_n:-0} ran to the end, ${fail_n:-0} failed"
  [[ -s "$work/short.failures" ]] && head -30 "$work/short.failures"
  (( check && ${fail_n:-0} > 0 )) && fail "flood: ${fail_n} short jobs failed"
  ok_n=$(grep -c '^ok' "$work/rpc.results" 2>/dev/null); fail_n=$(grep -c '^failed' "$work/rpc.results" 2>/dev/null)
  echo "rpc jobs: ${ok_n:-0} ran to the end, ${fail_n:-0} failed"
  [[ -s "$work/rpc.failures" ]] && head -30 "$work/rpc.failures"
  (( check && ${fail_n:-0} > 0 )) && fail "flood: ${fail_n} rpc jobs failed"
  if [[ -s "$work/rpc.runs" ]]; then
    echo "rpc workers 3 s into each job (run: RSS KiB, descriptors, threads of ps, trainer1, trainer2):"
    echo "  first: $(head -1 "$work/rpc.runs")"
    echo "  last:  $(tail -1 "$work/rpc.runs")"
    local first=($(head -1 "$work/rpc.runs")) last=($(tail -1 "$work/rpc.runs"))
    for (( j = 1; j < ${#first[@]}; j += 3 )); do
      (( check )) && (( last[j + 1] - first[j + 1] > flood_slack )) &&
        fail "flood: an rpc worker holds ${last[j + 1]} descriptors in the last job, ${first[j + 1]} in the first"
    done
  fi
  (( check && end_steps <= mid_steps )) && fail "flood: the train job made no progress in the second half"
  cat "$work/flood.out"
  kill -TERM "$train_l" 2>/dev/null; wait "$train_l" 2>/dev/null
}

if [[ "$workload" == flood ]]; then flood_soak; fi
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
