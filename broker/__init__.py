"""Redis Streams between front ends and workers (``--broker``, docs/scaling.md)."""
