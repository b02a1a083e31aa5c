#!/usr/bin/env python3
"""Tables for bench/iscsi/run.sh: summarize.py RESULTS_DIR > results.md

Median and min-max over the repetitions of each measurement, the ratio ibid / tgt (for times:
how many times faster ibid is), the load average next to each run, and the ibid pool's
physical/logical bytes before and after each step (from the saved GET /api/v1/pool answers).
"""
import csv
import json
import os
import statistics
import sys

out = sys.argv[1]
rows = list(csv.DictReader(open(os.path.join(out, "results.tsv")), delimiter="\t"))

LABEL = {
    "fill-unique": "fill the data LUN: qemu-img convert of unique random data (1 run)",
    "randread-4k-qd32": "iscsi-perf random 4 KiB reads, QD32, written data",
    "seqread-1m-qd8": "iscsi-perf sequential 1 MiB reads, QD8, written data",
    "convert-mixed": "qemu-img convert of the mixed image into a LUN",
    "zero-nounmap": "zero the 1 TiB LUN: qemu-io write -z (WRITE SAME, zero data, no UNMAP bit)",
    "zero-unmap": "zero the 1 TiB LUN: qemu-io write -z -u (WRITE SAME with UNMAP)",
    "xcopy": "EXTENDED COPY of the written data LUN to another LUN",
    "rwcopy": "read+write copy of the same data (qemu-img convert LUN to LUN)",
}
HIGHER_BETTER = {"IOPS", "MB/s"}


def num(v):
    try:
        return float(v)
    except ValueError:
        return None


def fmt(v):
    if v is None:
        return "n/a"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


by = {}
for r in rows:
    by.setdefault((r["measure"], r["system"]), []).append(r)

measures = [m for m in LABEL if any(k[0] == m for k in by)]
systems = sorted({r["system"] for r in rows}, key=lambda s: (s != "tgt", s))

print("| measurement | unit | tgt median (min–max) | ibid median (min–max) | ibid vs tgt |")
print("|---|---|---|---|---|")
for m in measures:
    cells, med = [], {}
    unit = ""
    for s in ("tgt", "ibid"):
        rs = by.get((m, s), [])
        vals = [num(r["value"]) for r in rs]
        vals = [v for v in vals if v is not None]
        if rs:
            unit = rs[0]["unit"]
        if not vals:
            cells.append("not supported" if rs else "—")
            continue
        med[s] = statistics.median(vals)
        extra = " (extrapolated)" if any("EXTRAPOLATED" in r["note"] for r in rs) else ""
        cells.append(f"{fmt(med[s])} ({fmt(min(vals))}–{fmt(max(vals))}){extra}")
    if "tgt" in med and "ibid" in med and med["tgt"] and med["ibid"]:
        if unit in HIGHER_BETTER:
            ratio = f"{med['ibid'] / med['tgt']:.2f}×"
        else:
            ratio = f"{med['tgt'] / med['ibid']:.1f}× faster" if med["ibid"] < med["tgt"] \
                else f"{med['ibid'] / med['tgt']:.1f}× slower"
    elif m == "xcopy" and "ibid" in med:
        rw = [num(r["value"]) for r in by.get(("rwcopy", "tgt"), [])]
        rw = [v for v in rw if v is not None]
        ratio = f"vs tgt read+write copy: {statistics.median(rw) / med['ibid']:.1f}× faster" if rw else ""
    else:
        ratio = ""
    print(f"| {LABEL[m]} | {unit} | {cells[0]} | {cells[1]} | {ratio} |")

print()
print("Every run (value, wall seconds, load average 1/5/15 min at its start, note):")
print()
print("| system | rep | measurement | value | unit | wall s | loadavg | note |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    w = num(r["wall_s"])
    print(f"| {r['system']} | {r['rep']} | {r['measure']} | {r['value']} | {r['unit']} | "
          f"{w:.2f} | {r['loadavg']} | {r['note']} |")

pdir = os.path.join(out, "pool")
if os.path.isdir(pdir):
    print()
    print("ibid pool (GET /api/v1/pool) around each step, bytes:")
    print()
    print("| rep | step | physical before | physical after | Δ physical | Δ logical_written | Δ metadata |")
    print("|---|---|---|---|---|---|---|")
    reps = sorted({f.split("-")[1] for f in os.listdir(pdir) if f.startswith("ibid-rep")})

    def load(rep, name):
        p = os.path.join(pdir, f"ibid-{rep}-{name}.json")
        return json.load(open(p)) if os.path.exists(p) else None

    for rep in reps:
        for step, a, b in [("fill", "fill-before", "fill-after"),
                           ("convert mixed", "conv-before", "conv-after"),
                           ("zero, no UNMAP", "zero-before", "zero-mid"),
                           ("zero, UNMAP", "zero-mid", "zero-after"),
                           ("xcopy", "xcopy-before", "xcopy-after"),
                           ("read+write copy", "rw-before", "rw-after")]:
            x, y = load(rep, a), load(rep, b)
            if not x or not y:
                continue
            d = lambda k: y[k] - x[k]
            print(f"| {rep[3:]} | {step} | {x['physical_bytes']:,} | {y['physical_bytes']:,} | "
                  f"{d('physical_bytes'):+,} | {d('logical_written_bytes'):+,} | {d('metadata_bytes'):+,} |")
