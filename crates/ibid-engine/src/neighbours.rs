//! Dedup by locality. Blocks written together are stored together (consecutive chunk sequence
//! numbers), and copied data (a clone, a backup, a second copy of a file) arrives in runs. So
//! once one block of a large write is found in the fingerprint index, the chunks stored around
//! it are read with one range scan of the chunk table and of their fingerprints (`chunk_fps.rs`),
//! and the write's other blocks are
//! looked for among them first: a point read of the `fps` B-tree, whose random 32-byte keys make
//! every lookup a walk through pages no cache holds, becomes a hash probe and a read of a chunk
//! record beside the ones just read. A hint only: the caller checks a hit against the chunk's
//! committed record before it takes a reference, unless no commit has freed any chunk since
//! the scan began (`Inner::frees` unchanged): only a commit frees chunks, and one that frees
//! chunk X keeps X's fingerprint in its shard's `dead_fps` from before X leaves the store until
//! after it bumps `frees`, so with the shard locked and `dead_fps` checked, an unchanged count
//! proves X is still stored (the scan read it with that fingerprint; fingerprints never
//! change).

use crate::shard::SHARD_BITS;
use crate::store::Store;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// No index hit yet.
const NONE: u64 = u64::MAX;
/// The `frees` count of neighbours that must always be confirmed (never matches a real one).
#[cfg(test)]
const ALWAYS_CONFIRM: u64 = u64::MAX;

/// The chunks stored around the first block of one write that the index found.
pub(crate) struct Neighbours {
    /// Sequence numbers loaded on each side of that chunk.
    span: u64,
    /// The pool's `frees` count when the scan began, and fingerprint → chunk id, once loaded.
    near: OnceLock<(u64, FxHashMap<[u8; 32], u64>)>,
    /// The first chunk a lookup of this write found in the index ([`NONE`]: none yet).
    first_hit: AtomicU64,
}

impl Neighbours {
    /// For a write of `blocks` blocks: its copy's chunks lie within that many sequence numbers
    /// of any one of them, in either direction.
    pub(crate) fn for_write(blocks: u64) -> Neighbours {
        Neighbours {
            span: blocks,
            near: OnceLock::new(),
            first_hit: AtomicU64::new(NONE),
        }
    }

    /// Neighbours already loaded with `near` (for tests of their callers).
    #[cfg(test)]
    pub(crate) fn loaded(near: FxHashMap<[u8; 32], u64>) -> Neighbours {
        let n = Neighbours::for_write(0);
        let _ = n.near.set((ALWAYS_CONFIRM, near));
        n
    }

    /// The chunk with fingerprint `fp` among the loaded neighbours, and the pool's `frees`
    /// count when they were read.
    pub(crate) fn get(&self, fp: &[u8; 32]) -> Option<(u64, u64)> {
        let (frees, near) = self.near.get()?;
        near.get(fp).map(|&id| (id, *frees))
    }

    /// Notes that the index holds chunk `id` (cheap: called with a dedup shard locked).
    pub(crate) fn found_in_index(&self, id: u64) {
        let _ = self
            .first_hit
            .compare_exchange(NONE, id, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Loads the neighbours of the first index hit, once; called with no lock held. `frees`:
    /// the pool's count of commits that freed chunks, read before the scan's snapshot. A failed
    /// scan only leaves them unloaded (the index answers instead).
    pub(crate) fn load_if_pending(&self, db: &Store, frees: &AtomicU64) {
        let hit = self.first_hit.load(Ordering::Acquire);
        if hit == NONE || self.near.get().is_some() {
            return;
        }
        let seq = hit >> SHARD_BITS;
        let lo = seq.saturating_sub(self.span) << SHARD_BITS;
        let hi = (seq.saturating_add(self.span).min(u64::MAX >> SHARD_BITS) << SHARD_BITS)
            | ((1 << SHARD_BITS) - 1);
        let before = frees.load(Ordering::Acquire);
        match scan(db, lo, hi) {
            // Another thread of the write may have loaded them meanwhile: either will do.
            Ok(near) => {
                let _ = self.near.set((before, near));
            }
            Err(e) => tracing::debug!("dedup neighbours of chunk {hit:#x}: {e}"),
        }
    }
}

/// The fingerprints of the chunks stored with ids in `lo..=hi` (those with a record: a dead
/// chunk's fingerprint may still be stored, stale).
fn scan(db: &Store, lo: u64, hi: u64) -> crate::Result<FxHashMap<[u8; 32], u64>> {
    let txn = db.read()?;
    let stored = crate::chunk_table::range(&txn, lo, hi)?;
    let mut near = FxHashMap::default();
    for (id, fp) in crate::chunk_fps::range(&txn, lo, hi)? {
        if stored.binary_search_by_key(&id, |&(i, _)| i).is_ok() {
            near.insert(fp, id);
        }
    }
    Ok(near)
}
