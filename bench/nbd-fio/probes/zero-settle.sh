#!/usr/bin/env bash
# usage: zero-settle.sh IBID [SERVE_ARGS...]
# Writes SIZE (default 8G) of 1 MiB unique blocks, then zeroes the whole 16 GiB export in
# 1 GiB WRITE_ZEROES requests and FLUSHes (timed, as the benchmark's write-zeroes job), then
# stops the server and times its shutdown: the final commit, which settles whatever the
# zeroes left for it (since session 16, every committed entry in the zeroed range). Prints
# both times and the server's CPU in each phase. With AFTER=N, first runs N seconds of 4 KiB
# random writes QD32 right after the zeroes (while the range settles, since session 16) and
# prints their IOPS and worst latencies.
. "$(dirname "$0")/common.sh"
start_ibid "$@"
fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="${SIZE:-8G}" \
    --refill_buffers=1 --randseed=1 --end_fsync=1 --output-format=json > "$SCRATCH/w.json"
c0=$(cpu_ticks)
/usr/bin/python3 "$(dirname "$0")/../nbdops.py" zero "$URI" $((16 << 30)) $((1 << 30)) \
    "$SCRATCH/zero.json" > /dev/null
zero_s=$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("%.3f" % (r["zero_s"] + r["flush_s"]))' \
    "$SCRATCH/zero.json")
c1=$(cpu_ticks)
if [ -n "${AFTER:-}" ]; then
    fio --name=r --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=4G \
        --norandommap --refill_buffers=1 --randseed=3 --time_based --runtime="$AFTER" \
        --lat_percentiles=1 --output-format=json > "$SCRATCH/r.json"
    fio_json "$SCRATCH/r.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']; p = w['clat_ns']['percentile']
print('random writes after the zeroes: %.0f IOPS, p99.9 %.1f ms, max %.1f ms' % (w['iops'],
      p['99.900000'] / 1e6, w['clat_ns']['max'] / 1e6))"
fi
t=$(date +%s.%N)
kill -TERM "$PID"; wait "$PID" || true
stop_s=$(echo "$(date +%s.%N) - $t" | bc)
echo "zero 16 GiB + flush: ${zero_s} s (server CPU $(echo "($c1 - $c0) / 100" | bc -l | xargs printf %.2f) s);" \
     "shutdown (final commit): ${stop_s} s"
