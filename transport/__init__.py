"""Socket transport for the framed protocol."""

from transport.connection import Connection
from transport.listener import BindError, Listener, bind_socket, refuse

__all__ = ["BindError", "Connection", "Listener", "bind_socket", "refuse"]
