#!/usr/bin/env bash
# Device side of issue 37's correctness, one call on one GPU: the recipe's Llama (bench-e2e,
# the same shared weights and tokens) trained with each micro-step through
# `Engine::forward_backward`, CUDA graphs off (`--graphs 0`) and on (`--graphs 1`), per-step
# losses and gradient norms compared; cases with gradient accumulation (`--gas`) and a change of
# sequence length mid-run (`--seq-switch STEP:SEQ`, which must capture a new graph, not replay
# the old one). Writes $OUT/graphs-parity-<kind>.json.
#   bash bench/run_graphs.sh KIND ["SIZE:MICRO:SEQ:STAGE:GAS:SWITCH ..."]   (SWITCH: STEP-SEQ or -)
#   (carry [".gpu"], staged by GPU_FEATURES=nccl scripts/gpu-stage.sh bench-e2e; STEPS, RUN_TIMEOUT)
# Tolerance, fixed before any run: the same kernels on the same values in the same order
# (`deterministic`), so per-step losses and gradient norms within 1e-6 relative.
source bench/prelude.sh "$1"
cases="${2:-smollm2:8:256:2:1:- smollm2:8:256:2:2:- smollm2:8:256:0:1:- smollm2:8:256:2:1:10-128}"
steps="${STEPS:-20}"
: > /tmp/graphs.jsonl
port=29650
for c in $cases; do
  IFS=: read -r size micro seq stage gas switch <<< "$c"
  for graphs in 0 1; do
    port=$((port + 1))
    tag="$size-$micro-$seq-s$stage-gas$gas-sw$switch-g$graphs"
    extra=(); [ "$switch" = - ] || extra=(--seq-switch "${switch/-/:}")
    CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-180}" \
      .gpu/bin/burn-zero run --nproc-per-node 1 --master-port "$port" -- .gpu/bin/bench-e2e \
      "$size" "$stage" "$steps" "$micro" "$seq" --warmup 1 --deterministic 1 --gas "$gas" \
      --graphs "$graphs" "${extra[@]}" > "/tmp/$tag.out" 2> "$out/graphs-$tag.log"
    rc=$?
    echo "$tag: exit $rc"; tail -n 2 "$out/graphs-$tag.log"
    python3 - "$tag" "$c" "$graphs" "$rc" <<'PY' >> /tmp/graphs.jsonl
import json, sys
tag, case, graphs, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
try:
    line = [l for l in open(f"/tmp/{tag}.out") if "{" in l][-1]
    run = json.loads(line[line.index("{"):])
except Exception as e:
    run = {"error": f"no result ({e})"}
print(json.dumps({"case": case, "graphs": graphs, "exit": rc, "losses": run.get("losses"),
                  "grad_norms": run.get("grad_norms"), "error": run.get("error"),
                  "median_step_s": run.get("median_step_s"),
                  "tokens_per_s_per_gpu": run.get("tokens_per_s_per_gpu")}))
PY
  done
done
python3 - "$kind" "$out/graphs-parity-$kind.json" <<'PY'
import json, sys
runs = [json.loads(l) for l in open("/tmp/graphs.jsonl")]
tol = 1e-6
def worst(a, b):
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
cases, ok = [], True
for case in dict.fromkeys(r["case"] for r in runs):
    by = {r["graphs"]: r for r in runs if r["case"] == case}
    g, e = by.get("1", {}), by.get("0", {})
    dl, dn = worst(g.get("losses"), e.get("losses")), worst(g.get("grad_norms"), e.get("grad_norms"))
    # The weights must move, or runs that train nothing would pass.
    moved = bool(e.get("losses")) and max(e["losses"]) - min(e["losses"]) > 1e-3 * abs(e["losses"][0])
    passed = dl is not None and dn is not None and dl <= tol and dn <= tol and moved
    ok &= passed
    cases.append({"case": case, "steps": len(e.get("losses") or []),
                  "max_relative_loss_difference": dl, "max_relative_grad_norm_difference": dn,
                  "tolerance": tol, "losses_moved": moved, "ok": passed,
                  "losses_graphs": g.get("losses"), "losses_eager": e.get("losses"),
                  "grad_norms_graphs": g.get("grad_norms"), "grad_norms_eager": e.get("grad_norms"),
                  "median_step_s_graphs": g.get("median_step_s"),
                  "median_step_s_eager": e.get("median_step_s"),
                  "errors": [g.get("error"), e.get("error")]})
doc = {"benchmark": "graphs-parity", "device": sys.argv[1],
       "commit": open(".gpu/commit").read().split(),
       "method": "bench-e2e on one GPU, bf16, shared weights and tokens, deterministic, each "
                 "micro-step through Engine::forward_backward with burn_zero.cuda_graphs off and on; "
                 "max over steps of |graphs-eager|/|eager|. Case SIZE:MICRO:SEQ:STAGE:GAS:SWITCH.",
       "ok": ok, "cases": cases}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
for c in cases:
    print(c["case"], "loss", c["max_relative_loss_difference"], "norm",
          c["max_relative_grad_norm_difference"], "ok" if c["ok"] else "FAILED")
PY
