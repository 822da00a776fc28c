# QA inference server on a GPU: CUDA torch + onnxruntime-gpu. Build from the repository root:
#   docker build -f docker/server.Dockerfile -t qa-server .
#   docker run --rm -v "$PWD/saved_models:/app/saved_models" --entrypoint python qa-server prepare_model.py
#   docker run --rm --gpus all -p 9999:9999 -v "$PWD/saved_models:/app/saved_models" qa-server
# cuDNN 9 + CUDA 13 runtime: what onnxruntime-gpu 1.31's CUDA provider links against (its wheel
# asks for nvidia-cuda-runtime ~=13.0 and nvidia-cudnn-cu13).
FROM nvidia/cuda:13.1.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
# Python 3.11, the version CI tests (Ubuntu 24.04's own python3 is 3.12): from the deadsnakes PPA,
# whose tool is removed again once the PPA is added.
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
       libjemalloc2 \
    && apt-get purge -y --auto-remove software-properties-common gpg-agent \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt constraints.txt ./
# Same pins as CPU installs, with onnxruntime swapped for onnxruntime-gpu; pip takes torch's CUDA
# build from PyPI for the same torch==2.13.0 pin.
RUN python3.11 -m venv /opt/venv \
    && /opt/venv/bin/python -c "import sys; assert sys.version_info[:2] == (3, 11), sys.version" \
    && sed 's/^onnxruntime==/onnxruntime-gpu==/' requirements.txt > requirements-gpu.txt \
    && /opt/venv/bin/pip install -r requirements-gpu.txt -c constraints.txt
ENV PATH=/opt/venv/bin:$PATH
# TensorRT 10 libraries for onnxruntime-gpu's TensorRT provider (libnvinfer.so.10, the major
# version onnxruntime links against; built for CUDA 13); without them the server logs why and
# runs on CUDA.
ARG TENSORRT_LIBS=tensorrt-cu13-libs==10.16.1.11
RUN if [ -n "$TENSORRT_LIBS" ]; then /opt/venv/bin/pip install "$TENSORRT_LIBS"; fi
ENV LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/tensorrt_libs:${LD_LIBRARY_PATH}
# jemalloc for every process of the server: the tokenizer allocates heavily, and with it the
# server spends about 12% less CPU per request (docs/benchmarks.md, docs/operations.md).
ENV LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2

COPY server.py client.py prepare_model.py ./
COPY clients/ clients/
COPY console/ console/
COPY engines/ engines/
COPY preparation/ preparation/
COPY tasks/ tasks/
COPY scheduling/ scheduling/
COPY dispatch/ dispatch/
COPY protocol/ protocol/
COPY settings/ settings/
COPY transport/ transport/
COPY telemetry/ telemetry/
COPY workers/ workers/
COPY broker/ broker/
# the request mix: prepare_model.py --fp16 checks the fp16 export on it (preparation/fp16.py)
COPY bench/data/ bench/data/
# The QA task's span search in C (tasks/_span_search.c; without it answers are searched in numpy,
# for more CPU per request): compiled for this image's Python, the compiler removed again.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3.11-dev \
    && gcc -O2 -fPIC -shared $(python3.11-config --includes) tasks/_span_search.c \
       -o "tasks/_span_search$(python3.11-config --extension-suffix)" \
    && apt-get purge -y --auto-remove gcc libc6-dev python3.11-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -c "from tasks.qa_answers import span_search; assert span_search() == 'c'"

# The prepared model is mounted here (run prepare_model.py once; see README).
VOLUME ["/app/saved_models"]
EXPOSE 9999
STOPSIGNAL SIGTERM
# Ready = every session loaded and warmed up, not draining (docs/operations.md). The server writes
# the address it serves on to the address file, so the check follows any --port given to the image.
# With token authentication (--auth_token_file FILE after the image name), give the container
# QA_SERVER_TOKEN_FILE=FILE (the probe authenticates with the file's first token) or
# QA_SERVER_TOKEN=TOKEN: client.py reads either from the environment, which the check inherits:
#   docker run ... -v "$PWD/tokens.txt:/run/secrets/qa_tokens:ro"
#     -e QA_SERVER_TOKEN_FILE=/run/secrets/qa_tokens qa-server --auth_token_file /run/secrets/qa_tokens
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s \
    CMD ["python", "client.py", "--address_file", "/tmp/qa-server.address", "--ready", "--timeout", "3"]
ENTRYPOINT ["python", "server.py", "--host", "0.0.0.0", "--address_file", "/tmp/qa-server.address"]
CMD ["--port", "9999"]
