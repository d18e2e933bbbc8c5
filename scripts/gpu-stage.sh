#!/usr/bin/env bash
# Build GPU binaries here and stage them in .gpu/ (git-ignored) for the device tool's `carry`.
#   scripts/gpu-stage.sh BIN [BIN...]      e.g. scripts/gpu-stage.sh gpu-smoke
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-collectives
#   STRIP=debug scripts/gpu-stage.sh ...   keeps the symbol table (function names in cuda-gdb)
# Binaries come from the examples crate built with --features cuda; each is stripped and, when
# over 24 MiB, xz-compressed (a call may carry 64 MiB in all). On the device run
#   bash scripts/gpu-run.sh BIN [ARGS...]   (with carry [".gpu"])
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 BIN [BIN...]" >&2; exit 2; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/burn-zero-target}"
features="${GPU_FEATURES:-cuda}"
args=()
for bin in "$@"; do
  # dist-worker (the tests crate's multi-process worker) builds from its own crate.
  if [ "$bin" = dist-worker ]; then
    cargo build --release -p burn-zero-tests --features "$features" --bin dist-worker
  else
    args+=(--bin "$bin")
  fi
done
[ ${#args[@]} -eq 0 ] || cargo build --release -p burn-zero-examples --features "$features" "${args[@]}"
# The launcher and `burn-zero report` travel too.
# (with the features burn-zero has: `host-profile` is the examples' own)
launcher_features=$(echo "$features" | tr ' ,' '\n\n' | grep -vx 'host-profile' | paste -sd' ')
cargo build --release -p burn-zero --features "${launcher_features:-cuda}" --bin burn-zero
mkdir -p .gpu/bin
rm -f .gpu/bin/*
for bin in burn-zero "$@"; do
  cp "$CARGO_TARGET_DIR/release/$bin" ".gpu/bin/$bin"
  if [ "${STRIP:-all}" = debug ]; then strip --strip-debug ".gpu/bin/$bin"; else strip ".gpu/bin/$bin"; fi
  if [ "$(stat -c %s ".gpu/bin/$bin")" -gt $((24 * 1024 * 1024)) ]; then
    xz -T2 -6 -f ".gpu/bin/$bin"
  fi
done
git rev-parse HEAD > .gpu/commit 2>/dev/null || echo unknown > .gpu/commit
git diff HEAD --quiet 2>/dev/null || echo "uncommitted-changes" >> .gpu/commit
du -sh .gpu; ls -la .gpu/bin
