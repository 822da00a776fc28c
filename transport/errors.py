"""The transport's start-up error, shared by the TCP and Unix-socket binders."""

from __future__ import annotations


class BindError(OSError):
    """The server cannot have the address it was asked to listen on."""
