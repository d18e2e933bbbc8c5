#!/usr/bin/env bash
# Device side of issue 10's flash attention benchmark, one call (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-attention):
# bench-attention's check (flash and block-sparse vs an f32 materialized reference, and a NaN
# query element reaching its row's output; exit 1 on a miss), block-sparse against dense flash at seq 4k-16k, its
# timings beside torch's SDPA flash backend (bench/attention_torch.py), and the memory of one
# training step at seq 8k with the flash kernels and with burn's materialized fallback (each
# in its own process: the fallback may run out of memory). Merged into $OUT/attention-<kind>.json.
#   bash bench/run_attention.sh KIND       (ITERATIONS)
source bench/prelude.sh "$1"
iterations="${ITERATIONS:-5}"
: > /tmp/attn.jsonl
.gpu/bin/bench-attention check >> /tmp/attn.jsonl 2>> "$out/attention.log"
echo "check: exit $?"
.gpu/bin/bench-attention time --iterations "$iterations" >> /tmp/attn.jsonl 2>> "$out/attention.log"
echo "time: exit $?"
.gpu/bin/bench-attention sparse --iterations 3 >> /tmp/attn.jsonl 2>> "$out/attention.log"
echo "sparse: exit $?"
for flash in 1 0; do
  .gpu/bin/bench-attention memory --seq 8192 --hd 128 --flash $flash >> /tmp/attn.jsonl \
    2>> "$out/attention.log"
  echo "memory flash=$flash: exit $?"
done
.gpu/bin/bench-attention memory --seq 8192 --hd 128 --sparse bigbird >> /tmp/attn.jsonl \
  2>> "$out/attention.log"
echo "memory block-sparse: exit $?"
python3 bench/attention_torch.py "$iterations" > /tmp/attn-torch.jsonl 2>> "$out/attention.log"
echo "torch: exit $?"; tail -n 5 "$out/attention.log"
python3 - "$kind" "$out/attention-$kind.json" <<'PY'
import json, sys
def lines(path):
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except Exception:
            pass
    return out
ours, torch = lines("/tmp/attn.jsonl"), lines("/tmp/attn-torch.jsonl")
checks = [l["check"] for l in ours if "check" in l]
ours_time = [l["time"] for l in ours if "time" in l]
torch_time = [l["time"] for l in torch if "time" in l]
for t in ours_time:
    same = lambda p: all(p.get(k) == t.get(k) for k in ("seq", "head_dim", "batch", "heads", "kv_heads"))
    peer = next((p for p in torch_time if same(p)), None)
    if peer:
        t["torch_tflops"] = peer["tflops"]
        t["over_torch_throughput"] = t["tflops"] / peer["tflops"]
result = {"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
          "checks_passed": sum(c["pass"] for c in checks), "checks": len(checks),
          "check_cases": checks, "time": ours_time,
          "nan_checks": [l["check_nan"] for l in ours if "check_nan" in l],
          "memory": [l["memory"] for l in ours if "memory" in l],
          "block_sparse": [l["sparse"] for l in ours if "sparse" in l],
          "torch": [l for l in torch if "time" not in l]}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "check_cases"}, indent=1))
PY
