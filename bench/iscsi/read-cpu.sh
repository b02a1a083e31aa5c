#!/usr/bin/env bash
# Server CPU per byte of iSCSI sequential reads, for A/B comparisons of the read path (issue
# 33): one pool filled with random data through iSCSI by the first binary, then, per round and
# per binary in turn, a fresh `serve` of that pool, a warming `qemu-img convert` of the whole
# LUN, and a 10 s iscsi-perf sequential 1 MiB QD8 read, with the server's user+system CPU
# from /proc/PID/stat around it (odd rounds run the binaries in the order given, even rounds
# reversed). Throughput on this 2-core machine swings ±20 % from run to
# run; CPU per byte moves less, and is what a CPU-only change changes.
#
# `--warm N` reads the LUN N more times before the measurement (ibid's read cache admits a
# block on its second miss: `--warm 1` measures it warm).
#
# usage: bench/iscsi/read-cpu.sh [--size SIZE] [--rounds N] [--warm N] IBID...
#   prints: round, binary, seq_MBps, cpu_ms_per_GB
set -euo pipefail

SIZE=1G ROUNDS=3 WARM=0
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --size) SIZE=$2; shift ;;
        --rounds) ROUNDS=$2; shift ;;
        --warm) WARM=$2; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
[ ${#BINS[@]} -gt 0 ] || { echo "give at least one ibid binary" >&2; exit 2; }
SCRATCH=$(mktemp -d /var/tmp/ibid-read-cpu.XXXXXX)
PORT=3273 NBD=10873 IQN=iqn.2026-11.org.ibid:pool
URL="iscsi://127.0.0.1:$PORT/$IQN/0"
PID=""
stop() {
    [ -n "$PID" ] || return 0
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
}
trap 'stop; rm -rf "$SCRATCH"' EXIT
serve() { # serve BIN [ARGS...]
    local bin=$1; shift
    "$bin" serve --data "$SCRATCH/pool" --iscsi "127.0.0.1:$PORT" --nbd "127.0.0.1:$NBD" \
        --http off --no-default-volume "$@" >"$SCRATCH/serve.log" 2>&1 &
    PID=$!
    for _ in $(seq 100); do grep -q 'Ctrl-C stops' "$SCRATCH/serve.log" && return 0; sleep 0.1; done
    echo "serve did not start:" >&2; cat "$SCRATCH/serve.log" >&2; exit 1
}
SIZE_B=$(numfmt --from=iec "$SIZE")
head -c "$SIZE_B" /dev/urandom >"$SCRATCH/data.img"
serve "${BINS[0]}" --volume "data=$SIZE"
qemu-img convert -n -f raw -O raw "$SCRATCH/data.img" "$URL"
stop
rm -f "$SCRATCH/data.img"
TCK=$(getconf CLK_TCK)
echo -e "round\tbinary\tseq_MBps\tcpu_ms_per_GB"
for r in $(seq "$ROUNDS"); do
    # Odd rounds in the order given, even ones reversed: the machine drifts within a round.
    ORDER=("${BINS[@]}")
    if [ $((r % 2)) -eq 0 ]; then
        ORDER=(); for ((i = ${#BINS[@]} - 1; i >= 0; i--)); do ORDER+=("${BINS[$i]}"); done
    fi
    for bin in "${ORDER[@]}"; do
        serve "$bin"
        for _ in $(seq $((WARM + 1))); do
            qemu-img convert -n -f raw "$URL" --target-image-opts "driver=null-co,size=$SIZE_B"
        done
        t0=$(awk '{print $14 + $15}' "/proc/$PID/stat")
        mbs=$(iscsi-perf -m 8 -b 2048 -t 10 -i iqn.2026-11.org.ibid:read-cpu "$URL" 2>&1 \
            | tr '\r' '\n' | grep 'iops average' | tail -1 | sed -E 's/.*\(([0-9]+) MB\/s\).*/\1/')
        t1=$(awk '{print $14 + $15}' "/proc/$PID/stat")
        stop
        echo -e "$r\t$bin\t$mbs\t$(echo "($t1 - $t0) * 1000 / $TCK / ($mbs * 10 / 1024)" | bc -l | xargs printf '%.0f')"
    done
done
