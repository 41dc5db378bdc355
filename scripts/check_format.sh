#!/usr/bin/env bash
# Fails when a C++ file of the repository differs from what clang-format makes of it with the
# repository's .clang-format (the style the code was written in, applied once). Exit 77 (ctest
# skips) when clang-format 14 is not installed; scripts/setup.sh installs it.
#   scripts/check_format.sh [ROOT]         check;   scripts/check_format.sh --fix [ROOT]   rewrite
set -uo pipefail
fix=0
if [ "${1:-}" = "--fix" ]; then fix=1; shift; fi
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cf=""
for c in clang-format-14 clang-format; do
  if command -v "$c" >/dev/null 2>&1 && "$c" --version | grep -q 'version 14\.'; then cf="$c"; break; fi
done
if [ -z "$cf" ]; then
  echo "check_format: clang-format 14 not found (scripts/setup.sh installs it); skipped"
  exit 77
fi
cd "$root" || exit 2
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cc' 2>/dev/null)
if [ "${#files[@]}" -eq 0 ]; then
  mapfile -t files < <(find . -path ./build -prune -o -path './build-*' -prune -o \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) -print | sed 's#^\./##')
fi
if [ "$fix" = 1 ]; then
  "$cf" -i --style=file "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! "$cf" --style=file --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "check_format: $f differs from clang-format's (scripts/check_format.sh --fix)"
    bad=$((bad + 1))
  fi
done
echo "check_format: ${#files[@]} files, $bad to format"
[ "$bad" -eq 0 ]
