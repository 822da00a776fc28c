"""Socket transport for the framed protocol."""

from transport.connection import Connection
from transport.listener import Listener, refuse

__all__ = ["Connection", "Listener", "refuse"]
