"""The HTTP/JSON API beside the TCP protocol (docs/http.md): probes, the OpenAI, Hugging Face,
text-embeddings-inference and KServe v2 shapes, and one JSON route per served op.

It runs in the front end's own process, on one event loop in a thread of its own (uvicorn with
httptools and uvloop), and hands every request to the same dispatch/ as TCP connections do: the
same models, queues, batching, admission control and deadlines.

- ``server.py``: the listener's thread, start and stop (``HttpFrontEnd``);
- ``guard.py``: each connection's limits (the cap, idle and header timeouts);
- ``app.py``: the ASGI application (routing, bearer tokens, typed errors); ``routes.py``: the
  routes;
- ``body.py``: reading a request's JSON body within the payload limit;
- ``exchange.py``: one HTTP request's wire requests, handed to dispatch/ and awaited;
- ``shapes/``: each API family's bodies, turned into wire requests and results into replies;
- ``errors.py``: typed errors as HTTP statuses; ``openapi.py``: the OpenAPI document.
"""
