#!/usr/bin/python3
"""NBD operations fio's nbd engine cannot issue, driven through libnbd (python3-libnbd).

  nbdops.py fua   URI SECONDS REGION_BYTES OUT.json
      4 KiB writes at random 4 KiB-aligned offsets inside [0, REGION_BYTES), queue depth 1, every
      write with NBD_CMD_FLAG_FUA (real FUA, not write+flush).  Each write carries fresh
      os.urandom data (generated before the timer starts for that write), so nothing dedups.
      Latency = h.pwrite() call to return (libnbd synchronous call: send + wait for the reply).

  nbdops.py zero  URI TOTAL_BYTES CHUNK_BYTES OUT.json
      NBD_CMD_WRITE_ZEROES over [0, TOTAL_BYTES) in CHUNK_BYTES requests, issued back to back
      (queue depth 1, no NO_HOLE, no FAST_ZERO), then one NBD_CMD_FLUSH.  Reports MB/s of the
      zeroes alone and of zeroes + flush.

Run it with the system Python (/usr/bin/python3): the libnbd bindings live there.
"""
import json
import os
import random
import sys
import time

import nbd


def pct(sorted_vals, p):
    if not sorted_vals:
        return 0.0
    k = min(len(sorted_vals) - 1, max(0, int(round(p / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[k]


def connect(uri):
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def fua(uri, seconds, region, out):
    h = connect(uri)
    if not h.can_fua():
        raise SystemExit(f"{uri}: server does not advertise FUA")
    rng = random.Random(42)
    blocks = region // 4096
    lats = []
    t_end = time.monotonic() + seconds
    t_start = time.monotonic()
    while True:
        buf = os.urandom(4096)
        off = rng.randrange(blocks) * 4096
        t0 = time.perf_counter_ns()
        h.pwrite(buf, off, nbd.CMD_FLAG_FUA)
        t1 = time.perf_counter_ns()
        lats.append(t1 - t0)
        if time.monotonic() >= t_end:
            break
    elapsed = time.monotonic() - t_start
    h.shutdown()
    lats.sort()
    res = {
        "op": "write+FUA", "bs": 4096, "qd": 1, "ios": len(lats),
        "elapsed_s": elapsed, "iops": len(lats) / elapsed,
        "mean_us": sum(lats) / len(lats) / 1000.0,
        "p50_us": pct(lats, 50) / 1000.0, "p99_us": pct(lats, 99) / 1000.0,
        "max_us": lats[-1] / 1000.0,
    }
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps(res))


def zero(uri, total, chunk, out):
    h = connect(uri)
    if not h.can_zero():
        raise SystemExit(f"{uri}: server does not advertise WRITE_ZEROES")
    size = h.get_size()
    total = min(total, size)
    t0 = time.perf_counter()
    off = 0
    n = 0
    while off < total:
        ln = min(chunk, total - off)
        h.zero(ln, off)
        off += ln
        n += 1
    t1 = time.perf_counter()
    h.flush()
    t2 = time.perf_counter()
    h.shutdown()
    res = {
        "op": "write_zeroes", "bytes": total, "chunk": chunk, "requests": n,
        "zero_s": t1 - t0, "flush_s": t2 - t1,
        "zero_MBps": total / (t1 - t0) / 1e6,
        "zero_flush_MBps": total / (t2 - t0) / 1e6,
    }
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    a = sys.argv
    if len(a) == 6 and a[1] == "fua":
        fua(a[2], float(a[3]), int(a[4]), a[5])
    elif len(a) == 6 and a[1] == "zero":
        zero(a[2], int(a[3]), int(a[4]), a[5])
    else:
        raise SystemExit(__doc__)
