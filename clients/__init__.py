"""What clients share: where and how they connect (``endpoint.py``). Light enough for the client
image: the standard library alone."""
