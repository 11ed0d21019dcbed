#!/usr/bin/env python3
"""gen_seeds.py OUTDIR: writes the small hand-made files the fuzz seed corpora start from (tools/fuzz.sh --seeds).

Tiny llama GGUF files (GGUF v3, ggml docs/gguf.md) with a SentencePiece or a byte-level BPE vocabulary and every
tensor type export dequantizes (f32, f16, bf16, Q4_0..Q8_0, Q2_K..Q6_K), written from a fixed seed; the fuzz script
then turns them into model.bin files, vocab-only files and raw tokenizer sections with ./export. Nothing here is
copied from a downloaded model. Standard library only.
"""
import os
import random
import struct
import sys

T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9
# ggml type id -> (elements per block, bytes per block)
GGML = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
        10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, typ, val):
    out = gstr(key) + struct.pack("<I", typ)
    if typ == T_U32: return out + struct.pack("<I", val)
    if typ == T_F32: return out + struct.pack("<f", val)
    if typ == T_BOOL: return out + struct.pack("<B", val)
    if typ == T_STR: return out + gstr(val)
    raise ValueError(typ)


def kv_arr(key, elem, vals):
    out = gstr(key) + struct.pack("<IIQ", T_ARR, elem, len(vals))
    for v in vals:
        out += gstr(v) if elem == T_STR else struct.pack("<f" if elem == T_F32 else "<i", v)
    return out


def tensor_bytes(rng, typ, n):
    be, bb = GGML[typ]
    assert n % be == 0
    if typ == 0: return struct.pack("<%df" % n, *[rng.uniform(-0.5, 0.5) for _ in range(n)])
    if typ == 1: return struct.pack("<%de" % n, *[rng.uniform(-0.5, 0.5) for _ in range(n)])
    if typ == 30: return b"".join(struct.pack("<f", rng.uniform(-0.5, 0.5))[2:] for _ in range(n))
    out = bytearray(rng.getrandbits(8) for _ in range(n // be * bb))
    if be == 32:   # a sane f16 scale (and min) at the start of every block
        for b in range(0, len(out), bb):
            out[b:b + 2] = struct.pack("<e", 0.01)
            if typ in (3, 7): out[b + 2:b + 4] = struct.pack("<e", -0.1)
    return bytes(out)


def gguf(meta, tensors, seed):
    """meta: list of encoded kv entries; tensors: list of (name, [ne0, ne1...], ggml type)."""
    rng = random.Random(seed)
    infos, data = b"", b""
    for name, ne, typ in tensors:
        n = 1
        for e in ne: n *= e
        infos += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", e) for e in ne)
        infos += struct.pack("<IQ", typ, len(data))
        if name == "rope_freqs.weight": data += struct.pack("<%df" % n, *[rng.uniform(0.5, 2.0) for _ in range(n)])
        else: data += tensor_bytes(rng, typ, n)
        data += b"\0" * (-len(data) % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + infos
    return head + b"\0" * (-len(head) % 32) + data


def spm_vocab():
    toks = [("<unk>", 2), ("<s>", 3), ("</s>", 3)] + [("<0x%02X>" % b, 6) for b in range(256)]
    for w in ["\u2581", "a", "b", "c", "e", "t", "h", "\u2581t", "\u2581th", "\u2581the", "he", "ab", "abc", "\u2581a",
              "\u00e9", "\u4e2d", "\u2581\u2581", "1", "12"]:
        toks.append((w, 1))
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(toks) - 259)]
    return toks, scores


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def bpe_vocab():
    m = bytes_to_unicode()
    toks = [(m[b], 1) for b in range(256)]
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("1", "2"), ("'", "s"),
                 ("Ċ", "Ċ"), ("Ġ", "Ġ")]:
        merges.append(a + " " + b)
        toks.append((a + b, 1))
    toks += [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3)]
    return toks, merges


def model_meta(dim, hidden, layers, heads, kvh, ctx, tok):
    meta = [kv("general.architecture", T_STR, "llama"), kv("general.name", T_STR, "fuzz-seed"),
            kv("llama.embedding_length", T_U32, dim), kv("llama.feed_forward_length", T_U32, hidden),
            kv("llama.block_count", T_U32, layers), kv("llama.attention.head_count", T_U32, heads),
            kv("llama.attention.head_count_kv", T_U32, kvh), kv("llama.context_length", T_U32, ctx),
            kv("llama.rope.freq_base", T_F32, 10000.0), kv("llama.attention.layer_norm_rms_epsilon", T_F32, 1e-5)]
    if tok == "spm":
        toks, scores = spm_vocab()
        meta += [kv("tokenizer.ggml.model", T_STR, "llama"), kv_arr("tokenizer.ggml.tokens", T_STR, [t for t, _ in toks]),
                 kv_arr("tokenizer.ggml.scores", T_F32, scores), kv_arr("tokenizer.ggml.token_type", T_I32, [y for _, y in toks]),
                 kv("tokenizer.ggml.bos_token_id", T_U32, 1), kv("tokenizer.ggml.eos_token_id", T_U32, 2),
                 kv("tokenizer.ggml.unknown_token_id", T_U32, 0), kv("tokenizer.ggml.add_bos_token", T_BOOL, 1),
                 kv("tokenizer.chat_template", T_STR, "{% for m in messages %}[INST] {{ m }} [/INST]{% endfor %}")]
        return meta, len(toks)
    if tok in ("smollm", "gpt2", "llama-bpe"):
        toks, merges = bpe_vocab()
        meta += [kv("tokenizer.ggml.model", T_STR, "gpt2"), kv("tokenizer.ggml.pre", T_STR, tok),
                 kv_arr("tokenizer.ggml.tokens", T_STR, [t for t, _ in toks]),
                 kv_arr("tokenizer.ggml.token_type", T_I32, [y for _, y in toks]),
                 kv_arr("tokenizer.ggml.merges", T_STR, merges),
                 kv("tokenizer.ggml.bos_token_id", T_U32, len(toks) - 3),
                 kv("tokenizer.ggml.eos_token_id", T_U32, len(toks) - 1),
                 kv("tokenizer.chat_template", T_STR, "{% for message in messages %}<|im_start|>{{ message }}{% endfor %}")]
        return meta, len(toks)
    return meta, None


def llama_tensors(dim, hidden, layers, heads, kvh, hd, vocab, types, tied=True, rope_factors=False):
    """types: dict role -> ggml type (role in emb, mat, ffn, norm)."""
    t = [("token_embd.weight", [dim, vocab], types.get("emb", 0))]
    if rope_factors: t.append(("rope_freqs.weight", [hd // 2], 0))
    for l in range(layers):
        p = "blk.%d." % l
        t += [(p + "attn_norm.weight", [dim], 0), (p + "attn_q.weight", [dim, heads * hd], types.get("mat", 0)),
              (p + "attn_k.weight", [dim, kvh * hd], types.get("mat", 0)), (p + "attn_v.weight", [dim, kvh * hd], types.get("mat", 0)),
              (p + "attn_output.weight", [heads * hd, dim], types.get("out", types.get("mat", 0))),
              (p + "ffn_norm.weight", [dim], 0), (p + "ffn_gate.weight", [dim, hidden], types.get("ffn", 0)),
              (p + "ffn_down.weight", [hidden, dim], types.get("down", types.get("ffn", 0))),
              (p + "ffn_up.weight", [dim, hidden], types.get("up", types.get("ffn", 0)))]
    t.append(("output_norm.weight", [dim], 0))
    if not tied: t.append(("output.weight", [dim, vocab], types.get("cls", types.get("emb", 0))))
    return t


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    cases = []
    # SentencePiece vocabulary, f32, 2 layers, rope factors
    meta, v = model_meta(8, 16, 2, 2, 1, 32, "spm")
    if True:
        rope = llama_tensors(8, 16, 2, 2, 1, 4, v, {}, tied=True, rope_factors=True)
        rope[1] = ("rope_freqs.weight", [2], 0)
        cases.append(("spm_f32", meta, rope))
    # byte-level BPE vocabularies (three pre-tokenizers), f16 / bf16, untied
    for i, pre in enumerate(("smollm", "gpt2", "llama-bpe")):
        meta, v = model_meta(8, 16, 1, 4, 2, 16, pre)
        cases.append(("bpe_%s" % pre, meta, llama_tensors(8, 16, 1, 4, 2, 2, v, {"emb": [1, 30, 0][i], "mat": [30, 1, 0][i]},
                                                             tied=(i != 1))))
    # 32-wide legacy quants, ids-only
    meta, _ = model_meta(32, 32, 1, 2, 2, 8, None)
    cases.append(("q_legacy", meta, llama_tensors(32, 32, 1, 2, 2, 16, 5, {"emb": 8, "mat": 2, "out": 3, "ffn": 6, "down": 7})))
    # 256-wide k-quants, ids-only
    meta, _ = model_meta(256, 2, 1, 1, 1, 8, None)
    meta.append(kv("llama.attention.key_length", T_U32, 2))   # head_dim != dim / n_heads
    cases.append(("q_k", meta, llama_tensors(256, 2, 1, 1, 1, 2, 3, {"emb": 10, "mat": 11, "out": 0, "ffn": 13, "up": 12,
                                                                   "down": 0, "cls": 14}, tied=False)))
    for i, (name, meta, tensors) in enumerate(cases):
        with open(os.path.join(out, name + ".gguf"), "wb") as f:
            f.write(gguf(meta, tensors, 1000 + i))


if __name__ == "__main__":
    main()
