# Sourced by the device scripts (`source bench/prelude.sh "$@"`): strict mode, NCCL settings,
# $kind (the first argument), $out, the binaries of .gpu/bin unpacked, and $gpus.
set -uo pipefail
export NCCL_NVLS_ENABLE=0   # NVLink multicast can take a shared host's GPUs down
kind="${1:?kind, e.g. nvidia-h200-x2}"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
for f in .gpu/bin/*.xz .gpu/prev/*.xz .gpu/mid/*.xz; do [ -e "$f" ] && xz -dkf "$f"; done
chmod +x .gpu/bin/*; for d in prev mid; do [ -d .gpu/$d ] && chmod +x .gpu/$d/*; done
gpus=$(nvidia-smi -L | wc -l)
