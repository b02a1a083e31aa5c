#!/usr/bin/env bash
# usage: metadata-bytes.sh IBID [PASSES]
# Issue 31's goal 5 (metadata bytes written per 4 KiB of unique data): PASSES (default 3)
# passes of 1 MiB sequential writes of new unique data over the same SIZE (default 2G) of a
# 16 GiB volume (pass 1 first writes, then rewrites), with `strace` on the server counting the
# bytes each pass writes, by file kind (`redb`: the metadata store; `journal`). With
# RANDOM_SECONDS=N, after those passes, N seconds of 4 KiB random overwrites (QD32) of the same
# area, counted the same way per block written. strace writes one file per thread (`-ff`): in
# one shared file a call another thread interrupts is split into an "unfinished" line and a
# "resumed" one that names no file, and those bytes went uncounted (before session 58 a quarter
# of the segments' bytes and a tenth of `meta.redb`'s under random overwrites); the count of
# such split calls is printed, and should be 0.
set -eu
IBID=$1 PASSES=${2:-3} SIZE=${SIZE:-2G} RANDOM_SECONDS=${RANDOM_SECONDS:-0}
S=$(mktemp -d "${TMPDIR:-/var/tmp}/ibid-metabytes.XXXXXX")
$IBID serve --data $S/pool --nbd 127.0.0.1:10872 --iscsi off --http 127.0.0.1:7872 --no-default-volume --volume v=16G >$S/server.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf $S' EXIT
for i in $(seq 200); do grep -q 'Ctrl-C stops' $S/server.log && break; sleep 0.1; done
count() { # count STRACE_PREFIX LABEL BLOCKS
  python3 - "$@" <<'PY'
import sys, re, collections, glob
c=collections.Counter()
lines=(l for f in glob.glob(sys.argv[1] + '.*') for l in open(f, errors='replace'))
for line in lines:
    if 'unfinished' in line or 'resumed' in line:
        c['unmatched calls']+=1
        continue
    m=re.search(r'^(\w+)\((\d+)<([^>]*)>.*=\s+(\d+)$', line.strip())
    if not m: continue
    path=m.group(3)
    kind='redb' if path.endswith('.redb') else 'journal' if '/journal' in path else 'segment' if path.endswith('.seg') else 'socket' if 'socket' in path or 'TCP' in path else 'other:'+path.split('/')[-1][:20]
    c[kind]+=int(m.group(4))
blocks=float(sys.argv[3])
unmatched=c.pop('unmatched calls', 0)
print(sys.argv[2], ' '.join(f'{k} {v/blocks:.1f} B/blk' for k,v in sorted(c.items()) if not k.startswith('socket')), f'(calls split: {unmatched})')
PY
}
size_blocks=$(python3 -c "import sys; s=sys.argv[1]; u={'K':1<<10,'M':1<<20,'G':1<<30}; print(int(s[:-1])*u[s[-1]]//4096)" $SIZE)
for pass in $(seq $PASSES); do
  strace -ff -p $PID -e trace=pwrite64,pwritev,pwritev2,write,writev -y -o $S/st.$pass -qq 2>/dev/null & SP=$!
  sleep 1
  fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:10872/v --rw=write --bs=1M --iodepth=8 --size=$SIZE --refill_buffers=1 --randseed=$pass --end_fsync=1 >/dev/null
  sleep 3
  kill $SP; wait $SP 2>/dev/null || true
  count $S/st.$pass "pass $pass" $size_blocks
done
if [ "$RANDOM_SECONDS" -gt 0 ]; then
  strace -ff -p $PID -e trace=pwrite64,pwritev,pwritev2,write,writev -y -o $S/st.random -qq 2>/dev/null & SP=$!
  sleep 1
  fio --name=r --ioengine=nbd --uri=nbd://127.0.0.1:10872/v --rw=randwrite --bs=4k --iodepth=32 --size=$SIZE --time_based=1 --runtime=$RANDOM_SECONDS --refill_buffers=1 --randrepeat=0 --norandommap=1 --end_fsync=1 --output-format=json > $S/r.json
  sleep 3
  kill $SP; wait $SP 2>/dev/null || true
  blocks=$(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); print(json.loads(t[t.index("{"):])["jobs"][0]["write"]["io_bytes"]//4096)' $S/r.json)
  count $S/st.random "random 4 KiB overwrites ($blocks blocks)" $blocks
fi
