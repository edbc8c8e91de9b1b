# Helpers the packaging tests share (sourced).
# A free TCP port on 127.0.0.1 with the next span-1 ports free too.
free_port_block() {
    python3 - "$1" <<'PY'
import random, socket, sys
span = int(sys.argv[1])
def free(p):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return False
    return True
for _ in range(200):
    base = random.randint(20000, 32000 - span)  # below the ephemeral range
    if all(free(base + i) for i in range(span)):
        print(base)
        sys.exit(0)
sys.exit(1)
PY
}

# run_pair NAME SERVER_CMD... -- CLIENT_CMD...: start the server side, then the
# client; both must exit 0 within 60 s.
run_pair() {
    local name=$1; shift
    local server=() client=()
    while [ "$1" != "--" ]; do server+=("$1"); shift; done
    shift
    client=("$@")
    timeout 60 "${server[@]}" > "$work/$name.server.log" 2>&1 &
    local spid=$!
    sleep 0.3
    local crc=0 src=0
    timeout 60 "${client[@]}" > "$work/$name.client.log" 2>&1 || crc=$?
    wait "$spid" || src=$?
    if [ $crc != 0 ] || [ $src != 0 ]; then
        echo "FAIL: $name (server rc $src, client rc $crc)"
        cat "$work/$name.server.log" "$work/$name.client.log"
        return 1
    fi
    echo "ok: $name: $(tail -1 "$work/$name.server.log") / $(tail -1 "$work/$name.client.log")"
}
