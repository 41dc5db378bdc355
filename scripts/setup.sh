#!/usr/bin/env bash
# Installs what tdist's build needs when it is missing: Debian packages and the pinned PyTorch
# (whose wheel carries libtorch and its CMake config). Idempotent: prints what it installs and
# installs nothing when everything is there. Works as root, or with sudo otherwise.
#
#   scripts/setup.sh            # check and install
#   TDIST_PYTHON=python3.11 scripts/setup.sh
set -euo pipefail

TORCH_VERSION="${TDIST_TORCH_VERSION:-2.11.0}"
PYTHON="${TDIST_PYTHON:-python3}"

DEB_PACKAGES=(
  build-essential cmake ninja-build ccache git pkg-config
  python3 python3-dev python3-pip python3-venv
  libboost-dev libcereal-dev libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  libssl-dev libgtest-dev libgmock-dev libbenchmark-dev
  iproute2 openmpi-bin libopenmpi-dev
  zlib1g-dev dataset-fashion-mnist
  clang libclang-rt-14-dev clang-format
)

say() { printf 'setup: %s\n' "$*"; }

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  SUDO=()
fi

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && [ "${#SUDO[@]}" -eq 0 ]; then
    say "missing Debian packages: ${missing[*]}; run as root or install sudo" >&2
    exit 1
  fi
  say "installing Debian packages: ${missing[*]}"
  "${SUDO[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  say "Debian packages present"
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  say "no $PYTHON found" >&2
  exit 1
fi

# Debian's own python3 refuses system-wide pip installs (PEP 668) unless told; a non-root user
# without a writable site-packages installs with --user.
pip_extra=()
if "$PYTHON" -m pip install --help 2>/dev/null | grep -q -- --break-system-packages &&
   [ -f "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/EXTERNALLY-MANAGED" ]; then
  pip_extra+=(--break-system-packages)
fi
if [ "$(id -u)" -ne 0 ] && ! "$PYTHON" -c 'import site, os, sys; sys.exit(0 if os.access(site.getsitepackages()[0], os.W_OK) else 1)'; then
  pip_extra+=(--user)
fi

have_torch=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have_torch" != "$TORCH_VERSION" ]; then
  say "installing torch==$TORCH_VERSION for $("$PYTHON" -c 'import sys; print(sys.executable)') (found: ${have_torch:-none})"
  pip_args=(-m pip install -q "torch==$TORCH_VERSION" numpy "${pip_extra[@]}")
  "$PYTHON" "${pip_args[@]}"
else
  say "torch $TORCH_VERSION present"
fi
# numpy for torch's Python side; expecttest for torch's own test modules, which
# tests/python/pytorch_suite.py runs against the tdist backend; matplotlib for
# scripts/plot_metrics.py (the main job's picture); safetensors for the fsdp tests that open
# tdist's safetensors files in Python and Python's in tdist (tests/fsdp/safetensors_test.cpp);
# scikit-build-core for `pip install --no-build-isolation .` (pyproject.toml: the PyTorch
# backend's wheel) and its test, Python.Pip.*. Each as module:package.
for pair in numpy:numpy expecttest:expecttest matplotlib:matplotlib safetensors:safetensors \
            scikit_build_core:scikit-build-core; do
  mod="${pair%%:*}" pkg="${pair#*:}"
  if ! "$PYTHON" -c "import $mod" >/dev/null 2>&1; then
    say "installing $pkg"
    "$PYTHON" -m pip install -q "$pkg" "${pip_extra[@]}"
  fi
done
say "ready: $("$PYTHON" -c 'import torch, torch.utils; print("torch", torch.__version__, "at", torch.utils.cmake_prefix_path)')"
