#!/usr/bin/env bash
# Device side of mixed precision (issue 7): the engine parity model trained 20 steps on all GPUs
# of the machine in real bf16 at ZeRO stages 0-3, and in fp16 with dynamic loss scaling, each
# against the fp32 run of the same stage, in one call. Writes $OUT/gpu-precision-<kind>.json:
# per run the largest relative loss gap to fp32 over the 20 steps, skipped steps, final loss.
# Needs .gpu/bin/{burn-zero,dist-worker} (dist-worker built with --features nccl).
source bench/prelude.sh "$@"
port=29700
steps=20
run() { # name stage precision
  port=$((port + 1))
  timeout 120 .gpu/bin/burn-zero run --nproc-per-node "$gpus" --master-port "$port" -- \
    .gpu/bin/dist-worker train-gpu "$2" 1 "$3" "$steps" > "$out/$1.log" 2>&1
  echo "$1: exit $?"
}
for stage in 0 1 2 3; do
  run "fp32-stage$stage" "$stage" fp32
  run "bf16-stage$stage" "$stage" bf16
done
run fp16-stage2 2 fp16
run fp16-stage3 3 fp16
python3 - "$kind" "$gpus" "$out" "$steps" <<'PY'
import json, sys
kind, gpus, out, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def results(name):
    r = {}
    try:
        lines = open(f"{out}/{name}.log").read().splitlines()
    except OSError:
        return r
    for line in lines:
        for prefix in ("[rank 0] RESULT ", "[rank 0] STAT "):
            if line.startswith(prefix):
                key, value = line[len(prefix):].split(" ", 1)
                r[key] = json.loads(value) if value.strip().startswith("[") else float(value)
    return r
report = {"benchmark": "gpu-precision", "kind": kind, "gpus": gpus, "steps": steps,
          "commit": open(".gpu/commit").read().split(), "runs": {}}
for p in ("bf16", "fp16"):
    for stage in range(4):
        run, ref = results(f"{p}-stage{stage}"), results(f"fp32-stage{stage}")
        if not run:
            continue
        losses = [run.get(f"loss_{s}") for s in range(steps)]
        refs = [ref.get(f"loss_{s}") for s in range(steps)]
        ok = all(x is not None for x in losses + refs)
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, refs)) if ok else None
        report["runs"][f"{p}-stage{stage}"] = {
            "max_rel_loss_gap_vs_fp32": gap, "final_loss": losses[-1], "fp32_final_loss": refs[-1],
            "skipped_steps": run.get("skipped_steps"), "device_collectives": run.get("device_collectives")}
json.dump(report, open(f"{out}/gpu-precision-{kind}.json", "w"), indent=1)
print(json.dumps(report, indent=1))
PY
