#!/usr/bin/env bash
# Device side of the CPU-Adam benchmark (issue 9): our fused step and torch's fused CPU AdamW on
# the same machine, the same thread count (every core), 1e9 fp32 parameters, in one run.
#   bash bench/run_cpu_adam.sh KIND     (carry [".gpu"], staged by scripts/gpu-stage.sh bench-cpu-adam)
source bench/prelude.sh "$1"
n="${PARAMS:-1e9}"; threads="${THREADS:-$(nproc)}"; steps="${STEPS:-5}"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)" > "$out/cpu.txt"
cat "$out/cpu.txt"
.gpu/bin/bench-cpu-adam --params "$n" --threads "$threads" --steps "$steps" > /tmp/ours.json
echo "ours: exit $?"
python3 bench/cpu_adam_torch.py "$n" "$threads" "$steps" > /tmp/torch.json
echo "torch: exit $?"
python3 - "$kind" "$out/cpu-adam-$kind.json" <<'PY'
import json, sys
ours, torch = json.load(open("/tmp/ours.json")), json.load(open("/tmp/torch.json"))
best = [r for r in ours["results"] if r["level"] == ours["detected_level"]]
fp32 = next(r for r in best if r["path"].startswith("fp32"))
result = {"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
          "cpu": open(sys.argv[2].rsplit("/", 1)[0] + "/cpu.txt").read(),
          "ours": ours, "torch": torch,
          "ratio_ours_over_torch_fp32": fp32["median_step_s"] / torch["median_step_s"]}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: result[k] for k in ("ratio_ours_over_torch_fp32",)}), fp32, torch)
PY
