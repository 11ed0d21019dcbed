#!/usr/bin/env bash
# kv_attend_cpu gives the same bits with the machine's vector instructions (AVX/AVX2 intrinsics in kv.c) and with
# portable C: tests/kv_dump.c hashes every output and probability over 42 cases (6 shapes incl. head_dim 8, 12, 24,
# 80 and 128, GQA 1 to 5, every storage type, residual, both position modes, evicting policies), built both ways.
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
for b in kv_dump kv_dump_portable; do
    [ -x "$bin/$b" ] || { echo "FAIL $bin/$b is missing (make test builds it)"; exit 1; }
done
a=$("$bin/kv_dump") || { echo "FAIL kv_dump (vector build) failed"; exit 1; }
p=$("$bin/kv_dump_portable") || { echo "FAIL kv_dump (portable build) failed"; exit 1; }
n=$(echo "$a" | wc -l)
if [ "$a" = "$p" ] && [ "$n" -eq 42 ]; then
    echo "PASS kv_attend_cpu: vector and portable builds give identical outputs and probabilities in all $n cases"
else
    echo "FAIL kv_attend_cpu: vector and portable builds differ ($n cases):"
    diff <(echo "$a") <(echo "$p") | head -20
fi
