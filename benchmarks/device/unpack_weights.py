"""Rebuild petl's float16 DINOv2 cache file from `.device/weights.{head,body.xz}` (see make_kit.py).

python3 benchmarks/device/unpack_weights.py OUT.safetensors
"""

import lzma
import sys
from pathlib import Path

import numpy as np

kit = Path(".device")
planes = np.frombuffer(lzma.decompress((kit / "weights.body.xz").read_bytes()), dtype=np.uint8)
half = len(planes) // 2
body = np.empty_like(planes)
body[0::2], body[1::2] = planes[:half], planes[half:]
Path(sys.argv[1]).write_bytes((kit / "weights.head").read_bytes() + body.tobytes())
