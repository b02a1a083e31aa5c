//! The disk seam: every byte the engine reads from or writes to its pool directory goes
//! through [`Disk`] and the [`DiskFile`]s it opens — segment files, the journal, the metadata
//! store (redb's `StorageBackend` is an adapter over a [`DiskFile`]), the reserve file — and so
//! do directory listings, removals, directory syncs and the filesystem's free space.
//!
//! Two implementations:
//! - [`FsDisk`]: the real filesystem (production), with `O_DIRECT` where the filesystem allows;
//! - [`SimDisk`]: memory, for the simulator and tests. It keeps what was written since each
//!   file's last sync apart from what is durable and, at a power cut, drops it, keeps a random
//!   subset, or tears the last write; it injects I/O errors and latency on chosen operations.
//!
//! The metadata store's fjall backend keeps its own files and does not go through the seam: a
//! pool on a [`SimDisk`] uses redb.

mod fs;
mod sim;

pub use fs::FsDisk;
pub use sim::{Fault, FaultOp, Rng, SimDisk, SimStats};

use std::any::Any;
use std::fmt::Debug;
use std::io;
use std::path::Path;
use std::sync::Arc;

/// How [`Disk::open`] treats a missing or existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// The file must exist.
    Existing,
    /// Created empty if missing; an existing file is opened as it is.
    Create,
    /// The file must not exist; it is created empty.
    CreateNew,
}

/// An open file of the pool directory. Reads and writes are positioned (no cursor), so a file
/// is shared between threads.
pub trait DiskFile: Send + Sync + Debug {
    /// Fills `buf` from `offset`; an `UnexpectedEof` error if the file ends first.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// As [`DiskFile::read_exact_at`], but only from memory: a `WouldBlock` error, with `buf`
    /// partly filled, if the read would wait for the device. Default: always `WouldBlock`
    /// (a file that cannot tell).
    fn read_exact_at_nowait(&self, _buf: &mut [u8], _offset: u64) -> io::Result<()> {
        Err(io::ErrorKind::WouldBlock.into())
    }
    /// Fills `bufs`, one after the other, from the bytes at `offset` on (a scattered read:
    /// one system call where the file allows); an `UnexpectedEof` error if the file ends
    /// first. Default: one read into a temporary buffer, then copies.
    fn read_scattered_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<()> {
        let mut all = vec![0u8; bufs.iter().map(|b| b.len()).sum()];
        self.read_exact_at(&mut all, offset)?;
        scatter(&all, bufs);
        Ok(())
    }
    /// As [`DiskFile::read_scattered_at`], but only from memory, as
    /// [`DiskFile::read_exact_at_nowait`].
    fn read_scattered_at_nowait(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<()> {
        let mut all = vec![0u8; bufs.iter().map(|b| b.len()).sum()];
        self.read_exact_at_nowait(&mut all, offset)?;
        scatter(&all, bufs);
        Ok(())
    }
    /// Writes all of `buf` at `offset`, extending the file if needed. Not durable until
    /// [`DiskFile::sync_data`] returns.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every write and size change to this file so far durable (fdatasync).
    fn sync_data(&self) -> io::Result<()>;
    /// The file's size.
    fn len(&self) -> io::Result<u64>;
    /// The bytes the file takes on the device: at most its size, less where it is sparse (a
    /// file extended by [`DiskFile::set_len`] holds no blocks where nothing was written yet).
    /// Default: its size.
    fn allocated(&self) -> io::Result<u64> {
        self.len()
    }
    /// Whether the file is empty.
    fn is_empty(&self) -> io::Result<bool> {
        self.len().map(|l| l == 0)
    }
    /// Cuts or extends (with zeros) the file to `len` bytes. Not durable until a sync.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Gives the file `len` bytes of allocated space (posix_fallocate), so that later writes
    /// within them cannot meet ENOSPC. Not durable until a sync.
    fn allocate(&self, len: u64) -> io::Result<()>;
}

/// A pool directory's storage (see the module's doc).
pub trait Disk: Send + Sync + Debug {
    /// Creates `dir` and its parents if missing.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Opens `path` for reading and writing.
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn DiskFile>>;
    /// Opens the existing `path` for writes that bypass the page cache (`O_DIRECT`): buffer
    /// addresses, offsets and lengths must be multiples of 4 KiB. `None` where the filesystem
    /// refuses direct I/O (the caller writes through [`Disk::open`]'s file instead).
    fn open_direct(&self, path: &Path) -> io::Result<Option<Arc<dyn DiskFile>>>;
    /// Whether `path` exists.
    fn exists(&self, path: &Path) -> bool;
    /// Names of the entries of `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Removes the file `path` (an open file stays readable through its handles).
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Makes the creations and removals of entries in `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// The filesystem under `dir`: (total bytes, bytes available to this process).
    fn fs_space(&self, dir: &Path) -> io::Result<(u64, u64)>;
    /// Takes the pool directory's exclusive lock (held until the returned guard is dropped);
    /// `Ok(None)` if another holder has it.
    fn lock_dir(&self, dir: &Path) -> io::Result<Option<Box<dyn Any + Send + Sync>>>;

    /// Whether this is the real filesystem (where components that keep their own files, such
    /// as the fjall metadata store, can run).
    fn is_real_filesystem(&self) -> bool {
        false
    }

    /// Reads the whole file `path`.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let f = self.open(path, OpenMode::Existing)?;
        let mut out = vec![0u8; f.len()? as usize];
        f.read_exact_at(&mut out, 0)?;
        Ok(out)
    }
}

/// The real filesystem, as a shared [`Disk`].
pub fn fs() -> Arc<dyn Disk> {
    Arc::new(FsDisk)
}

/// Copies `all` into `bufs`, one after the other (their lengths add up to at most its own).
pub(crate) fn scatter(all: &[u8], bufs: &mut [&mut [u8]]) {
    let mut at = 0;
    for b in bufs.iter_mut() {
        b.copy_from_slice(&all[at..at + b.len()]);
        at += b.len();
    }
}
