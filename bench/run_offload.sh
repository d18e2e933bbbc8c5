#!/usr/bin/env bash
# Device side of issue 9's benchmarks, one call (carry [".gpu"], staged by
#   scripts/gpu-stage.sh bench-cpu-adam bench-offload   with GPU_FEATURES=nccl):
#   1. CPU-Adam vs torch's fused CPU AdamW (bench/run_cpu_adam.sh)
#   2. one GPU, bf16, ZeRO-2: a deep MLP with the optimizer on the device and offloaded (same
#      size), then a larger one offloaded only; step time, breakdown and GPU memory peak.
#   bash bench/run_offload.sh KIND "LAYERS:WIDTH:cpu|nvme|none[:OPTIONS] ..."   (SKIP_CPU_ADAM=1: only these)
# OPTIONS, `+`-separated: `huge` advises the host partitions for transparent huge pages;
# `bf16init` builds the weights in bf16 (bench-offload's doc says why).
source bench/prelude.sh "$1"
runs="${2:-24:8192:none 24:8192:cpu 60:8192:cpu}"
[ -n "${SKIP_CPU_ADAM:-}" ] || bash bench/run_cpu_adam.sh "$1"
results=()
for spec in $runs; do
  IFS=: read -r layers width where options <<< "$spec"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > /tmp/mem.log &
  smi=$!
  timeout "${RUN_TIMEOUT:-200}" .gpu/bin/burn-zero run --nproc-per-node 1 --master-port 29711 -- \
    .gpu/bin/bench-offload "$layers" "$width" "$where" 5 "${options:-}" > /tmp/run.json 2> "$out/offload-${spec//:/_}.log"
  rc=$?
  kill $smi
  cat /tmp/run.json >> "$out/offload-${spec//:/_}.log"
  peak=$(sort -n /tmp/mem.log | tail -1)
  echo "$spec: exit $rc, peak GPU memory ${peak} MiB"; tail -n 3 "$out/offload-${spec//:/_}.log"
  python3 - "$spec" "$rc" "$peak" <<'PY' >> /tmp/offload-runs.jsonl
import json, sys
spec, rc, peak = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    line = open("/tmp/run.json").read().strip().splitlines()[-1]
    run = json.loads(line[line.index("{"):])  # the launcher prefixes "[rank 0] "
except Exception as e:
    run = {"error": f"no result ({e})"}
run.update({"spec": spec, "exit": rc, "peak_gpu_mib": int(peak) if peak.isdigit() else None})
print(json.dumps(run))
PY
  cp /tmp/offload-runs.jsonl "$out/offload-runs.jsonl"
done
python3 - "$kind" "$out/offload-$kind.json" <<'PY'
import json, sys
runs = [json.loads(l) for l in open("/tmp/offload-runs.jsonl")]
mem = open("/proc/meminfo").read().split("\n")[0]
# Parity: each offloaded run against the device-optimizer run of the same model (same seed, so
# step 0 must agree exactly; later steps differ only by the optimizer's arithmetic).
parity = []
for r in runs:
    base = next((b for b in runs if b.get("offload") == "none" and b.get("params") == r.get("params")), None)
    if base is None or r is base or not r.get("losses") or not base.get("losses"):
        continue
    # A non-finite loss is written as null: no parity then.
    pairs = list(zip(r["losses"], base["losses"]))
    if any(a is None or b is None for a, b in pairs):
        continue
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in pairs]
    parity.append({"spec": r["spec"], "against": base["spec"], "losses": r["losses"],
                   "device_losses": base["losses"], "max_rel_diff": max(diffs),
                   "step0_equal": r["losses"][0] == base["losses"][0]})
json.dump({"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0], "host_memory": mem,
           "runs": runs, "parity": parity}, open(sys.argv[2], "w"), indent=1)
for p in parity:
    print("parity", p["spec"], "max rel diff", p["max_rel_diff"], "step 0 equal", p["step0_equal"])
for r in runs:
    print(r["spec"], r.get("exit"), r.get("median_step_s"), r.get("offload_breakdown"), r.get("peak_gpu_mib"))
PY
