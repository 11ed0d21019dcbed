#!/usr/bin/env bash
# bench_tokenizer.sh [MODEL.bin ...]: tokenizer figures (prints, asserts nothing): encode throughput in MB/s on the
# whole Debian Reference (apt-get install debian-reference-en), time for 30,000 'a' with no spaces and for 30,000
# digits, peak memory. Default vocabularies: SmolLM2 (models/, from make model) and the vocab-only files
# tests/test_tokenizer.sh writes (GPT-2, Llama 2 SentencePiece). Builds tests/bin/test_tokenizer if needed.
set -eu
cd "$(dirname "$0")/.."
make -s tests/bin/test_tokenizer
gz=/usr/share/debian-reference/debian-reference.en.txt.gz
mkdir -p tests/tmp
text=tests/tmp/debian-reference.en.txt
if [ -f "$gz" ]; then gzip -dc "$gz" > "$text"; else echo "no $gz (apt-get install debian-reference-en): long-text figure skipped"; text=; fi
if [ $# -eq 0 ]; then
    set --
    for f in models/smollm2-135m-instruct.bin tests/tmp/vocab-gpt2.bin tests/tmp/vocab-llama-spm.bin; do
        [ -f "$f" ] && set -- "$@" "$f"
    done
    for v in gpt-2:gpt2 llama-spm:llama-spm; do   # write the vocab-only files when the data is here
        out=tests/tmp/vocab-${v##*:}.bin; gguf=../shared/data/vocab/ggml-vocab-${v%%:*}.gguf
        if [ ! -f "$out" ] && [ -f "$gguf" ]; then ./export --vocab-only "$gguf" "$out" >/dev/null && set -- "$@" "$out"; fi
    done
fi
[ $# -gt 0 ] || { echo "no vocabulary found: run make model or tests/test_tokenizer.sh first"; exit 1; }
echo "machine: $(uname -m), $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //')"
for m in "$@"; do
    tests/bin/test_tokenizer --bench "$m" $text
    echo
done
