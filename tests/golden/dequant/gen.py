#!/usr/bin/env python3
"""Writes the dequantization test vectors of tests/test_export.c: for each ggml type export.c reads, a few blocks of
random bytes (with every f16 scale replaced by a finite value, so no block decodes to NaN or inf) and the f32 values
the `gguf` Python package (an implementation independent of kvlab) dequantizes them to.

File layout (little-endian): u32 ggml type id, u32 n_elems, u32 n_bytes, the n_bytes raw block bytes, n_elems f32.
Run from the repository root:  python3 tests/golden/dequant/gen.py   (deterministic: fixed seed)."""
import os
import struct
import numpy as np
import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(20240601)

# byte offsets of the f16 scale fields inside one block (ggml-common.h)
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def scale_f16(i):
    """A finite f16 scale: mostly normal values of both signs over a wide exponent range, sometimes a subnormal."""
    if i % 7 == 3:
        return np.uint16(rng.integers(1, 0x400))            # subnormal
    v = rng.uniform(-2, 2) * 2.0 ** rng.integers(-12, 3)
    return np.float16(v).view(np.uint16)


def write(name, qtype, raw, n_elems):
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    assert expected.size == n_elems
    with open(os.path.join(HERE, name + ".bin"), "wb") as f:
        f.write(struct.pack("<3I", int(qtype), n_elems, raw.size))
        f.write(raw.tobytes())
        f.write(expected.astype("<f4").tobytes())


for qtype, offs in SCALES.items():
    blck, size = GGML_QUANT_SIZES[qtype]
    n_blocks = 8 if blck == 32 else 3
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    k = 0
    for b in range(n_blocks):
        for o in offs:
            raw[b, o:o + 2] = np.frombuffer(scale_f16(k).tobytes(), dtype=np.uint8)
            k += 1
    write(qtype.name.lower(), qtype, raw.reshape(-1), n_blocks * blck)

# F16 and BF16: every bit pattern class, NaN payloads, infinities, zeros and subnormals included (compared bitwise)
special = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x7c00, 0xfc00,
                    0x7e00, 0x7c01, 0xfe00, 0x7fff, 0x3c00, 0x3555], dtype=np.uint16)
for qtype in (T.F16, T.BF16):
    bits = np.concatenate([special, rng.integers(0, 65536, size=240, dtype=np.uint16)]).astype("<u2")
    write(qtype.name.lower(), qtype, bits.view(np.uint8), bits.size)

# F32: random finite values (a copy: checks byte order and offsets)
f = (rng.standard_normal(256) * 10.0 ** rng.integers(-5, 5, size=256)).astype("<f4")
write("f32", T.F32, f.view(np.uint8), f.size)
import importlib.metadata
print("gguf", importlib.metadata.version("gguf"), "numpy", np.__version__)
