#!/usr/bin/env bash
# Partial-block writes: 2 KiB random writes over NBD at QD16 on a 1 GiB area prefilled with
# 1 MiB writes, so each is a read-modify-write of one 4 KiB block (the engine's single-block
# placement path). Prints IOPS, p99 and the server's CPU per write.
# usage: partial-writes.sh IBID [SERVE_ARGS...]   (env: RUNTIME, default 15 s; see common.sh)
source "$(dirname "$0")/common.sh"
start_ibid "$@"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --size=1G --iodepth=8 \
    --refill_buffers=1 >/dev/null
t0=$(cpu_ticks)
fio --name=p --ioengine=nbd --uri="$URI" --rw=randwrite --bs=2k --size=1G --iodepth=16 \
    --time_based --runtime="${RUNTIME:-15}" --refill_buffers=1 --output-format=json \
    >"$SCRATCH/p.json"
t1=$(cpu_ticks)
python3 - "$SCRATCH/p.json" $((t1 - t0)) <<'PY'
import json, sys
t = open(sys.argv[1]).read()
w = json.loads(t[t.index("{"):])["jobs"][0]["write"]
n = max(w["total_ios"], 1)
print(f"iops={w['iops']:.0f} p99_us={w['clat_ns']['percentile']['99.000000'] / 1000:.0f} "
      f"cpu_us_per_write={int(sys.argv[2]) * 10000 / n:.1f}")
PY
