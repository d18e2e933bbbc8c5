#!/usr/bin/env bash
# Device side of issue 12, one call: bench-e2e (ours) and bench/e2e_fsdp2.py (PyTorch FSDP2) on
# the same machine, SIZE at ZeRO STAGE, on 1, 2, 4 and 8 GPUs (those the machine has), with each
# run's peak GPU memory from nvidia-smi; merged into $OUT/e2e-<kind>.json with the ratios.
#   bash bench/run_e2e.sh KIND [SIZE] [STAGE]    (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-e2e; STEPS, MICRO, SEQ, RUN_TIMEOUT)
source bench/prelude.sh "$1"
size="${2:-1b}"; stage="${3:-3}"
steps="${STEPS:-10}"; micro="${MICRO:-2}"; seq="${SEQ:-1024}"
: > /tmp/e2e.jsonl
port=29900
measure() { # name n command...
  local name=$1 n=$2; shift 2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > /tmp/mem.log &
  local smi=$!
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout "${RUN_TIMEOUT:-300}" "$@" \
    > "/tmp/$name-$n.out" 2> "$out/$name-$n.log"
  local rc=$?
  kill $smi
  local peak; peak=$(sort -n /tmp/mem.log | tail -1)
  echo "$name on $n GPU(s): exit $rc, peak $peak MiB"; tail -n 2 "$out/$name-$n.log"
  python3 - "$name" "$n" "$rc" "$peak" <<'PY' >> /tmp/e2e.jsonl
import json, sys
name, n, rc, peak = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    line = [l for l in open(f"/tmp/{name}-{n}.out") if "{" in l][-1]
    run = json.loads(line[line.index("{"):])
except Exception as e:
    run = {"error": f"no result ({e})"}
run.update({"name": name, "gpus": n, "exit": rc, "peak_gpu_mib": int(peak) if peak.isdigit() else None})
print(json.dumps(run))
PY
}
# GPU_COUNTS picks the sizes (default 1 2 4 8, those the machine has).
for n in ${GPU_COUNTS:-1 2 4 8}; do
  [ "$n" -le "$gpus" ] || continue
  port=$((port + 1))
  measure ours "$n" .gpu/bin/burn-zero run --nproc-per-node "$n" --master-port "$port" \
    -- .gpu/bin/bench-e2e "$size" "$stage" "$steps" "$micro" "$seq"
  port=$((port + 1))
  measure fsdp2 "$n" torchrun --nproc-per-node "$n" --master-port "$port" \
    bench/e2e_fsdp2.py "$size" "$stage" "$steps" "$micro" "$seq"
done
python3 - "$kind" "$out/e2e-$kind.json" <<'PY'
import json, sys
runs = [json.loads(l) for l in open("/tmp/e2e.jsonl")]
by = {(r["name"], r["gpus"]): r for r in runs}
ratios = {}
for (name, n), r in by.items():
    peer = by.get(("fsdp2", n))
    if name == "ours" and peer and "tokens_per_s_per_gpu" in r and "tokens_per_s_per_gpu" in peer:
        ratios[n] = {"tokens_per_s_per_gpu_ours_over_fsdp2":
                     r["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"],
                     "mfu_ours": r["mfu"], "mfu_fsdp2": peer["mfu"],
                     "final_loss_ours": r["losses"][-1], "final_loss_fsdp2": peer["losses"][-1]}
def scaling(name, n):
    one = by.get((name, 1), {}).get("tokens_per_s_per_gpu")
    many = by.get((name, n), {}).get("tokens_per_s_per_gpu")
    return many / one if one and many else None
result = {"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0], "runs": runs,
          "ratios_by_gpus": ratios,
          "scaling_4_gpus_of_linear_ours": scaling("ours", 4),
          "scaling_of_linear": {f"{name}_{n}_gpus": scaling(name, n)
                                for (name, n) in by if n > 1}}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
PY
