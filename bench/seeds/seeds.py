#!/usr/bin/python3
"""The seed experiments (DESIGN.md section 4, issue 7): ibid in each disk format next to qemu-nbd
(qcow2 preallocation=off|metadata|falloc|full, raw) and nbdkit file, in one run, all I/O through
NBD with real tools (fio's nbd engine, qemu-img, nbdcopy, libnbd).

usage: bench/seeds/seeds.py [--quick | --scale seed] [--out DIR] [--ibid PATH] [--scratch DIR]
                            [--systems a,b,...] [--only 1,2,...] [--budget BYTES]
       bench/seeds/seeds.py --report-only DIR      (re-render report.md and plots from results.json)

Writes DIR/results.json (raw numbers), DIR/report.md, DIR/*.png and prints a short summary.
Exits 1 if a correctness check failed (data read back through NBD differs, an ibid clone or copy
added data, ...). Runs under /usr/bin/python3 (python3-libnbd, python3-matplotlib).
"""

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# ------------------------------------------------------------------------------------------------
# The seeds' published figures (/work/shared/seeds, DESIGN.md section 4). GB in the articles is
# taken as GiB. Times in seconds.
SEEDS = {
    "000": "Pure Storage, 'VM Performance on Flash Storage, Part 2: Thin vs. Thick Provisioning'",
    "001": "R. Nobel, 'Eager thick vs Lazy thick disk performance' (2015, HP 3PAR, SSD)",
    "002": "C. Hosterman, 'What's New in Purity 5.1: WRITE SAME Handling Improvement'",
    "003": "J. Kemp, 'Cloning VMs - Why less (I/O & throughput) is better!' (Nutanix, VAAI-NAS)",
    "004": "'3PAR vSphere VAAI XCOPY Test Results: More efficient but not faster' (3PAR T400)",
}
SEED_FIG = {
    # 000: creation time of a 50 GB VM disk on the FlashArray with VAAI
    "create50_eager": 4.0, "create50_lazy": 0.2, "create50_thin": 0.1,
    # 000: 10 GB of VM data in a 50 GB disk -> 2 GB on the array
    "space_data": 10 * GiB, "space_phys": 2 * GiB,
    # 000: Jetstress, mean of the two instances of each format
    "jet": {
        "eager": {"db_read_iops": 1028.3, "db_write_iops": 750.8, "db_read_ms": 1.387,
                  "db_write_ms": 2.021, "log_write_iops": 343.8, "log_write_ms": 0.543},
        "lazy": {"db_read_iops": 1048.8, "db_write_iops": 767.8, "db_read_ms": 1.337,
                 "db_write_ms": 2.010, "log_write_iops": 346.1, "log_write_ms": 0.569},
        "thin": {"db_read_iops": 1048.2, "db_write_iops": 762.8, "db_read_ms": 1.354,
                 "db_write_ms": 2.034, "log_write_iops": 344.6, "log_write_ms": 0.564},
    },
    # 001: full format (every block written once) of a 40 GB disk
    "format_size": 40 * GiB, "format_eager": 537.0, "format_lazy": 667.0, "format_thin": 784.0,
    # 002: 1 TB eager-zeroed disk: no offload / WRITE SAME on Purity 5.0 / on 5.1
    "ezt1t_nooffload": 17 * 60 + 6.0, "ezt1t_ws_old": 3 * 60 + 47.0, "ezt1t_ws_new": 70.0,
    # 002: 32 KiB sequential writes QD32 on a thin disk: latency while allocating vs after
    "firstwrite_ms_old": 2.25, "firstwrite_ms_new": 1.6, "steady_ms": 0.7,
    # 003: clone of an 11.18 GB (40 GB provisioned) VM: full copy vs offloaded, 7 clones
    "clone_data": 11.18 * GiB, "clone_full_s": 8 * 60 + 49.0, "clone_fast_s": 5.0,
    "clone_space_added": 0,
    # 004: storage vMotion of 370 GB, ~5 GB written: 20 min with and without XCOPY
    "xcopy_size": 370 * GiB, "xcopy_s": 20 * 60.0,
}

# ------------------------------------------------------------------------------------------------
# Scales. budget = most bytes a peer may allocate on the scratch filesystem for one disk set
# (preallocated qcow2, full copies); larger cases are skipped with the reason in the report.
SCALES = {
    "quick": dict(prov_sizes=[1 * GiB, 64 * GiB], fmt_size=32 * MiB,
                  jet_db=128 * MiB, jet_log=16 * MiB, jet_runtime=1, jet_threads=3,
                  vm_disk=1 * GiB, vm_data=40 * MiB, change=256 * KiB, clones=3,
                  copy_empty=4 * GiB, copy_full=64 * MiB, zero_range=64 * GiB,
                  zero_small=256 * MiB, budget=2 * GiB),
    "default": dict(prov_sizes=[16 * GiB, 40 * GiB, 50 * GiB, 1 * TiB], fmt_size=8 * GiB,
                    jet_db=4 * GiB, jet_log=512 * MiB, jet_runtime=20, jet_threads=3,
                    vm_disk=16 * GiB, vm_data=2 * GiB, change=4 * MiB, clones=7,
                    copy_empty=64 * GiB, copy_full=8 * GiB, zero_range=1 * TiB,
                    zero_small=16 * GiB, budget=24 * GiB),
    "seed": dict(prov_sizes=[40 * GiB, 50 * GiB, 1 * TiB], fmt_size=40 * GiB,
                 jet_db=16 * GiB, jet_log=1 * GiB, jet_runtime=60, jet_threads=3,
                 vm_disk=50 * GiB, vm_data=10 * GiB, change=4 * MiB, clones=7,
                 copy_empty=370 * GiB, copy_full=8 * GiB, zero_range=1 * TiB,
                 zero_small=64 * GiB, budget=None),
}

IBID_FORMATS = {"ibid-thin": "thin", "ibid-lazy": "lazyzeroedthick",
                "ibid-eager": "eagerzeroedthick"}
PEERS = {
    "qcow2-off": ("qcow2", "off"), "qcow2-metadata": ("qcow2", "metadata"),
    "qcow2-falloc": ("qcow2", "falloc"), "qcow2-full": ("qcow2", "full"),
    "raw": ("raw", None), "nbdkit-file": ("nbdkit", None),
}
ALL_SYSTEMS = list(IBID_FORMATS) + list(PEERS)
# which VMware format each system is the analogue of
ANALOGUE = {"ibid-thin": "thin", "ibid-lazy": "lazy", "ibid-eager": "eager",
            "qcow2-off": "thin", "qcow2-metadata": "thin", "qcow2-falloc": "lazy",
            "qcow2-full": "eager", "raw": "thin", "nbdkit-file": "thin"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def human(n):
    if n is None:
        return "-"
    for unit, f in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= f:
            v = n / f
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def secs(t):
    if t is None:
        return "-"
    if t < 0.001:
        return f"{t * 1e6:.0f} µs"
    if t < 1:
        return f"{t * 1e3:.1f} ms"
    if t < 120:
        return f"{t:.2f} s"
    return f"{t / 60:.1f} min"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def run(cmd, **kw):
    """Runs a command, raising with its output on failure; returns (seconds, stdout)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {p.returncode}: "
                           f"{(p.stderr or p.stdout).strip()[-800:]}")
    return dt, p.stdout


def du(path):
    """Bytes allocated (st_blocks) under path."""
    if not os.path.exists(path):
        return 0
    _, out = run(["du", "-s", "--block-size=1", path])
    return int(out.split()[0])


def nbd_handle(uri):
    import nbd
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def wait_nbd(uri, proc, logf, timeout=30):
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {open(logf).read()[-800:]}")
        try:
            h = nbd_handle(uri)
            h.shutdown()
            return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"no NBD server at {uri}")


class Ctx:
    """The run: options, scratch space, started processes, checks."""

    def __init__(self, args, sc):
        self.args = args
        self.sc = sc
        self.scratch = args.scratch
        self.procs = []
        self.checks = []
        self.seq = 0

    def tmpdir(self, name):
        self.seq += 1
        d = os.path.join(self.scratch, f"{self.seq:03d}-{name}")
        os.makedirs(d)
        return d

    def spawn(self, cmd, logf):
        f = open(logf, "w")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)

    def check(self, name, ok, detail=""):
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        log(f"  check {'ok  ' if ok else 'FAIL'} {name}: {detail}")

    def budget_ok(self, need):
        b = self.sc["budget"]
        free = shutil.disk_usage(self.scratch).free
        if b is None:
            b = free - 10 * GiB
        return need <= min(b, free - 4 * GiB), min(b, free - 4 * GiB)


# ------------------------------------------------------------------------------------------------
# Systems


class Ibid:
    """One `ibid serve` on a fresh pool."""

    formats_supported = None  # probed once
    copy_supported = None

    def __init__(self, ctx, tag):
        self.ctx = ctx
        self.dir = ctx.tmpdir(f"ibid-{tag}")
        self.pool_dir = os.path.join(self.dir, "pool")
        self.logf = os.path.join(self.dir, "serve.log")
        self.proc = ctx.spawn([ctx.args.ibid, "serve", "--data", self.pool_dir,
                               "--capacity", "8T", "--capacity-force", "--nbd", "127.0.0.1:0", "--iscsi", "off",
                               "--http", "127.0.0.1:0", "--no-default-volume"], self.logf)
        self.nbd = self.http = None
        t_end = time.time() + 30
        while time.time() < t_end and not (self.nbd and self.http):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ibid serve exited: {open(self.logf).read()[-800:]}")
            for line in open(self.logf):
                line = line.strip()
                if line.startswith("NBD   nbd://"):
                    self.nbd = line[len("NBD   nbd://"):].split("/")[0]
                if line.startswith("API   http://"):
                    self.http = line[len("API   http://"):].split("/")[0]
            time.sleep(0.05)
        if not (self.nbd and self.http):
            raise RuntimeError(f"ibid serve printed no addresses: {open(self.logf).read()}")

    def api(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.http}/api/v1{path}", data=data, method=method,
                                     headers={"content-type": "application/json", "x-ibid-request": "1"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"code": str(e.code), "message": raw.decode(errors="replace")}

    def uri(self, vol):
        return f"nbd://{self.nbd}/{vol}"

    def create(self, vol, size, fmt="thin"):
        """Creates a volume; returns (seconds, the volume as described afterwards)."""
        t0 = time.perf_counter()
        st, body = self.api("POST", "/volumes", {"name": vol, "size": size, "format": fmt})
        dt = time.perf_counter() - t0
        if st != 201:
            raise RuntimeError(f"create {vol} {fmt} {size}: {st} {body}")
        _, info = self.api("GET", f"/volumes/{vol}")
        if Ibid.formats_supported is None:
            Ibid.formats_supported = "format" in info
        if Ibid.formats_supported and info.get("format") not in (fmt, None):
            raise RuntimeError(f"{vol}: asked for {fmt}, got {info.get('format')}")
        return dt, info

    def delete(self, vol):
        # A client that just exited may not be seen disconnected yet (the volume is in use for
        # a moment): retry for a few seconds before giving up.
        for _ in range(50):
            st, body = self.api("DELETE", f"/volumes/{vol}")
            if st != 409 or (body or {}).get("code") != "in_use":
                break
            time.sleep(0.1)
        if st not in (200, 204):
            raise RuntimeError(f"delete {vol}: {st} {body}")

    def clone(self, src, dst):
        t0 = time.perf_counter()
        st, body = self.api("POST", f"/volumes/{src}/clone", {"name": dst})
        dt = time.perf_counter() - t0
        if st != 201:
            raise RuntimeError(f"clone {src} -> {dst}: {st} {body}")
        return dt

    def copy(self, src, dst, length):
        """Range copy; returns (seconds, report) or (None, reason) when the API lacks it."""
        t0 = time.perf_counter()
        st, body = self.api("POST", f"/volumes/{dst}/copy", {
            "source": src, "source_offset": 0, "offset": 0, "length": length})
        dt = time.perf_counter() - t0
        if st in (404, 405) and (body or {}).get("code") not in ("not_found", "volume_not_found"):
            Ibid.copy_supported = False
            return None, f"not available yet (POST /volumes/{{dst}}/copy answered {st})"
        if st not in (200, 201):
            raise RuntimeError(f"copy {src} -> {dst}: {st} {body}")
        Ibid.copy_supported = True
        return dt, body

    def space(self):
        _, p = self.api("GET", "/pool")  # syncs the pool first
        return {"used_bytes": p["used_bytes"], "physical_bytes": p["physical_bytes"],
                "logical_written_bytes": p["logical_written_bytes"],
                "reserved_bytes": p.get("reserved_bytes"), "free_bytes": p.get("free_bytes"),
                "du_bytes": du(self.pool_dir)}

    def stop(self):
        """Stops the server and deletes its pool: the next system starts on a clean disk."""
        self.ctx.stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class PeerServer:
    def __init__(self, ctx, kind, path, export="disk"):
        self.ctx = ctx
        port = free_port()
        self.uri_ = f"nbd://127.0.0.1:{port}/{export}"
        logf = path + f".{port}.log"
        if kind == "nbdkit":
            cmd = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "-e", export, "file",
                   f"file={path}"]
        else:
            cmd = ["qemu-nbd", "-f", kind, "-b", "127.0.0.1", "-p", str(port), "-t", "-e", "16",
                   "-x", export, "--cache=none", "--aio=native", "--discard=unmap", path]
        self.proc = ctx.spawn(cmd, logf)
        wait_nbd(self.uri_, self.proc, logf)

    def uri(self, _vol=None):
        return self.uri_

    def stop(self):
        self.ctx.stop(self.proc)


class Peer:
    """A peer system: a disk file of one kind, served by qemu-nbd or nbdkit."""

    def __init__(self, ctx, name):
        self.ctx, self.name = ctx, name
        self.kind, self.prealloc = PEERS[name]
        self.fmt = "qcow2" if self.kind == "qcow2" else "raw"
        self.dir = ctx.tmpdir(name)

    def path(self, n):
        return os.path.join(self.dir, f"{n}.{self.fmt}")

    def prealloc_bytes(self, size):
        return size if self.prealloc in ("falloc", "full") else 0

    def create(self, n, size):
        p = self.path(n)
        if self.kind == "qcow2":
            dt, _ = run(["qemu-img", "create", "-q", "-f", "qcow2", "-o",
                         f"preallocation={self.prealloc}", p, str(size)])
        elif self.kind == "raw":
            dt, _ = run(["qemu-img", "create", "-q", "-f", "raw", p, str(size)])
        else:
            dt, _ = run(["truncate", "-s", str(size), p])
        return dt

    def serve(self, n):
        return PeerServer(self.ctx, "nbdkit" if self.kind == "nbdkit" else self.fmt, self.path(n))

    def space(self):
        return {"du_bytes": du(self.dir)}


def phys(space):
    """The physical figure of a space record: ibid's pool used_bytes, a peer's du."""
    return space.get("used_bytes", space.get("du_bytes"))


def skip(reason):
    log(f"  skip: {reason}")
    return {"skipped": reason}


# ------------------------------------------------------------------------------------------------
# fio


def fio(ctx, name, args, tag):
    out = os.path.join(ctx.args.out, "fio", f"{tag}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = ["fio", f"--name={name}", "--ioengine=nbd", "--output-format=json",
           f"--output={out}", "--lat_percentiles=1",
           "--percentile_list=1:5:10:25:50:75:90:95:99:99.9:99.99"] + args
    dt, _ = run(cmd)
    with open(out) as f:
        text = f.read()
    return dt, json.loads(text[text.index("{"):])


def lat_summary(side):
    lat = side.get("lat_ns", {})
    pct = lat.get("percentile", {})
    return {"iops": side.get("iops", 0), "bw_bytes": side.get("bw_bytes", 0),
            "mean_ms": lat.get("mean", 0) / 1e6,
            "pct_ms": {k: v / 1e6 for k, v in pct.items()}}


def fill(ctx, uri, offset, size, tag, seed=1, compress=0):
    args = [f"--uri={uri}", "--rw=write", "--bs=1M", "--iodepth=8", f"--offset={offset}",
            f"--size={size}", "--refill_buffers=1", f"--randseed={seed}", "--end_fsync=1"]
    if compress:
        args.append(f"--buffer_compress_percentage={compress}")
    return fio(ctx, "fill", args, tag)[0]


# ------------------------------------------------------------------------------------------------
# Experiments. Each returns {"systems": {name: {...}}, "notes": [...]}.


def exp1_provision(ctx, systems):
    """Create a disk of each format at each size."""
    res = {"sizes": ctx.sc["prov_sizes"], "systems": {}, "notes": []}
    for s in systems:
        log(f"[1 provisioning] {s}")
        r = res["systems"][s] = {}
        if s in IBID_FORMATS:
            srv = Ibid(ctx, "prov")
            try:
                for size in ctx.sc["prov_sizes"]:
                    dt, info = srv.create("p", size, IBID_FORMATS[s])
                    sp = srv.space()
                    r[str(size)] = {"seconds": dt, "space": sp, "info": info}
                    srv.delete("p")
            finally:
                srv.stop()
        else:
            peer = Peer(ctx, s)
            for size in ctx.sc["prov_sizes"]:
                ok, b = ctx.budget_ok(peer.prealloc_bytes(size))
                if not ok:
                    r[str(size)] = skip(f"would allocate {human(size)} on the scratch "
                                        f"filesystem (budget {human(b)})")
                    continue
                dt = peer.create("p", size)
                r[str(size)] = {"seconds": dt, "space": peer.space()}
                os.unlink(peer.path("p"))
    return res


def exp2_format(ctx, systems):
    """Write every block of a disk three times (sequential 32 KiB, QD32, new data each pass)."""
    size = ctx.sc["fmt_size"]
    res = {"size": size, "bs": "32k", "iodepth": 32, "systems": {}, "notes": [
        "each pass writes new incompressible data (fio refill_buffers, a different seed per "
        "pass) sequentially in 32 KiB writes at QD32 (seed 002's vdbench job), so no system can "
        "skip work by zero detection or dedup; the pass time includes the final flush"]}
    for s in systems:
        log(f"[2 first vs later writes] {s}")
        srv, peer = None, None
        if s in IBID_FORMATS:
            srv = Ibid(ctx, "fmt")
            srv.create("d", size, IBID_FORMATS[s])
        else:
            peer = Peer(ctx, s)
            ok, b = ctx.budget_ok(peer.prealloc_bytes(size) + size)
            if not ok:
                res["systems"][s] = skip(f"needs {human(2 * size)} of scratch (budget {human(b)})")
                continue
            peer.create("d", size)
            srv = peer.serve("d")
        passes = []
        try:
            for i in (1, 2, 3):
                dt, j = fio(ctx, "pass", [f"--uri={srv.uri('d')}", "--rw=write", "--bs=32k",
                                          "--iodepth=32", "--offset=0", f"--size={size}",
                                          "--refill_buffers=1", f"--randseed={10 + i}",
                                          "--end_fsync=1"], f"fmt-{s}-pass{i}")
                w = lat_summary(j["jobs"][0]["write"])
                w["seconds"] = dt
                passes.append(w)
                log(f"  pass {i}: {secs(dt)}, mean {w['mean_ms']:.3f} ms")
        finally:
            srv.stop()
        res["systems"][s] = {"passes": passes}
        if peer:
            shutil.rmtree(peer.dir)
    return res


def exp3_jetstress(ctx, systems):
    sc = ctx.sc
    db, logsz, rt, th = sc["jet_db"], sc["jet_log"], sc["jet_runtime"], sc["jet_threads"]
    size = db + logsz
    res = {"db": db, "log": logsz, "runtime": rt, "threads": th, "systems": {}, "notes": [
        f"database area [0, {human(db)}) prefilled, then for {rt} s: {th} threads of random "
        "32 KiB reads and writes at 58:42 (1.4:1) with 4 outstanding each, and one thread of "
        f"sequential 4/8 KiB log writes (60/40) in [{human(db)}, {human(size)}), each followed by "
        "a flush (write-through); data 50% compressible"]}
    for s in systems:
        log(f"[3 jetstress-like] {s}")
        peer = None
        if s in IBID_FORMATS:
            srv = Ibid(ctx, "jet")
            srv.create("d", size, IBID_FORMATS[s])
        else:
            peer = Peer(ctx, s)
            ok, b = ctx.budget_ok(peer.prealloc_bytes(size) + size)
            if not ok:
                res["systems"][s] = skip(f"needs {human(2 * size)} of scratch (budget {human(b)})")
                continue
            peer.create("d", size)
            srv = peer.serve("d")
        try:
            uri = srv.uri("d")
            fill(ctx, uri, 0, db, f"jet-{s}-prefill", seed=7, compress=50)
            jobfile = os.path.join(ctx.args.out, "fio", f"jet-{s}.fio")
            with open(jobfile, "w") as f:
                f.write(f"""[global]
ioengine=nbd
uri={uri}
time_based=1
runtime={rt}
refill_buffers=1
buffer_compress_percentage=50
randrepeat=0
norandommap=1
lat_percentiles=1

[db]
rw=randrw
rwmixread=58
bs=32k
offset=0
size={db}
iodepth=4
numjobs={th}
group_reporting=1

[log]
new_group
rw=write
bssplit=4k/60:8k/40
offset={db}
size={logsz}
iodepth=1
fsync=1
""")
            out = os.path.join(ctx.args.out, "fio", f"jet-{s}.json")
            run(["fio", "--output-format=json", f"--output={out}", jobfile])
            with open(out) as f:
                text = f.read()
            j = json.loads(text[text.index("{"):])
            dbj = next(x for x in j["jobs"] if x["jobname"] == "db")
            lgj = next(x for x in j["jobs"] if x["jobname"] == "log")
            r = {"db_read": lat_summary(dbj["read"]), "db_write": lat_summary(dbj["write"]),
                 "log_write": lat_summary(lgj["write"]),
                 "log_flush_ms": lgj.get("sync", {}).get("lat_ns", {}).get("mean", 0) / 1e6}
            res["systems"][s] = r
            log(f"  db {r['db_read']['iops']:.0f} r/s {r['db_write']['iops']:.0f} w/s, "
                f"log {r['log_write']['iops']:.0f} w/s")
        finally:
            srv.stop()
        if peer:
            shutil.rmtree(peer.dir)
    return res


def build_vm_image(ctx):
    """A sparse disk image of vm_disk bytes holding an ext4 filesystem made (mkfs.ext4 -d) from
    about vm_data bytes of this machine's /etc and /usr (hard links into a staging tree)."""
    sc = ctx.sc
    d = ctx.tmpdir("vm-image")
    tree = os.path.join(d, "root")
    target = sc["vm_data"]
    total, files = 0, 0
    t0 = time.perf_counter()
    for top in ("/etc", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/share", "/usr/libexec",
                "/usr/include", "/usr/local", "/usr/src"):
        if total >= target:
            break
        for root, dirs, names in os.walk(top):
            dirs.sort()
            rel = os.path.relpath(root, "/")
            os.makedirs(os.path.join(tree, rel), exist_ok=True)
            for n in sorted(names):
                src = os.path.join(root, n)
                dst = os.path.join(tree, rel, n)
                try:
                    st = os.lstat(src)
                    if os.path.islink(src):
                        os.symlink(os.readlink(src), dst)
                        continue
                    if not os.path.isfile(src):
                        continue
                    try:
                        os.link(src, dst)
                    except OSError:
                        shutil.copy2(src, dst)
                except OSError:
                    continue
                total += st.st_size
                files += 1
                if total >= target:
                    break
            if total >= target:
                break
    img = os.path.join(d, "vm.img")
    with open(img, "wb") as f:
        f.truncate(sc["vm_disk"])
    run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard",
         "-L", "vmroot", "-d", tree, img])
    shutil.rmtree(tree)
    info = {"path": img, "disk_bytes": sc["vm_disk"], "file_bytes": total, "files": files,
            "allocated_bytes": du(img), "build_seconds": time.perf_counter() - t0}
    log(f"[vm image] {files} files, {human(total)} of file data, image allocates "
        f"{human(info['allocated_bytes'])} of {human(sc['vm_disk'])}")
    return info


def write_image(img, uri):
    """Writes the image into an NBD export (zero runs skipped: every target is fresh)."""
    dt, _ = run(["qemu-img", "convert", "-n", "--target-is-zero", "-f", "raw", "-O", "raw",
                 img, uri])
    return dt


def compare(a, b):
    p = subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "raw", a, b],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode == 0, p.stdout.strip()[-300:]


def small_change(uri, size, i):
    h = nbd_handle(uri)
    h.pwrite(os.urandom(size), (64 * MiB + i * 8 * MiB) % (h.get_size() - size))
    h.flush()
    h.shutdown()


def exp45_space_clones(ctx, systems, image):
    """Experiments 4 and 5: the VM image into a disk, space; 7 clones, time and space after
    each; a small change into each clone, space."""
    sc = ctx.sc
    size, n, change = sc["vm_disk"], sc["clones"], sc["change"]
    res = {"size": size, "clones": n, "change": change, "image": image, "systems": {},
           "notes": [
               "peers' clones: qcow2 systems get linked clones (a qcow2 overlay with the disk "
               "as its backing file, `qemu-img create -b`) and full copies (`qemu-img convert`, "
               "same preallocation); raw and nbdkit-file get full copies (`qemu-img convert`, "
               "sparse). The source server is stopped first (the seed's VM was powered off). "
               "ibid: POST /volumes/NAME/clone on the live volume."]}
    for s in systems:
        log(f"[4+5 space and clones] {s}")
        if s in IBID_FORMATS:
            srv = Ibid(ctx, "vm")
            try:
                r = {}
                r["space_empty"] = srv.space()
                srv.create("vm", size, IBID_FORMATS[s])
                r["space_created"] = srv.space()
                r["write_seconds"] = write_image(image["path"], srv.uri("vm"))
                r["space_written"] = srv.space()
                ok, out = compare(image["path"], srv.uri("vm"))
                ctx.check(f"{s}: VM image reads back equal through NBD", ok, out)
                clones = []
                for i in range(n):
                    dt = srv.clone("vm", f"c{i}")
                    clones.append({"seconds": dt, "space": srv.space()})
                ok, out = compare(image["path"], srv.uri(f"c{n - 1}"))
                ctx.check(f"{s}: clone {n} reads back equal to the image", ok, out)
                added = (clones[-1]["space"]["physical_bytes"] -
                         r["space_written"]["physical_bytes"])
                meta = phys(clones[-1]["space"]) - phys(r["space_written"])
                ctx.check(f"{s}: {n} clones add no data (pool physical_bytes)", added <= 64 * KiB,
                          f"{added} bytes of data, {meta} bytes of data + metadata added")
                for i in range(n):
                    small_change(srv.uri(f"c{i}"), change, i)
                r["space_changed"] = srv.space()
                r["methods"] = {"clone": {"clones": clones}}
                res["systems"][s] = r
            finally:
                srv.stop()
            continue
        peer = Peer(ctx, s)
        r = {}
        ok, b = ctx.budget_ok(peer.prealloc_bytes(size))
        if not ok:
            res["systems"][s] = skip(f"would allocate {human(size)} (budget {human(b)})")
            continue
        peer.create("vm", size)
        r["space_created"] = peer.space()
        srv = peer.serve("vm")
        try:
            r["write_seconds"] = write_image(image["path"], srv.uri())
            ok, out = compare(image["path"], srv.uri())
            ctx.check(f"{s}: VM image reads back equal through NBD", ok, out)
        finally:
            srv.stop()
        r["space_written"] = peer.space()
        base = peer.path("vm")
        r["methods"] = {}
        methods = (["linked", "full copy"] if peer.kind == "qcow2" else ["full copy"])
        for m in methods:
            # linked overlays are thin; full copies keep the preallocation and hold the data
            need = 0 if m == "linked" else n * (peer.prealloc_bytes(size) +
                                                phys(r["space_written"]))
            ok, b = ctx.budget_ok(need)
            if not ok:
                r["methods"][m] = {"skipped": f"{n} full copies would allocate about "
                                              f"{human(need)} (budget {human(b)})"}
                continue
            clones = []
            paths = []
            for i in range(n):
                cp = os.path.join(peer.dir, f"{m.split()[0]}{i}.{peer.fmt}")
                if m == "linked":
                    cmd = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base,
                           cp, str(size)]
                elif peer.kind == "qcow2":
                    cmd = ["qemu-img", "convert", "-f", "qcow2", "-O", "qcow2", "-o",
                           f"preallocation={peer.prealloc}", base, cp]
                else:
                    cmd = ["qemu-img", "convert", "-f", "raw", "-O", "raw", base, cp]
                dt, _ = run(cmd)
                paths.append(cp)
                clones.append({"seconds": dt, "space": peer.space()})
            for i, cp in enumerate(paths):
                cs = PeerServer(ctx, "nbdkit" if peer.kind == "nbdkit" else peer.fmt, cp)
                try:
                    if i == n - 1:
                        ok, out = compare(image["path"], cs.uri())
                        ctx.check(f"{s} {m}: clone {n} reads back equal to the image", ok, out)
                    small_change(cs.uri(), change, i)
                finally:
                    cs.stop()
            sp = peer.space()
            for cp in paths:
                os.unlink(cp)
            r["methods"][m] = {"clones": clones, "space_changed": sp}
        res["systems"][s] = r
        shutil.rmtree(peer.dir)
    return res


def exp6_copy(ctx, systems, image):
    """Copy a mostly-empty disk (the VM image at its start) and a full one."""
    sc = ctx.sc
    cases = [("mostly-empty", sc["copy_empty"]), ("full", sc["copy_full"])]
    res = {"cases": {c: sz for c, sz in cases}, "image_bytes": image["disk_bytes"],
           "systems": {}, "notes": [
               "mostly-empty: the VM image of experiment 4 at offset 0, the rest never written; "
               "full: every block written with incompressible data. ibid offloaded: POST "
               "/volumes/DST/copy (range copy inside the pool); ibid host copy and peers: "
               "`nbdcopy` from one NBD export to another (it skips holes using block status and "
               "writes zeroes for them). Each copy is checked with `qemu-img compare` over NBD. The full "
               "disk's data is the same for the source and the copy, so on ibid a host copy "
               "(nbdcopy) is deduplicated against the source and adds (almost) nothing either."]}
    for s in systems:
        log(f"[6 copy] {s}")
        r = res["systems"][s] = {}
        for case, size in cases:
            if s in IBID_FORMATS:
                srv = Ibid(ctx, "copy")
                try:
                    srv.create("src", size, IBID_FORMATS[s])
                    if case == "full":
                        fill(ctx, srv.uri("src"), 0, size, f"copy-{s}-fill", seed=21)
                    else:
                        write_image(image["path"], srv.uri("src"))
                    before = srv.space()
                    srv.create("dst", size, IBID_FORMATS[s])
                    dt, rep = srv.copy("src", "dst", size)
                    if dt is None:
                        r[case + " offload"] = {"skipped": rep}
                    else:
                        after = srv.space()
                        ok, out = compare(srv.uri("src"), srv.uri("dst"))
                        ctx.check(f"{s}: range copy ({case}) reads back equal", ok, out)
                        added = after["physical_bytes"] - before["physical_bytes"]
                        meta = phys(after) - phys(before)
                        ctx.check(f"{s}: range copy ({case}) adds no data (pool physical_bytes)",
                                  added <= 64 * KiB, f"{added} bytes of data, {meta} bytes of "
                                  "data + metadata added")
                        r[case + " offload"] = {"seconds": dt, "report": rep,
                                                "space_before": before, "space_after": after}
                    srv.delete("dst")
                    srv.create("dst2", size, IBID_FORMATS[s])
                    before = srv.space()
                    dt, _ = run(["nbdcopy", srv.uri("src"), srv.uri("dst2")])
                    after = srv.space()
                    ok, out = compare(srv.uri("src"), srv.uri("dst2"))
                    ctx.check(f"{s}: nbdcopy ({case}) reads back equal", ok, out)
                    r[case + " nbdcopy"] = {"seconds": dt, "space_before": before,
                                            "space_after": after}
                finally:
                    srv.stop()
                continue
            peer = Peer(ctx, s)
            data = size if case == "full" else image["allocated_bytes"]
            need = 2 * max(peer.prealloc_bytes(size), data)
            ok, b = ctx.budget_ok(need)
            if not ok:
                r[case + " nbdcopy"] = skip(f"needs about {human(need)} (budget {human(b)})")
                shutil.rmtree(peer.dir)
                continue
            peer.create("src", size)
            peer.create("dst", size)
            a, d = peer.serve("src"), None
            try:
                if case == "full":
                    fill(ctx, a.uri(), 0, size, f"copy-{s}-fill", seed=21)
                else:
                    write_image(image["path"], a.uri())
                d = peer.serve("dst")
                before = peer.space()
                dt, _ = run(["nbdcopy", a.uri(), d.uri()])
                after = peer.space()
                ok, out = compare(a.uri(), d.uri())
                ctx.check(f"{s}: nbdcopy ({case}) reads back equal", ok, out)
                r[case + " nbdcopy"] = {"seconds": dt, "space_before": before,
                                        "space_after": after}
            finally:
                a.stop()
                if d:
                    d.stop()
            shutil.rmtree(peer.dir)
    return res


def zero_range(uri, length, chunk):
    h = nbd_handle(uri)
    t0 = time.perf_counter()
    off = 0
    while off < length:
        n = min(chunk, length - off)
        h.zero(n, off)
        off += n
    h.flush()
    dt = time.perf_counter() - t0
    h.shutdown()
    return dt


def exp7_zero(ctx, systems):
    sc = ctx.sc
    big, small = sc["zero_range"], sc["zero_small"]
    res = {"range": big, "small": small, "systems": {}, "notes": [
        f"NBD WRITE_ZEROES (libnbd, as nbdsh's h.zero) over [0, {human(big)}) of a fresh "
        f"{human(big)} disk in 1 GiB requests, then over [0, {human(small)}) in 1 MiB requests "
        "(ESXi's WRITE SAME size), then a flush; the eager-zeroed create time is experiment 1's "
        f"{human(big)} row"]}
    for s in systems:
        log(f"[7 zeroing] {s}")
        r = res["systems"][s] = {}
        if s in IBID_FORMATS:
            srv = Ibid(ctx, "zero")
            try:
                r["create_seconds"], _ = srv.create("z", big, IBID_FORMATS[s])
                r["zero_1g_seconds"] = zero_range(srv.uri("z"), big, GiB)
                r["zero_1m_seconds"] = zero_range(srv.uri("z"), small, MiB)
                r["space"] = srv.space()
            finally:
                srv.stop()
            continue
        peer = Peer(ctx, s)
        ok, b = ctx.budget_ok(peer.prealloc_bytes(big))
        if not ok:
            res["systems"][s] = skip(f"would allocate {human(big)} (budget {human(b)})")
            shutil.rmtree(peer.dir)
            continue
        r["create_seconds"] = peer.create("z", big)
        srv = peer.serve("z")
        try:
            r["zero_1g_seconds"] = zero_range(srv.uri(), big, GiB)
            r["zero_1m_seconds"] = zero_range(srv.uri(), small, MiB)
        finally:
            srv.stop()
        r["space"] = peer.space()
        shutil.rmtree(peer.dir)
    return res


# ------------------------------------------------------------------------------------------------
# Environment


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"({e})"


def environment(args):
    ibid_rev = sh(f"git -C {REPO} rev-parse --short HEAD")
    dirty = sh(f"git -C {REPO} status --porcelain -- crates Cargo.toml Cargo.lock | wc -l")
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv),
        "host_cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-").strip(),
        "nproc": os.cpu_count(),
        "mem": sh("free -g | awk '/Mem:/ {print $2 \" GiB total, \" $7 \" GiB available\"}'"),
        "kernel": sh("uname -r"),
        "scratch_fs": sh(f"df -T --block-size=G {args.scratch} | tail -1 | "
                         "awk '{print $1, $2, $3 \" size,\", $5 \" available\"}'"),
        "load_start": sh("cut -d' ' -f1-3 /proc/loadavg"),
        "versions": {
            "ibid": f"{ibid_rev} ({dirty} uncommitted changes under crates/), {args.ibid}",
            "qemu-nbd": sh("qemu-nbd --version | head -1"),
            "qemu-img": sh("qemu-img --version | head -1"),
            "nbdkit": sh("nbdkit --version"),
            "libnbd (nbdcopy)": sh("nbdcopy --version | head -1"),
            "fio": sh("fio --version"),
            "mkfs.ext4": sh("mkfs.ext4 -V 2>&1 | head -1"),
        },
    }


# ------------------------------------------------------------------------------------------------
# Report


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "-"
    r = a / b
    if r == 0:
        return "0"
    if r < 0.001:
        return f"{r:.1e}"
    return f"{r:.3g}"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join(str(x) for x in r) + " |")
    return "\n".join(out)


def get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def plots(res, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = {}
    ex = res["experiments"]

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=90)
        plt.close(fig)
        made[name] = True

    e = ex.get("1")
    if e:
        fig, ax = plt.subplots(figsize=(9, 4))
        names = list(e["systems"])
        w = 0.8 / max(1, len(e["sizes"]))
        for k, size in enumerate(e["sizes"]):
            ys = [get(e["systems"][n], str(size), "seconds") or 0 for n in names]
            ax.bar([i + k * w for i in range(len(names))], [max(y, 1e-5) for y in ys], w,
                   label=human(size))
        ax.set_yscale("log")
        ax.set_xticks([i + w * (len(e["sizes"]) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_ylabel("seconds (log); missing bar = not run")
        ax.set_title("1. Time to create a disk")
        ax.legend()
        save(fig, "provision.png")
    e = ex.get("2")
    if e:
        names = [n for n in e["systems"] if "passes" in e["systems"][n]]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for k in range(3):
            a1.bar([i + k * 0.27 for i in range(len(names))],
                   [e["systems"][n]["passes"][k]["seconds"] for n in names], 0.27,
                   label=f"pass {k + 1}")
        a1.set_xticks([i + 0.27 for i in range(len(names))])
        a1.set_xticklabels(names, rotation=30, ha="right")
        a1.set_ylabel("seconds")
        a1.set_title(f"2. Writing all of a {human(e['size'])} disk, 3 passes")
        a1.legend()
        for i, n in enumerate(names):
            for k, style in ((0, "-"), (2, ":")):
                pct = e["systems"][n]["passes"][k]["pct_ms"]
                xs = sorted(pct, key=float)
                a2.plot([float(x) / 100 for x in xs], [pct[x] for x in xs], style,
                        color=f"C{i % 10}", label=f"{n} pass {k + 1}" if k == 0 else None)
        a2.set_xscale("logit")
        a2.set_yscale("log")
        a2.set_xlabel("percentile (solid: pass 1, dotted: pass 3)")
        a2.set_ylabel("write latency, ms")
        a2.legend(fontsize=7)
        save(fig, "format.png")
    e = ex.get("3")
    if e:
        names = [n for n in e["systems"] if "db_read" in e["systems"][n]]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for k, key in enumerate(("db_read", "db_write", "log_write")):
            a1.bar([i + k * 0.27 for i in range(len(names))],
                   [e["systems"][n][key]["iops"] for n in names], 0.27, label=key)
            a2.bar([i + k * 0.27 for i in range(len(names))],
                   [e["systems"][n][key]["mean_ms"] for n in names], 0.27, label=key)
        for a, t in ((a1, "IOPS"), (a2, "mean latency, ms")):
            a.set_xticks([i + 0.27 for i in range(len(names))])
            a.set_xticklabels(names, rotation=30, ha="right")
            a.set_ylabel(t)
            a.legend()
        a1.set_title("3. Jetstress-like mixed database + log workload")
        save(fig, "jetstress.png")
    e = ex.get("45")
    if e:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        colors = plt.get_cmap("tab20").colors
        k = 0
        for n, r in e["systems"].items():
            for m, mr in (r.get("methods") or {}).items():
                cl = mr.get("clones")
                if not cl:
                    continue
                base = phys(r["space_written"])
                ys = [base / GiB] + [phys(c["space"]) / GiB for c in cl]
                lab = n if m == "clone" else f"{n} {m}"
                c = colors[k % len(colors)]
                k += 1
                a1.plot(range(len(ys)), ys, marker="o", color=c, label=lab)
                a2.plot(range(1, len(cl) + 1), [c_["seconds"] for c_ in cl], marker="o", color=c,
                        label=lab)
        a1.set_xlabel("clones made")
        a1.set_ylabel("physical GiB (ibid: pool used; peers: du)")
        a1.set_title("4+5. Space with the VM image and its clones")
        a2.set_xlabel("clone #")
        a2.set_ylabel("seconds")
        a2.set_yscale("log")
        a2.set_title("5. Time of each clone")
        a1.legend(fontsize=7)
        save(fig, "clones.png")
    e = ex.get("6")
    if e:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, case in zip(axes, ("mostly-empty", "full")):
            labels, vals, colors = [], [], []
            for n, r in e["systems"].items():
                for how in ("offload", "nbdcopy"):
                    v = r.get(f"{case} {how}", {})
                    if "seconds" in v:
                        labels.append(f"{n} {how}")
                        vals.append(max(v["seconds"], 1e-5))
                        colors.append("C3" if how == "offload" else "C0")
            ax.bar(range(len(vals)), vals, color=colors)
            ax.set_xticks(range(len(vals)))
            ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("seconds (log)")
            ax.set_title(f"6. Copy a {case} {human(e['cases'][case])} disk (red: ibid offload)")
        save(fig, "copy.png")
    e = ex.get("7")
    if e:
        names = [n for n in e["systems"] if "zero_1g_seconds" in e["systems"][n]]
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.bar(names, [max(e["systems"][n]["zero_1g_seconds"], 1e-5) for n in names])
        ax.set_yscale("log")
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"7. Zeroing {human(e['range'])} with NBD WRITE_ZEROES")
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
        save(fig, "zero.png")
    return made


def headline(res):
    """Rows: (claim, seed ref, seed figure, ibid figure, peer figure, ibid ÷ seed, ibid ÷ peer)."""
    ex = res["experiments"]
    rows = []

    def add(claim, ref, seedv, seedtxt, ibidv, ibidtxt, peerv, peertxt):
        rows.append([claim, ref, seedtxt, ibidtxt, peertxt, ratio(ibidv, seedv),
                     ratio(ibidv, peerv)])

    e1 = ex.get("1")

    def peer_create(peer, size):
        """The peer's create time at size, or the text of its largest size run."""
        r = get(e1, "systems", peer) or {}
        v = get(r, str(size), "seconds")
        if v is not None:
            return v, f"{peer}: {secs(v)}"
        done = [int(k) for k, x in r.items() if "seconds" in x]
        if not done:
            return None, f"{peer}: not run"
        m = max(done)
        return None, (f"{peer}: not run at {human(size)} (space budget); {human(m)} took "
                      f"{secs(r[str(m)]['seconds'])}")
    if e1:
        for fmt, peer, key in (("eager", "qcow2-full", "create50_eager"),
                               ("lazy", "qcow2-falloc", "create50_lazy"),
                               ("thin", "qcow2-off", "create50_thin")):
            size = 50 * GiB if 50 * GiB in e1["sizes"] else max(e1["sizes"])
            iv = get(e1, "systems", f"ibid-{fmt}", str(size), "seconds")
            pv, ptxt = peer_create(peer, size)
            add(f"create a {human(size)} {fmt} disk", "000", SEED_FIG[key], secs(SEED_FIG[key]),
                iv, secs(iv), pv, ptxt)
        if TiB in e1["sizes"]:
            iv = get(e1, "systems", "ibid-eager", str(TiB), "seconds")
            pv, ptxt = peer_create("qcow2-full", TiB)
            add("create a 1 TiB eager-zeroed disk", "002", SEED_FIG["ezt1t_ws_new"],
                f"{secs(SEED_FIG['ezt1t_ws_new'])} (WRITE SAME; "
                f"{secs(SEED_FIG['ezt1t_nooffload'])} without)", iv, secs(iv), pv, ptxt)
    e7 = ex.get("7")
    if e7:
        iv = get(e7, "systems", "ibid-thin", "zero_1g_seconds")
        pv = get(e7, "systems", "raw", "zero_1g_seconds")
        add(f"zero a {human(e7['range'])} range", "002", SEED_FIG["ezt1t_ws_new"] *
            e7["range"] / TiB, f"{secs(SEED_FIG['ezt1t_ws_new'])} per TiB", iv, secs(iv), pv,
            f"raw: {secs(pv)}")
    e2 = ex.get("2")
    if e2:
        gib = e2["size"] / GiB
        def first_run(*names):
            return next((n for n in names if get(e2, "systems", n, "passes")), names[0])
        for fmt, peer in (("eager", "qcow2-full"), ("lazy", "qcow2-falloc"),
                          ("thin", first_run("qcow2-off", "raw"))):
            sv = SEED_FIG[f"format_{fmt}"] / (SEED_FIG["format_size"] / GiB)
            p1 = get(e2, "systems", f"ibid-{fmt}", "passes")
            pp = get(e2, "systems", peer, "passes")
            iv = p1[0]["seconds"] / gib if p1 else None
            pv = pp[0]["seconds"] / gib if pp else None
            add(f"first full write of a disk, {fmt}, s per GiB", "001", sv, f"{sv:.1f} s/GiB",
                iv, f"{iv:.2f} s/GiB" if iv else "-", pv,
                f"{peer}: {pv:.2f} s/GiB" if pv else f"{peer}: not run")
        p = get(e2, "systems", "ibid-thin", "passes")
        tp = first_run("qcow2-off", "raw")
        pp = get(e2, "systems", tp, "passes")
        sv = SEED_FIG["firstwrite_ms_new"] / SEED_FIG["steady_ms"]
        iv = p[0]["mean_ms"] / p[1]["mean_ms"] if p else None
        pv = pp[0]["mean_ms"] / pp[1]["mean_ms"] if pp else None
        add("first-write penalty: mean write latency pass 1 ÷ pass 2, thin", "002", sv,
            f"{sv:.2f} (1.6 ms ÷ 0.7 ms)", iv, f"{iv:.2f}" if iv else "-", pv,
            f"{tp}: {pv:.2f}" if pv else "-")
    e3 = ex.get("3")
    if e3:
        def spread(names, key):
            v = [get(e3, "systems", n, key, "iops") for n in names]
            v = [x for x in v if x]
            return max(v) / min(v) if len(v) > 1 else None
        sv = max(SEED_FIG["jet"][f]["db_read_iops"] for f in SEED_FIG["jet"]) / \
            min(SEED_FIG["jet"][f]["db_read_iops"] for f in SEED_FIG["jet"])
        iv = spread(list(IBID_FORMATS), "db_read")
        pv = spread([p for p in PEERS if p.startswith("qcow2")], "db_read")
        add("database reads/s, fastest format ÷ slowest", "000", sv, f"{sv:.3f}", iv,
            f"{iv:.3f}" if iv else "-", pv, f"qcow2 formats: {pv:.3f}" if pv else "-")
        sv = SEED_FIG["jet"]["thin"]["db_read_ms"]
        iv = get(e3, "systems", "ibid-thin", "db_read", "mean_ms")
        pv = get(e3, "systems", "raw", "db_read", "mean_ms")
        add("database read latency (mean), thin", "000", sv, f"{sv:.2f} ms", iv,
            f"{iv:.2f} ms" if iv else "-", pv, f"raw: {pv:.2f} ms" if pv else "-")
        def durable(n):
            r = get(e3, "systems", n)
            if not r or "log_write" not in r:
                return None
            return r["log_write"]["mean_ms"] + r.get("log_flush_ms", 0)
        sv = SEED_FIG["jet"]["thin"]["log_write_ms"]
        iv, pv = durable("ibid-thin"), durable("raw")
        add("log write made durable (write + flush, mean), thin", "000", sv,
            f"{sv:.2f} ms (write-through)", iv, f"{iv:.2f} ms" if iv else "-", pv,
            f"raw: {pv:.2f} ms" if pv else "-")
    e45 = ex.get("45")
    if e45:
        img = e45["image"]["file_bytes"]
        sv = SEED_FIG["space_phys"] / SEED_FIG["space_data"]
        r = get(e45, "systems", "ibid-thin")
        iv = phys(r["space_written"]) / img if r and "space_written" in r else None
        rr = get(e45, "systems", "raw")
        pv = phys(rr["space_written"]) / img if rr and "space_written" in rr else None
        add(f"physical space ÷ VM data written ({human(img)} of files)", "000", sv,
            f"{sv:.2f} (2 GB for 10 GB)", iv, f"{iv:.2f}" if iv else "-", pv,
            f"raw: {pv:.2f}" if pv else "-")
        cl = get(r, "methods", "clone", "clones") if r else None
        iv = sum(c["seconds"] for c in cl) / len(cl) if cl else None
        lk = get(e45, "systems", "qcow2-off", "methods", "linked", "clones")
        pv = sum(c["seconds"] for c in lk) / len(lk) if lk else None
        add(f"clone a VM disk (mean of {e45['clones']})", "003", SEED_FIG["clone_fast_s"],
            f"{secs(SEED_FIG['clone_fast_s'])} offloaded, {secs(SEED_FIG['clone_full_s'])} "
            "full copy", iv, secs(iv), pv, f"qcow2-off linked: {secs(pv)}")
        fc = get(e45, "systems", "raw", "methods", "full copy", "clones")
        if fc:
            fv = sum(c["seconds"] for c in fc) / len(fc)
            add(f"clone a VM disk by full copy (mean of {e45['clones']})", "003", None,
                f"{secs(SEED_FIG['clone_full_s'])} ({human(SEED_FIG['clone_data'])})", iv,
                f"{secs(iv)} (fast clone)", fv, f"raw full copy: {secs(fv)}")
        ia = phys(cl[-1]["space"]) - phys(r["space_written"]) if cl else None
        pa = (phys(lk[-1]["space"]) - phys(get(e45, "systems", "qcow2-off", "space_written"))
              if lk else None)
        rows.append([f"physical space added by {e45['clones']} clones", "003", "0 (free space unchanged)",
                     human(ia) if ia is not None else "-",
                     f"qcow2-off linked: {human(pa)}" if pa is not None else "-", "-",
                     ratio(ia, pa)])
    e6 = ex.get("6")
    if e6:
        size = e6["cases"]["mostly-empty"]
        sv = SEED_FIG["xcopy_s"] / (SEED_FIG["xcopy_size"] / GiB)
        iv = get(e6, "systems", "ibid-thin", "mostly-empty offload", "seconds")
        pv = get(e6, "systems", "raw", "mostly-empty nbdcopy", "seconds")
        add(f"copy a mostly-empty disk ({human(size)}), s per GiB", "004", sv,
            f"{sv:.2f} s/GiB (20 min for 370 GB)", iv / (size / GiB) if iv is not None else None,
            (f"{iv / (size / GiB):.2g} s/GiB ({secs(iv)})" if iv is not None else
             get(e6, "systems", "ibid-thin", "mostly-empty offload", "skipped") or "-"),
            pv / (size / GiB) if pv else None,
            f"raw nbdcopy: {pv / (size / GiB):.2g} s/GiB ({secs(pv)})" if pv else "-")
    return rows


HEAD = ["claim", "seed", "seed's figure", "ibid", "peer", "ibid ÷ seed", "ibid ÷ peer"]


def report(res, out):
    made = plots(res, out)
    ex = res["experiments"]
    env = res["env"]
    L = []
    w = L.append
    w(f"# Seed experiments: ibid vs qemu-nbd and nbdkit ({res['scale']} scale)\n")
    w(f"Generated by `bench/seeds/seeds.py` on {env['date_utc']}: `{env['command']}`. "
      f"Whole run: {secs(res.get('seconds')) if res.get('seconds') else 'interrupted'}.\n")
    if not res.get("formats_supported"):
        w("> **ibid disk formats not available in this build**: the API ignored `format`, so "
          "only `ibid-thin` was run; `ibid-lazy` and `ibid-eager` rows are empty.\n")
    if res.get("copy_supported") is False:
        w("> **ibid range copy not available in this build** (`POST /volumes/DST/copy`): its "
          "rows say so; no figure is given for it.\n")
    for m in res.get("merged", []):
        w(f"> Experiment {m['experiment']} comes from an earlier run{'' if m['complete'] else ' (interrupted: the systems it finished)'}: "
          f"`{m['from']}` on {m['date_utc']} (load {m['load_start']} at its start, "
          f"{m['load_end']} at its end).\n")
    names = {"1": "1", "2": "2", "3": "3", "45": "4+5", "6": "6", "7": "7"}
    for key, e in sorted(ex.items()):
        missing = [n for n in ALL_SYSTEMS if n not in e.get("systems", {})]
        if missing:
            w(f"> Experiment {names.get(key, key)} has no figures for {', '.join(missing)}: not "
              "run (left out with --systems, or the run was stopped to fit the time).\n")
    w("Ratios are always **ibid's figure divided by the other's**: below 1 means ibid took less "
      "time / less space; for rates (IOPS) above 1 means ibid did more. The seeds ran on real "
      "arrays and ESXi hosts with other sizes; their figures are shown as published (GB taken "
      "as GiB), normalised per GiB where the sizes differ.\n")
    w("## Headline\n")
    w(table(HEAD, headline(res)) + "\n")
    w("Seeds: " + "; ".join(f"**{k}** {v}" for k, v in SEEDS.items()) + ".\n")
    w("## Machine and versions\n")
    w(f"- CPU: {env['host_cpu']}, {env['nproc']} cores; memory: {env['mem']}; kernel "
      f"{env['kernel']}")
    w(f"- scratch filesystem: {env['scratch_fs']}")
    w(f"- load average (1/5/15 min) at start: {env['load_start']}, at end: {res.get('load_end', '-')} "
      "(the machine is shared with other engineers' builds: figures are noisy)")
    for k, v in env["versions"].items():
        w(f"- {k}: {v}")
    w("- systems: " + ", ".join(res["systems"]) + " (qcow2-*: qemu-nbd serving a qcow2 file "
      "made with that `preallocation`; raw: qemu-nbd serving a sparse raw file; nbdkit-file: "
      "nbdkit's file plugin on a sparse file; qemu-nbd runs with `--cache=none --aio=native "
      "--discard=unmap`, so its reads and writes bypass the page cache, while nbdkit's file "
      "plugin (default cache mode) and ibid (buffered segment files) go through it: with 23 GiB "
      "of RAM their reads are largely served from memory). Analogues: thin = qcow2-off/metadata/raw/nbdkit, lazy-zeroed thick "
      "= qcow2-falloc, eager-zeroed thick = qcow2-full.")
    sz = res["sizes"]
    w(f"- sizes: provisioning {', '.join(human(x) for x in sz['prov_sizes'])}; full format "
      f"{human(sz['fmt_size'])}; Jetstress database {human(sz['jet_db'])} + log "
      f"{human(sz['jet_log'])}, {sz['jet_runtime']} s; VM disk {human(sz['vm_disk'])} with "
      f"about {human(sz['vm_data'])} of files, {sz['clones']} clones, changes of "
      f"{human(sz['change'])}; copies of a {human(sz['copy_empty'])} mostly-empty and a "
      f"{human(sz['copy_full'])} full disk; zeroing {human(sz['zero_range'])}; peers' "
      f"allocation budget {human(sz['budget']) if sz['budget'] else 'free space - 10 GiB'}\n")

    e = ex.get("1")
    if e:
        w("## 1. Provisioning time\n")
        w("ibid: `POST /api/v1/volumes` with the format (HTTP round trip included); peers: "
          "`qemu-img create` / `truncate`. Space: ibid pool used bytes, the space reserved for "
          "thick volumes, and the volume's to-be-zeroed blocks (tbz); peers: `du` of the "
          "file.\n")
        rows = []
        for n, r in e["systems"].items():
            row = [n]
            for size in e["sizes"]:
                c = r.get(str(size), {})
                if "seconds" not in c:
                    row.append(f"not run: {c.get('skipped', '-')}")
                elif c["space"].get("reserved_bytes") is not None:
                    row.append(f"{secs(c['seconds'])}; used {human(phys(c['space']))}, reserved "
                               f"{human(c['space']['reserved_bytes'])}, tbz "
                               f"{get(c, 'info', 'tbz_blocks')} blocks")
                else:
                    row.append(f"{secs(c['seconds'])}, {human(phys(c['space']))}")
            rows.append(row)
        w(table(["system"] + [human(s) for s in e["sizes"]], rows) + "\n")
        w("Seed 000 (50 GB, FlashArray with VAAI): eager 4 s, lazy 0.2 s, thin 0.1 s; "
          "seed 002: 1 TB eager-zeroed 17 min 6 s without WRITE SAME, 70 s with.\n")
        if "provision.png" in made:
            w("![provisioning](provision.png)\n")
    e = ex.get("2")
    if e:
        w("## 2. First write vs later writes (full format)\n")
        w(f"Disk {human(e['size'])}; " + "; ".join(e["notes"]) + ".\n")
        rows = []
        for n, r in e["systems"].items():
            if "passes" not in r:
                rows.append([n, f"not run: {r.get('skipped')}"] + [""] * 7)
                continue
            p = r["passes"]
            rows.append([n] + [secs(x["seconds"]) for x in p] +
                        [ratio(p[0]["seconds"], p[1]["seconds"]),
                         " / ".join(f"{x['mean_ms']:.2f}" for x in p),
                         " / ".join(f"{x['pct_ms'].get('99.000000', 0):.2f}" for x in p),
                         " / ".join(f"{x['pct_ms'].get('99.990000', 0):.2f}" for x in p),
                         f"{e['size'] / p[0]['seconds'] / MiB:.0f}"])
        w(table(["system", "pass 1", "pass 2", "pass 3", "pass 1 ÷ pass 2",
                 "mean latency ms (1/2/3)", "p99 ms (1/2/3)", "p99.99 ms (1/2/3)",
                 "pass 1 MiB/s"], rows) + "\n")
        w("Seed 001 (40 GB NTFS full format on 3PAR SSD): eager 537 s, lazy 667 s, thin 784 s "
          "for the first pass, the same for all three afterwards. Seed 002 (thin, 32 KiB QD32): "
          "2.25 ms (Purity 5.0) / 1.6 ms (5.1) while allocating, 0.7 ms after.\n")
        if "format.png" in made:
            w("![format](format.png)\n")
    e = ex.get("3")
    if e:
        w("## 3. Mixed database workload (Jetstress-like)\n")
        w("; ".join(e["notes"]) + ".\n")
        rows = []
        for n, r in e["systems"].items():
            if "db_read" not in r:
                rows.append([n, f"not run: {r.get('skipped')}"] + [""] * 6)
                continue
            def rate(x):
                return f"{x:.0f}" if x >= 10 else f"{x:.2f}"
            rows.append([n, rate(r['db_read']['iops']), rate(r['db_write']['iops']),
                         f"{r['db_read']['mean_ms']:.2f}", f"{r['db_write']['mean_ms']:.2f}",
                         rate(r['log_write']['iops']), f"{r['log_write']['mean_ms']:.2f}",
                         f"{r.get('log_flush_ms', 0):.2f}"])
        for f, v in SEED_FIG["jet"].items():
            rows.append([f"seed 000, {f} (per instance)", f"{v['db_read_iops']:.0f}",
                         f"{v['db_write_iops']:.0f}", f"{v['db_read_ms']:.2f}",
                         f"{v['db_write_ms']:.2f}", f"{v['log_write_iops']:.0f}",
                         f"{v['log_write_ms']:.2f}", "-"])
        w(table(["system", "DB reads/s", "DB writes/s", "DB read ms", "DB write ms",
                 "log writes/s", "log write ms", "log flush ms"], rows) + "\n")
        w("The seed's Jetstress ran 2 databases × 3 threads paced at 1 IOPS per mailbox on a "
          "FlashArray; this run is unpaced (as fast as each system goes), so compare the "
          "systems and formats with each other, and the spread between formats with the "
          "seed's.\n")
        if "jetstress.png" in made:
            w("![jetstress](jetstress.png)\n")
    e = ex.get("45")
    if e:
        img = e["image"]
        w("## 4. Space for a VM image, and 5. its clones\n")
        w(f"VM image: ext4 (`mkfs.ext4 -d`) of {img['files']} files ({human(img['file_bytes'])}) "
          f"from this machine's /etc and /usr, in a {human(img['disk_bytes'])} sparse image "
          f"that allocates {human(img['allocated_bytes'])}; written into each system's "
          f"{human(e['size'])} disk with `qemu-img convert -n --target-is-zero` over NBD and "
          "read back with `qemu-img compare`. Then "
          f"{e['clones']} clones, then {human(e['change'])} of new data written into each "
          "clone through NBD. " + " ".join(e["notes"]) + "\n")
        rows = []
        for n, r in e["systems"].items():
            if "space_written" not in r:
                rows.append([n, f"not run: {r.get('skipped')}"] + [""] * 9)
                continue
            base = phys(r["space_written"])
            created = phys(r.get("space_created") or {"du_bytes": 0})
            for m, mr in r["methods"].items():
                cl = mr.get("clones")
                if not cl:
                    rows.append([n, m, human(created), secs(r["write_seconds"]), human(base),
                                 ratio(base, img["file_bytes"]),
                                 f"not run: {mr.get('skipped')}", "", "", ""])
                    continue
                after = mr.get("space_changed") or r.get("space_changed")
                ts = [c["seconds"] for c in cl]
                extra = ""
                if "du_bytes" in r["space_written"] and "used_bytes" in r["space_written"]:
                    extra = f" (du {human(r['space_written']['du_bytes'])})"
                rows.append([n, m, human(created), secs(r["write_seconds"]), human(base) + extra,
                             ratio(base, img["file_bytes"]),
                             f"{secs(min(ts))} / {secs(sum(ts) / len(ts))} / {secs(max(ts))}",
                             human(phys(cl[-1]["space"]) - base),
                             human(phys(after) - phys(cl[-1]["space"])),
                             human(phys(after))])
        w(table(["system", "clone method", "physical after create", "image write time",
                 "physical after write",
                 "physical ÷ file data", "clone time min / mean / max", "added by clones",
                 "added by changes", "physical at end"], rows) + "\n")
        w("Physical: ibid = pool `used_bytes` (data after dedup and compression plus metadata; "
          "`du` of the pool directory in brackets, which includes not yet cleaned garbage and "
          "preallocated segment files); peers = `du` of all their files. Seed 000: 10 GB of VM "
          "data stored in 2 GB. Seed 003: 7 clones of an 11.18 GB VM, 5–7 s each offloaded "
          "(8 min 49 s as a full copy), free space unchanged.\n")
        if "clones.png" in made:
            w("![clones](clones.png)\n")
    e = ex.get("6")
    if e:
        w("## 6. Copy offload\n")
        w("; ".join(e["notes"]) + "\n")
        rows = []
        for n, r in e["systems"].items():
            for k, v in r.items():
                case, how = k.rsplit(" ", 1)
                size = e["cases"][case]
                if "seconds" not in v:
                    rows.append([n, case, human(size), how, f"not run: {v.get('skipped')}", "",
                                 ""])
                    continue
                added = human(phys(v["space_after"]) - phys(v["space_before"]))
                if "physical_bytes" in v["space_after"]:
                    added = (f"{human(v['space_after']['physical_bytes'] - v['space_before']['physical_bytes'])}"
                             f" data, {added} with metadata")
                rows.append([n, case, human(size), how, secs(v["seconds"]),
                             f"{size / GiB / v['seconds']:.2f}" if v["seconds"] else "-", added])
        w(table(["system", "disk", "size", "method", "time", "GiB/s (logical)",
                 "physical added"], rows) + "\n")
        w("Seed 004: a 370 GB storage vMotion (about 5 GB written) took 20 min with and without "
          "XCOPY on a 3PAR T400.\n")
        if "copy.png" in made:
            w("![copy](copy.png)\n")
    e = ex.get("7")
    if e:
        w("## 7. WRITE SAME / zeroing\n")
        w("; ".join(e["notes"]) + ".\n")
        rows = []
        for n, r in e["systems"].items():
            if "zero_1g_seconds" not in r:
                rows.append([n, f"not run: {r.get('skipped')}", "", "", "", ""])
                continue
            rows.append([n, secs(r["create_seconds"]), secs(r["zero_1g_seconds"]),
                         f"{e['range'] / GiB / r['zero_1g_seconds']:.0f}",
                         secs(r["zero_1m_seconds"]), human(phys(r["space"]))])
        w(table(["system", f"create {human(e['range'])}", f"zero {human(e['range'])} "
                 "(1 GiB requests)", "GiB/s", f"zero {human(e['small'])} (1 MiB requests)",
                 "physical after"], rows) + "\n")
        w("Seed 002: a 1 TB eager-zeroed disk took 70 s with WRITE SAME (about 15 GB/s), "
          "17 min 6 s without.\n")
        if "zero.png" in made:
            w("![zero](zero.png)\n")
    w("## Checks\n")
    w("The run fails (exit 1) if any of these fails.\n")
    for c in res.get("checks", []):
        w(f"- {'ok' if c['ok'] else '**FAILED**'}: {c['name']} {('— ' + c['detail']) if c['detail'] else ''}")
    w("")
    if res.get("errors"):
        w("## Errors\n")
        for k, v in res["errors"].items():
            w(f"- experiment {k}: `{v}`")
        w("")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, about a minute")
    ap.add_argument("--scale", choices=list(SCALES), default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ibid", default=None)
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    ap.add_argument("--only", default="1,2,3,4,5,6,7")
    ap.add_argument("--budget", default=None, help="bytes a peer may preallocate or copy")
    ap.add_argument("--report-only", metavar="DIR")
    ap.add_argument("--merge-from", metavar="DIR", action="append",
                    help="also report the experiments of an earlier run that this one did not run")
    args = ap.parse_args()

    if not args.report_only:
        # Fail now, not half an hour in: every experiment checks results with libnbd's Python
        # binding, which Debian installs for /usr/bin/python3 only (not for a pyenv python3).
        try:
            import nbd  # noqa: F401
        except ImportError:
            sys.exit(f"seeds.py: {sys.executable} cannot import nbd (python3-libnbd); "
                     "run it as bench/seeds/seeds.py, i.e. with /usr/bin/python3")

    if args.report_only:
        path = os.path.join(args.report_only, "results.json")
        if not os.path.exists(path):  # an interrupted run
            path = os.path.join(args.report_only, "results.partial.json")
        with open(path) as f:
            res = json.load(f)
        report(res, args.report_only)
        print(open(os.path.join(args.report_only, "report.md")).read())
        return 0

    scale = "quick" if args.quick else (args.scale or "default")
    sc = dict(SCALES[scale])
    if args.budget:
        sc["budget"] = int(args.budget)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out = os.path.abspath(args.out or os.path.join(HERE, "results", stamp))
    os.makedirs(args.out, exist_ok=True)
    if not args.ibid:
        tgt = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
        args.ibid = os.path.join(tgt, "release", "ibid")
    args.ibid = os.path.abspath(args.ibid)
    if not os.access(args.ibid, os.X_OK):
        log(f"no ibid binary at {args.ibid} (cargo build --release -p ibid, or --ibid)")
        return 2
    for t in ("fio", "qemu-img", "qemu-nbd", "nbdkit", "nbdcopy", "mkfs.ext4"):
        if not shutil.which(t):
            log(f"missing tool: {t} (scripts/install-test-tools.sh)")
            return 2
    own_scratch = args.scratch is None
    args.scratch = tempfile.mkdtemp(prefix="ibid-seeds.", dir=args.scratch or "/var/tmp")
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in ALL_SYSTEMS:
            log(f"unknown system {s}; known: {', '.join(ALL_SYSTEMS)}")
            return 2
    only = set(args.only.split(","))

    ctx = Ctx(args, sc)
    res = {"scale": scale, "sizes": sc, "systems": systems, "env": environment(args),
           "experiments": {}, "errors": {}}
    log(f"results: {args.out}; scratch: {args.scratch}")
    t0 = time.perf_counter()
    try:
        # Probe once whether this ibid knows disk formats; without them only ibid-thin runs.
        probe = Ibid(ctx, "probe")
        try:
            probe.create("p", GiB, "eagerzeroedthick")
        finally:
            probe.stop()
        res["formats_supported"] = bool(Ibid.formats_supported)
        if not Ibid.formats_supported:
            log("ibid ignores `format` (not available yet): running ibid-thin only")
            systems = [s for s in systems if s not in ("ibid-lazy", "ibid-eager")]
            res["systems"] = systems
        image = None
        # the quick, metadata-heavy experiments first, the long throughput ones last
        steps = [("1", lambda ss: exp1_provision(ctx, ss)),
                 ("7", lambda ss: exp7_zero(ctx, ss)),
                 ("45", lambda ss: exp45_space_clones(ctx, ss, image)),
                 ("3", lambda ss: exp3_jetstress(ctx, ss)),
                 ("2", lambda ss: exp2_format(ctx, ss)),
                 ("6", lambda ss: exp6_copy(ctx, ss, image))]

        def save_partial():
            # keep what is done so far, so that an interrupted run still leaves its numbers
            res["checks"] = ctx.checks
            with open(os.path.join(args.out, "results.partial.json"), "w") as f:
                json.dump(res, f, indent=1)
        for key, fn in steps:
            if not (set(key) & only):
                continue
            if key in ("45", "6") and image is None:
                image = build_vm_image(ctx)
            t1 = time.perf_counter()
            try:
                for s in systems:  # one system at a time, saved after each
                    part = fn([s])
                    if key not in res["experiments"]:
                        res["experiments"][key] = part
                    else:
                        res["experiments"][key]["systems"].update(part["systems"])
                    res["experiments"][key]["seconds"] = time.perf_counter() - t1
                    save_partial()
            except Exception as e:  # noqa: BLE001 - recorded in the report, run fails
                log(f"experiment {key} failed: {e}")
                res["errors"][key] = str(e)
                ctx.stop_all()
            log(f"  experiment {key}: {secs(time.perf_counter() - t1)}")
            save_partial()
        for d in args.merge_from or []:
            path = os.path.join(d, "results.json")
            if not os.path.exists(path):
                path = os.path.join(d, "results.partial.json")
            with open(path) as f:
                other = json.load(f)
            earlier = {m["experiment"]: m for m in other.get("merged", [])}
            for key, e in other["experiments"].items():
                if key not in res["experiments"]:
                    res["experiments"][key] = e
                    res.setdefault("merged", []).append(earlier.get(key) or
                        {"experiment": key, "from": other["env"]["command"],
                         "date_utc": other["env"]["date_utc"],
                         "load_start": other["env"]["load_start"],
                         "load_end": other.get("load_end", "-"),
                         "complete": os.path.basename(path) == "results.json"})
            ctx.checks.extend(c for c in other.get("checks", []))
    finally:
        ctx.stop_all()
        if own_scratch:
            shutil.rmtree(args.scratch, ignore_errors=True)
    res["copy_supported"] = Ibid.copy_supported
    res["seconds"] = time.perf_counter() - t0
    res["load_end"] = sh("cut -d' ' -f1-3 /proc/loadavg")
    res["checks"] = ctx.checks
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    try:
        os.unlink(os.path.join(args.out, "results.partial.json"))
    except OSError:
        pass
    report(res, args.out)
    print(f"seed experiments ({scale}), {secs(res['seconds'])}; report: "
          f"{os.path.join(args.out, 'report.md')}")
    print(table(HEAD, headline(res)))
    failed = [c for c in ctx.checks if not c["ok"]]
    for c in failed:
        print(f"CHECK FAILED: {c['name']}: {c['detail']}")
    for k, v in res["errors"].items():
        print(f"EXPERIMENT {k} FAILED: {v}")
    return 1 if failed or res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
