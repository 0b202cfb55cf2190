"""Request bodies of the OpenAI API (plus vLLM's sampling extras) and their
mapping onto SamplingParams.

Pydantic checks shapes and types (strict: "5" is not an int, 1 is not a
bool; unknown fields are refused, so a misspelt option fails loudly rather
than being ignored); SamplingParams checks ranges, and its messages start
with the field's name, which becomes the error's `param`. OpenAI fields that
the engine cannot honour are accepted only at their neutral value.

Where OpenAI's API is silent we follow vLLM: completions default to
max_tokens=16, chat to the rest of the context; temperature, top_p, top_k,
min_p and repetition_penalty default to the model's generation_config.json
where it sets them (server/generation_defaults.py), else to vLLM's defaults.

vLLM's extra fields are accepted under vLLM's names: its sampling rules
(min_tokens, logit_bias, allowed_token_ids, bad_words,
include_stop_str_in_output, prompt_logprobs, priority), its structured
outputs and their legacy guided_json / guided_regex / guided_choice /
guided_grammar spellings, and stream_options.continuous_usage_stats.
"""

from __future__ import annotations

import json
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
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


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
    logit_bias: dict[str, float] | None = None  # OpenAI's keys: token ids as strings
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    priority: int = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs
    # ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}), or
    # vLLM's older guided_* fields; one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        guided = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{kind}") is not None}
        sources = [name for name, given in (("response_format", self.response_format is not None and
                                             self.response_format.type != "text"),
                                            ("structured_outputs", self.structured_outputs is not None),
                                            ("guided_*", bool(guided))) if given]
        if len(sources) > 1:
            raise APIError(400, f"give one of response_format, structured_outputs and guided_*; got "
                                f"{' and '.join(sources)}", "structured_outputs")
        if self.response_format is not None:
            return self.response_format.structured_outputs()
        if guided:
            return StructuredOutputsParams(**guided)  # more than one kind: its own error names them
        if self.structured_outputs is not None:
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict | None = None,
                        structured: StructuredOutputsParams | None = None, **overrides) -> SamplingParams:
        """defaults: the model's generation_config sampling values, used where
        the request sets none. structured: replaces the request's own
        structured output (tool_choice's constraint)."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        given = dict(defaults or {})
        given.update({k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                      if getattr(self, k) is not None})
        try:
            structured = structured or self.structured_spec()
            fields = dict(
                n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop, structured_outputs=structured,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, min_tokens=self.min_tokens,
                logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                include_stop_str_in_output=self.include_stop_str_in_output, **given,
            )
            fields.update(overrides)
            return SamplingParams(**fields)
        except InvalidSamplingParameter as e:
            raise APIError(400, str(e), str(e).split(" ", 1)[0].rstrip(":").split(".")[0]) from None

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                           "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and (self.stream_options.include_usage or
                                                    self.stream_options.continuous_usage_stats)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # only None: no fill-in-the-middle
    best_of: int | None = None  # only None or n: every completion is returned

    def check_unsupported(self) -> None:
        self.check_common()
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token to compute: prompt_logprobs, or
        echo with logprobs (OpenAI returns the echoed prompt's logprobs)."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

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


class FunctionCall(_Strict):
    name: str
    arguments: str  # OpenAI's: the arguments as a JSON text


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None  # what the openai client echoes back from a response; not rendered

    @property
    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return content or ""

    def as_template_message(self) -> dict:
        """The message as chat templates read it (Hugging Face's convention):
        tool call arguments as objects, so a template can `tojson` them."""
        message = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text as it came


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; required / named calls always follow the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template

    def check_unsupported(self) -> None:
        self.check_common()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               "top_logprobs")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise APIError(400, f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                                    f"not among the tools: {names}", "tool_choice")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

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
    tools: list[Tool] | None = None  # rendered by the chat template with messages, as chat requests do


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides
