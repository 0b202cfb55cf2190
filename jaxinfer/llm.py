"""`LLM`: the offline entry point, with vLLM's names (generate, chat, stream)."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from jaxinfer.backends import choose_backend
from jaxinfer.engine.config import EngineConfig, ModelShape, fit_default_context
from jaxinfer.engine.early_compile import EarlyCompile
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.errors import RequestError
from jaxinfer.loading.model import load
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams


class LLM:
    """LLM(model=None, *, dtype="auto", quantization="auto", progress=True, **engine_options).

    model: None (the embedded SmolLM2-135M-Instruct), a HF directory or a .gguf file.
    dtype: "auto" (float32 on CPU; on a GPU the checkpoint's own dtype, as vLLM), "float32",
    "bfloat16" or "float16"; see `load`.
    quantization: "auto" (the default: a GGUF file's own blocks on CPU, which are
    exact; otherwise as stored), None (float weights), "gguf" (keep a GGUF file's
    Q8_0 / Q4_0 / Q4_1 weights quantized), "gguf-a8" (the GGUF's blocks, head included, times
    activations rounded to int8 blocks of 32, as llama.cpp runs a GGUF: fastest on CPU,
    perplexity +0.07%, opt-in because it changes the numbers), "int8" | "int4" | "fp8" (quantize
    the linear weights at load time), or "w8a8" (int8 weights and head, int8 activations per row,
    changes the numbers more); see `load`.
    allow_tf32: let a float32 model's matmuls run as TF32 on a GPU (10-bit mantissas, faster);
    by default float32 means float32 on every platform (backends/, choose_backend).
    engine_options: max_model_len, block_size, num_kv_blocks, kv_cache_memory_fraction,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, scheduling_policy,
    attention ("native": the CPU's C++ kernel, built on first use, the CPU default; "pallas": the Pallas
    kernels, the GPU default, in interpret mode elsewhere; "reference": plain jnp; backends/attention.py.
    The older option attention_backend and its values "xla", "jnp", "pallas_interpret" are accepted),
    kv_cache_dtype ("auto": the model's dtype; "int8" or "fp8": quantized K/V with a float32 scale
    per token and KV head, about 4x (float32 models) or 2x (bfloat16) the blocks for the same memory),
    speculative ({"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}; see engine/spec/config.py),
    async_scheduling (None: on with a GPU, off on CPU; prepare step N + 1 on the host while step N runs,
    engine/engine.py),
    warmup ("background", the default: serve once the smallest shape buckets are compiled and compile
    the others on a thread, see wait_compiled; "all": every bucket before serving; "on_demand": the
    smallest first, each other bucket when a step first needs it; programs stored by an earlier
    start load when a step first needs them; JAXINFER_WARMUP sets the default; the older
    background_compile=True/False is accepted for one release),
    enable_lora / max_loras / max_lora_rank (serve PEFT LoRA adapters: up to max_loras distinct adapters in
    one step, ranks up to max_lora_rank; requests pick theirs with `lora_request=`, see lora/).

    tensor_parallel_size N: shard the model over N devices (Megatron-style, parallel/sharding.py);
    data_parallel_size M: M engine replicas on disjoint groups of N devices, requests spread over
    them by outstanding work (engine/data_parallel.py). Both default to None: one device, no
    mesh at all; giving either (even 1) runs the sharded code path on a mesh.
    context_parallel_size C (1, 2, 4, 8 or 16): split each sequence's KV cache over C devices
    (times N for tensor parallelism), attention as ring attention (models/ring_attention.py);
    the longest servable context grows C times; num_kv_blocks then counts the blocks of all C.
    """

    def __init__(
        self, model=None, *, dtype: str = "auto", quantization: str | None = "auto", progress: bool = True,
        allow_tf32: bool = False, tensor_parallel_size: int | None = None, data_parallel_size: int | None = None,
        context_parallel_size: int | None = None, **engine_options,
    ):
        meshes = [None]
        if tensor_parallel_size is not None or data_parallel_size is not None or context_parallel_size is not None:
            from jaxinfer.parallel.distributed import check_data_parallel_hosts
            from jaxinfer.parallel.mesh import replica_meshes

            data_parallel_size = data_parallel_size or 1
            check_data_parallel_hosts(data_parallel_size)
            meshes = replica_meshes(tensor_parallel_size or 1, data_parallel_size,
                                    context_parallel_size=context_parallel_size or 1)
        backend = choose_backend(meshes[0], allow_tf32)
        configs, early = [], []

        def engine_config(model_config, dtype, mesh, backend, quantization):
            # Decided once the checkpoint's config is read, before its weights
            # are: bad options, and the context the KV pool holds, cost no load.
            # max_model_len defaults to the model's whole context (vLLM's rule),
            # or the longest the KV pool holds (fit_default_context).
            options = dict(engine_options)
            default_len = options.get("max_model_len") is None
            if default_len:
                options["max_model_len"] = model_config.max_position_embeddings
            try:
                config = EngineConfig(**options)
            except TypeError:
                known = set(EngineConfig.__dataclass_fields__)
                unknown = sorted(set(options) - known)
                raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}") from None
            config = config.for_backend(backend)
            shape = ModelShape(model_config, dtype, mesh, backend)
            if default_len:
                config = fit_default_context(shape, config)
            configs.append(config)
            early.append(EarlyCompile.start(shape, config, quantization))

        self.model = load(model, dtype=dtype, progress=progress, quantization=quantization, mesh=meshes[0],
                          backend=backend, before_weights=engine_config)
        self.tokenizer = self.model.tokenizer
        config = configs[0]
        self.max_model_len = config.max_model_len
        if len(meshes) == 1:
            self.engine = LLMEngine(self.model, config, progress=progress, early=early[0])
        else:
            from jaxinfer.engine.data_parallel import DataParallelEngine

            models = [self.model] + [self.model.on_mesh(mesh) for mesh in meshes[1:]]
            self.engine = DataParallelEngine([LLMEngine(m, config, progress=progress) for m in models])
        self._request_ids = itertools.count()

    # -- prompts -----------------------------------------------------------
    def _normalize_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        """str | list[str] | list[int] | list[list[int]] -> [(text, token_ids)]."""
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of strings, or a list of token-id lists")
        normalized = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
                normalized.append((prompt, self.tokenizer.encode(prompt)))
            elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
                normalized.append((None, list(prompt)))
            else:
                raise ValueError(f"prompt {i} is neither a string nor a list of token ids")
        return normalized

    # -- generation ----------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """lora_request: None (the base model), one LoRARequest for every
        prompt, or a list with one (or None) per prompt."""
        return self._generate(self._normalize_prompts(prompts), sampling_params, use_tqdm, lora_request)

    def _generate(self, prompts, sampling_params, use_tqdm, lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        lora_requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(lora_requests) != len(prompts):
            raise ValueError(f"got {len(lora_requests)} lora_requests for {len(prompts)} prompts")
        # Check every prompt before submitting any, so a bad one fails the
        # call without leaving the others half-run in the engine.
        for i, ((_, token_ids), params) in enumerate(zip(prompts, sampling_params)):
            self.engine.validate(f"prompt {i}", token_ids, params)
        for i, lora in enumerate(lora_requests):  # reads and checks each adapter once, before any runs
            self.engine.validate_lora(f"prompt {i}", lora)
        for i, params in enumerate(sampling_params):  # compiles grammars now (cached), failing before any runs
            self.engine.check_structured_outputs(f"prompt {i}", params)
        order = []
        for (text, token_ids), params, lora in zip(prompts, sampling_params, lora_requests):
            request_id = f"generate-{next(self._request_ids)}"
            self.engine.add_request(request_id, token_ids, params, prompt=text, lora_request=lora)
            order.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", unit="prompt", disable=not use_tqdm) as bar:
            while len(finished) < len(order):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update()
        return [finished[r] for r in order]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them;
        lora_request as for generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # The template writes BOS itself where the model wants one.
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        prompts = [(text, self.tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        return self._generate(prompts, sampling_params, use_tqdm, lora_request)

    def stream(self, prompt, sampling_params=None):
        """Yield text deltas of one prompt's first completion as tokens arrive.

        Other requests already in the engine keep running alongside it."""
        ((text, token_ids),) = self._normalize_prompts([prompt] if isinstance(prompt, str) else prompt)
        request_id = f"stream-{next(self._request_ids)}"
        params = sampling_params or SamplingParams()
        self.engine.add_request(request_id, token_ids, params, prompt=text)
        # Hold back a possible stop-string prefix until it is known not to be one.
        hold = max((len(s) for s in params.stop or ()), default=1) - 1
        emitted = 0
        while True:
            for output in self.engine.step():
                if output.request_id != request_id:
                    continue
                if output.error:
                    raise RequestError(output.error)
                completion = output.outputs[0]
                final = len(completion.text) if output.finished else len(completion.text) - hold
                if final > emitted:
                    yield completion.text[emitted:final]
                    emitted = final
                if output.finished:
                    return

    def stats(self) -> dict:
        return self.engine.stats()

    def wait_compiled(self) -> None:
        """Block until the engine's background warm-up (warmup="background")
        has compiled every program not stored by an earlier start: until
        then a step may run in a larger bucket than its own, and compilation
        shares the CPU. Stored programs load when a step first needs them.
        With the other warm-ups there is nothing to wait for."""
        self.engine.wait_compiled()

