#!/usr/bin/env bash
# Device side of issue 41 items 4-6 ("no wrong gradient on any path"), one call on 2 GPUs
# (carry [".gpu/bin", ".gpu/commit"], staged by
#   GPU_FEATURES=nccl scripts/gpu-stage.sh matmul-check burn-linear-repro bench-e2e dist-worker):
# 1. burn-linear-repro (burn alone): which products burn-cuda gets wrong, with and without
#    fusion; matmul-check: every product and the MLP training step through ZeroBackend, with
#    cuBLASLt and without, against f64 (fails on any error past its bound).
# 2. fp16 overflow on 2 GPUs at stages 2 and 3: dist-worker's parity MLP 20 steps clean and with
#    rank 1's loss of step 5 infinite (POISON_STEP), both deterministic: every rank skips
#    exactly step 5, the scale halves after it, steps before it repeat the clean run's bits,
#    ranks end with equal parameters.
# 3. Resume on 2 GPUs: bench-e2e's 125M Llama (bf16, cuBLASLt, flash attention, fused kernels)
#    16 steps saving at step 6, then resumed from that checkpoint to step 16, at stages 2 and 3,
#    in three modes: default, default with matmul.tune off, deterministic. Losses and gradient
#    norms of steps 6-15 compared bit for bit; the uninterrupted run is also repeated once per
#    mode (run-to-run variation without any resume).
# Logs under $OUT/numerics/, the summary in $OUT/numerics-<kind>.json.
#   bash bench/run_numerics.sh KIND        (SIZE 125m, STEPS 16, SAVE_AT 6; PARTS "1 2 3" and
#                                          STAGES "3 2" and MODES "default tune0 deterministic"
#                                          split the work over calls of 10 minutes)
source bench/prelude.sh "$1"
size="${SIZE:-125m}"; steps="${STEPS:-16}"; save_at="${SAVE_AT:-6}"
parts="${PARTS:-1 2 3}"; stages="${STAGES:-3 2}"
dir="$out/numerics"; mkdir -p "$dir"
port=29800
launch() { # LOG NPROC ARGS...: the launcher, 300 s at most
  local log="$1" n="$2"; shift 2; port=$((port + 1))
  timeout 300 .gpu/bin/burn-zero run --nproc-per-node "$n" --master-port "$port" -- "$@" \
    > "$log" 2>&1
  echo "$(basename "$log" .log): exit $?"
}

if [[ " $parts " == *" 1 "* ]]; then
echo "== 1. products"
timeout 300 .gpu/bin/burn-linear-repro > "$dir/burn-linear-repro.log" 2>&1
echo "burn-linear-repro: exit $?"; cat "$dir/burn-linear-repro.log"
# MC_SECTIONS: matmul-check's sections (default `f32 train`: on a fresh machine the cold
# autotune of every f16/bf16 shape outlasted 300 s); then its training step again with the
# step without cuBLASLt first.
timeout 300 .gpu/bin/matmul-check ${MC_SECTIONS:-f32 train} > "$dir/matmul-check.log" 2>&1
echo "matmul-check: exit $?"; grep -E "\[1, 3\]|training|matmul-check" "$dir/matmul-check.log"
timeout 300 .gpu/bin/matmul-check train --inner-first > "$dir/matmul-check-inner-first.log" 2>&1
echo "matmul-check train --inner-first: exit $?"; grep -E "training|matmul-check" \
  "$dir/matmul-check-inner-first.log"

fi
if [[ " $parts " == *" 2 "* ]]; then
echo "== 2. fp16 overflow"
for stage in 2 3; do
  BURN_ZERO_DETERMINISTIC=1 launch "$dir/fp16-stage$stage-clean.log" 2 \
    .gpu/bin/dist-worker train-gpu "$stage" 1 fp16 20
  POISON_STEP=5 BURN_ZERO_DETERMINISTIC=1 launch "$dir/fp16-stage$stage-poisoned.log" 2 \
    .gpu/bin/dist-worker train-gpu "$stage" 1 fp16 20
done

fi
echo "== 3. resume"
e2e() { # LOG ENV... -- ARGS...
  local log="$1"; shift
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  port=$((port + 1))
  env "${envs[@]}" timeout 300 .gpu/bin/burn-zero run --nproc-per-node 2 --master-port "$port" \
    -- .gpu/bin/bench-e2e "$size" "$@" > "$log" 2>&1
  echo "$(basename "$log" .log): exit $?"
}
[[ " $parts " == *" 3 "* ]] && for stage in $stages; do
  for mode in ${MODES:-default tune0 deterministic}; do
    case $mode in
      default) envs=(BURN_ZERO_CUBLASLT_TUNE=1) ;;
      tune0) envs=(BURN_ZERO_CUBLASLT_TUNE=0) ;;
      deterministic) envs=(BURN_ZERO_DETERMINISTIC=1) ;;
    esac
    ck="/tmp/ck-$stage-$mode"; rm -rf "$ck"
    e2e "$dir/resume-s$stage-$mode-first.log" "${envs[@]}" -- "$stage" "$steps" 4 1024 \
      --ckpt "$ck" --save-at "$save_at"
    e2e "$dir/resume-s$stage-$mode-again.log" "${envs[@]}" -- "$stage" "$steps" 4 1024
    e2e "$dir/resume-s$stage-$mode-resumed.log" "${envs[@]}" -- "$stage" "$steps" 4 1024 \
      --resume "$ck"
    rm -rf "$ck"
  done
done

python3 - "$kind" "$dir" "$out/numerics-$kind.json" "$save_at" <<'PY'
import json, math, re, sys
kind, d, path, save_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def text(name):
    try:
        return open(f"{d}/{name}.log", errors="replace").read()
    except OSError:
        return ""
report = {"benchmark": "numerics", "kind": kind, "commit": open(".gpu/commit").read().split()}
report["burn_linear_repro"] = [l for l in text("burn-linear-repro").splitlines() if "err" in l]
mc = text("matmul-check").splitlines()
report["matmul_check"] = {"passed": any("matmul-check: all passed" in l for l in mc),
    "failure": [l for l in mc if "FAILED" in l],
    "training": [l for l in mc if l.startswith("training step")],
    "training_inner_first": [l for l in text("matmul-check-inner-first").splitlines()
                             if l.startswith("training step") or "FAILED" in l],
    "linear_shapes": [l for l in mc if "[1, 3]x[1, 1]" in l or "[2, 3]x[1, 1] 31x64x5 t=(false,true)" in l]}
def results(name):
    r, hashes = {}, {}
    for line in text(name).splitlines():
        m = re.match(r"\[rank (\d+)\] (RESULT|STAT) (\S+) (.*)", line)
        if m and m.group(1) == "0":
            v = m.group(4).strip()
            r[m.group(3)] = json.loads(v) if v.startswith("[") else float(v)
        m = re.match(r"\[rank (\d+)\] PARAMS (\S+)", line)
        if m:
            hashes[int(m.group(1))] = m.group(2)
    return r, hashes
fp16 = {}
for stage in (2, 3):
    (clean, ch), (bad, bh) = results(f"fp16-stage{stage}-clean"), results(f"fp16-stage{stage}-poisoned")
    steps = [s for s in range(100) if f"loss_{s}" in bad]
    params = [v for k, v in bad.items() if k.startswith("param_")]
    fp16[f"stage{stage}"] = {
        "clean_skipped": clean.get("skipped_steps"), "poisoned_skipped": bad.get("skipped_steps"),
        "poisoned_scales": [bad.get(f"scale_{s}") for s in steps],
        "scales_as_expected": [bad.get(f"scale_{s}") for s in steps]
            == [256.0 if s <= 5 else 128.0 for s in steps],
        "losses_before_poison_bitwise_equal_clean": len(steps) > 5
            and all(bad.get(f"loss_{s}") == clean.get(f"loss_{s}") for s in range(5)),
        "losses_after_finite": all(math.isfinite(bad.get(f"loss_{s}", math.nan)) for s in steps[6:]),
        "params_finite": bool(params) and all(math.isfinite(x) for p in params for x in p),
        "rank_param_hashes": bh, "ranks_agree": len(bh) == 2 and len(set(bh.values())) == 1}
report["fp16_overflow_2gpu"] = fp16
def e2e(name):
    for line in text(name).splitlines():
        if line.startswith("[rank 0] {"):
            try:
                return json.loads(line[line.index("{"):])
            except ValueError:
                pass
    return None
resume = {}
for stage in (3, 2):
    for mode in ("default", "tune0", "deterministic"):
        first, again, resumed = (e2e(f"resume-s{stage}-{mode}-{w}") for w in ("first", "again", "resumed"))
        row = {"runs_completed": [x is not None for x in (first, again, resumed)]}
        if first and resumed:
            a, b = first["losses"][save_at:], resumed["losses"]
            na, nb = first["grad_norms"][save_at:], resumed["grad_norms"]
            row["resumed_first_step"] = resumed.get("first_step")
            row["steps_compared"] = [save_at, save_at + len(b) - 1]
            row["bitwise_equal_losses"] = sum(x == y for x, y in zip(a, b))
            row["bitwise_equal_norms"] = sum(x == y for x, y in zip(na, nb))
            row["first_differing_step"] = next((save_at + i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            row["max_abs_loss_diff"] = max((abs(x - y) for x, y in zip(a, b)), default=None)
            row["resume_bitwise"] = len(a) == len(b) > 0 and a == b and na == nb
        if first and again:
            row["repeat_bitwise_losses"] = first["losses"] == again["losses"]
            row["repeat_bitwise_norms"] = first["grad_norms"] == again["grad_norms"]
            row["repeat_max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(first["losses"], again["losses"]))
            row["median_step_s"] = [first.get("median_step_s"), again.get("median_step_s")]
        resume[f"stage{stage}-{mode}"] = row
report["resume_2gpu"] = {"model": "125m", "micro_batch": 4, "seq": 1024, "save_at": save_at, "rows": resume}
json.dump(report, open(path, "w"), indent=1)
print(json.dumps(report, indent=1))
PY
