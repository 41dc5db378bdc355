#!/usr/bin/env bash
# Runs PyTorch's own distributed backend suite (tests/python/pytorch_suite.py) against tdist in
# both modes and against gloo (the reference), at world sizes 2 and 3, then prints a table: per
# world size, how many tests pass on gloo, how many of those pass on tdist in each mode, and
# every test that passes on gloo but not on tdist (those marked "outside tdist" are PyTorch's).
#
#   scripts/pytorch-suite.sh [-k PATTERN ...]     # builds tdist_c10d first; ~1 h on 2 cores
#   OUT=dir scripts/pytorch-suite.sh              # keep the per-test outcome files in dir
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
OUT="${OUT:-$(mktemp -d -t tdist-suite.XXXXXX)}"
mkdir -p "$OUT"
scripts/build.sh >/dev/null
cmake --build "$BUILD_DIR" -j2 --target tdist_c10d >/dev/null
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
PYTHON="${TDIST_PYTHON:-python3}"

run() {  # backend mode world
  local name="$1-$2-$3"
  echo "== $name" >&2
  "$PYTHON" tests/python/pytorch_suite.py --backend "$1" --mode "$2" --world-size "$3" \
      --out "$OUT/$name.txt" "${@:4}" >"$OUT/$name.log" 2>&1 || true
  tail -n 1 "$OUT/$name.log" >&2
}

for world in 2 3; do
  run gloo plugin "$world" "$@"
  run tdist plugin "$world" "$@"
  run tdist widened "$world" "$@"
done

"$PYTHON" - "$OUT" <<'EOF'
import os, sys
out = sys.argv[1]
def outcomes(name):
    path = os.path.join(out, name + ".txt")
    if not os.path.exists(path):
        return {}
    result = {}
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        status, test = line.split()[0], line.split()[1].rstrip(":")
        result[test] = status
    return result
sys.path.insert(0, "tests/python")
outside = __import__("pytorch_suite").OUTSIDE_TDIST
print("| world | gloo passes | tdist plugin: runs / passes / gloo's passes also passing | "
      "tdist widened: gloo's passes also passing |")
print("|---|---|---|---|")
misses = []
for world in (2, 3):
    gloo = outcomes("gloo-plugin-%d" % world)
    plugin = outcomes("tdist-plugin-%d" % world)
    widened = outcomes("tdist-widened-%d" % world)
    gloo_pass = {t for t, s in gloo.items() if s == "PASS"}
    plugin_run = {t for t, s in plugin.items() if s != "SKIP"}
    plugin_pass = {t for t, s in plugin.items() if s == "PASS"}
    widened_pass = {t for t, s in widened.items() if s == "PASS"}
    print("| %d | %d | %d / %d / %d of %d | %d of %d |" % (
        world, len(gloo_pass), len(plugin_run), len(plugin_pass),
        len(gloo_pass & plugin_pass), len(gloo_pass & plugin_run),
        len(gloo_pass & widened_pass), len(gloo_pass)))
    for mode, got in (("plugin", plugin), ("widened", widened)):
        for t in sorted(gloo_pass):
            if t in got and got[t] not in ("PASS", "SKIP"):
                misses.append((world, mode, t, got[t]))
if misses:
    print("\nPass on gloo, not on tdist:")
    for world, mode, t, status in misses:
        why = outside.get(t)
        print("- world %d %s: %s %s%s" % (world, mode, status, t,
                                          (" (outside tdist: %s)" % why) if why else ""))
print("\nPer-test outcomes: %s" % out)
EOF
