"""What the routes share: the LLM once loaded, its engine thread, the served
models (the base model and its LoRA adapters), metrics and settings.

LoRA (vLLM's way): each adapter given at start (`jaxinfer serve
--lora-modules name=path`) or loaded at run time (load_lora_adapter, with
enable_lora) is served as a model of its own name; a request's `model` picks
the base model or an adapter. The adapters given at start are read and
checked when the model has loaded, so a bad one stops the server from
becoming ready (and /health says why) rather than failing its first request.
"""

from __future__ import annotations

import logging
import threading

from jaxinfer.server import errors
from jaxinfer.server.engine_thread import EngineThread
from jaxinfer.server.errors import APIError
from jaxinfer.server.generation_defaults import generation_defaults
from jaxinfer.server.host_work import HostWork
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.tool_parsers import PARSERS, detect_parser
from jaxinfer.tokenizer import TokenizerError

logger = logging.getLogger("jaxinfer.server")

# A prompt's characters may exceed max_model_len * (the longest token's characters)
# by this factor before it is refused untokenized: tokenizers that drop or merge
# characters (sentencepiece's whitespace runs) make fewer tokens than that bound says.
PROMPT_CHARS_SLACK = 4


class ServerState:
    """What the routes share: the LLM once loaded, its engine thread, metrics, settings."""

    def __init__(self, model_name: str, api_key: str | None, max_queue: int | None, lora_modules=None,
                 chat_template: str | None = None, tool_call_parser: str | None = None):
        self.model_name = model_name
        self.lora_modules = dict(lora_modules or {})  # served name -> LoRARequest
        if model_name in self.lora_modules:
            raise ValueError(f"LoRA module name {model_name!r} is the base model's served name; choose another")
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}, got {tool_call_parser!r}")
        self.api_key = api_key
        self.max_queue = max_queue
        self.chat_template = chat_template  # replaces the model's own (--chat-template)
        self.tool_call_parser = tool_call_parser
        self.metrics = ServerMetrics(model_name)
        self.work = HostWork()
        self.llm = None
        self.engine: EngineThread | None = None
        self.load_error: str | None = None
        self.sampling_defaults: dict = {}
        self.max_prompt_chars: int | None = None
        self.lockstep = None  # host 0 of a multi-host run: its lockstep.Leader (set before start)

    def attach(self, llm) -> None:
        """Serve this LLM: start the engine thread over the engine it holds (one or data-parallel)."""
        for name, lora in self.lora_modules.items():  # raises RequestError for an adapter it cannot serve
            llm.engine.validate_lora(f"LoRA module {name!r}", lora)
        self.sampling_defaults = generation_defaults(llm.model.source)
        if llm.tokenizer is not None:
            self.max_prompt_chars = llm.max_model_len * llm.tokenizer.max_token_chars * PROMPT_CHARS_SLACK
            if self.tool_call_parser is None:
                self.tool_call_parser = detect_parser(self.chat_template or llm.tokenizer.chat_template)
        engine = EngineThread(llm.engine, self.metrics, self.max_queue, lockstep=self.lockstep)
        engine.start()
        self.llm, self.engine = llm, engine
        logger.info("serving %s (max_model_len %d, tool-call parser %s)", self.model_name, llm.max_model_len,
                    self.tool_call_parser)

    def start(self, llm=None, load=None) -> None:
        """Serve `llm`, or the LLM that `load()` returns, built on a background
        thread so that /health can answer 503 meanwhile (and say why, if it fails)."""
        if llm is not None:
            self.attach(llm)
        elif load is not None:
            def load_then_attach():
                try:
                    self.attach(load())
                except Exception as e:  # the server stays up and says why on /health
                    logger.exception("loading the model failed")
                    self.load_error = f"loading the model failed: {type(e).__name__}: {e}"

            threading.Thread(target=load_then_attach, name="jaxinfer-load", daemon=True).start()

    def stop(self) -> None:
        if self.engine is not None:
            aborted = self.engine.stop()  # none are left after a graceful shutdown
            if aborted:
                logger.warning("shutdown: aborted %d unfinished request(s)", aborted)
        self.work.shutdown()

    def ready(self) -> EngineThread:
        if self.lockstep is not None and self.lockstep.lost is not None:
            raise APIError(503, self.lockstep.lost, code="host_lost")
        if self.engine is None:
            raise APIError(503, self.load_error or "the model is still loading", code="not_ready")
        if not self.engine.alive:
            raise APIError(503, self.engine.fatal_error or "the engine has stopped", code="engine_dead")
        return self.engine

    def check_model(self, model: str | None):
        """The LoRARequest the `model` field names, or None for the base model
        (also when the field is absent); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(f"'{m}'" for m in [self.model_name, *self.lora_modules])
        raise APIError(404, f"the model '{errors.clip(model, 100)}' does not exist; this server serves {served}",
                       "model", "model_not_found")

    @property
    def tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send prompts as token ids", "prompt")
        return self.llm.tokenizer

    def check_prompt_chars(self, name: str, num_chars: int) -> None:
        """Refuse, untokenized, a text too long for any tokenization of it to fit the context."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(400, f"{name} has {num_chars} characters, more than max_model_len="
                                f"{self.llm.max_model_len} tokens can hold (refused without tokenizing)", name)

    async def encode(self, name: str, text: str, add_special_tokens: bool) -> list[int]:
        self.check_prompt_chars(name, len(text))
        return await self.work.encode(self.tokenizer, text, add_special_tokens)

    async def chat_text(self, messages, add_generation_prompt: bool, template_kwargs, tools=None) -> str:
        self.check_prompt_chars("messages", sum(len(m.text) for m in messages))
        tokenizer = self.tokenizer
        variables = dict(template_kwargs or {})
        if tools is not None:
            variables["tools"] = tools
        rendered = [m.as_template_message() for m in messages]

        def render():
            return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                 chat_template=self.chat_template, **variables)

        try:
            return await self.work.text.run(render)
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from None
