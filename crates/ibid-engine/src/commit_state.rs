//! What the committer owns: behind the commit lock, the pool record as committed and the
//! reference-count log with the stale fingerprint counts ([`CommitState`]); and, read by every writer, the batch numbering
//! ([`Batches`]).

use crate::chunk_fps::Stale;
use crate::meta::PoolRecord;
use crate::ref_log::RefLog;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Committed counters, the reference-count log and the stale fingerprint counts, owned by the
/// committer.
pub(crate) struct CommitState {
    pub record: PoolRecord,
    pub ref_log: RefLog,
    /// Stale fingerprints per slice of the log (`chunk_fps.rs`).
    pub fps_stale: Stale,
    /// Layers a running build owns (`copy/layer_build.rs`); the other layers listed as being
    /// built are abandoned.
    pub building: BTreeSet<u64>,
}

/// The batch numbering. Writers stamp each change with the batch it belongs to, the one after
/// the last cut ([`Batches::stamp`], read holding the gate shared); a commit cuts that batch
/// ([`Batches::cut`], holding the gate exclusively) and, once it is durable, records it as
/// committed ([`Batches::committed_through`]). Invariants, asserted: both numbers only grow,
/// and no batch is committed before it is cut.
pub(crate) struct Batches {
    cut: AtomicU64,
    committed: AtomicU64,
    /// Blocks changed since the last cut (what the throttle and the pacer measure).
    dirty_blocks: AtomicU64,
    /// Blocks changed in the batch last cut, until it is committed.
    committing_blocks: AtomicU64,
    /// Orphan chunks may need freeing: the next commit runs even with nothing else to do.
    orphans_pending: AtomicBool,
}

impl Batches {
    /// The numbering of a pool whose last durable commit was batch `committed`; orphan chunks
    /// are looked for at the first commit.
    pub(crate) fn resume(committed: u64) -> Batches {
        Batches {
            cut: AtomicU64::new(committed),
            committed: AtomicU64::new(committed),
            dirty_blocks: AtomicU64::new(0),
            committing_blocks: AtomicU64::new(0),
            orphans_pending: AtomicBool::new(true),
        }
    }

    /// The batch a change made now belongs to: the one after the last cut. Stable while the
    /// caller holds the gate shared (cuts hold it exclusively).
    pub(crate) fn stamp(&self) -> u64 {
        self.cut.load(Ordering::Acquire) + 1
    }

    /// Cuts the next batch and returns its number (call holding the gate exclusively and the
    /// commit lock): the changes stamped with it are the batch's; the dirty count restarts.
    pub(crate) fn cut(&self) -> u64 {
        let no = self.cut.fetch_add(1, Ordering::AcqRel) + 1;
        let cut = self.dirty_blocks.swap(0, Ordering::Relaxed);
        self.committing_blocks.store(cut, Ordering::Relaxed);
        debug_assert!(
            self.committed.load(Ordering::Acquire) < no,
            "batch {no} cut after it was committed"
        );
        no
    }

    /// Batches durably committed.
    pub(crate) fn committed(&self) -> u64 {
        self.committed.load(Ordering::Acquire)
    }

    /// Records that batches up to `no`, which was cut, are durable (call holding the commit
    /// lock).
    pub(crate) fn committed_through(&self, no: u64) {
        let before = self.committed.swap(no, Ordering::AcqRel);
        self.committing_blocks.store(0, Ordering::Relaxed);
        debug_assert!(
            before <= no,
            "committed batches went from {before} back to {no}"
        );
        debug_assert!(
            no <= self.cut.load(Ordering::Acquire),
            "batch {no} committed before it was cut"
        );
    }

    /// Counts `blocks` more changed blocks in the batch being filled.
    pub(crate) fn add_dirty(&self, blocks: u64) {
        self.dirty_blocks.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Blocks changed since the last cut.
    pub(crate) fn dirty(&self) -> u64 {
        self.dirty_blocks.load(Ordering::Relaxed)
    }

    /// Blocks changed and not committed yet: since the last cut, and in the batch being
    /// committed.
    pub(crate) fn uncommitted(&self) -> u64 {
        self.dirty() + self.committing_blocks.load(Ordering::Relaxed)
    }

    /// Whether orphan chunks may need freeing, clearing the flag: the commit that takes it
    /// looks for them.
    pub(crate) fn take_orphans(&self) -> bool {
        self.orphans_pending.swap(false, Ordering::AcqRel)
    }
}
