#!/usr/bin/env bash
# The CPU attention gives the same bits with the machine's vector instructions (AVX/AVX2 intrinsics in kv.c) and with
# portable C, token by token (kv_attend_cpu) and in chunks (kv_attend_chunk, chunks of 1 to 64 tokens), on 1 and 2
# threads: tests/kv_dump.c hashes every output and probability over 136 cases (8 shapes: head_dim 8, 12, 24, 32, 64,
# 80 and 128, GQA groups of 1 to 6; 17 specs: every storage type, residual, precision bands (prec=, kprec=, vprec=),
# both position modes, evicting policies (one with a residual band), slots freed several at a time, low-rank keys
# and values fitted inside the stream, per-channel key groups (2, 4 and 8 bits) sealed inside it, also while
# evicting, a selection policy scoring every key), built both ways.
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
for b in kv_dump kv_dump_portable; do
    [ -x "$bin/$b" ] || { echo "FAIL $bin/$b is missing (make test builds it)"; exit 1; }
done
ref=$(OMP_NUM_THREADS=1 "$bin/kv_dump") || { echo "FAIL kv_dump (vector build) failed"; exit 1; }
n=$(echo "$ref" | wc -l)
[ "$n" -eq 136 ] || echo "FAIL kv_dump printed $n cases, 136 expected"
for b in kv_dump kv_dump_portable; do
    for mode in token chunk; do
        for th in 1 2; do
            [ "$b $mode $th" = "kv_dump token 1" ] && continue
            got=$(OMP_NUM_THREADS=$th "$bin/$b" "$mode") || { echo "FAIL $b $mode ($th threads) failed"; continue; }
            if [ "$got" = "$ref" ]; then
                echo "PASS $b, $mode by $mode, $th thread(s): outputs and probabilities identical to the vector build token by token ($n cases)"
            else
                echo "FAIL $b, $mode by $mode, $th thread(s) differs from the vector build token by token:"
                diff <(echo "$ref") <(echo "$got") | head -20
            fi
        done
    done
done
