//! The backend seam: what the NBD server needs from the storage below it.
//!
//! The `ibid` binary implements [`Exports`] and [`Export`] on top of engine volumes; this crate
//! ships [`crate::memory`] for tests and fuzzing. Every method is synchronous and may block:
//! the server calls them from its worker threads, several at once for one export, except the
//! writes [`Export::write_is_quick`] vouches for, which it runs on the connection's task.

use std::sync::Arc;
use thiserror::Error;

/// The unit of offsets and lengths the server lets through to the backend (bytes). Requests
/// not aligned to it are refused with `EINVAL` before reaching an [`Export`].
pub const BLOCK_SIZE_MIN: u32 = 512;
/// The block size at which the backend is efficient (bytes), advertised to clients.
pub const BLOCK_SIZE_PREFERRED: u32 = 4096;
/// The largest read or write payload (bytes), advertised as the maximum block size.
pub const PAYLOAD_LEN_MAX: u32 = 32 * 1024 * 1024;

const _: () =
    assert!(BLOCK_SIZE_MIN.is_power_of_two() && PAYLOAD_LEN_MAX & (BLOCK_SIZE_MIN - 1) == 0);

/// Which way a request moves data, as far as a rate limit cares ([`Export::throttle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A read.
    Read,
    /// A write, write-zeroes or trim.
    Write,
}

/// One export as listed by `NBD_OPT_LIST`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Export name (a volume, or `VOLUME@SNAPSHOT`).
    pub name: String,
    /// Human-readable description (may be empty).
    pub description: String,
}

/// One run of blocks with the same allocation state, as returned by [`Export::block_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (non-zero, a multiple of [`BLOCK_SIZE_MIN`] except at the export end).
    pub len: u64,
    /// The range reads as zeroes.
    pub zero: bool,
    /// The range has no storage allocated (a write there may need new space).
    pub hole: bool,
}

/// The far end of one NBD connection, handed to [`Exports::connected`]. The server holds it
/// exactly as long as the connection is open.
#[derive(Debug)]
pub struct Client {
    /// The client's address.
    pub peer: std::net::SocketAddr,
}

/// A backend failure, mapped to an NBD error number by the server.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The pool is full: the write needed space it could not get (`ENOSPC`).
    #[error("no space left in the pool")]
    NoSpace,
    /// The range lies outside the export (`EINVAL`).
    #[error("range outside the export")]
    OutOfRange,
    /// The export does not accept writes (`EPERM`).
    #[error("export is read-only")]
    ReadOnly,
    /// Any other failure (`EIO`); the string is for logs and error chunks.
    #[error("I/O error: {0}")]
    Io(String),
}

/// The set of exports a server offers (volumes and snapshots).
pub trait Exports: Send + Sync + 'static {
    /// Every export, for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<ExportInfo>;
    /// Opens the export called `name` (`None`: no such export). Called once per connection
    /// and for `NBD_OPT_INFO`; the returned handle lives as long as the connection.
    fn open(&self, name: &str) -> Option<Arc<dyn Export>>;
    /// A connection entered transmission on export `name`. `client` lives as long as that
    /// connection: a backend that keeps a `Weak` of it knows which connections are still open
    /// (to list a volume's clients, or refuse to delete it). Default: nothing.
    fn connected(&self, _name: &str, _client: &Arc<Client>) {}
}

/// One export (a volume). Offsets and lengths are bytes, multiples of [`BLOCK_SIZE_MIN`], and
/// within [`Export::size`]: the server checks this before calling. Concurrent calls are
/// allowed; a read never observes a torn block of a concurrent write.
pub trait Export: Send + Sync + 'static {
    /// Size in bytes (a multiple of [`BLOCK_SIZE_MIN`]); fixed for the connection's lifetime.
    fn size(&self) -> u64;
    /// Human-readable description for `NBD_INFO_DESCRIPTION`.
    fn description(&self) -> String {
        String::new()
    }
    /// The export refuses writes (snapshots).
    fn read_only(&self) -> bool;
    /// Fills `buf` with the data at `offset`: every byte of it (it comes with unspecified
    /// contents, an earlier reply's bytes or zeros).
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError>;
    /// Writes `data` at `offset`; with `fua`, it is durable before this returns.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError>;
    /// Whether a write (without FUA) of `len` bytes at `offset` would take CPU time only, a
    /// few hundred microseconds at most, as things stand: then the server runs it on the
    /// connection's own task instead of handing it to a worker thread, which saves two thread
    /// hand-offs per request. A hint: an occasional longer wait is harmless, a regular one
    /// would stall the connection's other requests. Default: never.
    fn write_is_quick(&self, _offset: u64, _len: u64) -> bool {
        false
    }
    /// Reads as [`Export::read`] does, but only if that needs no wait for the device (the data
    /// is in memory): then the server answers on the connection's own task, saving two thread
    /// hand-offs. `Some` with the outcome when it read (or failed), `None` — `buf` then holds
    /// nothing useful — when it would have waited: the server hands the request to a worker,
    /// which calls [`Export::read`]. Default: `None`.
    fn read_if_cached(&self, _offset: u64, _buf: &mut [u8]) -> Option<Result<(), ExportError>> {
        None
    }
    /// How long a request should wait before it runs, for a rate limit: asked once per
    /// read (`Read`, its length), write (`Write`, its length), write-zeroes and trim (`Write`,
    /// 0 bytes), on the connection's task, which then waits without holding a worker thread
    /// (and reads no further request of this connection meanwhile). The call itself must not
    /// block; what it returns is the request's share of the limit, taken now. Default: no wait.
    fn throttle(&self, _direction: Direction, _bytes: u64) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// Makes the range read as zeroes. Metadata-only and fast at any length, which is why the
    /// server advertises `NBD_FLAG_SEND_FAST_ZERO` and never refuses a fast-zero request.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError>;
    /// Discards the range (reads as zeroes afterwards in ibid; the protocol allows anything).
    fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError>;
    /// Makes every write acknowledged so far, on any connection, durable.
    fn flush(&self) -> Result<(), ExportError>;
    /// Allocation state from `offset`: consecutive extents covering at least one byte and at
    /// most `len` bytes (fewer is allowed; the client asks again).
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError>;
    /// A hint that the range will be read soon.
    fn cache(&self, _offset: u64, _len: u64) -> Result<(), ExportError> {
        Ok(())
    }
}
