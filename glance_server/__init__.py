"""GLANCE gateway: an OpenAI-compatible FastAPI front for the embedded engine or an SGLang server.

``create_app(config, backend)`` builds the ASGI app; ``glance serve`` (``glance_server.cli``) runs it under
uvicorn. See ``app.py`` for the endpoints and ``protocol.py`` for the ``glance`` metrics object.
"""

from .app import create_app
from .config import ServerConfig

__all__ = ["create_app", "ServerConfig"]
