//! The engine's error type.

use crate::units::{format_exact, format_with_bytes};
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
    #[error(
        "the pool cannot reserve {}: {} is free and unreserved",
        format_exact(*needed),
        format_exact(*available)
    )]
    CannotReserve {
        /// Bytes the operation would reserve.
        needed: u64,
        /// Bytes free and not reserved by other thick volumes.
        available: u64,
    },
    /// No volume has this name (or, for a `VOLUME@SNAPSHOT` name, no such snapshot).
    #[error("{}", not_found(.0))]
    NotFound(String),
    /// A volume (or, for a `VOLUME@SNAPSHOT` name, a snapshot) with this name already exists.
    #[error("{}", already_exists(.0))]
    AlreadyExists(String),
    /// An argument is malformed: unaligned offset, bad size, bad name.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The request reaches beyond the end of the volume.
    #[error(
        "offset {} + length {} is beyond the volume size {}",
        format_with_bytes(*offset),
        format_with_bytes(*len),
        format_exact(*size)
    )]
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

/// "no volume named ..", or for a snapshot's `VOLUME@SNAPSHOT` key "no snapshot .. of volume ..".
/// (Volume names cannot contain `@`, so the key says which it is.)
fn not_found(name: &str) -> String {
    match name.split_once('@') {
        Some((volume, snapshot)) => format!("no snapshot {snapshot:?} of volume {volume:?}"),
        None => format!("no volume named {name:?}"),
    }
}

/// "a volume named .. already exists", or the same of a snapshot's `VOLUME@SNAPSHOT` key.
fn already_exists(name: &str) -> String {
    match name.split_once('@') {
        Some((volume, snapshot)) => {
            format!("volume {volume:?} already has a snapshot named {snapshot:?}")
        }
        None => format!("a volume named {name:?} already exists"),
    }
}

/// Result alias for engine operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The same error again, for a second caller waiting on the operation that failed (an
    /// I/O error keeps its kind and message, not its source).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::NoSpace => Error::NoSpace,
            Error::CannotReserve { needed, available } => Error::CannotReserve {
                needed: *needed,
                available: *available,
            },
            Error::NotFound(s) => Error::NotFound(s.clone()),
            Error::AlreadyExists(s) => Error::AlreadyExists(s.clone()),
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::OutOfRange { offset, len, size } => Error::OutOfRange {
                offset: *offset,
                len: *len,
                size: *size,
            },
            Error::ReadOnly(s) => Error::ReadOnly(s.clone()),
            Error::Corrupt(s) => Error::Corrupt(s.clone()),
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: io::Error::new(source.kind(), source.to_string()),
            },
            Error::Metadata(s) => Error::Metadata(s.clone()),
            Error::Failed(s) => Error::Failed(s.clone()),
            Error::Locked(s) => Error::Locked(s.clone()),
        }
    }

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
    redb::CommitError,
    redb::CursorError
);
