"""Command line: `jaxinfer generate | bench | serve | convert | ppl ...`."""

from __future__ import annotations

import argparse
import sys
import time


def _add_quantization_args(parser: argparse.ArgumentParser) -> None:
    """--quantization and --kv-cache-dtype, shared by generate, bench and ppl."""
    parser.add_argument("--quantization", default="auto",
                        choices=["auto", "none", "gguf", "gguf-a8", "stored", "int8", "int4", "fp8", "w8a8"],
                        help="weights: auto (default) keeps a GGUF file's blocks on CPU (exact) and loads "
                             "anything else as stored; none loads as stored (GGUF blocks dequantized to "
                             "--dtype); gguf keeps a GGUF file's Q8_0/Q4_x/Q5_x/K-quant blocks quantized; gguf-a8 "
                             "also the head, and rounds activations to int8 blocks of 32 as llama.cpp does "
                             "(faster, perplexity +0.07%%, changes the numbers); int8/int4/fp8 "
                             "quantize the linear weights at load time; w8a8 quantizes the linear weights "
                             "and the head to int8 and the activations to int8 per token on the fly "
                             "(fastest on CPU; changes the numbers)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="auto: the model's dtype; int8/fp8: K/V with a float32 scale per token and KV head")


DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DTYPE_HELP = "auto: float32 on CPU, the checkpoint's own dtype on a GPU"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    _add_quantization_args(parser)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--attention", "--attention-backend", dest="attention", default=None,
                        choices=["reference", "native", "pallas", "xla", "jnp", "pallas_interpret"],
                        help="the attention implementation: native (CPU's C++ kernel, the CPU default), pallas "
                        "(the GPU default), reference (plain jnp); xla / jnp / pallas_interpret: older names "
                        "(--attention-backend), accepted for one release")
    parallel = parser.add_argument_group("multi-device (README.md, Multi-device)")
    parallel.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                          help="shard the model over N devices")
    parallel.add_argument("--data-parallel-size", type=int, default=None, metavar="M",
                          help="M engine replicas, each on its own N devices")
    parallel.add_argument("--context-parallel-size", type=int, default=None, metavar="C",
                          help="split each sequence's KV cache over C devices (ring attention)")
    parallel.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                          help="multi-host: process 0's address (or JAX_COORDINATOR_ADDRESS)")
    parallel.add_argument("--num-processes", type=int, default=None, help="multi-host: number of hosts "
                          "(or JAX_NUM_PROCESSES)")
    parallel.add_argument("--process-id", type=int, default=None, help="multi-host: this host's index "
                          "(or JAX_PROCESS_ID)")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Batch limits and speculative decoding, shared by bench and serve."""
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--speculative-method", choices=["ngram", "draft_model", "eagle"], default=None,
                        help="speculative decoding (draft_model: the target itself as its draft; "
                             "eagle: the draft head shipped for the default model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare step N + 1 on the host while step N runs (default: on with a GPU)")
    lora = parser.add_argument_group("LoRA adapters (README.md, LoRA adapters)")
    lora.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters (implied by "
                      "--lora-modules)")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="distinct adapters in one step (default: the number of --lora-modules, else 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served")


def _engine_options(args) -> dict:
    """LLM(...) keywords of _add_model_args' and _add_engine_args' engine options."""
    options = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, attention=args.attention,
                   async_scheduling=args.async_scheduling)
    if args.speculative_method:
        options["speculative"] = {"method": args.speculative_method,
                                  "num_speculative_tokens": args.num_speculative_tokens}
    modules = getattr(args, "lora_modules", None) or []
    if args.enable_lora or modules:
        # Every listed adapter gets a slot by default, so that requests for
        # different adapters share steps instead of waiting for a slot.
        options.update(enable_lora=True, max_loras=args.max_loras or max(1, len(modules)),
                       max_lora_rank=args.max_lora_rank)
    return options


def parse_lora_modules(items) -> dict:
    """--lora-modules NAME=PATH ... -> {NAME: LoRARequest}, lora_int_id 1, 2, ...
    in the order given; ValueError for a malformed or repeated NAME."""
    from jaxinfer.lora.request import LoRARequest

    modules = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    return modules


def _parallel_options(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                context_parallel_size=args.context_parallel_size)


def _quantization_options(args) -> dict:
    """LLM(...) keywords: quantization for load(), kv_cache_dtype for the engine."""
    return dict(quantization=_quantization(args), kv_cache_dtype=args.kv_cache_dtype)


def _quantization(args) -> str | None:
    return None if args.quantization == "none" else args.quantization


def _generate(args) -> int:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.sampling_params import InvalidSamplingParameter

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
    except InvalidSamplingParameter as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    # One batch of these prompts is all this engine runs: its programs are the
    # buckets of that many sequences, compiled (or loaded) before it starts, so
    # that no compilation shares the cores with the generation it times.
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, attention=args.attention,
              max_num_seqs=len(args.prompts), **_quantization_options(args), **_parallel_options(args))
    llm.wait_compiled()
    loaded = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        completion = output.outputs[0]
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(completion.text if args.chat else prompt + completion.text)
    print(f"[load + compile {loaded - start:.1f}s, maximum context {llm.stats()['max_context_len']} tokens, "
          f"{_speed(outputs)}]", file=sys.stderr)
    return 0


def _speed(outputs) -> str:
    """Time to the first token and the decode rate after it: the engine's
    speed, which the first token's prefill would hide in an average over all."""
    first = min(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.last_token_time for o in outputs)
    decoded = sum(len(o.outputs[0].token_ids) for o in outputs) - len(outputs)  # tokens after each first
    rate = f"{decoded / (last - first):.1f} tok/s" if decoded > 0 and last > first else "n/a"
    return (f"first token {outputs[0].metrics.time_to_first_token * 1e3:.0f} ms, then {decoded} tokens "
            f"at {rate}")


def _bench(args) -> int:
    from jaxinfer import LLM
    from jaxinfer.benchmark import print_and_save, run_latency, run_throughput, synthetic_requests

    options = _engine_options(args)
    if args.kind == "throughput":
        options["scheduling_policy"] = args.scheduling_policy
        options["enable_prefix_caching"] = not args.no_prefix_caching
    llm = LLM(args.model, dtype=args.dtype, **options, **_quantization_options(args), **_parallel_options(args))
    if args.kind == "throughput":
        requests = synthetic_requests(llm.model.config.vocab_size, args.num_prompts, args.input_len, args.output_len,
                                      args.range_ratio, args.prefix_len, args.seed)
        result = run_throughput(llm, requests)
    else:
        result = run_latency(llm, args.batch_size, args.input_len, args.output_len)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    print_and_save(f"bench {args.kind} ({llm.model.source})", {"config": config, **result}, args.json)
    return 0


def _serve(args) -> int:
    from jaxinfer.loading.checkpoint import DEFAULT_MODEL_FILE
    from jaxinfer.server.launch import serve

    options = dict(_engine_options(args), enable_prefix_caching=not args.no_prefix_caching,
                   scheduling_policy="continuous" if args.scheduling_policy == "fcfs" else args.scheduling_policy)
    lora_modules = parse_lora_modules(args.lora_modules)  # before the model loads: a typo fails at once
    if args.num_kv_blocks is not None:
        options["num_kv_blocks"] = args.num_kv_blocks

    def load():
        from jaxinfer import LLM

        return LLM(args.model, dtype=args.dtype, **options, **_quantization_options(args), **_parallel_options(args))

    chat_template = _read_chat_template(args.chat_template)
    name = args.served_model_name or args.model or DEFAULT_MODEL_FILE.split(".")[0]
    lockstep = None
    from jax._src import distributed

    if distributed.global_state.client is not None and distributed.global_state.num_processes > 1:
        from jaxinfer.parallel.options_check import check_same_options
        from jaxinfer.server.lockstep import Leader, serve_follower

        client, process_id = distributed.global_state.client, distributed.global_state.process_id
        num_processes = distributed.global_state.num_processes
        check_same_options(client, process_id, num_processes, serve_description(args))
        if process_id != 0:  # /health only; the engine loop follows host 0's requests
            serve_follower(load, client=client, process_id=process_id, host=args.host, port=args.port,
                           log_level=args.log_level)
            return 0
        lockstep = Leader(client, num_processes, args.lost_host_timeout)
    serve(load, model_name=name, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
          shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, lora_modules=lora_modules, lockstep=lockstep,
          chat_template=chat_template, tool_call_parser=args.tool_call_parser,
          allowed_origins=_origins(args.allowed_origins), allowed_methods=_origins(args.allowed_methods) or ["*"],
          allowed_headers=_origins(args.allowed_headers) or ["*"], allow_credentials=args.allow_credentials)
    return 0


def _read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself (vLLM's rule: a value
    with a brace or newline in it is a template)."""
    from pathlib import Path

    if value is None:
        return None
    if any(c in value for c in "{}\n"):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--chat-template: cannot read {value}: {e}") from None


def _origins(values) -> list[str] | None:
    """--allowed-origins and friends: vLLM's JSON list ('["*"]'), or plain values."""
    import json

    if not values:
        return None
    out = []
    for value in values:
        if value.strip().startswith("["):
            try:
                out += [str(v) for v in json.loads(value)]
            except ValueError as e:
                raise ValueError(f"not a JSON list: {value!r} ({e})") from None
        else:
            out += [v for v in value.split(",") if v]
    return out


# serve's options that are each host's own, or host 0's front end's alone: the
# other hosts may differ in these; any other option must match host 0's.
PER_HOST_SERVE_OPTIONS = {"func", "command", "host", "port", "process_id", "num_processes", "coordinator_address",
                          "api_key", "log_level", "served_model_name", "max_queue", "chat_template",
                          "tool_call_parser", "enable_auto_tool_choice", "allowed_origins", "allowed_methods",
                          "allowed_headers", "allow_credentials", "shutdown_timeout", "lost_host_timeout"}


def serve_description(args) -> dict:
    """What a lockstep host's engine depends on: serve's options but the per-host
    ones, the model's files, and the versions of jaxinfer and JAX."""
    from importlib.metadata import PackageNotFoundError, version

    import jax

    from jaxinfer.parallel.options_check import model_identity

    description = {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items())
                   if k not in PER_HOST_SERVE_OPTIONS}
    description["model files"] = model_identity(args.model)
    try:
        description["jaxinfer version"] = version("jaxinfer")
    except PackageNotFoundError:
        description["jaxinfer version"] = "unknown"
    description["jax version"] = jax.__version__
    return description


def _bench_serve(args) -> int:
    from jaxinfer.server.bench_serve import main as bench_serve_main

    return bench_serve_main(args)


def _convert(args) -> int:
    from jaxinfer.convert import convert

    try:
        convert(None if args.src == "default" else args.src, args.out_dir, quantize=args.quantize, group_size=args.group_size,
                calibration=args.calibration, dtype=args.dtype, include_head=args.include_head,
                overwrite=args.overwrite)
    except OSError as e:  # an existing or unwritable OUT_DIR
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _ppl(args) -> int:
    from jaxinfer import load
    from jaxinfer.perplexity import perplexity_of_text

    try:
        text = open(args.file, encoding="utf-8").read()
    except OSError as e:
        print(f"error: cannot read {args.file}: {e}", file=sys.stderr)
        return 1
    model = load(args.model, dtype=args.dtype, quantization=_quantization(args))
    start = time.perf_counter()
    result = perplexity_of_text(model, text, context_len=args.context_len, stride=args.stride,
                                kv_cache_dtype=args.kv_cache_dtype, progress=True)
    elapsed = time.perf_counter() - start
    print(f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.4f} nats) over "
          f"{result.num_tokens_scored} scored tokens of {result.num_tokens}, {result.num_windows} windows")
    print(f"model {model.source}, dtype {model.dtype}, weights {model.quantization or 'as stored'}, "
          f"kv cache {result.kv_cache_dtype}, context {result.context_len}, stride {result.stride} "
          f"[{elapsed:.1f}s]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA inference for Llama-family models")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts (or chat with --chat)")
    _add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default, reproducible)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the model's chat template")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=_generate)
    bench = commands.add_parser("bench", help="synthetic throughput / latency benchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    throughput = kinds.add_parser("throughput", help="offline throughput of many requests")
    latency = kinds.add_parser("latency", help="prefill and decode time of one batch")
    for p in (throughput, latency):
        _add_model_args(p)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=64)
        _add_engine_args(p)
        p.add_argument("--json", default=None, metavar="PATH")
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--range-ratio", type=float, default=0.0)
    throughput.add_argument("--prefix-len", type=int, default=0)
    throughput.add_argument("--scheduling-policy", choices=["continuous", "static"], default="continuous")
    throughput.add_argument("--no-prefix-caching", action="store_true", help="baseline for --prefix-len runs")
    throughput.add_argument("--seed", type=int, default=0)
    latency.add_argument("--batch-size", type=int, default=8)
    bench.set_defaults(func=_bench)
    bserve = kinds.add_parser("serve", help="load a running `jaxinfer serve` with streamed requests")
    bserve.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    bserve.add_argument("--host", default="127.0.0.1")
    bserve.add_argument("--port", type=int, default=8000)
    bserve.add_argument("--model", default=None, help="served model name (default: the server's first)")
    bserve.add_argument("--api-key", default=None)
    bserve.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    bserve.add_argument("--num-prompts", type=int, default=64)
    bserve.add_argument("--input-len", type=int, default=128)
    bserve.add_argument("--output-len", type=int, default=64)
    bserve.add_argument("--range-ratio", type=float, default=0.0)
    bserve.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each group's prefix")
    bserve.add_argument("--num-prefix-groups", type=int, default=4)
    bserve.add_argument("--vocab-size", type=int, default=32000, help="random token ids are drawn below this")
    bserve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    bserve.add_argument("--max-concurrency", type=int, default=None)
    bserve.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    bserve.add_argument("--seed", type=int, default=0)
    bserve.add_argument("--json", default=None, metavar="PATH")
    bserve.set_defaults(func=_bench_serve)
    srv = commands.add_parser("serve", help="OpenAI-compatible HTTP server (README.md, Serve)")
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="default loopback; another host wants --api-key")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (not on /health, /load, /metrics, /version)")
    srv.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    srv.add_argument("--max-queue", type=int, default=1024, help="most requests in flight; more are answered 429")
    _add_engine_args(srv)
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="PEFT LoRA adapter directories, each served as the model NAME (vLLM's flag)")
    srv.add_argument("--num-kv-blocks", type=int, default=None)
    srv.add_argument("--no-prefix-caching", action="store_true")
    srv.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                     help="fcfs: continuous batching in arrival order; priority: requests' `priority` "
                          "(lower first), then arrival (vLLM's)")
    srv.add_argument("--chat-template", default=None,
                     help="a Jinja chat template (a file, or the template itself) replacing the model's own")
    srv.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                     help="how tool calls are read from the output for tool_choice 'auto' (default: detected "
                          "from the chat template)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines: tool_choice 'auto' is on whenever a parser is known")
    srv.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                     help="CORS: origins browsers may call from ('*', or vLLM's JSON list); default no CORS")
    srv.add_argument("--allowed-methods", nargs="+", default=None, help="CORS methods (default '*')")
    srv.add_argument("--allowed-headers", nargs="+", default=None, help="CORS headers (default '*')")
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    srv.add_argument("--lost-host-timeout", type=float, default=5.0, metavar="SECONDS",
                     help="multi-host: host 0 fails its requests (503) and /health when another host's heartbeat "
                          "stops for this long")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are aborted")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.set_defaults(func=_serve)
    conv = commands.add_parser("convert", help="write a (quantized) jaxinfer checkpoint that loads straight to the device")
    conv.add_argument("src", metavar="SRC", help="HF directory, .gguf file, jaxinfer checkpoint, or 'default' (the embedded model)")
    conv.add_argument("out_dir", metavar="OUT_DIR")
    conv.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "int4-awq", "fp8"])
    conv.add_argument("--group-size", type=int, default=None,
                      help="input rows per scale (int8: default per channel; int4: default 128 or what divides)")
    conv.add_argument("--calibration", default=None, metavar="FILE", help="plain text for int4-awq")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="dtype of the weights left unquantized")
    conv.add_argument("--include-head", action="store_true", help="quantize the output projection too")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    conv.set_defaults(func=_convert)
    ppl = commands.add_parser("ppl", help="perplexity of a text file (sliding window through the paged KV cache)")
    ppl.add_argument("--model", default=None, help="HF directory, .gguf file or jaxinfer checkpoint "
                                                   "(default: embedded SmolLM2-135M-Instruct)")
    ppl.add_argument("file", metavar="FILE")
    ppl.add_argument("--context-len", type=int, default=None, help="tokens per window (default min(model max, 1024))")
    ppl.add_argument("--stride", type=int, default=None, help="window advance (default context_len // 2)")
    _add_quantization_args(ppl)
    ppl.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    ppl.set_defaults(func=_ppl)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from jaxinfer.parallel.distributed import initialize

        # Before anything touches JAX's devices (flags, else JAX_COORDINATOR_ADDRESS etc.).
        initialize(getattr(args, "coordinator_address", None), getattr(args, "num_processes", None),
                   getattr(args, "process_id", None))
        return args.func(args)
    except (ValueError, RuntimeError) as e:  # bad model path, bad prompt: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
