#!/usr/bin/env bash
# usage: db-log.sh SYSTEM [IBID [SERVE_ARGS...]]   SYSTEM: ibid | raw (qemu-nbd, raw file,
# --cache=none --aio=native)
# Issue 31's database mix on a 16 GiB volume: DB_GIB (default 2) GiB prefilled with 50 %
# compressible data, then RUNTIME (default 30) s of 3 jobs of 32 KiB random reads and writes
# (58/42, QD4 each) beside one 4 KiB sequential log writer that flushes after every write
# (fio fsync=1). Prints total DB IOPS, the log writer's commits/s and its flush mean, p99 and max.
# Variations: DB_BS (default 32k), DB_JOBS (3), DB_QD (4).
. "$(dirname "$0")/common.sh"
system=$1; shift
DB_GIB=${DB_GIB:-2}
RUNTIME=${RUNTIME:-30}
DB_BS=${DB_BS:-32k}
DB_JOBS=${DB_JOBS:-3}
DB_QD=${DB_QD:-4}
start_system "$system" "$@"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=${DB_GIB}G \
    --refill_buffers=1 --buffer_compress_percentage=50 --randseed=7 --end_fsync=1 > /dev/null
sleep 2
cat > "$SCRATCH/mix.fio" <<JOB
[global]
ioengine=nbd
uri=$URI
time_based=1
runtime=$RUNTIME
refill_buffers=1
buffer_compress_percentage=50
randrepeat=0
norandommap=1
lat_percentiles=1

[db]
rw=randrw
rwmixread=58
bs=$DB_BS
offset=0
size=${DB_GIB}G
iodepth=$DB_QD
numjobs=$DB_JOBS
group_reporting=1

[log]
new_group
rw=write
bs=4k
offset=${DB_GIB}G
size=1G
iodepth=1
fsync=1
JOB
c0=$(cpu_ticks)
fio --output-format=json --output="$SCRATCH/mix.json" "$SCRATCH/mix.fio"
c1=$(cpu_ticks)
python3 - "$SCRATCH/mix.json" "$system" "$((c1 - c0))" "$RUNTIME" <<'PY'
import json, sys
t = open(sys.argv[1]).read(); j = json.loads(t[t.index("{"):])
db = next(x for x in j["jobs"] if x["jobname"] == "db")
lg = next(x for x in j["jobs"] if x["jobname"] == "log")
s = lg["sync"]["lat_ns"]; w = lg["write"]["clat_ns"]
p99 = s.get("percentile", {}).get("99.000000", 0) / 1e6
print("%-4s db %6.0f IOPS  log %5.0f commits/s  write %.2f ms  flush mean %.2f ms p99 %.2f ms max %.1f ms  server CPU %.0f%%" % (
    sys.argv[2], db["read"]["iops"] + db["write"]["iops"], lg["write"]["iops"], w["mean"] / 1e6,
    s["mean"] / 1e6, p99, s["max"] / 1e6, int(sys.argv[3]) / float(sys.argv[4])))
PY
