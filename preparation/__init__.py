"""Model preparation, the library behind prepare_model.py: where a model comes from
(``model_sources``), its export to a servable folder (``export``) and its checked float16 copy
(``fp16``). It writes what engines/ and tasks/ read at serving time (engines/model_dir.py's
serving.json); the server never imports it.
"""
