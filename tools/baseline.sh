#!/usr/bin/env bash
# A refactor must change no result. This script writes the outputs that say so, for a ./run binary ($KVLAB_RUN, default
# ./run) into a directory: -tokenlog files of the nine policies at budget 256 (snapkv prefill=512) in four storage and
# position variants (f32, q8, q4 with residual=32, pos=cache) over the first 2,048 tokens of the Debian Reference,
# -c 2048, at -chunk 1 and 64 on 1 thread and -chunk 64 on 2 threads, and the greedy ids of generate and chat.
# Then `sha256sum DIR/*` of two builds (before and after a change) must be equal line for line. kvlab's own output is
# the reference here only for "nothing changed"; golden values of correctness come from independent tools (tests/).
# Usage: KVLAB_RUN=/path/to/run tools/baseline.sh OUTDIR       (about two hours on 2 cores; prints progress)
# BASELINE_CFGS (default "1:1 64:1 64:2", CHUNK:THREADS) and BASELINE_VARIANTS (default "f32 q8 q4r32 cache") run a
# part of the set; a file already in OUTDIR is kept, so a later call with the rest completes it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/baseline.sh OUTDIR}
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
[ -f "$M" ] || { echo "baseline: $M missing: make model" >&2; exit 1; }
ref=/usr/share/debian-reference/debian-reference.en.txt.gz
[ -f "$ref" ] || { echo "baseline: $ref missing: apt-get install debian-reference-en" >&2; exit 1; }
mkdir -p "$out"
text=$out/text.txt
zcat "$ref" | head -c 20000 >"$text" || true   # more than 2,049 tokens; -n 2048 scores the first 2,048 (zcat ends
[ "$(wc -c <"$text")" -eq 20000 ] || { echo "baseline: could not read $ref" >&2; exit 1; }   # on SIGPIPE: || true)

pols="window:256 sink:256 h2o:256 tova:256 scissorhands:256 lru:256 random:256 snapkv:256,prefill=512"
variants="f32: q8:,type=q8 q4r32:,type=q4,residual=32 cache:,pos=cache"
cfgs=${BASELINE_CFGS:-1:1 64:1 64:2}
want=${BASELINE_VARIANTS:-f32 q8 q4r32 cache}
fulls=("full" "full,type=q8" "full,type=q4,residual=32" "full,pos=cache")
i=0
for v in $variants; do
    name=${v%%:*}; suffix=${v#*:}
    args=(-kv "${fulls[$i]}"); i=$((i + 1))
    case " $want " in *" $name "*) ;; *) continue ;; esac
    for p in $pols; do
        case $p in snapkv*) args+=(-kv "snapkv:256${suffix},prefill=512") ;; *) args+=(-kv "$p$suffix") ;; esac
    done
    for cfg in $cfgs; do
        set -- ${cfg/:/ }
        f=$out/ppl_${name}_chunk$1_t$2.tok
        [ -s "$f" ] && { echo "baseline: $f exists, kept" >&2; continue; }
        echo "baseline: $name -chunk $1, $2 thread(s): $(date +%T)" >&2
        OMP_NUM_THREADS=$2 "$RUN" "$M" -m ppl -f "$text" -c 2048 -n 2048 -chunk "$1" "${args[@]}" \
            -tokenlog "$f.tmp" 2>"$out/ppl_${name}_chunk$1_t$2.err" >/dev/null
        mv "$f.tmp" "$f"
    done
done
for p in full sink:32 h2o:32 window:32,type=q8; do
    [ -s "$out/chat_${p//[:,=]/_}.ids" ] && continue
    OMP_NUM_THREADS=2 "$RUN" "$M" -t 0 -n 64 -ids -kv "$p" -i "The capital of France is" 2>/dev/null \
        >"$out/gen_${p//[:,=]/_}.ids"
    OMP_NUM_THREADS=2 "$RUN" "$M" -m chat -t 0 -n 64 -ids -kv "$p" -i "Explain why the sky is blue." 2>/dev/null \
        >"$out/chat_${p//[:,=]/_}.ids"
done
(cd "$out" && sha256sum ./*.tok ./*.ids) | tee "$out/SHA256SUMS"
