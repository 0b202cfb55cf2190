"""`jaxinfer serve`: uvicorn in front of the app, the model loaded in the background.

The socket opens first and /health answers 503 until the model is loaded and
compiled (load balancers and the tests poll it). On SIGINT/SIGTERM uvicorn
stops accepting, lets in-flight requests finish for up to
`shutdown_timeout` seconds, then the app's shutdown aborts what is left
(their clients get finish_reason "abort"); both steps are logged.
"""

from __future__ import annotations

import ipaddress
import logging

import uvicorn

from jaxinfer.server.app import build_app

logger = logging.getLogger("jaxinfer.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
        state = self.config.app.state.server  # the FastAPI app (uvicorn keeps it as given)
        in_flight = state.engine.num_in_flight if state.engine is not None else 0
        if not self.should_exit:
            logger.warning("signal %s: finishing %d in-flight request(s) (up to %.0f s), then aborting the rest",
                           getattr(sig, "name", sig), in_flight, self.config.timeout_graceful_shutdown or 0)
        super().handle_exit(sig, frame)


def serve(load, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int | None = 1024, shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve until a signal; `load()` returns the LLM (called in a background thread)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(host) and api_key is None:
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                       host)
    app = build_app(model_name=model_name, load=load, api_key=api_key, max_queue=max_queue)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)
    _Server(config).run()
