#!/usr/bin/env bash
# Prepared single-GPU check (run through the device tool when a GPU is lent; finishes well under 8 minutes):
# profiler peak vs torch.cuda.max_memory_allocated and predicted vs measured step time for GPT-2 medium/large
# in bf16, with and without our runtime applied. Writes $OUT/gpu_check.json when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e . >/dev/null 2>&1 || python3 -m pip install -q -e .
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 scripts/gpu_check.py --models gpt2-medium gpt2-large --batch-size 8 --seq-len 1024 --steps 5 \
    ${OUT:+--json "$OUT/gpu_check.json"}
