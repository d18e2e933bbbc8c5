#!/usr/bin/env bash
# Device side of issue 35's training parity, one call on one GPU: the recipe's Llama
# (bench-e2e, the same shared weights and tokens) trained with the fused kernels (RMSNorm,
# RoPE, SwiGLU, the loss's cross-entropy kernel) and with all four switched off
# (BURN_ZERO_FUSED_*=0: burn's ops and autodiff of the reference formulas), per-step losses and
# gradient norms compared. Writes $OUT/fused-parity-<kind>.json.
#   bash bench/run_fused_parity.sh KIND ["SIZE:MICRO:SEQ:PRECISION:AC ..."]
#   (carry [".gpu"], staged by GPU_FEATURES=nccl scripts/gpu-stage.sh bench-e2e; STEPS, RUN_TIMEOUT)
# Tolerances, fixed before any run: per-step loss within 1e-4 relative in fp32 and 1e-2 in
# bf16 (bf16 keeps 8 bits: 3.9e-3 a rounding, and the two paths round in different places);
# gradient norms within 1e-3 and 3e-2.
source bench/prelude.sh "$1"
cases="${2:-smollm2:8:256:fp32:0 smollm2:8:256:bf16:0 smollm2:8:256:bf16:1 1b:2:1024:bf16:0}"
steps="${STEPS:-10}"
: > /tmp/parity.jsonl
port=29750
off=(BURN_ZERO_FUSED_RMS_NORM=0 BURN_ZERO_FUSED_ROPE=0 BURN_ZERO_FUSED_SWIGLU=0
  BURN_ZERO_FUSED_CROSS_ENTROPY=0)
for c in $cases; do
  IFS=: read -r size micro seq precision ac <<< "$c"
  for mode in fused unfused; do
    port=$((port + 1))
    tag="$size-$micro-$seq-$precision-ac$ac-$mode"
    vars=(); [ "$mode" = unfused ] && vars=("${off[@]}")
    env "${vars[@]}" CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-180}" \
      .gpu/bin/burn-zero run --nproc-per-node 1 --master-port "$port" -- .gpu/bin/bench-e2e \
      "$size" 2 "$steps" "$micro" "$seq" --precision "$precision" --ac "$ac" --warmup 1 \
      > "/tmp/$tag.out" 2> "$out/parity-$tag.log"
    rc=$?
    echo "$tag: exit $rc"; tail -n 1 "$out/parity-$tag.log"
    python3 bench/parity_runs.py record "$tag" "$c" "$mode" "$rc" >> /tmp/parity.jsonl
  done
done
python3 - "$kind" "$out/fused-parity-$kind.json" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from parity_runs import compare
runs = [json.loads(l) for l in open("/tmp/parity.jsonl")]
tolerance = {"fp32": (1e-4, 1e-3), "bf16": (1e-2, 3e-2)}
cases, ok = compare(runs, "fused", "unfused", lambda c: tolerance[c.split(":")[3]][0],
                    lambda c: tolerance[c.split(":")[3]][1])
doc = {"benchmark": "fused-parity", "device": sys.argv[1],
       "commit": open(".gpu/commit").read().split(),
       "method": "bench-e2e at ZeRO-2 on one GPU, shared weights and tokens, fused kernels on and "
                 "all four off (BURN_ZERO_FUSED_*=0); max over steps of |fused-unfused|/|unfused|",
       "ok": ok, "cases": cases}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
for c in cases:
    print(c["case"], "loss", c["max_relative_loss_difference"], "norm",
          c["max_relative_grad_norm_difference"], "ok" if c["ok"] else "FAILED")
PY
