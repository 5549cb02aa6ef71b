#!/usr/bin/env bash
# Best-effort install of what the `rocm` compile tests need on a machine without an AMD GPU:
# the FlyDSL wheel, Debian's lld-19 and rocm-device-libs, and a ROCM_PATH-style folder
#   $FMHA_FLYDSL_ROCM_PATH (default ~/.cache/fmha_ops/flydsl_rocm) with
#   llvm/bin/ld.lld -> lld-19 and amdgcn/bitcode -> the device bitcode.
# The tests find that folder on their own (fmha_ops.kernels.flydsl.aot.toolchain_root).
# Never fails: when something cannot install, the tests skip and say why.
set -u
FLYDSL_VERSION=0.5.0
ROOT="${FMHA_FLYDSL_ROCM_PATH:-$HOME/.cache/fmha_ops/flydsl_rocm}"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi

timeout 120 python -m pip install -q "flydsl==${FLYDSL_VERSION}" || echo "flydsl ${FLYDSL_VERSION}: pip install failed"

if command -v apt-get >/dev/null 2>&1; then
  if ! dpkg -s lld-19 rocm-device-libs >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    timeout 120 $SUDO apt-get install -y -q --no-install-recommends lld-19 rocm-device-libs >/dev/null 2>&1 \
      || { timeout 60 $SUDO apt-get update -q >/dev/null 2>&1 \
           && timeout 120 $SUDO apt-get install -y -q --no-install-recommends lld-19 rocm-device-libs >/dev/null 2>&1; } \
      || echo "apt-get install lld-19 rocm-device-libs failed"
  fi
else
  echo "no apt-get: install lld (>= 19) and rocm-device-libs yourself"
fi

LLD=""
for c in /usr/lib/llvm-19/bin/ld.lld "$(command -v ld.lld-19 2>/dev/null)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then LLD="$c"; break; fi
done
BC=""
for c in /usr/lib/x86_64-linux-gnu/amdgcn/bitcode /usr/lib/aarch64-linux-gnu/amdgcn/bitcode /usr/lib/amdgcn/bitcode; do
  if [ -d "$c" ]; then BC="$c"; break; fi
done
if [ -n "$LLD" ] && [ -n "$BC" ]; then
  mkdir -p "$ROOT/llvm/bin" "$ROOT/amdgcn"
  ln -sfn "$LLD" "$ROOT/llvm/bin/ld.lld"
  ln -sfn "$BC" "$ROOT/amdgcn/bitcode"
  echo "export FMHA_FLYDSL_ROCM_PATH=$ROOT"
else
  echo "toolchain incomplete (ld.lld-19: ${LLD:-missing}, amdgcn bitcode: ${BC:-missing}); rocm tests will skip"
fi
exit 0
