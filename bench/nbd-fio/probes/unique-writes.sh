#!/usr/bin/env bash
# usage: unique-writes.sh IBID [SERVE_ARGS...]
# 1 MiB sequential writes of unique data (QD8, SIZE, default 8G) on a fresh pool; prints MB/s
# and the server's CPU per MB (session 15's huge-page pairs; alternate two builds).
. "$(dirname "$0")/common.sh"
start_ibid "$@"
c0=$(cpu_ticks)
fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="${SIZE:-8G}" \
    --refill_buffers=1 --randseed=1 --end_fsync=1 --output-format=json > "$SCRATCH/w.json"
c1=$(cpu_ticks)
fio_json "$SCRATCH/w.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']; cpu = ($c1 - $c0) / 100
print('MB/s %.0f  server CPU %.1f s  ms/MB %.2f' % (w['bw_bytes'] / 1e6, cpu, cpu * 1e3 / (w['io_bytes'] / 1e6)))"
