#!/usr/bin/env bash
# usage: rewrite-passes.sh IBID PASSES [PASS...]
# Issue 31's goal 1 pass by pass: PASSES passes of rewrite.sh's shape (1 MiB sequential writes
# of new unique data, QD8, over the same 2 GiB of a 16 GiB volume, a seed per pass) on one
# server; prints MB/s and the server's CPU per MB of each pass, then the commit thread's
# (`ibid-background`) CPU ticks over all of them. Each PASS listed is recorded with
# `perf record --call-graph dwarf` into $PERF_DIR/perf.passN.data (default /var/tmp).
. "$(dirname "$0")/common.sh"
bin=$1; passes=$2; shift 2
profiled=" $* "
start_ibid "$bin"
for pass in $(seq "$passes"); do
    if [[ "$profiled" == *" $pass "* ]]; then
        perf record -F 299 --call-graph dwarf,32768 -p "$PID" \
            -o "${PERF_DIR:-/var/tmp}/perf.pass$pass.data" > /dev/null 2>&1 & PP=$!
    fi
    c0=$(cpu_ticks)
    fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=2G \
        --refill_buffers=1 --randseed="$pass" --end_fsync=1 --output-format=json > "$SCRATCH/w.json"
    c1=$(cpu_ticks)
    if [[ "$profiled" == *" $pass "* ]]; then kill -INT "$PP"; wait "$PP" || true; fi
    echo "pass $pass $(fio_json "$SCRATCH/w.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']; cpu = ($c1 - $c0) / 100
print('%.0f MB/s %.2f ms/MB' % (w['bw_bytes'] / 1e6, cpu * 1e3 / (w['io_bytes'] / 1e6)))")"
done
for t in /proc/"$PID"/task/*; do
    [ "$(cat "$t/comm")" = ibid-background ] && echo "commit thread CPU ticks $(awk '{print $14 + $15}' "$t/stat")"
done
