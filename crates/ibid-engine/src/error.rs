//! The engine's error type.

use std::io;

/// Every way an engine operation can fail.
///
/// Operating errors (a full pool, a bad argument, a missing volume) leave the pool unchanged.
/// `Io` and `Corrupt` during a metadata commit put the pool into a failed state (`Failed`): after
/// an I/O error the engine stops instead of guessing, and the pool must be reopened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A write needs new physical space and the pool has none left.
    #[error("no space left in the pool")]
    NoSpace,
    /// A thick volume's reservation (creation, growth or conversion) does not fit in the
    /// pool's unreserved free space.
    #[error("the pool cannot reserve {needed} bytes: {available} bytes are free and unreserved")]
    CannotReserve {
        /// Bytes the operation would reserve.
        needed: u64,
        /// Bytes free and not reserved by other thick volumes.
        available: u64,
    },
    /// No volume has this name.
    #[error("no volume named {0:?}")]
    NotFound(String),
    /// A volume with this name already exists.
    #[error("a volume named {0:?} already exists")]
    AlreadyExists(String),
    /// An argument is malformed: unaligned offset, bad size, bad name.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The request reaches beyond the end of the volume.
    #[error("offset {offset} + length {len} is beyond the volume size {size}")]
    OutOfRange {
        /// First byte of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// Size of the volume in bytes.
        size: u64,
    },
    /// The volume is a read-only snapshot.
    #[error("{0} is a read-only snapshot")]
    ReadOnly(String),
    /// Stored data or metadata failed its checksum or a structural check.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// An operating-system I/O error.
    #[error("I/O error: {context}: {source}")]
    Io {
        /// What the engine was doing, as a verb phrase.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The metadata store reported an error.
    #[error("metadata store: {0}")]
    Metadata(String),
    /// The pool hit an I/O error earlier and refuses further work until it is reopened.
    #[error("the pool has failed after an earlier error and must be reopened: {0}")]
    Failed(String),
    /// Another process holds this pool open.
    #[error("the pool at {0} is in use by another process")]
    Locked(String),
}

/// Result alias for engine operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error with what the engine was doing.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Metadata(e.to_string())
            }
        }
    )*};
}
from_redb!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);
