"""What the CPU running the tests lets the native kernels be (jaxinfer/native/,
built with -march=native): the matmul kernel's tiled paths are AVX-512 code,
the exact K-quant kernel AVX-512 or AVX2 (with FMA and F16C) code, the
int8-activation kernels AVX512-VNNI code. On a CPU without them the engine
stores plain layouts and multiplies through XLA (each kernel's available()
and tileable() say so, and tests of that path run everywhere); a test of
those kernels' own output needs the instructions."""

import pytest

from jaxinfer.native.build import cpu_has

AVX512 = cpu_has("avx512f")
KQUANT = AVX512 or (cpu_has("avx2") and cpu_has("fma") and cpu_has("f16c"))
VNNI = AVX512 and cpu_has("avx512bw") and cpu_has("avx512_vnni")

needs_avx512 = pytest.mark.skipif(not AVX512, reason="an AVX-512 kernel path; this CPU has no AVX-512")
needs_kquant_kernel = pytest.mark.skipif(
    not KQUANT, reason="the exact K-quant kernel; this CPU has neither AVX-512 nor AVX2 with FMA and F16C")
needs_vnni = pytest.mark.skipif(not VNNI, reason="an AVX512-VNNI kernel; this CPU has no AVX512-VNNI")
