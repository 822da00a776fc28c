"""Client libraries for the inference server.

The blocking, thread-safe ``Client`` (:mod:`clients.blocking`), the asyncio client
(:mod:`clients.aio`), and what both share: where and how they connect (:mod:`clients.endpoint`,
the standard library alone) and the rest (:mod:`clients.common`). The top-level ``client.py`` is
the command line and re-exports them: ``from client import Client`` and ``from clients import
Client`` name the same class.
"""

from clients.aio import AsyncClient
from clients.blocking import Client
from clients.common import ConnectionLost

__all__ = ["AsyncClient", "Client", "ConnectionLost"]
