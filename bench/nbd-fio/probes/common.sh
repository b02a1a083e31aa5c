# Shared by the probes: start `ibid serve` (BIN, extra args after it) on a fresh pool under
# SCRATCH, wait for its NBD export, and helpers to read its CPU ticks and the disk's counters.
# Env: SCRATCH (default /var/tmp/ibid-probe), PORT (default 10990), DISK (default vda), HTTP
# (ibid's API and /metrics address, default off).
set -euo pipefail
SCRATCH=${SCRATCH:-/var/tmp/ibid-probe}
PORT=${PORT:-10990}
HTTP=${HTTP:-off}
DISK=${DISK:-vda}
URI=nbd://127.0.0.1:$PORT/bench

start_ibid() {
    rm -rf "$SCRATCH"; mkdir -p "$SCRATCH"
    local bin=$1; shift
    "$bin" serve --data "$SCRATCH/pool" --nbd 127.0.0.1:$PORT --iscsi off --http "$HTTP" \
        --volume bench=16G --no-default-volume "$@" > "$SCRATCH/log" 2>&1 &
    PID=$!
    trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; cp "$SCRATCH/log" /tmp/last-probe.log 2>/dev/null; rm -rf "$SCRATCH"' EXIT
    for _ in $(seq 100); do nbdinfo --size "$URI" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "ibid did not start: $(tail -3 "$SCRATCH/log")" >&2; exit 1
}
# start_system SYSTEM [IBID [SERVE_ARGS...]]: `ibid` starts IBID as start_ibid does; `raw` starts
# qemu-nbd serving a 16 GiB raw file with --cache=none --aio=native (the peer of record).
start_system() {
    local system=$1; shift
    case $system in
    ibid) start_ibid "$@" ;;
    raw)
        rm -rf "$SCRATCH"; mkdir -p "$SCRATCH"
        qemu-img create -q -f raw "$SCRATCH/raw.img" 16G
        qemu-nbd -f raw --cache=none --aio=native -x bench -p "$PORT" -b 127.0.0.1 -t \
            "$SCRATCH/raw.img" > "$SCRATCH/log" 2>&1 &
        PID=$!
        trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$SCRATCH"' EXIT
        for _ in $(seq 100); do nbdinfo --size "$URI" >/dev/null 2>&1 && break; sleep 0.1; done ;;
    *) echo "unknown system $system" >&2; exit 2 ;;
    esac
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
ctx_switches() { grep -h ctxt_switches /proc/$PID/task/*/status | awk '{s += $2} END {print s}'; }
disk_reads() { awk -v d="$DISK" '$3 == d {print $4, $6}' /proc/diskstats; }
fio_json() { python3 -c 'import json,sys; t=open(sys.argv[1]).read(); print(json.dumps(json.loads(t[t.index("{"):])["jobs"][0]))' "$1"; }
