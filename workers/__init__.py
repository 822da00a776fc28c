"""Where admitted requests are run: in this process (``--workers 1``) or in worker processes
pulling from the front end's queue (``--workers N``), behind one interface (backend.py)."""
