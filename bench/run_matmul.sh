#!/usr/bin/env bash
# Device side: burn's CUDA matmul and torch.matmul on the same shapes, one call; writes
# $OUT/matmul-<kind>.json. Needs .gpu/bin/bench-matmul (scripts/gpu-stage.sh bench-matmul).
#   bash bench/run_matmul.sh KIND [burn-zero|burn-cuda]   (default: both)
source bench/prelude.sh "$@"
.gpu/bin/bench-matmul "${@:2}" > "$out/burn.log" 2>&1; echo "burn exit $?"
python3 bench/matmul_torch.py > "$out/torch.log" 2>&1; echo "torch exit $?"
python3 - "$kind" "$out" <<'PY'
import json, subprocess, sys
import torch
kind, out = sys.argv[1], sys.argv[2]
rows = lambda p: [json.loads(l) for l in open(p) if l.startswith("{")]
burn, ref = rows(f"{out}/burn.log"), rows(f"{out}/torch.log")
results = []
for b in burn:
    t = next((t for t in ref if (t["dtype"], t["linear"], t["product"]) == (b["dtype"], b["linear"], b["product"])), None)
    t32 = next((t for t in ref if t["dtype"] == "f32-tf32" and (t["linear"], t["product"]) == (b["linear"], b["product"])), None) if b["dtype"] == "f32" else None
    results.append({**{k: b[k] for k in ("system", "dtype", "linear", "product", "m", "k", "n")},
                    "burn_tflops": b["tflops"], "torch_tflops": t and t["tflops"], "ratio": t and round(b["tflops"] / t["tflops"], 3),
                    "torch_tf32_tflops": t32 and t32["tflops"], "ratio_tf32": t32 and round(b["tflops"] / t32["tflops"], 3),
                    "burn_first_call_ms": b["first_call_ms"], "torch_first_call_ms": t and t["first_call_ms"],
                    "cublaslt_calls": b.get("cublaslt_calls"), "gemm_gpu_us": b.get("gemm_gpu_us"), "host_us_per_phase": b.get("host_us_per_phase")})
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
doc = {"benchmark": "matmul", "kind": kind, "device": smi, "commit": open(".gpu/commit").read().split(),
       "burn": "0.21.0; burn-zero: ZeroBackend<Cuda> (cuBLASLt, TF32 allowed for f32); burn-cuda: burn::backend::Cuda alone (fusion + autotune)", "torch": torch.__version__,
       "method": "2mkn/t; 3 warmup + 20 timed calls with device sync; gemm_gpu_us: CUDA events around each cuBLASLt GEMM (BURN_ZERO_MATMUL_PROFILE=1); host_us_per_phase: operands (taken from fusion's handles on its thread; burn-zero-resolve: resolved by the caller), cubecl (one call to its thread: output allocated, addresses), ordering before, cuBLASLt call, ordering after; time_us from the caller's thread, 20 calls then one sync; uniform(-1,1) inputs; first_call_ms includes kernel compile/autotune; torch f32 is strict fp32 (TF32 column: allow_tf32)",
       "results": results}
json.dump(doc, open(f"{out}/matmul-{kind}.json", "w"), indent=1)
for r in results:
    print(f"{r['system']:>9} {r['dtype']:>4} {r['linear']:>17} {r['product']:>11} {r['m']}x{r['k']}x{r['n']}: burn {r['burn_tflops']:>7} torch {r['torch_tflops']} ratio {r['ratio']} first {r['burn_first_call_ms']} ms")
PY
