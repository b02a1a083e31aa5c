//! The NBD server's view of the pool: every volume is an export named after it. Every request
//! is counted in the volume's [`VolumeIo`] (`protocol="nbd"`) and charged to its
//! [`VolumeQos`] limits (snapshots are not limited). Writes pass the volume's copy gate
//! ([`CopyGates`]): they wait for an EXTENDED COPY involving the volume instead of failing it.
//! A volume being restored from a remote runs each request through its restore's hooks
//! ([`RestoreHooks`]), and is not exported until its restore runs.

use crate::clients::Clients;
use crate::copy_gates::{CopyGates, Gate};
use crate::instant_restores::{InstantRestores, RestoreHooks};
use crate::metrics::{Metrics, Op, Protocol, VolumeIo};
use crate::qos::{Qos, VolumeQos};
use ibid_engine::{Error, ExtentKind, Pool, Volume};
use ibid_nbd::{Direction, Export, ExportError, ExportInfo, Exports, Extent};
use std::sync::Arc;
use std::time::Duration;

/// Extents returned per block-status request at most (clients ask again from where it ends).
/// Small, because qemu uses only the first extent of each reply and asks again from its end.
const BLOCK_STATUS_EXTENTS_MAX: usize = 64;

/// All volumes of a pool, as NBD exports.
pub struct PoolExports {
    pool: Pool,
    metrics: Arc<Metrics>,
    clients: Arc<Clients>,
    qos: Arc<Qos>,
    gates: Arc<CopyGates>,
    instants: Arc<InstantRestores>,
}

impl PoolExports {
    /// Exports every volume of `pool`, counting I/O in `metrics` and connections in `clients`,
    /// limited by `qos`, its writes passing `gates`, restored volumes through `instants`.
    pub fn new(
        pool: Pool,
        metrics: Arc<Metrics>,
        clients: Arc<Clients>,
        qos: Arc<Qos>,
        gates: Arc<CopyGates>,
        instants: Arc<InstantRestores>,
    ) -> Self {
        PoolExports {
            pool,
            metrics,
            clients,
            qos,
            gates,
            instants,
        }
    }
}

impl Exports for PoolExports {
    fn list(&self) -> Vec<ExportInfo> {
        let snapshots = self
            .pool
            .list_snapshots(None)
            .into_iter()
            .map(|s| ExportInfo {
                name: format!("{}@{}", s.volume, s.name),
                description: format!("ibid snapshot, read-only, {} bytes", s.size_bytes),
            });
        self.pool
            .list_volumes_now()
            .into_iter()
            // A volume whose restore has not resumed yet cannot be opened: not listed either.
            .filter(|v| !self.instants.is_opening(&v.name))
            .map(|v| ExportInfo {
                description: format!("ibid volume, {} bytes", v.size_bytes),
                name: v.name,
            })
            .chain(snapshots)
            .collect()
    }

    fn connected(&self, name: &str, client: &Arc<ibid_nbd::Client>) {
        let weak = Arc::downgrade(client);
        let alive: std::sync::Weak<dyn std::any::Any + Send + Sync> = weak;
        self.clients
            .add(name, "nbd", Some(client.peer), None, alive);
    }

    /// A volume by name, or a snapshot as `VOLUME@SNAPSHOT` (read-only).
    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let (volume, qos, gate, restore) = match name.split_once('@') {
            Some((volume, snapshot)) => (
                self.pool.snapshot(volume, snapshot).ok()?,
                None,
                None,
                RestoreHooks::default(),
            ),
            None => {
                if self.instants.is_opening(name) {
                    return None;
                }
                let volume = self.pool.volume(name).ok()?;
                let qos = self.qos.volume(volume.id(), name);
                let gate = self.gates.gate(volume.id());
                let restore = RestoreHooks::of(&self.instants, volume.id());
                (volume, Some(qos), Some(gate), restore)
            }
        };
        Some(Arc::new(VolumeExport {
            size: volume.size(),
            io: self.metrics.volume(name, Protocol::Nbd),
            volume,
            qos,
            gate,
            restore,
        }))
    }
}

/// One volume as an NBD export. The size is fixed when the connection opens it.
struct VolumeExport {
    volume: Volume,
    size: u64,
    io: Arc<VolumeIo>,
    /// The volume's limits (shared with its other connections); `None` for a snapshot.
    qos: Option<Arc<VolumeQos>>,
    /// The volume's copy gate, passed by writes; `None` for a snapshot.
    gate: Option<Arc<Gate>>,
    /// The volume's instant restore, if it is being restored.
    restore: RestoreHooks,
}

fn to_export_error(e: Error) -> ExportError {
    match e {
        Error::NoSpace => ExportError::NoSpace,
        Error::OutOfRange { .. } | Error::InvalidArgument(_) => ExportError::OutOfRange,
        Error::ReadOnly(_) => ExportError::ReadOnly,
        other => {
            tracing::error!("volume I/O: {other}");
            ExportError::Io(other.to_string())
        }
    }
}

impl Export for VolumeExport {
    fn size(&self) -> u64 {
        self.size
    }

    fn description(&self) -> String {
        format!("ibid volume {}", self.volume.name())
    }

    fn read_only(&self) -> bool {
        self.volume.read_only()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        let len = buf.len() as u64;
        self.io
            .record(Op::Read, len, || {
                self.restore.read(&self.volume, offset, buf)
            })
            .map_err(to_export_error)
    }

    fn read_if_cached(&self, offset: u64, buf: &mut [u8]) -> Option<Result<(), ExportError>> {
        if self.restore.is_live() {
            return None;
        }
        let start = std::time::Instant::now();
        let result = match self.volume.read_if_cached(offset, buf) {
            Ok(false) => return None,
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        Some(
            self.io
                .record_since(Op::Read, buf.len() as u64, start, result)
                .map_err(to_export_error),
        )
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        let _gate = self.gate.as_ref().map(|g| g.write());
        self.io
            .record(Op::Write, data.len() as u64, || {
                let len = data.len() as u64;
                self.restore
                    .write(offset, len, fua, || self.volume.write(offset, data, fua))
            })
            .map_err(to_export_error)
    }

    fn write_is_quick(&self, offset: u64, len: u64) -> bool {
        // Not while a copy is inside the gate or waiting: the write would wait for it on the
        // connection's task.
        let copying = self.gate.as_ref().is_some_and(|g| g.copying());
        !copying && !self.restore.is_live() && self.volume.write_is_quick(offset, len)
    }

    fn throttle(&self, direction: Direction, bytes: u64) -> Duration {
        self.qos
            .as_ref()
            .map_or(Duration::ZERO, |q| q.charge(direction.into(), bytes))
    }

    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        let _gate = self.gate.as_ref().map(|g| g.write());
        self.io
            .record(Op::WriteZeroes, len, || {
                self.restore.write(offset, len, fua, || {
                    self.volume.write_zeroes(offset, len, fua)
                })
            })
            .map_err(to_export_error)
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        let _gate = self.gate.as_ref().map(|g| g.write());
        self.io
            .record(Op::WriteZeroes, len, || {
                self.restore.write(offset, len, false, || {
                    self.volume.write_zeroes(offset, len, false)
                })
            })
            .map_err(to_export_error)
    }

    fn flush(&self) -> Result<(), ExportError> {
        self.io
            .record(Op::Flush, 0, || self.restore.flush(&self.volume))
            .map_err(to_export_error)
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        let extents = self
            .volume
            .block_status_max(offset, len, BLOCK_STATUS_EXTENTS_MAX)
            .map_err(to_export_error)?;
        Ok(self
            .restore
            .block_status(extents)
            .into_iter()
            .map(|e| {
                let zero = e.kind == ExtentKind::Zero;
                Extent {
                    len: e.length,
                    zero,
                    hole: zero,
                }
            })
            .collect())
    }
}
