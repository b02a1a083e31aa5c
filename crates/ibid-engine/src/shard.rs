//! The dedup shards' uncommitted state: a chunk id's low [`SHARD_BITS`] bits pick one of
//! [`SHARDS`] shards, each holding the chunk-level changes writers made since the last cut
//! and those being committed.

use crate::format::NewChunkRecord;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;

/// Number of dedup shards; a chunk id's low bits name its shard.
pub const SHARDS: usize = 64;
/// Bits of a chunk id that hold the shard.
pub const SHARD_BITS: u32 = 6;

/// Uncommitted chunk-level changes of one dedup shard. Fx hashing: the keys are chunk ids and
/// BLAKE3 fingerprints, and these maps see a few operations per block written.
#[derive(Default)]
pub(crate) struct ShardBatch {
    pub new_chunks: FxHashMap<u64, NewChunkRecord>,
    pub fps: FxHashMap<[u8; 32], u64>,
    pub deltas: FxHashMap<u64, i64>,
}

impl ShardBatch {
    /// An empty batch with room for as many entries as `self` holds: the next batch of a
    /// steady write load is about as large, and its maps then skip growing step by step
    /// (each step rehashes into freshly allocated memory).
    pub fn sized_like(&self) -> ShardBatch {
        fn sized<K, V>(n: usize) -> FxHashMap<K, V> {
            FxHashMap::with_capacity_and_hasher(n, Default::default())
        }
        ShardBatch {
            new_chunks: sized(self.new_chunks.len()),
            fps: sized(self.fps.len()),
            deltas: sized(self.deltas.len()),
        }
    }
}

pub(crate) struct ShardState {
    pub dirty: ShardBatch,
    pub committing: Arc<ShardBatch>,
    /// Fingerprints whose chunk died in a commit not yet visible to readers of the store.
    pub dead_fps: FxHashSet<[u8; 32]>,
    /// Fingerprints of new chunks a writer is appending without the shard lock (see
    /// `prepare_group`): another writer of the same block waits for it to be placed.
    pub placing: FxHashSet<[u8; 32]>,
}
