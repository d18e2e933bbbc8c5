"""The summary of bench/run_e2e_zero3.sh's runs (also after a run was cut short):
    python3 bench/e2e_zero3_summary.py KIND RUNS.jsonl OUT.json MACHINE.txt
ratios of each variant of ours to every other run of its case (tokens/s/GPU, peak GPU memory over the training steps, the
largest per-step loss difference) and a table."""
import json, sys
runs = [json.loads(l) for l in open(sys.argv[2])]
rows = []
# Every variant of ours against every other run of its case (peers and the other variants).
for r in runs:
    if not r["name"].startswith("ours"):
        continue
    key = (tuple(r["case"]), r["gpus"])
    row = {"case": r["case"], "gpus": r["gpus"], "system": r["name"]}
    for peer in runs:
        if (tuple(peer["case"]), peer["gpus"]) != key or peer["name"] == r["name"]:
            continue
        a, b = r.get("tokens_per_s_per_gpu"), peer.get("tokens_per_s_per_gpu")
        row[f"tokens_{r['name']}_over_{peer['name']}"] = a / b if a and b else None
        pa, pb = r.get("peak_gpu_mib_training"), peer.get("peak_gpu_mib_training")
        row[f"memory_{r['name']}_over_{peer['name']}"] = pa / pb if pa and pb else None
        la, lb = r.get("losses"), peer.get("losses")
        if la and lb:
            row[f"max_loss_diff_{r['name']}_vs_{peer['name']}"] = max(abs(x - y) for x, y in zip(la, lb))
    rows.append(row)
commit = open(".gpu/commit").read().split()
result = {"device": sys.argv[1], "commit": commit[0], "dirty": len(commit) > 1,
          "machine": open(sys.argv[4]).read(),
          "mfu_formula": "tokens/s/GPU x (6 x params + 12 x layers x hidden x seq) / 989.4e12",
          "comparisons": rows, "runs": runs}
json.dump(result, open(sys.argv[3], "w"), indent=1)
print(f"{'system':12} {'case':18} {'gpus':>4} {'tok/s/gpu':>10} {'mfu':>6} {'peak MiB':>9} "
      f"{'train MiB':>9} {'loss0':>8} {'lossN':>8}")
for r in runs:
    l = r.get("losses") or [float("nan")]
    print(f"{r['name']:12} {str(r['case']):18} {r['gpus']:>4} "
          f"{r.get('tokens_per_s_per_gpu', 0) or 0:>10.0f} {r.get('mfu', 0) or 0:>6.3f} "
          f"{r.get('peak_gpu_mib') or 0:>9} {r.get('peak_gpu_mib_training') or 0:>9} "
          f"{l[0]:>8.4f} {l[-1]:>8.4f} {r.get('error', '')}")
for row in rows:
    print(json.dumps(row))
