#!/usr/bin/env bash
# Bad inputs for ./export (issue 8's catalogue): each must fail with exit status 1, one "export: ..." line naming the
# problem, and no crash. The crafted files are written by test_export --write-cases (a tiny valid llama GGUF and
# llama2.c files, each corrupted in one way). Usage: tests/test_export_bad.sh TEST_BIN_DIR (from tests/run.sh).
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
EXPORT=${KVLAB_EXPORT:-./export}   # make test-debug runs the sanitizer build
d=tests/tmp/export_bad
rm -rf "$d"; mkdir -p "$d"
if [ ! -x "$EXPORT" ] || [ ! -x "$bin/test_export" ]; then
    echo "FAIL export_bad: needs ./export and $bin/test_export (make export test)"; exit 1
fi
"$bin/test_export" --write-cases "$d" || { echo "FAIL export_bad: could not write the cases"; exit 1; }
mkdir -p "$d/a_directory"

fails=0
TIMEOUT=$(command -v timeout >/dev/null && echo "timeout 120")   # an export that blocks on a FIFO fails, not hangs
# expect NAME "WORDS (a grep -E pattern, case-insensitive)" ARGS...
expect() {
    local name=$1 words=$2; shift 2
    local out rc
    out=$($TIMEOUT "$EXPORT" "$@" 2>&1 >/dev/null); rc=$?
    if [ $rc -eq 1 ] && printf '%s' "$out" | grep -qiE -- "$words" && ! printf '%s' "$out" | grep -q "Sanitizer"; then
        echo "PASS export rejects $name: $(printf '%s' "$out" | head -1)"
    else
        echo "FAIL export rejects $name: exit $rc, wanted /$words/, got: $(printf '%s' "$out" | head -3)"
        fails=$((fails + 1))
    fi
    [ -e "$d/out.bin" ] && { echo "FAIL export $name left an output file"; fails=$((fails + 1)); rm -f "$d/out.bin"; }
    [ -e "$d/out.bin.tmp" ] && { echo "FAIL export $name left out.bin.tmp"; fails=$((fails + 1)); rm -f "$d/out.bin.tmp"; }
}
o=$d/out.bin

# the unmodified file works (so each failure below is the corruption's doing)
if "$EXPORT" "$d/good.gguf" "$o" 2>/dev/null && [ -s "$o" ]; then echo "PASS export accepts the uncorrupted tiny GGUF"
else echo "FAIL export accepts the uncorrupted tiny GGUF"; fails=$((fails + 1)); fi
rm -f "$o"

# GGUF structure
expect "wrong magic"                    "wrong magic"                 "$d/bad_magic.gguf" "$o"
expect "GGUF version 1"                 "unsupported GGUF version 1"  "$d/version1.gguf" "$o"
expect "GGUF version 4"                 "unsupported GGUF version 4"  "$d/version4.gguf" "$o"
expect "tensor count beyond the file"   "tensor count .* larger than the file" "$d/tensor_count.gguf" "$o"
expect "KV count beyond the file"       "KV count .* larger than the file"     "$d/kv_count.gguf" "$o"
expect "array count beyond the file"    "array count .* larger than the file"  "$d/array_count.gguf" "$o"
expect "string length past the end"     "string length .* past the end"        "$d/string_past_end.gguf" "$o"
expect "nested array"                   "nested arrays"               "$d/nested_array.gguf" "$o"
expect "array of unknown type"          "unknown array element type 99" "$d/array_unknown_type.gguf" "$o"
expect "unknown value type"             "unknown value type 77"       "$d/unknown_value_type.gguf" "$o"
expect "tensor offset outside data"     "blk.1.ffn_up.weight.*outside the data section" "$d/offset_outside.gguf" "$o"
expect "shape byte size overflow"       "overflows 64 bits"           "$d/shape_overflow.gguf" "$o"
expect "alignment 0"                    "alignment 0 is not a nonzero power of two"  "$d/align0.gguf" "$o"
expect "alignment 48"                   "alignment 48 is not a nonzero power of two" "$d/align48.gguf" "$o"
expect "duplicate tensor name"          "duplicate tensor name 'blk.0.attn_q.weight'" "$d/duplicate_tensor.gguf" "$o"
expect "duplicate metadata key"         "duplicate metadata key 'general.name'" "$d/duplicate_key.gguf" "$o"
expect "GGUF cut inside tensor data"    "outside the data section.*truncated" "$d/cut_in_data.gguf" "$o"
expect "GGUF cut inside the header"     "file ends inside"            "$d/cut_in_header.gguf" "$o"
expect "unknown tensor type id"         "unsupported tensor type \? \(id 99\) in tensor blk.0.attn_q.weight" "$d/unknown_type.gguf" "$o"
# model content
expect "unsupported tensor type"        "unsupported tensor type IQ4_NL \(id 20\) in tensor blk.0.attn_q.weight" "$d/unsupported_type.gguf" "$o"
expect "unsupported architecture"       "unsupported architecture 'gpt2'" "$d/arch_gpt2.gguf" "$o"
expect "unsupported tokenizer model"    "unsupported tokenizer model 'bert'" "$d/tokenizer_bert.gguf" "$o"
expect "missing required tensor"        "required tensor blk.1.ffn_up.weight is missing" "$d/missing_tensor.gguf" "$o"
expect "missing embedding"              "required tensor token_embd.weight is missing" "$d/missing_embedding.gguf" "$o"
expect "more layers than tensors"       "required tensor blk.2.attn_norm.weight is missing" "$d/layer_missing.gguf" "$o"
expect "wrong-shape Wq"                 "blk.0.attn_q.weight has wrong shape \[64, 32\], expected \[64, 64\]" "$d/wrong_shape_wq.gguf" "$o"
expect "wrong-shape Wk"                 "blk.1.attn_k.weight has wrong shape \[64, 64\], expected \[64, 32\]" "$d/wrong_shape_wk.gguf" "$o"
expect "wrong-shape Wv"                 "blk.0.attn_v.weight has wrong shape" "$d/wrong_shape_wv.gguf" "$o"
expect "wrong-shape Wo"                 "blk.0.attn_output.weight has wrong shape" "$d/wrong_shape_wo.gguf" "$o"
expect "n_heads not a multiple of n_kv_heads" "n_heads 4 is not a multiple of n_kv_heads 3" "$d/heads_not_multiple.gguf" "$o"
expect "zero dimension"                 "embedding_length = 0 is out of range" "$d/zero_dim.gguf" "$o"
expect "absurd layer count"             "block_count = 1000000 is out of range" "$d/absurd_layers.gguf" "$o"
expect "missing RMSNorm epsilon"        "layer_norm_rms_epsilon is missing" "$d/missing_eps.gguf" "$o"
expect "--vocab-only without a tokenizer" "nothing to write" "$d/no_tokenizer.gguf" "$o" --vocab-only

# llama2.c
expect "llama2.c tokenizer with the wrong entry count" "has 13 entries but the model's vocab_size is 12" --llama2c "$d/l2c.bin" --tokenizer "$d/tok13.bin" "$o"
expect "llama2.c token length past the end" "token 11 length .* past the end" --llama2c "$d/l2c.bin" --tokenizer "$d/tok_past_end.bin" "$o"
expect "llama2.c token longer than max_token_length" "token 2 length 6 is larger than the header's max_token_length 5" --llama2c "$d/l2c.bin" --tokenizer "$d/tok_max5.bin" "$o"
expect "llama2.c negative max_token_length" "max_token_length -1 is negative" --llama2c "$d/l2c.bin" --tokenizer "$d/tok_max_neg.bin" "$o"
expect "llama2.c checkpoint cut short"  "describes .* bytes of checkpoint, the file has" --llama2c "$d/l2c_cut.bin" "$o"
expect "llama2.c int8 (version 2)"      "version 2 \(int8\)" --llama2c "$d/l2c_v2.bin" "$o"
real_tok=../shared/data/models/llama2-tokenizer.bin; real_ck=../shared/data/models/stories260K.bin
if [ -f "$real_tok" ] && [ -f "$real_ck" ]; then
    expect "stories260K with the 32000-token tokenizer" "32000 entries but the model's vocab_size is 512" --llama2c "$real_ck" --tokenizer "$real_tok" "$o"
else
    echo "SKIP stories260K + llama2-tokenizer.bin: files not present"
fi
if "$EXPORT" --llama2c "$d/l2c.bin" --tokenizer "$d/tok12.bin" "$o" 2>/dev/null && [ -s "$o" ]; then
    echo "PASS export accepts the uncorrupted llama2.c checkpoint and tokenizer"
else echo "FAIL export accepts the uncorrupted llama2.c checkpoint and tokenizer"; fails=$((fails + 1)); fi
rm -f "$o"

# files and flags
expect "missing file"                   "cannot open .*no such file" "$d/does_not_exist.gguf" "$o"
expect "a directory"                    "is a directory"             "$d/a_directory" "$o"
expect "empty file"                     "is empty"                   "$d/empty.bin" "$o"
expect "empty llama2.c checkpoint"      "is empty"                   --llama2c "$d/empty.bin" "$o"
expect "empty tokenizer"                "is empty"                   --llama2c "$d/l2c.bin" --tokenizer "$d/empty.bin" "$o"
expect "a text file as GGUF"            "not a GGUF file"            tests/test_export_bad.sh "$o"
expect "output in a missing directory"  "cannot create output .*out.bin: directory .*no/such/dir does not exist" "$d/good.gguf" "$d/no/such/dir/out.bin"
expect "output under a file"            "cannot write output .*good.gguf/out.bin: not a directory" "$d/good.gguf" "$d/good.gguf/out.bin"
expect "empty output path"              "output path is empty"       "$d/good.gguf" ""
expect "flag without value (--wtype)"   "flag --wtype needs a value" "$d/good.gguf" "$o" --wtype
expect "flag without value (--tokenizer)" "flag --tokenizer needs a value" --llama2c "$d/l2c.bin" "$o" --tokenizer
expect "flag without value (--dim)"     "flag --dim needs a value"   --random "$o" --dim --hidden 8
expect "unknown flag"                   "unknown flag '--frobnicate'" "$d/good.gguf" "$o" --frobnicate
expect "--wtype q4 (not yet)"           "q4 is not yet available"    "$d/good.gguf" "$o" --wtype q4
expect "--wtype bogus"                  "unknown type 'f8'.*f32, q8" "$d/good.gguf" "$o" --wtype f8
expect "missing output path"            "expected IN.gguf OUT.bin"   "$d/good.gguf"
expect "no arguments"                   "expected IN.gguf OUT.bin"
expect "--llama2c and --random"         "exclude each other"         --llama2c "$d/l2c.bin" --random "$o"
expect "--random missing --seed"        "needs --seed"               --random "$o" --dim 8 --hidden 8 --layers 1 --heads 2 --kv-heads 1 --vocab 4 --seq 8
expect "--random non-numeric"           "--dim: 'x8' is not an integer" --random "$o" --dim x8
expect "--random zero dim"              "--dim: 0 is out of range"   --random "$o" --dim 0
expect "--random heads not a multiple"  "not a multiple"             --random "$o" --dim 8 --hidden 8 --layers 1 --heads 4 --kv-heads 3 --vocab 4 --seq 8 --seed 1
expect "--random bad theta"             "--theta: '-1' is not a positive number" --random "$o" --dim 8 --hidden 8 --layers 1 --heads 2 --kv-heads 1 --vocab 4 --seq 8 --seed 1 --theta -1
expect "--dim outside --random"         "only for --random"          "$d/good.gguf" "$o" --dim 8
R="--random $o --dim 8 --hidden 8 --layers 1 --heads 2 --kv-heads 1 --seq 8 --seed 1"
expect "--vocab-from outside --random"  "only for --random"          "$d/good.gguf" "$o" --vocab-from "$d/good.gguf"
expect "--vocab-from not a GGUF"        "not a GGUF file"            $R --vocab 4 --vocab-from "$d/l2c.bin"
expect "--vocab-from a corrupt GGUF"    "wrong magic"                $R --vocab 4 --vocab-from "$d/bad_magic.gguf"
expect "--vocab-from missing"           "no such file"               $R --vocab 4 --vocab-from "$d/nonexistent.gguf"

# the output path: never one of the inputs (same device and inode, however it is spelled), never a device, directory
# or FIFO (export writes OUT.tmp and renames it over OUT). The inputs must come out unchanged.
s=$d/same; mkdir -p "$s"
cp "$d/good.gguf" "$s/X.gguf"; cp "$d/l2c.bin" "$s/ck.bin"; cp "$d/tok12.bin" "$s/tok.bin"
ln "$s/X.gguf" "$s/hard.gguf"; ln -s X.gguf "$s/sym.gguf"; cp "$d/good.gguf" "$s/Y.tmp"
sum_before=$(cat "$s/X.gguf" "$s/ck.bin" "$s/tok.bin" "$s/Y.tmp" | cksum)
same="is the same file as the"
expect "output = input"                 "output .*X.gguf $same input .*X.gguf"        "$s/X.gguf" "$s/X.gguf"
expect "output = input spelled ./"      "output \./.*X.gguf $same input .*X.gguf"    "$s/X.gguf" "./$s/X.gguf"
expect "output = input spelled dir/../" "output .*same/\.\./same/X.gguf $same input" "$s/X.gguf" "$s/../same/X.gguf"
expect "output a hard link to the input" "output .*hard.gguf $same input .*X.gguf"  "$s/X.gguf" "$s/hard.gguf"
expect "output a symlink to the input"  "output .*sym.gguf $same input .*X.gguf"    "$s/X.gguf" "$s/sym.gguf"
expect "input a symlink to the output"  "output .*X.gguf $same input .*sym.gguf"    "$s/sym.gguf" "$s/X.gguf"
expect "output's temporary file = input" "Y.tmp \(the temporary file for output .*Y\) $same input" "$s/Y.tmp" "$s/Y"
expect "--llama2c output = checkpoint"  "output .*ck.bin $same checkpoint .*ck.bin" --llama2c "$s/ck.bin" --tokenizer "$s/tok.bin" "$s/ck.bin"
expect "--llama2c output = tokenizer"   "output \./.*tok.bin $same tokenizer .*tok.bin" --llama2c "$s/ck.bin" --tokenizer "$s/tok.bin" "./$s/tok.bin"
expect "--llama2c output = checkpoint, ids-only" "output .*ck.bin $same checkpoint" --llama2c "$s/ck.bin" "$s/ck.bin"
if [ "$(cat "$s/X.gguf" "$s/ck.bin" "$s/tok.bin" "$s/Y.tmp" | cksum)" = "$sum_before" ] && [ -L "$s/sym.gguf" ] &&
   [ ! -e "$s/Y" ] && [ -z "$(ls "$s" | grep -v '^Y.tmp$' | grep '\.tmp$')" ]; then
    echo "PASS export leaves its inputs unchanged and writes no temporary file when the output is an input"
else echo "FAIL export changed an input or left a .tmp file: $(ls "$s" | tr '\n' ' ')"; fails=$((fails + 1)); fi
if "$EXPORT" --random "$s/X.gguf" --dim 8 --hidden 8 --layers 1 --heads 2 --kv-heads 1 --vocab 4 --seq 8 --seed 1 \
       2>/dev/null && ! cmp -s "$s/X.gguf" "$d/good.gguf"; then
    echo "PASS export --random (no input) still replaces an existing regular file"
else echo "FAIL export --random (no input) still replaces an existing regular file"; fails=$((fails + 1)); fi

# not regular files. A device node made here when root (so that an export that does write it harms nothing outside
# $d); /dev/null otherwise (a user cannot create /dev/null.tmp or rename over it).
if [ "$(id -u)" = 0 ] && mknod "$d/null" c 1 3 2>/dev/null; then dev=$d/null; else dev=/dev/null; fi
expect "a character device as output"   "output .*null is a character device, not a regular file" "$d/good.gguf" "$dev"
[ -c "$dev" ] && [ ! -e "$dev.tmp" ] || { echo "FAIL export wrote $dev.tmp or replaced $dev"; fails=$((fails + 1)); }
expect "a directory as output"          "output .*a_directory is a directory, not a regular file" "$d/good.gguf" "$d/a_directory"
expect "a directory as output (dir/)"   "output .*a_directory/ is a directory"     "$d/good.gguf" "$d/a_directory/"
mkfifo "$d/fifo" "$d/fifo_tmp.tmp"
expect "a FIFO as output"               "output .*fifo is a FIFO, not a regular file" "$d/good.gguf" "$d/fifo"
expect "a FIFO as the temporary file"   "fifo_tmp.tmp \(the temporary file for output .*fifo_tmp\) exists and is a FIFO" "$d/good.gguf" "$d/fifo_tmp"
expect "--random into a directory"      "output .*a_directory is a directory" --random "$d/a_directory" --dim 8 --hidden 8 --layers 1 --heads 2 --kv-heads 1 --vocab 4 --seq 8 --seed 1
[ -p "$d/fifo" ] && [ ! -e "$d/fifo.tmp" ] && [ ! -e "$d/a_directory.tmp" ] && [ -z "$(ls -A "$d/a_directory")" ] ||
    { echo "FAIL export wrote beside or into a non-regular output"; fails=$((fails + 1)); }

# an output directory that is not writable: as root (who may write anywhere) through setpriv as user nobody
mkdir -p "$d/ro"; chmod 555 "$d/ro"
as_user=""
if [ "$(id -u)" = 0 ]; then
    if command -v setpriv >/dev/null && setpriv --reuid=65534 --regid=65534 --clear-groups "$EXPORT" --help >/dev/null 2>&1 &&
       setpriv --reuid=65534 --regid=65534 --clear-groups test -r "$d/good.gguf"; then
        as_user="setpriv --reuid=65534 --regid=65534 --clear-groups"
    else as_user=none; fi
fi
if [ "$as_user" = none ]; then
    echo "SKIP export rejects an unwritable output directory: root, and no setpriv to run it as nobody"
else
    out=$($as_user "$EXPORT" "$d/good.gguf" "$d/ro/out.bin" 2>&1 >/dev/null); rc=$?
    if [ $rc -eq 1 ] && printf '%s' "$out" | grep -qE "^export: cannot create output .*ro/out.bin: directory .*ro is not writable \(Permission denied\)$" &&
       [ -z "$(ls -A "$d/ro")" ]; then
        echo "PASS export rejects an unwritable output directory: $out"
    else echo "FAIL export rejects an unwritable output directory: exit $rc, got: $out"; fails=$((fails + 1)); fi
fi
chmod 755 "$d/ro"
rm -rf "$d"
[ $fails -eq 0 ]
