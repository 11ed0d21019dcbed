#!/usr/bin/env python3
"""A scripted model.bin, written from docs/FORMAT.md without kvlab's exporter: its greedy output is a chain chosen
here. Every layer's output projections (wo, w2) are zero, so the residual stream is the embedding of the current
token; embedding row i is the unit vector e_i (dim >= vocab), so the final RMSNorm gives sqrt(dim) * e_i and the
logits are sqrt(dim) times column i of the classifier: logit[j] = 10 if j == next[i] else 1. Greedy decoding therefore
follows i -> next[i] whatever the context.

usage: scripted_model.py OUT.bin NEXT [--tokenizer]
  NEXT: comma-separated next ids, one per vocab id (e.g. 3,1,2,...); --tokenizer adds a SentencePiece vocabulary:
  0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3 <0x1B>, 4 <0x07>, 5 "a", 6 "[31m", 7 "b" (no dummy prefix, no BOS added).
"""
import struct
import sys

PIECES = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<0x1B>", 6), ("<0x07>", 6), ("a", 1), ("[31m", 1), ("b", 1)]


def pad64(b):
    return b + b"\0" * (-len(b) % 64)


def f32s(vals):
    return struct.pack("<%df" % len(vals), *vals)


def main():
    out, nxt = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    with_tok = "--tokenizer" in sys.argv[3:]
    vocab = len(nxt)
    dim = hidden = head_dim = 16
    assert vocab <= dim and (not with_tok or vocab == len(PIECES))
    tok = b""
    if with_tok:
        tok = struct.pack("<II5iII", 1, vocab, 1, 2, -1, -1, 0, 0, 0) + b"\0" * 32 + struct.pack("<I", 0)
        for piece, ttype in PIECES:
            p = piece.encode()
            tok += struct.pack("<fiI", 0.0, ttype, len(p)) + p
        tok += struct.pack("<I", 0)   # no merges
    zeros = lambda r, c: f32s([0.0] * (r * c))
    ones = f32s([1.0] * dim)
    w = pad64(f32s([1.0 if j == i else 0.0 for i in range(vocab) for j in range(dim)]))   # embedding (vocab, dim)
    for m in (ones, zeros(dim, dim), zeros(dim, dim), zeros(dim, dim), zeros(dim, dim),   # norm, wq wk wv wo
              ones, zeros(hidden, dim), zeros(dim, hidden), zeros(hidden, dim)):         # norm, w1 w2 w3
        w += pad64(m)
    w += pad64(ones)   # final norm
    # classifier (vocab, dim): row j, column i = 10 when next[i] == j, else 1
    w += pad64(f32s([10.0 if i < vocab and nxt[i] == j else 1.0 for j in range(vocab) for i in range(dim)]))
    tok_off = 256 if tok else 0
    w_off = 256 + len(pad64(tok)) if tok else 256
    hdr = struct.pack("<II12i2f5Q", 0x424C564B, 1, dim, hidden, 1, 1, 1, head_dim, vocab, 64, 0, 0, 0, 0,
                      10000.0, 1e-5, tok_off, len(tok), w_off, len(w), w_off + len(w))
    hdr += b"\0" * (256 - len(hdr))
    with open(out, "wb") as f:
        f.write(hdr + (pad64(tok) if tok else b"") + w)


if __name__ == "__main__":
    main()
