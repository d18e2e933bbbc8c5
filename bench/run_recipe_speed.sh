#!/usr/bin/env bash
# Issue 37's speed check, one call: the recipe's model (SmolLM2-135M's shape, bench-e2e's
# `smollm2` preset, shared starting weights and tokens) at the recipe's batch (32 × 256 a GPU),
# stage 2, bf16, AdamW, clipping at 1, on 1 GPU and then 2 GPUs: ours with CUDA graphs
# (`--graphs 1`) and without (`--graphs 0`: the same forward_backward call, eager), eager torch
# (DDP on 2 GPUs) and torch.compile, each timed the same way (a device sync around each step
# only: PHASE_SYNC=0 for torch); then each system once more under CUPTI for the GPU's busy
# fraction (BUSY=1 of run_host_pace.sh). Writes $OUT/recipe-speed-<kind>.json.
#   bash bench/run_recipe_speed.sh KIND ["CASES"]   (carry [".gpu"]; STEPS, RUN_TIMEOUT, GPU_COUNTS)
source bench/prelude.sh "$1"
cases="${2:-smollm2:32:256:2}"
export STEPS="${STEPS:-15}" PHASE_SYNC=0 SKIP_FSDP2=1 EAGER_COMPILE=1 BUSY=1
export OURS_VARIANTS="eager:E2E_GRAPHS=0 graphs:E2E_GRAPHS=1"
root="$out"
for n in ${GPU_COUNTS:-1 2}; do
  OUT="$root/n$n" GPUS=$n OUT_NAME=pace bash bench/run_host_pace.sh "$kind" "$cases" \
    > "$root/pace-n$n.txt" 2>&1
  echo "$n GPU(s): exit $?"; grep -E '^\{"case"' "$root/pace-n$n.txt" | cut -c1-220
done
python3 - "$kind" "$root" "$root/recipe-speed-$kind.json" <<'PY'
import json, os, sys
kind, root, path = sys.argv[1:]
rows, busy = [], []
for n in sorted(d for d in os.listdir(root) if d.startswith("n") and d[1:].isdigit()):
    doc = json.load(open(os.path.join(root, n, f"pace-{kind}.json")))
    by_tag = {r["tag"]: r for r in doc["runs"]}
    for s in doc["summary"]:
        run = by_tag.get(s["tag"], {})
        rows.append({"gpus": int(n[1:]), **s, "system": run.get("system"),
                     "losses": run.get("losses"), "peak_gpu_gib_pool": run.get("peak_reserved_gib"),
                     "mfu": run.get("mfu"), "cuda_graphs": run.get("cuda_graphs"),
                     "phase_sync": run.get("phase_sync")})
    busy += [{"gpus": int(n[1:]), **b} for b in doc["gpu_busy"]]
doc = {"benchmark": "recipe-speed", "device": kind, "commit": open(".gpu/commit").read().split()[0],
       "method": "bench-e2e smollm2 preset (SmolLM2-135M's shape) and bench/e2e_eager.py from the "
                 "same shared weights and token stream; micro-batch x seq per GPU as in the case; "
                 "tokens/s per GPU over the timed steps (median step); torch timed with one device "
                 "sync a step (PHASE_SYNC=0), ours syncs around each step as well; ours-*-eager is "
                 "--graphs 0 (forward_backward, no capture), ours-*-graphs --graphs 1; busy: union "
                 "of kernels, copies and memsets over the timed steps from CUPTI (bench/nsys_busy.py)",
       "rows": rows, "gpu_busy": busy}
json.dump(doc, open(path, "w"), indent=1)
for r in rows:
    print(r["gpus"], r["tag"], r["tokens_per_s"], r["over_eager_torch"], r["final_loss"])
for b in busy:
    print(b["gpus"], b.get("tag"), b.get("gpu_busy"))
PY
