//! Provisioning formats: thin, lazy-zeroed thick and eager-zeroed thick are space policies over
//! one data layout, not layouts of their own.
//!
//! Every format creates in O(1), reads unwritten blocks as zeros from the map, and writes,
//! dedups, compresses and shares data the same way, so all three perform the same from the
//! first write. What differs is the space promise:
//!
//! - **Reservation.** A thick volume keeps [`RESERVED_BYTES_PER_BLOCK`] of pool space reserved
//!   for each of its blocks that holds no data (`size − mapped` blocks). Writing data to a block
//!   consumes its reservation; zeroing or unmapping the block takes it back. Thin writes may not
//!   use reserved space (they fail with `NoSpace` when `used + reserved` reaches capacity);
//!   thick writes may, so a thick volume can always fill every block it has, whatever thin
//!   volumes did to the pool. The pool counts reservations with one atomic,
//!   `Inner::thick_unwritten_blocks`, changed under the volume's map lock together with its
//!   mapped count. Zeroing counts the blocks it unmaps when its range settles (see
//!   `overlay.rs`, `commit.rs`), so their reservation returns then, not when the zero is
//!   acknowledged; their old data is still counted as used until then, and a zero on a thick
//!   volume wakes the committer at once.
//! - **Overwrite headroom.** New data is stored before the commit that frees the data it
//!   replaces, so overwriting a written block needs a block's space for a while. The pool keeps
//!   one block's reservation per block of its thick volumes, up to
//!   [`OVERWRITE_HEADROOM_BLOCKS_MAX`] (64 MiB of data, more than one write can carry), reserved
//!   from their creation (`Inner::thick_blocks`): thin writes may not use it, so a thick volume
//!   whose every block holds data still overwrites them, and rewrites blocks it zeroed before
//!   their range settles, on a pool thin volumes filled. Writes past the headroom wait for the
//!   commit that frees what earlier ones replaced (a write that finds no space retries once
//!   after a commit).
//! - **Admission.** A write to a thick volume that still has blocks without data is always
//!   admitted: the space was promised when the reservation was taken. Any other thick write is
//!   admitted while used space (the headroom included) fits in the capacity. The metadata
//!   store's file grows in steps (doubling while small, then by regions of up to 4 GiB) after
//!   the writes that caused it, so a step taken after thin writes filled the pool may push
//!   `used` past the nominal capacity by part of a step; the reservation still holds.
//! - **Limits of the promise**, as in any array that shares data: the reservation covers one
//!   copy of every block. Overwriting a block whose old data something else still references
//!   (a snapshot, a clone, a duplicate elsewhere) needs new space the reservation did not set
//!   aside; that space comes from the pool's free space like a thin write (and the headroom
//!   while it lasts).
//! - **tbz** ("to be zeroed", VMware's term): a lazy-zeroed thick volume reports its blocks that
//!   hold no data as tbz; an eager-zeroed one reports 0 from creation. Nothing is ever written
//!   to zero a block (unwritten blocks read as zeros), so `eagerzero` and `inflate` are
//!   metadata-only conversions.

use crate::error::{Error, Result};
use crate::format::{VolumeFormat, VolumeRecord, BLOCK_BYTES, RECORD_HEADER_BYTES};
use crate::meta;
use crate::pool::{Inner, Pool, VolumeState};
use crate::space::SpaceClaim;
use std::sync::atomic::Ordering;

/// Metadata a stored block may add (map entry, chunk record, fingerprint index, B-tree slack):
/// measured at 288 B per unique block with 1 Mi blocks and ~515 B with 2 Mi (redb file size).
const METADATA_BYTES_PER_BLOCK: u64 = 512;

/// Pool space a thick volume reserves for each block that holds no data: an incompressible
/// 4 KiB block's record in a segment file, plus its metadata.
pub const RESERVED_BYTES_PER_BLOCK: u64 =
    BLOCK_BYTES as u64 + RECORD_HEADER_BYTES as u64 + METADATA_BYTES_PER_BLOCK;

/// Most blocks the pool keeps reserved as headroom for thick volumes' overwrites (64 MiB of
/// data: more than the largest single write, 32 MiB over NBD).
pub const OVERWRITE_HEADROOM_BLOCKS_MAX: u64 = 16 << 10;

/// Blocks of a volume of `size` bytes.
pub(crate) fn volume_blocks(size: u64) -> u64 {
    size.div_ceil(BLOCK_BYTES as u64)
}

/// What the pool's reservation counters hold for these volume records: the thick volumes'
/// unwritten blocks and all their blocks (`Inner::thick_unwritten_blocks`, `thick_blocks`).
pub(crate) fn thick_totals<'a>(records: impl Iterator<Item = &'a VolumeRecord>) -> (u64, u64) {
    records
        .filter(|r| r.format.is_thick())
        .fold((0, 0), |(unwritten, blocks), r| {
            (
                unwritten + unwritten_blocks(r.size, r.mapped_blocks),
                blocks + volume_blocks(r.size),
            )
        })
}

/// Blocks of a volume of `size` bytes with `mapped` blocks of data that hold no data.
pub(crate) fn unwritten_blocks(size: u64, mapped: u64) -> u64 {
    reservation_share(size, mapped).max(0) as u64
}

/// What a thick volume of `size` bytes with `mapped` blocks adds to the pool's
/// `thick_unwritten_blocks`: its unwritten blocks, or less than zero while a zeroed range
/// settles. The in-memory mapped count counts a block written inside a pending zeroed range
/// while the committed block the range hides is still counted (the range's settlement
/// subtracts it), so it can pass the volume's size meanwhile; the pool's sum follows every
/// change of it (`note_mapped_change`), and a volume leaving the sum must take out exactly
/// that, not [`unwritten_blocks`]' zero.
pub(crate) fn reservation_share(size: u64, mapped: u64) -> i64 {
    volume_blocks(size) as i64 - mapped as i64
}

impl VolumeState {
    /// The volume's provisioning format.
    pub(crate) fn format(&self) -> VolumeFormat {
        VolumeFormat::from_code(self.format.load(Ordering::Relaxed)).unwrap_or_default()
    }
}

impl Inner {
    /// Claims `bytes` of pool space for a new chunk of volume `v` ([`Space::claim`]: a thick
    /// volume with blocks still without data is always admitted).
    pub(crate) fn reserve_space(&self, bytes: u64, v: &VolumeState) -> Result<SpaceClaim<'_>> {
        self.space.claim(bytes, v.format().is_thick(), || {
            let map = v.map.lock();
            unwritten_blocks(map.size, map.mapped_blocks) > 0
        })
    }

    /// Records that `v`'s mapped count changed by `delta` (call with its map locked): a thick
    /// volume's reservation follows it.
    pub(crate) fn note_mapped_change(&self, v: &VolumeState, delta: i64) {
        if delta != 0 && v.format().is_thick() {
            self.space.note_mapped_change(delta);
        }
    }
}

impl Pool {
    /// Changes a volume's provisioning format, in O(1): to a thick format it reserves space for
    /// the blocks that hold no data (`CannotReserve` if that does not fit); to thin it releases
    /// the reservation. Lazy- to eager-zeroed thick (`vmkfstools -k`) and thin to eager-zeroed
    /// thick (`inflate`) are the seeds' conversions. Returns the previous format.
    pub fn set_volume_format(&self, name: &str, format: VolumeFormat) -> Result<VolumeFormat> {
        self.inner.check_failed()?;
        let state = self.live_state(name)?;
        let reserving = self.inner.space.reserving();
        let mut map = state.map.lock();
        if map.deleted {
            return Err(Error::NotFound(name.to_string()));
        }
        let old = state.format();
        if old == format {
            return Ok(old);
        }
        let share = reservation_share(map.size, map.mapped_blocks);
        let blocks = volume_blocks(map.size) as i64;
        match (old.is_thick(), format.is_thick()) {
            (false, true) => {
                reserving.check(share, blocks)?;
                reserving.add(share, blocks);
            }
            (true, false) => self.inner.space.release(share, blocks),
            _ => {}
        }
        state.format.store(format.code(), Ordering::Relaxed);
        map.record_dirty = true;
        drop(map);
        drop(reserving);
        self.inner.commit()?;
        self.inner.check_soft_threshold();
        Ok(old)
    }

    /// Changes the pool's capacity. Refused with `CannotReserve` below what is used and
    /// reserved: the capacity is a promise to thick volumes.
    pub fn set_capacity(&self, capacity_bytes: u64) -> Result<()> {
        self.set_capacity_checked(capacity_bytes, false)
    }

    /// [`Pool::set_capacity`], accepting a capacity larger than the filesystem can hold
    /// (the pool then promises space the filesystem may not have; writes of new data get
    /// ENOSPC when it fills).
    pub fn set_capacity_forced(&self, capacity_bytes: u64) -> Result<()> {
        self.set_capacity_checked(capacity_bytes, true)
    }

    fn set_capacity_checked(&self, capacity_bytes: u64, force: bool) -> Result<()> {
        self.inner.check_failed()?;
        // What the filesystem can hold: what the pool's files take now and what is free.
        let (_, fs_avail) = self.inner.space.fs().now();
        let holdable = (self.inner.segment_file_bytes() + self.inner.space.meta_bytes())
            .saturating_add(fs_avail);
        if capacity_bytes > holdable && !force {
            return Err(Error::InvalidArgument(format!(
                "capacity {} is more than the filesystem under the pool can hold ({}: its \
                 files and the space available); force it to promise space the filesystem may \
                 not have",
                crate::units::format_exact(capacity_bytes),
                crate::units::format_exact(holdable)
            )));
        }
        self.inner
            .space
            .reserving()
            .set_capacity(capacity_bytes, || {
                self.update_pool_record(|r| r.capacity_bytes = capacity_bytes)
            })?;
        self.inner.check_soft_threshold();
        Ok(())
    }

    /// Changes the soft threshold (1 to 100 percent of capacity).
    pub fn set_soft_threshold(&self, pct: u8) -> Result<()> {
        self.inner.check_failed()?;
        if pct == 0 || pct > 100 {
            return Err(Error::InvalidArgument(format!(
                "soft threshold {pct}: must be 1 to 100 percent"
            )));
        }
        self.update_pool_record(|r| r.soft_threshold_pct = pct as u64)?;
        self.inner.space.set_soft_threshold_pct(pct as u64);
        self.inner.check_soft_threshold();
        Ok(())
    }

    /// Changes the committed pool record in its own transaction.
    fn update_pool_record(&self, change: impl FnOnce(&mut meta::PoolRecord)) -> Result<()> {
        let mut cs = self.inner.commit.lock();
        self.inner.update_pool_record(&mut cs, change)
    }
}

#[cfg(test)]
mod tests {
    use crate::format::{BLOCK_BYTES, RECORD_HEADER_BYTES};
    use crate::{Error, Pool, PoolConfig};
    use std::sync::{Arc, Barrier};

    /// A held claim counts as used space at once, so a second claim cannot take the same
    /// bytes; a failed claim and a dropped one count nothing; writers claiming at once never
    /// claim more than the free space together.
    #[test]
    fn claims_count_at_once_and_never_pass_the_capacity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = PoolConfig {
            capacity_bytes: Some(64 << 20),
            background: false,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.path().join("p"), config).expect("create");
        pool.create_volume("v", 1 << 30).expect("v");
        let inner = pool.inner.clone();
        // The filter rebuild started at creation commits when done, and a commit updates the
        // metadata's size: let it finish, so that the free space stays put below.
        if let Some(rebuild) = inner.rebuild_thread.lock().take() {
            rebuild.join().expect("filter rebuild");
        }
        let v = inner.catalog.volume("v").expect("v");
        let free = inner.space.capacity() - inner.space.used_now();
        let chunk = (RECORD_HEADER_BYTES + BLOCK_BYTES) as u64;

        let held = inner
            .reserve_space(free - chunk, &v)
            .expect("most of the space");
        assert!(matches!(
            inner.reserve_space(2 * chunk, &v),
            Err(Error::NoSpace)
        ));
        let last = inner.reserve_space(chunk, &v).expect("the rest");
        assert_eq!(inner.space.used_now(), inner.space.capacity());
        drop((held, last));
        assert_eq!(inner.space.pending_bytes(), 0);

        let writers = 8;
        let start = Arc::new(Barrier::new(writers));
        let kept: u64 = (0..writers)
            .map(|_| {
                let (inner, v, start) = (inner.clone(), v.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let mut kept = 0;
                    while let Ok(claim) = inner.reserve_space(chunk, &v) {
                        claim.keep();
                        kept += chunk;
                    }
                    kept
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("writer"))
            .sum();
        assert!(kept <= free, "claimed {kept} of {free} free bytes");
        assert!(
            kept + writers as u64 * chunk > free,
            "claimed only {kept} of {free}"
        );
        assert_eq!(inner.space.pending_bytes(), kept as i64);
    }
}
