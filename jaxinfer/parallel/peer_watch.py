"""Heartbeats between lockstep hosts, so that host 0 learns within seconds
that another host died or stalled.

Every host but 0 writes a growing count to the key-value store every
`interval` seconds from a thread of its own; host 0 reads them all as often
and calls `on_lost(process_id, message)` once, for the first host whose
count has not moved for `timeout` seconds. Without this, host 0 would learn
only when a collective of a model step fails or times out (minutes; or
never, for a host that is stopped but keeps its sockets open), or when
jax.distributed's own heartbeat (heartbeat_timeout_seconds, 100 s by
default) ends the whole job.

What it does not see: a host whose process runs but whose engine thread is
stuck (its heartbeat thread still beats); that host's step collectives hold
host 0 until they time out.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("jaxinfer.parallel")

PREFIX = "jaxinfer/beat"


class Heartbeat:
    """A follower's beat: a daemon thread writing its count every `interval` seconds."""

    def __init__(self, client, process_id: int, interval: float = 0.5):
        self.client, self.key, self.interval = client, f"{PREFIX}/{process_id}", interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                self.client.key_value_set(self.key, str(count), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - host 0 (the store) has gone; the engine loop says so
                return
            count += 1
            self._stop.wait(self.interval)


class PeerWatch:
    """Host 0's watch over processes 1 .. num_processes - 1."""

    def __init__(self, client, num_processes: int, on_lost, timeout: float = 5.0, interval: float = 0.5):
        self.client, self.on_lost, self.timeout, self.interval = client, on_lost, timeout, interval
        self.peers = list(range(1, num_processes))
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-peer-watch", daemon=True)

    def start(self) -> "PeerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        start = time.monotonic()
        seen = {p: (None, start) for p in self.peers}  # process -> (last count read, when it last changed)
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for process in self.peers:
                try:
                    count = self.client.key_value_try_get(f"{PREFIX}/{process}")
                except Exception:  # noqa: BLE001 - not written yet: its first beat is still due
                    count = None
                last, since = seen[process]
                if count is not None and count != last:
                    seen[process] = (count, now)
                elif now - since > self.timeout:
                    self.lost = (f"lost host: process {process} of the lockstep run has not answered for "
                                 f"{now - since:.1f} s (died or stalled); restart every process")
                    logger.error("%s", self.lost)
                    self.on_lost(process, self.lost)
                    return

    def explain(self, default: str) -> str:
        """A failed step's message: the lost host when the watch names one
        within its timeout (a dead peer breaks a collective before its
        heartbeat is overdue), else `default`."""
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while self.lost is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(self.interval / 2)
        return self.lost or default
