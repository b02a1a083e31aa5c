#!/usr/bin/env bash
# usage: flatten-stall.sh IBID [SERVE_ARGS...]
# What a host's writes feel while a deleted snapshot's layer is flattened: writes SIZE
# (default 4G) of 1 MiB unique blocks to volume `bench`, takes a snapshot, rewrites the same
# SIZE with other unique data (the top layer then holds as many entries as the frozen one),
# then runs 4 KiB random writes at QD1 to another volume of the pool for RUNTIME (default 30)
# seconds and deletes the snapshot DELAY (default 3) seconds in: the background merges the two
# layers of `bench` meanwhile. Prints the writes' IOPS and latencies (p99, p99.9, max), the
# same for a run with no snapshot deleted, on the same server just before, as the baseline,
# and what the server logged about flattening (RUST_LOG=ibid_engine=debug).
# WORK=copy instead copies `bench` (filled once) to a new volume `dst` (`ibid volume copy`, a
# range copy by frames) DELAY seconds in: the background makes that copy permanent 5 s later,
# which is what the writes then feel. FSYNC=N flushes after every N writes (0: never), as a
# database's log does. TARGET=bench writes to the volume being merged instead of another.
# WORK=delete deletes `bench` (filled once) DELAY seconds in, and prints how long the delete
# took: the writes then feel its layer's entries being deleted. QD=N runs the random writes at
# queue depth N (default 1).
HTTP=${HTTP:-127.0.0.1:18990}
export RUST_LOG=${RUST_LOG:-info,ibid_engine::snapshot=debug,ibid_engine::copy=debug}
. "$(dirname "$0")/common.sh"
BIN=$1
start_ibid "$@"
cli() { "$BIN" --server "http://$HTTP" "$@"; }
SIZE=${SIZE:-4G} RUNTIME=${RUNTIME:-30} DELAY=${DELAY:-3} WORK=${WORK:-flatten} FSYNC=${FSYNC:-0}
TARGET=${TARGET:-other} QD=${QD:-1}
fill() {
    fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
        --refill_buffers=1 --randseed="$1" --end_fsync=1 --output-format=json > /dev/null
}
writes() {
    fio --name=r --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$TARGET" --rw=randwrite --bs=4k --iodepth="$QD" --size="$SIZE" \
        --norandommap --refill_buffers=1 --randseed="$1" --time_based --runtime="$RUNTIME" --fsync="$FSYNC" \
        --lat_percentiles=1 --output-format=json > "$SCRATCH/r.json"
    fio_json "$SCRATCH/r.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']; p = w['clat_ns']['percentile']
print('%s: %.0f IOPS, p99 %.2f ms, p99.9 %.1f ms, max %.1f ms' % (sys.argv[1], w['iops'],
      p['99.000000'] / 1e6, p['99.900000'] / 1e6, w['clat_ns']['max'] / 1e6))" "$2"
}
cli volume create other --size "$SIZE" > /dev/null
fill 1
if [ "$WORK" = copy ]; then
    cli volume create dst --size 16G > /dev/null  # the size of `bench` (common.sh)
    writes 3 "random writes, no copy"
    ( sleep "$DELAY"; cli volume copy bench dst > /dev/null ) &
    WORKER=$!
    writes 4 "random writes, bench copied to dst after ${DELAY} s"
elif [ "$WORK" = delete ]; then
    writes 3 "random writes, nothing deleted"
    ( sleep "$DELAY"; t0=$(date +%s%3N); cli volume delete bench > /dev/null
      echo "volume delete bench: $(( $(date +%s%3N) - t0 )) ms" ) &
    WORKER=$!
    writes 4 "random writes, bench deleted after ${DELAY} s"
else
    cli snapshot create bench old > /dev/null
    fill 2
    writes 3 "random writes, no flattening"
    ( sleep "$DELAY"; cli snapshot delete bench old > /dev/null ) &
    WORKER=$!
    writes 4 "random writes, the snapshot deleted after ${DELAY} s"
fi
wait "$WORKER"
sleep 1
grep -a "flatten\|materialize\|discard" "$SCRATCH/log" || echo "(nothing logged about flattening, copies or discards)"
