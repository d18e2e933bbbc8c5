#!/usr/bin/env bash
# Issue 36 diagnostic, one call: where the register-resident attention kernels spend their
# instructions. bench-attention's timings run once with a cubecl.toml that logs every compiled
# kernel's CUDA source; each `mma_*` kernel's source is compiled again with nvcc for sm_90 and
# its SASS dumped (opcode counts per kernel, registers and spills from ptxas), and ncu profiles
# one launch of each at seq 4096 / head dim 128 with the full set (instruction mix, stall
# reasons per SASS line). Writes $OUT/logs.tgz and $OUT/attention-sass-<kind>.json.
#   bash bench/diag_attention_sass.sh KIND     (carry [".gpu/bin", ".gpu/commit"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh bench-attention; NCU_KERNELS as in
#   run_attention_registers.sh, "" for none)
source bench/prelude.sh "$1"
logs="$out/logs"; mkdir -p "$logs"
printf '[compilation.logger]\nlevel = "full"\nfile = "%s"\n' "$logs/kernels.log" > cubecl.toml
BURN_ZERO_ATTENTION_REGISTER_SCORES=1 timeout 200 .gpu/bin/bench-attention time --iterations 3 \
  > "$logs/time.jsonl" 2> "$logs/time.log"
echo "time: exit $?"; cat "$logs/time.jsonl"
rm -f cubecl.toml
python3 - "$logs" <<'PY'
import re, sys, os
logs = sys.argv[1]
text = open(f"{logs}/kernels.log").read()
blocks = re.findall(r"\[START_KERNEL_COMPILATION\](.*?)\[END_KERNEL_COMPILATION\]", text, re.S)
seen = {}
for b in blocks:
    name = re.search(r"name: (.*)", b)
    name = name.group(1) if name else "unnamed"
    m = re.search(r"mma_(forward|dq|dkdv)", name)
    if not m:
        continue
    src = re.search(r"source:\n```[a-z]*\n(.*)```", b, re.S).group(1)
    n = seen.get(m.group(0), 0)
    seen[m.group(0)] = n + 1
    path = f"{logs}/{m.group(0)}-{n}.cu"
    open(path, "w").write(src)
    print("kernel source", path, name[:160])
PY
nvcc_arch="-arch=sm_90"
for cu in "$logs"/mma_*.cu; do
  [ -e "$cu" ] || continue
  base="${cu%.cu}"
  # cubecl's mbarrier wrapper names its pointer type as NVRTC takes it; nvcc wants uint64_t.
  sed -i "s/uint64 \*mbar_ptr = /auto *mbar_ptr = /" "$cu"
  nvcc -cubin $nvcc_arch -O3 -Xptxas -v -o "$base.cubin" "$cu" > "$base.ptxas.txt" 2>&1
  echo "nvcc $(basename "$cu"): exit $?"; grep -E "registers|spill" "$base.ptxas.txt" | head -4
  cuobjdump -sass "$base.cubin" > "$base.sass" 2>&1
  # Opcode counts over the whole kernel (static), the main loop is the bulk.
  grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+[@!A-Z0-9_.]+( [A-Z0-9_.]+)?' "$base.sass" \
    | awk '{op=$2; if (op ~ /^@/) op=$3; split(op, p, "."); print p[1]}' | sort | uniq -c | sort -rn \
    > "$base.opcodes.txt"
  echo "opcodes $(basename "$base"): $(head -12 "$base.opcodes.txt" | awk '{printf "%s %s, ", $2, $1}')"
done
if command -v ncu > /dev/null; then
  for ks in ${NCU_KERNELS-mma_forward:18 mma_dq:9 mma_dkdv:9}; do
    k=${ks%%:*}; skip=${ks##*:}
    BURN_ZERO_ATTENTION_REGISTER_SCORES=1 timeout 150 ncu --kernel-name "regex:$k" --launch-skip "$skip" \
      --launch-count 1 --set full --import-source no -o "$logs/ncu-$k" \
      .gpu/bin/bench-attention time --iterations 2 > "$logs/ncu-$k.log" 2>&1
    echo "ncu $k: exit $?"
    ncu -i "$logs/ncu-$k.ncu-rep" --csv --page details > "$logs/ncu-$k-details.csv" 2>&1
    ncu -i "$logs/ncu-$k.ncu-rep" --csv --page source --print-source sass > "$logs/ncu-$k-sass.csv" 2>&1
    echo "ncu $k pages: exit $?"
    python3 bench/ncu_sass_mix.py "$logs/ncu-$k-sass.csv" | head -12
    grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc Active" \
      "$logs/ncu-$k-details.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF}'
    rm -f "$logs/ncu-$k.ncu-rep"
  done
fi
python3 - "$kind" "$out/attention-sass-$kind.json" "$logs" <<'PY'
import json, sys, glob, os
kind, path, logs = sys.argv[1:]
res = {"issue": 36, "device": kind, "commit": open(".gpu/commit").read().split()[0], "kernels": {}}
for f in sorted(glob.glob(f"{logs}/mma_*.opcodes.txt")):
    name = os.path.basename(f).replace(".opcodes.txt", "")
    ops = {}
    for line in open(f):
        c, op = line.split()
        ops[op] = int(c)
    res["kernels"][name] = {"static_opcodes": ops,
                            "ptxas": open(f.replace(".opcodes.txt", ".ptxas.txt")).read()[-600:]}
json.dump(res, open(path, "w"), indent=1)
PY
cd "$out" && tar czf logs.tgz logs && rm -rf logs
