#!/usr/bin/env bash
# Device side: the engine parity run (tests/src/cases.rs engine_run: 10 AdamW steps, clipping,
# warmup) on CPU (1 rank, TCP; equal to plain burn within 1e-5, see engine_parity.rs), on 1 GPU,
# and on all GPUs of the machine at ZeRO stages 0-3 over NCCL (collectives ordered by device flags;
# stage 2 also with overlap_comm, and host-staged), in one call. Writes
# $OUT/gpu-parity-<kind>.json with the largest relative differences and how many collectives
# ran on device memory (0 for the host-staged control run).
# Needs .gpu/bin/{burn-zero,dist-worker} (dist-worker built with --features nccl).
source bench/prelude.sh "$@"
port=29600
run() { # name nproc mode stage gas
  port=$((port + 1))
  .gpu/bin/burn-zero run --nproc-per-node "$2" --master-port "$port" -- .gpu/bin/dist-worker "$3" "$4" "$5" > "$out/$1.log" 2>&1
  echo "$1: exit $?"
}
run cpu 1 train 0 1
run gpu1-stage0 1 train-gpu 0 1
for stage in 0 1 2 3; do run "gpu$gpus-stage$stage" "$gpus" train-gpu "$stage" 1; done
run "gpu$gpus-stage2-gas3" "$gpus" train-gpu 2 3
# Collectives in flight while backward computes (stage 3 overlaps by default).
OVERLAP_COMM=1 run "gpu$gpus-stage2-overlap" "$gpus" train-gpu 2 1
# The same stage-2 run with collectives staged through host memory: an independent path.
BURN_ZERO_HOST_COLLECTIVES=1 run "gpu$gpus-stage2-host" "$gpus" train-gpu 2 1
python3 - "$kind" "$gpus" "$out" <<'PY'
import json, glob, os, sys
kind, gpus, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def results(name):
    r = {}
    for line in open(f"{out}/{name}.log"):
        for prefix in ("[rank 0] RESULT ", "[rank 0] STAT "):
            if not line.startswith(prefix):
                continue
            key, value = line[len(prefix):].split(" ", 1)
            r[key] = json.loads(value) if value.strip().startswith("[") else [float(value)]
    return r
def max_rel(a, b, prefix):
    worst = 0.0
    for k in a:
        if k.startswith(prefix):
            for x, y in zip(a[k], b[k]):
                worst = max(worst, abs(x - y) / max(abs(y), 1e-3))
    return worst
runs = sorted(os.path.basename(p)[:-4] for p in glob.glob(f"{out}/gpu*.log"))
cpu, one = results("cpu"), results("gpu1-stage0")
doc = {"benchmark": "gpu-parity", "kind": kind, "gpus": gpus, "commit": open(".gpu/commit").read().split(),
       "method": "max over steps/elements of |a-b|/max(|b|,1e-3); losses and clip norms of 10 steps, final parameters",
       "runs": {}}
for name in runs:
    r = results(name)
    if not r:
        doc["runs"][name] = {"error": "no results (see log)"}
        continue
    doc["runs"][name] = {
        "vs_1gpu": {p: max_rel(r, one, p) for p in ("loss_", "norm_", "param_")},
        "vs_cpu": {p: max_rel(r, cpu, p) for p in ("loss_", "norm_", "param_")},
        "final_loss": r["loss_9"][0],
        "device_collectives": int(r.get("device_collectives", [0])[0])}
json.dump(doc, open(f"{out}/gpu-parity-{kind}.json", "w"), indent=1)
print(json.dumps(doc["runs"], indent=1))
PY
