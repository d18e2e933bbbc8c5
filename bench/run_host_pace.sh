#!/usr/bin/env bash
# Device side of issue 37's measurements, one call on one GPU: our step beside PyTorch's on the
# same model, weights and tokens. For each case SIZE:MICRO:SEQ:STAGE: ours (bench-e2e, with
# OURS_ARGS if set; FLUSH="64 1024 ..." runs it once per `--flush-interval`, a binary of 0ae6c26
# only), FSDP2 on one GPU (bench/e2e_fsdp2.py) and eager torch (bench/e2e_eager.py;
# EAGER_COMPILE=1 adds a torch.compile row, on the first repeat only: it compiles for a minute).
# OURS_VARIANTS="NAME:VAR=VALUE[,VAR=VALUE...] ..." runs ours once per variant with those variables
# set (e.g. "stream:BURN_ZERO_CUBLASLT_ORDER=stream batched:BURN_ZERO_EAGER_HOST_QUEUE=0"), tagged
# ours-SIZE-NAME; E2E_BIN=PATH in a variant runs another bench-e2e (an earlier commit's, e.g.
# .gpu/prev/bench-e2e); SKIP_FSDP2=1 leaves FSDP2 out. Each run's GPU busy fraction is nvidia-smi's utilization.gpu averaged over its timed
# steps (coarse: a sample covers 1/6 to 1 s). BUSY=1 runs ours (each variant), eager torch and FSDP2
# once more per case with CUPTI's activity records (bench/cupti_busy/busy.c, built into
# .gpu/lib/libbusy.so by bench/cupti_busy/build.sh; CUPTI from the device's torch), and the busy
# fraction is the union of their kernels, copies and memsets over the timed steps
# (bench/nsys_busy.py), with their kernels per step by name (bench/busy_kernels.py); NSYS_CASES does the same under Nsight Systems where it is installed.
# GPUS=N runs every system on N GPUs (ours: N ranks; eager torch: DistributedDataParallel under
# torchrun; FSDP2: N ranks), nvidia-smi watching GPU 0; OUT_NAME names the result file
# ($OUT/OUT_NAME-KIND.json, default host-pace).
#   bash bench/run_host_pace.sh KIND ["1b:2:1024:2 125m:32:256:2"]   (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-e2e; STEPS, RUN_TIMEOUT, REPEATS)
source bench/prelude.sh "$1"
gpus="${GPUS:-1}"
visible=$(seq -s, 0 $((gpus - 1)))
# The eager peer: one process, or DDP under torchrun.
eager_cmd() { # port
  if [ "$gpus" = 1 ]; then echo python3 bench/e2e_eager.py
  else echo torchrun --nproc-per-node "$gpus" --master-port "$1" bench/e2e_eager.py; fi
}
cases="${2:-1b:2:1024:2 125m:32:256:2}"
steps="${STEPS:-12}"
: > /tmp/pace.jsonl; : > /tmp/pace-nsys.jsonl; : > /tmp/pace-kernels.jsonl
port=29950
measure() { # tag case command...
  local tag=$1 case=$2; shift 2
  nvidia-smi -i 0 --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits \
    -lms 100 > /tmp/smi.log &
  local smi=$!
  CUDA_VISIBLE_DEVICES=$visible timeout "${RUN_TIMEOUT:-150}" "$@" > "/tmp/$tag.out" 2> "$out/$tag.log"
  local rc=$?
  kill $smi
  cp /tmp/smi.log "$out/$tag-smi.csv"
  echo "$tag: exit $rc"; tail -n 2 "$out/$tag.log"
  python3 - "$tag" "$case" "$rc" "$(stat -c %Y "/tmp/$tag.out" 2>/dev/null)" <<'PY' >> /tmp/pace.jsonl
import json, sys
from datetime import datetime
tag, case, rc, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
try:
    line = [l for l in open(f"/tmp/{tag}.out") if "{" in l][-1]
    run = json.loads(line[line.index("{"):])
except Exception as e:
    run = {"error": f"no result ({e})"}
samples = []
for l in open("/tmp/smi.log"):
    p = [x.strip() for x in l.split(",")]
    try:
        samples.append((datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), int(p[1]), float(p[2])))
    except (ValueError, IndexError):
        pass
# The timed steps end when the JSON line is written (the output file's mtime, whole seconds)
# and span the sum of their step times before it.
timed = sum(run.get("step_times_s") or [])
if end.isdigit() and timed > 0:
    t1 = int(end) + 1.0
    busy = [u for t, _, u in samples if t1 - timed - 1.0 <= t <= t1 - 1.0]
    run["gpu_busy_smi"] = sum(busy) / len(busy) / 100 if busy else None
    run["gpu_busy_samples"] = len(busy)
run["peak_gpu_mib"] = max((m for _, m, _ in samples), default=None)
run.update({"tag": tag, "case": case, "exit": rc})
print(json.dumps(run))
PY
}
# The JSON object on stdin with its run's tag and case (and tracer, if given) added.
tagged() { # tag case [tracer]
  python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d.update(tag=sys.argv[1], case=sys.argv[2]); d.update({"tracer": sys.argv[3]} if len(sys.argv) > 3 else {}); print(json.dumps(d))' "$@"
}
# REPEATS=N runs every system of a case N times, interleaved (ours, FSDP2, eager, ... then
# again), so a drift of the machine during the call falls on all of them; the summary gives each
# system's median over its repeats beside the spread.
for r in $(seq 1 "${REPEATS:-1}"); do
rep=$([ "${REPEATS:-1}" -gt 1 ] && echo "-r$r")
for c in $cases; do
  IFS=: read -r size micro seq stage <<< "$c"
  for f in ${FLUSH:-default}; do
  for v in ${OURS_VARIANTS:-default}; do
    port=$((port + 1))
    flush=(); tag="ours-$size"; assigns=()
    [ "$f" = default ] || { flush=(--flush-interval "$f"); tag="$tag-f$f"; }
    [ "$v" = default ] || { tag="$tag-${v%%:*}"; IFS=, read -ra assigns <<< "${v#*:}"; }
    # shellcheck disable=SC2086
    ( [ ${#assigns[@]} -eq 0 ] || export "${assigns[@]}"
      measure "$tag$rep" "$c" .gpu/bin/burn-zero run --nproc-per-node "$gpus" --master-port "$port" \
        -- "${E2E_BIN:-.gpu/bin/bench-e2e}" "$size" "$stage" "$steps" "$micro" "$seq" "${flush[@]}" \
        ${OURS_ARGS:-} )
  done
  done
  port=$((port + 1))
  [ -n "${SKIP_FSDP2:-}" ] || measure "fsdp2-$size$rep" "$c" torchrun --nproc-per-node "$gpus" \
    --master-port "$port" bench/e2e_fsdp2.py "$size" "$stage" "$steps" "$micro" "$seq"
  port=$((port + 1))
  # shellcheck disable=SC2046
  measure "eager-$size$rep" "$c" $(eager_cmd "$port") "$size" "$stage" "$steps" "$micro" "$seq"
  if [ -n "${EAGER_COMPILE:-}" ] && [ "$r" = 1 ]; then
    port=$((port + 1))
    # shellcheck disable=SC2046
    measure "compile-$size$rep" "$c" $(eager_cmd "$port") "$size" "$stage" "$steps" \
      "$micro" "$seq" --compile 1
  fi
done
done
# BUSY=1: each case once more per system with CUPTI's activity records (one CSV per process).
cupti=$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia" \
  /usr/local/cuda*/extras/CUPTI/lib64 -name 'libcupti.so*' 2>/dev/null | sort | head -1)
echo "cupti: ${cupti:-not found}"
for c in $([ -n "${BUSY:-}" ] && [ -n "$cupti" ] && [ -f .gpu/lib/libbusy.so ] && echo "$cases"); do
  IFS=: read -r size micro seq stage <<< "$c"
  for sys in $(for v in ${OURS_VARIANTS:-default}; do echo "ours:$v"; done) eager \
    $([ -n "${SKIP_FSDP2:-}" ] || echo fsdp2); do
    port=$((port + 1))
    v=${sys#ours:}; tag="busy-$sys-$size"; assigns=()
    case $sys in
      eager) read -ra cmd <<< "$(eager_cmd "$port")" ;;
      fsdp2) cmd=(torchrun --nproc-per-node "$gpus" --master-port "$port" bench/e2e_fsdp2.py) ;;
      *)
        tag="busy-ours-$size$([ "$v" = default ] || echo "-${v%%:*}")"
        [ "$v" = default ] || IFS=, read -ra assigns <<< "${v#*:}"
        bin=.gpu/bin/bench-e2e
        for a in "${assigns[@]}"; do [[ $a == E2E_BIN=* ]] && bin=${a#E2E_BIN=}; done
        cmd=(.gpu/bin/burn-zero run --nproc-per-node "$gpus" --master-port "$port" -- "$bin") ;;
    esac
    rm -rf "/tmp/$tag"; mkdir -p "/tmp/$tag"
    # shellcheck disable=SC2086
    env "${assigns[@]}" CUDA_VISIBLE_DEVICES="$visible" BUSY_OUT_DIR="/tmp/$tag" \
      BUSY_CUPTI_LIB="$cupti" CUDA_INJECTION64_PATH="$PWD/.gpu/lib/libbusy.so" \
      timeout "${RUN_TIMEOUT:-150}" "${cmd[@]}" "$size" "$stage" "$steps" "$micro" "$seq" \
      $([[ $sys == ours:* ]] && echo "${OURS_ARGS:-}") > "/tmp/$tag.out" 2> "$out/$tag.log"
    echo "$tag: exit $?"
    trace=$(ls -S "/tmp/$tag"/busy-*.csv 2>/dev/null | head -1)
    [ -n "$trace" ] || { echo "$tag: no trace" | tee -a "$out/$tag.log"; continue; }
    python3 bench/nsys_busy.py "$trace" "/tmp/$tag.out" \
      | tagged "$tag" "$c" cupti | tee -a /tmp/pace-nsys.jsonl
    python3 bench/busy_kernels.py "$trace" "/tmp/$tag.out" \
      | tagged "$tag" "$c" >> /tmp/pace-kernels.jsonl
    # NEIGHBOURS="REGEX ...": the kernels beside each launch matching each (two either side;
    # bench/kernel_neighbours.py), one file per pattern.
    n=0
    for pattern in ${NEIGHBOURS:-}; do
      n=$((n + 1))
      python3 bench/kernel_neighbours.py "$trace" "/tmp/$tag.out" "$pattern" 30 2 \
        > "$out/$tag-neighbours-$n.json"
    done
  done
done
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${nsys:-not found}"
for c in ${NSYS_CASES:-}; do
  [ -n "$nsys" ] || break
  IFS=: read -r size micro seq stage <<< "$c"
  port=$((port + 1))
  for sys in ours eager; do
    if [ $sys = ours ]; then
      cmd=(.gpu/bin/burn-zero run --nproc-per-node 1 --master-port "$port" -- .gpu/bin/bench-e2e)
    else
      cmd=(python3 bench/e2e_eager.py)
    fi
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-150}" "$nsys" profile -t cuda --sample none \
      --cpuctxsw none -o "/tmp/nsys-$sys-$size" -f true "${cmd[@]}" "$size" "$stage" "$steps" \
      "$micro" "$seq" $([ $sys = ours ] && echo "${OURS_ARGS:-}") \
      > "/tmp/nsys-$sys-$size.out" 2> "$out/nsys-$sys-$size.log"
    echo "nsys $sys $size: exit $?"
    "$nsys" stats --report cuda_gpu_trace --format csv -o "/tmp/nsys-$sys-$size" \
      "/tmp/nsys-$sys-$size.nsys-rep" > /dev/null 2>> "$out/nsys-$sys-$size.log"
    python3 bench/nsys_busy.py "/tmp/nsys-$sys-${size}_cuda_gpu_trace.csv" "/tmp/nsys-$sys-$size.out" \
      | tagged "nsys-$sys-$size" "$c" | tee -a /tmp/pace-nsys.jsonl
  done
done
[ -f /tmp/pace-nsys.jsonl ] || : > /tmp/pace-nsys.jsonl
[ -f /tmp/pace-kernels.jsonl ] || : > /tmp/pace-kernels.jsonl
python3 - "$kind" "$out/${OUT_NAME:-host-pace}-$kind.json" <<'PY'
import json, sys
runs = [json.loads(l) for l in open("/tmp/pace.jsonl")]
nsys_runs = [json.loads(l) for l in open("/tmp/pace-nsys.jsonl") if l.strip()]
kernels = [json.loads(l) for l in open("/tmp/pace-kernels.jsonl") if l.strip()]
summary = []
for case in dict.fromkeys(r["case"] for r in runs):
    rows = [r for r in runs if r["case"] == case]
    eager = next((r for r in rows if r["tag"].startswith("eager-")), {})
    base = eager.get("tokens_per_s_per_gpu")
    for r in rows:
        tps = r.get("tokens_per_s_per_gpu")
        summary.append({"case": case, "tag": r["tag"], "tokens_per_s": tps,
                        "over_eager_torch": tps / base if tps and base else None,
                        "gpu_busy_smi": r.get("gpu_busy_smi"), "median_step_s": r.get("median_step_s"),
                        "final_loss": (r.get("losses") or [None])[-1],
                        "peak_gpu_mib": r.get("peak_gpu_mib")})
# Over the repeats (tags ending in -rN): each system's median tokens/s, its spread, and the
# ratio of medians to eager torch's.
import re, statistics
by_system = {}
for r in runs:
    if r.get("tokens_per_s_per_gpu"):
        system = re.sub(r"-r[0-9]+$", "", r["tag"])
        by_system.setdefault((r["case"], system), []).append(r["tokens_per_s_per_gpu"])
repeats = []
for (case, system), values in by_system.items():
    eager = by_system.get((case, next((s for c, s in by_system if c == case
                                        and s.startswith("eager-")), "")), [])
    median = statistics.median(values)
    repeats.append({"case": case, "system": system, "runs": len(values),
                    "median_tokens_per_s": median, "min": min(values), "max": max(values),
                    "over_eager_torch_median": median / statistics.median(eager) if eager else None})
json.dump({"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
           "summary": summary, "over_repeats": repeats, "gpu_busy": nsys_runs,
           "kernels": kernels, "runs": runs},
          open(sys.argv[2], "w"), indent=1)
for s in summary + repeats + nsys_runs:
    print(json.dumps(s))
PY
