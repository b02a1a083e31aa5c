//! What a writer consults, beside its shard's uncommitted chunks, to find a stored duplicate
//! of a block: the dedup filter (a Bloom filter of fingerprint prefixes, `bloom.rs`), the
//! dedup index's runs as last committed (`dedup_index.rs`), and the count of commits that
//! freed chunks, which tells a write's neighbours (`neighbours.rs`) whether a chunk they saw
//! may be gone.
//!
//! The filter and the runs are replaced whole (`Arc`s swapped under a short lock): readers
//! take the current one and keep it as long as they need, whatever replaces it meanwhile.

use crate::bloom::Bloom;
use crate::dedup_index::Runs;
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The dedup lookup's in-memory state (see the module's doc).
pub(crate) struct Dedup {
    filter: RwLock<Arc<Bloom>>,
    runs: RwLock<Arc<Runs>>,
    /// Commits that freed chunks so far, bumped before their fingerprints leave `dead_fps`.
    frees: AtomicU64,
}

impl Dedup {
    /// The state of a pool opening with `filter` (empty until rebuilt) and the committed `runs`.
    pub(crate) fn new(filter: Bloom, runs: Runs) -> Dedup {
        Dedup {
            filter: RwLock::new(Arc::new(filter)),
            runs: RwLock::new(Arc::new(runs)),
            frees: AtomicU64::new(0),
        }
    }

    /// The current dedup filter.
    pub(crate) fn filter(&self) -> Arc<Bloom> {
        self.filter.read().clone()
    }

    /// Installs a filter sized for `capacity` fingerprints that answers "maybe" for whatever
    /// the current one holds until it is filled ([`Bloom::growing_from`]), and returns it.
    pub(crate) fn grow_filter(&self, capacity: u64) -> Arc<Bloom> {
        let mut current = self.filter.write();
        let grown = Arc::new(Bloom::growing_from(capacity, current.clone()));
        *current = grown.clone();
        grown
    }

    /// The dedup index's runs as last committed.
    pub(crate) fn runs(&self) -> Arc<Runs> {
        self.runs.read().clone()
    }

    /// Installs the runs a commit's transaction left (after it is durable, before the commit
    /// publishes: see `dedup_index.rs`).
    pub(crate) fn set_runs(&self, runs: Runs) {
        *self.runs.write() = Arc::new(runs);
    }

    /// The count of commits that freed chunks (read before a neighbour scan's snapshot).
    pub(crate) fn frees(&self) -> &AtomicU64 {
        &self.frees
    }

    /// A commit frees chunks: bumped before their fingerprints leave `dead_fps`.
    pub(crate) fn note_frees(&self) {
        self.frees.fetch_add(1, Ordering::AcqRel);
    }
}
