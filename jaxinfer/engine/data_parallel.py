"""Data parallelism: M engine replicas behind one engine interface.

Each replica is a whole LLMEngine (scheduler, block manager, paged pool,
compiled programs) over its own ("model",) mesh of tensor_parallel_size
devices (parallel/mesh.py); the params are loaded once, into replica 0's shards, and
copied device to device to the others. A new request goes to the replica
with the least outstanding work, counted in engine steps: its prompt tokens
not yet computed over max_num_batched_tokens (what one step prefills) plus
its tokens still to generate over max_num_seqs (one per running sequence per
step). Weighing a generated token max_num_batched_tokens / max_num_seqs
times a prompt token matters: counting plain tokens sends a short-prompt,
long-output request where it waits longest. Measured with
scripts/bench_data_parallel.py (engine steps to drain a heavy-tailed
workload, BENCHMARKS.md). A request stays on its replica (its KV blocks live there).

Why replicas rather than one mesh with a "data" axis over the batch: the
engine's batch is a ragged, host-scheduled set of sequences with per-replica
block tables; a data axis would force every replica to the same bucket shape
and the same step cadence (one slow prefill stalls all), and would need a
pool split by replica inside one program. Independent replicas share nothing
but the process, so their steps overlap: `step` dispatches every busy
replica from its own thread, and JAX releases the GIL while a program runs
and while the host waits for the sampled tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from jaxinfer.errors import RequestError
from jaxinfer.outputs import RequestOutput

# Replicas step concurrently, so their times overlap: report the largest; a
# request lives on one replica, so the maximum context is one replica's.
# Counts (tokens, blocks, compilations, cache hits) add up.
_MAX_STATS = ("host_time_s", "device_time_s", "max_context_len")


def outstanding_steps(engine) -> float:
    """Engine steps the replica's queued work needs if nothing else arrives (see the module docstring)."""
    prompt, generate = engine.outstanding_tokens()
    return prompt / engine.config.max_num_batched_tokens + generate / engine.config.max_num_seqs


class DataParallelEngine:
    """The LLMEngine interface LLM uses (validate, add_request, step, abort,
    has_unfinished, stats, wait_compiled) over replicas; `replica_of` maps request ids to the
    replica index serving them."""

    def __init__(self, replicas: list):
        if not replicas:
            raise ValueError("DataParallelEngine needs at least one replica")
        self.replicas = replicas
        self.config = replicas[0].config
        self.model = replicas[0].model
        self.tokenizer = replicas[0].tokenizer
        self.replica_of: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="dp-replica")

    # Requests are checked by one replica's rules: replicas are configured alike.
    def validate(self, name, prompt_token_ids, params) -> None:
        self.replicas[0].validate(name, prompt_token_ids, params)

    def validate_prompt(self, name, prompt_token_ids) -> None:
        self.replicas[0].validate_prompt(name, prompt_token_ids)

    def check_token_ids(self, name, token_ids) -> None:
        self.replicas[0].check_token_ids(name, token_ids)

    def validate_priority(self, name, priority) -> None:
        self.replicas[0].validate_priority(name, priority)

    def grammar_timeout_message(self, params) -> str:
        return self.replicas[0].grammar_timeout_message(params)

    def check_structured_outputs(self, name, params) -> None:
        self.replicas[0].check_structured_outputs(name, params)  # each replica compiles (and caches) its own

    @property
    def grammar_compiler(self):
        return self.replicas[0].grammar_compiler  # what check_structured_outputs warms

    def validate_lora(self, name, lora_request) -> None:
        for replica in self.replicas:  # each replica keeps its own host copy and slots
            replica.validate_lora(name, lora_request)

    def add_request(self, request_id: str, prompt_token_ids, params, prompt=None, lora_request=None,
                    priority: int = 0) -> int:
        if request_id in self.replica_of:
            raise RequestError(f"request {request_id}: id already in use")
        index = self.choose_replica(prompt_token_ids, params)
        extra = {"priority": priority} if priority else {}  # the default stays the replicas' own
        self.replicas[index].add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                         lora_request=lora_request, **extra)
        self.replica_of[request_id] = index
        return index

    def choose_replica(self, prompt_token_ids, params) -> int:
        """The replica with the least outstanding work in steps (ties: the lowest index)."""
        loads = [outstanding_steps(r) for r in self.replicas]
        return loads.index(min(loads))

    def abort(self, request_id: str) -> RequestOutput | None:
        index = self.replica_of.pop(request_id, None)
        return None if index is None else self.replicas[index].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished()]
        if len(busy) <= 1:
            results = busy[0].step() if busy else []
        else:
            results = [out for outs in self._pool.map(lambda r: r.step(), busy) for out in outs]
        for output in results:
            if output.finished:
                self.replica_of.pop(output.request_id, None)
        return results

    def wait_compiled(self) -> None:
        for replica in self.replicas:
            replica.wait_compiled()

    def stats(self) -> dict:
        per_replica = [r.stats() for r in self.replicas]
        total = {}
        for key in per_replica[0]:
            values = [s[key] for s in per_replica]
            total[key] = max(values) if key in _MAX_STATS else sum(values)
        total["replicas"] = per_replica
        return total
