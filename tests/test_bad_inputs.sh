#!/usr/bin/env bash
# Bad inputs for ./run (issue 8's catalogue, the part tests/test_run.sh and tests/test_export_bad.sh do not hold):
# every model.bin header field out of range, offsets and lengths that lie, truncation, a corrupt tokenizer section,
# bad token-id files for -m detokenize, and the command line (each flag without its value, non-numeric and
# out-of-range numbers, unknown and conflicting flags, bad -kv specs, prompts longer than the context). Each case must
# exit non-zero without a signal, print one "run: ..." line matching the expected words, and no sanitizer report.
# The files are made here: ./export --random models and tests/fuzz/gen_seeds.py's tiny GGUFs exported by ./export,
# each corrupted in one field. Usage: tests/test_bad_inputs.sh [TEST_BIN_DIR] (from tests/run.sh).
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}; EXPORT=${KVLAB_EXPORT:-./export}   # make test-debug runs the sanitizer build
d=tests/tmp/bad_inputs
rm -rf "$d"; mkdir -p "$d"
n_cases=0

# expect NAME PATTERN CMD...: non-zero exit below 128 (not a signal), stderr matches PATTERN, no sanitizer report
expect() {
    local name=$1 pat=$2; shift 2
    n_cases=$((n_cases + 1))
    "$@" >"$d/out" 2>"$d/err" </dev/null; local rc=$?
    if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -qiE -- "$pat" "$d/err" && ! grep -qE "Sanitizer|runtime error" "$d/err"
    then echo "PASS bad input: $name -> $(head -1 "$d/err" | head -c 160)"
    else echo "FAIL bad input: $name: exit $rc, wanted /$pat/, stderr: $(head -c 400 "$d/err")"; fi
}

# --- fixtures ---
R=$d/r.bin   # ids-only, untied: dim 48, hidden 112, 3 layers, 6/2 heads, head_dim 8, vocab 97, ctx 64
"$EXPORT" --random "$R" --dim 48 --hidden 112 --layers 3 --heads 6 --kv-heads 2 --vocab 97 --seq 64 --seed 7 \
    >/dev/null 2>&1 || echo "FAIL fixture: export --random"
RF=$d/rf.bin  # with rope factors
"$EXPORT" --random "$RF" --dim 16 --hidden 24 --layers 1 --heads 2 --kv-heads 1 --vocab 11 --seq 16 --seed 3 \
    --rope-factors >/dev/null 2>&1 || echo "FAIL fixture: export --random --rope-factors"
python3 tests/fuzz/gen_seeds.py "$d/gguf" || echo "FAIL fixture: gen_seeds.py"
V=$d/spm.bin; B=$d/bpe.bin; VO=$d/spm_vocab.bin   # tiny SentencePiece (278 tokens, ctx 32) and byte-level BPE models
"$EXPORT" "$d/gguf/spm_f32.gguf" "$V" >/dev/null 2>&1 || echo "FAIL fixture: export spm_f32.gguf"
"$EXPORT" "$d/gguf/bpe_smollm.gguf" "$B" >/dev/null 2>&1 || echo "FAIL fixture: export bpe_smollm.gguf"
"$EXPORT" --vocab-only "$d/gguf/spm_f32.gguf" "$VO" >/dev/null 2>&1 || echo "FAIL fixture: export --vocab-only"
for f in "$R" "$RF" "$V" "$B" "$VO"; do
    if "$RUN" "$f" -m tokenize -i "1" >/dev/null 2>&1 || "$RUN" "$f" -n 1 -i "1" >/dev/null 2>&1; then :
    else echo "FAIL fixture $f does not load"; fi
done

# le BYTES VALUE: VALUE as BYTES little-endian bytes, in printf's \x form (VALUE may be negative)
le() {
    local n=$1 v=$2 s="" i
    for ((i = 0; i < n; i++)); do s+=$(printf '\\x%02x' $(((v >> (8 * i)) & 255))); done
    printf '%s' "$s"
}
# patch SRC DST OFFSET BYTES VALUE: DST = SRC with VALUE written at OFFSET
patch() {
    cp "$1" "$2"
    printf "$(le "$4" "$5")" | dd of="$2" bs=1 seek="$3" conv=notrunc status=none
}
# hdr NAME PATTERN OFFSET BYTES VALUE [FILE]: the model with one header field changed must be rejected
hdr() {
    local f=${6:-$R}
    patch "$f" "$d/case.bin" "$3" "$4" "$5"
    expect "model.bin $1" "$2" "$RUN" "$d/case.bin" -n 1 -i 1
}
size=$(stat -c %s "$R")

# --- model.bin: every header field out of range (docs/FORMAT.md offsets) ---
OOR="is out of range"; WB="weight section is .* bytes but the config needs"
hdr "dim 0"                 "dim = 0 $OOR"              8 4 0
hdr "dim -1"                "dim = -1 $OOR"             8 4 -1
hdr "dim 65537"             "dim = 65537 $OOR"          8 4 65537
hdr "dim 47 (weights do not match)" "$WB"               8 4 47
hdr "hidden_dim 0"          "hidden_dim = 0 $OOR"       12 4 0
hdr "hidden_dim 2^18+1"     "hidden_dim = 262145 $OOR"  12 4 262145
hdr "hidden_dim 111"        "$WB"                       12 4 111
hdr "n_layers -1"           "n_layers = -1 $OOR"        16 4 -1
hdr "n_layers 1025"         "n_layers = 1025 $OOR"      16 4 1025
hdr "n_layers 2"            "$WB"                       16 4 2
hdr "n_heads 0"             "n_heads = 0 $OOR"          20 4 0
hdr "n_heads 1025"          "n_heads = 1025 $OOR"       20 4 1025
hdr "n_heads 5 (not a multiple of 2)" "n_heads 5 is not a multiple of n_kv_heads 2" 20 4 5
hdr "n_heads 4 (weights do not match)" "$WB"            20 4 4
hdr "n_kv_heads 0"          "n_kv_heads = 0 $OOR"       24 4 0
hdr "n_kv_heads -2"         "n_kv_heads = -2 $OOR"      24 4 -2
hdr "n_kv_heads 4"          "n_heads 6 is not a multiple of n_kv_heads 4" 24 4 4
hdr "n_kv_heads 1025"       "n_kv_heads = 1025 $OOR"    24 4 1025
hdr "head_dim 0"            "head_dim = 0 $OOR"         28 4 0
hdr "head_dim 1"            "head_dim = 1 $OOR"         28 4 1
hdr "head_dim 7 (odd)"      "head_dim 7 is odd"         28 4 7
hdr "head_dim 1026"         "head_dim = 1026 $OOR"      28 4 1026
hdr "head_dim 16 (weights do not match)" "$WB"          28 4 16
hdr "vocab_size 0"          "vocab_size = 0 $OOR"       32 4 0
hdr "vocab_size -97"        "vocab_size = -97 $OOR"     32 4 -97
hdr "vocab_size 2^22+1"     "vocab_size = 4194305 $OOR" 32 4 4194305
hdr "vocab_size 98"         "$WB"                       32 4 98
hdr "seq_len 0"             "seq_len = 0 $OOR"          36 4 0
hdr "seq_len -1"            "seq_len = -1 $OOR"         36 4 -1
hdr "seq_len 2^24+1"        "seq_len = 16777217 $OOR"   36 4 16777217
hdr "rope_pairing 2"        "rope_pairing = 2 $OOR"     40 4 2
hdr "rope_pairing -1"       "rope_pairing = -1 $OOR"    40 4 -1
hdr "tied 2"                "tied = 2 $OOR"             44 4 2
hdr "tied 1 in an untied file" "$WB"                    44 4 1
hdr "wtype 2 (unknown)"     "wtype = 2 $OOR"            48 4 2
hdr "wtype 1 (q8) on a shape q8 cannot hold" "wtype 1 \(q8\) needs .* multiples of 32" 48 4 1
hdr "wtype -1"              "wtype = -1 $OOR"           48 4 -1
hdr "has_rope_factors 2"    "has_rope_factors = 2 $OOR" 52 4 2
hdr "has_rope_factors 1 without factors" "$WB"          52 4 1
hdr "rope_theta 0"          "rope_theta 0 $OOR"         56 4 0
hdr "rope_theta -1"         "rope_theta -1 $OOR"        56 4 0xbf800000
hdr "rope_theta NaN"        "rope_theta nan $OOR"       56 4 0x7fc00000
hdr "rope_theta inf"        "rope_theta inf $OOR"       56 4 0x7f800000
hdr "rope_theta 1e13"       "rope_theta 1e\+13 $OOR"    56 4 0x551184e7
hdr "norm_eps 0"            "norm_eps 0 $OOR"           60 4 0
hdr "norm_eps 1"            "norm_eps 1 $OOR"           60 4 0x3f800000
hdr "norm_eps -1e-5"        "norm_eps -1e-05 $OOR"      60 4 0xb727c5ac
hdr "norm_eps NaN"          "norm_eps nan $OOR"         60 4 0x7fc00000
hdr "tokenizer_offset inside the header" "tokenizer section .* lies outside the file" 64 8 16 "$V"
hdr "tokenizer_offset past the end" "tokenizer section .* lies outside the file" 64 8 $(stat -c %s "$V") "$V"
hdr "tokenizer_bytes past the end" "tokenizer section .* lies outside the file" 72 8 $(stat -c %s "$V") "$V"
hdr "tokenizer_bytes 2^64-1" "tokenizer section .* lies outside the file" 72 8 -1 "$V"
hdr "tokenizer_bytes in an ids-only file" "tokenizer section .* lies outside the file" 72 8 $((size)) "$R"
hdr "weights_offset unaligned" "weight section .* outside the file or is unaligned" 80 8 320
hdr "weights_offset 0"      "weight section .* outside the file or is unaligned" 80 8 0
hdr "weights_offset 2^63"   "weight section .* outside the file or is unaligned" 80 8 $((1 << 63))
hdr "weights_offset 64 bytes late" "weight section .* outside the file or is unaligned" 80 8 $((size - $(od -An -t u8 -j 88 -N 8 "$R") + 64))
hdr "weights_bytes +64"     "$WB"                       88 8 $(( $(od -An -t u8 -j 88 -N 8 "$R") + 64 ))
hdr "weights_bytes 2^64-1"  "$WB"                       88 8 -1
hdr "file_bytes +1"         "header says .*: truncated or corrupt" 96 8 $((size + 1))
hdr "file_bytes 0"          "header says 0: truncated or corrupt" 96 8 0
hdr "reserved byte 104"     "reserved header byte 104 is not zero" 104 1 1
hdr "reserved byte 255"     "reserved header byte 255 is not zero" 255 1 255
hdr "vocab-only file with n_layers 0 and no tokenizer" "neither layers nor a tokenizer" 72 8 0 "$VO"
# rope factors in the file (after the embedding, 64-byte aligned): not positive, or NaN
emb_end=$(( $(od -An -t u8 -j 80 -N 8 "$RF") + 11 * 16 * 4 ))
hdr "rope factor -1"        "rope factor 0 = -1 is not a positive finite number" $emb_end 4 0xbf800000 "$RF"
hdr "rope factor NaN"       "rope factor 0 = nan is not a positive finite number" $emb_end 4 0x7fc00000 "$RF"
hdr "rope factor 0"         "rope factor 0 = 0 is not a positive finite number" $emb_end 4 0 "$RF"

# --- model.bin: truncated or extended ---
for cut in 1 4096 $((size - 255)) $((size - 257)); do
    head -c $((size - cut)) "$R" >"$d/cut.bin"
    expect "model.bin cut to $((size - cut)) bytes" "shorter than the 256-byte|truncated" "$RUN" "$d/cut.bin" -i 1
done
{ cat "$R"; printf 'x'; } >"$d/long.bin"
expect "model.bin with a trailing byte" "truncated or corrupt" "$RUN" "$d/long.bin" -i 1
vsize=$(stat -c %s "$V"); toff=$(od -An -t u8 -j 64 -N 8 "$V" | tr -d ' ')
head -c $((toff + 100)) "$V" >"$d/cut.bin"
expect "model.bin cut inside its tokenizer section" "truncated" "$RUN" "$d/cut.bin" -i 1

# --- model.bin: a corrupt tokenizer section (offsets inside the section: docs/FORMAT.md) ---
tok() { patch "$V" "$d/case.bin" $((toff + $3)) "$4" "$5"; expect "tokenizer section: $1" "$2" "$RUN" "$d/case.bin" -n 1 -i a; }
tok "kind 3"                "tokenizer kind 3 unknown" 0 4 3
tok "kind 0"                "tokenizer kind 0 unknown" 0 4 0
tok "n_tokens 2^32-1"       "n_tokens 4294967295 does not fit" 4 4 -1
tok "n_tokens 277 (one short)" "tokenizer|277"       4 4 277
tok "bos_id 278 (= vocab)"  "bos_id 278 out of range" 8 4 278
tok "eos_id -7"             "eos_id -7 out of range" 12 4 -7
tok "unk_id 2^31-1"         "unk_id 2147483647 out of range" 24 4 2147483647
tok "chat template length past the end" "truncated" 68 4 -1
patch "$B" "$d/case.bin" $(( $(od -An -t u8 -j 64 -N 8 "$B") + 36 )) 4 0x6e6b6e75   # pre = "unkn"
expect "tokenizer section: unknown byte-level pre-tokenizer" "unknown byte-level BPE pre-tokenizer" "$RUN" "$d/case.bin" -n 1 -i a

# --- ids for -m detokenize ---
det() { printf "$2" >"$d/ids.txt"; expect "detokenize ids '$1'" "$3" "$RUN" "$V" -m detokenize -f "$d/ids.txt"; }
det "12 abc"          '12 abc'                "token id 'abc' is not a number"
det "1.5"             '1.5'                   "token id '1.5' is not a number"
det "0x10"            '0x10'                  "token id '0x10' is not a number"
det "-3"              '5 -3'                  "token id -3 is out of range \[0, 278\)"
det "278 (= vocab)"   '278'                   "token id 278 is out of range \[0, 278\)"
det "2^31"            '2147483648'            "token id 2147483648 is out of range"
det "2^64 (overflow)" '18446744073709551616'  "token id '18446744073709551616' is not a number"
det "a 40-digit id"   '1234567890123456789012345678901234567890' "is not a number"
det "a NUL byte"      '1 \0 2'                "holds a NUL byte"
det "+5"              '+5 x'                  "token id 'x' is not a number"
expect "detokenize without -f" "detokenize needs a file of ids" "$RUN" "$V" -m detokenize
expect "detokenize a missing file" "cannot|no such file" "$RUN" "$V" -m detokenize -f "$d/no_such_ids.txt"
expect "detokenize on an ids-only model" "has no tokenizer" "$RUN" "$R" -m detokenize -f "$d/ids.txt"
expect "tokenize on an ids-only model" "has no tokenizer" "$RUN" "$R" -m tokenize -i hello
expect "a vocab-only file asked to generate" "holds only a tokenizer" "$RUN" "$VO" -i hello

# --- command line: every flag without its value (the last argument) ---
for f in -m -i -f -n -t -p -s -c -y -kv -kvt -kvlog -d -o -chunk -ppl-mode -tokenlog; do
    expect "flag $f without its value" "flag $f needs a value" "$RUN" "$R" $f
done
# --- non-numeric and out-of-range numbers ---
num() { expect "$1 '$2'" "bad $1 '$(printf '%s' "$2" | sed 's/[][\.*^$+?(){}|]/\\&/g')'" "$RUN" "$R" "$1" "$2"; }
for v in abc "" 5x 1e3 0x10 2.5 -1 1073741825 99999999999999999999; do num -n "$v"; done
for v in abc "" nan inf -0.5 100.5 1e400 "1,5"; do num -t "$v"; done
for v in x 0 -0.1 1.01 nan "" 1e-400x; do num -p "$v"; done
for v in abc -1 18446744073709551616 "" 1.0; do num -s "$v"; done
for v in x 0 -5 16777217 "" 8k; do num -c "$v"; done
for v in x 0 65537 -1; do num -chunk "$v"; done
# --- unknown flags and values ---
for f in -x --n - -- -kV -N --help-me; do expect "unknown flag '$f'" "unknown flag '$f'" "$RUN" "$R" "$f" 1; done
expect "unknown mode"            "unknown mode '-m gen'"           "$RUN" "$R" -m gen
expect "unknown -ppl-mode"       "unknown -ppl-mode 'chunks'"      "$RUN" "$R" -m ppl -ppl-mode chunks
expect "unknown device"          "unknown device '-d gpu'"         "$RUN" "$R" -d gpu
expect "unknown -kvt"            "unknown -kvt 'int8'"             "$RUN" "$R" -kvt int8
expect "-d cuda in a CPU build"  "no CUDA|cuda"                    "$RUN" "$R" -d cuda -n 1 -i 1
expect "no model path, a flag first" "unknown flag '5'|cannot open model '-n'" "$RUN" -n 5
# --- conflicting flags ---
expect "-i and -f in tokenize"   "with -i or -f, not both"         "$RUN" "$V" -m tokenize -i a -f "$d/ids.txt"
expect "-f in generate"          "-f is not used by -m generate" "$RUN" "$R" -f "$d/ids.txt"
expect "-f in chat"              "-f is not used by -m chat" "$RUN" "$V" -m chat -f "$d/ids.txt"
expect "-f twice in detokenize"  "repeatable only in ppl"          "$RUN" "$V" -m detokenize -f "$d/ids.txt" -f "$d/ids.txt"
expect "two -kv in chat"         "several policies run only in"    "$RUN" "$V" -m chat -kv full -kv window:8 -i hi
expect "-y in generate"          "-y is not used by -m generate"   "$RUN" "$V" -y sys -i hi
many_f=(); for i in $(seq 65); do many_f+=(-f "$d/ids.txt"); done
expect "65 -f files"             "too many -f files"               "$RUN" "$R" -m ppl "${many_f[@]}"
many_kv=(); for i in $(seq 33); do many_kv+=(-kv window:8); done
expect "33 -kv policies"         "too many -kv policies"           "$RUN" "$R" -m ppl "${many_kv[@]}"
expect "passkey -c too short"    "is too short: the fixed text"    "$RUN" "$V" -m passkey -c 32
# passkey's grid lists (the lengths against -c and the fixed text: tests/test_passkey.sh, which has a real tokenizer)
expect "-depths 1.5"             "-depths '1.5': '1.5' is not a depth in \[0, 1\]" "$RUN" "$V" -m passkey -depths 1.5
expect "-depths -0.25"           "'-0.25' is not a depth in \[0, 1\]" "$RUN" "$V" -m passkey -depths 0,-0.25
expect "-depths 0,,1"            "-depths '0,,1' has an empty item" "$RUN" "$V" -m passkey -depths 0,,1
expect "-depths 0.5,"            "has an empty item"               "$RUN" "$V" -m passkey -depths 0.5,
expect "-depths 0.5,0.50"        "0.50 is given twice"             "$RUN" "$V" -m passkey -depths 0.5,0.50
expect "-depths 17 values"       "at most 16 values"               "$RUN" "$V" -m passkey \
    -depths 0,0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.65,0.7,0.75,0.8
expect "-lengths 0"              "-lengths '0': '0' is not a token count" "$RUN" "$V" -m passkey -lengths 0
expect "-lengths 512,1k"         "'1k' is not a token count"       "$RUN" "$V" -m passkey -lengths 512,1k
expect "-lengths 2.5"            "'2.5' is not a token count"      "$RUN" "$V" -m passkey -lengths 2.5
expect "-lengths 64,64"          "64 is given twice"               "$RUN" "$V" -m passkey -lengths 64,64
expect "-passkey2 2"             "bad -passkey2 '2'"               "$RUN" "$V" -m passkey -passkey2 2
expect "-depths in ppl"          "-depths is not used by -m ppl \(it is for passkey and task\)" "$RUN" "$R" -m ppl -f "$d/ids.txt" -depths 0.5
expect "-lengths in ppl"         "-lengths is not used by -m ppl" "$RUN" "$R" -m ppl -f "$d/ids.txt" -lengths 64
expect "bench -lengths over -c"  "-lengths: a context of 64 tokens and 32 decode steps is over -c 64" "$RUN" "$R" -m bench -c 64 -lengths 64
expect "-passkey2 in generate"   "-passkey2 is not used by -m generate" "$RUN" "$R" -i 1 -passkey2 0
expect "bench -c below -n"        "leaves no room for a prompt"     "$RUN" "$R" -m bench -c 10
# --- bad -kv specs ---
kv() { expect "-kv '$1'" "$2" "$RUN" "$R" -n 1 -i 1 -kv "$1"; }
kv ""                           "empty kv spec"
kv "window"                     "window|budget"
kv "window:0"                   "budget 0"
kv "window:abc"                 "bad budget 'abc'"
kv "window:-4"                  "bad budget '-4'"
kv "window:8,type=q3"           "unknown storage type type=q3"
kv "window:8,type=q8,ktype=q4"  "conflicts with type="
kv "window:8,ktype=q8,ktype=q4" "given twice"
kv "window:8,frob=1"            "frob"
kv "window:8,pos=rope"          "unknown pos=rope"
kv "window:8,agg=sum"           "unknown agg=sum"
kv "window:8,residual=-1"       "bad residual=-1"
kv "window:8,noequals"          "options are key=value"
kv "sink:4,sinks=4"             "sinks"
kv "h2o:64,recent=64"           "recent"
kv "window:1B"                  "too small|byte budget|bytes"
kv "$(printf 'window:8,%.0s' $(seq 30))"   "too long"
kv "nosuch"                     "unknown kv policy 'nosuch'"
# --- prompts longer than the context under full ---
expect "text prompt longer than -c under full" "longer than the context of 4 tokens" "$RUN" "$V" -t 0 -c 4 -i "the abc the abc the abc"
expect "prompt longer than the trained context (32) under full" "longer than the context of 32 tokens" \
    "$RUN" "$V" -t 0 -kv full -i "$(printf 'abc %.0s' $(seq 40))"
expect "ids prompt longer than -c under full,type=q8" "longer than the context of 3 tokens" \
    "$RUN" "$R" -t 0 -c 3 -kv full,type=q8 -i "1 2 3 4"
echo "bad inputs in this file: $n_cases"
exit 0
