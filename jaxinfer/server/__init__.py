"""`jaxinfer serve`: an OpenAI-compatible HTTP server over one LLMEngine.

app.py (routes), engine_thread.py (the one thread that steps the engine),
protocol.py (request bodies -> SamplingParams), responses.py (OpenAI response
and chunk shapes), errors.py (OpenAI's error body), metrics.py (Prometheus),
bench_serve.py (`jaxinfer bench serve`, a client for a running server).
"""
