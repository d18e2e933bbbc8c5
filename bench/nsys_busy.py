"""GPU busy fraction of a run's timed steps from a trace of its GPU activity (issue 37).
    python3 bench/nsys_busy.py TRACE.csv RUN.json
TRACE.csv is `nsys stats --report cuda_gpu_trace --format csv` of the run, or the CSV that
bench/cupti_busy's injection library writes in the same columns (kernels, copies and memsets,
each with its start and duration); RUN.json is the JSON line the run printed (its
`step_times_s`, the timed steps, which are the last ones). The window is the last sum(step
times) seconds before the last GPU activity, the busy time the union of the activities' intervals
inside it. Prints one JSON object."""
import csv
import json
import sys


def read_run(run_file):
    """The JSON line a run printed (its last line holding a `{`)."""
    line = [l for l in open(run_file) if "{" in l][-1]
    return json.loads(line[line.index("{"):])


def read_trace(trace):
    """The trace's rows, skipping the lines nsys prints before its header."""
    with open(trace) as f:
        return list(csv.DictReader([r for r in f if r.strip() and not r.startswith("Generating")]))


def window(spans, run):
    """The timed steps' window (begin, end, ns) over `spans` of (start, end) in ns."""
    timed_ns = sum(run["step_times_s"]) * 1e9
    end = max(e for _, e in spans)
    return end - timed_ns, end, timed_ns


def main():
    trace, run_file = sys.argv[1], sys.argv[2]
    run = read_run(run_file)
    spans = []
    for r in read_trace(trace):
        try:
            start = float(r["Start (ns)"])
            spans.append((start, start + float(r["Duration (ns)"])))
        except (KeyError, ValueError):
            continue
    if not spans:
        print(json.dumps({"error": "no GPU activity in the trace"}))
        return
    begin, end, timed_ns = window(spans, run)
    busy, cursor = 0.0, begin
    for s, e in sorted(spans):
        s, e = max(s, cursor), min(e, end)
        if e > s:
            busy += e - s
            cursor = e
    inside = sum(1 for s, e in spans if e > begin)
    print(json.dumps({"gpu_busy": busy / timed_ns, "window_s": timed_ns / 1e9,
                      "activities_in_window": inside,
                      "activities_per_step": inside / max(len(run["step_times_s"]), 1),
                      "traced_tokens_per_s": run.get("tokens_per_s_per_gpu")}))

if __name__ == "__main__":
    main()
