#!/usr/bin/env python3
"""Independent NumPy reference forward pass for kvlab's model.bin (docs/FORMAT.md), in float64.

Written from the Llama architecture, not from kvlab's C code; it is the reference the tests compare against.

  RMSNorm      y = x * w / sqrt(mean(x^2) + eps)
  RoPE         angle(pos, i) = pos * theta^(-2i/head_dim) / factor_i  (factor_i = rope_freqs[i] when present,
               as llama.cpp's ggml_rope_ext divides the frequency by the factor), rotating pairs (2i, 2i+1)
               (rope_pairing 0) or (i, i+head_dim/2) (rope_pairing 1)
  attention    causal softmax(q.k / sqrt(head_dim)); query head h reads kv head h // (n_heads / n_kv_heads)
  FFN          w2 @ (silu(w1 @ x) * (w3 @ x))
  output       final RMSNorm, then the classifier (the embedding when tied)

Usage:
  ref_forward.py MODEL.bin --ids 1,5,7 [--positions 0,2]        logits (%.9g) at the given positions
  ref_forward.py MODEL.bin --ids 1 --greedy N                    greedy continuation ids (argmax, first index wins)
Only wtype 0 (f32) files are read.
"""
import argparse
import struct
import sys

import numpy as np

MAGIC = 0x424C564B
HDR = struct.Struct("<IIiiiiiiiiiiiiffQQQQQ")  # 104 bytes, then reserved zeros up to 256


def align64(n):
    return (n + 63) & ~63


class Model:
    def __init__(self, path):
        data = open(path, "rb").read()
        if len(data) < 256:
            raise ValueError("file shorter than the header")
        (magic, version, dim, hidden, n_layers, n_heads, n_kv, head_dim, vocab, seq_len, pairing, tied, wtype,
         has_rf, theta, eps, tok_off, tok_bytes, w_off, w_bytes, file_bytes) = HDR.unpack_from(data, 0)
        if magic != MAGIC or version != 1:
            raise ValueError("bad magic/version %#x/%d" % (magic, version))
        if file_bytes != len(data):
            raise ValueError("file_bytes %d != file length %d" % (file_bytes, len(data)))
        if wtype != 0:
            raise ValueError("only f32 weights (wtype 0) are supported")
        if n_heads % n_kv:
            raise ValueError("n_heads % n_kv_heads != 0")
        self.dim, self.hidden, self.n_layers = dim, hidden, n_layers
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.vocab, self.seq_len, self.pairing = vocab, seq_len, pairing
        self.theta, self.eps = float(theta), float(eps)  # the f32 values, widened
        off = w_off

        def take(rows, cols=None):
            nonlocal off
            off = align64(off)
            n = rows * (cols if cols is not None else 1)
            a = np.frombuffer(data, dtype="<f4", count=n, offset=off).astype(np.float64)
            off += 4 * n
            return a.reshape(rows, cols) if cols is not None else a

        self.emb = take(vocab, dim)
        self.rope_factors = take(head_dim // 2) if has_rf else None
        self.layers = []
        qd, kd = n_heads * head_dim, n_kv * head_dim
        for _ in range(n_layers):
            L = {}
            L["attn_norm"] = take(dim)
            L["wq"] = take(qd, dim)
            L["wk"] = take(kd, dim)
            L["wv"] = take(kd, dim)
            L["wo"] = take(dim, qd)
            L["ffn_norm"] = take(dim)
            L["w1"] = take(hidden, dim)
            L["w2"] = take(dim, hidden)
            L["w3"] = take(hidden, dim)
            self.layers.append(L)
        self.final_norm = take(dim)
        self.cls = self.emb if tied else take(vocab, dim)
        if off > w_off + w_bytes or w_off + w_bytes > len(data):
            raise ValueError("weights run past weights_bytes / file end")
        # RoPE inverse frequencies, float64
        i = np.arange(head_dim // 2, dtype=np.float64)
        inv = self.theta ** (-2.0 * i / head_dim)
        if self.rope_factors is not None:
            inv = inv / self.rope_factors
        self.inv_freq = inv
        self.reset()

    def reset(self):
        self.kc = [[] for _ in range(self.n_layers)]
        self.vc = [[] for _ in range(self.n_layers)]
        self.pos = 0

    def rmsnorm(self, x, w):
        return x * w / np.sqrt(np.mean(x * x) + self.eps)

    def rope(self, v, pos):
        # v: (n, head_dim)
        ang = pos * self.inv_freq
        c, s = np.cos(ang), np.sin(ang)
        out = v.copy()
        if self.pairing == 0:
            a, b = v[:, 0::2], v[:, 1::2]
            out[:, 0::2] = a * c - b * s
            out[:, 1::2] = a * s + b * c
        else:
            h = self.head_dim // 2
            a, b = v[:, :h], v[:, h:]
            out[:, :h] = a * c - b * s
            out[:, h:] = a * s + b * c
        return out

    def step(self, token):
        """Feed one token at the next position, return its logits (float64, vocab)."""
        pos = self.pos
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        group = nh // nkv
        x = self.emb[token].copy()
        for l, L in enumerate(self.layers):
            xb = self.rmsnorm(x, L["attn_norm"])
            q = self.rope((L["wq"] @ xb).reshape(nh, hd), pos)
            k = self.rope((L["wk"] @ xb).reshape(nkv, hd), pos)
            v = (L["wv"] @ xb).reshape(nkv, hd)
            self.kc[l].append(k)
            self.vc[l].append(v)
            K = np.stack(self.kc[l])  # (pos+1, nkv, hd)
            V = np.stack(self.vc[l])
            out = np.empty((nh, hd))
            for h in range(nh):
                kv = h // group
                sc = K[:, kv, :] @ q[h] / np.sqrt(hd)
                sc = np.exp(sc - sc.max())
                sc /= sc.sum()
                out[h] = sc @ V[:, kv, :]
            x = x + L["wo"] @ out.reshape(-1)
            xb = self.rmsnorm(x, L["ffn_norm"])
            g = L["w1"] @ xb
            u = L["w3"] @ xb
            x = x + L["w2"] @ ((g / (1.0 + np.exp(-g))) * u)
        x = self.rmsnorm(x, self.final_norm)
        self.pos += 1
        return self.cls @ x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ids", required=True, help="comma-separated token ids fed from position 0")
    ap.add_argument("--positions", default="", help="comma-separated positions whose logits to print")
    ap.add_argument("--greedy", type=int, default=0, help="then generate this many ids greedily")
    ap.add_argument("--stop", type=int, default=None, help="stop greedy generation when this id is produced")
    a = ap.parse_args()
    m = Model(a.model)
    ids = [int(t) for t in a.ids.split(",") if t != ""]
    want = set(int(p) for p in a.positions.split(",") if p != "")
    for t in ids:
        if not 0 <= t < m.vocab:
            sys.exit("token id %d out of range" % t)
    logits = None
    for p, t in enumerate(ids):
        logits = m.step(t)
        if p in want:
            print("%d %s" % (p, " ".join("%.9g" % v for v in logits)))
    if a.greedy:
        gen, margins = [], []
        while len(gen) < a.greedy:
            top2 = np.argsort(-logits, kind="stable")[:2]
            nxt = int(np.argmax(logits))
            margins.append(logits[top2[0]] - logits[top2[1]])
            if a.stop is not None and nxt == a.stop:
                print("# stop id %d produced after %d ids" % (nxt, len(gen)), file=sys.stderr)
                break
            gen.append(nxt)
            if len(gen) == a.greedy or m.pos >= m.seq_len:
                break
            logits = m.step(nxt)
        print("greedy " + " ".join(str(g) for g in gen))
        print("margins " + " ".join("%.6g" % g for g in margins))


if __name__ == "__main__":
    main()
