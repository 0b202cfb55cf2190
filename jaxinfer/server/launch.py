"""`jaxinfer serve`: uvicorn in front of the app, the model loaded in the background.

The socket opens first and /health answers 503 until the model is loaded and
compiled (load balancers and the tests poll it). On SIGINT/SIGTERM uvicorn
stops accepting and in-flight requests may finish for up to
`shutdown_timeout` seconds; then the engine thread aborts what is left, so
those clients still get a well-formed end (finish_reason "abort", usage,
`data: [DONE]`) rather than a cut connection. Both steps are logged.
uvicorn's own grace period is a few seconds longer, as a backstop.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import threading

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
        if not self.should_exit and state.engine is not None:
            logger.warning("%s: finishing %d in-flight request(s) (up to %.0f s), then aborting the rest",
                           signal.Signals(sig).name, in_flight, self.shutdown_timeout)
            engine = state.engine

            def abort_the_rest():
                aborted = engine.stop()
                if aborted:
                    logger.warning("grace period over: aborted %d request(s)", aborted)

            timer = threading.Timer(self.shutdown_timeout, abort_the_rest)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def serve(load, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int | None = 1024, shutdown_timeout: float = 30.0, log_level: str = "info",
          lora_modules=None, lockstep=None, **app_options) -> None:
    """Serve until a signal; `load()` returns the LLM (called in a background thread).
    lora_modules: {served name: LoRARequest}, served beside the base model.
    app_options: build_app's chat_template, tool_call_parser and CORS options.
    lockstep: host 0 of a multi-host run, its lockstep.Leader."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(host) and api_key is None:
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                       host)
    app = build_app(model_name=model_name, load=load, api_key=api_key, max_queue=max_queue,
                    lora_modules=lora_modules, **app_options)
    app.state.server.lockstep = lockstep
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    server = _Server(config)
    server.shutdown_timeout = shutdown_timeout
    server.run()
