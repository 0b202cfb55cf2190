"""`LLM`: the offline entry point, with vLLM's names (generate, chat)."""

from __future__ import annotations

import itertools
import time

from tqdm.auto import tqdm

from jaxinfer.model import load
from jaxinfer.outputs import RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.simple_generator import SimpleGenerator

# Cap for the default max_model_len: a model's advertised context (often 32k+)
# would size caches far beyond what a laptop run needs.
DEFAULT_MAX_MODEL_LEN = 8192


class LLM:
    """LLM(model=None, dtype="float32", max_model_len=None, progress=True).

    model: None (the embedded SmolLM2-135M-Instruct), a HF directory or a .gguf file.
    """

    def __init__(self, model=None, *, dtype: str = "float32", max_model_len: int | None = None, progress=True):
        self.model = load(model, dtype=dtype, progress=progress)
        self.tokenizer = self.model.tokenizer
        limit = self.model.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        elif not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        self.max_model_len = max_model_len
        self._generator = SimpleGenerator(self.model, max_model_len)
        self._request_counter = itertools.count()

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

    def _check_prompt(self, i: int, token_ids: list[int]) -> None:
        vocab = self.model.config.vocab_size
        if not token_ids:
            raise ValueError(f"prompt {i} is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(token_ids)} tokens, which leaves no room to generate "
                f"within max_model_len={self.max_model_len}"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    # -- generation ----------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        return self._generate(self._normalize_prompts(prompts), sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        for i, (_, token_ids) in enumerate(prompts):
            self._check_prompt(i, token_ids)
        results = []
        for (text, token_ids), params in tqdm(
            list(zip(prompts, sampling_params)), desc="generating", unit="prompt", disable=not use_tqdm
        ):
            metrics = RequestMetrics(arrival_time=time.perf_counter())
            metrics.first_scheduled_time = metrics.arrival_time
            outputs = [self._generator.generate(token_ids, params, i, metrics) for i in range(params.n)]
            metrics.finished_time = metrics.last_token_time = time.perf_counter()
            results.append(
                RequestOutput(
                    request_id=str(next(self._request_counter)),
                    prompt=text,
                    prompt_token_ids=token_ids,
                    outputs=outputs,
                    finished=True,
                    metrics=metrics,
                )
            )
        return results

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # The template writes BOS itself where the model wants one.
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        prompts = [(text, self.tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        return self._generate(prompts, sampling_params, use_tqdm)

    def warmup(self, prompt_lengths, max_tokens: int, progress: bool = True) -> None:
        """Compile the programs these requests need, with a progress bar."""
        steps = [step for n in sorted(set(prompt_lengths)) for step in self._generator.warmup(n, max_tokens)]
        for step in tqdm(steps, desc="compiling", unit="program", disable=not progress, leave=False):
            step()
