"""The native CPU kernels: C++ XLA FFI handlers, each beside its Python wrapper
(the way pallas_kernels/ holds the GPU kernels), and the code that builds,
caches and registers them.

    build.py                  compile with the machine's C++ compiler, cache, load, register
    parallel.h                the thread pool and helpers every kernel shares
    kquant_layer.h            a K-quant weight's layer as both K-quant kernels read it
    matmul.cc, q8_matmul.cc   x @ a quantized weight (float or int8-rounded activations); matmul.py
    kquant_matmul.cc          x @ a K-quant weight as the file stores it (float activations; the
                              int8-activation one is q8_matmul.cc's second handler); kquant_matmul.py
    expert_matmul.cc          a MoE's float32 experts, only the selected ones; expert_matmul.py
    paged_attention.cc        attention over the paged KV pool; paged_attention.py
    zeroed_buffer.cc          zeroed arrays left unallocated until written (the KV pool); zeroed_buffer.py
    kquant_repack.cc          not a handler: a GGUF's K-quant blocks into the kernels' tiles at load
                              (ctypes); kquant_repack.py

The CPU backend (jaxinfer/backends/cpu.py) calls the handlers, the GGUF
loader the repacking; the plain jnp (numpy) path each replaces is the
reference their tests compare against.
"""
