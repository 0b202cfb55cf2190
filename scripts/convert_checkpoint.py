"""Convert a checkpoint into a (quantized) jaxinfer checkpoint; same as `jaxinfer convert`.

    python scripts/convert_checkpoint.py SRC OUT_DIR [--quantize none|int8|int4|int4-awq|fp8]
        [--group-size G] [--calibration FILE] [--dtype bfloat16|float32] [--include-head] [--overwrite]
"""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
