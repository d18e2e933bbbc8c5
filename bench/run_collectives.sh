#!/usr/bin/env bash
# Device side, one call: burn-zero's collectives and torch.distributed's on the same GPUs,
# merged into $OUT/collectives-<kind>.json. Needs .gpu/ staged by
#   scripts/gpu-stage.sh bench-collectives   (with GPU_FEATURES=nccl)
# Usage: bash bench/run_collectives.sh KIND
source bench/prelude.sh "$@"
.gpu/bin/burn-zero report > "$out/report.txt" 2>&1; cat "$out/report.txt"
.gpu/bin/burn-zero run --nproc-per-node "$gpus" --master-port 29511 -- .gpu/bin/bench-collectives > "$out/ours.log" 2>&1
echo "burn-zero exit $?"; tail -5 "$out/ours.log"
torchrun --nproc-per-node "$gpus" --master-port 29512 bench/collectives_torch.py > "$out/torch.log" 2>&1
echo "torch exit $?"; tail -3 "$out/torch.log"
python3 - "$kind" "$gpus" "$out" <<'PY'
import json, re, subprocess, sys
import torch
kind, gpus, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def lines(path, prefix):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith(prefix):
            line = line[len(prefix):]
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows
ours = lines(f"{out}/ours.log", "[rank 0] ")
theirs = lines(f"{out}/torch.log", "")
nccl = re.search(r"nccl version (\d+)", open(f"{out}/ours.log").read())
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().splitlines()
results = []
for o in ours:
    t = next((t for t in theirs if t["op"] == o["op"] and t["bytes"] == o["bytes"]), None)
    results.append({"op": o["op"], "bytes": o["bytes"], "burn_zero_busbw_GBps": o["busbw_GBps"],
                    "torch_busbw_GBps": t and t["busbw_GBps"],
                    "ratio": t and round(o["busbw_GBps"] / t["busbw_GBps"], 3),
                    "burn_zero_time_us": o["time_us"], "torch_time_us": t and t["time_us"]})
doc = {"benchmark": "collectives", "kind": kind, "gpus": gpus, "device": smi,
       "commit": open(".gpu/commit").read().split(), "burn": "0.21.0", "cudarc": "0.19.10",
       "nccl_burn_zero": nccl and int(nccl.group(1)), "torch": torch.__version__,
       "nccl_torch": ".".join(map(str, torch.cuda.nccl.version())),
       "env": {"NCCL_NVLS_ENABLE": "0"},
       "method": "busbw = bytes/time x (n-1)/n (x2 for all_reduce); bytes = larger buffer; 3 warmup, 20 iters (<=64 MiB) or 10, device sync; buffers of ones",
       "results": results}
json.dump(doc, open(f"{out}/collectives-{kind}.json", "w"), indent=1)
for r in results:
    print(f"{r['op']:>15} {r['bytes'] >> 20:>5} MiB  ours {r['burn_zero_busbw_GBps']:>7} GB/s  torch {r['torch_busbw_GBps']} GB/s  ratio {r['ratio']}")
PY
