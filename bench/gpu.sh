#!/usr/bin/env bash
# The GPU benchmark from a fresh checkout on a bare GPU machine: a virtual environment with the
# CUDA builds (onnxruntime-gpu for onnxruntime, torch's CUDA wheel for the same pin), the
# bert-base-sized random model with its fp16 export, then bench/gpu.py (arguments pass through).
#   bash bench/gpu.sh                     # everything, about 10 minutes on one GPU
#   bash bench/gpu.sh --engines onnx      # fewer parts
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-gpu
sed 's/^onnxruntime==/onnxruntime-gpu==/' requirements.txt > .venv-gpu/requirements-gpu.txt
# TensorRT 10 for onnxruntime-gpu's TensorRT provider, as in docker/server.Dockerfile
echo "tensorrt-cu12-libs==10.13.0.35" >> .venv-gpu/requirements-gpu.txt
.venv-gpu/bin/python -m pip install --quiet --disable-pip-version-check \
    -r .venv-gpu/requirements-gpu.txt -c constraints.txt
SITE=$(.venv-gpu/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export LD_LIBRARY_PATH="$SITE/tensorrt_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
MODEL=bench/models/bert-base-random
if [ ! -f "$MODEL/model_fp16.onnx" ]; then
    # random weights: near-flat logits, so fp16 may flip a few answers; keep it and record it
    .venv-gpu/bin/python prepare_model.py --random_bert_base --fp16 --fp16_min_agreement 0 \
        --model_dir "$MODEL"
fi
mkdir -p bench/results
exec .venv-gpu/bin/python bench/gpu.py --model_dir "$MODEL" "$@"
