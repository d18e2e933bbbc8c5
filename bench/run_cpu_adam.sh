#!/usr/bin/env bash
# Device side of the CPU-Adam benchmark (issue 9): our fused step and torch's fused CPU AdamW on
# the same machine, the same thread count (every core), 1e9 fp32 parameters, in one run.
# Ours runs as shipped (plain pages, unpinned threads: burn_zero.cpu_adam's defaults) and in
# variants (huge-page-advised buffers, pinned threads); torch runs as shipped and with its huge-page
# allocation switched on (THP_MEM_ALLOC_ENABLE=1). The ratio compares the best of each.
#   bash bench/run_cpu_adam.sh KIND     (carry [".gpu"], staged by scripts/gpu-stage.sh bench-cpu-adam)
source bench/prelude.sh "$1"
n="${PARAMS:-1e9}"; threads="${THREADS:-$(nproc)}"; steps="${STEPS:-5}"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)" > "$out/cpu.txt"
echo "transparent_hugepage: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)" >> "$out/cpu.txt"
cat "$out/cpu.txt"
: > /tmp/ours.jsonl
for variant in "" "--huge-pages" "--best-only --huge-pages --pin" ; do
  # shellcheck disable=SC2086
  .gpu/bin/bench-cpu-adam --params "$n" --threads "$threads" --steps "$steps" $variant >> /tmp/ours.jsonl
  echo "ours ($variant): exit $?"
done
: > /tmp/torch.jsonl
for thp in 0 1; do
  THP_MEM_ALLOC_ENABLE=$thp python3 bench/cpu_adam_torch.py "$n" "$threads" "$steps" >> /tmp/torch.jsonl
  echo "torch (THP_MEM_ALLOC_ENABLE=$thp): exit $?"
done
python3 - "$kind" "$out/cpu-adam-$kind.json" <<'PY'
import json, sys
ours = [json.loads(l) for l in open("/tmp/ours.jsonl")]
torch = [json.loads(l) for l in open("/tmp/torch.jsonl")]
def fp32(run):
    return next(r for r in run["results"]
                if r["level"] == run["detected_level"] and r["path"].startswith("fp32"))
best_ours = min(ours, key=lambda r: fp32(r)["median_step_s"])
best_torch = min(torch, key=lambda r: r["median_step_s"])
result = {"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
          "cpu": open(sys.argv[2].rsplit("/", 1)[0] + "/cpu.txt").read(),
          "ours": ours, "torch": torch,
          "shipped_ours_fp32_s": fp32(ours[0])["median_step_s"],
          "best_ours_fp32_s": fp32(best_ours)["median_step_s"],
          "best_ours_variant": {k: best_ours[k] for k in ("pinned", "huge_pages")},
          "best_torch_s": best_torch["median_step_s"],
          "ratio_shipped_ours_over_best_torch_fp32": fp32(ours[0])["median_step_s"] / best_torch["median_step_s"],
          "ratio_ours_over_torch_fp32": fp32(best_ours)["median_step_s"] / best_torch["median_step_s"]}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k not in ("ours", "torch", "cpu")}))
PY
