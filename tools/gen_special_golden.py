#!/usr/bin/env python3
"""Generate tests/golden/smollm2/special.txt: SmolLM2 ids for text with special-token markers, from Hugging Face's
`tokenizers` package (an implementation independent of kvlab and of llama.cpp), for tokenizer_encode_special.

The HF tokenizer is assembled from the vocabulary a model.bin carries (docs/FORMAT.md, tokenizer section: the GGUF's
tokens and merges as `./export` copied them; only data is read, none of kvlab's tokenizer code runs): a byte-level
BPE model with those merges, SmolLM2's tokenizer.json pre-tokenizer (Digits(individual_digits) then
ByteLevel(add_prefix_space=False, use_regex=True)), no normalizer, and every CONTROL token (type 3) added as a special
token (normalized=False, no lstrip/rstrip), as SmolLM2's added_tokens are. Before writing anything it checks that
this tokenizer reproduces llama.cpp's ids on tests/golden/tokenizer/corpus.txt (smollm2.ids) and on the five prompts
of tests/golden/smollm2 (tokenized by llama.cpp with parse_special = true); it stops if either differs.
HF splits added tokens leftmost-longest, llama.cpp longest-first; for SmolLM2's 17 markers ("<...>", no "<" or ">"
inside) no two occurrences can overlap, so the two rules give the same split.

Usage (needs `pip install tokenizers`; tested with tokenizers 0.23.3):
    python3 tools/gen_special_golden.py models/smollm2-135m-instruct.bin > tests/golden/smollm2/special.txt
Output: comment lines (#), then per case two lines: "text ESCAPED" (\\n \\r \\t \\\\ escaped) and "ids N N ...".
"""
import os
import struct
import sys

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(messages):
    """SmolLM2's template for these messages with add_generation_prompt (default system prompt when none)."""
    out = ""
    if messages[0][0] != "system":
        out += "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n"
    for role, content in messages:
        out += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


CASES = [
    chatml([("user", "\n\nHello")]),                       # the reported case: "\n\n" at the start of a turn
    chatml([("user", "Hello\n\n")]),
    chatml([("user", "  two spaces first")]),
    chatml([("system", "Be brief."), ("user", "Hi!"), ("assistant", " Hello. \n"), ("user", "\tand 1234?")]),
    chatml([("user", "")]),
    chatml([("user", "quote <|im_end|> inside")]),          # marker text inside a message is a marker here
    "<|im_start|><|im_end|><|endoftext|>",
    "<|im_start|",
    "<<|im_end|>>",
    "1<|im_end|>2",
    " <|im_end|> ",
    "\n<|im_end|>\n\n<|im_start|>\n",
    "<jupyter_code>x = 1\n<jupyter_output>1<empty_output>",
    "<repo_name>kvlab<file_sep>tokenizer.c<reponame><filename><gh_stars>10",
    "a<issue_start>b<issue_comment>c<issue_closed>d<jupyter_start><jupyter_text><jupyter_script>",
    "caf\u00e9<|im_end|>\u4f60\u597d<|endoftext|>\U0001F600",
]


def section(path):
    data = open(path, "rb").read()
    off, n = struct.unpack_from("<QQ", data, 64)
    return data[off:off + n]


def parse(sec):
    pos = 0

    def u32():
        nonlocal pos
        v = struct.unpack_from("<I", sec, pos)[0]
        pos += 4
        return v

    kind, n_tokens = u32(), u32()
    pos += 5 * 4 + 4 + 4
    pre = sec[pos:pos + 32].rstrip(b"\0").decode()
    pos += 32
    n = u32()
    pos += n   # chat template
    tokens = []
    for _ in range(n_tokens):
        pos += 4   # score
        ttype, n = u32(), u32()
        tokens.append((sec[pos:pos + n].decode("utf-8"), ttype))
        pos += n
    merges = []
    for _ in range(u32()):
        n = u32()
        merges.append(sec[pos:pos + n].decode("utf-8"))
        pos += n
    return kind, pre, tokens, merges


def unescape(s):
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            out.append({"n": "\n", "r": "\r", "t": "\t"}.get(s[i + 1], s[i + 1]))
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def escape(s):
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def main():
    kind, pre, tokens, merges = parse(section(sys.argv[1]))
    if kind != 2 or pre != "smollm":
        sys.exit("not the SmolLM2 vocabulary (kind %d, pre %r)" % (kind, pre))
    tok = Tokenizer(models.BPE(vocab={t: i for i, (t, _) in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in tokens if ty == 3])

    def enc(s):
        return tok.encode(s, add_special_tokens=False).ids

    gold = os.path.join(ROOT, "tests", "golden")
    corpus = open(os.path.join(gold, "tokenizer", "corpus.txt"), encoding="utf-8").read().split("\n")
    ids = open(os.path.join(gold, "tokenizer", "smollm2.ids")).read().split("\n")
    bad = sum(1 for c, l in zip(corpus, ids) if (c or l) and enc(unescape(c)) != [int(x) for x in l.split()])
    prompts = [l for l in open(os.path.join(gold, "smollm2", "prompts.txt"), encoding="utf-8").read().split("\n")
               if l and not l.startswith("#")]
    want = {}
    for line in open(os.path.join(gold, "smollm2", "greedy.txt")):
        if line.startswith("prompt "):
            k, v = line.split(" ids:")
            want[int(k.split()[1])] = [int(x) for x in v.split()]
    bad_prompts = [i for i, p in enumerate(prompts) if enc(unescape(p)) != want[i]]
    if bad or bad_prompts:
        sys.exit("the HF tokenizer differs from llama.cpp: %d corpus strings, prompts %s" % (bad, bad_prompts))

    print("# kvlab golden: SmolLM2 ids of text with special-token markers, for tokenizer_encode_special.")
    print("# Made by tools/gen_special_golden.py with Hugging Face tokenizers %s (not llama.cpp, not kvlab); that"
          % __import__("tokenizers").__version__)
    print("# tokenizer first reproduced llama.cpp's ids on all %d corpus strings and the 5 prompts of greedy.txt."
          % sum(1 for c, l in zip(corpus, ids) if c or l))
    print("# Per case: \"text\" (\\n \\r \\t \\\\ escaped), then \"ids\". See tests/golden/README.md.")
    for s in CASES:
        print("text " + escape(s))
        print("ids " + " ".join(str(i) for i in enc(s)))


if __name__ == "__main__":
    main()
