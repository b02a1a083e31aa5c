#!/usr/bin/env bash
# usage: rewrite.sh SYSTEM [IBID [SERVE_ARGS...]]   SYSTEM: ibid | raw (qemu-nbd, raw file,
# --cache=none --aio=native)
# Issue 31's goal 1: PASSES (default 3) passes of 1 MiB sequential writes of new unique,
# incompressible data (QD8) over the same SIZE (default 2G) of a 16 GiB volume, each pass with
# its own seed, so from pass 2 on every write replaces written data. Prints MB/s per pass, the
# server's CPU per MB, and pass N ÷ pass 1.
. "$(dirname "$0")/common.sh"
system=$1; shift
start_system "$system" "$@"
first=
line="$system"
for pass in $(seq "${PASSES:-3}"); do
    c0=$(cpu_ticks)
    fio --name=w --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="${SIZE:-2G}" \
        --refill_buffers=1 --randseed="$pass" --end_fsync=1 --output-format=json > "$SCRATCH/w.json"
    c1=$(cpu_ticks)
    r=$(fio_json "$SCRATCH/w.json" | python3 -c "
import json, sys; w = json.load(sys.stdin)['write']; cpu = ($c1 - $c0) / 100
print('%.0f %.2f' % (w['bw_bytes'] / 1e6, cpu * 1e3 / (w['io_bytes'] / 1e6)))")
    set -- $r
    first=${first:-$1}
    line="$line  pass $pass $1 MB/s ($2 ms CPU/MB, $(python3 -c "print('%.2f' % ($1 / $first))")×)"
done
echo "$line"
