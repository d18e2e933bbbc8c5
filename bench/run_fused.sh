#!/usr/bin/env bash
# Device side of issue 35's fused-op benchmark, one call (carry [".gpu"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-fused ...):
# bench/fused_torch.py (torch eager equivalents of each op and of the loss) first, then
# bench-fused (checks of the kernels against burn ops, times of the kernels and of burn ops at
# the 8B Llama's shapes, the loss's time and memory, the loss's checks) on the same GPU, merged
# into $OUT/fused-ops-<kind>.json with each op's time ÷ torch's and the loss's ratios.
#   bash bench/run_fused.sh KIND       (ITERATIONS, default 20; FUSED_ARGS, e.g. "--checks loss";
#   FUSED_TIMEOUT seconds for bench-fused, default 420: torch runs first, the merge always)
source bench/prelude.sh "$1"
iterations="${ITERATIONS:-20}"
python3 bench/fused_torch.py "$iterations" > /tmp/fused-torch.json 2> "$out/fused-torch.log"
echo "torch: exit $?"; tail -n 3 "$out/fused-torch.log"
timeout "${FUSED_TIMEOUT:-420}" .gpu/bin/bench-fused --iterations "$iterations" ${FUSED_ARGS:-} \
  > /tmp/fused-ours.json 2> "$out/fused-ours.log"
echo "bench-fused: exit $?"; grep -v "^check" "$out/fused-ours.log" | tail -n 20; grep -c " ok$" "$out/fused-ours.log"
grep "FAILED\|started$" "$out/fused-ours.log" | tail -n 12
python3 - "$kind" "$out/fused-ops-$kind.json" <<'PY'
import json, sys
def load(path):
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except Exception as e:
        return {"error": f"no result ({e})"}
ours, torch = load("/tmp/fused-ours.json"), load("/tmp/fused-torch.json")
peers = {"rms_norm": ["rms_norm (torch.nn.RMSNorm)", "rms_norm (HF LlamaRMSNorm)"],
         "add_rms_norm": ["add_rms_norm (x + r, then torch.nn.RMSNorm)"],
         "swiglu": ["swiglu"], "rope Interleaved": ["rope Interleaved (32 heads)", "rope Interleaved (8 heads)"],
         "rope HalfSplit": ["rope HalfSplit (32 heads)"]}
ratios = []
by_name = {r["op"]: r for r in torch.get("time", [])}
seen = {}
for r in ours.get("time", []):
    i = seen.get(r["op"], 0); seen[r["op"]] = i + 1
    names = peers.get(r["op"], [])
    # Interleaved RoPE runs at 32 then 8 heads in both programs; the others once.
    candidates = [names[i]] if r["op"] == "rope Interleaved" and i < len(names) else names
    best = min((by_name[n] for n in candidates if n in by_name), key=lambda t: t["forward_backward_ms"], default=None)
    if best is None:
        continue
    ratios.append({"op": r["op"], "shape": r["shape"], "torch_peer": best["op"],
                   "forward_time_over_torch": r["kernels_forward_ms"] / best["forward_ms"],
                   "forward_backward_time_over_torch": r["kernels_forward_backward_ms"] / best["forward_backward_ms"],
                   "burn_ops_forward_backward_over_kernels": r["burn_ops_forward_backward_ms"] / r["kernels_forward_backward_ms"],
                   # Per call in queues of ten between syncs (no sync latency per call).
                   "forward_queued_over_torch": r["kernels_forward_queued_ms"] / best["forward_queued_ms"],
                   "forward_backward_queued_over_torch": r["kernels_forward_backward_queued_ms"] / best["forward_backward_queued_ms"]})
# The loss: each of our runs against torch eager's materialized loss (f32 logits, the peer;
# bf16 logits beside it), time and memory beyond the two gradients.
loss_ratios = []
peers_loss = {r["peer"]: r for r in torch.get("loss", [])}
for run in (ours.get("loss") or {}).get("runs", []):
    row = {"chunk_rows": run.get("chunk_rows"), "cross_entropy_kernel": run.get("cross_entropy_kernel")}
    for key, peer in peers_loss.items():
        tag = "f32_logits" if key.startswith("f32") else "bf16_logits"
        row[f"time_over_torch_{tag}"] = run["ms"] / peer["ms"]
        row[f"beyond_gradients_over_torch_{tag}"] = run["beyond_gradients_bytes"] / max(peer["beyond_gradients_bytes"], 1)
    loss_ratios.append(row)
result = {"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
          "checks_ok": ours.get("checks_ok"), "ratios": ratios, "loss": ours.get("loss"),
          "loss_ratios": loss_ratios,
          "ours": ours, "torch": torch}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps({"checks_ok": result["checks_ok"], "ratios": ratios, "loss": result["loss"],
                  "torch_loss": torch.get("loss"), "loss_ratios": loss_ratios}, indent=1))
PY
