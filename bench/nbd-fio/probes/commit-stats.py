#!/usr/bin/env python3
"""usage: commit-stats.py LOG

Summarizes the engine's commit log (`RUST_LOG=ibid_engine::commit=debug`; the probes keep the
last server's log in /tmp/last-probe.log) for the commits that freed chunks and held over 10 Ki
map entries (a random-overwrite phase): their number, the commit time per map entry, entries
and commit time, the idle gap between one commit's end and the next one's start, and the map
entries committed per second."""
import re
import statistics
import sys

LINE = re.compile(r"(\d\d):(\d\d):(\d\d\.\d+)Z.*commit (\d+): (\d+) map entries, (\d+) new chunks, "
                  r"(\d+) chunks freed, ([0-9.]+) ms")
PENDING = re.compile(r"; (\d+) map changes pending")
rows = []
for line in open(sys.argv[1]):
    m = LINE.search(line)
    if m:
        end = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        entries, freed, ms = int(m.group(5)), int(m.group(7)), float(m.group(8))
        p = PENDING.search(line)
        rows.append((end, entries, freed, ms, int(p.group(1)) if p else None))
rows = [r for r in rows if r[1] > 10000 and r[2] > 1000]
if len(rows) < 2:
    sys.exit("fewer than two commits of an overwrite phase in the log")
us = [1e3 * r[3] / r[1] for r in rows]
gaps = [b[0] - b[3] / 1e3 - a[0] for a, b in zip(rows, rows[1:])]
q = statistics.quantiles
print("%d commits; µs per entry p25 %.1f median %.1f p75 %.1f; entries median %d; "
      "commit ms median %.0f max %.0f; gap between commits median %.2f s max %.2f s; "
      "%.0f entries committed per second" % (
          len(rows), q(us, n=4)[0], statistics.median(us), q(us, n=4)[2],
          statistics.median(r[1] for r in rows), statistics.median(r[3] for r in rows),
          max(r[3] for r in rows), statistics.median(gaps), max(gaps),
          sum(r[1] for r in rows[1:]) / (rows[-1][0] - rows[0][0])))
pending = [r[4] for r in rows if r[4] is not None]
if pending:
    print("map changes pending after a commit: median %d, max %d" % (
        statistics.median(pending), max(pending)))
