"""Client libraries for the inference server.

The blocking, thread-safe ``Client`` lives in the top-level ``client.py`` (the command line's
module); this package holds what both clients share: where and how they connect
(:mod:`clients.endpoint`, the standard library alone) and the rest (:mod:`clients.common`), and
the asyncio client (:mod:`clients.aio`). ``from client import AsyncClient`` and ``from clients
import AsyncClient`` name the same class.
"""

from clients.aio import AsyncClient
from clients.common import ConnectionLost

__all__ = ["AsyncClient", "ConnectionLost"]
