"""Which kernels run beside a kernel of interest in a traced run's timed steps: for each launch
whose name matches PATTERN, the WIDTH kernels launched just before and after it on its stream
(one each by default), counted per step. A copy or cast that nothing in our code calls by name
is placed by its neighbours.
    python3 bench/kernel_neighbours.py TRACE.csv RUN.json PATTERN [TOP [WIDTH]]
TRACE.csv and RUN.json as for bench/busy_kernels.py; prints one JSON object."""
import json
import re
import sys
from collections import Counter

from busy_kernels import label
from nsys_busy import read_run, read_trace, window


def main():
    trace, run_file, pattern = sys.argv[1], sys.argv[2], re.compile(sys.argv[3])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    width = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    run = read_run(run_file)
    steps = max(len(run["step_times_s"]), 1)
    streams = {}
    for r in read_trace(trace):
        if r.get("Kind", "") != "kernel":
            continue
        start = float(r["Start (ns)"])
        streams.setdefault(r.get("Stream", ""), []).append(
            (start, start + float(r["Duration (ns)"]), label(r.get("Name", ""))))
    spans = [(s, e) for launches in streams.values() for s, e, _ in launches]
    begin, _, _ = window(spans, run)
    pairs, total = Counter(), 0
    for launches in streams.values():
        launches.sort()
        for i, (s, _, name) in enumerate(launches):
            if s < begin or not pattern.search(name):
                continue
            before = " < ".join(n for _, _, n in launches[max(i - width, 0):i]) or "-"
            after = " > ".join(n for _, _, n in launches[i + 1:i + 1 + width]) or "-"
            pairs[(before, after)] += 1
            total += 1
    print(json.dumps({
        "pattern": pattern.pattern,
        "per_step": total / steps,
        "neighbours": [{"before": b, "after": a, "per_step": n / steps}
                       for (b, a), n in pairs.most_common(top)],
    }))


if __name__ == "__main__":
    main()
