"""`jaxinfer serve`: an OpenAI-compatible HTTP server over one LLMEngine.

app.py (build_app: state, middleware and routes put together), state.py
(what the routes share: the LLM, its engine thread, the served models),
middleware.py (API key, body limit, CORS, error mapping), routes.py (the
endpoints), admission.py (a request's checks before the engine thread gets
it), reply.py (a whole reply) and streaming.py (a streamed one),
engine_thread.py (the one thread that steps the engine), protocol.py
(request bodies -> SamplingParams), responses.py (OpenAI response and chunk
shapes), errors.py (OpenAI's error body), metrics.py (Prometheus),
tool_calls.py and tool_parsers.py (tools and tool_choice; reading calls back
per template family), host_work.py (tokenizing and templates off the event
loop), prompt_logprobs.py (the prompt-scoring pass), generation_defaults.py
(the model's sampling defaults), bench_serve.py (`jaxinfer bench serve`, a
client for a running server).
"""
