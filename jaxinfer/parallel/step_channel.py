"""Host 0's word to the other hosts before each lockstep step, through the
distributed runtime's key-value store.

A lockstep server takes requests on host 0 only; the other hosts must add
and abort the same requests at the same step boundary, or their schedulers
diverge and their collectives hang. Host 0 writes one numbered message per
step boundary (an empty one when nothing changed) and every other host reads
them in order before it steps.

The key-value store (the coordination service jax.distributed already runs
in host 0's process) rather than a broadcast collective: host 0's write is
one RPC that does not wait for the readers, so a dead or stalled host cannot
block host 0 here (only inside the model's own collectives, which the
heartbeats of peer_watch.py cover); a reader's wait has a timeout, so it
notices a host 0 that has gone; a message of any size is one write (no
fixed buffer, no rounds), and no device program runs for it. BENCHMARKS.md
("Multi-host serving") has its cost beside broadcast_one_to_all's.

Messages are deleted a block at a time: a block is read by every host once
two model steps have run after its last message, because every host joins
a step's collectives only after reading the messages before it.
"""

from __future__ import annotations

PREFIX = "jaxinfer/step"
BLOCK = 64  # messages per key-value directory, deleted together
POLL_MS = 1000  # a reader's longest single wait; it loops, checking that the store still answers


def kv_client():
    """The distributed runtime's client (jax.distributed.initialize must have run)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def _key(index: int) -> str:
    return f"{PREFIX}/{index // BLOCK}/{index % BLOCK}"


class StepWriter:
    """Host 0's side: publish() one message per step boundary, stepped() after each model step."""

    def __init__(self, client=None):
        self.client = client or kv_client()
        self.count = 0  # messages written
        self.bytes = 0
        self.steps = 0  # model steps run
        self._closed: list[tuple[int, int]] = []  # (block, steps run when its last message was written)

    def publish(self, message: bytes) -> None:
        self.client.key_value_set_bytes(_key(self.count), message)
        self.count += 1
        self.bytes += len(message)
        if self.count % BLOCK == 0:
            self._closed.append((self.count // BLOCK - 1, self.steps))

    def stepped(self) -> None:
        self.steps += 1
        while self._closed and self.steps >= self._closed[0][1] + 2:
            block, _ = self._closed.pop(0)
            self.client.key_value_delete(f"{PREFIX}/{block}")


class StepReader:
    """Another host's side: receive() the next message, in order."""

    def __init__(self, client=None):
        self.client = client or kv_client()
        self.count = 0

    def receive(self, should_stop=lambda: False) -> bytes | None:
        """The next message; None when should_stop() turns true while waiting.
        Raises when the store stops answering (host 0 has gone)."""
        while True:
            try:
                message = self.client.blocking_key_value_get_bytes(_key(self.count), POLL_MS)
            except Exception as e:  # noqa: BLE001 - the runtime raises one type for every status
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                if should_stop():
                    return None
                continue
            self.count += 1
            return message
