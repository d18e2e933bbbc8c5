#!/usr/bin/env bash
# Device side of issue 11's and 39's pipeline checks, one call: the recipe's model shape in a
# pipeline over the GPUs (examples/src/bin/bench_pipeline.rs) on 1 GPU and, for each schedule, on
# each pipeline size of PIPES, same seeded weights and tokens: losses compared step by step, step
# times, and the idle fraction measured against the 1-GPU run beside the one the schedule implies.
#   bash bench/run_pipeline.sh KIND      (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-pipeline; STEPS, MICRO, RUN_TIMEOUT,
#   SCHEDULES: space-separated, default "1f1b"; e.g. "1f1b interleaved:2 zb-h1";
#   PIPES: space-separated pipeline sizes, default every GPU of the machine (e.g. "2 4" on 4:
#   a size below the machine's takes its first GPUs);
#   MODEL: smollm2 (default) or 3b; SEQ, BATCH: override the model's; a schedule written
#   NAME/host, e.g. 1f1b/host, runs with messages through the host instead of NCCL's links;
#   PIPE_CHECKPOINT=0|1 overrides the model's per-layer checkpointing in the pipelines, not in
#   the 1-GPU run: its losses still compare, its step time then does not, see idle_from_clock;
#   SUFFIX names those runs apart, e.g. SUFFIX=-nockpt)
source bench/prelude.sh "$1"
steps="${STEPS:-8}"; micro="${MICRO:-8}"; schedules="${SCHEDULES:-1f1b}"; pipes="${PIPES:-$gpus}"
shape=("${MODEL:-smollm2}" ${SEQ:+"$SEQ"} ${BATCH:+"$BATCH"})
run() {  # run N SCHEDULE TAG [LINKS]
  CUDA_VISIBLE_DEVICES="$(seq -s, 0 $(($1 - 1)))" PIPE_LINKS="${4:-device}" timeout "${RUN_TIMEOUT:-280}" \
    .gpu/bin/burn-zero run --nproc-per-node "$1" --master-port $((29800 + $1)) \
    -- .gpu/bin/bench-pipeline "$steps" "$micro" "$2" "${shape[@]}" > "/tmp/pipe-$3.out" 2> "$out/pipeline-$3.log"
  echo "pipeline $2 on $1 GPU(s): exit $?"; tail -n 3 "$out/pipeline-$3.log"
  # Each run's result line as it comes, kept should a later run outlast the call.
  grep -h "{" "/tmp/pipe-$3.out" | sed "s/^/$3 /" >> "$out/runs.jsonl"
}
PIPE_CHECKPOINT= run 1 1f1b one
# A schedule written NAME/host sends through the host side channel instead of NCCL's links.
for p in $pipes; do
  for s in $schedules; do
    links=device; [ "${s%/host}" != "$s" ] && links=host
    tag="${s//:/-}"; run "$p" "${s%/host}" "${tag//\//-}-$p${SUFFIX:-}" "$links"
  done
done
python3 - "$kind" "$out/pipeline-$kind.json" "$pipes" "${SUFFIX:-}" $schedules <<'PY'
import json, sys
kind, path, pipes, suffix, schedules = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4], sys.argv[5:]
def run(tag):
    try:
        line = [l for l in open(f"/tmp/pipe-{tag}.out") if "{" in l][-1]
        return json.loads(line[line.index("{"):])  # the launcher prefixes "[rank r] "
    except Exception as e:
        return {"error": f"no result ({e})"}
one = run("one")
result = {"device": kind, "commit": open(".gpu/commit").read().split()[0], "one_gpu": one,
          "pipelines": {}}
for p in pipes:
    n = int(p)
    for s in schedules:
        many = run(s.replace(":", "-").replace("/", "-") + f"-{p}{suffix}")
        if "losses" in one and "losses" in many:
            many["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(many["losses"], one["losses"]))
            if one.get("median_step_s") and many.get("median_step_s") and \
                    one.get("checkpointed_layers") == many.get("checkpointed_layers"):
                many["measured_idle_fraction"] = 1 - one["median_step_s"] / (n * many["median_step_s"])
        result["pipelines"][f"{s} on {p}{suffix}"] = many
json.dump(result, open(path, "w"), indent=1)
print(json.dumps({s: {k: r.get(k) for k in ("median_step_s", "measured_idle_fraction",
                  "idle_from_clock", "schedule_bubble_fraction", "bubble_measured_costs",
                  "max_rel_loss_diff", "peak_gpu_bytes", "error")}
                  for s, r in result["pipelines"].items()}))
PY
