"""Host work a request brings with it, off the event loop and bounded.

Tokenizing a long text, rendering a chat template and scoring a prompt's
logprobs (server/prompt_logprobs.py) take CPU in proportion to what the
client sent. On the event loop, one such request would freeze every stream
the server is serving; so they run on small worker pools, and each pool
admits a bounded number of waiting jobs (more is a 429, not an unbounded
queue). Short texts are tokenized inline: a thread hop would cost more than
the work. What one job may cost is bounded by the caller (a prompt longer
than the context can hold is refused before it is tokenized, app.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from jaxinfer.server.errors import APIError

# Texts up to this many characters are tokenized on the event loop (well under a millisecond).
INLINE_CHARS = 16384


class WorkerPool:
    """A thread pool that refuses (429) rather than queue more than max_waiting jobs."""

    def __init__(self, name: str, workers: int, max_waiting: int):
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"jaxinfer-{name}")
        self.max_jobs = workers + max_waiting
        self.num_jobs = 0  # running or waiting; event loop only

    async def run(self, fn, *args):
        if self.num_jobs >= self.max_jobs:
            raise APIError(429, f"the server is at capacity: {self.num_jobs} {self.name} jobs are running or "
                                f"waiting; retry later", code="queue_full")
        self.num_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.num_jobs -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HostWork:
    """The server's pools: tokenizing and templates (2 workers; the tokenizer
    releases the GIL on long texts), prompt scoring (1 worker: each job holds
    a [prompt, vocab] logits array)."""

    def __init__(self):
        self.text = WorkerPool("tokenizer", workers=2, max_waiting=64)
        self.scoring = WorkerPool("prompt-logprobs", workers=1, max_waiting=16)

    async def encode(self, tokenizer, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self.text.run(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def shutdown(self) -> None:
        self.text.shutdown()
        self.scoring.shutdown()
