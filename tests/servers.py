"""Test and bench helper: run an app under a real uvicorn server on a port, in a background
thread (``from servers import ServerThread`` in tests, ``from tests.servers import ...`` in bench)."""

from __future__ import annotations

import threading
import time

from schemas.settings import free_port


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (default ``flywheel serve``'s, loopback):``port`` in a
    daemon thread.

    ``start()`` returns once the port accepts connections (RuntimeError after ``timeout_s``);
    ``stop()`` asks uvicorn to exit and joins.
    """

    def __init__(self, app, port: int | None = None, host: str | None = None):
        import uvicorn

        from serving.config import ServeConfig

        self.port = port or free_port()
        self.host = ServeConfig.model_fields["host"].default if host is None else host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.server.started:
                return self
            time.sleep(0.02)
        raise RuntimeError(f"uvicorn did not start on {self.url} within {timeout_s}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
