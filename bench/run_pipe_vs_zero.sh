#!/usr/bin/env bash
# Issue 39's side-by-side, one call on 4 GPUs: the 3B Llama (tied, each decoder layer
# checkpointed, fp32, sequence 2048) trained as a pipeline of 2 stages × 2 data copies
# (bench-pipeline, 1F1B, MICRO micro-batches of 1 sequence per copy and step) and with ZeRO-2 and
# ZeRO-3 over the same 4 GPUs (bench-e2e --precision fp32 --ac 1, one sequence per GPU and
# step), each with its tokens/s and its peak GPU memory (nvidia-smi's memory.used every 200 ms,
# the largest of the 4 GPUs) → $OUT/pipe-vs-zero-<kind>.json.
#   bash bench/run_pipe_vs_zero.sh KIND   (carry [".gpu/bin", ".gpu/commit"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-pipeline bench-e2e; STEPS, MICRO, RUN_TIMEOUT,
#   SYSTEMS: space-separated, default "pipe2x2 zero2 zero3")
source bench/prelude.sh "$1"
steps="${STEPS:-5}"; micro="${MICRO:-8}"
: > /tmp/pvz.jsonl
measure() {  # measure NAME COMMAND...: runs it on the 4 GPUs beside nvidia-smi's sampler
  local name=$1; shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "/tmp/mem-$name.log" &
  local smi=$!
  timeout "${RUN_TIMEOUT:-200}" "$@" > "/tmp/$name.out" 2> "$out/pvz-$name.log"
  local rc=$?
  kill $smi; wait $smi 2>/dev/null
  echo "$name: exit $rc"; tail -n 2 "$out/pvz-$name.log"
  python3 - "$name" "$rc" <<'PY' >> /tmp/pvz.jsonl
import json, sys
name, rc = sys.argv[1], int(sys.argv[2])
try:
    line = [l for l in open(f"/tmp/{name}.out") if "{" in l][-1]
    run = json.loads(line[line.index("{"):])
except Exception as e:
    run = {"error": f"no result ({e})"}
mib = [int(l.split(",")[1]) for l in open(f"/tmp/mem-{name}.log") if l.count(",") == 1]
run.update({"name": name, "exit": rc, "peak_gpu_mib_nvidia_smi": max(mib, default=None)})
print(json.dumps(run))
PY
}
launch=(.gpu/bin/burn-zero run --nproc-per-node 4 --master-port 29960 --)
for s in ${SYSTEMS:-pipe2x2 zero2 zero3}; do
  case $s in
    pipe2x2) measure "$s" "${launch[@]}" .gpu/bin/bench-pipeline "$steps" "$micro" 1f1b 3b 2048 1 2 ;;
    zero2) measure "$s" "${launch[@]}" .gpu/bin/bench-e2e 3b 2 "$steps" 1 2048 --precision fp32 --ac 1 ;;
    zero3) measure "$s" "${launch[@]}" .gpu/bin/bench-e2e 3b 3 "$steps" 1 2048 --precision fp32 --ac 1 ;;
  esac
done
python3 - "$kind" "$out/pipe-vs-zero-$kind.json" <<'PY'
import json, sys
kind, path = sys.argv[1:]
runs = [json.loads(l) for l in open("/tmp/pvz.jsonl")]
rows = {}
for r in runs:
    if r["name"] == "pipe2x2":
        tps = r.get("tokens_per_s")
        rows[r["name"]] = {"tokens_per_s_per_gpu": tps / 4 if tps else None,
                           "median_step_s": r.get("median_step_s"),
                           "tokens_per_step": 2 * r.get("micro_batches", 0) * r.get("seq", 0)}
    else:
        rows[r["name"]] = {"tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"),
                           "tokens_per_step": r.get("world", 0) * r.get("micro_batch", 0) * r.get("seq", 0)}
    rows[r["name"]]["peak_gpu_gib_nvidia_smi"] = (r["peak_gpu_mib_nvidia_smi"] or 0) / 1024
    rows[r["name"]]["exit"] = r["exit"]
json.dump({"device": kind, "commit": open(".gpu/commit").read().split(), "runs": runs,
           "summary": rows}, open(path, "w"), indent=1)
print(json.dumps(rows))
PY
