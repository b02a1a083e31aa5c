//! The pool's space: its capacity and soft threshold, what is used (live chunks, chunks not
//! yet committed, metadata), what thick volumes keep reserved, and the filesystem under it.
//!
//! One owner for every figure that decides whether new data fits, so that the rules live in
//! one place (see `provision.rs` for the policy they implement):
//! - a new chunk's bytes are **claimed** before they are written ([`Space::claim`]): counted
//!   as used at once, so writers racing for the last bytes never pass the capacity together;
//! - a **reservation** for thick volumes is taken only through [`Reserving`], which holds the
//!   lock that serializes reservations, so that two cannot both fit in the same free space;
//! - a commit moves claimed bytes to live ones ([`Space::commit`]).
//!
//! The figures are atomics: readers (statistics, the cleaner's pressure, admission) never wait.

use crate::error::{Error, Result};
use crate::fs_space::FsSpace;
use crate::provision::{OVERWRITE_HEADROOM_BLOCKS_MAX, RESERVED_BYTES_PER_BLOCK};
use parking_lot::{Mutex, MutexGuard};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// Blocks of overwrite headroom for thick volumes of `blocks` blocks in all.
fn headroom_blocks(blocks: i64) -> u64 {
    (blocks.max(0) as u64).min(OVERWRITE_HEADROOM_BLOCKS_MAX)
}

/// Space reserved for thick volumes of `blocks` blocks in all, `unwritten` of them without
/// data.
fn reserved_bytes_for(unwritten: i64, blocks: i64) -> u64 {
    (unwritten.max(0) as u64 + headroom_blocks(blocks)).saturating_mul(RESERVED_BYTES_PER_BLOCK)
}

/// Whether `used` bytes are at or past `pct` percent of `capacity`.
pub(crate) fn past_threshold(used: u64, capacity: u64, pct: u64) -> bool {
    used as u128 * 100 >= capacity as u128 * pct as u128
}

/// What a pool's space starts from when it opens.
pub(crate) struct Opening {
    /// The pool record's capacity and soft threshold.
    pub capacity_bytes: u64,
    pub soft_threshold_pct: u64,
    /// The pool record's committed live chunks and their bytes.
    pub live_chunks: u64,
    pub live_bytes: u64,
    /// The metadata's files (store and journal), bytes.
    pub meta_bytes: u64,
    /// Thick volumes' blocks without data, and all their blocks
    /// ([`crate::provision::thick_totals`]).
    pub thick_unwritten_blocks: u64,
    pub thick_blocks: u64,
}

/// The pool's space (see the module's doc).
pub(crate) struct Space {
    capacity_bytes: AtomicU64,
    soft_threshold_pct: AtomicU64,
    /// Committed live chunk bytes and count (mirror the pool record).
    live_bytes: AtomicU64,
    live_chunks: AtomicU64,
    /// Bytes claimed for chunks not yet committed.
    pending_bytes: AtomicI64,
    /// The metadata's files, as of the last commit.
    meta_bytes: AtomicU64,
    /// Blocks of thick volumes that hold no data: each keeps a reservation. Changed with the
    /// volume's map locked; below zero only while a zeroed range settles (`provision.rs`).
    thick_unwritten_blocks: AtomicI64,
    /// Blocks of thick volumes (their sizes summed): up to
    /// [`OVERWRITE_HEADROOM_BLOCKS_MAX`] of them keep a reservation as headroom for
    /// overwrites. Raised only through [`Reserving`].
    thick_blocks: AtomicI64,
    /// Serializes operations that take new reservations ([`Space::reserving`]).
    reserve_lock: Mutex<()>,
    /// Past the soft threshold (or the filesystem low) as of the last check.
    soft_warned: AtomicBool,
    /// The filesystem under the pool: new data is admitted only while it keeps its reserve.
    fs: FsSpace,
}

impl Space {
    /// The space of a pool opening with `at`, on the filesystem `fs`.
    pub(crate) fn new(at: Opening, fs: FsSpace) -> Space {
        Space {
            capacity_bytes: AtomicU64::new(at.capacity_bytes),
            soft_threshold_pct: AtomicU64::new(at.soft_threshold_pct),
            live_bytes: AtomicU64::new(at.live_bytes),
            live_chunks: AtomicU64::new(at.live_chunks),
            pending_bytes: AtomicI64::new(0),
            meta_bytes: AtomicU64::new(at.meta_bytes),
            thick_unwritten_blocks: AtomicI64::new(at.thick_unwritten_blocks as i64),
            thick_blocks: AtomicI64::new(at.thick_blocks as i64),
            reserve_lock: Mutex::new(()),
            soft_warned: AtomicBool::new(false),
            fs,
        }
    }

    /// The filesystem under the pool.
    pub(crate) fn fs(&self) -> &FsSpace {
        &self.fs
    }

    /// The pool's capacity, bytes.
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity_bytes.load(Ordering::Relaxed)
    }

    /// The soft threshold, percent of the capacity.
    pub(crate) fn soft_threshold_pct(&self) -> u64 {
        self.soft_threshold_pct.load(Ordering::Relaxed)
    }

    /// Sets the soft threshold (1 to 100, checked by the caller and recorded in the pool
    /// record first).
    pub(crate) fn set_soft_threshold_pct(&self, pct: u64) {
        assert!((1..=100).contains(&pct), "soft threshold {pct} %");
        self.soft_threshold_pct.store(pct, Ordering::Relaxed);
    }

    /// Committed live chunk bytes.
    pub(crate) fn live_bytes(&self) -> u64 {
        self.live_bytes.load(Ordering::Relaxed)
    }

    /// Committed live chunks.
    pub(crate) fn live_chunks(&self) -> u64 {
        self.live_chunks.load(Ordering::Relaxed)
    }

    /// The metadata's files, bytes, as of the last commit.
    pub(crate) fn meta_bytes(&self) -> u64 {
        self.meta_bytes.load(Ordering::Relaxed)
    }

    /// A commit stored `new_bytes` of claimed chunks: the pool record now counts `live_chunks`
    /// chunks of `live_bytes`, and the metadata's files take `meta_bytes`.
    pub(crate) fn commit(
        &self,
        new_bytes: u64,
        live_bytes: u64,
        live_chunks: u64,
        meta_bytes: u64,
    ) {
        self.live_bytes.store(live_bytes, Ordering::Relaxed);
        self.live_chunks.store(live_chunks, Ordering::Relaxed);
        let before = self
            .pending_bytes
            .fetch_sub(new_bytes as i64, Ordering::Relaxed);
        debug_assert!(before >= new_bytes as i64, "committed more than claimed");
        self.meta_bytes.store(meta_bytes, Ordering::Relaxed);
    }

    /// Counts `bytes` of an uncommitted chunk replayed from the journal as claimed (its commit
    /// moves them to live ones).
    pub(crate) fn adopt(&self, bytes: u64) {
        self.pending_bytes
            .fetch_add(bytes as i64, Ordering::Relaxed);
    }

    /// Bytes claimed for chunks not yet committed.
    #[cfg(test)]
    pub(crate) fn pending_bytes(&self) -> i64 {
        self.pending_bytes.load(Ordering::Relaxed)
    }

    /// Bytes used now: live chunks, chunks claimed since the last commit, metadata.
    pub(crate) fn used_now(&self) -> u64 {
        self.used_with_pending(self.pending_bytes.load(Ordering::Relaxed))
    }

    /// [`Self::used_now`] with `pending` bytes claimed.
    fn used_with_pending(&self, pending: i64) -> u64 {
        let used = self.live_bytes() as i64 + pending + self.meta_bytes() as i64;
        used.max(0) as u64
    }

    /// Space thick volumes keep reserved: for their unwritten blocks, and the overwrite
    /// headroom.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        reserved_bytes_for(
            self.thick_unwritten_blocks.load(Ordering::Relaxed),
            self.thick_blocks.load(Ordering::Relaxed),
        )
    }

    /// The part of [`Self::reserved_bytes`] kept as headroom for thick volumes' overwrites.
    pub(crate) fn overwrite_headroom_bytes(&self) -> u64 {
        headroom_blocks(self.thick_blocks.load(Ordering::Relaxed)) * RESERVED_BYTES_PER_BLOCK
    }

    /// Bytes neither used nor reserved.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.capacity()
            .saturating_sub(self.used_now() + self.reserved_bytes())
    }

    /// The thick volumes' unwritten blocks and all their blocks, as counted (for `verify`).
    pub(crate) fn thick_counts(&self) -> (i64, i64) {
        (
            self.thick_unwritten_blocks.load(Ordering::Relaxed),
            self.thick_blocks.load(Ordering::Relaxed),
        )
    }

    /// Claims `bytes` of pool space for a new chunk: counts them as used (until the commit
    /// that stores the chunk makes them live) for as long as the returned claim is held or
    /// kept. Fails with `NoSpace`, counting nothing, if they would not fit: a thin volume may
    /// not use what thick volumes keep reserved; a thick volume (`thick`) may, and is always
    /// admitted while it has blocks without data (`has_unwritten`, asked only then: its
    /// reservation covers them).
    ///
    /// The bytes are added before the check, and the check uses the sum that addition
    /// returned, so concurrent writers see each other's claims and together never pass the
    /// capacity (two racing for the last bytes may both fail; a write retries once after a
    /// commit). A check first and an addition after the append would let every writer
    /// preparing a block at once pass the same check.
    pub(crate) fn claim(
        &self,
        bytes: u64,
        thick: bool,
        has_unwritten: impl FnOnce() -> bool,
    ) -> Result<SpaceClaim<'_>> {
        let claim = SpaceClaim { space: self, bytes };
        let pending = self.pending_bytes.fetch_add(bytes as i64, Ordering::AcqRel) + bytes as i64;
        let used = self.used_with_pending(pending);
        let reserved = if thick { 0 } else { self.reserved_bytes() };
        let fits = used + reserved <= self.capacity() || (thick && has_unwritten());
        // The filesystem is the hard limit, whatever the pool promised.
        if fits && self.fs.admits(bytes) {
            return Ok(claim);
        }
        Err(Error::NoSpace)
    }

    /// A thick volume's mapped count changed by `delta` (call with its map locked): its
    /// unwritten blocks change the other way.
    pub(crate) fn note_mapped_change(&self, delta: i64) {
        self.thick_unwritten_blocks
            .fetch_sub(delta, Ordering::Relaxed);
    }

    /// Takes the lock that serializes new reservations: what is checked through the guard
    /// stays true until it adds the blocks.
    pub(crate) fn reserving(&self) -> Reserving<'_> {
        Reserving {
            space: self,
            _lock: self.reserve_lock.lock(),
        }
    }

    /// Gives back the reservation of a thick volume that leaves the pool's thick set (deleted
    /// or made thin): its `share` of the unwritten blocks
    /// ([`crate::provision::reservation_share`]) and its `blocks`. Needs no lock: giving
    /// space back cannot break a promise.
    pub(crate) fn release(&self, share: i64, blocks: i64) {
        self.thick_unwritten_blocks
            .fetch_sub(share, Ordering::Relaxed);
        let left = self.thick_blocks.fetch_sub(blocks, Ordering::Relaxed) - blocks;
        assert!(
            left >= 0,
            "thick volumes' blocks counted below zero: {left}"
        );
    }

    /// Whether the pool was past its soft threshold (or the filesystem low) at the last check.
    pub(crate) fn soft_warned(&self) -> bool {
        self.soft_warned.load(Ordering::Relaxed)
    }

    /// Whether used and reserved space is past the soft threshold, or the filesystem is low,
    /// with the filesystem available `fs_avail`.
    pub(crate) fn past_soft_threshold(&self, fs_avail: u64) -> bool {
        let used = self.committed_or_reserved();
        past_threshold(used, self.capacity(), self.soft_threshold_pct()) || self.fs.is_low(fs_avail)
    }

    /// What the soft threshold is measured against: committed use and reservations.
    fn committed_or_reserved(&self) -> u64 {
        self.live_bytes() + self.meta_bytes() + self.reserved_bytes()
    }

    /// Logs the soft threshold crossing of pool `dir` once, and its clearing; cheap (atomics
    /// only), run after every commit.
    pub(crate) fn check_soft_threshold(&self, dir: &Path) {
        let capacity = self.capacity();
        let used = self.committed_or_reserved();
        let pct = self.soft_threshold_pct();
        let fs_low = self.fs.low();
        if past_threshold(used, capacity, pct) || fs_low {
            if !self.soft_warned.swap(true, Ordering::Relaxed) {
                if fs_low {
                    let (_, avail) = self.fs.now();
                    tracing::warn!(
                        "pool {}: the filesystem has {} available, under twice the {} kept \
                         for metadata (new data is refused below it)",
                        dir.display(),
                        crate::units::format_size(avail),
                        crate::units::format_size(self.fs.reserve_bytes())
                    );
                } else {
                    tracing::warn!(
                        "pool {}: {used} of {capacity} bytes used or reserved, past the soft threshold of {pct} %",
                        dir.display()
                    );
                }
            }
        } else if self.soft_warned.swap(false, Ordering::Relaxed) {
            tracing::info!("pool {}: back under the soft threshold", dir.display());
        }
    }
}

/// The reservation lock held ([`Space::reserving`]): checks and takes reservations, and
/// changes the capacity, one such operation at a time.
pub(crate) struct Reserving<'a> {
    space: &'a Space,
    _lock: MutexGuard<'a, ()>,
}

impl Reserving<'_> {
    /// Fails with `CannotReserve` unless the reservation that `unwritten` more unwritten
    /// blocks and `blocks` more blocks of thick volumes add fits in the space that is neither
    /// used nor reserved.
    pub(crate) fn check(&self, unwritten: i64, blocks: i64) -> Result<()> {
        let (u, b) = self.space.thick_counts();
        let needed = reserved_bytes_for(u.saturating_add(unwritten), b.saturating_add(blocks))
            .saturating_sub(reserved_bytes_for(u, b));
        let available = self.space.free_bytes();
        if needed > available {
            return Err(Error::CannotReserve { needed, available });
        }
        Ok(())
    }

    /// Adds `unwritten` unwritten blocks and `blocks` blocks to the thick volumes' counts
    /// (after [`Self::check`], or for a volume whose reservation was already promised).
    pub(crate) fn add(&self, unwritten: i64, blocks: i64) {
        assert!(blocks >= 0, "adding {blocks} thick blocks");
        self.space
            .thick_unwritten_blocks
            .fetch_add(unwritten, Ordering::Relaxed);
        self.space.thick_blocks.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Sets the capacity, refused with `CannotReserve` below what is used and reserved (the
    /// capacity is a promise to thick volumes); `record` makes the new capacity durable first.
    pub(crate) fn set_capacity(
        &self,
        capacity_bytes: u64,
        record: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let needed = self.space.used_now() + self.space.reserved_bytes();
        if capacity_bytes < needed {
            return Err(Error::CannotReserve {
                needed,
                available: capacity_bytes,
            });
        }
        record()?;
        self.space
            .capacity_bytes
            .store(capacity_bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// Pool space counted as used for a new chunk not yet registered ([`Space::claim`]): given
/// back when dropped, unless [`SpaceClaim::keep`] hands it to the chunk (whose commit then
/// counts it as live).
#[must_use = "a claim dropped at once gives its space back"]
pub(crate) struct SpaceClaim<'a> {
    space: &'a Space,
    bytes: u64,
}

impl SpaceClaim<'_> {
    /// The chunk is registered: its uncommitted bytes stay counted until its commit.
    pub(crate) fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for SpaceClaim<'_> {
    fn drop(&mut self) {
        let before = self
            .space
            .pending_bytes
            .fetch_sub(self.bytes as i64, Ordering::AcqRel);
        debug_assert!(before >= self.bytes as i64, "a claim given back twice");
    }
}
