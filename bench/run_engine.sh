#!/usr/bin/env bash
# Device side, one call: training-step time of the engine (examples/src/bin/bench_engine.rs) at
# ZeRO stages 0–2 (burn's matmuls, device collectives; at stage 2 also cuBLASLt matmuls and
# host-staged collectives), and the PyTorch peer
# (bench/engine_torch.py) on the same GPUs; merged into $OUT/engine-<kind>.json.
# Needs .gpu/ staged by  GPU_FEATURES=nccl scripts/gpu-stage.sh bench-engine
source bench/prelude.sh "$@"
port=29700
: > "$out/engine.jsonl"
ours() { # log-name stage [ENV=VALUE...]
  port=$((port + 1))
  env "${@:3}" .gpu/bin/burn-zero run --nproc-per-node "$gpus" --master-port "$port" \
    -- .gpu/bin/bench-engine "$2" > "$out/engine-$1.log" 2>&1
  echo "bench-engine $1: exit $?"
  grep -h '"impl"' "$out/engine-$1.log" | sed 's/^\[rank 0\] //' >> "$out/engine.jsonl"
}
for stage in 0 1 2; do
  ours "$stage" "$stage"
  port=$((port + 1))
  torchrun --nproc-per-node "$gpus" --master-port "$port" bench/engine_torch.py "$stage" > "$out/torch-$stage.log" 2>&1
  echo "torch stage $stage: exit $?"
  grep -h '"impl"' "$out/torch-$stage.log" >> "$out/engine.jsonl"
done
# Stage 2 with cuBLASLt matmuls (opt-in), and with host-staged collectives.
ours 2-cublaslt 2 BURN_ZERO_CUBLASLT=1
ours 2-host 2 BURN_ZERO_HOST_COLLECTIVES=1
python3 - "$kind" "$gpus" "$out" <<'PY'
import json, subprocess, sys
kind, gpus, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(f"{out}/engine.jsonl") if l.strip()]
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
doc = {"benchmark": "engine-step", "kind": kind, "gpus": gpus, "gpu": gpu,
       "commit": open(".gpu/commit").read().split(),
       "method": "median of 8 timed steps after 4 warm-up steps; forward+backward+step, synchronized; "
                 "8 x Linear(4096,4096)+ReLU, batch 64 per GPU, AdamW, fp32 weights (TF32 matmuls in both)",
       "rows": rows}
for stage in (0, 1, 2):
    t = [r for r in rows if r["stage"] == stage and r["impl"] == "torch"]
    for r in rows:
        if r["stage"] == stage and r["impl"] == "burn-zero" and t:
            r["torch_over_ours"] = round(t[0]["median_step_ms"] / r["median_step_ms"], 3)
json.dump(doc, open(f"{out}/engine-{kind}.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
