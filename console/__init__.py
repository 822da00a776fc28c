"""Terminal interaction for the interactive client (client.py's REPL)."""
