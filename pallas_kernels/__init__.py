"""Pallas kernels (paged decode attention, blockwise prefill attention,
quantized matmul), each beside a plain-jnp reference. Arrive with issue 4."""
