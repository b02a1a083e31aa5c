#!/usr/bin/env bash
# usage: breakdown.sh IBID [SERVE_ARGS...]
# What the space breakdown's walk costs (`POST /api/v1/pool/breakdown`, the computation the
# server otherwise runs in the background): SIZE (default 16G) of the volume filled with 1 MiB
# sequential writes of unique data, then the breakdown asked for ROUNDS (default 3) times on the
# quiet pool. Prints each call's time and the server CPU it took.
HTTP=${HTTP:-127.0.0.1:7899}
. "$(dirname "$0")/common.sh"
[ $# -ge 1 ] || { sed -n '2,6p' "$0"; exit 2; }
bin=$1; shift
SIZE=${SIZE:-16G}
ROUNDS=${ROUNDS:-3}
start_ibid "$bin" "$@"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
    --refill_buffers=1 --end_fsync=1 > /dev/null
sleep 3
for _ in $(seq "$ROUNDS"); do
    c0=$(cpu_ticks)
    t=$(curl -s -X POST -H 'X-Ibid-Request: 1' -o /dev/null -w '%{time_total}' "http://$HTTP/api/v1/pool/breakdown")
    c1=$(cpu_ticks)
    printf 'breakdown of %s: %.2f s, server CPU %d ms\n' "$SIZE" "$t" "$(( (c1 - c0) * 10 ))"
done
