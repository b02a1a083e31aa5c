//! The filesystem under the pool: its free space, a reserve kept for metadata, and the
//! admission of new data against it.
//!
//! The pool's capacity is a promise the filesystem may not keep: other files on it can take
//! the space later. A segment write or a metadata commit that finds the filesystem full fails
//! the pool, so new data is refused ([`crate::Error::NoSpace`], ENOSPC to clients) while the
//! filesystem still has [`FsSpace::reserve_bytes`] available: what commits, the journal and
//! the cleaner need to go on. Reads, zeroing, deletes and the API keep working, and writes
//! resume as soon as space returns (each admission looks at the filesystem again at least
//! every [`REFRESH`], no restart needed).
//!
//! # The reserve file
//! `POOL/reserve` holds [`RESERVE_FILE_BYTES`] of allocated zeros. Opening a pool on a
//! filesystem with less than that available deletes it first, so that recovery (the journal's
//! replay and its commit) has room; so does the background thread of a running pool when
//! other files fill the filesystem, so that commits go on; it puts the file back once the
//! filesystem has room again ([`FsSpace::restore_reserve_file`]).

use crate::disk::{Disk, OpenMode};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of the reserve file a pool keeps so that it can always open.
pub const RESERVE_FILE_BYTES: u64 = 32 << 20;
/// Least filesystem space kept free for metadata: admission refuses new data below it.
const RESERVE_MIN_BYTES: u64 = 64 << 20;
/// Most: 1/32 of the filesystem up to this.
const RESERVE_MAX_BYTES: u64 = 1 << 30;
/// How long a reading of the filesystem's free space is trusted.
pub const REFRESH: Duration = Duration::from_millis(100);
/// Name of the reserve file in the pool directory.
const RESERVE_FILE: &str = "reserve";

/// Size and available space of the filesystem holding `dir` (`statvfs`).
pub(crate) fn statvfs(disk: &dyn Disk, dir: &Path) -> Result<(u64, u64)> {
    (disk.fs_space(dir)).map_err(|e| Error::io("statvfs pool directory", e))
}

/// The reserve kept free on a filesystem of `total` bytes: 1/32 of it, within
/// [`RESERVE_MIN_BYTES`]..=[`RESERVE_MAX_BYTES`].
pub(crate) fn reserve_for(total: u64) -> u64 {
    (total / 32).clamp(RESERVE_MIN_BYTES, RESERVE_MAX_BYTES)
}

/// The filesystem under a pool, its free space read at most every [`REFRESH`].
pub(crate) struct FsSpace {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    start: Instant,
    /// Filesystem size, bytes.
    total: AtomicU64,
    /// Available bytes at the last reading.
    avail: AtomicU64,
    /// Bytes admitted since the last reading (not yet seen in `avail`).
    admitted: AtomicU64,
    /// When `avail` was read, in milliseconds since `start`.
    read_ms: AtomicU64,
}

impl FsSpace {
    /// Reads the filesystem holding `dir`.
    pub(crate) fn new(disk: Arc<dyn Disk>, dir: &Path) -> Result<FsSpace> {
        let (total, avail) = statvfs(&*disk, dir)?;
        Ok(FsSpace {
            disk,
            dir: dir.to_path_buf(),
            start: Instant::now(),
            total: AtomicU64::new(total),
            avail: AtomicU64::new(avail),
            admitted: AtomicU64::new(0),
            read_ms: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Reads the filesystem again (keeps the last reading if `statvfs` fails).
    pub(crate) fn refresh(&self) {
        if let Ok((total, avail)) = statvfs(&*self.disk, &self.dir) {
            self.total.store(total, Ordering::Relaxed);
            self.avail.store(avail, Ordering::Relaxed);
            self.admitted.store(0, Ordering::Relaxed);
        }
        self.read_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn refresh_if_stale(&self) {
        let age = self
            .now_ms()
            .saturating_sub(self.read_ms.load(Ordering::Relaxed));
        if age >= REFRESH.as_millis() as u64 {
            self.refresh();
        }
    }

    /// Bytes kept free on this filesystem for metadata.
    pub(crate) fn reserve_bytes(&self) -> u64 {
        reserve_for(self.total.load(Ordering::Relaxed))
    }

    /// Whether `bytes` of new data may be written: the filesystem keeps its reserve after
    /// them and after what was admitted since it was last read (counted until the next
    /// reading; bytes admitted but still in the writers' buffers then, at most a few tens of
    /// MiB, come out of the reserve). Reads it again when the reading is stale or the
    /// admitted bytes would eat an eighth of what it showed.
    pub(crate) fn admits(&self, bytes: u64) -> bool {
        let avail = self.avail.load(Ordering::Relaxed);
        if self.admitted.load(Ordering::Relaxed) + bytes > avail / 8 {
            self.refresh();
        } else {
            self.refresh_if_stale();
        }
        let admitted = self.admitted.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let ok =
            self.avail.load(Ordering::Relaxed).saturating_sub(admitted) >= self.reserve_bytes();
        if !ok {
            let _ = self
                .admitted
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| {
                    Some(a.saturating_sub(bytes))
                });
        }
        ok
    }

    /// The filesystem's size and available bytes (a reading at most [`REFRESH`] old).
    pub(crate) fn now(&self) -> (u64, u64) {
        self.refresh_if_stale();
        (
            self.total.load(Ordering::Relaxed),
            self.avail.load(Ordering::Relaxed),
        )
    }

    /// Whether the filesystem is nearly full: less than twice the reserve available. Part of
    /// the soft-threshold alarm.
    pub(crate) fn low(&self) -> bool {
        self.is_low(self.now().1)
    }

    /// Whether `avail` available bytes make the filesystem nearly full (see [`Self::low`]).
    pub(crate) fn is_low(&self, avail: u64) -> bool {
        avail < 2 * self.reserve_bytes()
    }

    /// Deletes the reserve file when the filesystem has less than its size available (so
    /// that opening the pool has room); returns whether it did.
    pub(crate) fn release_reserve_file_if_full(disk: &dyn Disk, dir: &Path) -> Result<bool> {
        let path = dir.join(RESERVE_FILE);
        let (_, avail) = statvfs(disk, dir)?;
        if avail >= RESERVE_FILE_BYTES || !disk.exists(&path) {
            return Ok(false);
        }
        (disk.remove_file(&path)).map_err(|e| Error::io("remove reserve file", e))?;
        Ok(true)
    }

    /// [`FsSpace::release_reserve_file_if_full`] on a running pool: something else filled the
    /// filesystem, and the commits, the journal and the cleaner need room to go on.
    pub(crate) fn release_if_full(&self) -> Result<bool> {
        let released = Self::release_reserve_file_if_full(&*self.disk, &self.dir)?;
        if released {
            self.refresh();
        }
        Ok(released)
    }

    /// Creates the reserve file if it is missing and the filesystem can spare it beyond the
    /// reserve; returns whether it did. A partial file (a failed allocation) is removed.
    pub(crate) fn restore_reserve_file(&self) -> Result<bool> {
        let path = self.dir.join(RESERVE_FILE);
        if self.disk.exists(&path) {
            return Ok(false);
        }
        let (_, avail) = self.now();
        if avail < RESERVE_FILE_BYTES + 2 * self.reserve_bytes() {
            return Ok(false);
        }
        let file = (self.disk.open(&path, OpenMode::CreateNew))
            .map_err(|e| Error::io("create reserve file", e))?;
        let allocated = (file.allocate(RESERVE_FILE_BYTES)).and_then(|()| file.sync_data());
        if let Err(e) = allocated {
            let _ = self.disk.remove_file(&path);
            return Err(Error::io("allocate reserve file", e));
        }
        self.refresh();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_thirty_second_of_the_filesystem_within_bounds() {
        assert_eq!(reserve_for(0), RESERVE_MIN_BYTES);
        assert_eq!(reserve_for(1 << 30), RESERVE_MIN_BYTES);
        assert_eq!(reserve_for(16 << 30), 512 << 20);
        assert_eq!(reserve_for(1 << 50), RESERVE_MAX_BYTES);
    }

    #[test]
    fn admission_counts_what_it_admitted_until_the_next_reading() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = FsSpace::new(crate::disk::fs(), dir.path()).expect("statvfs");
        let (_, avail) = fs.now();
        let room = avail.saturating_sub(fs.reserve_bytes());
        // Admitting all of the room at once refreshes (over an eighth) and still fits...
        assert!(fs.admits(room / 2));
        // ...but more than the room never does, whatever was read, and a refusal counts
        // nothing.
        assert!(!fs.admits(room + (1 << 30)));
        assert!(fs.admits(4096));
    }
}
