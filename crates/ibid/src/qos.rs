//! Per-volume QoS: IOPS and MB/s limits (read, write, total) on a volume, shared by all its
//! connections through both protocols.
//!
//! Each limited volume has token buckets, one per limit set: a request takes its share (one
//! I/O, its bytes) from each bucket that applies to it when the front end asks
//! ([`VolumeQos::charge`]), and waits until the deepest of them is paid back. Buckets may go
//! into debt, so a request larger than the burst still passes, and the long-run rate is the
//! limit; a full bucket holds [`BURST`] worth of the limit. The wait happens in the front end's
//! async task (NBD: the connection's reader; iSCSI: the command's task), never on a thread
//! shared with other volumes, and a throttled request waits, it never fails.
//!
//! What counts (README, "The CLI"): reads and writes their bytes; write-zeroes, trim,
//! WRITE SAME and UNMAP one write I/O and no bytes (they are metadata operations); flush,
//! block status, EXTENDED COPY nothing. Snapshots (`VOLUME@SNAPSHOT` exports) are not limited.
//!
//! Limits are kept in `qos.json` in the pool directory, owned by this binary: keyed by volume
//! id (never reused), rewritten whole to a temporary file, synced, and renamed over the old one,
//! so a crash leaves the old or the new table. Entries of volumes that no longer exist (a crash
//! between a delete and the rewrite) are dropped when the server starts.

use crate::api::ApiError;
use ibid_engine::Pool;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Name of the limits table in the pool directory.
pub const FILE_NAME: &str = "qos.json";
/// Version of `qos.json`'s format.
const FILE_VERSION: u64 = 1;
/// How much of its limit a bucket holds when full: a volume idle for this long may run this
/// far ahead of its limit.
pub const BURST: Duration = Duration::from_millis(100);
/// Largest IOPS limit accepted.
pub const IOPS_MAX: u64 = 10_000_000;
/// Largest MB/s limit accepted (1 TiB/s).
pub const MBPS_MAX: u64 = 1 << 20;
/// Bytes in the "MB" of a MB/s limit: MiB, like every size in ibid.
pub const MB: u64 = 1 << 20;

/// A volume's limits; `None` is unlimited. MB/s are MiB (2^20 bytes) per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Reads per second.
    pub read_iops: Option<u64>,
    /// Writes (write-zeroes and unmaps included) per second.
    pub write_iops: Option<u64>,
    /// Reads and writes per second.
    pub total_iops: Option<u64>,
    /// MiB read per second.
    pub read_mbps: Option<u64>,
    /// MiB written per second.
    pub write_mbps: Option<u64>,
    /// MiB read and written per second.
    pub total_mbps: Option<u64>,
}

/// The API's names of the limits, in [`Limits::get`] order.
pub const FIELDS: [&str; 6] = [
    "read_iops",
    "write_iops",
    "total_iops",
    "read_mbps",
    "write_mbps",
    "total_mbps",
];

impl Limits {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.all().iter().all(Option::is_none)
    }

    /// The limits in [`FIELDS`] order.
    pub fn all(&self) -> [Option<u64>; 6] {
        [
            self.read_iops,
            self.write_iops,
            self.total_iops,
            self.read_mbps,
            self.write_mbps,
            self.total_mbps,
        ]
    }

    fn slot(&mut self, field: &str) -> Option<&mut Option<u64>> {
        Some(match field {
            "read_iops" => &mut self.read_iops,
            "write_iops" => &mut self.write_iops,
            "total_iops" => &mut self.total_iops,
            "read_mbps" => &mut self.read_mbps,
            "write_mbps" => &mut self.write_mbps,
            "total_mbps" => &mut self.total_mbps,
            _ => return None,
        })
    }

    /// These limits with `patch` applied, JSON merge-patch style: a field set to a number sets
    /// that limit, to `null` removes it, absent leaves it. Every field is checked before
    /// anything is applied; the error is the precise reason the patch is refused.
    pub fn patched(&self, patch: &Map<String, Value>) -> Result<Limits, String> {
        let mut out = *self;
        for (field, value) in patch {
            let max = if field.ends_with("_iops") {
                IOPS_MAX
            } else {
                MBPS_MAX
            };
            let Some(slot) = out.slot(field) else {
                return Err(format!(
                    "unknown QoS limit {field:?}; the limits are {}",
                    FIELDS.join(", ")
                ));
            };
            *slot = match value {
                Value::Null => None,
                Value::Number(n) => match n.as_u64() {
                    Some(v) if (1..=max).contains(&v) => Some(v),
                    _ => {
                        return Err(format!(
                            "{field} must be a whole number from 1 to {max} (or null for no \
                             limit), not {n}"
                        ))
                    }
                },
                other => {
                    return Err(format!(
                        "{field} must be a whole number from 1 to {max} (or null for no limit), \
                         not {other}"
                    ))
                }
            };
        }
        Ok(out)
    }
}

/// One token bucket: `rate` tokens a second, at most `burst` saved up, debt allowed.
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: f64, now: Instant) -> Bucket {
        let burst = (rate * BURST.as_secs_f64()).max(1.0);
        Bucket {
            rate,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes `n` tokens; the seconds until the bucket is out of debt again.
    fn take(&mut self, now: Instant, n: f64) -> f64 {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + dt * self.rate).min(self.burst) - n;
        if self.tokens >= 0.0 {
            0.0
        } else {
            -self.tokens / self.rate
        }
    }
}

/// Which way a request moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// A read.
    Read,
    /// A write (of data or zeroes).
    Write,
}

impl From<ibid_nbd::Direction> for Direction {
    fn from(d: ibid_nbd::Direction) -> Self {
        match d {
            ibid_nbd::Direction::Read => Direction::Read,
            ibid_nbd::Direction::Write => Direction::Write,
        }
    }
}

impl From<ibid_iscsi::Direction> for Direction {
    fn from(d: ibid_iscsi::Direction) -> Self {
        match d {
            ibid_iscsi::Direction::Read => Direction::Read,
            ibid_iscsi::Direction::Write => Direction::Write,
        }
    }
}

/// The buckets of the limits set, in [`FIELDS`] order.
struct Buckets {
    limits: Limits,
    buckets: [Option<Bucket>; 6],
}

/// One volume's limits and their buckets, shared by all its connections.
pub struct VolumeQos {
    name: String,
    /// Any limit set: the fast path of an unlimited volume takes no lock.
    limited: AtomicBool,
    state: Mutex<Buckets>,
    throttled_requests: AtomicU64,
    throttled_ns: AtomicU64,
}

impl VolumeQos {
    fn new(name: &str, limits: Limits) -> VolumeQos {
        let qos = VolumeQos {
            name: name.to_string(),
            limited: AtomicBool::new(false),
            state: Mutex::new(Buckets {
                limits: Limits::default(),
                buckets: Default::default(),
            }),
            throttled_requests: AtomicU64::new(0),
            throttled_ns: AtomicU64::new(0),
        };
        qos.apply(limits);
        qos
    }

    /// Replaces the limits; buckets start full.
    fn apply(&self, limits: Limits) {
        let now = Instant::now();
        let mut state = self.state.lock();
        state.limits = limits;
        for (i, limit) in limits.all().into_iter().enumerate() {
            let per_unit = if i < 3 { 1.0 } else { MB as f64 };
            state.buckets[i] = limit.map(|l| Bucket::new(l as f64 * per_unit, now));
        }
        self.limited.store(!limits.is_unlimited(), Relaxed);
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.state.lock().limits
    }

    /// Takes one request of `bytes` from the buckets that apply to it and returns how long it
    /// must wait before it runs (zero when it is within the limits). Never blocks beyond a
    /// short lock; the caller does the waiting.
    pub fn charge(&self, direction: Direction, bytes: u64) -> Duration {
        if !self.limited.load(Relaxed) {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let mut state = self.state.lock();
        let (iops, mbps) = match direction {
            Direction::Read => (0, 3),
            Direction::Write => (1, 4),
        };
        let mut wait = 0f64;
        for (i, n) in [
            (iops, 1.0),
            (2, 1.0),
            (mbps, bytes as f64),
            (5, bytes as f64),
        ] {
            if n == 0.0 {
                continue;
            }
            if let Some(b) = &mut state.buckets[i] {
                wait = wait.max(b.take(now, n));
            }
        }
        drop(state);
        if wait <= 0.0 {
            return Duration::ZERO;
        }
        let wait = Duration::from_secs_f64(wait);
        self.throttled_requests.fetch_add(1, Relaxed);
        let ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        self.throttled_ns.fetch_add(ns, Relaxed);
        wait
    }

    /// Requests made to wait so far.
    pub fn throttled_requests(&self) -> u64 {
        self.throttled_requests.load(Relaxed)
    }

    /// Total time requests were made to wait so far.
    pub fn throttled_seconds(&self) -> f64 {
        self.throttled_ns.load(Relaxed) as f64 / 1e9
    }
}

/// One row of `qos.json`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    id: u64,
    /// The volume's name, for people reading the file; the id is the key.
    name: String,
    limits: Limits,
}

/// `qos.json`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    version: u64,
    volumes: Vec<Row>,
}

/// Every volume's QoS, by volume id, and the file that keeps the limits.
pub struct Qos {
    /// `qos.json`; `None` keeps nothing (tests).
    path: Option<PathBuf>,
    volumes: RwLock<HashMap<u64, Arc<VolumeQos>>>,
    /// Held while the table is changed and written, so writes land in order.
    saving: Mutex<()>,
}

impl Qos {
    /// The limits kept in `pool`'s directory (none if it has no `qos.json`), for the volumes
    /// that still exist.
    pub fn open(pool: &Pool) -> anyhow::Result<Qos> {
        let path = pool.dir().join(FILE_NAME);
        let qos = Qos {
            path: Some(path.clone()),
            volumes: RwLock::default(),
            saving: Mutex::default(),
        };
        let Some(table) = crate::durable::read_table::<Table>(&path, "QoS limits", FILE_VERSION)?
        else {
            return Ok(qos);
        };
        let mut stale = false;
        {
            let mut volumes = qos.volumes.write();
            for row in table.volumes {
                match pool.volume_by_id(row.id) {
                    Ok(v) if v.name() == row.name => {
                        volumes.insert(row.id, Arc::new(VolumeQos::new(&row.name, row.limits)));
                    }
                    _ => stale = true,
                }
            }
        }
        if stale {
            let _guard = qos.saving.lock();
            let rows = qos.rows(None);
            save(&path, rows)?;
        }
        Ok(qos)
    }

    /// A table that keeps nothing on disk.
    #[cfg(test)]
    pub fn in_memory() -> Qos {
        Qos {
            path: None,
            volumes: RwLock::default(),
            saving: Mutex::default(),
        }
    }

    /// Volume `id`'s QoS, created unlimited if it has none yet: for a connection opening the
    /// volume, which keeps it, so later changes of the limits reach it.
    pub fn volume(&self, id: u64, name: &str) -> Arc<VolumeQos> {
        if let Some(q) = self.volumes.read().get(&id) {
            return q.clone();
        }
        self.volumes
            .write()
            .entry(id)
            .or_insert_with(|| Arc::new(VolumeQos::new(name, Limits::default())))
            .clone()
    }

    /// Volume `id`'s QoS if it has any (a lookup under a shared lock: for the iSCSI target,
    /// which opens the volume per command).
    pub fn get(&self, id: u64) -> Option<Arc<VolumeQos>> {
        self.volumes.read().get(&id).cloned()
    }

    /// Volume `id`'s limits (unlimited if none were set).
    pub fn limits(&self, id: u64) -> Limits {
        self.get(id).map(|q| q.limits()).unwrap_or_default()
    }

    /// The table's rows, with `change` (id, name, limits) applied; unlimited volumes left out.
    fn rows(&self, change: Option<(u64, &str, Limits)>) -> BTreeMap<u64, Row> {
        let mut rows: BTreeMap<u64, Row> = self
            .volumes
            .read()
            .iter()
            .map(|(&id, q)| {
                let row = Row {
                    id,
                    name: q.name.clone(),
                    limits: q.limits(),
                };
                (id, row)
            })
            .collect();
        if let Some((id, name, limits)) = change {
            rows.insert(
                id,
                Row {
                    id,
                    name: name.to_string(),
                    limits,
                },
            );
        }
        rows.retain(|_, r| !r.limits.is_unlimited());
        rows
    }

    /// Sets volume `id`'s limits to what `change` makes of the current ones: written to the
    /// file first, then in force on every connection at once. Changes are serialized. On an
    /// error (`change`'s, or the file's as a 500 `internal`) nothing changed.
    pub fn update(
        &self,
        id: u64,
        name: &str,
        change: impl FnOnce(Limits) -> Result<Limits, ApiError>,
    ) -> Result<Limits, ApiError> {
        let _guard = self.saving.lock();
        let limits = change(self.limits(id))?;
        if let Some(path) = &self.path {
            save(path, self.rows(Some((id, name, limits)))).map_err(ApiError::internal)?;
        }
        self.volume(id, name).apply(limits);
        Ok(limits)
    }

    /// Forgets deleted volume `id` (its limits leave the file).
    pub fn forget(&self, id: u64) -> anyhow::Result<()> {
        let _guard = self.saving.lock();
        let removed = self.volumes.write().remove(&id);
        match (removed, &self.path) {
            (Some(q), Some(path)) if !q.limits().is_unlimited() => save(path, self.rows(None)),
            _ => Ok(()),
        }
    }
}

/// Writes the table crash-safely: a temporary file, synced, renamed over `path`, directory
/// synced.
fn save(path: &Path, rows: BTreeMap<u64, Row>) -> anyhow::Result<()> {
    let table = Table {
        version: FILE_VERSION,
        volumes: rows.into_values().collect(),
    };
    let text = serde_json::to_string_pretty(&table)? + "\n";
    crate::durable::write_file(path, text.as_bytes())
        .map_err(|e| anyhow::anyhow!("write the QoS limits to {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn patch(v: Value) -> Map<String, Value> {
        v.as_object().expect("object").clone()
    }

    /// Numbers set, null clears, absent keeps; bad values and names are refused whole.
    #[test]
    fn patches() {
        let l = Limits::default()
            .patched(&patch(json!({"write_iops": 200, "read_mbps": 5})))
            .expect("valid");
        assert_eq!(l.write_iops, Some(200));
        assert_eq!(l.read_mbps, Some(5));
        let l2 = l
            .patched(&patch(json!({"write_iops": null})))
            .expect("valid");
        assert_eq!(l2.write_iops, None);
        assert_eq!(l2.read_mbps, Some(5));
        for bad in [
            json!({"write_iops": 0}),
            json!({"write_iops": -1}),
            json!({"write_iops": 1.5}),
            json!({"write_iops": "100"}),
            json!({"write_iops": IOPS_MAX + 1}),
            json!({"read_mbps": MBPS_MAX + 1}),
            json!({"iops": 100}),
        ] {
            assert!(l.patched(&patch(bad.clone())).is_err(), "{bad}");
        }
    }

    /// A 100 IOPS limit lets the burst through, then makes each request wait its 10 ms.
    #[test]
    fn bucket_rate() {
        let qos = Qos::in_memory();
        let v = qos.volume(1, "v");
        assert_eq!(v.charge(Direction::Write, 4096), Duration::ZERO);
        let limits = Limits {
            write_iops: Some(100),
            ..Limits::default()
        };
        assert!(qos.update(1, "v", |_| Ok(limits)).is_ok());
        // Burst: 10 requests (100 ms of the limit); reads are not limited.
        let mut waits: Vec<Duration> = (0..30).map(|_| v.charge(Direction::Write, 4096)).collect();
        assert_eq!(v.charge(Direction::Read, 4096), Duration::ZERO);
        assert!(waits[..9].iter().all(|w| w.is_zero()), "{waits:?}");
        let last = waits.pop().expect("30");
        // 30 requests at 100/s with 10 free: the last waits ~200 ms.
        assert!(
            last > Duration::from_millis(180) && last < Duration::from_millis(220),
            "{last:?}"
        );
        assert_eq!(v.throttled_requests(), 20);
    }

    /// A MB/s limit charges bytes: at 1 MiB/s total, 256 KiB requests, reads and writes alike,
    /// pass at four a second once the 100 ms burst is spent; zeroing (0 bytes) passes.
    #[test]
    fn bytes_rate() {
        let qos = Qos::in_memory();
        let limits = Limits {
            total_mbps: Some(1),
            ..Limits::default()
        };
        assert!(qos.update(1, "v", |_| Ok(limits)).is_ok());
        let v = qos.get(1).expect("entry");
        let waits: Vec<f64> = (0..8)
            .map(|i| {
                let d = if i % 2 == 0 {
                    Direction::Read
                } else {
                    Direction::Write
                };
                v.charge(d, 256 << 10).as_secs_f64()
            })
            .collect();
        assert_eq!(v.charge(Direction::Write, 0), Duration::ZERO);
        // 8 × 256 KiB = 2 MiB against a 0.1 MiB burst: the last waits ~1.9 s.
        assert!((waits[7] - 1.9).abs() < 0.05, "{waits:?}");
        assert!(
            waits.windows(2).all(|w| (w[1] - w[0] - 0.25).abs() < 0.01),
            "{waits:?}"
        );
        assert!(v.throttled_seconds() > 7.0, "{}", v.throttled_seconds());
    }
}
