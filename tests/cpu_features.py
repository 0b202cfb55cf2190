"""What the CPU running the tests lets the native kernels be (jaxinfer/native/,
built with -march=native): the exact kernels' tiled paths (matmul.cc's,
kquant_matmul.cc) are AVX-512 or AVX2 (with FMA and F16C) code, written on
vec16.h; the int8-activation kernels (q8_matmul.cc) are AVX512-VNNI or AVX2
code, on vec16.h too; the float experts' kernel is AVX-512 code. On a CPU without them the engine
stores plain layouts and multiplies through XLA (each kernel's available()
and tileable() say so, and tests of that path run everywhere); a test of
those kernels' own output needs the instructions."""

import pytest

from jaxinfer.native.build import cpu_has

AVX512 = cpu_has("avx512f")
VEC16 = AVX512 or (cpu_has("avx2") and cpu_has("fma") and cpu_has("f16c"))
VNNI = AVX512 and cpu_has("avx512bw") and cpu_has("avx512_vnni")
# q8_matmul.cc's integer dots: vpdpbusd with AVX-512 (built only with VNNI there), vpmaddubsw with AVX2.
INT8_DOTS = VNNI if AVX512 else VEC16

needs_avx512 = pytest.mark.skipif(not AVX512, reason="an AVX-512 kernel path; this CPU has no AVX-512")
needs_vec16 = pytest.mark.skipif(
    not VEC16, reason="an exact kernel's tiled path (vec16.h); this CPU has neither AVX-512 nor AVX2 with FMA and F16C")
needs_int8_dots = pytest.mark.skipif(
    not INT8_DOTS, reason="the int8-activation kernel; this CPU has neither AVX512-VNNI nor AVX2 with FMA and F16C")
