"""Socket transport for the framed protocol: TCP, a Unix socket, TLS over TCP."""

from transport.connection import Connection
from transport.errors import BindError
from transport.listener import Listener, bind_socket, refuse
from transport.unix import bind_unix_socket

__all__ = ["BindError", "Connection", "Listener", "bind_socket", "bind_unix_socket", "refuse"]
