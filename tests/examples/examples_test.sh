#!/usr/bin/env bash
# Installs tdist from the build tree into a temporary prefix, builds examples/embed against the
# installed package with find_package(tdist), and runs it.
#   embed_test.sh <build dir> <source dir>
set -euo pipefail
build="$1"; src="$2"
work="$(mktemp -d "${TMPDIR:-/tmp}/tdist-embed-XXXXXX")"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/examples/embed" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
out="$("$work/build/embed_example")"
echo "$out"
grep -q "tensor round trip ok" <<<"$out"
# The installed tree holds the headers as consumers include them.
test -f "$work/prefix/include/tdist/core/store.h"
test -f "$work/prefix/lib/cmake/tdist/tdistConfig.cmake"
