#!/usr/bin/env bash
# kvlab's model-vs-model KL against llama.cpp's (tests/golden/smollm2/kl_q8.txt; how it was made: tests/golden/README.md):
# build/kl_models --ctx 512 --chunks 4, llama-perplexity's chunks and scored positions (the second half of each
# chunk), on SmolLM2's f32 weights and on ./export --wtype q8's, over the same 12,000 bytes of the Debian Reference,
# against llama-perplexity --kl-divergence between its F32 and Q8_0 GGUFs. Same direction, KL(p_f32 ‖ p_q8).
# Both programs' q8 weights are the same bytes (all 4,202,496 blocks compared when the golden was made); their
# activations are quantized with an f32 scale (kvlab) and an f16 one (ggml), and after 30 layers that difference
# leaves the two q8 runs' rounding noise nearly independent (KL between the two q8 runs: 0.00229, almost the KL of
# each to f32). The tolerance is therefore statistical, measured when the golden was made: the per-token difference
# kvlab − llama.cpp over the 1,020 scored tokens has a standard error of its mean of 8.68e-5; 4 of them (3.47e-4), plus
# the bias of llama.cpp's estimator (its 16-bit base log-probs and the terms below e^-16 it drops: +1.1e-5 when applied to
# kvlab's own logits) and its 6-decimal print (5e-7): 3.6e-4. Measured: 0.002608 vs 0.002729, |Δ| 1.21e-4 (1.4 standard
# errors). The direction is not resolved at this size (the reverse KL is 0.002621): tests/test_metrics.c checks it.
# The f32 perplexity over the same positions also matches llama-perplexity's final estimate (6.6823): that checks the
# positions scored. SKIPs without the model, the GGUF or the Debian Reference (or another version of it), and under
# KVLAB_SANITIZE (minutes under ASan; the normal build runs it).
set -u
cd "$(dirname "$0")/.."
EXPORT=${KVLAB_EXPORT:-./export}
KLM=build/kl_models
M=models/smollm2-135m-instruct.bin
G=.cache/SmolLM2-135M-Instruct.Q4_1.gguf
TEXT=/usr/share/debian-reference/debian-reference.en.txt.gz
GOLD=tests/golden/smollm2/kl_q8.txt
tmp=tests/tmp/smol_kl; rm -rf "$tmp"; mkdir -p "$tmp"
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP KL golden under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
if [ ! -f "$M" ] || [ ! -f "$G" ] || [ ! -f "$TEXT" ]; then
    echo "SKIP KL golden: $M, $G or $TEXT missing (make model; apt-get install debian-reference-en)"; exit 0
fi
[ -x "$KLM" ] || { echo "FAIL KL golden: $KLM is missing (make builds it)"; exit 0; }
gold() { awk -v k="$1" '$1 == k { print $2 }' "$GOLD"; }
zcat "$TEXT" | head -c "$(gold text_bytes)" >"$tmp/text.txt"
if [ "$(sha256sum <"$tmp/text.txt" | cut -d' ' -f1)" != "$(gold text_sha256)" ]; then
    echo "SKIP KL golden: this Debian Reference's first $(gold text_bytes) bytes differ from the golden's text"; exit 0
fi
"$EXPORT" "$G" "$tmp/q8.bin" --wtype q8 >/dev/null 2>"$tmp/err" || { echo "FAIL export --wtype q8: $(cat "$tmp/err")"; exit 0; }
"$KLM" --ctx "$(gold n_ctx)" --chunks "$(gold chunks)" "$M" "$tmp/q8.bin" "$tmp/text.txt" >"$tmp/out" 2>>"$tmp/err"
rc=$?
rm -f "$tmp/q8.bin"
kl=$(sed -n 's/^kl_models: kl_mean \([^ ]*\) tokens .*/\1/p' "$tmp/out")
n=$(sed -n 's/^kl_models: kl_mean [^ ]* tokens \([0-9]*\)$/\1/p' "$tmp/out")
ppl=$(sed -n 's/^  A .*: ppl \([0-9.]*\)$/\1/p' "$tmp/out")
if [ $rc -ne 0 ] || [ -z "$kl" ]; then echo "FAIL kl_models: exit $rc: $(tail -3 "$tmp/out" "$tmp/err")"; exit 0; fi
want=$(gold mean_kld)
if awk -v g="$kl" -v w="$want" -v n="$n" -v wn="$(gold scored_tokens)" \
        'BEGIN { d = g - w; if (d < 0) d = -d; exit !(n == wn && d <= 3.6e-4) }'; then
    echo "PASS KL(p_f32 ‖ p_q8) on SmolLM2, n_ctx 512 x 4 chunks, second halves: kvlab $kl vs llama-perplexity $want over $n tokens (|Δ| $(awk -v g="$kl" -v w="$want" 'BEGIN { d = g - w; printf "%.2g", d < 0 ? -d : d }') <= 3.6e-4)"
else echo "FAIL KL(p_f32 ‖ p_q8): kvlab '$kl' over '$n' tokens vs llama-perplexity $want over $(gold scored_tokens) (tolerance 3.6e-4)"; fi
# the f32 side's perplexity over the same positions: llama-perplexity prints 4 decimals (5e-5), and the two engines'
# f32 logits differ by at most 2.6e-5 (tests/golden/README.md, smollm2/), so each NLL by at most 5.2e-5 and the
# perplexity by 6.7 * 5.2e-5 = 3.5e-4; kl_models prints 4 decimals too: 4.5e-4 in all
wp=$(gold ppl_f32_final_estimate)
if awk -v g="$ppl" -v w="$wp" 'BEGIN { d = g - w; if (d < 0) d = -d; exit !(g != "" && d <= 4.5e-4) }'; then
    echo "PASS perplexity of the f32 weights over the same positions: $ppl vs llama-perplexity's $wp"
else echo "FAIL perplexity over llama-perplexity's positions: '$ppl' vs $wp"; fi
exit 0
