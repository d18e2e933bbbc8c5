#!/usr/bin/env bash
# Issue 39's pipe-4 hang, one call on 4 GPUs: the 3B Llama under 1F1B over 4 GPUs (bench-pipeline),
# NCCL's transports logged; if a run has not finished after HANG_S seconds, every rank's host
# threads and the kernels resident on its GPU are read with cuda-gdb (attach, backtraces,
# `info cuda kernels`), the GPUs' load sampled, then the run is killed. VARIANTS: space-separated
# environment settings, one run each ("-" for none), e.g. "- CUDA_MODULE_LOADING=EAGER".
#   bash bench/diag_pipe_hang.sh KIND   (carry [".gpu/bin", ".gpu/commit"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-pipeline; STEPS, MICRO, SCHEDULE, PIPE, HANG_S)
# COMPILE_LOG=1 writes a cubecl.toml that logs each kernel cubecl compiles (name only) on stderr;
# a variant "BURN_ZERO_TRACE_ORDER=1" adds every flag handshake; on a hang the last lines of each
# rank's log are printed. Stage with STRIP=debug for function names in the backtraces.
source bench/prelude.sh "$1"
steps="${STEPS:-2}"; micro="${MICRO:-8}"; schedule="${SCHEDULE:-1f1b}"; pipe="${PIPE:-4}"
hang="${HANG_S:-120}"
if [ "${COMPILE_LOG:-0}" = 1 ]; then
  printf '[compilation.logger]\nlevel = "basic"\nstderr = true\n' > cubecl.toml
fi
nvidia-smi topo -m > "$out/topo.txt" 2>&1; cat "$out/topo.txt"
n=0
for variant in ${VARIANTS:--}; do
  n=$((n + 1)); tag="v$n"
  envs=(); [ "$variant" != "-" ] && IFS=, read -r -a envs <<< "$variant"
  echo "== $tag: ${envs[*]:-(no extra settings)}"
  env "${envs[@]}" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((pipe - 1)))" \
    .gpu/bin/burn-zero run --nproc-per-node "$pipe" --master-port $((29900 + n)) \
    -- .gpu/bin/bench-pipeline "$steps" "$micro" "$schedule" 3b > "$out/$tag.out" 2> "$out/$tag.log" &
  launcher=$!
  for ((t = 0; t < hang; t += 5)); do kill -0 $launcher 2>/dev/null || break; sleep 5; done
  if kill -0 $launcher 2>/dev/null; then
    echo "$tag: still running after ${hang}s: reading the ranks"
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv > "$out/$tag-load.txt"
    cat "$out/$tag-load.txt"
    for pid in $(pgrep -f "bin/bench-pipeline"); do
      timeout 90 cuda-gdb -q -p "$pid" -batch -ex "set pagination off" -ex "info threads" \
        -ex "thread apply all bt 24" -ex "info cuda kernels" -ex "detach" \
        > "$out/$tag-gdb-$pid.txt" 2>&1 &
    done
    wait $(jobs -p | grep -v "^$launcher$") 2>/dev/null
    pkill -f "bin/bench-pipeline"; sleep 2; kill $launcher 2>/dev/null
    for r in $(seq 0 $((pipe - 1))); do
      echo "-- rank $r's last lines"; grep "^\[rank $r\]" "$out/$tag.log" | tail -n "${TAIL:-25}" | cut -c1-220
    done
    for f in "$out/$tag"-gdb-*.txt; do
      echo "-- $f"; grep -E "^\*? *[0-9]+ +Thread|^#[0-9]+ .* in (cu|nccl|pthread|__|sched|syscall|std::thread)" "$f" | head -40
      grep -A12 -i "Kernel Dev" "$f" | head -14
    done
  else
    wait $launcher; echo "$tag: exit $?"
  fi
  grep -h "{" "$out/$tag.out" | tail -1 | cut -c1-400
  grep -hE "via P2P|via SHM|NET/|Channel 00" "$out/$tag.log" | sort | uniq -c | sort -rn | head -12
  tail -n 3 "$out/$tag.log"
done
tar czf "$out/diag.tgz" -C "$out" $(cd "$out" && ls | grep -v diag.tgz) 2>/dev/null
