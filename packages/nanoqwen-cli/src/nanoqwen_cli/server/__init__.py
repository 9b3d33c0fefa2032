"""`nanoqwen-cli serve`: an OpenAI-compatible HTTP server over the batched engine.

command.py (the click command, socket, uvicorn), app.py (routes), protocol.py (request validation and
OpenAI's JSON/SSE shapes), metrics.py (Prometheus).
"""
