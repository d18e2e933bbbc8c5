#!/usr/bin/env python3
# Executed-instruction mix and stall reasons of one kernel from an ncu SASS source page
# (`ncu -i R --csv --page source --print-source sass`, which bench/diag_attention_sass.sh writes
# and summarises with this script):
#   python3 bench/ncu_sass_mix.py ncu-KERNEL-sass.csv
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h:i for i,h in enumerate(hdr)}
ops = collections.Counter(); stalls = collections.Counter(); samples = collections.Counter()
tot = 0; totsamp = 0
stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
for r in data:
    if len(r) < len(hdr): continue
    src = r[ix["Source"]].strip()
    op = src.split()[0] if src else "?"
    if op.startswith("@"): op = src.split()[1]
    op = op.split(".")[0]
    n = int(r[ix["Instructions Executed"]] or 0)
    ops[op] += n; tot += n
    s = int(r[ix["# Samples"]] or 0); samples[op] += s; totsamp += s
    for h in stall_cols:
        stalls[h] += int(r[ix[h]] or 0)
print("total warp instr executed", tot)
for op, n in ops.most_common(25): print(f"{op:10s} {n:12d} {n/tot:6.3f}  samples {samples[op]/max(totsamp,1):.3f}")
print("stalls:")
ts = sum(stalls.values())
for h, n in stalls.most_common(10): print(f"  {h:28s} {n/ts:.3f}")
