//! The iSCSI target's view of the pool: one LUN per volume, and one per snapshot exported
//! read-only, as the LUN table ([`LunMap`]) says. Every command that reaches a volume is
//! counted in its [`VolumeIo`] (`protocol="iscsi"`; a snapshot's under `VOLUME@SNAPSHOT`), and
//! a volume's reads and writes are charged to its QoS limits ([`Qos`]; snapshots are not
//! limited).
//!
//! An EXTENDED COPY passes its volumes' gates ([`CopyGates`]) on the copies' side, a write its
//! volume's gate on the writes' side, here and in the NBD server: writes wait for the copies
//! involving their volume, copies for the writes, and copies in flight reach the engine
//! together.

use crate::clients::Clients;
use crate::copy_gates::{CopyGates, Gate};
use crate::instant_restores::{InstantRestores, RestoreHooks};
use crate::lun_map::{LunMap, Mapping};
use crate::metrics::{Metrics, Op, Protocol, VolumeIo};
use crate::qos::Qos;
use ibid_engine::{Error, ExtentKind, Pool, Volume};
use ibid_iscsi::{Direction, Extent, HeldData, Lun, LunError, LunInfo, Luns};
use std::sync::Arc;
use std::time::Duration;

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
    map: Arc<LunMap>,
    /// Per volume: writes hold it shared, EXTENDED COPY exclusively.
    gates: Arc<CopyGates>,
    /// Volumes being restored from a remote.
    instants: Arc<InstantRestores>,
}

/// Attempts of a copy the engine gave up on because its volumes kept changing.
const COPY_TRIES: usize = 3;

impl PoolLuns {
    /// Exports what `map` maps of `pool`, counting I/O in `metrics` and sessions in
    /// `clients`, limited by `qos`, its writes and copies passing `gates`.
    pub fn new(
        pool: Pool,
        metrics: Arc<Metrics>,
        clients: Arc<Clients>,
        qos: Arc<Qos>,
        map: Arc<LunMap>,
        gates: Arc<CopyGates>,
        instants: Arc<InstantRestores>,
    ) -> Self {
        let dir = std::fs::canonicalize(pool.dir()).unwrap_or_else(|_| pool.dir().to_path_buf());
        let pool_identity = *blake3::hash(dir.as_os_str().as_encoded_bytes()).as_bytes();
        PoolLuns {
            pool,
            pool_identity,
            metrics,
            clients,
            qos,
            map,
            gates,
            instants,
        }
    }

    /// What LUN `lun` maps, reconciling the table with the pool first if the LUN is unknown
    /// (a volume created by a path that did not map it yet).
    fn mapping(&self, lun: u64) -> Option<Mapping> {
        if let Some(m) = self.map.get(lun) {
            return Some(m);
        }
        if let Err(e) = self.map.refresh(&self.pool) {
            tracing::error!("LUN table: {e:#}");
        }
        self.map.get(lun)
    }

    /// The volume or read-only snapshot LUN `lun` exports, with its export name.
    fn volume_by_lun(&self, lun: u64) -> Option<(Volume, Mapping)> {
        let m = self.mapping(lun)?;
        let volume = match &m.snapshot {
            None => self.pool.volume_by_id(m.volume_id).ok()?,
            Some(s) => {
                let snap = self.pool.snapshot(&m.volume, s).ok()?;
                (Some(snap.id()) == m.snapshot_id).then_some(snap)?
            }
        };
        Some((volume, m))
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
    /// REPORT LUNS reconciles the table first if the catalog changed (a deleted snapshot's
    /// export goes).
    fn list(&self) -> Vec<LunInfo> {
        if let Err(e) = self.map.refresh(&self.pool) {
            tracing::error!("LUN table: {e:#}");
        }
        self.map
            .list()
            .into_iter()
            .map(|m| LunInfo {
                lun: m.lun,
                name: m.name(),
            })
            .collect()
    }

    fn open(&self, lun: u64) -> Option<Arc<dyn Lun>> {
        let (volume, mapping) = self.volume_by_lun(lun)?;
        let restore = match mapping.snapshot {
            Some(_) => RestoreHooks::default(),
            None if self.instants.is_opening(&mapping.volume) => return None,
            None => RestoreHooks::of(&self.instants, volume.id()),
        };
        let mut h = blake3::Hasher::new();
        h.update(&self.pool_identity);
        h.update(&volume.id().to_le_bytes());
        let id: [u8; 16] = h.finalize().as_bytes()[..16].try_into().expect("16 bytes");
        // The target opens the LUN for every command: this lookup is one shared lock, like
        // the engine's volume lookup just above.
        let io = self.metrics.volume(&mapping.name(), Protocol::Iscsi);
        let gate = self.gates.gate(mapping.volume_id);
        Some(Arc::new(VolumeLun {
            volume,
            id,
            io,
            gate,
            restore,
        }))
    }

    fn copy_range(
        &self,
        src_lun: u64,
        src_off: u64,
        dst_lun: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<(), LunError> {
        let (src, src_map) = self.volume_by_lun(src_lun).ok_or(LunError::NoSuchLun)?;
        let (dst, dst_map) = self.volume_by_lun(dst_lun).ok_or(LunError::NoSuchLun)?;
        // A backlog of uncommitted writes is committed first, while writes go on: a copy by
        // frames commits its volumes' changes behind the gates, and the writes wait for it.
        src.commit_backlog().map_err(to_lun_error)?;
        let gates = self.gates.for_copy(&[src_map.volume_id, dst_map.volume_id]);
        let _held: Vec<_> = gates.iter().map(|g| g.copy()).collect();
        let io = self.metrics.volume(&dst_map.name(), Protocol::Iscsi);
        // A volume being restored: the source's chunks are fetched first, the destination's
        // whole chunks claimed (the restore must not write over the copy).
        let (src_restore, dst_restore) = match (&src_map.snapshot, &dst_map.snapshot) {
            (None, None) => (
                RestoreHooks::of(&self.instants, src.id()),
                RestoreHooks::of(&self.instants, dst.id()),
            ),
            (None, Some(_)) => (
                RestoreHooks::of(&self.instants, src.id()),
                RestoreHooks::default(),
            ),
            _ => (
                RestoreHooks::default(),
                RestoreHooks::of(&self.instants, dst.id()),
            ),
        };
        let mut tries = 0;
        loop {
            tries += 1;
            let copied = io.record(Op::Copy, len, || {
                src_restore.fetch(src_off, len)?;
                dst_restore.write(dst_off, len, false, || {
                    dst.copy_from(&src, src_off, dst_off, len)
                })
            });
            match copied {
                Ok(_) => return Ok(()),
                Err(Error::Metadata(m)) if tries < COPY_TRIES && m.contains("kept changing") => {
                    tracing::debug!("copy retried: {m}");
                }
                Err(e) => return Err(to_lun_error(e)),
            }
        }
    }

    fn space_warning(&self) -> bool {
        self.pool.soft_threshold_exceeded()
    }

    /// The pool's catalog (volumes, snapshots, sizes) and the LUN table: both only grow, so
    /// their sum changes whenever either does.
    fn generation(&self) -> u64 {
        self.pool
            .catalog_generation()
            .wrapping_add(self.map.generation())
    }

    /// A volume's QoS entry exists once it has had limits or an NBD connection: one shared
    /// lock per command, like the metrics lookup in `open`. Snapshots are not limited.
    fn throttle(&self, lun: u64, direction: Direction, bytes: u64) -> Duration {
        self.map
            .volume_id(lun)
            .and_then(|id| self.qos.get(id))
            .map_or(Duration::ZERO, |q| q.charge(direction.into(), bytes))
    }

    fn connected(&self, lun: u64, initiator: &Arc<ibid_iscsi::Initiator>) {
        if let Some((_, mapping)) = self.volume_by_lun(lun) {
            let weak = Arc::downgrade(initiator);
            let alive: std::sync::Weak<dyn std::any::Any + Send + Sync> = weak;
            self.clients.add(
                &mapping.name(),
                "iscsi",
                initiator.peer,
                Some(initiator.name.clone()),
                alive,
            );
        }
    }
}

/// A read's blocks left in the pool's read cache, sent from there.
struct CachedBlocks(ibid_engine::HeldBlocks);

impl HeldData for CachedBlocks {
    fn parts(&self) -> usize {
        self.0.len()
    }

    fn part(&self, i: usize) -> (usize, &[u8]) {
        self.0.get(i)
    }
}

/// One volume as a LUN.
struct VolumeLun {
    volume: Volume,
    id: [u8; 16],
    io: Arc<VolumeIo>,
    /// The volume's gate, passed by writes (see the module's comment).
    gate: Arc<Gate>,
    /// The volume's instant restore, if it is being restored.
    restore: RestoreHooks,
}

impl Lun for VolumeLun {
    fn size(&self) -> u64 {
        self.volume.size()
    }

    fn read_only(&self) -> bool {
        self.volume.read_only()
    }

    fn id(&self) -> [u8; 16] {
        self.id
    }

    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), LunError> {
        let len = buf.len() as u64;
        self.io
            .record(Op::Read, len, || self.restore.read(&self.volume, off, buf))
            .map_err(to_lun_error)
    }

    fn read_held(&self, off: u64, buf: &mut [u8]) -> Result<Option<Box<dyn HeldData>>, LunError> {
        let len = buf.len() as u64;
        let held = self
            .io
            .record(Op::Read, len, || {
                self.restore.read_held(&self.volume, off, buf)
            })
            .map_err(to_lun_error)?;
        Ok((!held.is_empty()).then(|| Box::new(CachedBlocks(held)) as Box<dyn HeldData>))
    }

    fn write(&self, off: u64, data: &[u8], fua: bool) -> Result<(), LunError> {
        let _gate = self.gate.write();
        self.io
            .record(Op::Write, data.len() as u64, || {
                let len = data.len() as u64;
                self.restore
                    .write(off, len, fua, || self.volume.write(off, data, fua))
            })
            .map_err(to_lun_error)
    }

    fn write_zeroes(&self, off: u64, len: u64) -> Result<(), LunError> {
        let _gate = self.gate.write();
        self.io
            .record(Op::WriteZeroes, len, || {
                self.restore.write(off, len, false, || {
                    self.volume.write_zeroes(off, len, false)
                })
            })
            .map_err(to_lun_error)
    }

    fn flush(&self) -> Result<(), LunError> {
        self.io
            .record(Op::Flush, 0, || self.restore.flush(&self.volume))
            .map_err(to_lun_error)
    }

    fn compare_and_write(
        &self,
        off: u64,
        expected: &[u8],
        new: &[u8],
    ) -> Result<Option<u64>, LunError> {
        let _gate = self.gate.write();
        self.io
            .record(Op::CompareAndWrite, new.len() as u64, || {
                self.restore.compare_and_write(off, new.len() as u64, || {
                    self.volume.compare_and_write(off, expected, new, false)
                })
            })
            .map_err(to_lun_error)
    }

    fn block_status(&self, off: u64, len: u64) -> Result<Vec<Extent>, LunError> {
        let extents = self
            .volume
            .block_status_max(off, len, LBA_STATUS_EXTENTS_MAX)
            .map_err(to_lun_error)?;
        Ok(self
            .restore
            .block_status(extents)
            .into_iter()
            .map(|e| Extent {
                off: e.offset,
                len: e.length,
                mapped: e.kind == ExtentKind::Data,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The target sees the LUN table: LUNs listed in order, a snapshot export read-only, and
    /// a move changes the generation (the target's REPORTED LUNS DATA HAS CHANGED).
    #[test]
    fn luns_follow_the_table() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = Pool::create(
            dir.path().join("pool"),
            ibid_engine::PoolConfig {
                capacity_bytes: Some(1 << 30),
                background: false,
                ..ibid_engine::PoolConfig::default()
            },
        )
        .expect("pool");
        let a = pool.create_volume("a", 1 << 20).expect("a").id();
        pool.create_volume("b", 1 << 20).expect("b");
        pool.create_snapshot("a", "s").expect("snapshot");
        let map = Arc::new(LunMap::open(&pool).expect("map"));
        let luns = PoolLuns::new(
            pool.clone(),
            Arc::new(Metrics::default()),
            Arc::new(Clients::default()),
            Arc::new(Qos::in_memory()),
            map.clone(),
            Arc::default(),
            Arc::new(InstantRestores::in_memory()),
        );
        map.export_snapshot(&pool, "a", "s", Some(6))
            .expect("export");
        let before = luns.generation();
        map.assign(&pool, a, Some(9)).expect("move");
        assert_ne!(luns.generation(), before);
        let listed: Vec<(u64, String)> = luns.list().into_iter().map(|l| (l.lun, l.name)).collect();
        assert_eq!(
            listed,
            [
                (1, "b".to_string()),
                (6, "a@s".to_string()),
                (9, "a".to_string())
            ]
        );
        let snap = luns.open(6).expect("snapshot LUN");
        assert!(snap.read_only());
        assert_eq!(snap.write(0, &[1; 512], false), Err(LunError::ReadOnly));
        assert!(!luns.open(9).expect("volume LUN").read_only());
        assert!(luns.open(0).is_none(), "a's old LUN is free");
        drop(luns);
        pool.close().expect("close");
    }
}
