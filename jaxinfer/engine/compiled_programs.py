"""Which step programs a runner compiles (the bucket grid), in what order,
and their compiled executables: warm-up, background compilation and the
executable cache. ModelRunner (engine/runner.py) is a CompiledPrograms and
supplies the placeholder arguments each program is lowered with.

Buckets: a pure-decode step (one new token per sequence) runs in (n, n) for
n one of the backend's decode buckets (CPU: every power of two from 1 up to
max_num_seqs; GPU: powers of four), and the Pallas attention serves it with
its split-k decode kernel. Other steps pad the flattened token count to a
power of two from 16 up to max_num_batched_tokens and the sequence count to
one of the backend's buckets for that many tokens (CPU: every power of two
from 8 up to max_num_seqs; GPU: one). With K speculative tokens, a step that
verifies drafts runs in (n (1 + K), n) for the decode buckets n. Everything
compiles at warm-up; a compilation after warm-up is counted and logged as
an error.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax
from tqdm.auto import tqdm

from jaxinfer.engine.executable_cache import LOAD_THREADS, ExecutableCache
from jaxinfer.engine.sampler import CONDITIONAL, SamplerWork
from jaxinfer.utils import bucket_size, powers_of_two

log = logging.getLogger(__name__)


class CompiledPrograms:
    """The bucket grid of a runner's step programs and their executables.
    A subclass provides _warmup_call(program) -> (jitted program, placeholder
    arguments of the program's shapes, static arguments)."""

    def __init__(self, backend, max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                 sampling: bool, executable_cache: ExecutableCache | None):
        self.backend = backend
        self.num_speculative_tokens = num_speculative_tokens
        self.sampling = sampling
        self.token_buckets = powers_of_two(16, max_num_batched_tokens)
        self.seq_buckets = powers_of_two(8, max_num_seqs)
        # Padding one decode token to 16 would multiply a memory-bound step's compute by 16.
        self.decode_buckets = backend.decode_buckets(max_num_seqs)
        # program -> its compiled executable (warmup, _executable; one
        # assignment per program, so the serving thread may read it while
        # another fills it); the buckets whose programs are all compiled; the
        # thread compiling the others, if any.
        self._executables: dict = {}
        self.executable_cache = executable_cache
        self._cache_keys: dict = {}  # program -> its executable cache key (warmup)
        self._stored_later: set = set()  # stored programs warm-up left to load later (_load_stored, the thread)
        self._loading = threading.Lock()  # one program loads at a time after warm-up
        self._ready_lock = threading.Lock()
        self.num_loaded = 0  # programs loaded from the executable cache (warm-up, steps, the background thread)
        self.num_loaded_before_serving = 0  # of which warm-up loaded before returning
        self._ready: frozenset = frozenset()
        self._background: _BackgroundCompile | None = None
        self.warmed_up = False
        # The sample programs of each size: the conditional one, or one per
        # combination of optional pieces (engine/sampler.py, needed_work).
        self._sampler_works = [CONDITIONAL] if backend.conditional_skips else [
            SamplerWork(conditional=False, draw=draw, filters=filters)
            for draw, filters in ((False, False), (True, False), (True, True))]

    # -- the bucket grid -----------------------------------------------------
    def buckets(self) -> list[tuple[int, int, str]]:
        """(tokens, seqs, layout) buckets of the forward program."""
        buckets = [(n, n, "decode") for n in self.decode_buckets]
        # >= 1 token per sequence, so seqs <= tokens.
        buckets += [(t, s, "mixed") for t in self.token_buckets for s in self._mixed_seq_buckets(t)]
        k = self.num_speculative_tokens
        return buckets + [(n * (1 + k), n, "verify") for n in self.decode_buckets if k]

    def bucket_programs(self, bucket: tuple[int, int, str]) -> list[tuple]:
        """The programs a step in `bucket` runs: its forward and, with sampling,
        the sampler of its seqs size, plain and full (programs.py), one per
        SamplerWork the backend uses (engine/sampler.py), and acceptance for a
        verify bucket."""
        _, num_seqs, layout = bucket
        programs = [("forward", *bucket)]
        if self.sampling:
            programs += [("sample", num_seqs, full, work) for full in (False, True) for work in self._sampler_works]
            if layout == "verify":
                programs.append(("verify", num_seqs, self.num_speculative_tokens))
        return programs

    def programs(self) -> list[tuple]:
        """Every program warm-up compiles."""
        return list(dict.fromkeys(p for bucket in self.buckets() for p in self.bucket_programs(bucket)))

    @property
    def num_compilations(self) -> int:
        """Programs compiled (or loaded from the executable cache) so far:
        warm-up's, and any a step needed after it (an error, see _executable)."""
        return len(self._executables)

    def bucket(self, num_tokens: int, num_seqs: int, verify: bool = False) -> tuple[int, int, str]:
        if verify:
            n = min(b for b in self.decode_buckets if b >= num_seqs)
            bucket = (n * (1 + self.num_speculative_tokens), n, "verify")
        elif num_tokens == num_seqs:
            n = min(b for b in self.decode_buckets if b >= num_seqs)
            bucket = (n, n, "decode")
        else:
            tokens = bucket_size(num_tokens, 16)
            bucket = (tokens, min(s for s in self._mixed_seq_buckets(tokens) if s >= num_seqs), "mixed")
        if bucket in self._ready or self._load_stored(bucket):
            return bucket
        # Its programs are still compiling in the background (warmup): the
        # smallest ready bucket of the layout that holds the step (padding
        # rows and sequences are inert), at worst the largest, ready first.
        return min((b for b in self._ready if b[2] == bucket[2] and b[0] >= bucket[0] and b[1] >= bucket[1]),
                   default=bucket)

    def _mixed_seq_buckets(self, num_tokens: int) -> list[int]:
        """The sequence buckets compiled for mixed steps of num_tokens (a bucket) tokens: the backend's choice."""
        return self.backend.mixed_seq_buckets(num_tokens, self.seq_buckets)

    # -- warm-up -------------------------------------------------------------
    def warmup(self, progress: bool = True, background: bool = False) -> None:
        """Compile every program of programs(), running none: the executables
        are kept and called directly (_executable).

        The largest bucket of each layout compiles first: any step fits in it,
        so the runner can serve as soon as those are ready. With background,
        the other buckets then compile on a thread while the engine serves, the
        smallest first; until a step's own bucket is ready, bucket() pads the
        step into a ready one, so no step ever waits for a compilation.
        Programs compile backend.compile_threads at a time (one on CPU, where
        XLA already spreads one compilation over the cores and two at once
        gained nothing; several on a GPU's host, where each compilation of an
        unrolled model is mostly one thread's work).

        Programs in the executable cache are loaded, not compiled. With
        background and every program stored, none is loaded before serving:
        bucket() loads a step's own bucket the first time it runs, and the
        thread loads the rest, so a warm start serves its first request
        after loading a handful of programs instead of all of them. Else the
        first buckets' programs load (or compile) before serving, and the
        other stored ones load on the thread ahead of its compilations.
        Every program not stored is traced and lowered here, on the calling
        thread, and only XLA's compilation of the lowered modules runs on the
        other. JAX calls its thread support limited, and lowering on the
        background thread failed now and then inside JAX's lowering (a
        KeyError on a jaxpr variable) while the engine served; compilation
        and loading are XLA's C++ alone. Lowering all 25 programs of the
        default engine costs ~2 s of the start (BENCHMARKS.md, "Cold start")."""
        buckets = self.buckets()
        layouts = dict.fromkeys(layout for _, _, layout in buckets)
        first = [max(b for b in buckets if b[2] == layout) for layout in layouts]
        rest = sorted((b for b in buckets if b not in first), key=lambda b: b[:2])
        calls = {p: self._warmup_call(p) for p in self.programs()}
        if self.executable_cache is not None:
            self._cache_keys = {p: self.executable_cache.key(p, args, statics) for p, (_, args, statics) in calls.items()}
            stored = {p for p in calls if self.executable_cache.has(self._cache_keys[p])}
            # With every program stored, none is needed before the first step
            # asks for its own bucket (bucket() loads it); else the first
            # buckets serve every step until the rest are compiled.
            now = set(calls) if not background else set() if stored == set(calls) else set(self._programs_of(first))
            self._stored_later = stored - now
            self._load({p: self._cache_keys[p] for p in calls if p in now})
        stored_later = list(self._stored_later)  # loaded on the background thread, or by bucket() when a step needs them
        lowered = {p: self._lower(p, *calls[p])
                   for p in tqdm([p for p in calls if p not in self._executables and p not in stored_later],
                                 desc="lowering", unit="program", disable=not progress, leave=False)}
        self._compile(first, lowered, progress)
        self.num_loaded_before_serving = self.num_loaded
        self.warmed_up = True
        rest = [b for b in first if b not in self._ready] + rest  # first buckets left to load, if any
        if background and rest:
            self._background = _BackgroundCompile(self, rest, lowered, stored_later)
        else:
            self._compile(rest, lowered, progress)

    def _load_stored(self, bucket: tuple) -> bool:
        """Load `bucket`'s programs from the executable cache now, where every
        one missing is stored there (a warm start whose background thread
        has not reached them yet); whether the bucket is then ready. Tens of
        milliseconds a program, where padding a short prompt into the
        largest bucket cost a step of the largest size (and its buffers:
        ~200 MB of temporaries for 256 tokens of a 0.5B model)."""
        missing = [p for p in self.bucket_programs(bucket) if p not in self._executables]
        if not all(p in self._stored_later or p in self._executables for p in missing) or not all(
                self._load_one(p) for p in missing):
            return False
        self._mark_ready(bucket)
        return True

    def _mark_ready(self, bucket: tuple) -> None:
        with self._ready_lock:  # the serving thread (_load_stored) and the background thread both add
            self._ready = self._ready | {bucket}  # rebound, never mutated: bucket() reads it unlocked

    def _programs_of(self, buckets: list[tuple]) -> list[tuple]:
        return list(dict.fromkeys(p for b in buckets for p in self.bucket_programs(b)))

    def _load(self, keys: dict) -> None:
        """Load the programs of `keys` ({program: cache key}) that the
        executable cache holds, two threads at a time (warm-up, before any
        other thread loads)."""
        loaded = self.executable_cache.load_all(keys, max(LOAD_THREADS, self.backend.compile_threads))
        self._executables.update(loaded)
        self.num_loaded += len(loaded)

    def _load_one(self, program: tuple) -> bool:
        """Load one stored program unless loaded already (by the serving thread's
        bucket() or the background thread, whichever comes first); whether it is there."""
        with self._loading:
            if program not in self._executables:
                executable = self.executable_cache.load(self._cache_keys[program])
                if executable is None:
                    return False
                self._executables[program] = executable
                self.num_loaded += 1
            self._stored_later.discard(program)
            return True

    def _warmup_call(self, program: tuple):
        """(jitted program, placeholder arguments of the program's shapes, static arguments): the subclass's."""
        raise NotImplementedError

    def wait_compiled(self) -> None:
        """Block until a background warm-up has compiled every program."""
        if self._background is not None:
            self._background.join()

    def _compile(self, buckets: list[tuple], lowered: dict, progress: bool = False,
                 stop: threading.Event | None = None) -> None:
        """Compile the programs of `buckets` (backend.compile_threads at once),
        marking each bucket ready once all of its programs are, in order."""
        todo = [p for p in self._programs_of(buckets) if p not in self._executables and p in lowered]
        with ThreadPoolExecutor(self.backend.compile_threads, thread_name_prefix="jaxinfer-compile") as pool:
            futures = {p: pool.submit(self._compile_one, lowered[p], p) for p in todo}
            for bucket in tqdm(buckets, desc="compiling", unit="bucket", disable=not progress, leave=False):
                for program in self.bucket_programs(bucket):
                    if program in futures:
                        self._executables[program] = futures[program].result()
                if all(p in self._executables for p in self.bucket_programs(bucket)):
                    self._mark_ready(bucket)
                elif not all(p in self._stored_later for p in self.bucket_programs(bucket)
                             if p not in self._executables):  # stored, did not load, and not lowered
                    log.warning("bucket %s stays unused: a stored program of it did not load", bucket)
                if stop is not None and stop.is_set():
                    pool.shutdown(cancel_futures=True)
                    return

    def _compile_one(self, lowered, program: tuple):
        options = self.backend.compiler_options()
        if self.executable_cache is None:
            return lowered.compile(options)
        return self.executable_cache.compile(lowered, self._cache_keys[program], options)

    @staticmethod
    def _lower(program: tuple, fn, args: tuple, statics: dict):
        # Lowered from shapes alone: the compiling thread must not hold the
        # buffers (the KV pool is donated, so deleted, at every step).
        return fn.lower(*jax.tree.map(_shape_of, args), **statics)

    def _executable(self, program: tuple, fn, args: tuple, statics: dict):
        """`program`'s executable. One missing after warm-up is a shape that
        escaped bucketing: it is compiled here, counted and logged as an error."""
        executable = self._executables.get(program)
        if executable is None:
            if self.warmed_up:
                log.error("compilation after warm-up of %s: a shape escaped bucketing", program)
            lowered = self._lower(program, fn, args, statics)
            executable = self._executables[program] = lowered.compile(self.backend.compiler_options())
        return executable


def _shape_of(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


class _BackgroundCompile:
    """A daemon thread compiling a runner's remaining buckets. At interpreter
    exit it is told to stop after its current bucket and joined: a thread
    left inside XLA while the process tears down can crash the exit."""

    _running: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, programs: CompiledPrograms, buckets: list[tuple], lowered: dict, stored: list):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(programs, buckets, lowered, stored),
                                        name="jaxinfer-compile", daemon=True)
        _BackgroundCompile._running.add(self)
        self._thread.start()

    def _main(self, programs: CompiledPrograms, buckets: list[tuple], lowered: dict, stored: list) -> None:
        try:
            for program in stored:
                if self._stop.is_set():
                    return
                programs._load_one(program)
            programs._compile(buckets, lowered, stop=self._stop)
        except Exception:  # the largest buckets still serve every step
            log.exception("background compilation failed; steps keep running in the buckets compiled so far")

    def join(self) -> None:
        self._thread.join()

    @classmethod
    def stop_all(cls) -> None:
        for job in list(cls._running):
            job._stop.set()
        for job in list(cls._running):
            job.join()


# At the start of interpreter shutdown, before concurrent.futures drains its
# pools (registered earlier, so it runs after this: these callbacks run in
# reverse): each job stops after its current program, so no compile is left
# running in a daemon thread while the interpreter finalizes, which aborted the
# process ("FATAL: exception not rethrown"). atexit proper runs too late: after
# the pools' drain has started every queued compile.
threading._register_atexit(_BackgroundCompile.stop_all)
