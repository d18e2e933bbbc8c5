#!/usr/bin/env python3
"""Per-kernel GPU time from ncu `--page raw --csv` logs (bench/.gpu ncu.sh), by category.

    python3 analyse.py ncu-ours.csv.gz ncu-fsdp2.csv.gz > report.txt

For each file: the complete training steps, found by the optimizer kernels that run once per
step (a step ends with its last optimizer kernel), and the last complete one summarised. Where a
file holds no complete step (the run was cut short), it falls back to what is there: the phases
of the first step (init / forward+loss / backward) and, for ours, steady per-layer windows of the
forward (between attention-forward kernels) and backward (between attention dQ kernels).

Ours only: cuBLASLt autotune candidates of the first step are marked and left out of the steady
numbers. burn-zero wraps every cuBLASLt call in a `bz_wait` .. `bz_signal` bracket on the GEMM
stream; inside one bracket, every GEMM launch but the last is an autotune candidate.
Only the standard library: pandas may be missing.
"""
import csv
import gzip
import re
import statistics
import sys
from collections import defaultdict

# First match wins; order matters (e.g. "fused adam" before "fuse", "reduce_scatter" in nccl).
CATEGORIES = [
    ("nccl", r"nccl|oneRankReduce"),  # oneRankReduce: NCCL's 1-rank reduce(-scatter)
    ("optimizer", r"adam|multi_tensor_apply|lamb|optimizer"),
    ("attention", r"flash|attention|fmha|sdpa|tc_forward|tc_dq|tc_dkdv|group_sum"),
    ("gemm", r"gemm|cutlass|nvjet|sm90_xmma|cublas|kernel2|matmul"),
    ("flag/sync", r"^(raise|await_done|bz_wait|bz_signal)$|flag|barrier"),
    ("reduction", r"reduce|norm|sum|softmax|cross_entropy|nll"),  # before "fuse": reduce_kernel_fused
    ("elementwise/fused", r"elemwise|fuse|vectorized_elementwise|unrolled_elementwise|binop|unary|full_kernel|fill"),
    ("copy/cast/layout", r"copy|cast|into_contiguous|transpose|cat|slice|gather|scatter|index|embedding"),
]
SMALL_NS = 5_000  # "launch-bound" kernels: shorter than 5 us
OPTIMIZER = {"ours": r"adamw", "fsdp2": r"multi_tensor_apply|adam"}


def category(name):
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.I):
            return cat
    return "other"


def load(path):
    """[(kernel name, duration ns)] in launch order; skips ==PROF== lines and the units row."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    head = rows[0]
    name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    out = []
    for row in rows[1:]:
        value = row[time_col].replace(",", "")
        if not re.fullmatch(r"[0-9.]+", value):  # units row ("ns") or a kernel ncu failed on
            continue
        out.append((row[name_col], float(value)))
    return out


def autotune_mask(kernels):
    """True for cuBLASLt autotune candidates (ours): all GEMMs but the last in a bracket."""
    mask, bracket = [False] * len(kernels), None
    for i, (name, _) in enumerate(kernels):
        if name == "bz_wait":
            bracket = []
        elif name == "bz_signal" and bracket is not None:
            for j in bracket[:-1]:
                mask[j] = True
            bracket = None
        elif bracket is not None and category(name) == "gemm":
            bracket.append(i)
    return mask


def step_ends(kernels, pattern):
    """Index just past each step: the end of each run of optimizer kernels (gap < 50 launches)."""
    hits = [i for i, (n, _) in enumerate(kernels) if re.search(pattern, n, re.I)]
    ends = []
    for a, b in zip(hits, hits[1:] + [None]):
        if b is None or b - a > 50:
            ends.append(a + 1)
    return ends


def summary(kernels, idx, title, top=30):
    ks = [kernels[i] for i in idx]
    total = sum(d for _, d in ks)
    print(f"\n### {title}\n")
    if not ks:
        print("(no kernels)")
        return {}
    small = [d for _, d in ks if d < SMALL_NS]
    print(f"kernels: {len(ks)}, GPU time: {total / 1e6:.3f} ms; "
          f"< 5 us: {len(small)} kernels, {sum(small) / 1e6:.3f} ms\n")
    cats = defaultdict(lambda: [0, 0.0])
    for n, d in ks:
        cats[category(n)][0] += 1
        cats[category(n)][1] += d
    print("| category | kernels | ms | % |\n| --- | ---: | ---: | ---: |")
    for c, (k, d) in sorted(cats.items(), key=lambda x: -x[1][1]):
        print(f"| {c} | {k} | {d / 1e6:.3f} | {100 * d / total:.1f} |")
    names = defaultdict(lambda: [0, 0.0])
    for n, d in ks:
        names[n][0] += 1
        names[n][1] += d
    print(f"\n| top {top} kernels | count | total ms | mean us |\n| --- | ---: | ---: | ---: |")
    for n, (k, d) in sorted(names.items(), key=lambda x: -x[1][1])[:top]:
        print(f"| `{n[:90]}` | {k} | {d / 1e6:.3f} | {d / k / 1e3:.1f} |")
    return {c: d for c, (k, d) in cats.items()}


def windows(kernels, marker, keep):
    """Kernel index lists between consecutive launches of `marker` (one model layer each)."""
    at = [i for i, (n, _) in enumerate(kernels) if n.startswith(marker)]
    return [[j for j in range(a, b) if keep[j]] for a, b in zip(at, at[1:])]


def layer_stats(kernels, wins, what, skip_first=1):
    wins = wins[skip_first:]
    if not wins:
        return None
    per = [sum(kernels[j][1] for j in w) / 1e3 for w in wins]
    print(f"\n{what}: {len(wins)} whole layers (first {skip_first} skipped); per layer GPU time "
          f"median {statistics.median(per):.1f} us, mean {statistics.mean(per):.1f} us, "
          f"min {min(per):.1f}, max {max(per):.1f}; kernels per layer "
          f"{sum(map(len, wins)) / len(wins):.1f}")
    merged = [j for w in wins for j in w]
    cats = summary(kernels, merged, f"{what}: all {len(wins)} steady layers together", top=20)
    return {"mean_us": statistics.mean(per), "median_us": statistics.median(per),
            "kernels": len(merged) / len(wins),
            "small": sum(kernels[j][1] < SMALL_NS for j in merged) / len(wins),
            "small_ms": sum(kernels[j][1] for j in merged if kernels[j][1] < SMALL_NS) / len(wins) / 1e6,
            "per_layer_ms": {c: d / len(wins) / 1e6 for c, d in cats.items()}}


def analyse(path, system):
    kernels = load(path)
    print(f"\n## {system}: {path}: {len(kernels)} kernels profiled, "
          f"{sum(d for _, d in kernels) / 1e6:.2f} ms GPU time in all")
    if not kernels:
        print("\nNo kernel rows: ncu profiled nothing before the run ended.")
        return
    tuned = autotune_mask(kernels) if system == "ours" else [False] * len(kernels)
    if any(tuned):
        at = [i for i, t in enumerate(tuned) if t]
        print(f"cuBLASLt autotune candidates: {len(at)} launches, "
              f"{sum(kernels[i][1] for i in at) / 1e6:.2f} ms (first step only)")
    ends = step_ends(kernels, OPTIMIZER[system])
    print(f"optimizer runs (step ends) found: {len(ends)}")
    if len(ends) >= 2:
        a, b = ends[-2], ends[-1]
        print(f"complete steps after the first: {len(ends) - 1}; the last one is kernels {a}..{b - 1}")
        return summary(kernels, range(a, b), f"{system}: last complete step")
    # No complete steady step: describe what there is.
    print("\nNo complete steady step captured: phases of the first step instead.")
    starts = [i for i, (n, _) in enumerate(kernels) if n.startswith("slice_kernel_e_i32")]
    f0 = starts[0] if starts else 0
    fwd_att = [i for i, (n, _) in enumerate(kernels) if n.startswith("tc_forward")]
    loss = [i for i, (n, _) in enumerate(kernels)
            if fwd_att and i > fwd_att[-1] and n.startswith("cast_element_i_f32_o_bf16")]
    b0 = loss[0] + 1 if loss else len(kernels)
    keep = [not t for t in tuned]
    summary(kernels, range(0, f0), f"{system}: init (before the first batch)", top=10)
    summary(kernels, [i for i in range(f0, b0) if keep[i]],
            f"{system}: step 0 forward + loss ({len(fwd_att)} attention layers), autotune excluded")
    dq = [i for i, (n, _) in enumerate(kernels) if n.startswith("tc_dq")]
    summary(kernels, [i for i in range(b0, len(kernels)) if keep[i]],
            f"{system}: step 0 backward, partial ({len(dq)} of {len(fwd_att)} layers' attention "
            f"backward reached), autotune excluded")
    fwd = layer_stats(kernels, windows(kernels, "tc_forward", keep), f"{system}: forward layer")
    bwd = layer_stats(kernels, windows(kernels, "tc_dq", keep), f"{system}: backward layer")
    if fwd and bwd and dq:
        # Extrapolation to one steady step, optimizer and embedding backward not included.
        f_ms = sum(kernels[i][1] for i in range(f0, b0) if keep[i]) / 1e6
        head = sum(kernels[i][1] for i in range(b0, dq[0]) if keep[i]) / 1e6
        b_ms = head + len(fwd_att) * bwd["mean_us"] / 1e3
        print(f"\nEstimate of a steady step's kernel time without the optimizer: forward+loss "
              f"{f_ms:.1f} ms (step 0, autotune out) + backward {b_ms:.1f} ms (LM-head/loss/norm "
              f"backward {head:.1f} ms + {len(fwd_att)} x mean layer {bwd['mean_us'] / 1e3:.2f} ms)"
              f" = {f_ms + b_ms:.1f} ms")
        est = defaultdict(float)
        for i in list(range(f0, b0)) + list(range(b0, dq[0])):
            if keep[i]:
                est[category(kernels[i][0])] += kernels[i][1] / 1e6
        for c, ms in bwd["per_layer_ms"].items():
            est[c] += len(fwd_att) * ms
        n = len(fwd_att)
        part = [i for i in range(f0, dq[0]) if keep[i]]
        k = len(part) + n * bwd["kernels"]
        sm = sum(kernels[i][1] < SMALL_NS for i in part) + n * bwd["small"]
        sm_ms = sum(kernels[i][1] for i in part if kernels[i][1] < SMALL_NS) / 1e6 + n * bwd["small_ms"]
        print(f"Estimated kernels per step (no optimizer): {k:.0f}, of them < 5 us: {sm:.0f} "
              f"({sm_ms:.2f} ms)")
        print(f"\n| category | fwd layer ms | bwd layer ms | est. step ms (no optimizer) |"
              "\n| --- | ---: | ---: | ---: |")
        for c in sorted(est, key=lambda c: -est[c]):
            print(f"| {c} | {fwd['per_layer_ms'].get(c, 0):.3f} | "
                  f"{bwd['per_layer_ms'].get(c, 0):.3f} | {est[c]:.2f} |")
        print(f"| total | {fwd['mean_us'] / 1e3:.3f} | {bwd['mean_us'] / 1e3:.3f} | "
              f"{sum(est.values()):.2f} |")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        analyse(p, "fsdp2" if "fsdp" in p else "ours")
