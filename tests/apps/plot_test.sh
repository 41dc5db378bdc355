#!/usr/bin/env bash
# scripts/plot_metrics.py over a real tdist-train metrics file: draws a PNG; bad input (a line
# that is not JSON, no training reports, a missing file) exits 2 with the reason and writes nothing.
#   plot_test.sh <python> <plot_metrics.py> <tdist-train>
set -euo pipefail
python="$1"; plot="$2"; train="$3"
work="$(mktemp -d "${TMPDIR:-/tmp}/tdist-plot-XXXXXX")"
trap 'rm -rf "$work"' EXIT

"$train" --steps 12 --hidden 16 --layers 1 --log-every 4 --eval-every 6 --test-samples 200 \
  --progress none --metrics "$work/m.jsonl" >/dev/null
# A second run appended to the same file: --last-run draws only it.
"$train" --steps 8 --hidden 16 --layers 1 --log-every 4 --test-samples 200 \
  --progress none --metrics "$work/m.jsonl" >/dev/null
grep -q '"event":"eval"' "$work/m.jsonl"

"$python" "$plot" "$work/m.jsonl" -o "$work/all.png" --title "plot test"
"$python" "$plot" "$work/m.jsonl" -o "$work/last.png" --last-run
for png in all last; do
  # PNG signature, then an IHDR with the figure's size (1170 x 342 at 90 dpi).
  [ "$(head -c 8 "$work/$png.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]
  [ "$(od -An -tu1 -j16 -N8 "$work/$png.png" | tr -s ' ')" = " 0 0 4 146 0 0 1 86" ]
done

expect_bad() {  # expect_bad <message> <file>
  local rc=0 err
  err="$("$python" "$plot" "$2" -o "$work/bad.png" 2>&1 >/dev/null)" || rc=$?
  [ "$rc" = 2 ] || { echo "exit $rc for $2, expected 2: $err"; exit 1; }
  grep -qF "$1" <<<"$err" || { echo "expected '$1' in: $err"; exit 1; }
  [ ! -e "$work/bad.png" ] || { echo "bad input wrote an image"; exit 1; }
}
{ head -1 "$work/m.jsonl"; echo '{"event": "train", "step": 3,'; } >"$work/broken.jsonl"
expect_bad "broken.jsonl:2: not JSON" "$work/broken.jsonl"
echo '[1, 2]' >"$work/list.jsonl"
expect_bad "list.jsonl:1: not a JSON object" "$work/list.jsonl"
grep '"event":"eval"' "$work/m.jsonl" >"$work/eval-only.jsonl"
expect_bad "no training reports" "$work/eval-only.jsonl"
expect_bad "cannot read $work/absent.jsonl" "$work/absent.jsonl"
echo "plot test ok"
