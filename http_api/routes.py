"""Every route of the HTTP API (docs/http.md): probes, information, metrics, and the models'
routes in each API family's shape (http_api/shapes/)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from http_api.routing import Request, Response, Route
from http_api.errors import HttpError
from http_api.shapes import Call, hf, kserve, native, openai
from protocol.errors import BadRequest

if TYPE_CHECKING:
    from http_api.app import HttpApp

#: What the server calls itself in ``/v2`` and ``/info``.
SERVER_NAME = "qa-inference-server"
VERSION = "0.1.0"


class Routes:
    """The handlers, bound to one app."""

    def __init__(self, app: HttpApp) -> None:
        self.app = app
        self.state = app.state
        self.created = int(time.time())
        self._registry: Any = None  # /metrics: made on the first scrape

    # -- probes ----------------------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        """200 while the process answers: no model, engine or device is asked anything."""
        return Response({"status": "live"})

    async def ready(self, request: Request) -> Response:
        """200 when every model is loaded and warmed up (and, for a broker's front end, a
        worker serves it) and the server is not draining; else 503, saying why (and, where
        no token is required, which models are ready)."""
        why = self.not_ready()
        if why is None:
            return Response({"status": "ready"})
        body: dict[str, Any] = {"status": "not_ready", "error": why, "error_type": "unavailable"}
        if not self.state.auth.required and self.state.serving \
                and not self.state.handler.draining:  # a stop may hold a backend's lock
            body["models"] = {m.name: m.backend is not None and m.backend.ready
                              for m in self.state.models}
        return Response(body, 503, {"retry-after": "1"})

    def not_ready(self) -> str | None:
        """Why the server is not ready, or None."""
        if self.state.handler.draining:
            return "draining: the server is stopping"
        if not self.state.serving:
            return "loading: the models are loading and warming up"
        waiting = [m.name for m in self.state.models if m.backend is None or not m.backend.ready]
        if waiting:
            return (f"model(s) {', '.join(waiting)} not serving (a worker lost, restarting, "
                    "or, with --broker, no live worker or no Redis)")
        return None

    async def v2_ready(self, request: Request) -> Response:
        """KServe's server readiness: 200 with an empty body, or 503 with ``{}``."""
        ready = self.not_ready() is None
        return Response(b"" if ready else b"{}", 200 if ready else 503)

    async def v2_live(self, request: Request) -> Response:
        """KServe's liveness: 200 with an empty body."""
        return Response(b"")

    async def model_ready(self, request: Request) -> Response:
        """KServe's model readiness (no token needed: an unknown model's 404 names none)."""
        name = request.params["name"]
        model = self.state.models.models.get(name)
        if model is None:
            raise HttpError("not_found", f"unknown model {name[:64]!r}")
        ready = self.not_ready() is None and model.backend is not None and model.backend.ready
        return Response(b"" if ready else b"{}", 200 if ready else 503)

    # -- information -----------------------------------------------------------------------
    async def info(self, request: Request) -> Response:
        """``GET /info``: the models, version, limits, and whether tokens are required."""
        cfg = self.state.config
        return Response({"name": SERVER_NAME, "version": VERSION,
                         "models": [m.describe() for m in self.state.models],
                         "limits": {"http_payload_limit": cfg.http_payload_limit,
                                    "max_texts": cfg.max_texts,
                                    "max_question_chars": cfg.max_question_chars,
                                    "max_context_chars": cfg.max_context_chars,
                                    "max_queue": cfg.max_queue,
                                    "request_timeout_ms": cfg.request_timeout_ms,
                                    "max_connections": cfg.max_connections},
                         "auth": self.state.auth.required, "ready": self.not_ready() is None})

    async def metrics(self, request: Request) -> Response:
        """The Prometheus exposition, as ``--metrics_port`` serves it; made on a thread of its
        own, since a scrape asks worker processes for their figures."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from telemetry.prometheus import metrics_registry

        if self._registry is None:
            self._registry = metrics_registry(self.state)
        text = await asyncio.get_running_loop().run_in_executor(None, generate_latest,
                                                                self._registry)
        return Response(text, content_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        """``GET /openapi.json``: the OpenAPI document of the routes served now."""
        from http_api.openapi import document

        return Response(document(self.state.models))

    async def v1_models(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models``: every served model."""
        return Response(openai.model_list([m.name for m in self.state.models], self.created))

    async def v1_model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{id}``: one served model."""
        model = self._model(request.params["name"])
        return Response(openai.model_list([model.name], self.created)["data"][0])

    async def v2(self, request: Request) -> Response:
        """KServe's server metadata: no extension (no binary tensor data)."""
        return Response({"name": SERVER_NAME, "version": VERSION, "extensions": []})

    async def v2_model(self, request: Request) -> Response:
        """KServe's model metadata: its inputs and outputs as tensors."""
        model = self._model(request.params["name"])
        kserve.check_tensor_form(model.name, model.op)
        platform = {"onnx": "onnxruntime_onnx", "pytorch": "pytorch_libtorch"}.get(
            self.state.config.inference_engine_type, self.state.config.inference_engine_type)
        return Response(kserve.metadata(model.name, model.op, platform, model.info.labels))

    # -- the models --------------------------------------------------------------------------
    async def qa(self, request: Request) -> Response:
        """``POST /qa``: the Hugging Face question-answering shape."""
        return await self._shaped(request, hf.qa_call)

    async def embed(self, request: Request) -> Response:
        """``POST /embed``: text-embeddings-inference's embeddings."""
        return await self._shaped(request, hf.embed_call)

    async def predict(self, request: Request) -> Response:
        """``POST /predict``: text-embeddings-inference's classification."""
        return await self._shaped(request, partial(hf.classify_call, tei=True))

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: OpenAI's embeddings."""
        return await self._shaped(request, openai.embeddings_call)

    async def _shaped(self, request: Request, shape: Callable[[Any, int], Call]) -> Response:
        """Run the call ``shape`` makes of the body, with ``--max_texts`` inputs at most."""
        return await self.app.run(request, shape(await self.app.json_body(request),
                                                 self._max_inputs()))

    async def root(self, request: Request) -> Response:
        """``POST /``: the Hugging Face shapes, told apart by the body (hf.task_of_body)."""
        body = await self.app.json_body(request)
        return await self.app.run(request, self._hf_call(hf.task_of_body(body), body))

    async def model_call(self, request: Request) -> Response:
        """``POST /models/{name}``: that model's task's Hugging Face shape."""
        model = self._model(request.params["name"])
        call = self._hf_call(model.op, await self.app.json_body(request))
        if call.model not in (None, model.name):
            raise BadRequest(f"the body names model {call.model[:64]!r}, the path "
                             f"{model.name!r}: name one")
        call.model = model.name
        return await self.app.run(request, call)

    def _hf_call(self, op: str, body: Any) -> Any:
        limit = self._max_inputs()
        if op == "qa":
            return hf.qa_call(body, limit)
        if op == "embed":
            return hf.embed_call(body, limit)
        if op == "classify":
            return hf.classify_call(body, limit, tei=False)
        return native.native_call(op, body)

    async def op(self, request: Request) -> Response:
        """``POST /ops/{op}``: the TCP op's own fields and result, for any served op."""
        op = request.params["name"]
        self.app.check_serving()
        if op not in {m.op for m in self.state.models}:
            raise HttpError("not_found", f"no model here serves {op!r} requests (served: "
                            f"{', '.join(sorted({m.op for m in self.state.models}))})")
        return await self.app.run(request, native.native_call(op, await self.app.json_body(
            request)))

    async def infer(self, request: Request) -> Response:
        """KServe's ``POST /v2/models/{m}/infer`` with BYTES inputs."""
        model = self._model(request.params["name"])
        if "inference-header-content-length" in request.headers:
            raise BadRequest("binary tensor data is not supported (GET /v2 lists no "
                             "extension): send the inputs' data as JSON")
        return await self.app.run(request, kserve.infer_call(
            model.name, model.op, await self.app.json_body(request), self._max_inputs()))

    def _model(self, name: str) -> Any:
        """The served model of a path, or 404 (503 while the models are still read)."""
        self.app.check_serving()
        model = self.state.models.models.get(name)
        if model is None:
            raise HttpError("not_found", f"unknown model {name[:64]!r} (served: "
                            f"{', '.join(self.state.models.models)})")
        return model

    def _max_inputs(self) -> int:
        return self.state.config.max_texts


def route_table(app: HttpApp) -> tuple[dict[str, Route], list[tuple[str, str, Route]]]:
    """The exact paths, and the patterns ``PREFIX{name}SUFFIX``, with their routes."""
    r = Routes(app)
    get, post = (lambda h: {"GET": h}), (lambda h: {"POST": h})
    exact = {
        "/health": Route(get(r.ready), open=True),
        "/health/ready": Route(get(r.ready), open=True),
        "/health/live": Route(get(r.live), open=True),
        "/v2/health/live": Route(get(r.v2_live), open=True),
        "/v2/health/ready": Route(get(r.v2_ready), open=True),
        "/info": Route(get(r.info)),
        "/metrics": Route(get(r.metrics)),
        "/openapi.json": Route(get(r.openapi)),
        "/v1/models": Route(get(r.v1_models)),
        "/v2": Route(get(r.v2)),
        "/": Route(post(r.root)),
        "/qa": Route(post(r.qa)),
        "/embed": Route(post(r.embed)),
        "/predict": Route(post(r.predict)),
        "/v1/embeddings": Route(post(r.embeddings)),
    }
    ready, infer, metadata = (Route(get(r.model_ready), open=True), Route(post(r.infer)),
                              Route(get(r.v2_model)))
    patterns = [  # every model has one version, "1" (tritonclient's model_version="1")
        ("/v2/models/", "/versions/1/ready", ready),
        ("/v2/models/", "/versions/1/infer", infer),
        ("/v2/models/", "/versions/1", metadata),
        ("/v2/models/", "/ready", ready),
        ("/v2/models/", "/infer", infer),
        ("/v2/models/", "", metadata),
        ("/v1/models/", "", Route(get(r.v1_model))),
        ("/models/", "", Route(post(r.model_call))),
        ("/ops/", "", Route(post(r.op))),
    ]
    return exact, patterns
