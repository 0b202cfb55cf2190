"""The one thread that owns the engine.

The event loop never runs a step: a step blocks for the device, and the
engine's state (scheduler, block manager) is not safe to touch from two
threads. Handlers hand requests and aborts to this thread through a queue;
it drains the queue, steps while anything is unfinished, and posts each
request's news to that request's asyncio queue with one
`loop.call_soon_threadsafe` per step (not one per token). JAX releases the
GIL while a program runs, so the event loop keeps serving meanwhile.

What crosses the thread boundary are *deltas* (the text, tokens and logprobs
new since the last post), never the engine's live CompletionOutput objects,
which the next step mutates. Text is held back by the longest stop string
minus one character until it cannot become part of a stop string, so a
stream never sends text that a stop string later cuts away.

A request that fails validation fails alone (its queue gets the error). A
step that raises fails the requests it held (the engine says which, with
RequestOutput.internal_error; they get EngineStepFailed, a 500) and the
others go on. Only an exception that escapes the engine's step (it lost its
KV pool) is fatal: every open request gets it, /health turns 503 and new
requests are refused.

Admission (--max-queue) counts sequences (a request's prompts times its n)
and is reserved by the handler before any tokenizing or grammar compiling
(`reserve`), so an over-full server refuses at once and cheaply.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from jaxinfer.errors import RequestError
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger("jaxinfer.server")


class EngineDead(RuntimeError):
    """The engine thread stopped (a step failed, or the server is shutting down)."""


class QueueFull(RuntimeError):
    """More requests are in flight than the server admits (--max-queue)."""


class EngineStepFailed(RuntimeError):
    """The engine step that held this request raised (the server's fault, not the request's)."""


class Reservation:
    """Room for `count` sequences under --max-queue, held from admission until
    the request ends. release() is idempotent; a reservation dropped without
    it (a stream whose body never started) releases itself when collected."""

    def __init__(self, engine: "EngineThread", count: int):
        self.engine, self.count = engine, count
        engine.num_in_flight += count

    def release(self) -> None:
        if self.count:
            self.engine.num_in_flight -= self.count
            self.count = 0

    def __del__(self):
        self.release()


@dataclass
class CompletionDelta:
    """What one completion (of a request's n) gained since the last post."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    lora_request: object = None  # a LoRARequest (the adapter the request's `model` named), or None
    priority: int = 0  # under the "priority" scheduling policy, lower runs first


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one open request."""

    request: EngineRequest
    post: tuple  # (the owner's event loop, its function that puts [(tag, item)] on the owner's asyncio queue)
    tag: int
    arrival: float
    hold: int  # characters held back while a stop string may still be forming
    sent_text: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None


class EngineThread:
    """engine: an LLMEngine or DataParallelEngine (validate, add_request, step,
    abort, has_unfinished, stats). metrics: a ServerMetrics or None."""

    def __init__(self, engine, metrics=None, max_queue: int | None = None, lockstep=None):
        self.engine = engine
        self.lockstep = lockstep  # a multi-host run's lockstep.Leader (host 0), or None
        self.metrics = metrics
        self.max_queue = max_queue
        self.num_in_flight = 0  # sequences admitted and not yet finished (Reservation); event loop only
        self.fatal_error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self.stats: dict = engine.stats()  # the latest snapshot, written by the engine thread only
        if lockstep is not None:
            lockstep.bind(self)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    # -- the event loop's side ---------------------------------------------
    def reserve(self, num_sequences: int) -> Reservation:
        """Admit `num_sequences` more sequences or raise QueueFull (or
        EngineDead): the first thing a handler does, before any work."""
        if self.fatal_error is not None or self._stopping:
            raise EngineDead(self.fatal_error or "the server is shutting down")
        if self.max_queue is not None and self.num_in_flight + num_sequences > self.max_queue:
            raise QueueFull(f"{self.num_in_flight} sequences in flight and this request has {num_sequences}; "
                            f"the server admits {self.max_queue}")
        return Reservation(self, num_sequences)

    async def call(self, fn):
        """Run fn(engine) on the engine thread between steps (the engine is
        not safe to touch from two threads) and return its result."""
        if self.fatal_error is not None or self._stopping:
            raise EngineDead(self.fatal_error or "the server is shutting down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def resolve(ok, value):
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        self._commands.put(("call", fn, loop, resolve))
        return await future

    async def generate(self, requests: list[EngineRequest], reservation: Reservation | None = None):
        """Submit requests (the prompts of one HTTP request) and yield
        (index into requests, RequestDelta) as they progress, until all finish.
        Leaving early (an error, a client disconnect cancelling the task)
        aborts those still running, which frees their KV blocks at once.
        reservation: the admission the handler took (released here at the
        end); None reserves the requests' sequences now."""
        if reservation is None:
            reservation = self.reserve(sum(r.params.n for r in requests))
        if self.fatal_error is not None or self._stopping:
            reservation.release()
            raise EngineDead(self.fatal_error or "the server is shutting down")
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def post(items):  # runs on the loop: one call per step carries all of this call's items
            for item in items:
                inbox.put_nowait(item)

        arrival = time.perf_counter()
        open_ids = {r.request_id for r in requests}
        try:
            for tag, request in enumerate(requests):
                self._commands.put(("add", request, tag, loop, post, arrival))
            # The thread sets fatal_error before it drains its queue for the last time, so
            # adds queued before that drain are answered there, and later ones are caught here.
            if self.fatal_error is not None:
                raise EngineDead(self.fatal_error)
            while open_ids:
                tag, item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    open_ids.discard(item.request_id)
                yield tag, item
        finally:
            reservation.release()
            for request_id in open_ids:
                self._commands.put(("abort", request_id))

    def stop(self, timeout: float = 5.0) -> int:
        """Abort what is still open, tell its clients, and end the thread; returns how many were aborted."""
        self._stopping = True
        done = threading.Event()
        result = []
        self._commands.put(("stop", done, result))
        if self._thread.is_alive():
            done.wait(timeout)
        self._thread.join(timeout)
        return result[0] if result else 0

    def lose_host(self, message: str) -> None:
        """A lockstep host is gone (lockstep.Leader's watch, on its own thread):
        refuse new work and fail every open request now, while this thread may
        still be blocked in a step's collective that will never finish."""
        self.fatal_error = self.fatal_error or message
        outgoing: dict = {}
        for tracked in list(self._tracked.values()):
            self._queue(outgoing, tracked, EngineDead(self.fatal_error))
        self._flush(outgoing)

    # -- the engine thread -------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                # Idle: sleep until a command comes. Busy: take what is queued and step.
                commands = [self._commands.get()] if not self.engine.has_unfinished() else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                outgoing: dict = {}
                stop = None
                for command in commands:  # adds queued beside a stop are added, then aborted with the rest
                    if command[0] == "stop":
                        stop = command
                    else:
                        self._apply(command, outgoing)
                if stop is not None:
                    self._flush(outgoing)
                    self._shutdown(stop[1], stop[2])
                    return
                if self.lockstep is not None:  # the other hosts apply the same adds and aborts first
                    self.lockstep.publish(will_step=self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if self.lockstep is not None:
                        self.lockstep.stepped()
                    now = time.perf_counter()
                    for output in outputs:
                        self._collect(output, now, outgoing)
                self._refresh_stats()
                self._flush(outgoing)
            except Exception as e:  # a failed step: every open request learns it, and the server stops serving
                logger.exception("engine step failed; the server stops serving")
                message = f"engine failure: {type(e).__name__}: {e}"
                if self.lockstep is not None:  # a lost host breaks a step's collective: name it
                    message = self.lockstep.explain(message)
                self.fatal_error = self.fatal_error or message
                outgoing = {}
                for tracked in self._tracked.values():
                    self._queue(outgoing, tracked, EngineDead(self.fatal_error))
                self._tracked.clear()
                self._refuse_queued(outgoing)
                self._flush(outgoing)
                return

    def _apply(self, command, outgoing) -> None:
        if command[0] == "call":
            _, fn, loop, resolve = command
            try:
                result = (True, fn(self.engine))
            except Exception as e:  # the caller's to answer
                result = (False, e)
            try:
                loop.call_soon_threadsafe(resolve, *result)
            except RuntimeError:
                pass
            return
        if command[0] == "add":
            _, request, tag, loop, post, arrival = command
            tracked = _Tracked(request, (loop, post), tag, arrival,
                               hold=max((len(s) for s in request.params.stop), default=1) - 1,
                               sent_text=[0] * request.params.n, sent_tokens=[0] * request.params.n,
                               done=[False] * request.params.n)
            extra = {"priority": request.priority} if request.priority else {}
            try:
                self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                        prompt=request.prompt, lora_request=request.lora_request, **extra)
            except RequestError as e:  # this request only
                self._queue(outgoing, tracked, e)
                return
            self._tracked[request.request_id] = tracked
            if self.lockstep is not None:
                self.lockstep.added(request)
            if self.metrics is not None:
                self.metrics.on_request_added(len(request.prompt_token_ids))
        elif command[0] == "abort":
            request_id = command[1]
            if self._tracked.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                if self.lockstep is not None:
                    self.lockstep.aborted(request_id)
                if self.metrics is not None:
                    self.metrics.on_request_finished("abort", None)

    def _collect(self, output: RequestOutput, now: float, outgoing) -> None:
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return
        if output.error:  # failed after it was accepted (a grammar that did not compile, a failed step)
            if self.lockstep is not None and getattr(output, "internal_error", False):
                # A failed step of a lockstep run (a lost host, most often) leaves the hosts out of step.
                raise RuntimeError(output.error)
            del self._tracked[output.request_id]
            if self.metrics is not None:
                self.metrics.on_request_finished("abort", now - tracked.arrival)
            failure = EngineStepFailed if getattr(output, "internal_error", False) else RequestError
            self._queue(outgoing, tracked, failure(output.error))
            return
        completions = []
        new_tokens = 0
        for c in output.outputs:
            i = c.index
            if tracked.done[i]:
                continue
            finished = c.finish_reason is not None
            end = len(c.text) if finished else max(tracked.sent_text[i], len(c.text) - tracked.hold)
            start_token = tracked.sent_tokens[i]
            if end == tracked.sent_text[i] and start_token == len(c.token_ids) and not finished:
                continue
            completions.append(CompletionDelta(
                index=i, text=c.text[tracked.sent_text[i]:end], token_ids=c.token_ids[start_token:],
                logprobs=c.logprobs[start_token:] if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            ))
            new_tokens += len(c.token_ids) - start_token
            tracked.sent_text[i], tracked.sent_tokens[i], tracked.done[i] = end, len(c.token_ids), finished
        if new_tokens:
            if self.metrics is not None:
                self.metrics.on_tokens(new_tokens, tracked.arrival, tracked.last_token_time, now)
            tracked.first_token_time = tracked.first_token_time or now
            tracked.last_token_time = now
        if output.finished:
            del self._tracked[output.request_id]
            if self.metrics is not None:
                reasons = {c.finish_reason for c in output.outputs}
                reason = next(r for r in ("abort", "length", "stop") if r in reasons)
                self.metrics.on_request_finished(reason, now - tracked.arrival, output.metrics)
        if completions or output.finished:
            delta = RequestDelta(output.request_id, output.prompt_token_ids, completions, output.finished,
                                 output.num_cached_tokens)
            self._queue(outgoing, tracked, delta)

    @staticmethod
    def _queue(outgoing, tracked: _Tracked, item) -> None:
        loop, post = tracked.post
        outgoing.setdefault((loop, post), []).append((tracked.tag, item))

    @staticmethod
    def _flush(outgoing) -> None:
        for (loop, post), items in outgoing.items():
            try:
                loop.call_soon_threadsafe(post, items)
            except RuntimeError:  # that loop has closed: nobody is listening
                pass

    def _refresh_stats(self) -> None:
        self.stats = self.engine.stats()
        if self.metrics is not None:
            self.metrics.on_engine_stats(self.stats)

    def _shutdown(self, done: threading.Event, result: list) -> None:
        self.fatal_error = self.fatal_error or "the server is shutting down"
        outgoing: dict = {}
        result.append(len(self._tracked))
        for request_id in list(self._tracked):
            output = self.engine.abort(request_id)
            if output is not None:  # its client gets finish_reason "abort" and what was generated
                self._collect(output, time.perf_counter(), outgoing)
        self._tracked.clear()
        if self.lockstep is not None:
            self.lockstep.finish()
        self._refuse_queued(outgoing)
        self._flush(outgoing)
        done.set()

    def _refuse_queued(self, outgoing) -> None:
        """The thread is ending: adds still queued get the reason, so no handler waits forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request, tag, loop, post, _ = command
                outgoing.setdefault((loop, post), []).append((tag, EngineDead(self.fatal_error)))
            elif command[0] == "call":
                _, _, loop, resolve = command
                try:
                    loop.call_soon_threadsafe(resolve, False, EngineDead(self.fatal_error))
                except RuntimeError:
                    pass
