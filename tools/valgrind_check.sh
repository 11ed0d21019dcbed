#!/usr/bin/env bash
# tools/valgrind_check.sh: valgrind memcheck over short CPU-only runs of ./run and ./export; passes when valgrind
# reports no error and no leak (definite, indirect or possible) in any of them. Valgrind cannot execute AVX-512, so
# kvlab is rebuilt for a portable target (-march=x86-64-v2, -O2, no OpenMP: libgomp's thread pool stays allocated
# at exit and is not kvlab's) into build/vg. Models: ./export --random, the tiny tokenizer models of
# tests/fuzz/gen_seeds.py, and stories260K when ../shared/data has it. Prints one PASS/FAIL line per run and ends
# with "valgrind: N runs clean" or exits non-zero. Usage: tools/valgrind_check.sh (from the repository root or not).
set -u
export KVLAB_THREADS_DEFAULT=0   # ./run would exec itself to set its thread defaults; keep valgrind on one process
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind_check: valgrind is not installed (apt-get install valgrind)"; exit 2; }
B=build/vg; T=$B/tmp
make -s BUILD=$B OUT=$B OPT="-O2 -march=x86-64-v2" OMP= all >/dev/null || { echo "valgrind_check: build failed"; exit 2; }
rm -rf "$T"; mkdir -p "$T"
VG=(valgrind --tool=memcheck --leak-check=full --show-leak-kinds=all --errors-for-leak-kinds=definite,indirect,possible
    --error-exitcode=99 --track-origins=yes)
bad=0; n=0
# check NAME WANT_RC CMD...: the command must exit WANT_RC under memcheck with no error and no definite, indirect or
# possible leak (those count as errors here); "still reachable" is reported but allowed only on an error exit
check() {
    local name=$1 want=$2; shift 2
    n=$((n + 1))
    "${VG[@]}" --log-file="$T/vg.$n.log" "$@" >"$T/out.$n" 2>"$T/err.$n"; local rc=$?
    local errs heap
    errs=$(grep -m1 -o "ERROR SUMMARY: [0-9]* errors" "$T/vg.$n.log")
    heap=$(grep -m1 -E "All heap blocks were freed|in use at exit" "$T/vg.$n.log" | sed 's/^==[0-9]*== *//')
    if [ $rc -eq "$want" ] && grep -q "ERROR SUMMARY: 0 errors" "$T/vg.$n.log" &&
       { [ "$want" -ne 0 ] || grep -q "All heap blocks were freed" "$T/vg.$n.log"; }
    then echo "PASS valgrind $name: exit $rc, $errs, $heap"
    else echo "FAIL valgrind $name: exit $rc (want $want), $errs, $heap (log $T/vg.$n.log)"; bad=$((bad + 1)); fi
}
R=$T/tiny.bin
check "export --random" 0 $B/export --random "$R" --dim 48 --hidden 112 --layers 2 --heads 6 --kv-heads 2 --vocab 97 \
    --seq 64 --seed 7
python3 tests/fuzz/gen_seeds.py "$T/gguf"
check "export GGUF (SentencePiece, f32, rope factors)" 0 $B/export "$T/gguf/spm_f32.gguf" "$T/spm.bin"
check "export GGUF (byte-level BPE, f16/bf16)" 0 $B/export "$T/gguf/bpe_smollm.gguf" "$T/bpe.bin"
check "export GGUF (Q2_K..Q6_K)" 0 $B/export "$T/gguf/q_k.gguf" "$T/qk.bin"
check "export GGUF --vocab-only" 0 $B/export --vocab-only "$T/gguf/bpe_gpt2.gguf" "$T/gpt2_vocab.bin"
check "generate 16 ids, full" 0 $B/run "$R" -d cpu -t 0 -n 16 -i "1 2 3"
check "generate 40 ids, sampling, window:8,type=q8" 0 $B/run "$R" -d cpu -t 0.8 -s 1 -n 40 -i "5 6" -kv window:8,type=q8
check "generate 40 ids, h2o:12 pos=cache q4 residual" 0 $B/run "$R" -d cpu -t 0 -n 40 -i 1 -kv h2o:12,type=q4,residual=2,pos=cache
check "generate text (SentencePiece), sink:8" 0 $B/run "$T/spm.bin" -d cpu -t 0 -n 12 -i "the abc 12" -kv sink:8,sinks=2
check "chat (byte-level BPE, ChatML), window:12" 0 $B/run "$T/bpe.bin" -m chat -d cpu -t 0 -n 8 -kv window:12 -i "hello there"
check "tokenize" 0 $B/run "$T/gpt2_vocab.bin" -m tokenize -i "It's 12 o'clock, $(printf '\xff') ok"
printf '10 20 30 40 255 256' >"$T/ids.txt"
printf 'the abc the abc 12 the 1 2 abc' >"$T/text.txt"
check "ppl (SentencePiece), full, window:8 and snapkv" 0 $B/run "$T/spm.bin" -m ppl -d cpu -f "$T/text.txt" -kv full \
    -kv window:8 -kv snapkv:8,prefill=6,obs=2
check "detokenize" 0 $B/run "$T/spm.bin" -m detokenize -f "$T/ids.txt"
check "a GGUF given to run (error exit)" 1 $B/run "$T/gguf/spm_f32.gguf" -n 1 -i 1
check "a bad -kv spec (error exit)" 1 $B/run "$R" -n 1 -i 1 -kv h2o:8,recent=8
S=../shared/data/models/stories260K.bin
if [ -f "$S" ]; then
    check "export stories260K (llama2.c)" 0 $B/export --llama2c "$S" "$T/s260.bin"
    check "stories260K generate 32 tokens, tova:16" 0 $B/run "$T/s260.bin" -d cpu -t 0 -n 32 -kv tova:16
else
    echo "SKIP valgrind stories260K: $S not found"
fi
if [ $bad -eq 0 ]; then echo "valgrind: $n runs clean (no errors, no leaks)"; else echo "valgrind: $bad of $n runs FAILED"; exit 1; fi
