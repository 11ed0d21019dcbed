# tests/lib.sh: what several shell tests share; source it after setting RUN (./run), M (the model) and tmp (a scratch
# directory).
# expect_error NAME PATTERN ARGS...: ./run M ARGS... must exit 1 with one stderr line (the "run: note" lines aside)
# that holds PATTERN (a fixed string); prints PASS or FAIL with what it saw.
expect_error() {
    local name=$1 pat=$2; shift 2
    "$RUN" "$M" "$@" >/dev/null 2>"$tmp/e"; local rc=$?
    grep -v "^run: note" "$tmp/e" >"$tmp/e1"
    if [ $rc -eq 1 ] && [ "$(wc -l <"$tmp/e1")" -eq 1 ] && grep -qF -- "$pat" "$tmp/e1"; then echo "PASS $name -> $(cat "$tmp/e1")"
    else echo "FAIL $name: rc $rc, stderr: $(head -c 300 "$tmp/e")"; fi
}
