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

use crate::format::{VolumeRecord, BLOCK_BYTES, RECORD_HEADER_BYTES};

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
