//! The NBD server's view of the pool: every volume is an export named after it.

use ibid_engine::{Error, ExtentKind, Pool, Volume};
use ibid_nbd::{Export, ExportError, ExportInfo, Exports, Extent};
use std::sync::Arc;

/// Extents returned per block-status request at most (clients ask again from where it ends).
/// Small, because qemu uses only the first extent of each reply and asks again from its end.
const BLOCK_STATUS_EXTENTS_MAX: usize = 64;

/// All volumes of a pool, as NBD exports.
pub struct PoolExports {
    pool: Pool,
}

impl PoolExports {
    /// Exports every volume of `pool`.
    pub fn new(pool: Pool) -> Self {
        PoolExports { pool }
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
            .list_volumes()
            .into_iter()
            .map(|v| ExportInfo {
                description: format!("ibid volume, {} bytes", v.size_bytes),
                name: v.name,
            })
            .chain(snapshots)
            .collect()
    }

    /// A volume by name, or a snapshot as `VOLUME@SNAPSHOT` (read-only).
    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let volume = match name.split_once('@') {
            Some((volume, snapshot)) => self.pool.snapshot(volume, snapshot).ok()?,
            None => self.pool.volume(name).ok()?,
        };
        Some(Arc::new(VolumeExport {
            size: volume.size(),
            volume,
        }))
    }
}

/// One volume as an NBD export. The size is fixed when the connection opens it.
struct VolumeExport {
    volume: Volume,
    size: u64,
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
        self.volume.read(offset, buf).map_err(to_export_error)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.volume
            .write(offset, data, fua)
            .map_err(to_export_error)
    }

    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.volume
            .write_zeroes(offset, len, fua)
            .map_err(to_export_error)
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        self.volume
            .write_zeroes(offset, len, false)
            .map_err(to_export_error)
    }

    fn flush(&self) -> Result<(), ExportError> {
        self.volume.flush().map_err(to_export_error)
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        let extents = self
            .volume
            .block_status_max(offset, len, BLOCK_STATUS_EXTENTS_MAX)
            .map_err(to_export_error)?;
        Ok(extents
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
