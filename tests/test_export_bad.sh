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
# expect NAME "WORDS (a grep -E pattern, case-insensitive)" ARGS...
expect() {
    local name=$1 words=$2; shift 2
    local out rc
    out=$("$EXPORT" "$@" 2>&1 >/dev/null); rc=$?
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
expect "output in a missing directory"  "cannot create"              "$d/good.gguf" "$d/no/such/dir/out.bin"
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
rm -rf "$d"
[ $fails -eq 0 ]
