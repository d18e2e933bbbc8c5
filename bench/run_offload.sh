#!/usr/bin/env bash
# Device side of issue 9's benchmarks, one call (carry [".gpu"], staged by
#   scripts/gpu-stage.sh bench-cpu-adam bench-offload   with GPU_FEATURES=nccl):
#   1. CPU-Adam vs torch's fused CPU AdamW (bench/run_cpu_adam.sh)
#   2. one GPU, bf16, ZeRO-2: a deep MLP with the optimizer on the device and offloaded (same
#      size), then a larger one offloaded only; step time, breakdown and GPU memory peak.
#   bash bench/run_offload.sh KIND "LAYERS:WIDTH:cpu|nvme|none[:OPTIONS] ..."   (SKIP_CPU_ADAM=1: only these)
# OPTIONS, `+`-separated: `huge` advises the host partitions for transparent huge pages;
# `bf16init` builds the weights in bf16 (bench-offload's doc says why); `formula` builds weights
# and inputs from bench-offload's formula (what bench/offload_deepspeed.py does); `serial` turns
# our overlap off; `atN` steps sub-groups ahead on N threads (`cpu_adam.ahead_threads`); `bf16g`
# accumulates gradients in bf16, so the host gradient partition is bf16.
# A spec `ds:LAYERS:WIDTH` runs DeepSpeed itself on the same model (bench/offload_deepspeed.py:
# formula weights and inputs, ZeRO-2, optimizer offloaded to the CPU, DeepSpeedCPUAdam); carry
# ".whl" too then (../shared/GPU.md). The summary pairs each of our runs with a DeepSpeed run of
# the same size ("versus_deepspeed").
source bench/prelude.sh "$1"
runs="${2:-24:8192:none 24:8192:cpu 60:8192:cpu}"
# DeepSpeed: its pure-Python install and the wheels the machine lacks (../shared/GPU.md), only
# when a spec asks for it; then its CPU-Adam op built once here (JIT, nvcc and ninja), outside
# the runs' timeouts.
want_ds=; for spec in $runs; do [[ "$spec" == ds:* ]] && want_ds=1; done
if [ -n "$want_ds" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && mkdir -p /tmp/dsb && tar xzf .whl/deepspeed-0.19.8.tar.gz -C /tmp/dsb \
    && (cd /tmp/dsb/deepspeed-0.19.8 && PYTHONPATH=/tmp/site DS_BUILD_OPS=0 python3 -m pip install \
        -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .) \
    || echo "DeepSpeed did not install"
  t0=$(date +%s)
  PYTHONPATH=/tmp/site timeout 900 python3 -c \
    'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
    > "$out/offload-ds-cpu-adam-build.log" 2>&1
  echo "DeepSpeed CPU-Adam op build: exit $? after $(( $(date +%s) - t0 )) s"
  tail -n 3 "$out/offload-ds-cpu-adam-build.log"
fi
[ -n "${SKIP_CPU_ADAM:-}" ] || bash bench/run_cpu_adam.sh "$1"
results=()
for spec in $runs; do
  nvidia-smi -i 0 --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits \
    -lms 200 > /tmp/smi.log &
  smi=$!
  if [[ "$spec" == ds:* ]]; then
    IFS=: read -r _ layers width <<< "$spec"
    PYTHONPATH=/tmp/site timeout "${RUN_TIMEOUT:-200}" torchrun --nproc-per-node 1 --master-port 29712 \
      bench/offload_deepspeed.py "$layers" "$width" 5 > /tmp/run.json 2> "$out/offload-${spec//:/_}.log"
  else
    IFS=: read -r layers width where options <<< "$spec"
    timeout "${RUN_TIMEOUT:-200}" .gpu/bin/burn-zero run --nproc-per-node 1 --master-port 29711 -- \
      .gpu/bin/bench-offload "$layers" "$width" "$where" 5 "${options:-}" > /tmp/run.json 2> "$out/offload-${spec//:/_}.log"
  fi
  rc=$?
  kill $smi
  cat /tmp/run.json >> "$out/offload-${spec//:/_}.log"
  cut -d, -f2 /tmp/smi.log | tr -d ' ' > /tmp/mem.log
  cp /tmp/smi.log "$out/offload-${spec//:/_}-smi.csv"
  peak=$(sort -n /tmp/mem.log | tail -1)
  echo "$spec: exit $rc, peak GPU memory ${peak} MiB"; tail -n 3 "$out/offload-${spec//:/_}.log"
  python3 - "$spec" "$rc" "$peak" <<'PY' >> /tmp/offload-runs.jsonl
import json, sys
spec, rc, peak = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    line = [l for l in open("/tmp/run.json").read().strip().splitlines() if "{" in l][-1]
    run = json.loads(line[line.index("{"):])  # the launcher prefixes "[rank 0] "
except Exception as e:
    run = {"error": f"no result ({e})"}
run.update({"spec": spec, "exit": rc, "peak_gpu_mib": int(peak) if peak.isdigit() else None})
# GPU busy fraction: nvidia-smi's utilization.gpu (the share of its sample period in which a
# kernel ran), averaged over the samples inside the timed steps' window.
from datetime import datetime
window = run.get("timed_window_unix_s") or [0, 0]
busy = []
for line in open("/tmp/smi.log"):
    parts = [p.strip() for p in line.split(",")]
    try:
        t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        if window[0] <= t <= window[1]:
            busy.append(float(parts[2]) / 100)
    except (ValueError, IndexError):
        pass
run["gpu_busy_smi"] = sum(busy) / len(busy) if busy else None
run["gpu_busy_samples"] = len(busy)
print(json.dumps(run))
PY
  cp /tmp/offload-runs.jsonl "$out/offload-runs.jsonl"
done
python3 - "$kind" "$out/offload-$kind.json" <<'PY'
import json, os, sys
runs = [json.loads(l) for l in open("/tmp/offload-runs.jsonl")]
mem = open("/proc/meminfo").read().split("\n")[0]
def is_ds(r):
    return r.get("spec", "").startswith("ds:")
def options(r):  # ours: the spec's fourth field, `+`-separated
    parts = r.get("spec", "").split(":")
    return parts[3].split("+") if len(parts) > 3 and parts[3] else []
def formula(r):
    return True if is_ds(r) else ("formula" in options(r) or r.get("formula") is True)
def rel_diffs(a, b):  # per step |a - b| / |b|; None when either lacks a finite loss
    if not a or not b or len(a) != len(b) or any(x is None for x in a + b):
        return None
    return [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)]
ours = [r for r in runs if not is_ds(r)]
# Parity: each offloaded run against the device-optimizer run of the same model (same seed, so
# step 0 must agree exactly; later steps differ only by the optimizer's arithmetic); among our
# own runs only, a base with the same `formula` option preferred.
parity = []
for r in ours:
    bases = [b for b in ours if b.get("offload") == "none" and b.get("params") == r.get("params")]
    base = next((b for b in bases if formula(b) == formula(r)), bases[0] if bases else None)
    if base is None or r is base or not r.get("losses") or not base.get("losses"):
        continue
    # A non-finite loss is written as null: no parity then.
    pairs = list(zip(r["losses"], base["losses"]))
    if any(a is None or b is None for a, b in pairs):
        continue
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in pairs]
    parity.append({"spec": r["spec"], "against": base["spec"], "losses": r["losses"],
                   "device_losses": base["losses"], "max_rel_diff": max(diffs),
                   "step0_equal": r["losses"][0] == base["losses"][0]})
# Against DeepSpeed: each of our runs with a DeepSpeed run of the same parameter count; the
# losses compared step by step when ours was built from the formula too.
versus = []
for r in ours:
    ds = next((d for d in runs if is_ds(d) and d.get("params") is not None
               and d.get("params") == r.get("params") and d.get("median_step_s")), None)
    if ds is None:
        continue
    a, b = r.get("median_step_s"), ds.get("median_step_s")
    v = {"spec": r["spec"], "against": ds["spec"], "offload": r.get("offload"),
         "median_step_s": a, "ds_median_step_s": b,
         "ratio": a / b if a and b else None,
         "engine_backward_s": r.get("engine_backward_s"), "engine_step_s": r.get("engine_step_s"),
         "ds_backward_s": ds.get("backward_s"), "ds_step_s": ds.get("step_s"),
         "peak_gpu_mib": r.get("peak_gpu_mib"), "ds_peak_gpu_mib": ds.get("peak_gpu_mib"),
         "formula": formula(r)}
    if formula(r):
        diffs = rel_diffs(r.get("losses"), ds.get("losses"))
        v.update({"losses": r.get("losses"), "ds_losses": ds.get("losses"), "rel_diffs": diffs,
                  "max_rel_diff": max(diffs) if diffs else None})
    versus.append(v)
# Our offloaded step against its largest part: backward on the device, the CPU step (with any
# part of it overlapped with the backward), the weights up. 1 would be perfect overlap.
for r in ours:
    b = r.get("offload_breakdown")
    if not isinstance(b, dict) or not r.get("median_step_s"):
        continue
    parts = {"engine_backward_s": r.get("engine_backward_s"),
             "cpu_s": (b.get("cpu_step_s") or 0.0) + (b.get("overlapped_cpu_step_s") or 0.0),
             "h2d_s": b.get("h2d_s")}
    parts = {k: x for k, x in parts.items() if x is not None}
    if parts and max(parts.values()) > 0:
        largest = max(parts, key=parts.get)
        r["step_over_max_part"] = r["median_step_s"] / parts[largest]
        r["step_max_part"] = largest
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), None)
json.dump({"device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0], "host_memory": mem,
           "host_cpu": cpu, "host_cores": os.cpu_count(),
           "runs": runs, "parity": parity, "versus_deepspeed": versus}, open(sys.argv[2], "w"), indent=1)
for p in parity:
    print("parity", p["spec"], "max rel diff", p["max_rel_diff"], "step 0 equal", p["step0_equal"])
for r in runs:
    print(r["spec"], r.get("exit"), r.get("median_step_s"), r.get("offload_breakdown"), r.get("peak_gpu_mib"),
          "busy", r.get("gpu_busy_smi"), "rows/s", r.get("rows_per_s"))
for r in runs:
    if "step_over_max_part" in r:
        print("step over max part", r["spec"], round(r["step_over_max_part"], 3), "(" + r["step_max_part"] + ")")
for v in versus:
    print("versus deepspeed", v["spec"], "vs", v["against"], "median", v["median_step_s"], "vs",
          v["ds_median_step_s"], "ratio ours/ds", v["ratio"],
          "max rel loss diff", v.get("max_rel_diff", "n/a (no formula)"))
PY
