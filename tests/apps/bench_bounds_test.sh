#!/usr/bin/env bash
# tdist-bench prints its bound beside its figure: brief runs of each mode at tiny sizes, whose
# table and JSON must carry the bound and the ratio columns with positive, finite values that
# vary with the size (a bound copied from one row to the others, or a ratio that is not
# figure / bound, fails); bad flags exit 2 with the reason.
#   bench_bounds_test.sh MODE <tdist-run> <tdist-bench> <python> <plot_bench.py>
# MODE: collective-shm, collective-tcp, anchor-mpi (exit 77, ctest's skip, without mpirun),
#       anchor-gloo, scripts, ddp, pipeline, rpc, net, bad-flags, plot.
set -euo pipefail
mode="$1"; run="$2"; bench="$3"; python="$4"; plot="$5"
work="$(mktemp -d "${TMPDIR:-/tmp}/tdist-bench-bounds-XXXXXX")"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1

collective() {  # collective <extra args...>: world 2, 4K..64K, rows in $work/c.json
  timeout 120 "$run" --standalone --nproc-per-node 2 "$bench" collective --op allreduce \
    --min-bytes 4K --max-bytes 64K --step-factor 4 --iters 3 --warmup 1 --json "$work/c.json" \
    "$@" >"$work/c.out"
  cat "$work/c.out"
}

# check_collective <bound name> [anchor]: the JSON rows and the printed table.
check_collective() {
  "$python" - "$work/c.json" "$work/c.out" "$1" "${2:-none}" <<'EOF'
import json, math, os, re, sys
data, bound_name, anchor = json.load(open(sys.argv[1])), sys.argv[3], sys.argv[4]
table = re.sub(r"(?m)^\[rank \d+\] ", "", open(sys.argv[2]).read())  # tdist-run's prefix
rows = data["rows"]
assert len(rows) == 3, rows
assert data["bound"].startswith(bound_name), data["bound"]
assert data["anchor"] == anchor, data["anchor"]
ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
for r in rows:
    assert r["wrong"] == 0, r
    for k in ["busbw_gbs", "bound_gbs", "busbw_over_bound"]:
        assert ok(r[k]), (k, r)
    assert abs(r["busbw_over_bound"] - r["busbw_gbs"] / r["bound_gbs"]) <= 1e-6 * r["busbw_over_bound"], r
    if anchor != "none":
        for k in ["anchor_time_us", "anchor_busbw_gbs", "busbw_over_anchor"]:
            assert ok(r[k]), (k, r)
        assert abs(r["busbw_over_anchor"] - r["anchor_time_us"] / r["time_us"]) <= 1e-6 * r["busbw_over_anchor"], r
# Measured per row: not one figure for all (two cache-resident sizes may time alike).
assert len({r["bound_gbs"] for r in rows}) >= 2, "the bound is the same in every row"
# The cross-core copy beside the memcpy bound (shared memory, two CPUs or more): in every row or
# in none, positive, busbw over it, measured per row.
xcore = [r for r in rows if "xcore_gbs" in r]
assert len(xcore) in (0, len(rows)), rows
if bound_name == "single-thread memcpy" and len(os.sched_getaffinity(0)) >= 2:
    assert xcore, "no cross-core copy with two CPUs"
for r in xcore:
    assert ok(r["xcore_gbs"]) and ok(r["busbw_over_xcore"]), r
    assert abs(r["busbw_over_xcore"] - r["busbw_gbs"] / r["xcore_gbs"]) <= 1e-6 * r["busbw_over_xcore"], r
assert not xcore or len({r["xcore_gbs"] for r in rows}) >= 2, "the cross-core copy is the same in every row"
# The printed table: the columns by name, and the same values per row.
header = [l for l in table.splitlines() if l.startswith("#") and "bound(GB/s)" in l]
assert header, "no bound column in the table"
cols = header[0].lstrip("#").split()
want = ["bound(GB/s)", "bus/bound"] + ([f"{anchor}(us)", f"bus/{anchor}"] if anchor != "none" else [])
want += ["xcore(GB/s)", "bus/xcore"] if xcore else []
assert ("xcore(GB/s)" in cols) == bool(xcore), cols
for c in want:
    assert c in cols, (c, cols)
lines = [l.split() for l in table.splitlines() if l and not l.startswith("#")]
assert len(lines) == len(rows), lines
for fields, r in zip(lines, rows):
    assert len(fields) == len(cols), (fields, cols)
    for c in want:
        assert float(fields[cols.index(c)]) > 0, (c, fields)
    assert abs(float(fields[cols.index("bound(GB/s)")]) - r["bound_gbs"]) <= 0.0005 + 1e-3 * r["bound_gbs"]
    if xcore:
        assert abs(float(fields[cols.index("xcore(GB/s)")]) - r["xcore_gbs"]) <= 0.0005 + 1e-3 * r["xcore_gbs"]
print("collective table ok:", data["bound"])
EOF
  check_round_trip "$work/c.json" "$work/c.out" "the rows"
}

# check_round_trip <json> <output> <what>: the core-to-core round trip measured before and after
# <what> (Note [Core-to-core round trip]), in the JSON and as printed, wherever two CPUs are there
# to measure it.
check_round_trip() {
  "$python" - "$@" <<'EOF'
import json, math, os, re, sys
data, what = json.load(open(sys.argv[1])), sys.argv[3]
text = re.sub(r"(?m)^\[rank \d+\] ", "", open(sys.argv[2]).read())
trip = data["core_round_trip"]
ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
if len(os.sched_getaffinity(0)) >= 2:
    assert trip and ok(trip["before_ns"]) and ok(trip["after_ns"]) and len(set(trip["cpus"])) == 2, trip
    line = (f"core-to-core round trip of a cache line (CPUs {trip['cpus'][0]} and {trip['cpus'][1]}): "
            f"{trip['before_ns']:.0f} ns before {what}, {trip['after_ns']:.0f} ns after")
    assert line in text, (line, text)
else:
    assert trip is None and "core-to-core round trip: not measured" in text, trip
print("core-to-core round trip ok:", trip)
EOF
}

expect_usage_error() {  # expect_usage_error <text in stderr> <command...>
  local text="$1" rc=0 err
  shift
  err="$("$@" 2>&1 >/dev/null)" || rc=$?
  [ "$rc" = 2 ] || { echo "FAIL: exit $rc (expected 2) from: $*"; echo "$err"; exit 1; }
  grep -qF -- "$text" <<<"$err" || { echo "FAIL: expected '$text' in: $err"; exit 1; }
  echo "usage error ok: $*"
}

case "$mode" in
  collective-shm)
    collective
    check_collective "single-thread memcpy"
    ;;
  collective-tcp)
    TDIST_TRANSPORT=tcp collective
    check_collective "plain TCP stream rank 0 -> rank 1 (127.0.0.1)"
    ;;
  anchor-mpi)
    command -v mpirun >/dev/null || { echo "SKIP: mpirun not installed"; exit 77; }
    [ -x "$(dirname "$bench")/tdist-bench-mpi" ] || { echo "SKIP: tdist-bench-mpi not built (no MPI at configure time)"; exit 77; }
    collective --anchor mpi
    check_collective "single-thread memcpy" mpi
    ;;
  anchor-gloo)
    "$python" -c "import torch.distributed" 2>/dev/null || { echo "SKIP: no torch for $python"; exit 77; }
    collective --anchor gloo --python "$python"
    check_collective "single-thread memcpy" gloo
    ;;
  ddp)
    # Gradients as bucket views here: the default path is the one every other DDP test takes.
    timeout 150 "$bench" ddp --world-size 2 --iters 6 --warmup 2 --hidden 16 --layers 1 --rounds 1 \
      --no-torch --gradient-as-bucket-view --json "$work/d.json" | tee "$work/d.out"
    "$python" - "$work/d.json" "$work/d.out" <<'EOF'
import json, math, sys
data, text = json.load(open(sys.argv[1])), open(sys.argv[2]).read()
worlds = {w["world"]: w for w in data["worlds"]}
assert sorted(worlds) == [1, 2], worlds
assert data["gradient_as_bucket_view"] is True and "gradients as bucket views" in text, data
ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
for w in worlds.values():
    assert ok(w["bound"]["samples_per_s"]) and ok(w["tdist"]["samples_per_s"]), w
    assert abs(w["tdist_over_bound"] - w["tdist"]["samples_per_s"] / w["bound"]["samples_per_s"]) < 1e-9 * w["tdist_over_bound"] + 1e-12, w
assert worlds[1]["bound"] != worlds[2]["bound"], "the same bound at world 1 and 2"
assert "bound: 2 x libtorch" in text and text.count("of bound") == 2, text
print("ddp bounds ok")
EOF
    check_round_trip "$work/d.json" "$work/d.out" "the runs"
    ;;
  pipeline)
    # The issue's GPT at a tiny size beside torch.distributed.pipelining (the anchor script's
    # GPT cut at the same bounds), and zero-bubble (no torch counterpart): each figure positive,
    # each bubble a fraction, the ratio the table's.
    "$python" -c "import torch.distributed.pipelining" 2>/dev/null || { echo "SKIP: no torch pipelining for $python"; exit 77; }
    timeout 150 "$bench" pipeline --model gpt --layers 2 --width 16 --heads 2 --context 8 \
      --micro-batch-size 2 --microbatches 3 --schedules gpipe,zb --steps 2 --warmup 1 \
      --python "$python" --json "$work/p.json" | tee "$work/p.out"
    "$python" - "$work/p.json" "$work/p.out" <<'EOF'
import json, math, sys
data, text = json.load(open(sys.argv[1])), open(sys.argv[2]).read()
assert data["model"] == "gpt" and data["width"] == 16 and data["layers"] == 2, data
assert "model gpt 2x16 h2 ctx8 bytes" in text, text
ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
runs = {r["schedule"]: r for r in data["schedules"]}
assert sorted(runs) == ["gpipe", "zb"], runs
for r in runs.values():
    assert ok(r["tdist"]["samples_per_s"]) and 0 <= r["tdist"]["bubble_measured"] < 1, r
g = runs["gpipe"]
assert ok(g["torch"]["samples_per_s"]), g
assert abs(g["tdist_over_torch"] - g["tdist"]["samples_per_s"] / g["torch"]["samples_per_s"]) < 1e-9, g
assert "torch" not in runs["zb"] and f'{g["tdist_over_torch"]:.2f}x of torch' in text, text
print("pipeline gpt ok")
EOF
    ;;
  rpc)
    timeout 120 "$bench" rpc --rtt-iters 50 --warmup 10 --async-calls 200 --outstanding 16 \
      --repeats 1 --echo-mib 1 --echo-iters 3 --rounds 1 --no-torch --json "$work/r.json" | tee "$work/r.out"
    "$python" - "$work/r.json" "$work/r.out" <<'EOF'
import json, math, sys
data, text = json.load(open(sys.argv[1])), open(sys.argv[2]).read()
ours, bounds = data["tdist"], data["bounds"]
ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
for k in ["pingpong_us", "memcpy_gbps", "echo_tcp_gbps"]:
    assert ok(ours[k]), (k, ours)
for k in ["pingpong_over_rtt", "echo_over_memcpy", "echo_over_tcp"]:
    assert ok(bounds[k]), (k, bounds)
assert abs(bounds["pingpong_over_rtt"] - ours["pingpong_us"] / ours["rtt_us"]) < 1e-9 * bounds["pingpong_over_rtt"]
assert ours["pingpong_bytes"] == 64
assert "bound: TCP ping-pong of 64 bytes" in text and "bound: memcpy" in text, text
print("rpc bounds ok")
EOF
    check_round_trip "$work/r.json" "$work/r.out" "the rounds"
    ;;
  scripts)
    # Its Python scripts are found beside the binary or in <prefix>/share/tdist/scripts, never in
    # the build machine's source tree: the binary copied alone names both places and the flag;
    # with its script where `cmake --install` puts it, the gloo anchor runs.
    "$python" -c "import torch.distributed" 2>/dev/null || { echo "SKIP: no torch for $python"; exit 77; }
    mkdir -p "$work/prefix/bin" "$work/prefix/share/tdist/scripts"
    cp "$bench" "$work/prefix/bin/"
    bench="$work/prefix/bin/tdist-bench"
    expect_usage_error "cannot find bench_ddp_torch.py beside $bench" "$bench" ddp --world-size 2
    expect_usage_error "--torch-script" "$bench" ddp --world-size 2
    expect_usage_error "cannot find bench_gloo.py" "$bench" collective --anchor gloo \
      --init-method "tcp://127.0.0.1:1?rank=0&world_size=1"
    cp "$(dirname "$plot")/bench_gloo.py" "$work/prefix/share/tdist/scripts/"
    collective --anchor gloo --python "$python"
    check_collective "single-thread memcpy" gloo
    ;;
  bad-flags)
    expect_usage_error "--anchor: foo not in {none,mpi,gloo}" "$bench" collective --anchor foo
    expect_usage_error "measures float32 sum only" "$bench" collective --anchor mpi --dtype int32 \
      --init-method "tcp://127.0.0.1:1?rank=0&world_size=1"
    # --device cuda: the anchors time CPU tensors only; without a visible GPU (all hidden here),
    # a clear refusal before any rendezvous.
    expect_usage_error "--anchor mpi times CPU tensors only and cannot run with --device cuda" \
      "$bench" collective --anchor mpi --device cuda --init-method "tcp://127.0.0.1:1?rank=0&world_size=1"
    expect_usage_error "--device cuda: " env CUDA_VISIBLE_DEVICES= "$bench" collective --device cuda \
      --init-method "tcp://127.0.0.1:1?rank=0&world_size=1"
    expect_usage_error "--device: gpu not in {cpu,cuda}" "$bench" collective --device gpu
    expect_usage_error "--world-size" "$bench" ddp --world-size 1
    expect_usage_error "--bound-bytes" "$bench" rpc --bound-bytes 0
    expect_usage_error "--small" "$bench" net --small 0
    expect_usage_error "--width 10 must be in [1, 65536] and a multiple of --heads 4" \
      "$bench" pipeline --model gpt --width 10 --heads 4
    expect_usage_error "--model: transformer not in {mlp,gpt}" "$bench" pipeline --model transformer
    ;;
  net)
    # Every model on every shape, each figure positive and finite, the table the JSON's.
    timeout 120 "$bench" net --rounds 1 --iters 50 --large 1M --large-iters 3 --clients 3 \
      --requests 50 --json "$work/n.json" >"$work/n.out"
    cat "$work/n.out"
    "$python" - "$work/n.json" "$work/n.out" <<'EOF'
import json, math, sys
data, table = json.load(open(sys.argv[1])), open(sys.argv[2]).read().splitlines()
models = ["posix", "poll", "asio", "asio-inline"]
keys = ["pingpong_us", "stream_gbps", "requests_per_s"]
assert sorted(data["models"]) == sorted(models), data["models"]
assert table[0].split()[1:] == models, table[0]
for i, k in enumerate(keys):
    fields = table[1 + i].split()[-len(models):]
    for m, f in zip(models, fields):
        v = data["models"][m][k]
        assert isinstance(v, float) and math.isfinite(v) and v > 0, (m, k, v)
        assert abs(float(f) - v) <= 0.5 + 1e-6 * v, (m, k, f, v)  # printed with 0-2 decimals
print("net table ok")
EOF
    ;;
  plot)
    "$python" -c "import matplotlib" 2>/dev/null || { echo "SKIP: no matplotlib for $python"; exit 77; }
    collective --plot "$work/c.png" --python "$python"
    [ "$(head -c 8 "$work/c.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || { echo "FAIL: not a PNG"; exit 1; }
    echo '{"op": "allreduce"}' >"$work/bad.json"
    rc=0; err="$("$python" "$plot" collective "$work/bad.json" -o "$work/bad.png" 2>&1)" || rc=$?
    [ "$rc" = 2 ] && grep -qF "expected the keys" <<<"$err" && [ ! -e "$work/bad.png" ] ||
      { echo "FAIL: bad JSON: exit $rc: $err"; exit 1; }
    echo "plot ok"
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
echo PASS
