"""Socket transport for the framed protocol."""

from transport.connection import Connection, Listener

__all__ = ["Connection", "Listener"]
