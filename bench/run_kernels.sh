#!/usr/bin/env bash
# Device side of issue 10's kernel benchmark, one call (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-kernels):
# the fused AdamW kernel and LAMB passes checked against the tensor-op optimizer and timed beside burn's tensor
# ops (bench-kernels), torch.optim.AdamW(fused=True) and a copy measuring the bandwidth
# (bench/kernels_torch.py), same GPU, same parameter count; merged into $OUT/kernels-<kind>.json.
#   bash bench/run_kernels.sh KIND [PARAMS]       (STEPS)
source bench/prelude.sh "$1"
params="${2:-268435456}"; steps="${STEPS:-10}"
.gpu/bin/bench-kernels --params "$params" --steps "$steps" > /tmp/ours.json 2> "$out/kernels-ours.log"
echo "bench-kernels: exit $?"; cat "$out/kernels-ours.log"
python3 bench/kernels_torch.py "$params" "$steps" > /tmp/torch.json 2> "$out/kernels-torch.log"
echo "torch: exit $?"; tail -n 3 "$out/kernels-torch.log"
python3 - "$kind" "$out/kernels-$kind.json" <<'PY'
import json, sys
def load(path):
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except Exception as e:
        return {"error": f"no result ({e})"}
ours, torch = load("/tmp/ours.json"), load("/tmp/torch.json")
result = {"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
          "ours": ours, "torch": torch}
if "fused_s" in ours and "adamw_fused_s" in torch:
    result["fused_over_torch_time"] = ours["fused_s"] / torch["adamw_fused_s"]
    result["fused_fraction_of_copy_bandwidth"] = ours["fused_gb_per_s"] / torch["copy_gb_per_s"]
    result["torch_fraction_of_copy_bandwidth"] = torch["adamw_fused_gb_per_s"] / torch["copy_gb_per_s"]
    result["tensor_ops_over_fused_time"] = ours["tensor_ops_s"] / ours["fused_s"]
if "lamb_fused_s" in ours and "copy_gb_per_s" in torch:
    result["lamb_tensor_ops_over_fused_time"] = ours["lamb_tensor_ops_s"] / ours["lamb_fused_s"]
    result["lamb_fused_fraction_of_copy_bandwidth"] = ours["lamb_fused_gb_per_s"] / torch["copy_gb_per_s"]
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k not in ("ours",)}, indent=1))
PY
