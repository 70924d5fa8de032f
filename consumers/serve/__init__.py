"""Serve mode, an application of its own: the role (``role.py``: the engine loop following ``sync``), the
OpenAI-compatible HTTP app (``app.py``), the bodies it reads (``api_models.py``), its error answers (``errors.py``)
and the uvicorn server it runs in (``http_server.py``: exposure, TLS, slow clients), the feedback desk and its
writer (``feedback_desk.py``) over the feedback bookkeeping (``feedback.py``: no Kafka), and streamed text
(``stream.py``). Nothing is imported here, so the bookkeeping loads without the engine or the web framework."""
