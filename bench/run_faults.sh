#!/usr/bin/env bash
# Device side of issue 41 item 1, one call on 2 GPUs (carry [".gpu/bin", ".gpu/commit"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh dist-worker):
# the launcher runs dist-worker's device fault cases with NCCL on both GPUs, each under a
# communicator timeout of $TIMEOUT seconds (BURN_ZERO_TIMEOUT): `stall` (rank 1 sleeps before a
# device collective), `hang` (rank 1's NCCL stream waits on a flag nobody raises: the
# collective never runs and the watchdogs fire), `mismatch` (rank 1 all-gathers where rank 0
# all-reduces), `kill` (rank 1 SIGKILLs itself). Each must end within TIMEOUT + 10 s, non-zero,
# with the rank or the calls named. Logs in $OUT/faults/, a summary in $OUT/faults-<kind>.json.
#   bash bench/run_faults.sh KIND       (TIMEOUT, default 10)
source bench/prelude.sh "$1"
timeout_s="${TIMEOUT:-10}"
mkdir -p "$out/faults"
: > /tmp/faults.jsonl
for case in stall hang mismatch kill; do
  start=$(date +%s.%N)
  BURN_ZERO_TIMEOUT=$timeout_s timeout $((timeout_s + 60)) .gpu/bin/burn-zero run \
    --nproc-per-node 2 --master-port $((29600 + RANDOM % 300)) --grace 5 -- \
    .gpu/bin/dist-worker faults-gpu "$case" 1 > "$out/faults/$case.log" 2>&1
  code=$?
  took=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  verdict=$(grep -h "burn-zero run:" "$out/faults/$case.log" | tail -n 2 | tr '\n' ' ')
  echo "$case: exit $code after $took s; $verdict"
  end=$(date +%s.%N)
  python3 - "$case" "$code" "$took" "$timeout_s" "$out/faults/$case.log" "$end" >> /tmp/faults.jsonl <<'PY'
import json, re, sys
case, code, took, timeout, log, end = sys.argv[1:]
text = open(log, errors="replace").read()
fault = re.search(r"at step \d+ \(unix time ([0-9.]+)\)", text)
after = round(float(end) - float(fault.group(1)), 1) if fault else None
lines = [l for l in text.splitlines() if "burn-zero run:" in l or "burn-zero flight:" in l
         or "burn-zero: " in l or "mismatch" in l or "timed out" in l]
print(json.dumps({"case": case, "exit": int(code), "job_seconds": float(took),
                  "seconds_after_the_fault": after, "timeout_s": float(timeout),
                  "within_timeout_plus_10": after is not None and after <= float(timeout) + 10,
                  "lines": lines[:12]}))
PY
done
python3 - "$kind" "$out/faults-$kind.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open("/tmp/faults.jsonl")]
json.dump({"issue": 41, "device": sys.argv[1], "commit": open(".gpu/commit").read().split()[0],
           "note": "seconds_after_the_fault: from the victim's line (its clock) to the launcher's exit",
           "cases": rows}, open(sys.argv[2], "w"), indent=1)
PY
