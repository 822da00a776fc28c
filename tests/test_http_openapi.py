"""``GET /openapi.json`` against the server that serves it: the document is valid OpenAPI 3, lists
every route the server answers, and describes them truthfully, which a bounded, reproducible
property-based fuzz (schemathesis) checks against a live server of a tiny qa, embed and classify
model: no 500 for bad input, every status and content type documented, every response matching
its schema; and the server still answers a good request afterwards."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from http_api.routes import route_table
from server import InferenceServer, ServerConfig
from tests.http_helpers import QA_BODY, request
from tests.text_models import build_tiny_repository

#: Each operation's fuzzed examples (positive and negative): enough to find a crash or an
#: undocumented answer, few enough that the file stays well under a minute on two busy cores.
MAX_EXAMPLES = 20


def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis's ``not_a_server_error``, but for the one 5xx a request may ask for: 504
    ``deadline_exceeded`` where the request gave itself a deadline (a fuzzed ``X-Timeout-Ms`` or
    ``timeout_ms`` of a microsecond passes before its batch runs; docs/http.md's errors)."""
    if response.status_code == 504 and _asked_a_deadline(case) \
            and _error_type(response) == "deadline_exceeded":
        return None
    return not_a_server_error(ctx, response, case)


def _asked_a_deadline(case: Any) -> bool:
    headers = {k.lower() for k in (case.headers or {})}
    return "x-timeout-ms" in headers or (isinstance(case.body, dict) and "timeout_ms" in case.body)


def _error_type(response: Any) -> Any:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("error_type") if isinstance(body, dict) else None


def media_type_exactly_documented(ctx: Any, response: Any, case: Any) -> bool | None:
    """The response's whole ``Content-Type``, parameters too, is one its status documents
    (``content_type_conformance`` compares the type and subtype only)."""
    responses = case.operation.definition.raw["responses"]
    status = str(response.status_code)
    entry = responses.get(status) or responses.get(f"{status[0]}XX") or responses.get("default")
    if not entry or not entry.get("content"):
        return None
    sent = _normal((response.headers.get("content-type") or [""])[0])
    documented = {_normal(media_type) for media_type in entry["content"]}
    assert sent in documented, f"{case.operation.label} {status}: Content-Type {sent!r}, " \
                               f"documented {sorted(documented)}"
    return None


def _normal(media_type: str) -> str:
    return ";".join(part.strip() for part in media_type.lower().split(";"))


#: The answer is documented: its status, its content type, its body's schema.
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance,
               media_type_exactly_documented]
CHECKS = [no_server_error, *CONFORMANCE]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[InferenceServer]:
    """A server of three tiny real models, with small limits so fuzzed bodies stay cheap."""
    repository = build_tiny_repository(tmp_path_factory.mktemp("http_openapi_repository"),
                                       tiny_model_dir)
    config = ServerConfig(host="127.0.0.1", port=0, model_dir=str(repository),
                          num_inference_sessions=1, threads_per_session=1, max_batch_size=4,
                          max_texts=4, max_question_chars=200, max_context_chars=2000,
                          http_payload_limit=20000, request_timeout_ms=5000)
    with InferenceServer(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def base_url(server: InferenceServer) -> str:
    address = server.http_address
    assert address is not None
    return "http://{}:{}".format(*address)


@pytest.fixture(scope="module")
def document(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url}/openapi.json", timeout=30) as reply:
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("application/json")
        return json.loads(reply.read())


def test_the_document_is_valid_openapi_3(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.")
    validate(document)


def test_the_document_lists_every_route_the_server_answers(server: InferenceServer,
                                                           document: dict[str, Any]) -> None:
    exact, patterns = route_table(SimpleNamespace(state=server))  # what HttpApp matches
    served_ops = sorted({model.op for model in server.models})
    want: dict[str, set[str]] = {path: set(route.handlers) for path, route in exact.items()}
    for prefix, suffix, route in patterns:
        if prefix == "/ops/":  # one path per served op, with that op's fields
            want.update({f"/ops/{op}": set(route.handlers) for op in served_ops})
        else:
            want[f"{prefix}{{name}}{suffix}"] = set(route.handlers)
    got = {path: {method.upper() for method in item if method != "parameters"}
           for path, item in document["paths"].items()}
    assert sorted(set(want) - set(got)) == [], "routes the document leaves out"
    assert sorted(set(got) - set(want)) == [], "paths the document lists that are not served"
    assert {path: got[path] for path in want} == want, "methods"
    assert served_ops == ["classify", "embed", "qa"]


@pytest.fixture(scope="module")
def api_schema(document: dict[str, Any], base_url: str) -> Any:
    config = schemathesis.Config.from_dict({
        "base-url": base_url,
        "request-timeout": 30,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True,
                       "database": "none"},
        "phases": {"examples": {"enabled": True}, "fuzzing": {"enabled": True},
                   "coverage": {"enabled": True}, "stateful": {"enabled": False}},
    })
    return schemathesis.openapi.from_dict(json.loads(json.dumps(document)), config=config)


fuzzed = schemathesis.pytest.from_fixture("api_schema")


@fuzzed.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzz_finds_no_server_error_and_no_undocumented_answer(case: Any) -> None:
    case.call_and_validate(checks=CHECKS)


def test_the_server_still_answers_a_good_request_after_the_fuzz(server: InferenceServer) -> None:
    address = server.http_address
    assert address is not None
    status, _, body = request(address, "POST", "/qa", QA_BODY)
    assert status == 200, body
    assert set(body) == {"answer", "score", "start", "end"}
    assert request(address, "GET", "/health/ready")[:3:2] == (200, {"status": "ready"})


@pytest.mark.parametrize("path", ["/health/ready", "/health", "/v2/health/ready",
                                  "/v2/models/qa/ready", "/v2/models/qa/versions/1/ready"])
def test_the_readiness_probes_not_ready_answers_are_documented(
        server: InferenceServer, api_schema: Any, base_url: str, path: str) -> None:
    """The fuzz only sees a ready server: a draining one's readiness answers (503) must be
    documented too. Last in the file: it flips the module's server to draining a moment."""
    operation = next(op.ok() for op in api_schema.get_all_operations()
                     if op.ok().path == path.replace("/qa/", "/{name}/"))
    case = operation.Case(path_parameters={"name": "qa"} if "{name}" in operation.path else None)
    server.handler.draining = True
    try:
        response = case.call_and_validate(base_url=base_url, checks=CONFORMANCE)
    finally:
        server.handler.draining = False
    assert response.status_code == 503
