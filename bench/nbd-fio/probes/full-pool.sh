#!/usr/bin/env bash
# usage: full-pool.sh IBID [SERVE_ARGS...]
# Issue 31's goal 6: 4 KiB random overwrites of unique data (QD32, RUNTIME s, default 120) over
# an 8 GiB volume filled with unique data, once on a pool with room to spare (40 GiB) and once
# on a pool that volume fills to FULL_PCT (default 80) %, the cleaner working. Prints IOPS per
# case, the full pool's ratio to the roomy one, and the write amplification: bytes the
# device wrote (/proc/diskstats, DISK) ÷ bytes the client wrote, during the random writes.
# CASES=full runs the full pool alone (prints its IOPS and amplification).
. "$(dirname "$0")/common.sh"
bin=$1; shift
RUNTIME=${RUNTIME:-120}
FULL_PCT=${FULL_PCT:-80}
disk_written() { awk -v d="$DISK" '$3 == d {print $10 * 512}' /proc/diskstats; }
run() {
    local capacity=$1; shift
    start_ibid "$bin" --capacity "$capacity" --volume bench2=8G "$@"
    local uri=nbd://127.0.0.1:$PORT/bench2
    fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size=8G \
        --refill_buffers=1 --randseed=21 --end_fsync=1 > /dev/null
    local w0; w0=$(disk_written)
    fio --name=rw --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --iodepth=32 --size=8G \
        --time_based=1 --runtime="$RUNTIME" --refill_buffers=1 --randrepeat=0 --norandommap=1 \
        --end_fsync=1 --output-format=json > "$SCRATCH/rw.json"
    local w1; w1=$(disk_written)
    fio_json "$SCRATCH/rw.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']
print('%.0f %.2f' % (w['iops'], ($w1 - $w0) / w['io_bytes']))"
    kill "$PID"; wait "$PID" 2>/dev/null || true
}
full_capacity="$(( 8 * 100 / FULL_PCT ))G"
if [ "${CASES:-roomy full}" = full ]; then
    set -- $(run "$full_capacity" "$@")
    echo "${FULL_PCT} % full: $1 IOPS, write amplification $2"
    exit 0
fi
roomy=$(run 40G "$@")
full=$(run "$full_capacity" "$@")
set -- $roomy $full
echo "roomy pool: $1 IOPS, write amplification $2; ${FULL_PCT} % full: $3 IOPS, write amplification $4; ratio $(python3 -c "print('%.2f' % ($3 / $1))")"
