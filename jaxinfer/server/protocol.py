"""Request bodies of the OpenAI API (plus vLLM's sampling extras) and their
mapping onto SamplingParams.

Pydantic checks shapes and types (strict: "5" is not an int, 1 is not a
bool; unknown fields are refused, so a misspelt option fails loudly rather
than being ignored); SamplingParams checks ranges, and its messages start
with the field's name, which becomes the error's `param`. OpenAI fields that
the engine cannot honour are accepted only at their neutral value.

Where OpenAI's API is silent we follow vLLM: completions default to
max_tokens=16, chat to the rest of the context; temperature defaults to 1.0.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.sampling_params import (
    MAX_LOGPROBS,
    InvalidSamplingParameter,
    SamplingParams,
    StructuredOutputsParams,
)
from jaxinfer.server.errors import APIError

# The most completions one request may ask for: each is a sequence in the
# engine, so n=10**6 would be a denial of service, not a request.
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema field", "response_format")
        # OpenAI: a json_schema without a schema allows any JSON value; "any object" is our reading.
        return StructuredOutputsParams(json=self.json_schema.schema_ or {"type": "object"})


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, as OpenAI's clients send it; not used
    logit_bias: dict[str, float] | None = None  # only empty: the sampler has no per-token bias
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # only 0: the engine has no minimum-length rule (EOS is never masked)
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs
    # ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}); not both.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        from_format = self.response_format.structured_outputs() if self.response_format is not None else None
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
        return StructuredOutputsParams.from_dict(self.structured_outputs)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.min_tokens:
            raise APIError(400, "min_tokens is not supported (only 0)", "min_tokens")
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                 if getattr(self, k) is not None}
        try:
            structured = self.structured_spec()
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop, structured_outputs=structured,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, **given,
            )
        except InvalidSamplingParameter as e:
            raise APIError(400, str(e), str(e).split(" ", 1)[0].rstrip(":")) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # only None: no fill-in-the-middle
    best_of: int | None = None  # only None or n: every completion is returned

    def check_unsupported(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.echo and self.logprobs is not None:
            # OpenAI returns the prompt's logprobs then; the engine does not compute them.
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # only empty: no tool calling
    tool_choice: Literal["none"] | None = None
    add_generation_prompt: bool = True  # vLLM's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template

    def check_unsupported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): text or chat messages -> token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
