#!/usr/bin/env bash
# Device side of issue 33, one call: ZeRO-3 runs of bench-e2e (ours), bench/e2e_fsdp2.py
# (PyTorch FSDP2) and bench/e2e_deepspeed.py (DeepSpeed 0.19.8) from the same starting weights
# and tokens, one row of CASES at a time, each system with its peak GPU memory from nvidia-smi
# over the whole run and over its training steps alone; merged into $OUT/e2e-zero3-<kind>.json.
#   bash bench/run_e2e_zero3.sh KIND    (carry [".gpu", ".whl"]; staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-e2e; .whl as ../shared/GPU.md says)
# CASES: ';'-separated "SIZE GPUS MICRO SEQ [AC [SYSTEM,SYSTEM...]]" rows (default below; a
# row's own comma-separated systems replace SYSTEMS for it; SIZE is 125m, 1b, 3b, 8b or 70b, or
# SIZE:LAYERS for that shape with LAYERS decoder layers: 8b:48 is 11.5B, 70b:28 26.1B); SYSTEMS: which of
# "ours ours-pf ours-pf-unfused ours-pf-smem ours-pf-regs ours-pf-keep ours-prev ours-pf-prev ours-op ours-op-nvme ours-oo ours-oo-op ours-nvme ours-mid ours-keep ours-full-loss ours-old ours-hf ours-b5e7 ours-b2e8
# ours-rows1k fsdp2 deepspeed deepspeed-oo-op deepspeed-nvme" (deepspeed-oo-op: DeepSpeed with its
# optimizer and parameters offloaded to the CPU, as ours-oo-op; deepspeed-nvme: its optimizer state
# in swap files, as ours-nvme)
# run (ours: fitted pools, the chunked loss, free pages released between phases,
# reduce_bucket_size 5e7; ours-keep: the same without the release; ours-full-loss: logits
# materialized; ours-old: cubecl's pools, logits materialized, no release, as before issue 33;
# ours-hf: Hugging Face's "auto" reduce_bucket_size, hidden x hidden elements; ours-b5e7: 5e7,
# now the same as ours; ours-b2e8: 2e8, ours until 1f8d105; ours-rows1k: chunks of 1,024
# tokens in the loss instead of 2,048; ours-pf: stage3_prefetch_bucket_size of two decoder
# layers instead of DeepSpeed's 5e7; ours-pf-unfused: ours-pf with burn_zero::nn's fused
# kernels off (RMSNorm, RoPE, SwiGLU in burn ops); ours-pf-smem: ours-pf with the attention
# forward that stages scores in shared memory (burn_zero.attention_register_scores off);
# ours-pf-regs: ours-pf with the attention kernels that keep scores in registers (on); ours-pf-keep: the same without the release; ours-prev, ours-mid: ours with the binary of an earlier
# commit staged in .gpu/prev/ or .gpu/mid/ (with its commit file), for an A/B in the same call;
# ours-pf-prev: ours-pf with .gpu/prev's binary; ours-op, ours-op-nvme, ours-oo, ours-oo-op: ours-pf
# with offload_param on the CPU or in swap files under /tmp/burn-zero-swap, with offload_optimizer
# on the CPU, or with offload_param and offload_optimizer both on the CPU; ours-nvme: ours-pf with
# the optimizer state in swap files under /tmp/burn-zero-swap, emptied before each run);
# WARMUP: ours' steps left out of the timing (bench-e2e --warmup, default 2); GRAD_ACCUM=bf16:
# ours' gradients accumulated and reduced in bf16 (bench-e2e --grad-accum-dtype; an offloaded
# optimizer's host gradient partition then bf16, 2 bytes a parameter instead of 4);
# DISK_CHECK=GB: the swap directory's disk measured first (bench/disk_bandwidth.sh, GB per stream);
# STEPS (default 6); RUN_TIMEOUT per run in seconds (default 300); SUB_GROUP (see below).
source bench/prelude.sh "$1"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"  # a failing collective says why
steps="${STEPS:-6}"
cases="${CASES:-1b 2 2 1024;1b 2 4 2048;3b 2 1 4096}"
systems="${SYSTEMS:-ours ours-old fsdp2 deepspeed}"
: > /tmp/e2e.jsonl
{
  echo "commit: $(tr '\n' ' ' < .gpu/commit)"
  [ -f .gpu/prev/commit ] && echo "ours-prev commit: $(tr '\n' ' ' < .gpu/prev/commit)"
  [ -f .gpu/mid/commit ] && echo "ours-mid commit: $(tr '\n' ' ' < .gpu/mid/commit)"
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$out/machine.txt"

# DeepSpeed: its pure-Python install and the wheels the machine lacks (../shared/GPU.md).
if [[ " $systems ${cases} " == *deepspeed* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && mkdir -p /tmp/dsb && tar xzf .whl/deepspeed-0.19.8.tar.gz -C /tmp/dsb \
    && (cd /tmp/dsb/deepspeed-0.19.8 && PYTHONPATH=/tmp/site DS_BUILD_OPS=0 python3 -m pip install \
        -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .) \
    || echo "DeepSpeed did not install"
fi
# The shared starting weights' hash in torch: llm/src/shared_init.rs's test expects these.
python3 bench/shared_init.py | tee "$out/shared-init-check.txt"

if [ -n "${DISK_CHECK:-}" ]; then
  mkdir -p /tmp/burn-zero-swap
  bash bench/disk_bandwidth.sh /tmp/burn-zero-swap "$DISK_CHECK" | tee "$out/disk.json"
fi
port=29700
# SUB_GROUP: sub_group_size of both systems' offloaded runs (ours-oo-op, deepspeed-oo-op);
# unset, each keeps its default (1e9 for both).
sub_group="${SUB_GROUP:+--sub-group $SUB_GROUP}"
hidden2() { # Hugging Face's "auto" reduce_bucket_size: hidden x hidden (SIZE:LAYERS as SIZE)
  case "${1%%:*}" in 125m) echo $((768 * 768)) ;; 1b) echo $((2048 * 2048)) ;;
    3b) echo $((3072 * 3072)) ;; 8b) echo $((4096 * 4096)) ;; 70b) echo $((8192 * 8192)) ;; esac
}
layers2() { # two decoder layers' parameters: 2 x (2 h^2 + 2 h kv + 3 h i)
  case "${1%%:*}" in 125m) echo $((2 * (2*768*768 + 2*768*256 + 3*768*2048))) ;;
    1b) echo $((2 * (2*2048*2048 + 2*2048*512 + 3*2048*8192))) ;;
    3b) echo $((2 * (2*3072*3072 + 2*3072*1024 + 3*3072*8192))) ;;
    8b) echo $((2 * (2*4096*4096 + 2*4096*1024 + 3*4096*14336))) ;;
    70b) echo $((2 * (2*8192*8192 + 2*8192*1024 + 3*8192*28672))) ;; esac
}
measure() { # name size n micro seq ac command...
  local name=$1 size=$2 n=$3 micro=$4 seq=$5 ac=$6; shift 6
  local tag="$name-${size//:/l}-$n-$micro-$seq-ac$ac"  # 70b:28 -> 70bl28 (file names take no ':')
  nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 200 \
    > "/tmp/mem-$tag.log" &
  local smi=$!
  # Host memory in use (MemTotal - MemAvailable, MiB) every second: offload's footprint.
  (while true; do awk -v t="$(date +%s.%N)" '/^MemTotal/{m=$2} /^MemAvailable/{a=$2}
     END{printf "%s %d\n", t, (m-a)/1024}' /proc/meminfo; sleep 1; done) > "/tmp/host-$tag.log" &
  local hostmem=$!
  local t0; t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout "${RUN_TIMEOUT:-300}" "$@" \
    > "/tmp/$tag.out" 2> "$out/$tag.log"
  local rc=$?
  kill $smi $hostmem; wait $smi $hostmem 2>/dev/null
  echo "$tag: exit $rc after $(( $(date +%s) - t0 )) s"; tail -n 3 "$out/$tag.log"
  python3 - "$tag" "$name" "$n" "$rc" "$size" "$micro" "$seq" "$ac" <<'PY' >> /tmp/e2e.jsonl
import datetime, json, sys
tag, name, n, rc, size, micro, seq, ac = sys.argv[1:]
try:
    line = [l for l in open(f"/tmp/{tag}.out") if "{" in l][-1]
    run = json.loads(line[line.index("{"):])  # the launcher prefixes "[rank 0] "
except Exception as e:
    run = {"error": f"no result ({e})"}
samples = []
for l in open(f"/tmp/mem-{tag}.log"):
    try:
        ts, idx, mib, busy = [x.strip() for x in l.split(",")]
        t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((t, int(idx), int(mib), int(busy)))
    except ValueError:
        pass
start = run.get("train_start_unix")
peak = max((m for _, _, m, _ in samples), default=None)
train = [m for t, _, m, _ in samples if start is not None and t >= start]
# nvidia-smi's utilization.gpu (percent of time a kernel ran) over the training steps, all GPUs.
busy = [b for t, _, _, b in samples if start is not None and t >= start]
host = [(float(t), int(m)) for t, m in (l.split() for l in open(f"/tmp/host-{tag}.log") if l.strip())]
run.update({"name": name, "gpus": int(n), "exit": int(rc), "case": [size, int(micro), int(seq)],
            "activation_checkpointing_asked": ac == "1",
            "peak_gpu_mib": peak, "peak_gpu_mib_training": max(train) if train else None,
            "gpu_busy_smi": sum(busy) / len(busy) / 100 if busy else None,
            "peak_host_mib": max((m for _, m in host), default=None),
            "peak_host_mib_training": max((m for t, m in host if start is not None and t >= start),
                                          default=None)})
print(json.dumps(run))
PY
}

IFS=';' read -ra rows <<< "$cases"
for row in "${rows[@]}"; do
  read -r size n micro seq ac only <<< "$row"
  ac="${ac:-0}"
  [ "$n" -le "$gpus" ] || { echo "skip $row: $gpus GPUs"; continue; }
  list="$systems"; [ -n "$only" ] && list="${only//,/ }"
  for system in $list; do
    port=$((port + 1))
    case "$system" in
      ours|ours-pf|ours-pf-unfused|ours-pf-smem|ours-pf-regs|ours-pf-keep|ours-prev|ours-pf-prev|ours-op|ours-op-nvme|ours-oo|ours-oo-op|ours-nvme|ours-mid|ours-keep|ours-full-loss|ours-old|ours-hf|ours-b5e7|ours-b2e8|ours-rows1k)
        bin=.gpu/bin/bench-e2e; envs=()
        # ours' settings, and ours-pf's: the same with two decoder layers' prefetch.
        base=(--pool fitted --loss chunked --release 1)
        pf=("${base[@]}" --prefetch "$(layers2 "$size")")
        case "$system" in
          ours) flags=("${base[@]}") ;;
          ours-pf) flags=("${pf[@]}") ;;
          ours-pf-unfused) flags=("${pf[@]}")
            envs=(BURN_ZERO_FUSED_RMS_NORM=0 BURN_ZERO_FUSED_ROPE=0 BURN_ZERO_FUSED_SWIGLU=0) ;;
          ours-pf-smem) flags=("${pf[@]}"); envs=(BURN_ZERO_ATTENTION_REGISTER_SCORES=0) ;;
          ours-pf-regs) flags=("${pf[@]}"); envs=(BURN_ZERO_ATTENTION_REGISTER_SCORES=1) ;;
          ours-pf-keep) flags=(--pool fitted --loss chunked --release 0 --prefetch "$(layers2 "$size")") ;;
          ours-prev) flags=("${base[@]}"); bin=.gpu/prev/bench-e2e ;;
          ours-pf-prev) flags=("${pf[@]}"); bin=.gpu/prev/bench-e2e ;;
          ours-op) flags=("${pf[@]}" --offload-param cpu) ;;
          ours-op-nvme) mkdir -p /tmp/burn-zero-swap
            flags=("${pf[@]}" --offload-param nvme:/tmp/burn-zero-swap) ;;
          ours-oo) flags=("${pf[@]}" --offload-optimizer cpu $sub_group) ;;
          ours-oo-op) flags=("${pf[@]}" --offload-param cpu --offload-optimizer cpu $sub_group) ;;
          ours-nvme) rm -rf /tmp/burn-zero-swap; mkdir -p /tmp/burn-zero-swap
            flags=("${pf[@]}" --offload-optimizer nvme:/tmp/burn-zero-swap $sub_group) ;;
          ours-mid) flags=("${base[@]}"); bin=.gpu/mid/bench-e2e ;;
          ours-keep) flags=(--pool fitted --loss chunked --release 0) ;;
          ours-full-loss) flags=(--pool fitted --loss full --release 1) ;;
          ours-old) flags=(--pool sliced --loss full --release 0) ;;
          ours-hf) flags=("${base[@]}" --bucket "$(hidden2 "$size")") ;;
          ours-b5e7) flags=("${base[@]}" --bucket 50000000) ;;
          ours-b2e8) flags=("${base[@]}" --bucket 200000000) ;;
          ours-rows1k) flags=("${base[@]}" --loss-rows 1024) ;;
        esac
        measure "$system" "$size" "$n" "$micro" "$seq" "$ac" \
          env "${envs[@]}" .gpu/bin/burn-zero run --nproc-per-node "$n" --master-port "$port" \
          -- "$bin" "$size" 3 "$steps" "$micro" "$seq" "${flags[@]}" --ac "$ac" ${WARMUP:+--warmup $WARMUP} \
          ${GRAD_ACCUM:+--grad-accum-dtype $GRAD_ACCUM} ;;
      fsdp2) measure fsdp2 "$size" "$n" "$micro" "$seq" "$ac" \
        torchrun --nproc-per-node "$n" --master-port "$port" \
        bench/e2e_fsdp2.py "$size" 3 "$steps" "$micro" "$seq" --ac "$ac" ;;
      deepspeed) measure deepspeed "$size" "$n" "$micro" "$seq" "$ac" \
        env PYTHONPATH=/tmp/site torchrun --nproc-per-node "$n" --master-port "$port" \
        bench/e2e_deepspeed.py "$size" 3 "$steps" "$micro" "$seq" --ac "$ac" ;;
      deepspeed-oo-op) measure deepspeed-oo-op "$size" "$n" "$micro" "$seq" "$ac" \
        env PYTHONPATH=/tmp/site torchrun --nproc-per-node "$n" --master-port "$port" \
        bench/e2e_deepspeed.py "$size" 3 "$steps" "$micro" "$seq" --ac "$ac" --offload cpu $sub_group ;;
      deepspeed-nvme) rm -rf /tmp/ds-swap; mkdir -p /tmp/ds-swap
        measure deepspeed-nvme "$size" "$n" "$micro" "$seq" "$ac" \
        env PYTHONPATH=/tmp/site torchrun --nproc-per-node "$n" --master-port "$port" \
        bench/e2e_deepspeed.py "$size" 3 "$steps" "$micro" "$seq" --ac "$ac" --offload nvme:/tmp/ds-swap $sub_group ;;
    esac
  done
done

python3 bench/e2e_zero3_summary.py "$kind" /tmp/e2e.jsonl "$out/e2e-zero3-$kind.json" "$out/machine.txt"
