#!/usr/bin/env bash
# usage: metadata-bytes.sh IBID [PASSES]
# Issue 31's goal 5 (metadata bytes written per 4 KiB of unique data): PASSES (default 3)
# passes of 1 MiB sequential writes of new unique data over the same 2 GiB of a 16 GiB volume
# (pass 1 first writes, then rewrites), with `strace` on the server counting the bytes each
# pass writes, by file kind (`redb`: the metadata store; `journal`). Segment writes made through
# the asynchronous I/O path are not all seen by strace: their figure is partial.
set -eu
IBID=$1 PASSES=${2:-3}
S=$(mktemp -d "${TMPDIR:-/var/tmp}/ibid-metabytes.XXXXXX")
$IBID serve --data $S/pool --nbd 127.0.0.1:10872 --iscsi off --http 127.0.0.1:7872 --no-default-volume --volume v=16G >$S/server.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf $S' EXIT
for i in $(seq 200); do grep -q 'Ctrl-C stops' $S/server.log && break; sleep 0.1; done
for pass in $(seq $PASSES); do
  strace -f -p $PID -e trace=pwrite64,pwritev,pwritev2,write,writev -y -o $S/st.$pass -qq 2>/dev/null & SP=$!
  sleep 1
  fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:10872/v --rw=write --bs=1M --iodepth=8 --size=2G --refill_buffers=1 --randseed=$pass --end_fsync=1 >/dev/null
  sleep 3
  kill $SP; wait $SP 2>/dev/null || true
  python3 - $S/st.$pass $pass <<'PY'
import sys, re, collections
c=collections.Counter()
for line in open(sys.argv[1], errors='replace'):
    m=re.search(r'^\d+\s+(\w+)\((\d+)<([^>]*)>.*=\s+(\d+)$', line.strip())
    if not m: continue
    path=m.group(3)
    kind='redb' if path.endswith('.redb') else 'journal' if '/journal' in path else 'segment' if path.endswith('.seg') else 'socket' if 'socket' in path or 'TCP' in path else 'other:'+path.split('/')[-1][:20]
    c[kind]+=int(m.group(4))
blocks=(2<<30)/4096
print('pass', sys.argv[2], ' '.join(f'{k} {v/blocks:.1f} B/blk' for k,v in sorted(c.items()) if not k.startswith('socket')))
PY
done
