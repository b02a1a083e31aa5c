#!/usr/bin/env bash
# usage: clients.sh SYSTEM [IBID [SERVE_ARGS...]]   SYSTEM: ibid | raw (as in common.sh)
# CLIENTS (default 1) fio jobs, each its own NBD connection, of BS (default 32k) random writes
# at QD (default 32) each for RUNTIME (default 15) s, then the same of random reads, on a
# 2 GiB area prefilled with 50 % compressible data. Prints the total IOPS of each phase.
# (Session 32: one client at 32 KiB, and two clients at 8 KiB with QD=16, measured what the
# NBD server's inline limit for busy servers costs.)
. "$(dirname "$0")/common.sh"
system=$1; shift
CLIENTS=${CLIENTS:-1}
BS=${BS:-32k}
QD=${QD:-32}
RUNTIME=${RUNTIME:-15}
start_system "$system" "$@"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=2G \
    --refill_buffers=1 --buffer_compress_percentage=50 --randseed=7 --end_fsync=1 > /dev/null
out=""
for rw in randwrite randread; do
    fio --name=$rw --ioengine=nbd --uri="$URI" --rw=$rw --bs="$BS" --iodepth="$QD" \
        --numjobs="$CLIENTS" --group_reporting=1 --size=2G --time_based=1 --runtime="$RUNTIME" \
        --refill_buffers=1 --buffer_compress_percentage=50 --norandommap=1 --randrepeat=0 \
        --output-format=json --output="$SCRATCH/$rw.json" > /dev/null
    dir=$([ $rw = randwrite ] && echo write || echo read)
    out="$out $rw $(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print("%.0f IOPS" % j[sys.argv[2]]["iops"])' "$SCRATCH/$rw.json" "$dir")"
done
echo "$system$out"
