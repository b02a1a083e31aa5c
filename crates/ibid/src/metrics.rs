//! Prometheus metrics (issue 5), served as `GET /metrics` on the API's HTTP server in the
//! text exposition format 0.0.4. Names, labels and meanings: `docs/METRICS.md`.
//!
//! Two sources:
//! - **I/O**, recorded by the front ends' adapters (`nbd_exports.rs`, `iscsi_luns.rs`): per
//!   volume and protocol, requests, bytes, errors and a latency histogram per kind of request.
//!   Each (volume, protocol) has one [`VolumeIo`] of plain atomics; an adapter looks it up when
//!   it opens the volume and keeps the `Arc`, so recording a request takes no lock. (NBD opens
//!   once per connection; the iSCSI target opens the LUN per command, so there the lookup, a
//!   shared read lock, is per command, next to the engine's own volume lookup.)
//! - **QoS**, from the volumes' [`Qos`] entries: the limits in force, and the requests made to
//!   wait and for how long.
//! - **Space**, read from the engine at scrape time ([`Pool::stats`], [`Pool::list_volumes_now`]):
//!   figures exact as of the last commit (at most about a second old). A scrape never forces a
//!   commit.
//!
//! Written by hand rather than with `prometheus-client`: the format is a few lines of text per
//! sample, the space figures are computed at scrape time (a custom collector either way), and
//! that crate's `Histogram::observe` takes a mutex per observation, which the I/O path must
//! not. The page is checked by a parser in `tests/metrics.rs`.

use crate::qos::Qos;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use ibid_engine::Pool;
use std::collections::{BTreeMap, HashSet};
use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Upper bounds of the latency histogram buckets, in seconds (`+Inf` follows).
const LATENCY_BUCKETS_S: [f64; 17] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];
const BUCKET_COUNT: usize = LATENCY_BUCKETS_S.len() + 1;

/// Content type of the text exposition format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The front end a request came through (label `protocol`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `ibid-nbd`.
    Nbd,
    /// `ibid-iscsi`.
    Iscsi,
}

impl Protocol {
    const ALL: [Protocol; 2] = [Protocol::Nbd, Protocol::Iscsi];

    fn label(self) -> &'static str {
        match self {
            Protocol::Nbd => "nbd",
            Protocol::Iscsi => "iscsi",
        }
    }
}

/// A kind of request (label `op`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Read.
    Read,
    /// Write (with or without FUA).
    Write,
    /// Write zeroes, trim/discard, WRITE SAME, UNMAP: the engine does the same for all.
    WriteZeroes,
    /// Flush / SYNCHRONIZE CACHE.
    Flush,
    /// COMPARE AND WRITE (bytes: the data written).
    CompareAndWrite,
    /// EXTENDED COPY segment, counted on the destination volume (bytes: the length copied).
    Copy,
}

impl Op {
    const ALL: [Op; 6] = [
        Op::Read,
        Op::Write,
        Op::WriteZeroes,
        Op::Flush,
        Op::CompareAndWrite,
        Op::Copy,
    ];

    fn label(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::WriteZeroes => "write_zeroes",
            Op::Flush => "flush",
            Op::CompareAndWrite => "compare_and_write",
            Op::Copy => "copy",
        }
    }
}

/// Counters of one kind of request. Aligned so that two kinds never share a cache line.
#[derive(Default)]
#[repr(align(64))]
struct OpStats {
    /// Requests per latency bucket, not cumulative; the last is `+Inf`. Their sum is the
    /// request count, so the page's `+Inf` bucket always equals its `_count`.
    buckets: [AtomicU64; BUCKET_COUNT],
    latency_ns_sum: AtomicU64,
    /// Bytes of successful requests.
    bytes: AtomicU64,
    errors: AtomicU64,
}

impl OpStats {
    fn observe(&self, latency: Duration) {
        let s = latency.as_secs_f64();
        let i = LATENCY_BUCKETS_S
            .iter()
            .position(|&le| s <= le)
            .unwrap_or(BUCKET_COUNT - 1);
        self.buckets[i].fetch_add(1, Relaxed);
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.latency_ns_sum.fetch_add(ns, Relaxed);
    }
}

/// One volume's I/O through one protocol, shared by all its connections: atomics only.
#[derive(Default)]
pub struct VolumeIo {
    ops: [OpStats; Op::ALL.len()],
}

impl VolumeIo {
    /// Runs `f`, one request of kind `op` moving `bytes`, and records it: its latency, then
    /// its bytes if it succeeded or an error if it failed.
    pub fn record<T, E>(
        &self,
        op: Op,
        bytes: u64,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let start = Instant::now();
        let result = f();
        self.record_since(op, bytes, start, result)
    }

    /// Records `result`, one request of kind `op` moving `bytes` that started at `start`, as
    /// [`VolumeIo::record`] does; returns it.
    pub fn record_since<T, E>(
        &self,
        op: Op,
        bytes: u64,
        start: Instant,
        result: Result<T, E>,
    ) -> Result<T, E> {
        let stats = &self.ops[op as usize];
        stats.observe(start.elapsed());
        match &result {
            Ok(_) => stats.bytes.fetch_add(bytes, Relaxed),
            Err(_) => stats.errors.fetch_add(1, Relaxed),
        };
        result
    }
}

/// Running totals of one volume's I/O (requests, bytes, latency sums), as [`Metrics::totals`]
/// reads them. Writes count write, write-zeroes (trim, WRITE SAME, UNMAP) and compare-and-write
/// requests; flushes and copies are left out; latencies are those of plain reads and writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoTotals {
    /// Read requests.
    pub read_ops: u64,
    /// Write requests (write, write-zeroes, compare-and-write).
    pub write_ops: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written (write, compare-and-write).
    pub write_bytes: u64,
    /// Sum of the read latencies, nanoseconds.
    pub read_latency_ns: u64,
    /// Sum of the write latencies (plain writes), nanoseconds.
    pub write_latency_ns: u64,
    /// Plain writes (the count behind `write_latency_ns`).
    pub plain_writes: u64,
}

impl IoTotals {
    fn add(&mut self, io: &VolumeIo) {
        let count = |op: Op| -> u64 {
            io.ops[op as usize]
                .buckets
                .iter()
                .map(|b| b.load(Relaxed))
                .sum()
        };
        let read = &io.ops[Op::Read as usize];
        let write = &io.ops[Op::Write as usize];
        let reads = count(Op::Read);
        let writes = count(Op::Write);
        self.read_ops += reads;
        self.plain_writes += writes;
        self.write_ops += writes + count(Op::WriteZeroes) + count(Op::CompareAndWrite);
        self.read_bytes += read.bytes.load(Relaxed);
        self.write_bytes +=
            write.bytes.load(Relaxed) + io.ops[Op::CompareAndWrite as usize].bytes.load(Relaxed);
        self.read_latency_ns += read.latency_ns_sum.load(Relaxed);
        self.write_latency_ns += write.latency_ns_sum.load(Relaxed);
    }

    /// What happened between `earlier` and `self` (counters that went back, as when a volume's
    /// counters were dropped and made again, count from zero).
    pub fn since(&self, earlier: &IoTotals) -> IoTotals {
        let d = |a: u64, b: u64| if a >= b { a - b } else { a };
        IoTotals {
            read_ops: d(self.read_ops, earlier.read_ops),
            write_ops: d(self.write_ops, earlier.write_ops),
            read_bytes: d(self.read_bytes, earlier.read_bytes),
            write_bytes: d(self.write_bytes, earlier.write_bytes),
            read_latency_ns: d(self.read_latency_ns, earlier.read_latency_ns),
            write_latency_ns: d(self.write_latency_ns, earlier.write_latency_ns),
            plain_writes: d(self.plain_writes, earlier.plain_writes),
        }
    }

    /// Adds `other` to these totals.
    pub fn merge(&mut self, other: &IoTotals) {
        self.read_ops += other.read_ops;
        self.write_ops += other.write_ops;
        self.read_bytes += other.read_bytes;
        self.write_bytes += other.write_bytes;
        self.read_latency_ns += other.read_latency_ns;
        self.write_latency_ns += other.write_latency_ns;
        self.plain_writes += other.plain_writes;
    }
}

/// Every volume's I/O counters, by protocol and volume name (snapshots as `VOLUME@SNAPSHOT`).
#[derive(Default)]
pub struct Metrics {
    /// Indexed by `Protocol as usize`.
    volumes: [RwLock<BTreeMap<String, Arc<VolumeIo>>>; Protocol::ALL.len()],
}

impl Metrics {
    /// The counters of volume `name` through `protocol`, created at zero on first use. Call
    /// it when opening the volume and keep the result: it takes a lock.
    pub fn volume(&self, name: &str, protocol: Protocol) -> Arc<VolumeIo> {
        let map = &self.volumes[protocol as usize];
        if let Some(io) = map.read().unwrap_or_else(|e| e.into_inner()).get(name) {
            return io.clone();
        }
        map.write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// Forgets the counters of volumes that no longer exist and that no connection holds, so
    /// deleted volumes leave the page.
    fn prune(&self, existing: &HashSet<String>) {
        let stale = |name: &String, io: &Arc<VolumeIo>| {
            !existing.contains(name) && Arc::strong_count(io) == 1
        };
        for map in &self.volumes {
            // Look first under the read lock: the write lock would stall every iSCSI command.
            let read = map.read().unwrap_or_else(|e| e.into_inner());
            if !read.iter().any(|(name, io)| stale(name, io)) {
                continue;
            }
            drop(read);
            let mut map = map.write().unwrap_or_else(|e| e.into_inner());
            // Under the write lock nobody can take a new reference: a count of 1 is final.
            map.retain(|name, io| !stale(name, io));
        }
    }

    /// Every (protocol, volume, counters), in page order.
    fn entries(&self) -> Vec<(Protocol, String, Arc<VolumeIo>)> {
        let mut out = Vec::new();
        for p in Protocol::ALL {
            let map = self.volumes[p as usize]
                .read()
                .unwrap_or_else(|e| e.into_inner());
            out.extend(map.iter().map(|(n, io)| (p, n.clone(), io.clone())));
        }
        out
    }

    /// Running totals of every volume's I/O since the server started, both protocols summed,
    /// by export name (snapshots as `VOLUME@SNAPSHOT`): what the stats history samples. Reads
    /// atomics only, under the maps' read locks.
    pub fn totals(&self) -> Vec<(String, IoTotals)> {
        let mut by_name: BTreeMap<String, IoTotals> = BTreeMap::new();
        for (_, name, io) in self.entries() {
            by_name.entry(name).or_default().add(&io);
        }
        by_name.into_iter().collect()
    }

    /// The whole exposition page for `pool` and its volumes' `qos`.
    pub fn render(&self, pool: &Pool, qos: &Qos) -> String {
        let volumes = pool.list_volumes_now();
        let mut existing: HashSet<String> = volumes.iter().map(|v| v.name.clone()).collect();
        existing.extend(
            pool.list_snapshots(None)
                .into_iter()
                .map(|s| format!("{}@{}", s.volume, s.name)),
        );
        self.prune(&existing);
        let mut page = Page::default();
        render_pool(&mut page, pool);
        render_read_cache(&mut page, pool);
        page.family(
            "ibid_volume_size_bytes",
            "gauge",
            "Size of the volume as seen by clients.",
        );
        for v in &volumes {
            page.sample(
                "ibid_volume_size_bytes",
                &[("volume", &v.name)],
                v.size_bytes,
            );
        }
        page.family(
            "ibid_volume_mapped_blocks",
            "gauge",
            "4 KiB blocks of the volume mapped to data, as of the last commit.",
        );
        for v in &volumes {
            page.sample(
                "ibid_volume_mapped_blocks",
                &[("volume", &v.name)],
                v.mapped_blocks,
            );
        }
        page.family(
            "ibid_volume_tbz_blocks",
            "gauge",
            "Lazy-zeroed thick volumes: 4 KiB blocks never written (to be zeroed); else 0.",
        );
        for v in &volumes {
            page.sample(
                "ibid_volume_tbz_blocks",
                &[("volume", &v.name), ("format", v.format.as_str())],
                v.tbz_blocks,
            );
        }
        page.family(
            "ibid_volume_reserved_bytes",
            "gauge",
            "Pool space a thick volume keeps reserved for its blocks without data.",
        );
        for v in &volumes {
            page.sample(
                "ibid_volume_reserved_bytes",
                &[("volume", &v.name), ("format", v.format.as_str())],
                v.reserved_bytes,
            );
        }
        render_qos(&mut page, &volumes, qos);
        render_io(&mut page, &self.entries());
        page.text
    }
}

/// The background scrub's figures.
pub fn render_scrub(st: &crate::scrub::ScrubStatus) -> String {
    let mut page = Page::default();
    let families: [(&str, &str, &str, f64); 7] = [
        (
            "ibid_scrub_running",
            "gauge",
            "1 while a scrub pass runs.",
            f64::from(u8::from(st.running)),
        ),
        (
            "ibid_scrub_passes_total",
            "counter",
            "Scrub passes completed since the server started.",
            st.passes as f64,
        ),
        (
            "ibid_scrub_checked_chunks_total",
            "counter",
            "Chunks the scrub read back and checked since the server started.",
            st.checked_chunks_total as f64,
        ),
        (
            "ibid_scrub_checked_bytes_total",
            "counter",
            "Bytes the scrub read since the server started.",
            st.checked_bytes_total as f64,
        ),
        (
            "ibid_scrub_damaged_chunks",
            "gauge",
            "Damaged chunks the current (or last) scrub pass found.",
            st.damaged.len() as f64,
        ),
        (
            "ibid_scrub_progress_ratio",
            "gauge",
            "Part of the current (or last) pass done: chunks checked / chunks at its start.",
            if st.total_chunks == 0 {
                f64::from(u8::from(st.passes > 0))
            } else {
                (st.checked_chunks as f64 / st.total_chunks as f64).min(1.0)
            },
        ),
        (
            "ibid_scrub_last_pass_finished_seconds",
            "gauge",
            "When the last complete scrub pass ended, Unix time (0: none yet).",
            st.last_pass_finished_unix_s.unwrap_or(0) as f64,
        ),
    ];
    for (name, kind, help, value) in families {
        page.family(name, kind, help);
        page.sample(name, &[], value);
    }
    page.text
}

/// Pushes to and restores from remotes since the server started (`remotes.rs` records them).
#[derive(Default)]
pub struct OffloadStats {
    /// Bytes pushes sent to object stores.
    pub pushed_bytes: AtomicU64,
    /// Bytes restores received from object stores.
    pub restored_bytes: AtomicU64,
    /// Chunks pushes sent.
    pub chunks_sent: AtomicU64,
    /// Chunks pushes skipped (the remote had them).
    pub chunks_skipped: AtomicU64,
    /// Pushes that completed.
    pub pushes: AtomicU64,
    /// Pushes that failed or were cancelled.
    pub push_failures: AtomicU64,
    /// Restores that completed.
    pub restores: AtomicU64,
    /// GCs of remotes that schedules ran.
    pub gc_runs: AtomicU64,
    /// Bytes those GCs freed in the remotes.
    pub gc_bytes_freed: AtomicU64,
    /// Per volume, when its last push completed (Unix seconds).
    pub last_push_unix_s: parking_lot::Mutex<BTreeMap<String, u64>>,
}

/// The offload figures, and each schedule's lag (volume, seconds overdue).
pub fn render_offload(st: &OffloadStats, schedule_lags: &[(String, u64)]) -> String {
    let mut page = Page::default();
    let counters: [(&str, &str, &AtomicU64); 9] = [
        (
            "ibid_remote_pushed_bytes_total",
            "Bytes pushes sent to remotes (packs, index segments, manifests).",
            &st.pushed_bytes,
        ),
        (
            "ibid_remote_restored_bytes_total",
            "Bytes restores received from remotes.",
            &st.restored_bytes,
        ),
        (
            "ibid_remote_chunks_sent_total",
            "Chunks pushes sent.",
            &st.chunks_sent,
        ),
        (
            "ibid_remote_chunks_skipped_total",
            "Chunks pushes skipped: the remote had them.",
            &st.chunks_skipped,
        ),
        ("ibid_remote_pushes_total", "Pushes completed.", &st.pushes),
        (
            "ibid_remote_push_failures_total",
            "Pushes that failed or were cancelled.",
            &st.push_failures,
        ),
        (
            "ibid_remote_restores_total",
            "Restores completed.",
            &st.restores,
        ),
        (
            "ibid_remote_scheduled_gcs_total",
            "GCs of remotes run by schedules (after their retention deleted snapshots).",
            &st.gc_runs,
        ),
        (
            "ibid_remote_scheduled_gc_freed_bytes_total",
            "Bytes of packs those GCs deleted.",
            &st.gc_bytes_freed,
        ),
    ];
    for (name, help, v) in counters {
        page.family(name, "counter", help);
        page.sample(name, &[], v.load(Relaxed));
    }
    let name = "ibid_remote_last_push_seconds";
    page.family(
        name,
        "gauge",
        "When the volume's last push completed, Unix time.",
    );
    for (volume, t) in st.last_push_unix_s.lock().iter() {
        page.sample(name, &[("volume", volume)], t);
    }
    let name = "ibid_schedule_lag_seconds";
    page.family(
        name,
        "gauge",
        "Seconds a volume's snapshot schedule is overdue (0: on time).",
    );
    for (volume, lag) in schedule_lags {
        page.sample(name, &[("volume", volume)], lag);
    }
    page.text
}

/// Pool-wide figures from [`Pool::stats`].
fn render_pool(page: &mut Page, pool: &Pool) {
    let s = pool.stats();
    let gauges: [(&str, &str, f64); 25] = [
        (
            "capacity_bytes",
            "Capacity of the pool.",
            s.capacity_bytes as f64,
        ),
        (
            "used_bytes",
            "Space counted against capacity: physical plus metadata.",
            s.used_bytes as f64,
        ),
        ("free_bytes", "Capacity minus used.", s.free_bytes as f64),
        (
            "physical_bytes",
            "Bytes the live chunks occupy in segment files, after compression.",
            s.physical_bytes as f64,
        ),
        (
            "metadata_bytes",
            "Size of the metadata store.",
            s.metadata_bytes as f64,
        ),
        (
            "logical_written_bytes",
            "Non-zero data the volumes hold as seen by clients (mapped blocks x 4 KiB).",
            s.logical_written_bytes as f64,
        ),
        (
            "unique_bytes",
            "Distinct non-zero blocks stored, before compression (unique chunks x 4 KiB).",
            s.unique_bytes as f64,
        ),
        (
            "unique_chunks",
            "Distinct chunks stored.",
            s.unique_chunks as f64,
        ),
        (
            "garbage_bytes",
            "Dead bytes in segment files, awaiting the cleaner.",
            s.garbage_bytes as f64,
        ),
        (
            "segment_file_bytes",
            "Bytes of all segment files.",
            s.segment_file_bytes as f64,
        ),
        (
            "provisioned_bytes",
            "Sum of the volumes' sizes (thin: may exceed capacity).",
            s.provisioned_bytes as f64,
        ),
        (
            "thick_provisioned_bytes",
            "Sum of the thick volumes' sizes.",
            s.thick_provisioned_bytes as f64,
        ),
        (
            "reserved_bytes",
            "Space thick volumes keep reserved: for their blocks without data, and the overwrite headroom.",
            s.reserved_bytes as f64,
        ),
        (
            "overwrite_headroom_bytes",
            "Part of the reserved space that lets thick volumes overwrite their data on a full pool.",
            s.overwrite_headroom_bytes as f64,
        ),
        (
            "filesystem_bytes",
            "Size of the filesystem under the pool.",
            s.filesystem_bytes as f64,
        ),
        (
            "filesystem_free_bytes",
            "Bytes available on the filesystem under the pool (other files can take them too).",
            s.filesystem_free_bytes as f64,
        ),
        (
            "filesystem_reserve_bytes",
            "Filesystem bytes kept free for metadata: new data gets ENOSPC below it.",
            s.filesystem_reserve_bytes as f64,
        ),
        (
            "data_reduction_ratio",
            "Logical written bytes per physical byte (1 for an empty pool).",
            s.data_reduction_ratio,
        ),
        (
            "soft_threshold_ratio",
            "Soft threshold, as a fraction of capacity.",
            f64::from(s.soft_threshold_pct) / 100.0,
        ),
        (
            "soft_threshold_exceeded",
            "1 while used + reserved has reached the soft threshold, else 0.",
            f64::from(u8::from(s.soft_threshold_exceeded)),
        ),
        ("volumes", "Number of volumes.", s.volumes as f64),
        (
            "dedup_filter_ram_bytes",
            "RAM of the dedup filter.",
            s.dedup_filter_ram_bytes as f64,
        ),
        (
            "dedup_filter_capacity",
            "Fingerprints the dedup filter is sized for.",
            s.dedup_filter_capacity as f64,
        ),
        (
            "dedup_filter_fingerprints",
            "Fingerprints the dedup filter holds, of live and of since freed chunks (rebuilt past \
             twice its capacity).",
            s.dedup_filter_fingerprints as f64,
        ),
        (
            "layer_filter_ram_bytes",
            "RAM of the filters that let lookups skip map layers.",
            s.layer_filter_ram_bytes as f64,
        ),
    ];
    for (name, help, value) in gauges {
        let name = format!("ibid_pool_{name}");
        page.family(&name, "gauge", help);
        page.sample(&name, &[], Float(value));
    }
    page.family(
        "ibid_pool_commits_total",
        "counter",
        concat!(
            "Number of the last committed metadata batch: commits since the pool was created, ",
            "plus up to 66 numbers skipped at each open."
        ),
    );
    page.sample("ibid_pool_commits_total", &[], s.committed_batches);
}

/// The engine's read cache: its size and fill, and what it served.
fn render_read_cache(page: &mut Page, pool: &Pool) {
    let s = pool.read_cache_stats();
    let metrics: [(&str, &str, &str, u64); 6] = [
        (
            "capacity_bytes",
            "gauge",
            "Memory the read cache may use (0: none).",
            s.capacity_bytes,
        ),
        (
            "used_bytes",
            "gauge",
            "Memory holding cached blocks.",
            s.used_bytes,
        ),
        (
            "hits_total",
            "counter",
            "4 KiB blocks read from the read cache.",
            s.hits,
        ),
        (
            "misses_total",
            "counter",
            "4 KiB blocks looked for in the read cache and read from their segment.",
            s.misses,
        ),
        (
            "admitted_total",
            "counter",
            "4 KiB blocks put into the read cache (on their second miss).",
            s.admitted,
        ),
        (
            "evicted_total",
            "counter",
            "Cached blocks dropped to make room.",
            s.evicted,
        ),
    ];
    for (name, kind, help, value) in metrics {
        let name = format!("ibid_read_cache_{name}");
        page.family(&name, kind, help);
        page.sample(&name, &[], value);
    }
}

/// Per-volume QoS limits and throttling counters.
fn render_qos(page: &mut Page, volumes: &[ibid_engine::VolumeInfo], qos: &Qos) {
    let entries: Vec<_> = volumes
        .iter()
        .map(|v| (v.name.as_str(), qos.get(v.id)))
        .collect();
    let limits = [
        (
            "ibid_volume_qos_limit_iops",
            "QoS limit of the volume in requests per second (op: read, write, total).",
            0,
            1,
        ),
        (
            "ibid_volume_qos_limit_bytes_per_second",
            "QoS limit of the volume in bytes per second (op: read, write, total).",
            3,
            crate::qos::MB,
        ),
    ];
    for (name, help, first, unit) in limits {
        page.family(name, "gauge", help);
        for (volume, q) in &entries {
            let Some(q) = q else { continue };
            let all = q.limits().all();
            for (i, op) in ["read", "write", "total"].into_iter().enumerate() {
                if let Some(l) = all[first + i] {
                    page.sample(name, &[("volume", volume), ("op", op)], l * unit);
                }
            }
        }
    }
    let name = "ibid_volume_throttled_requests_total";
    page.family(
        name,
        "counter",
        "Requests QoS made wait before they ran, through any protocol.",
    );
    for (volume, q) in &entries {
        let n = q.as_ref().map_or(0, |q| q.throttled_requests());
        page.sample(name, &[("volume", volume)], n);
    }
    let name = "ibid_volume_throttled_seconds_total";
    page.family(
        name,
        "counter",
        "Time requests waited for the volume's QoS limits, summed over requests.",
    );
    for (volume, q) in &entries {
        let s = q.as_ref().map_or(0.0, |q| q.throttled_seconds());
        page.sample(name, &[("volume", volume)], Float(s));
    }
}

/// Per-volume, per-protocol request counters and latency histograms.
fn render_io(page: &mut Page, entries: &[(Protocol, String, Arc<VolumeIo>)]) {
    type Counter = fn(&OpStats) -> u64;
    let counters: [(&str, &str, Counter, &[Op]); 3] = [
        (
            "ibid_volume_requests_total",
            "Requests handed to the engine, failed ones included.",
            |s| s.buckets.iter().map(|b| b.load(Relaxed)).sum(),
            &Op::ALL,
        ),
        (
            "ibid_volume_bytes_total",
            "Bytes read, written, zeroed or copied by successful requests.",
            |s| s.bytes.load(Relaxed),
            &[
                Op::Read,
                Op::Write,
                Op::WriteZeroes,
                Op::CompareAndWrite,
                Op::Copy,
            ],
        ),
        (
            "ibid_volume_errors_total",
            "Requests that failed.",
            |s| s.errors.load(Relaxed),
            &Op::ALL,
        ),
    ];
    for (name, help, get, ops) in counters {
        page.family(name, "counter", help);
        for (p, volume, io) in entries {
            for &op in ops {
                let l = io_labels(*p, op, volume);
                page.sample(name, &l, get(&io.ops[op as usize]));
            }
        }
    }
    let name = "ibid_volume_request_duration_seconds";
    page.family(
        name,
        "histogram",
        "Time from the adapter's call into the engine to its return.",
    );
    for (p, volume, io) in entries {
        for op in Op::ALL {
            let stats = &io.ops[op as usize];
            let l = io_labels(*p, op, volume);
            let mut cumulative = 0u64;
            for (i, bucket) in stats.buckets.iter().enumerate() {
                cumulative += bucket.load(Relaxed);
                let le = LATENCY_BUCKETS_S
                    .get(i)
                    .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
                let [v, p, o] = l;
                page.sample(
                    &format!("{name}_bucket"),
                    &[v, p, o, ("le", &le)],
                    cumulative,
                );
            }
            let sum_s = stats.latency_ns_sum.load(Relaxed) as f64 / 1e9;
            page.sample(&format!("{name}_sum"), &l, Float(sum_s));
            page.sample(&format!("{name}_count"), &l, cumulative);
        }
    }
}

/// The labels of one (volume, protocol, op) series.
fn io_labels(p: Protocol, op: Op, volume: &str) -> [(&'static str, &str); 3] {
    [
        ("volume", volume),
        ("protocol", p.label()),
        ("op", op.label()),
    ]
}

/// A sample value that is a float: Prometheus spells infinities `+Inf`/`-Inf`.
struct Float(f64);

impl Display for Float {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            v if v.is_nan() => f.write_str("NaN"),
            v if v == f64::INFINITY => f.write_str("+Inf"),
            v if v == f64::NEG_INFINITY => f.write_str("-Inf"),
            v => write!(f, "{v}"),
        }
    }
}

/// An exposition page being written.
#[derive(Default)]
struct Page {
    text: String,
}

impl Page {
    /// The `# HELP` and `# TYPE` lines that open a metric family.
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// One sample line: `name{label="value",...} value`.
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", escape_label(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }
}

/// Escapes a label value: backslash, double quote and newline.
fn escape_label(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// `GET /metrics`: the exposition page. Needs the [`Metrics`] and the [`Qos`] as request
/// extensions.
pub async fn scrape(
    State(pool): State<Pool>,
    Extension(metrics): Extension<Arc<Metrics>>,
    Extension(qos): Extension<Arc<Qos>>,
    Extension(scrubber): Extension<Arc<crate::scrub::Scrubber>>,
    Extension(offload): Extension<Arc<OffloadStats>>,
    Extension(schedules): Extension<Arc<crate::schedules::Schedules>>,
) -> Response {
    // Engine calls may wait on the pool's locks: keep them off the async workers.
    let page = move || {
        metrics.render(&pool, &qos)
            + &render_scrub(&scrubber.status())
            + &render_offload(&offload, &schedules.lags())
    };
    match tokio::task::spawn_blocking(page).await {
        Ok(page) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], page).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("render metrics: {e}"),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Latencies land in the first bucket whose bound holds them; errors and bytes split.
    #[test]
    fn record_buckets_bytes_and_errors() {
        let io = VolumeIo::default();
        let ok: Result<(), ()> = io.record(Op::Write, 4096, || Ok(()));
        assert!(ok.is_ok());
        let err: Result<(), ()> = io.record(Op::Write, 4096, || Err(()));
        assert!(err.is_err());
        let w = &io.ops[Op::Write as usize];
        assert_eq!(w.bytes.load(Relaxed), 4096);
        assert_eq!(w.errors.load(Relaxed), 1);
        assert_eq!(w.buckets.iter().map(|b| b.load(Relaxed)).sum::<u64>(), 2);
        let s = OpStats::default();
        s.observe(Duration::from_micros(50));
        s.observe(Duration::from_micros(51));
        s.observe(Duration::from_secs(11));
        assert_eq!(s.buckets[0].load(Relaxed), 1);
        assert_eq!(s.buckets[1].load(Relaxed), 1);
        assert_eq!(s.buckets[BUCKET_COUNT - 1].load(Relaxed), 1);
    }

    /// Label values are escaped; floats use Prometheus spellings.
    #[test]
    fn sample_lines() {
        let mut page = Page::default();
        page.sample("m", &[("a", "x\"y\\z\n")], Float(f64::INFINITY));
        page.sample("n", &[], Float(0.5));
        assert_eq!(page.text, "m{a=\"x\\\"y\\\\z\\n\"} +Inf\nn 0.5\n");
    }
}
