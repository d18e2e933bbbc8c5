#!/usr/bin/env bash
# Device side: unpack the binaries staged by scripts/gpu-stage.sh and run one with its args,
# logging to $OUT/<bin>.log together with the machine's description.
#   bash scripts/gpu-run.sh BIN [ARGS...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0   # NVLink multicast can take a shared host's GPUs down
out="${OUT:-/tmp/out}"; mkdir -p "$out"
bin="$1"; shift
for f in .gpu/bin/*.xz; do [ -e "$f" ] && xz -dkf "$f"; done
chmod +x .gpu/bin/* 2>/dev/null
{
  echo "commit: $(cat .gpu/commit 2>/dev/null | tr '\n' ' ')"
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$out/$bin.log"
start=$(date +%s%N)
".gpu/bin/$bin" "$@" 2>&1 | tee -a "$out/$bin.log"
rc=${PIPESTATUS[0]}
echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$out/$bin.log"
exit "$rc"
