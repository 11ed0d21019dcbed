#!/usr/bin/env bash
# test_tokenizer.sh BIN_DIR: the tokenizers against llama.cpp's ids on real vocabularies. Vocab-only model.bin
# files are written by ./export --vocab-only from ../shared/data/vocab (SKIP when absent); SmolLM2 comes from
# models/smollm2-135m-instruct.bin (`make model`; SKIP when absent). tests/golden/tokenizer/README: see
# tests/golden/README.md. The unit tests on tiny in-memory vocabularies run as BIN_DIR/test_tokenizer alone.
# `--special` runs check tokenizer_encode_special (special-token text parsed) on each vocabulary: SmolLM2 against
# llama.cpp's prompt ids (tests/golden/smollm2/greedy.txt) and Hugging Face tokenizers' (special.txt).
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
EXPORT=${KVLAB_EXPORT:-./export}
data=../shared/data/vocab
gold=tests/golden/tokenizer
mkdir -p tests/tmp
rc=0
for v in gpt-2:gpt2 llama-spm:llama-spm; do
    src=${v%%:*}; name=${v##*:}
    gguf=$data/ggml-vocab-$src.gguf
    if [ ! -f "$gguf" ]; then echo "SKIP tokenizer $name: $gguf not found"; continue; fi
    out=tests/tmp/vocab-$name.bin
    if ! "$EXPORT" --vocab-only "$gguf" "$out" >tests/tmp/export-$name.log 2>&1; then
        echo "FAIL tokenizer $name: ./export --vocab-only $gguf failed: $(tail -1 tests/tmp/export-$name.log)"
        rc=1; continue
    fi
    "$bin/test_tokenizer" "$out" "$name" $gold/corpus.txt $gold/$name.ids "$gguf.inp" "$gguf.out" || rc=1
    "$bin/test_tokenizer" --special "$out" "$name" || rc=1
done
smol=models/smollm2-135m-instruct.bin
sg=tests/golden/smollm2
if [ -f "$smol" ]; then
    "$bin/test_tokenizer" "$smol" smollm2 $gold/corpus.txt $gold/smollm2.ids || rc=1
    "$bin/test_tokenizer" --special "$smol" smollm2 $sg/prompts.txt $sg/greedy.txt $sg/special.txt || rc=1
else
    echo "SKIP tokenizer smollm2: $smol not found (make model)"
    echo "SKIP tokenizer_encode_special smollm2 (llama.cpp and Hugging Face goldens): $smol not found (make model)"
fi
exit $rc
