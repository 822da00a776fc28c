"""Socket transport for the framed protocol."""

from transport.connection import Connection, Listener, refuse

__all__ = ["Connection", "Listener", "refuse"]
