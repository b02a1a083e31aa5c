#!/usr/bin/env python3
"""Per thread class of a process over an interval: CPU time, run-queue wait, context switches.

usage: schedstat.py PID SECONDS

Threads are grouped by name with trailing digits dropped (ibid-nbd-0..31 -> ibid-nbd-N).
From /proc/PID/task/*/schedstat (time on a CPU, time runnable but waiting for one, slices),
in cores: 1.00 = one CPU for the whole interval. Session 19 used it during the unique-write
probe: the NBD workers waited 5 cores' worth in the run queue for 0.5 core of CPU.
"""
import collections
import os
import re
import sys
import time


def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = re.sub(r"\d+$", "N", stat[stat.index("(") + 1 : stat.rindex(")")])
            run, wait, slices = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
        except FileNotFoundError:
            continue
        out[tid] = (name, run, wait, slices)
    return out


def main():
    pid, seconds = sys.argv[1], float(sys.argv[2])
    before = snap(pid)
    time.sleep(seconds)
    after = snap(pid)
    by_name = collections.defaultdict(lambda: [0, 0, 0])
    for tid, (name, run, wait, slices) in after.items():
        _, run0, wait0, slices0 = before.get(tid, (name, 0, 0, 0))
        agg = by_name[name]
        agg[0] += run - run0
        agg[1] += wait - wait0
        agg[2] += slices - slices0
    for name, (run, wait, slices) in sorted(by_name.items(), key=lambda kv: -kv[1][0]):
        print("%-18s cpu %5.2f cores  run queue %5.2f  switches/s %7.0f"
              % (name, run / 1e9 / seconds, wait / 1e9 / seconds, slices / seconds))


if __name__ == "__main__":
    main()
