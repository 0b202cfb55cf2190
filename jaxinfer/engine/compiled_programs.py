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
verifies drafts runs in (n (1 + K), n) for the decode buckets n. Every
bucket compiles at warm-up (before serving or on a background thread), or,
on demand, when a step first needs it; any other compilation after warm-up
is a shape that escaped the grid, counted and logged as an error.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax
from tqdm.auto import tqdm

from jaxinfer.engine.executable_cache import LOAD_THREADS, ExecutableCache, argument_signature
from jaxinfer.engine.sampler import CONDITIONAL, SamplerWork, greedy_work
from jaxinfer.engine.tracing_turns import TRACING_TURNS
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
        self._stored_later: set = set()  # stored programs warm-up left to load when a step needs them (_load_stored)
        self._loading = threading.Lock()  # one program loads at a time after warm-up
        self._ready_lock = threading.Lock()
        self._ready_changed = threading.Condition(self._ready_lock)  # a step waiting in bucket() for the thread
        self.num_loaded = 0  # programs loaded from the executable cache (warm-up, steps, the background thread)
        self.num_loaded_before_serving = 0  # of which warm-up loaded before returning
        self.num_adopted = 0  # programs taken from an early compile (adopt)
        self.num_off_grid = 0  # compilations of a shape that escaped bucketing (_executable): a bug
        self._ready: frozenset = frozenset()
        self._background: _BackgroundCompile | None = None
        self._coming: set = set()  # programs the background thread compiles (warmup)
        self._on_demand: set = set()  # programs a step compiles when it first needs one (warmup's "on_demand")
        self.warmed_up = False
        # The sample programs of each size: the conditional one (and, plain,
        # the greedy one, runner.py's _sampler_work), or one per combination
        # of optional pieces (engine/sampler.py, needed_work).
        self._sampler_works = [CONDITIONAL] if backend.conditional_skips else [
            SamplerWork(conditional=False, draw=draw, filters=filters)
            for draw, filters in ((False, False), (True, False), (True, True))]
        self.greedy_work = greedy_work(backend.conditional_skips)
        self._plain_sampler_works = list(dict.fromkeys([*self._sampler_works, self.greedy_work]))

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
            programs += [("sample", num_seqs, False, work) for work in self._plain_sampler_works]
            programs += [("sample", num_seqs, True, work) for work in self._sampler_works]
            if layout == "verify":
                programs.append(("verify", num_seqs, self.num_speculative_tokens))
        return programs

    def serving_programs(self, bucket: tuple[int, int, str]) -> list[tuple]:
        """The programs of `bucket` that must be compiled before it serves:
        its forward and the greedy sampler (and acceptance, verifying). A
        request that samples, or asks for penalties or logprobs, and comes
        before its sampler is compiled waits for it (_executable). On a
        two-core CPU the first buckets serve ~2 s sooner: a full sampler
        compiles in ~0.7 s, the conditional one in ~0.5 s, the greedy one in 0.09 s."""
        return [p for p in self.bucket_programs(bucket) if p[0] != "sample" or (not p[2] and p[3] == self.greedy_work)]

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
        if self._on_demand:  # the step compiles its bucket's programs (_executable); the next finds it ready
            return bucket
        # Its programs are still compiling in the background (warmup): the
        # smallest ready bucket of the layout that holds the step (padding
        # rows and sequences are inert); where none does yet, the step waits
        # for the thread, which compiles each layout's largest bucket next.
        with TRACING_TURNS.given_up(), self._ready_changed:  # the thread may need a turn to lower it
            while True:
                holding = [b for b in self._ready if b[2] == bucket[2] and b[0] >= bucket[0] and b[1] >= bucket[1]]
                if holding:
                    return min(holding)
                if self._background is None or not self._background.running:
                    return bucket  # nothing left to wait for: _executable compiles it (an error)
                self._ready_changed.wait()

    def _mixed_seq_buckets(self, num_tokens: int) -> list[int]:
        """The sequence buckets compiled for mixed steps of num_tokens (a bucket) tokens: the backend's choice."""
        return self.backend.mixed_seq_buckets(num_tokens, self.seq_buckets)

    # -- warm-up -------------------------------------------------------------
    def warmup(self, progress: bool = True, mode: str = "all") -> None:
        """Compile the programs of programs() (EngineConfig.warmup's `mode`
        says which ones now), running none: the executables are kept and
        called directly (_executable).

        The smallest bucket of each layout compiles first: what one short
        request needs (a 16-token prompt, one decode row), so the runner
        serves it as soon as those are ready (with the largest first, a cold
        start's first request would run padded into them: a 5-token prompt
        as 256 rows, one decode row as 16). A bucket serves once its
        serving_programs() are compiled. "all" compiles the rest before
        returning; "on_demand" leaves each to the first step that needs it
        (the step runs in its own bucket, waiting for the compilation); with
        "background", the rest compile on a thread while the engine serves: the first buckets' full
        samplers, each layout's largest bucket (any step fits in it), then
        the others, smallest first. Until a step's own bucket is ready,
        bucket() pads the step into a ready one, and a step that none holds
        yet waits for the thread. Programs compile backend.compile_threads
        at a time (one on CPU, where XLA already spreads one compilation over
        the cores and two at once gained nothing; several on a GPU's host,
        where each compilation of an unrolled model is mostly one thread's
        work).

        Programs in the executable cache are loaded, not compiled. With
        background and every program stored, none is loaded before serving;
        else the first buckets' programs load (or compile) before serving.
        Either way the other stored ones stay on disk until a step needs
        them: bucket() loads a step's own bucket the first time it runs (tens
        of milliseconds), so a warm start serves its first request after
        loading a handful of programs, and holds only those its steps ran
        (each loaded program is resident code; BENCHMARKS.md, "Cold start").
        A program not stored is lowered (traced) just before it compiles,
        and compiles on other threads while the next is lowered: before
        serving, only the first buckets' programs (here, on the calling
        thread); the rest on the background thread, taking turns with the
        engine's steps (engine/tracing_turns.py says why). Lowering every
        program before serving cost ~3 s of a 0.47B K-quant model's cold
        start on two cores (BENCHMARKS.md, "Cold start")."""
        background, later = mode == "background", mode != "all"  # later: only the first buckets before serving
        buckets = self.buckets()
        layouts = dict.fromkeys(layout for _, _, layout in buckets)
        first = self.first_buckets()
        largest = [b for b in (max(b for b in buckets if b[2] == layout) for layout in layouts) if b not in first]
        rest = largest + sorted((b for b in buckets if b not in first and b not in largest), key=lambda b: b[:2])
        # Their shapes, not the placeholder arrays: a program lowered later
        # on the background thread must not hold buffers (the KV pool is
        # donated, so deleted, at every step).
        calls = {p: _shapes_of(*self._warmup_call(p)) for p in self.programs()}
        if self.executable_cache is not None:
            self._cache_keys = self._keys(calls)
            stored = {p for p in calls if self.executable_cache.has(self._cache_keys[p])}
            # With every program stored, none is needed before the first step
            # asks for its own bucket (bucket() loads it); else the first
            # buckets serve every step until the rest are compiled.
            now = set(calls) if not later else set() if stored == set(calls) else set(self._programs_of(first))
            self._stored_later = stored - now
            self._load({p: self._cache_keys[p] for p in calls if p in now})
        stored_later = list(self._stored_later)  # loaded by bucket() when a step needs them
        # The programs to compile, in order (stored ones are loaded instead);
        # with background or on demand, only the first buckets' before serving.
        to_compile = {p: calls[p] for p in self._programs_of(first + rest)
                      if p not in self._executables and p not in stored_later}
        now = [p for b in first for p in self.serving_programs(b)] if later else list(to_compile)
        self._compile(first + ([] if later else rest), {p: to_compile.pop(p) for p in now if p in to_compile},
                      progress)
        self.num_loaded_before_serving = self.num_loaded
        self.warmed_up = True
        if mode == "on_demand":
            self._on_demand = set(to_compile)
            return
        # Buckets with programs left: the first ones' full samplers, or
        # programs left to load; then the rest.
        rest = [b for b in first + rest if not all(p in self._executables for p in self.bucket_programs(b))]
        if background and rest:
            if to_compile:  # before the engine serves: its first step already takes turns (tracing_turns.py)
                TRACING_TURNS.lowering_started()
            self._coming = set(to_compile)
            self._background = _BackgroundCompile(self, rest, to_compile)

    def first_buckets(self) -> list[tuple]:
        """The smallest bucket of each layout: what a short first request runs in."""
        buckets = self.buckets()
        return [min(b for b in buckets if b[2] == layout) for layout in dict.fromkeys(b[2] for b in buckets)]

    def compile_first(self, pool: ThreadPoolExecutor) -> list:
        """Lower the serving programs of the first buckets on this thread and
        start compiling them on `pool` (those stored in the executable cache
        are loaded instead), nothing else: what an engine's early compile
        makes while the model's weights load (engine/early_compile.py).
        Returns the compilations' futures; each executable joins this
        runner's as it is done."""
        first = self.first_buckets()
        calls = {p: _shapes_of(*self._warmup_call(p)) for b in first for p in self.serving_programs(b)}
        if self.executable_cache is not None:
            self._cache_keys = self._keys(calls)
            self._load(self._cache_keys)
        return [self._submit(pool, program, self._lower(program, *call), first)
                for program, call in calls.items() if program not in self._executables]

    def adopt(self, other: CompiledPrograms) -> int:
        """Take each executable `other` holds for a program this one has not
        compiled, where the program's arguments have the same shapes, dtypes
        and placements here (and the same static arguments): an early
        compile's, made on the weights' shapes before they loaded. How many."""
        taken = 0
        for program, executable in list(other._executables.items()):
            if program in self._executables:
                continue
            fn, args, statics = _shapes_of(*self._warmup_call(program))
            other_fn, other_args, other_statics = _shapes_of(*other._warmup_call(program))
            if fn is other_fn and statics == other_statics and argument_signature(args) == argument_signature(other_args):
                self._executables[program] = executable
                if program in other._cache_keys:
                    self._cache_keys[program] = other._cache_keys[program]
                taken += 1
        self.num_adopted += taken
        return taken

    def _load_stored(self, bucket: tuple) -> bool:
        """Load `bucket`'s serving programs from the executable cache now,
        where every one missing is stored there (a warm start); whether the
        bucket is then ready. Tens of milliseconds a program, where padding a
        short prompt into the largest bucket cost a step of the largest size
        (and its buffers: ~200 MB of temporaries for 256 tokens of a 0.5B
        model). Its other samplers load when a step first runs them (_executable)."""
        missing = [p for p in self.serving_programs(bucket) if p not in self._executables]
        if not all(p in self._stored_later or p in self._executables for p in missing) or not all(
                self._load_one(p) for p in missing):
            return False
        self._mark_ready(bucket)
        return True

    def _mark_ready(self, bucket: tuple) -> None:
        with self._ready_changed:  # the serving thread (_load_stored) and the background thread both add
            self._ready = self._ready | {bucket}  # rebound, never mutated: bucket() reads it unlocked
            self._ready_changed.notify_all()

    def _programs_of(self, buckets: list[tuple]) -> list[tuple]:
        return list(dict.fromkeys(p for b in buckets for p in self.bucket_programs(b)))

    def _load(self, keys: dict) -> None:
        """Load the programs of `keys` ({program: cache key}) that the
        executable cache holds and this runner lacks, two threads at a time
        (warm-up, before any other thread loads). An early compile's programs,
        adopted before warm-up, are stored by then: loading them again would
        deserialize each a second time before the first request."""
        keys = {program: key for program, key in keys.items() if program not in self._executables}
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

    @property
    def num_pending(self) -> int:
        """Programs neither compiled (or loaded) yet nor left to a step
        (stored, to load, or on demand, to compile): what the background
        thread has left to compile."""
        return len([p for p in self.programs()
                    if p not in self._executables and p not in self._stored_later and p not in self._on_demand])

    @property
    def compiling(self) -> bool:
        """Whether the background thread is still compiling: it takes turns
        with the steps for the cores (and the GIL while it lowers)."""
        return self._background is not None and self._background.running

    def wait_compiled(self) -> None:
        """Block until a background warm-up has compiled every program that is
        not stored (stored ones load when a step needs them)."""
        if self._background is not None:
            self._background.join()

    def stop_compiling(self) -> None:
        """Stop a background warm-up after the program it is compiling; the
        ones it had not started are dropped."""
        if self._background is not None:
            self._background.stop()

    def _compile(self, buckets: list[tuple], calls: dict, progress: bool = False,
                 stop: threading.Event | None = None) -> None:
        """Lower and compile the programs of `buckets` that `calls` holds
        ({program: (jitted program, argument shapes, statics)}, in order).
        Each is lowered on this thread, in a tracing turn (tracing_turns.py),
        and compiled on the pool (backend.compile_threads at once) as soon as
        it is lowered, while this thread lowers the next; a bucket is marked
        ready as soon as all of its programs are compiled."""
        todo = [p for p in self._programs_of(buckets) if p not in self._executables and p in calls]
        futures = {}
        with ThreadPoolExecutor(self.backend.compile_threads, thread_name_prefix="jaxinfer-compile") as pool:
            for program in tqdm(todo, desc="lowering", unit="program", disable=not progress, leave=False):
                if stop is not None and stop.is_set():
                    pool.shutdown(cancel_futures=True)
                    return
                with TRACING_TURNS.turn():
                    lowered = self._lower(program, *calls[program])
                futures[program] = self._submit(pool, program, lowered, buckets)
            for bucket in tqdm(buckets, desc="compiling", unit="bucket", disable=not progress, leave=False):
                for program in self.bucket_programs(bucket):
                    if program in futures:
                        futures[program].result()  # raises what the compilation raised
                if all(p in self._executables for p in self.serving_programs(bucket)):
                    self._mark_ready(bucket)  # its programs loaded from the executable cache, or compiled
                elif not all(
                        p in self._stored_later for p in self.serving_programs(bucket)
                        if p not in self._executables):  # stored, did not load, and not lowered
                    log.warning("bucket %s stays unused: a stored program of it did not load", bucket)
                if stop is not None and stop.is_set():
                    pool.shutdown(cancel_futures=True)
                    return

    def _keys(self, calls: dict) -> dict:
        """{program: its executable cache key} of calls ({program: (fn, argument shapes, statics)})."""
        return {p: self.executable_cache.key(p, args, statics) for p, (_, args, statics) in calls.items()}

    def _submit(self, pool: ThreadPoolExecutor, program: tuple, lowered, buckets: list[tuple]):
        """Compile `lowered` on `pool`; its executable joins this runner's when done (_compiled)."""
        future = pool.submit(self._compile_one, lowered, program)
        future.add_done_callback(lambda f: self._compiled(program, f, buckets))
        return future

    def _compiled(self, program: tuple, future, buckets: list[tuple]) -> None:
        """A compilation's end (on the pool's thread): keep the executable,
        mark each of `buckets` whose serving programs are now all compiled,
        and wake a step waiting for this program (_executable)."""
        if future.cancelled() or future.exception() is not None:
            return
        self._executables[program] = future.result()
        for bucket in buckets:
            if bucket not in self._ready and all(p in self._executables for p in self.serving_programs(bucket)):
                self._mark_ready(bucket)
        with self._ready_changed:
            self._ready_changed.notify_all()

    def _compile_one(self, lowered, program: tuple):
        options = self.backend.compiler_options()
        if self.executable_cache is None or program not in self._cache_keys:  # not stored: a shape off the grid
            return lowered.compile(options)
        return self.executable_cache.compile(lowered, self._cache_keys[program], options)

    @staticmethod
    def _lower(program: tuple, fn, args: tuple, statics: dict):
        return fn.lower(*jax.tree.map(_shape_of, args), **statics)

    def _executable(self, program: tuple, fn, args: tuple, statics: dict):
        """`program`'s executable: loaded here if stored and not yet loaded,
        waited for if the background thread is compiling it, compiled here
        if warm-up left it on demand (lowered as warm-up lowers it, so that
        it is the program, and has the cache key, a full warm-up makes). Any
        other missing after warm-up is a shape that escaped bucketing: it is
        compiled here, counted and logged as an error."""
        executable = self._executables.get(program)
        if executable is None and program in self._stored_later and self._load_one(program):
            executable = self._executables[program]
        if executable is None and program in self._coming:  # the background thread is making it
            with TRACING_TURNS.given_up(), self._ready_changed:
                while program not in self._executables and self._background.running:
                    self._ready_changed.wait()
            executable = self._executables.get(program)
        if executable is None:
            call = (fn, args, statics)
            if program in self._on_demand:
                call = _shapes_of(*self._warmup_call(program))
            elif self.warmed_up:
                log.error("compilation after warm-up of %s: a shape escaped bucketing", program)
                self.num_off_grid += 1
            executable = self._executables[program] = self._compile_one(self._lower(program, *call), program)
        return executable


def _shape_of(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


def _shapes_of(fn, args: tuple, statics: dict) -> tuple:
    return fn, jax.tree.map(_shape_of, args), statics


class _BackgroundCompile:
    """A daemon thread compiling a runner's remaining buckets. At interpreter
    exit it is told to stop after its current bucket and joined: a thread
    left inside XLA while the process tears down can crash the exit."""

    _running: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, programs: CompiledPrograms, buckets: list[tuple], calls: dict):
        self._stop = threading.Event()
        self.running = True  # until _main returns: a step waiting in bucket() waits no longer after
        self._thread = threading.Thread(target=self._main, args=(programs, buckets, calls),
                                        name="jaxinfer-compile", daemon=True)
        _BackgroundCompile._running.add(self)
        self._thread.start()

    def _main(self, programs: CompiledPrograms, buckets: list[tuple], calls: dict) -> None:
        try:
            programs._compile(buckets, calls, stop=self._stop)
        except Exception:  # a step no compiled bucket holds is compiled where it runs (an error)
            log.exception("background compilation failed; steps keep running in the buckets compiled so far")
        finally:
            if calls:
                TRACING_TURNS.lowering_done()
            with programs._ready_changed:
                self.running = False
                programs._ready_changed.notify_all()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        self._thread.join()

    @classmethod
    def stop_all(cls) -> None:
        for job in list(cls._running):
            job.stop()
        for job in list(cls._running):
            job.join()


# At the start of interpreter shutdown, before concurrent.futures drains its
# pools (registered earlier, so it runs after this: these callbacks run in
# reverse): each job stops after its current program, so no compile is left
# running in a daemon thread while the interpreter finalizes, which aborted the
# process ("FATAL: exception not rethrown"). atexit proper runs too late: after
# the pools' drain has started every queued compile.
threading._register_atexit(_BackgroundCompile.stop_all)
