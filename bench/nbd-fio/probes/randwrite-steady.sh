#!/usr/bin/env bash
# usage: randwrite-steady.sh SYSTEM [IBID [SERVE_ARGS...]]   SYSTEM: ibid | raw (qemu-nbd, raw
# file, --cache=none --aio=native)
# Issue 31's goal 2: a 16 GiB volume filled with 1 MiB sequential unique writes, then RUNTIME
# (default 600) s of 4 KiB random overwrites of unique data at QD32 over all of it. Prints the
# median of the 1-second IOPS intervals, the worst interval and how many fell below half the
# median, the mean and worst completion latency, the server's CPU and its peak RSS.
. "$(dirname "$0")/common.sh"
system=$1; shift
RUNTIME=${RUNTIME:-600}
start_system "$system" "$@"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=16G \
    --refill_buffers=1 --randseed=11 --end_fsync=1 > /dev/null
c0=$(cpu_ticks)
fio --name=rw --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=16G \
    --time_based=1 --runtime="$RUNTIME" --refill_buffers=1 --randrepeat=0 --norandommap=1 \
    --write_iops_log="$SCRATCH/iops" --log_avg_msec=1000 --output-format=json \
    > "$SCRATCH/rw.json"
c1=$(cpu_ticks)
# The 1-second IOPS log stays for a look afterwards (the scratch directory goes at exit).
cp "$SCRATCH"/iops_iops.*.log /tmp/last-probe-iops.log
hwm=$(awk '/VmHWM/ {print $2}' "/proc/$PID/status")
python3 - "$SCRATCH/rw.json" "$SCRATCH"/iops_iops.*.log "$system" "$((c1 - c0))" "$RUNTIME" "$hwm" <<'PY'
import json, statistics, sys
t = open(sys.argv[1]).read(); j = json.loads(t[t.index("{"):])["jobs"][0]["write"]
iops = [int(l.split(",")[1]) for l in open(sys.argv[2]) if l.strip()]
med = statistics.median(iops)
low = sum(1 for x in iops if x < med / 2)
print("%-4s %d s: IOPS median %.0f (mean %.0f), worst second %d (%.2f× median), %d of %d seconds below half the median;"
      " clat mean %.2f ms, max %.1f ms; server CPU %.0f%%, peak RSS %.0f MiB" % (
    sys.argv[3], len(iops), med, j["iops"], min(iops), min(iops) / med, low, len(iops),
    j["clat_ns"]["mean"] / 1e6, j["clat_ns"]["max"] / 1e6, int(sys.argv[4]) / float(sys.argv[5]),
    int(sys.argv[6]) / 1024))
PY
