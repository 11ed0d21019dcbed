#!/usr/bin/env bash
# tests/test_attn_ref.c built as portable C (attn_ref_portable: kv.c and attn_cpu.c with no vector instructions):
# kv_attend_cpu and kv_attend_chunk's scalar code against kv_attend_ref within the f32 bound of
# tests/attn_ref_check.h, over the same grid as the vector build (tests/bin/test_attn_ref). Its PASS/FAIL lines are
# its own; this script only runs it (one thread: the arithmetic does not depend on the thread count,
# tests/test_kv_portable.sh checks that).
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
[ -x "$bin/attn_ref_portable" ] || { echo "FAIL $bin/attn_ref_portable is missing (make test builds it)"; exit 1; }
OMP_NUM_THREADS=1 "$bin/attn_ref_portable"
