#!/usr/bin/env bash
# usage: store-bytes.sh IBID
# Issue 31's goal 5 (metadata bytes written per 4 KiB block) without strace: a 16 GiB volume
# filled with 1 MiB sequential unique writes, then SECS (default 300) s of 4 KiB random
# overwrites of unique data at QD32; the metadata store's bytes come from the commits' debug
# lines (`N KiB to the store; after ... and M KiB applying the cleaner's moves`: the redb
# backend counts what it writes), summed over the commits that ended during the overwrites and
# divided by the blocks fio wrote. `metadata-bytes.sh` counts the same bytes with `strace`,
# which slows the server enough (every write call stops it) to change how many blocks each
# commit carries, and so the figure: use this one for steady-state comparisons.
set -eu
IBID=$1 SECS=${SECS:-300}
S=$(mktemp -d /var/tmp/ibid-store-bytes.XXXXXX)
RUST_LOG=ibid_engine=debug,info $IBID serve --data $S/pool --nbd 127.0.0.1:10873 --iscsi off --http 127.0.0.1:7873 --no-default-volume --volume v=16G >$S/server.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf $S' EXIT
for i in $(seq 200); do grep -q 'Ctrl-C stops' $S/server.log && break; sleep 0.1; done
fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:10873/v --rw=write --bs=1M --iodepth=8 --size=16G --refill_buffers=1 --randseed=1 --end_fsync=1 >/dev/null
sleep 3
T0=$(python3 -c 'import datetime; print(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f"))')
fio --name=r --ioengine=nbd --uri=nbd://127.0.0.1:10873/v --rw=randwrite --bs=4k --iodepth=32 --size=16G --time_based=1 --runtime=$SECS --refill_buffers=1 --randrepeat=0 --norandommap=1 --end_fsync=1 --output-format=json > $S/r.json
T1=$(python3 -c 'import datetime; print(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f"))')
python3 - $S/server.log $S/r.json $T0 $T1 <<'PY'
import re,sys,json
log,rj,t0,t1=sys.argv[1:5]
t=open(rj).read(); w=json.loads(t[t.index("{"):])["jobs"][0]["write"]
blocks=w["io_bytes"]//4096
kib=mk=n=ent=0; ms=0.0
for l in open(log):
    m=re.search(r'^(\S+)Z DEBUG ibid_engine::commit: commit (\d+): (\d+) map entries.*?, ([\d.]+) ms .*?, (\d+) KiB to the store; after ([\d.]+) ms and (\d+) KiB',l)
    if m and t0 <= m.group(1) <= t1:
        n+=1; ent+=int(m.group(3)); ms+=float(m.group(4)); kib+=int(m.group(5)); mk+=int(m.group(7))
print(f"iops {w['iops']:.0f} max_lat_ms {w['clat_ns']['max']/1e6:.1f} blocks {blocks} commits {n} mean_entries {ent/max(n,1):.0f} commit_ms_mean {ms/max(n,1):.0f} store B/blk {(kib+mk)*1024/blocks:.1f} (commits {kib*1024/blocks:.1f}, moves {mk*1024/blocks:.1f})")
PY
