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
rows = []
for line in open(sys.argv[1]):
    m = LINE.search(line)
    if m:
        end = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        entries, freed, ms = int(m.group(5)), int(m.group(7)), float(m.group(8))
        rows.append((end, entries, freed, ms))
rows = [r for r in rows if r[1] > 10000 and r[2] > 1000]
if len(rows) < 2:
    sys.exit("fewer than two commits of an overwrite phase in the log")
us = [1e3 * ms / entries for _, entries, _, ms in rows]
gaps = [b[0] - b[3] / 1e3 - a[0] for a, b in zip(rows, rows[1:])]
q = statistics.quantiles
print("%d commits; µs per entry p25 %.1f median %.1f p75 %.1f; entries median %d; "
      "commit ms median %.0f max %.0f; gap between commits median %.2f s max %.2f s; "
      "%.0f entries committed per second" % (
          len(rows), q(us, n=4)[0], statistics.median(us), q(us, n=4)[2],
          statistics.median(r[1] for r in rows), statistics.median(r[3] for r in rows),
          max(r[3] for r in rows), statistics.median(gaps), max(gaps),
          sum(r[1] for r in rows[1:]) / (rows[-1][0] - rows[0][0])))
