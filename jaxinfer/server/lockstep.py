"""`jaxinfer serve` across hosts: host 0 takes the requests, every host steps.

The engine runs in lockstep on every host (parallel/distributed.py): each
host's scheduler must see the same requests added and aborted at the same
step boundaries. Host 0 runs the HTTP front end and its engine thread
(engine_thread.py); after applying a boundary's adds and aborts, and before
it steps, it publishes what took effect (request ids, prompt token ids,
sampling parameters with any structured-output spec, LoRA request,
priority; aborts; shutdown) through parallel/step_channel.py. Every other
host runs `follow`: read the next message, apply it, step when the engine
has work, discard the outputs. Prompt texts stay on host 0 (the other hosts
never answer anyone).

Host 0 fails every open request with a 503 naming the host, and /health
turns 503, when another host's heartbeat stops (parallel/peer_watch.py),
even while its engine thread is blocked in a step's collective. The other
hosts answer /health only, on their own port.
"""

from __future__ import annotations

import logging
import pickle
import threading

from jaxinfer.errors import RequestError
from jaxinfer.parallel.peer_watch import Heartbeat, PeerWatch
from jaxinfer.parallel.step_channel import StepReader, StepWriter

logger = logging.getLogger("jaxinfer.server")

EMPTY = b""  # nothing changed at this boundary (most decode steps): zero bytes


def encode(ops: list, stop: bool = False) -> bytes:
    """ops: ("add", request_id, prompt_token_ids, params, lora_request, priority) and ("abort", request_id), in
    the order host 0 applied them."""
    return EMPTY if not ops and not stop else pickle.dumps((ops, stop), protocol=pickle.HIGHEST_PROTOCOL)


def decode(message: bytes) -> tuple[list, bool]:
    # Written by host 0 of this job through the runtime's own store, which
    # every host of the job already trusts to run its programs.
    return ([], False) if message == EMPTY else pickle.loads(message)


class Leader:
    """Host 0's end: the step channel and the watch over the other hosts.
    EngineThread calls add/abort/publish/finish; ServerState reads `lost`."""

    def __init__(self, client, num_processes: int, lost_host_timeout: float = 5.0):
        self.writer = StepWriter(client)
        self.engine_thread = None
        self._ops: list = []
        self.watch = PeerWatch(client, num_processes, self._on_lost, timeout=lost_host_timeout).start()

    @property
    def lost(self) -> str | None:
        return self.watch.lost

    def bind(self, engine_thread) -> None:
        self.engine_thread = engine_thread
        if self.lost is not None:
            engine_thread.lose_host(self.lost)

    def _on_lost(self, process: int, message: str) -> None:
        if self.engine_thread is not None:
            self.engine_thread.lose_host(message)

    # -- the engine thread's calls -----------------------------------------------------------------
    def added(self, request) -> None:
        self._ops.append(("add", request.request_id, request.prompt_token_ids, request.params,
                          request.lora_request, request.priority))

    def aborted(self, request_id: str) -> None:
        self._ops.append(("abort", request_id))

    def publish(self, will_step: bool) -> None:
        """Before a step (or after adds and aborts that precede none): what took effect since the last."""
        if self._ops or will_step:
            self.writer.publish(encode(self._ops))
            self._ops = []

    def stepped(self) -> None:
        self.writer.stepped()

    def finish(self) -> None:
        """Shutdown: the other hosts abort what they hold and stop."""
        self.writer.publish(encode(self._ops, stop=True))
        self._ops = []
        self.watch.stop()

    def explain(self, default: str) -> str:
        return self.watch.explain(default)


class Follower:
    """Another host's end: `follow(engine)` until host 0 says stop. `error` says why it stopped early."""

    def __init__(self, client, process_id: int):
        self.reader = StepReader(client)
        self.heartbeat = Heartbeat(client, process_id).start()
        self.engine = None
        self.error: str | None = None
        self.stopped = threading.Event()

    def follow(self, engine) -> None:
        self.engine = engine
        try:
            while True:
                message = self.reader.receive()
                ops, stop = decode(message)
                for op in ops:
                    if op[0] == "add":
                        _, request_id, token_ids, params, lora, priority = op
                        extra = {"priority": priority} if priority else {}
                        try:
                            engine.add_request(request_id, token_ids, params, lora_request=lora, **extra)
                        except RequestError:  # host 0 accepted it; a host that refuses it has diverged
                            logger.exception("host 0 added %s and this host cannot", request_id)
                            raise
                    else:
                        engine.abort(op[1])
                if stop:
                    for request_id in list(engine.requests):
                        engine.abort(request_id)
                    return
                if engine.has_unfinished():
                    engine.step()
        except Exception as e:  # host 0 gone, or a step failed: this host stops following
            logger.exception("the lockstep engine loop stopped")
            self.error = f"the lockstep engine loop stopped: {type(e).__name__}: {e}"
        finally:
            self.heartbeat.stop()
            self.stopped.set()


def follower_app(state: dict):
    """The other hosts' HTTP front: /health only (200 while following host 0)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="jaxinfer (lockstep follower)", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health():
        follower: Follower | None = state.get("follower")
        problem = state.get("error") or (follower.error if follower is not None else None)
        if problem is None and (follower is None or follower.engine is None):
            problem = "the model is still loading"
        elif problem is None and follower.stopped.is_set():
            problem = "host 0 ended the run"
        if problem is not None:
            return JSONResponse({"error": {"message": problem, "type": "server_error", "code": "not_ready"}},
                                status_code=503)
        return Response(status_code=200)

    return app


def serve_follower(load, *, client, process_id: int, host: str, port: int, log_level: str = "info") -> None:
    """A host other than 0: /health on host:port, and the engine loop fed by
    host 0 (load() builds the LLM, with the same options as host 0's) until
    host 0 stops the run or this process gets a signal."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state: dict = {}
    server = uvicorn.Server(uvicorn.Config(follower_app(state), host=host, port=port, log_level=log_level))

    def run():
        try:
            follower = state["follower"] = Follower(client, process_id)
            llm = load()
            logger.info("process %d: following host 0", process_id)
            follower.follow(llm.engine)
        except Exception as e:  # loading failed: /health says why
            logger.exception("process %d: loading the model failed", process_id)
            state["error"] = f"loading the model failed: {type(e).__name__}: {e}"
        server.should_exit = True

    threading.Thread(target=run, name="jaxinfer-follower", daemon=True).start()
    server.run()
    follower = state.get("follower")
    if state.get("error") or (follower is not None and follower.error):
        raise RuntimeError(state.get("error") or follower.error)
