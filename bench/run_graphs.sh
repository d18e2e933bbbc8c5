#!/usr/bin/env bash
# Device side of issue 37's correctness, one call on one or more GPUs: the recipe's Llama (bench-e2e,
# the same shared weights and tokens) trained with each micro-step through
# `Engine::forward_backward`, CUDA graphs off (`--graphs 0`) and on (`--graphs 1`), per-step
# losses and gradient norms compared; cases with gradient accumulation (`--gas`) and a change of
# sequence length mid-run (`--seq-switch STEP:SEQ`, which must capture a new graph, not replay
# the old one). Writes $OUT/graphs-parity-<kind>.json.
#   bash bench/run_graphs.sh KIND ["SIZE:MICRO:SEQ:STAGE:GAS:SWITCH[:GPUS] ..."]
#   (SWITCH: STEP-SEQ or -; GPUS: processes, one per GPU, default 1)
#   (carry [".gpu"], staged by GPU_FEATURES=nccl scripts/gpu-stage.sh bench-e2e; STEPS, RUN_TIMEOUT)
# Tolerance, fixed before any run: the same kernels on the same values in the same order
# (`deterministic`), so per-step losses and gradient norms within 1e-6 relative.
source bench/prelude.sh "$1"
cases="${2:-smollm2:8:256:2:1:- smollm2:8:256:2:2:- smollm2:8:256:0:1:- smollm2:8:256:2:1:10-128}"
steps="${STEPS:-20}"
: > /tmp/graphs.jsonl
port=29650
for c in $cases; do
  IFS=: read -r size micro seq stage gas switch gpus <<< "$c"
  gpus=${gpus:-1}
  for graphs in 0 1; do
    port=$((port + 1))
    tag="$size-$micro-$seq-s$stage-gas$gas-sw$switch-n$gpus-g$graphs"
    extra=(); [ "$switch" = - ] || extra=(--seq-switch "${switch/-/:}")
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1))) timeout "${RUN_TIMEOUT:-180}" \
      .gpu/bin/burn-zero run --nproc-per-node "$gpus" --master-port "$port" -- .gpu/bin/bench-e2e \
      "$size" "$stage" "$steps" "$micro" "$seq" --warmup 1 --deterministic 1 --gas "$gas" \
      --graphs "$graphs" "${extra[@]}" > "/tmp/$tag.out" 2> "$out/graphs-$tag.log"
    rc=$?
    echo "$tag: exit $rc"; tail -n 2 "$out/graphs-$tag.log"
    python3 bench/parity_runs.py record "$tag" "$c" "g$graphs" "$rc" >> /tmp/graphs.jsonl
  done
done
python3 - "$kind" "$out/graphs-parity-$kind.json" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from parity_runs import compare
runs = [json.loads(l) for l in open("/tmp/graphs.jsonl")]
cases, ok = compare(runs, "g1", "g0", lambda c: 1e-6, lambda c: 1e-6)
doc = {"benchmark": "graphs-parity", "device": sys.argv[1],
       "commit": open(".gpu/commit").read().split(),
       "method": "bench-e2e on GPUS processes (one per GPU; losses and norms of rank 0), bf16, shared weights and tokens, deterministic, each "
                 "micro-step through Engine::forward_backward with burn_zero.cuda_graphs off (g0) "
                 "and on (g1); max over steps of |g1-g0|/|g0|. Case SIZE:MICRO:SEQ:STAGE:GAS:SWITCH[:GPUS].",
       "ok": ok, "cases": cases}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
for c in cases:
    print(c["case"], "loss", c["max_relative_loss_difference"], "norm",
          c["max_relative_grad_norm_difference"], "ok" if c["ok"] else "FAILED")
PY
