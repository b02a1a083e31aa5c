#!/usr/bin/env bash
# usage: random-reads.sh IBID [SERVE_ARGS...]
# 4 GiB of 1 MiB writes, RANDWRITE seconds (default 20; 0: none) of 4 KiB random writes QD32,
# then 20 s of 4 KiB random reads QD32; prints IOPS, server CPU per read, disk reads per
# request (session 15's runtime-size pairs: TOKIO_WORKER_THREADS=2 vs 1, or two builds).
. "$(dirname "$0")/common.sh"
start_ibid "$@"
fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=4G \
    --refill_buffers=1 --randseed=1 --end_fsync=1 --output-format=json > /dev/null
if [ "${RANDWRITE:-20}" != 0 ]; then
    fio --name=rw --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=4G \
        --norandommap --refill_buffers=1 --randseed=3 --time_based --runtime="${RANDWRITE:-20}" \
        --output-format=json > "$SCRATCH/rw.json"
    fio_json "$SCRATCH/rw.json" | python3 -c "
import json, sys; print('randwrite IOPS %.0f' % json.load(sys.stdin)['write']['iops'])"
fi
sleep 5
d0=$(disk_reads); c0=$(cpu_ticks)
fio --name=r --ioengine=nbd --uri="$URI" --rw=randread --bs=4k --iodepth=32 --size=4G \
    --norandommap --randseed=4 --time_based --runtime=20 --output-format=json > "$SCRATCH/r.json"
d1=$(disk_reads); c1=$(cpu_ticks)
fio_json "$SCRATCH/r.json" | python3 -c "
import json, sys; r = json.load(sys.stdin)['read']; n = r['total_ios']; cpu = ($c1 - $c0) / 100
d0 = '$d0'.split(); d1 = '$d1'.split(); reads = int(d1[0]) - int(d0[0])
print('randread IOPS %.0f  server CPU %.1f us/read  disk reads/request %.2f  p50 %.0f us' % (
    r['iops'], cpu / n * 1e6, reads / n, r['clat_ns']['percentile']['50.000000'] / 1e3))"
