//! The iSCSI target's view of the pool: one LUN per volume. A volume's LUN number is its
//! volume id minus one, so it never changes while the volume exists and is never reused.
//! Every command that reaches a volume is counted in its [`VolumeIo`] (`protocol="iscsi"`),
//! and reads and writes are charged to its QoS limits ([`Qos`]).

use crate::clients::Clients;
use crate::metrics::{Metrics, Op, Protocol, VolumeIo};
use crate::qos::Qos;
use ibid_engine::{Error, ExtentKind, Pool, Volume};
use ibid_iscsi::{Direction, Extent, Lun, LunError, LunInfo, Luns};
use std::sync::Arc;
use std::time::Duration;

/// Highest LUN number SAM allows with flat addressing; volumes beyond it are not exported.
const LUN_MAX: u64 = 16383;
/// Extents returned per GET LBA STATUS at most (initiators ask again from where it ends).
const LBA_STATUS_EXTENTS_MAX: usize = 256;

/// All volumes of a pool, as LUNs of one target.
pub struct PoolLuns {
    pool: Pool,
    /// Mixed into every LUN's identity so two pools never report the same NAA designator.
    pool_identity: [u8; 32],
    metrics: Arc<Metrics>,
    clients: Arc<Clients>,
    qos: Arc<Qos>,
}

impl PoolLuns {
    /// Exports every volume of `pool`, counting I/O in `metrics` and sessions in `clients`,
    /// limited by `qos`.
    pub fn new(pool: Pool, metrics: Arc<Metrics>, clients: Arc<Clients>, qos: Arc<Qos>) -> Self {
        let dir = std::fs::canonicalize(pool.dir()).unwrap_or_else(|_| pool.dir().to_path_buf());
        let pool_identity = *blake3::hash(dir.as_os_str().as_encoded_bytes()).as_bytes();
        PoolLuns {
            pool,
            pool_identity,
            metrics,
            clients,
            qos,
        }
    }

    fn volume_by_lun(&self, lun: u64) -> Option<Volume> {
        self.pool.volume_by_id(lun + 1).ok()
    }
}

fn to_lun_error(e: Error) -> LunError {
    match e {
        Error::NoSpace => LunError::NoSpace,
        Error::OutOfRange { .. } | Error::InvalidArgument(_) => LunError::OutOfRange,
        Error::NotFound(_) => LunError::NoSuchLun,
        Error::ReadOnly(_) => LunError::ReadOnly,
        other => {
            tracing::error!("volume I/O: {other}");
            LunError::Io(other.to_string())
        }
    }
}

impl Luns for PoolLuns {
    fn list(&self) -> Vec<LunInfo> {
        self.pool
            .list_volumes_now()
            .into_iter()
            .filter(|v| v.id - 1 <= LUN_MAX)
            .map(|v| LunInfo {
                lun: v.id - 1,
                name: v.name,
            })
            .collect()
    }

    fn open(&self, lun: u64) -> Option<Arc<dyn Lun>> {
        let volume = self.volume_by_lun(lun)?;
        let mut h = blake3::Hasher::new();
        h.update(&self.pool_identity);
        h.update(&volume.id().to_le_bytes());
        let id: [u8; 16] = h.finalize().as_bytes()[..16].try_into().expect("16 bytes");
        // The target opens the LUN for every command: this lookup is one shared lock, like
        // the engine's volume lookup just above.
        let io = self.metrics.volume(volume.name(), Protocol::Iscsi);
        Some(Arc::new(VolumeLun { volume, id, io }))
    }

    fn copy_range(
        &self,
        src_lun: u64,
        src_off: u64,
        dst_lun: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<(), LunError> {
        let src = self.volume_by_lun(src_lun).ok_or(LunError::NoSuchLun)?;
        let dst = self.volume_by_lun(dst_lun).ok_or(LunError::NoSuchLun)?;
        self.metrics
            .volume(dst.name(), Protocol::Iscsi)
            .record(Op::Copy, len, || dst.copy_from(&src, src_off, dst_off, len))
            .map(|_| ())
            .map_err(to_lun_error)
    }

    fn space_warning(&self) -> bool {
        self.pool.soft_threshold_exceeded()
    }

    fn generation(&self) -> u64 {
        self.pool.catalog_generation()
    }

    /// A volume's QoS entry exists once it has had limits or an NBD connection: one shared
    /// lock per command, like the metrics lookup in `open`.
    fn throttle(&self, lun: u64, direction: Direction, bytes: u64) -> Duration {
        self.qos
            .get(lun + 1)
            .map_or(Duration::ZERO, |q| q.charge(direction.into(), bytes))
    }

    fn connected(&self, lun: u64, initiator: &Arc<ibid_iscsi::Initiator>) {
        if let Some(volume) = self.volume_by_lun(lun) {
            let weak = Arc::downgrade(initiator);
            let alive: std::sync::Weak<dyn std::any::Any + Send + Sync> = weak;
            self.clients.add(
                volume.name(),
                "iscsi",
                initiator.peer,
                Some(initiator.name.clone()),
                alive,
            );
        }
    }
}

/// One volume as a LUN.
struct VolumeLun {
    volume: Volume,
    id: [u8; 16],
    io: Arc<VolumeIo>,
}

impl Lun for VolumeLun {
    fn size(&self) -> u64 {
        self.volume.size()
    }

    fn read_only(&self) -> bool {
        false
    }

    fn id(&self) -> [u8; 16] {
        self.id
    }

    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), LunError> {
        let len = buf.len() as u64;
        self.io
            .record(Op::Read, len, || self.volume.read(off, buf))
            .map_err(to_lun_error)
    }

    fn write(&self, off: u64, data: &[u8], fua: bool) -> Result<(), LunError> {
        self.io
            .record(Op::Write, data.len() as u64, || {
                self.volume.write(off, data, fua)
            })
            .map_err(to_lun_error)
    }

    fn write_zeroes(&self, off: u64, len: u64) -> Result<(), LunError> {
        self.io
            .record(Op::WriteZeroes, len, || {
                self.volume.write_zeroes(off, len, false)
            })
            .map_err(to_lun_error)
    }

    fn flush(&self) -> Result<(), LunError> {
        self.io
            .record(Op::Flush, 0, || self.volume.flush())
            .map_err(to_lun_error)
    }

    fn compare_and_write(
        &self,
        off: u64,
        expected: &[u8],
        new: &[u8],
    ) -> Result<Option<u64>, LunError> {
        self.io
            .record(Op::CompareAndWrite, new.len() as u64, || {
                self.volume.compare_and_write(off, expected, new, false)
            })
            .map_err(to_lun_error)
    }

    fn block_status(&self, off: u64, len: u64) -> Result<Vec<Extent>, LunError> {
        let extents = self
            .volume
            .block_status_max(off, len, LBA_STATUS_EXTENTS_MAX)
            .map_err(to_lun_error)?;
        Ok(extents
            .into_iter()
            .map(|e| Extent {
                off: e.offset,
                len: e.length,
                mapped: e.kind == ExtentKind::Data,
            })
            .collect())
    }
}
