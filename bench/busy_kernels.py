"""What a run's GPU did per timed step, by kernel (issue 37; issue 35's launch counts).
    python3 bench/busy_kernels.py TRACE.csv RUN.json [TOP]
TRACE.csv is the CSV of bench/cupti_busy (kernels with their names, copies, memsets); RUN.json
the JSON line the run printed. The window is bench/nsys_busy.py's: the last sum(step times)
seconds before the last GPU activity. Prints one JSON object: per step, the activities and their
time in each class (GEMM, attention, copy, memset, other kernels) and the TOP kernel names by
time, with their launches per step. A name's trailing hexadecimal hash (cubecl's) is dropped so
one kernel's variants count together."""
import json
import re
import sys

from nsys_busy import read_run, read_trace, window

CLASSES = [
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul", re.I)),
    ("attention", re.compile(r"flash|attention|mma_(forward|dq|dkdv)|sdpa|fmha", re.I)),
]


def label(name):
    """The kernel's name without its argument list or trailing hash."""
    name = name.split("(")[0]
    return re.sub(r"[_]?[0-9a-f]{8,}$", "", name)[:120]


def main():
    trace, run_file = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    run = read_run(run_file)
    steps = max(len(run["step_times_s"]), 1)
    rows = []
    for r in read_trace(trace):
        start, dur = float(r["Start (ns)"]), float(r["Duration (ns)"])
        rows.append((start, start + dur, r.get("Kind", ""), r.get("Name", "")))
    begin, _, _ = window([(s, e) for s, e, _, _ in rows], run)
    classes, names = {}, {}
    for s, e, kind, name in rows:
        if e <= begin:
            continue
        if kind != "kernel":
            cls = kind
        else:
            cls = next((c for c, rx in CLASSES if rx.search(name)), "other kernels")
            key = label(name)
            n = names.setdefault(key, [0, 0.0])
            n[0] += 1
            n[1] += e - s
        c = classes.setdefault(cls, [0, 0.0])
        c[0] += 1
        c[1] += e - s
    per_step = {c: {"count": n / steps, "ms": t / steps / 1e6} for c, (n, t) in classes.items()}
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    print(json.dumps({
        "steps": steps,
        "per_step": per_step,
        "kernels_per_step": sum(n for n, _ in names.values()) / steps,
        "top_by_time": [{"kernel": k, "per_step": n / steps, "ms_per_step": t / steps / 1e6}
                        for k, (n, t) in ranked],
    }))


if __name__ == "__main__":
    main()
