//! The ibid storage engine: a pool of thin volumes on local disk, with inline zero removal,
//! deduplication (BLAKE3, pool-wide) and compression (LZ4), a log-structured chunk store with a
//! background cleaner, and exact space accounting.
//!
//! The engine knows nothing of protocols: front ends (NBD, iSCSI, HTTP) call this API.
//!
//! ```no_run
//! use ibid_engine::{Pool, PoolConfig};
//! let pool = Pool::create("/tmp/pool", PoolConfig::default())?;
//! let vol = pool.create_volume("vm1", 10 << 30)?;
//! vol.write(0, &[7u8; 4096], false)?;
//! vol.flush()?;
//! let mut buf = [0u8; 512];
//! vol.read(512, &mut buf)?;
//! # Ok::<(), ibid_engine::Error>(())
//! ```
#![deny(clippy::unwrap_used)]
#![deny(missing_docs)]

#[cfg(feature = "mimalloc")]
pub mod allocator;
mod background;
mod bloom;
mod breakdown;
mod catalog;
pub mod checksum;
pub mod chunk_fps;
pub mod chunk_table;
mod cleaner_pace;
mod commit;
mod commit_state;
mod compression;
pub mod config;
mod copy;
mod dedup;
mod dedup_index;
mod dedup_key;
mod direct_io;
pub mod disk;
pub mod error;
pub mod event_log;
pub mod fingerprint;
pub mod format;
mod fs_space;
#[doc(hidden)]
pub mod fuzzing;
mod gc;
mod inner;
mod journal;
mod layer_filter;
mod map_page;
pub mod map_table;
pub mod meta;
mod neighbours;
mod overlay;
mod pacer;
mod pool;
mod provision;
mod read_cache;
mod recovery;
mod ref_log;
mod reformat;
mod relocations;
mod scrub;

mod segment;
mod shard;
pub mod simulator;
mod snapshot;
mod space;
mod stack;
pub mod stats;
pub mod store;
#[cfg(test)]
mod test_data;
pub mod units;
pub mod verify;
mod volume;
mod volume_state;

pub use breakdown::{SpaceBreakdown, VolumeShare};
pub use config::PoolConfig;
pub use error::{Error, Result};
pub use format::VolumeFormat;
pub use pool::{validate_volume_name, validate_volume_size, Pool};
pub use provision::{OVERWRITE_HEADROOM_BLOCKS_MAX, RESERVED_BYTES_PER_BLOCK};
pub use read_cache::{HeldBlocks, ReadCacheStats};
pub use scrub::{DamagedChunk, ScrubStep};
pub use snapshot::SnapshotInfo;
pub use stats::{PoolStats, VolumeSpace};
pub use store::Backend as MetaBackend;
pub use verify::VerifyReport;
pub use volume::{CopyReport, Extent, ExtentKind, Volume, QUICK_WRITE_BLOCKS_MAX};
pub use volume_state::VolumeInfo;
