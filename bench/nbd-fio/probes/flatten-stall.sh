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
HTTP=${HTTP:-127.0.0.1:18990}
export RUST_LOG=${RUST_LOG:-info,ibid_engine::snapshot=debug}
. "$(dirname "$0")/common.sh"
BIN=$1
start_ibid "$@"
cli() { "$BIN" --server "http://$HTTP" "$@"; }
SIZE=${SIZE:-4G} RUNTIME=${RUNTIME:-30} DELAY=${DELAY:-3}
fill() {
    fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
        --refill_buffers=1 --randseed="$1" --end_fsync=1 --output-format=json > /dev/null
}
writes() {
    fio --name=r --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/other" --rw=randwrite --bs=4k --iodepth=1 --size="$SIZE" \
        --norandommap --refill_buffers=1 --randseed="$1" --time_based --runtime="$RUNTIME" \
        --lat_percentiles=1 --output-format=json > "$SCRATCH/r.json"
    fio_json "$SCRATCH/r.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']; p = w['clat_ns']['percentile']
print('%s: %.0f IOPS, p99 %.2f ms, p99.9 %.1f ms, max %.1f ms' % (sys.argv[1], w['iops'],
      p['99.000000'] / 1e6, p['99.900000'] / 1e6, w['clat_ns']['max'] / 1e6))" "$2"
}
cli volume create other --size "$SIZE" > /dev/null
fill 1
cli snapshot create bench old > /dev/null
fill 2
writes 3 "random writes, no flattening"
( sleep "$DELAY"; cli snapshot delete bench old > /dev/null ) &
DELETER=$!
writes 4 "random writes, the snapshot deleted after ${DELAY} s"
wait "$DELETER"
sleep 1
grep -a "flatten" "$SCRATCH/log" || echo "(nothing logged about flattening)"
