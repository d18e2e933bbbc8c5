#!/usr/bin/env bash
# Device side of issue 14's 3D run, one call on 8 GPUs: the recipe's model (SmolLM2-135M's
# shape, seeded weights, two synthetic batches in turn) trained in pipe 2 × data 2 × model 2
# (dist-worker llama-3d-gpu: ParallelLlamaStage, 1F1B over 4 micro-batches, Adam, fp32), and
# beside it on GPU 0 the unsplit model on the same whole batch (llama-ref-gpu). Losses compared
# step by step → $OUT/3d-<kind>.json.
#   bash bench/run_3d.sh KIND     (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh dist-worker; STEPS, RUN_TIMEOUT; GRID="PIPE DATA
#   MODEL" for another layout, e.g. "2 1 2" on 4 GPUs)
source bench/prelude.sh "$1"
steps="${STEPS:-10}"
read -r pipe data model <<< "${GRID:-2 2 2}"
n=$((pipe * data * model))
[ "$gpus" -ge "$n" ] || { echo "needs $n GPUs, this machine has $gpus"; exit 2; }
CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-500}" .gpu/bin/dist-worker llama-ref-gpu "$steps" $pipe $data $model \
  > /tmp/ref.out 2> "$out/3d-reference.log" &
ref=$!
timeout "${RUN_TIMEOUT:-500}" .gpu/bin/burn-zero run --nproc-per-node "$n" --master-port 29870 \
  -- .gpu/bin/dist-worker llama-3d-gpu "$steps" $pipe $data $model > /tmp/3d.out 2> "$out/3d-ranks.log"
echo "3d: exit $?"; wait $ref; echo "reference: exit $?"
cat /tmp/3d.out /tmp/ref.out | grep -E "LOSSES|REFERENCE" | cut -c1-300
grep -h "steps in" "$out/3d-ranks.log" | head -8
python3 - "$kind" "$out/3d-$kind.json" $pipe $data $model <<'PY'
import json, re, sys
kind, path = sys.argv[1], sys.argv[2]
pipe, data, model = map(int, sys.argv[3:6])
def floats(s): return [float(v) for v in s.strip().strip("[]").split(",") if v.strip()]
ranks, times = {}, {}
for line in open("/tmp/3d.out"):
    m = re.search(r"LOSSES (\[[^\]]*\]) (\[.*\])", line)
    if m: ranks[m.group(1)] = floats(m.group(2))
    m = re.search(r"STEP_S (\[[^\]]*\]) (\[.*\])", line)
    if m: times[m.group(1)] = floats(m.group(2))
ref = None
for line in open("/tmp/ref.out"):
    if line.startswith("REFERENCE "): ref = floats(line[len("REFERENCE "):])
result = {"device": kind, "commit": open(".gpu/commit").read().split(),
          "model": "SmolLM2-135M shape (30 layers, hidden 576, 9 heads, 3 kv heads, vocab 49152, tied), seeded",
          "grid": {"pipe": pipe, "data": data, "model": model}, "micro_batches": 4, "batch": 4, "seq": 256,
          "reference_1_gpu": ref, "last_stage_ranks_pipe_data_model": ranks}
if ref and ranks:
    result["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for l in ranks.values() for a, b in zip(l, ref))
    result["all_steps_reported"] = all(len(l) == len(ref) for l in ranks.values()) and len(ranks) == data * model
if times:
    # Steps after the first two (kernel compilation and autotuning), the slowest rank's.
    slowest = [max(t[i] for t in times.values()) for i in range(min(map(len, times.values())))]
    timed = sorted(slowest[2:]) or sorted(slowest)
    median = timed[len(timed) // 2]
    tokens = data * 4 * 4 * 256  # every data shard's 4 micro-batches of 4 sequences of 256
    result.update({"step_times_s": slowest, "median_step_s": median,
                   "tokens_per_s": tokens / median, "tokens_per_s_per_gpu": tokens / median / (pipe * data * model)})
json.dump(result, open(path, "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "last_stage_ranks_pipe_data_model"}))
PY
