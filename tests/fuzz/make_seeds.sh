#!/usr/bin/env bash
# make_seeds.sh OUTDIR: the fuzz seeds, all made by the project itself: tiny GGUF files (gen_seeds.py), their
# model.bin and --vocab-only exports, ./export --random models of several shapes, raw tokenizer sections cut from
# those files, texts for the encoder, -kv specs and command lines. OUTDIR/TARGET/ holds each target's seeds and
# OUTDIR/vocabs/ the vocabularies fuzz_encode loads (KVLAB_FUZZ_VOCABS). Needs ./export (make) and python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
o=$1
EXPORT=${KVLAB_EXPORT:-./export}
rm -rf "$o"; mkdir -p "$o"/{gguf,model,tokenizer,encode,kvspec,cli,trace,vocabs}   # trace: seeds in corpus/trace only
python3 tests/fuzz/gen_seeds.py "$o/gguf"
for g in "$o"/gguf/*.gguf; do
    b=$(basename "$g" .gguf)
    $EXPORT "$g" "$o/model/$b.bin" >/dev/null
    if $EXPORT --vocab-only "$g" "$o/model/$b.vocab.bin" >/dev/null 2>&1; then cp "$o/model/$b.vocab.bin" "$o/vocabs/"; fi
done
r=1
for shape in "8 16 1 2 1 16 8" "12 20 2 6 2 11 5 --tied" "8 8 1 4 4 7 3 --rope-factors --head-dim 6" "16 24 1 4 2 9 4"; do
    set -- $shape
    $EXPORT --random "$o/model/random$r.bin" --dim $1 --hidden $2 --layers $3 --heads $4 --kv-heads $5 --vocab $6 \
        --seq $7 --seed $r "${@:8}" >/dev/null
    r=$((r + 1))
done
# the tokenizer section of each file that has one (header fields 64: offset, 72: bytes)
python3 - "$o" <<'PY'
import glob, os, struct, sys
o = sys.argv[1]
for f in sorted(glob.glob(o + "/model/*.bin")):
    d = open(f, "rb").read()
    off, n = struct.unpack_from("<QQ", d, 64)
    if n: open(os.path.join(o, "tokenizer", os.path.basename(f)), "wb").write(d[off:off + n])
texts = [b"", b"Hello world", b"the abc 12 345", b" leading  spaces\n\nand\ttabs ", "h\u00e9llo \u4e2d\u6587 \U0001F600".encode(),
         b"\xff\xfe\xc3\x28\xe2\x82\x00 invalid", b"it's we'll I'M", b"1234567890 3.14159", b"\x00\x01\x02\x7f",
         b"<s></s><|im_start|>user", b"a" * 300]
for i, t in enumerate(texts):
    open(os.path.join(o, "encode", "text%02d" % i), "wb").write(t)
specs = ["full", "window:8", "sink:8,sinks=2,pos=cache", "h2o:8,recent=3", "tova:6", "scissorhands:8",
         "snapkv:8,obs=2", "random:5,seed=3", "window:8,type=q8,residual=2", "full,ktype=q4,vtype=f16",
         "window:64KiB", "h2o:8,agg=max", "window:2,type=bf16", "sink:1MiB"]
for i, s in enumerate(specs):
    open(os.path.join(o, "kvspec", "spec%02d" % i), "w").write(s)
# command lines: arguments separated by NUL, the model path first
cli = [["m.bin", "-n", "5", "-t", "0", "-i", "hi"], ["m.bin", "-m", "ppl", "-f", "a", "-f", "b", "-kv", "full", "-kv", "window:8"],
       ["m.bin", "-p", "0.5", "-s", "18446744073709551615", "-c", "16", "-kvt", "q8"],
       ["m.bin", "-m", "chat", "-y", "sys", "-d", "cpu", "-o", "x.json", "-ids", "-bos", "-v"],
       ["m.bin", "-m", "ppl", "-chunk", "64", "-ppl-mode", "chunked", "-tokenlog", "t", "-kvlog", "k"],
       ["-h"], ["m.bin", "-n", "1e3"], ["m.bin", "-t", "nan"], ["m.bin", "-m", "detokenize", "-f", "ids.txt"]]
for i, a in enumerate(cli):
    open(os.path.join(o, "cli", "cli%02d" % i), "wb").write(b"\0".join(x.encode() for x in a))
PY
