//! The storage seam: what the target needs from the volumes it exports.
//!
//! The `ibid` binary implements these traits on top of engine volumes; the
//! crate ships [`crate::memory`] for tests. All methods are synchronous and
//! may block: the target calls them from `spawn_blocking`. Offsets and
//! lengths are in bytes and multiples of [`crate::BLOCK_SIZE`].

use std::sync::Arc;
use thiserror::Error;

/// Errors a LUN operation can report; each maps to one SCSI sense.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LunError {
    /// The pool has no space for new data (DATA PROTECT 27h/07h).
    #[error("no space left in pool")]
    NoSpace,
    /// The range lies outside the LUN (ILLEGAL REQUEST 21h/00h).
    #[error("range out of bounds")]
    OutOfRange,
    /// The LUN is read-only (DATA PROTECT 27h/00h).
    #[error("read-only")]
    ReadOnly,
    /// The LUN does not exist any more (ILLEGAL REQUEST 25h/00h).
    #[error("no such LUN")]
    NoSuchLun,
    /// Any other failure (MEDIUM ERROR / HARDWARE ERROR).
    #[error("I/O error: {0}")]
    Io(String),
}

/// One LUN as listed by [`Luns::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunInfo {
    /// LUN number (0..16383).
    pub lun: u64,
    /// Human name of the volume (reported nowhere on the wire but logs).
    pub name: String,
}

/// The initiator end of one logged-in (normal session) connection, handed to
/// [`Luns::connected`]. The target holds it exactly as long as the connection is open.
#[derive(Debug)]
pub struct Initiator {
    /// The initiator's address (`None` if the socket could not tell).
    pub peer: Option<std::net::SocketAddr>,
    /// Its iSCSI name (`InitiatorName`).
    pub name: String,
}

/// A run of blocks with one allocation state, as [`Lun::block_status`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset.
    pub off: u64,
    /// Length in bytes.
    pub len: u64,
    /// True if the range holds data; false if deallocated (reads zeros).
    pub mapped: bool,
}

/// One exported volume.
pub trait Lun: Send + Sync + 'static {
    /// Size in bytes (multiple of 512).
    fn size(&self) -> u64;
    /// Whether writes are refused.
    fn read_only(&self) -> bool;
    /// A stable 16-byte identity: the NAA designator and serial derive from it.
    fn id(&self) -> [u8; 16];
    /// Read `buf.len()` bytes at `off`.
    fn read(&self, off: u64, buf: &mut [u8]) -> Result<(), LunError>;
    /// Read `buf.len()` bytes at `off` as [`Lun::read`] does, except that parts of the data
    /// may be left where they are (a cache's memory) instead of copied into `buf`: returned
    /// as [`HeldData`], which the target sends from, while `buf` holds the rest (and anything
    /// where the held parts go). Default: [`Lun::read`], nothing held.
    fn read_held(&self, off: u64, buf: &mut [u8]) -> Result<Option<Box<dyn HeldData>>, LunError> {
        self.read(off, buf).map(|()| None)
    }
    /// Write `data` at `off`; with `fua` it is durable when this returns.
    fn write(&self, off: u64, data: &[u8], fua: bool) -> Result<(), LunError>;
    /// Make the range read as zeros and deallocate it (metadata only).
    fn write_zeroes(&self, off: u64, len: u64) -> Result<(), LunError>;
    /// Make every acknowledged write durable.
    fn flush(&self) -> Result<(), LunError>;
    /// Atomically: if the range equals `expected`, write `new` and return
    /// `None`; otherwise change nothing and return the offset (from `off`) of
    /// the first differing byte.
    fn compare_and_write(
        &self,
        off: u64,
        expected: &[u8],
        new: &[u8],
    ) -> Result<Option<u64>, LunError>;
    /// Allocation state of a range, as contiguous extents in order covering
    /// at least the first block of the range.
    fn block_status(&self, off: u64, len: u64) -> Result<Vec<Extent>, LunError>;
}

/// Parts of a read's data held outside its buffer ([`Lun::read_held`]), kept as they are
/// until this is dropped (after the last Data-In that carries them is sent).
pub trait HeldData: Send + Sync + 'static {
    /// How many parts there are.
    fn parts(&self) -> usize;
    /// Part `i`: its offset in the read's data and its bytes. Parts are in ascending
    /// offset order, do not overlap, and lie within the read.
    fn part(&self, i: usize) -> (usize, &[u8]);
}

/// The set of LUNs behind the one target.
pub trait Luns: Send + Sync + 'static {
    /// Every LUN, in LUN order.
    fn list(&self) -> Vec<LunInfo>;
    /// Open one LUN.
    fn open(&self, lun: u64) -> Option<Arc<dyn Lun>>;
    /// Copy `len` bytes from one LUN to another (or the same) by reference
    /// (EXTENDED COPY). Ranges on the same LUN may overlap: the result is as
    /// if the source was read whole first.
    fn copy_range(
        &self,
        src_lun: u64,
        src_off: u64,
        dst_lun: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<(), LunError>;
    /// True while the pool is past its soft threshold; the target then raises
    /// UNIT ATTENTION 38h/07h once per I_T nexus and LUN.
    fn space_warning(&self) -> bool {
        false
    }
    /// A counter bumped whenever LUNs are added or removed; a change raises
    /// UNIT ATTENTION REPORTED LUNS DATA HAS CHANGED (3Fh/0Eh) so initiators
    /// rescan. (A LUN's size change raises CAPACITY DATA HAS CHANGED by itself.)
    fn generation(&self) -> u64 {
        0
    }
    /// A normal session's connection sent its first command addressed to `lun` (REPORT LUNS
    /// aside, which every initiator sends to LUN 0 whatever it uses). `initiator` lives as
    /// long as that connection: a backend that keeps a `Weak` of it knows which connections
    /// still use the LUN (to list a volume's clients, or refuse to delete it). Default: nothing.
    fn connected(&self, _lun: u64, _initiator: &Arc<Initiator>) {}
    /// How long a command to `lun` should wait before it runs, for a rate limit: asked once
    /// per READ (`Read`, its transfer length), WRITE and WRITE AND VERIFY (`Write`, their
    /// transfer length), COMPARE AND WRITE (`Write`, the length written), WRITE SAME and
    /// UNMAP (`Write`, 0 bytes); the command's task then waits asynchronously, holding no
    /// thread. The call itself must not block; what it returns is the command's share of the
    /// limit, taken now. Default: no wait.
    fn throttle(&self, _lun: u64, _direction: Direction, _bytes: u64) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

/// Which way a command moves data, as far as a rate limit cares ([`Luns::throttle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A read.
    Read,
    /// A write of data or zeroes.
    Write,
}
