"""Request handling: parse a decoded message, route it to a model, admit it, count it, and turn
every outcome into exactly one reply (dispatch/handler.py, dispatch/completion.py), over the set
of served models (dispatch/models.py). The transport below only moves frames."""
