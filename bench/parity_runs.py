"""Shared by the two-mode parity scripts (run_fused_parity.sh, run_graphs.sh): one bench-e2e
run's per-step losses and gradient norms as a JSON line, and the comparison of two modes.

    python3 bench/parity_runs.py record TAG CASE MODE RC   (reads /tmp/TAG.out, prints a line)
"""
import json
import sys


def record(tag, case, mode, rc):
    """The run's JSON line (the last line of /tmp/TAG.out holding a JSON object)."""
    try:
        line = [l for l in open(f"/tmp/{tag}.out") if "{" in l][-1]
        run = json.loads(line[line.index("{"):])
    except Exception as e:  # a run that died prints no result
        run = {"error": f"no result ({e})"}
    return {"case": case, "mode": mode, "exit": rc, "losses": run.get("losses"),
            "grad_norms": run.get("grad_norms"), "error": run.get("error"),
            "median_step_s": run.get("median_step_s"),
            "tokens_per_s_per_gpu": run.get("tokens_per_s_per_gpu")}


def worst(a, b):
    """The largest |a - b| / |b| over the steps; None unless both ran the same steps."""
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def moved(run):
    """Whether the run's losses vary: runs whose losses never change would pass without any op
    running. (Not "the loss fell": at 1B from random weights it rises and falls in 10 steps.)"""
    losses = run.get("losses")
    return bool(losses) and max(losses) - min(losses) > 1e-3 * abs(losses[0])


def compare(runs, mode, reference, loss_tol, norm_tol):
    """Per case: `mode`'s runs against `reference`'s, within the tolerances (functions of the
    case), and whether the reference moved. Returns (cases, all passed)."""
    cases, ok = [], True
    for case in dict.fromkeys(r["case"] for r in runs):
        by = {r["mode"]: r for r in runs if r["case"] == case}
        a, b = by.get(mode, {}), by.get(reference, {})
        dl, dn = worst(a.get("losses"), b.get("losses")), worst(a.get("grad_norms"), b.get("grad_norms"))
        lt, nt = loss_tol(case), norm_tol(case)
        passed = dl is not None and dn is not None and dl <= lt and dn <= nt and moved(b)
        ok &= passed
        cases.append({"case": case, "steps": len(b.get("losses") or []),
                      "max_relative_loss_difference": dl, "max_relative_grad_norm_difference": dn,
                      "tolerance_loss": lt, "tolerance_grad_norm": nt, "losses_moved": moved(b),
                      "ok": passed, f"losses_{mode}": a.get("losses"),
                      f"losses_{reference}": b.get("losses"),
                      f"grad_norms_{mode}": a.get("grad_norms"),
                      f"grad_norms_{reference}": b.get("grad_norms"),
                      f"median_step_s_{mode}": a.get("median_step_s"),
                      f"median_step_s_{reference}": b.get("median_step_s"),
                      f"tokens_per_s_{mode}": a.get("tokens_per_s_per_gpu"),
                      f"tokens_per_s_{reference}": b.get("tokens_per_s_per_gpu"),
                      "errors": [a.get("error"), b.get("error")]})
    return cases, ok


if __name__ == "__main__" and sys.argv[1:2] == ["record"]:
    tag, case, mode, rc = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    print(json.dumps(record(tag, case, mode, rc)))
