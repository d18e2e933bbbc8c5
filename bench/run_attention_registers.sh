#!/usr/bin/env bash
# Device side of issue 36's register-resident kernels, one call (carry [".gpu/bin", ".gpu/commit"],
# staged by GPU_FEATURES=nccl scripts/gpu-stage.sh bench-attention):
# bench-attention's check with the register kernels (forward, dq, dkdv; seq 1-8k, GQA, three
# dtypes, block-sparse on the shared-memory kernels), its timings with the register kernels and
# with the shared-memory ones, torch's SDPA (flash) beside them, and one ncu pass per register
# kernel (registers, spills, duration). Writes $OUT/attention-registers-<kind>.json and logs.
#   bash bench/run_attention_registers.sh KIND       (ITERATIONS; NCU_KERNELS="name:skip ...", "" for none;
#   an earlier binary in .gpu/prev/ with its .gpu/prev/commit is timed too, carry [".gpu"])
source bench/prelude.sh "$1"
iterations="${ITERATIONS:-10}"
logs="$out/logs"; mkdir -p "$logs"
BURN_ZERO_ATTENTION_REGISTER_SCORES=1 timeout 300 .gpu/bin/bench-attention check \
  > "$logs/check.jsonl" 2> "$logs/check.log"
echo "check: exit $? ($(grep -c '"pass":true' "$logs/check.jsonl") passed, $(grep -c '"pass":false' "$logs/check.jsonl") failed)"
grep '"pass":false' "$logs/check.jsonl" | head -5
for r in 1 0; do
  BURN_ZERO_ATTENTION_REGISTER_SCORES=$r timeout 300 .gpu/bin/bench-attention time \
    --iterations "$iterations" > "$logs/time-registers-$r.jsonl" 2>> "$logs/time.log"
  echo "time registers=$r: exit $?"
done
timeout 300 python3 bench/attention_torch.py "$iterations" > "$logs/torch.jsonl" 2>> "$logs/torch.log"
echo "torch: exit $?"
# An earlier binary's register kernels in the same call (carry .gpu/prev with its commit file).
if [ -x .gpu/prev/bench-attention ]; then
  BURN_ZERO_ATTENTION_REGISTER_SCORES=1 timeout 300 .gpu/prev/bench-attention time \
    --iterations "$iterations" > "$logs/time-prev.jsonl" 2>> "$logs/time.log"
  echo "time prev ($(cat .gpu/prev/commit 2>/dev/null | head -c 7)): exit $?"
fi
if command -v ncu > /dev/null; then
  # The 4th timed case (seq 4096, head dim 128): each case launches the forward 6 times
  # (warm-up and 2 timed steps, then as many forwards alone) and the backward kernels 3 times.
  for ks in ${NCU_KERNELS-mma_forward:18 mma_dq:9 mma_dkdv:9}; do
    k=${ks%%:*}; skip=${ks##*:}
    BURN_ZERO_ATTENTION_REGISTER_SCORES=1 timeout 120 ncu --kernel-name "regex:$k" --launch-skip "$skip" \
      --launch-count 1 --section LaunchStats --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis --csv \
      .gpu/bin/bench-attention time --iterations 2 > "$logs/ncu-$k.csv" 2>&1
    echo "ncu $k: exit $?"
  done
fi
python3 - "$kind" "$out/attention-registers-$kind.json" "$logs" <<'PY'
import json, os, sys
kind, path, logs = sys.argv[1:]
def lines(p):
    out = []
    for line in open(p):
        try:
            out.append(json.loads(line))
        except Exception:
            pass
    return out
checks = [l["check"] for l in lines(f"{logs}/check.jsonl") if "check" in l]
nan = [l["check_nan"] for l in lines(f"{logs}/check.jsonl") if "check_nan" in l]
reg = [l["time"] for l in lines(f"{logs}/time-registers-1.jsonl") if "time" in l]
smem = [l["time"] for l in lines(f"{logs}/time-registers-0.jsonl") if "time" in l]
torch = [l["time"] for l in lines(f"{logs}/torch.jsonl") if "time" in l]
prev = [l["time"] for l in lines(f"{logs}/time-prev.jsonl") if "time" in l] \
    if os.path.exists(f"{logs}/time-prev.jsonl") else []
key = lambda t: tuple(t.get(k) for k in ("seq", "head_dim", "batch", "heads", "kv_heads"))
rows = []
for t in reg:
    s = next((x for x in smem if key(x) == key(t)), {})
    p = next((x for x in torch if key(x) == key(t)), {})
    row = dict(zip(("seq", "head_dim", "batch", "heads", "kv_heads"), key(t)))
    row.update({"registers_fwd_ms": t["fwd_ms"], "registers_fwd_bwd_ms": t["fwd_bwd_ms"],
                "smem_fwd_ms": s.get("fwd_ms"), "smem_fwd_bwd_ms": s.get("fwd_bwd_ms"),
                "torch_fwd_ms": p.get("fwd_ms"), "torch_fwd_bwd_ms": p.get("fwd_bwd_ms")})
    if p.get("fwd_bwd_ms"):
        row["registers_fwd_bwd_over_torch_speed"] = p["fwd_bwd_ms"] / t["fwd_bwd_ms"]
        row["registers_fwd_over_torch_speed"] = p["fwd_ms"] / t["fwd_ms"]
    if s.get("fwd_bwd_ms"):
        row["registers_over_smem_speed"] = s["fwd_bwd_ms"] / t["fwd_bwd_ms"]
    r = next((x for x in prev if key(x) == key(t)), None)
    if r:
        row.update({"prev_fwd_ms": r["fwd_ms"], "prev_fwd_bwd_ms": r["fwd_bwd_ms"],
                    "registers_over_prev_speed": r["fwd_bwd_ms"] / t["fwd_bwd_ms"],
                    "registers_fwd_over_prev_speed": r["fwd_ms"] / t["fwd_ms"]})
    rows.append(row)
result = {"issue": 36, "device": kind, "commit": open(".gpu/commit").read().split()[0],
          "prev_commit": open(".gpu/prev/commit").read().split()[0] if prev else None,
          "checks_passed": sum(c["pass"] for c in checks) + sum(c["pass"] for c in nan),
          "checks": len(checks) + len(nan), "time": rows, "check_cases": checks, "nan_checks": nan}
json.dump(result, open(path, "w"), indent=1)
for r in rows:
    print(json.dumps(r))
print("checks", result["checks_passed"], "/", result["checks"])
PY
cd "$out" && tar czf logs.tgz logs && rm -rf logs
