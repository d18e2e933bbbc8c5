#!/usr/bin/env bash
# Device side of issue 11's pipeline check, one call: the recipe's model shape in a pipeline of
# one stage per GPU (examples/src/bin/bench_pipeline.rs) on 1 GPU and on every GPU of the
# machine, same seeded weights and tokens: losses compared step by step, step times, and the
# idle fraction measured against the 1-GPU run beside the one 1F1B implies.
#   bash bench/run_pipeline.sh KIND      (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-pipeline; STEPS, MICRO, RUN_TIMEOUT)
source bench/prelude.sh "$1"
steps="${STEPS:-8}"; micro="${MICRO:-8}"
for n in 1 "$gpus"; do
  timeout "${RUN_TIMEOUT:-280}" .gpu/bin/burn-zero run --nproc-per-node "$n" --master-port $((29800 + n)) \
    -- .gpu/bin/bench-pipeline "$steps" "$micro" > "/tmp/pipe-$n.out" 2> "$out/pipeline-$n.log"
  echo "pipeline on $n GPU(s): exit $?"; tail -n 3 "$out/pipeline-$n.log"
done
python3 - "$kind" "$gpus" "$out/pipeline-$kind.json" <<'PY'
import json, sys
kind, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def run(k):
    try:
        line = [l for l in open(f"/tmp/pipe-{k}.out") if "{" in l][-1]
        return json.loads(line[line.index("{"):])  # the launcher prefixes "[rank r] "
    except Exception as e:
        return {"error": f"no result ({e})"}
one, many = run(1), run(n)
result = {"device": kind, "commit": open(".gpu/commit").read().split()[0], "one_gpu": one, "pipeline": many}
if "losses" in one and "losses" in many:
    diffs = [abs(a - b) / abs(b) for a, b in zip(many["losses"], one["losses"])]
    result["max_rel_loss_diff"] = max(diffs)
    if one.get("median_step_s") and many.get("median_step_s"):
        efficiency = one["median_step_s"] / (n * many["median_step_s"])
        result["measured_idle_fraction"] = 1 - efficiency
json.dump(result, open(path, "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k not in ("one_gpu", "pipeline")}))
PY
