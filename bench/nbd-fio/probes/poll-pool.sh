#!/usr/bin/env bash
# usage: poll-pool.sh IBID QUERY [SERVE_ARGS...]
# What a poller of GET /api/v1/pool costs a busy pool: 8 GiB of the volume filled with 1 MiB
# sequential writes, then RUNTIME (default 60) s of 4 KiB random overwrites QD32 over it while
# curl asks GET /api/v1/pool$QUERY every 5 s, as the dashboard does. QUERY: "" (the exact
# answer: a commit and a fold of the reference log first), "?sync=false" (the figures as of the
# last commit) or "none" (no poller). Prints IOPS, p99 and worst completion latency, and the
# calls' median and worst time.
HTTP=${HTTP:-127.0.0.1:7899}
. "$(dirname "$0")/common.sh"
[ $# -ge 2 ] || { sed -n '2,8p' "$0"; exit 2; }
bin=$1 query=$2; shift 2
RUNTIME=${RUNTIME:-60}
start_ibid "$bin" "$@"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=8G \
    --refill_buffers=1 --end_fsync=1 > /dev/null
calls="$SCRATCH/calls"
: > "$calls"
if [ "$query" != none ]; then
    while sleep 5; do
        curl -s -o /dev/null -w '%{time_total}\n' "http://$HTTP/api/v1/pool$query" \
            >> "$calls" || true
    done &
    POLLER=$!
    # common.sh's exit trap, with the poller stopped first.
    trap 'kill $POLLER $PID 2>/dev/null; wait $PID 2>/dev/null
          cp "$SCRATCH/log" /tmp/last-probe.log 2>/dev/null; rm -rf "$SCRATCH"' EXIT
fi
fio --name=rw --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=8G \
    --time_based=1 --runtime="$RUNTIME" --refill_buffers=1 --randrepeat=0 --norandommap=1 \
    --output-format=json > "$SCRATCH/rw.json"
if [ -n "${POLLER:-}" ]; then
    kill "$POLLER" 2>/dev/null || true
    wait "$POLLER" 2>/dev/null || true
fi
fio_json "$SCRATCH/rw.json" | python3 -c "
import json, statistics, sys
w = json.load(sys.stdin)['write']; lat = w['clat_ns']
calls = [float(x) for x in open('$calls').read().split()]
print('query=%r: %.0f IOPS, p99 %.2f ms, worst %.1f ms; %d calls, median %.3f s, worst %.3f s' % (
    '$query', w['iops'], lat['percentile']['99.000000'] / 1e6, lat['max'] / 1e6, len(calls),
    statistics.median(calls) if calls else 0, max(calls) if calls else 0))"
