#!/usr/bin/env bash
# The Jacobi eigen solver (lowrank.c) against NumPy's eigh (tests/lowrank_eigh.py): seeded random second moments,
# and the real ones of SmolLM2's pre-RoPE keys, kv head 0 of layers 0 and 15 over the first 256 tokens of the Debian
# Reference (test_lowrank --dump-cov). NumPy: the one importable by python3, else installed from PyPI with pip into
# .cache/pylib (as tools/fetch_model.sh fetches the model's wheel with pip); SKIP when neither works. The real
# moments SKIP without the model or the text.
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
T=$bin/test_lowrank
M=models/smollm2-135m-instruct.bin
TEXT=/usr/share/debian-reference/debian-reference.en.txt.gz
tmp=tests/tmp/lowrank_eigh; rm -rf "$tmp"; mkdir -p "$tmp"
[ -x "$T" ] || { echo "FAIL eigh: $T is missing (make $T)"; exit 0; }
if ! python3 -c 'import numpy' 2>/dev/null; then
    export PYTHONPATH=$PWD/.cache/pylib${PYTHONPATH:+:$PYTHONPATH}
    if ! python3 -c 'import numpy' 2>/dev/null; then
        echo "installing NumPy into .cache/pylib (python3 -m pip install --target)"
        python3 -m pip install --disable-pip-version-check -q --target .cache/pylib numpy >"$tmp/pip.log" 2>&1
    fi
    if ! python3 -c 'import numpy' 2>/dev/null; then
        echo "SKIP eigh against NumPy: NumPy is not importable and pip could not install it ($(tail -1 "$tmp/pip.log"))"
        exit 0
    fi
fi
covs=()
if [ -f "$M" ] && [ -f "$TEXT" ] && [ -z "${KVLAB_SANITIZE:-}" ]; then
    zcat "$TEXT" | head -c 4000 >"$tmp/text.txt"
    for layer in 0 15; do
        if "$T" --dump-cov "$M" "$tmp/text.txt" 256 $layer "$tmp/smollm2-keys-layer$layer.txt" 2>"$tmp/err"; then
            covs+=("$tmp/smollm2-keys-layer$layer.txt")
        else echo "FAIL eigh: test_lowrank --dump-cov layer $layer: $(cat "$tmp/err")"; fi
    done
else echo "SKIP eigh on SmolLM2's key moments: $M or $TEXT missing (or the sanitizer build)"; fi
python3 tests/lowrank_eigh.py "$T" "$tmp" "${covs[@]}" || echo "FAIL eigh: tests/lowrank_eigh.py exited $?"
