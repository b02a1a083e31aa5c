#!/usr/bin/env bash
# usage: qd1-flush.sh IBID [SERVE_ARGS...]
# 1 GiB written, then 15 s of 4 KiB random writes at QD1 each followed by a FLUSH (fio
# fsync=1); prints pairs/s, write and flush p50, server CPU and context switches per request
# (session 15's runtime-size pairs).
. "$(dirname "$0")/common.sh"
start_ibid "$@"
fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=1G \
    --refill_buffers=1 --end_fsync=1 > /dev/null
sleep 3
c0=$(cpu_ticks); x0=$(ctx_switches)
fio --name=q --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=1 --fsync=1 --size=1G \
    --norandommap --refill_buffers=1 --randseed=5 --time_based --runtime=15 \
    --output-format=json > "$SCRATCH/q.json"
c1=$(cpu_ticks); x1=$(ctx_switches)
fio_json "$SCRATCH/q.json" | python3 -c "
import json, sys; j = json.load(sys.stdin); w = j['write']; s = j['sync']; n = w['total_ios']
p = lambda l: l['percentile']['50.000000'] / 1e3 if 'percentile' in l else l['mean'] / 1e3
print('pairs/s %.0f  write p50 %.0f us  flush p50 %.0f us  server CPU/pair %.0f us  context switches/pair %.1f' % (
    w['iops'], p(w['clat_ns']), p(s['lat_ns']), ($c1 - $c0) * 1e4 / n, ($x1 - $x0) / n))"
