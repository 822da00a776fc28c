# Sourced by bench/gpu_check.sh and bench/gpu_layouts.sh, from the repository root with PYTHON
# set: installs from .whl/ (bash bench/gpu_check.sh --fill) the packages the GPU benchmarks
# import that this python lacks, the pinned tokenizers where the machine's is older, and builds
# the QA span search's C extension where a compiler is there.
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
