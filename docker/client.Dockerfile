# The interactive QA client (REPL) and client library: needs only msgpack. From the repository root:
#   docker build -f docker/client.Dockerfile -t qa-client .
#   docker run --rm -it --network host qa-client --host 127.0.0.1 --port 9999
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY requirements.txt ./
RUN pip install "$(grep '^msgpack==' requirements.txt)"
COPY client.py ./
COPY clients/ clients/
COPY console/ console/
COPY protocol/ protocol/
COPY settings/cli.py settings/__init__.py settings/
ENTRYPOINT ["python", "client.py"]
