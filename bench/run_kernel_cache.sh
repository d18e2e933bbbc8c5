#!/usr/bin/env bash
# Device side: bench-matmul started twice with burn-zero's persistent CubeCL caches; the second
# process should pay no compile/autotune cost. Writes $OUT/kernel-cache-<kind>.json.
source bench/prelude.sh "$@"
export BENCH_PERSIST_KERNELS=1 BURN_ZERO_CACHE_DIR=/tmp/burn-zero-kernel-cache
rm -rf "$BURN_ZERO_CACHE_DIR"
s=$(date +%s); .gpu/bin/bench-matmul > "$out/first.log" 2>&1; echo "first process: exit $? in $(( $(date +%s) - s )) s"
s=$(date +%s); .gpu/bin/bench-matmul > "$out/second.log" 2>&1; echo "second process: exit $? in $(( $(date +%s) - s )) s"
du -sh "$BURN_ZERO_CACHE_DIR"/* 2>/dev/null
python3 - "$kind" "$out" <<'PY'
import json, sys
kind, out = sys.argv[1], sys.argv[2]
rows = lambda p: [json.loads(l) for l in open(p) if l.startswith("{")]
first, second = rows(f"{out}/first.log"), rows(f"{out}/second.log")
cases = []
for a, b in zip(first, second):
    cases.append({k: a[k] for k in ("dtype", "linear", "product", "m", "k", "n")} |
                 {"first_process_first_call_ms": a["first_call_ms"], "second_process_first_call_ms": b["first_call_ms"],
                  "first_process_tflops": a["tflops"], "second_process_tflops": b["tflops"]})
doc = {"benchmark": "kernel-cache", "kind": kind, "commit": open(".gpu/commit").read().split(),
       "method": "examples bench-matmul run twice in fresh processes with burn_zero::kernel_cache::persist (empty cache before the first)",
       "total_first_call_ms": [round(sum(c["first_process_first_call_ms"] for c in cases), 1), round(sum(c["second_process_first_call_ms"] for c in cases), 1)],
       "cases": cases}
json.dump(doc, open(f"{out}/kernel-cache-{kind}.json", "w"), indent=1)
print("sum of first calls: first process", doc["total_first_call_ms"][0], "ms, second process", doc["total_first_call_ms"][1], "ms")
for c in cases:
    print(f"{c['dtype']:>4} {c['linear']:>17} {c['product']:>11}: first call {c['first_process_first_call_ms']:>9} ms -> {c['second_process_first_call_ms']:>8} ms; TFLOP/s {c['first_process_tflops']} -> {c['second_process_tflops']}")
PY
