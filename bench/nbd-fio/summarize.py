#!/usr/bin/python3
"""Summarize a bench/nbd-fio results directory as Markdown (stdout).

usage: summarize.py RESULTS_DIR

Per job and system: the median over repetitions of the primary figure (MB/s or IOPS) with the
spread (min-max), the other figures' medians, the server's CPU seconds for the job, and the
ratio of medians against qemu-nbd raw.  Higher ratio = better for every job (QD1 jobs are
compared by IOPS, i.e. the inverse of the mean latency).
"""
import csv
import glob
import json
import os
import statistics
import sys

OUT = sys.argv[1]
SYSTEMS = ["ibid", "qemu-raw", "qemu-qcow2", "nbdkit-file"]
BASE = "qemu-raw"
JOBS = [
    ("seq-unique", "1 MiB seq write QD8, unique incompressible", "MB/s"),
    ("seq-reducible", "1 MiB seq write QD8, dedupe 80 % / compress 50 %", "MB/s"),
    ("randwrite", "4 KiB rand write QD32", "IOPS"),
    ("randread", "4 KiB rand read QD32", "IOPS"),
    ("qd1-write-fua", "4 KiB rand write QD1, FUA (libnbd)", "IOPS"),
    ("qd1-write-flush", "4 KiB rand write QD1 + FLUSH each (fio fsync=1)", "IOPS"),
    ("write-zeroes", "WRITE_ZEROES 16 GiB in 1 GiB requests + FLUSH", "MB/s"),
]
GOALS = {"seq-unique": 0.8, "seq-reducible": 1.5, "randwrite": 1.0, "randread": 1.0}


def pct(lat, p):
    try:
        return lat["percentile"]["%.6f" % p] / 1000.0
    except (KeyError, TypeError):
        return float("nan")


def load(sys_, rep, job):
    """-> dict of figures for one job run, or None."""
    tag = f"{sys_}-rep{rep}-{job}"
    f = os.path.join(OUT, "fio", tag + ".json")
    o = os.path.join(OUT, "ops", tag + ".json")
    if os.path.exists(f):
        txt = open(f).read()
        try:
            j = json.loads(txt[txt.index("{"):])["jobs"][0]  # fio may print notes first
        except ValueError:
            return None  # unfinished or failed run
        if j.get("error"):
            return None
        d = j["read"] if job == "randread" else j["write"]
        r = {"MB/s": d["bw_bytes"] / 1e6, "IOPS": d["iops"],
             "p50_us": pct(d["lat_ns"], 50), "p99_us": pct(d["lat_ns"], 99),
             "ios": d["total_ios"] + j["sync"]["total_ios"]}
        if job == "qd1-write-flush":
            s = j["sync"]["lat_ns"]
            r["flush_p50_us"] = pct(s, 50)
            r["flush_p99_us"] = pct(s, 99)
        return r
    if os.path.exists(o):
        j = json.load(open(o))
        if job == "write-zeroes":
            return {"MB/s": j["zero_flush_MBps"], "zero_only_MBps": j["zero_MBps"],
                    "flush_s": j["flush_s"], "ios": j["requests"] + 1}
        return {"IOPS": j["iops"], "MB/s": j["iops"] * 4096 / 1e6,
                "p50_us": j["p50_us"], "p99_us": j["p99_us"], "ios": j["ios"]}
    return None


meta = {}
if os.path.exists(os.path.join(OUT, "jobs.tsv")):
    for row in csv.DictReader(open(os.path.join(OUT, "jobs.tsv")), delimiter="\t"):
        meta[(row["system"], int(row["rep"]), row["job"])] = row

reps = sorted({int(os.path.basename(p).split("-rep")[1].split("-")[0])
               for p in glob.glob(os.path.join(OUT, "*", "*-rep*-*.json"))})
systems = [s for s in SYSTEMS if glob.glob(os.path.join(OUT, "*", f"{s}-rep*"))]


def med(vals):
    vals = [v for v in vals if v == v]
    return statistics.median(vals) if vals else float("nan")


def fmt(v, unit=""):
    if v != v:
        return "–"
    if abs(v) >= 100:
        return f"{v:,.0f}{unit}"
    if abs(v) >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.2f}{unit}"


summary = {}
for job, _, prim in JOBS:
    for s in systems:
        runs = [load(s, r, job) for r in reps]
        runs = [x for x in runs if x]
        if not runs:
            continue
        keys = runs[0].keys()
        m = {k: med([x[k] for x in runs]) for k in keys}
        m["_prim"] = [x[prim] for x in runs]
        m["_cpu"] = med([float(meta[(s, r, job)]["server_cpu_s"]) for r in reps
                         if (s, r, job) in meta])
        cs = []
        for r, x in zip(reps, [load(s, r, job) for r in reps]):
            row = meta.get((s, r, job))
            if x and row and row.get("ctx_switches", "").strip().isdigit() and x["ios"]:
                cs.append(int(row["ctx_switches"]) / x["ios"])
        m["_cs"] = med(cs)
        m["_wall"] = med([float(meta[(s, r, job)]["wall_s"]) for r in reps
                          if (s, r, job) in meta])
        summary[(job, s)] = m

print(f"Results: `{OUT}` — {len(reps)} repetition(s); medians, spread = min–max over repetitions.\n")
print("| job | system | primary (median) | spread | MB/s | IOPS | p50 µs | p99 µs | server CPU s / wall s | server ctx sw / request | vs qemu-nbd raw |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for job, desc, prim in JOBS:
    for s in systems:
        m = summary.get((job, s))
        if not m:
            continue
        b = summary.get((job, BASE))
        ratio = m[prim] / b[prim] if b and b[prim] else float("nan")
        extra_lat = ""
        if job == "qd1-write-flush":
            extra_lat = f" (flush {fmt(m['flush_p50_us'])}/{fmt(m['flush_p99_us'])})"
        p50 = fmt(m.get("p50_us", float("nan")))
        p99 = fmt(m.get("p99_us", float("nan")))
        if job == "write-zeroes":
            p50 = p99 = "–"
            extra_lat = f" zero-only {fmt(m['zero_only_MBps'])} MB/s"
        prim_v = fmt(m[prim]) + " " + prim
        spread = f"{fmt(min(m['_prim']))}–{fmt(max(m['_prim']))}"
        iops = fmt(m["IOPS"]) if "IOPS" in m else "–"
        print(f"| {desc} | {s} | {prim_v} | {spread} | {fmt(m['MB/s'])} | {iops} | "
              f"{p50} | {p99}{extra_lat} | {fmt(m['_cpu'])} / {fmt(m['_wall'])} | {fmt(m['_cs'])} | {fmt(ratio)}× |")

print("\n**Goals (ibid ÷ qemu-nbd raw, ratio of medians):**\n")
print("| goal | job | ratio | target | met? |")
print("|---|---|---|---|---|")
for job, desc, prim in JOBS:
    if job not in GOALS:
        continue
    a, b = summary.get((job, "ibid")), summary.get((job, BASE))
    if not a or not b:
        continue
    ratio = a[prim] / b[prim]
    lo = min(a["_prim"]) / max(b["_prim"])
    hi = max(a["_prim"]) / min(b["_prim"])
    ok = "yes" if ratio >= GOALS[job] else f"**no** ({(1 - ratio / GOALS[job]) * 100:.0f} % short)"
    print(f"| ≥ {GOALS[job]}× | {desc} | {ratio:.2f}× (range {lo:.2f}–{hi:.2f}) | {GOALS[job]}× | {ok} |")

sp = os.path.join(OUT, "space_after_seq_kib.tsv")
if os.path.exists(sp):
    print("\nSpace used on the backing filesystem after the two sequential jobs (median):\n")
    rows = {}
    for line in open(sp):
        s, r, k = line.split()
        rows.setdefault(s, []).append(int(k))
    for s in systems:
        if s in rows:
            print(f"- {s}: {med(rows[s]) / 1048576:.2f} GiB")
