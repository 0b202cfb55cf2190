"""What the CPU running the tests lets the native kernels be (jaxinfer/native/,
built with -march=native): the matmul kernel's tiled paths and the K-quant
kernels are AVX-512 code, the int8-activation kernels AVX512-VNNI code. On a
CPU without them the engine stores plain layouts and multiplies through XLA
(each kernel's available() and tileable() say so, and tests of that path run
everywhere); a test of those kernels' own output needs the instructions."""

import pytest

from jaxinfer.native.build import cpu_has

AVX512 = cpu_has("avx512f")
VNNI = AVX512 and cpu_has("avx512bw") and cpu_has("avx512_vnni")

needs_avx512 = pytest.mark.skipif(not AVX512, reason="an AVX-512 kernel path; this CPU has no AVX-512")
needs_vnni = pytest.mark.skipif(not VNNI, reason="an AVX512-VNNI kernel; this CPU has no AVX512-VNNI")
