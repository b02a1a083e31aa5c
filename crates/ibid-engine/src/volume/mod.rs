//! A volume handle: block I/O, zeroing, block status. The handle's API is here; the paths
//! behind it are in [`read`], [`write`](mod@write) (block preparation, placement, installation and
//! reference counting), [`zero`] and [`share`] (range copies and compare-and-write).
//!
//! Offsets and lengths are bytes, multiples of 512. Inside, the engine works in 4 KiB blocks:
//! a write that covers part of a block reads the block, patches it and writes it whole, holding
//! the block's stripe lock so concurrent partial writes to one block never lose each other.

use crate::compression;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::format::{self, Frame, BLOCK_BYTES, RECORD_FLAG_LZ4, RECORD_HEADER_BYTES, SECTOR_BYTES};
use crate::inner::Inner;
use crate::journal::Change;
use crate::layer_filter::LayerFilters;
use crate::meta;
use crate::neighbours::Neighbours;
use crate::overlay::Entry;
use crate::read_cache::HeldBlocks;
use crate::segment::NewRecord;
use crate::segment::DATA_WRITERS;
use crate::shard::{ShardState, SHARDS, SHARD_BITS};
use crate::stack::{Found, Resolved};
use crate::stats::VolumeSpace;
use crate::store::{ReadTxn, Reader};
use crate::volume_state::{VolumeMap, VolumeState, STRIPES};
use parking_lot::MutexGuard;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

mod read;
mod share;
#[cfg(test)]
mod tests;
mod write;
mod zero;

pub(crate) use read::{resolve_stored, resolve_stored_each, scan_layer};
pub use write::QUICK_WRITE_BLOCKS_MAX;
use write::*;

const BLOCK: u64 = BLOCK_BYTES as u64;

/// Most commits a write that found no space retries after ([`Inner::retry_after_commit`]).
const RETRIES_AFTER_COMMIT_MAX: usize = 16;
/// Most segments a writer refused by the filesystem cleans before it answers `NoSpace`
/// (`retry_after_commit`).
const CLEANS_FOR_SPACE_MAX: usize = 64;
/// Pool room under which a refused writer does not clean: the refusal is then the pool's
/// own capacity, which cleaning (it frees filesystem space, not pool space) does not change.
const ROOM_FOR_CLEANING_MIN: u64 = 1 << 20;
/// Blocks of a write fingerprinted together.
const LANES: u64 = fingerprint::LANES as u64;
/// Times a read retries when the chunk it found was concurrently freed or moved.
const READ_RETRIES_MAX: usize = 8;
/// Uncommitted blocks (across the pool) past which [`Volume::commit_backlog`] commits.
const COPY_BACKLOG_BLOCKS: u64 = 4096;

/// An extent reported by [`Volume::block_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// What the extent holds.
    pub kind: ExtentKind,
}

/// Allocation state of an extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    /// Mapped to stored data.
    Data,
    /// Reads as zeros and holds no space (never written, zeroed or unmapped).
    Zero,
}

/// A handle on one volume. Cheap to clone; any number of threads may use handles at once.
#[derive(Clone)]
pub struct Volume {
    inner: Arc<Inner>,
    state: Arc<VolumeState>,
}

impl Volume {
    pub(crate) fn new(inner: Arc<Inner>, state: Arc<VolumeState>) -> Self {
        Volume { inner, state }
    }

    /// The volume's in-memory state.
    pub(crate) fn state(&self) -> &Arc<VolumeState> {
        &self.state
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// The volume's size in bytes.
    pub fn size(&self) -> u64 {
        self.state.map.lock().size
    }

    /// A stable identifier of the volume, unique in its pool.
    pub fn id(&self) -> u64 {
        self.state.id
    }

    /// Frames in the volume's stack: its own layer, snapshot and clone ancestry, range copies
    /// not yet made permanent (for tests and benchmarks).
    #[doc(hidden)]
    pub fn stack_depth(&self) -> usize {
        self.state.map.lock().stack.len()
    }

    /// Blocks mapped to data, including uncommitted writes. Zeroing counts the blocks it
    /// unmaps as its range settles, so this commits first while a zeroed range is pending.
    pub fn mapped_blocks(&self) -> u64 {
        if let Err(e) = self.inner.settle_zeroed(Some(&self.state)) {
            tracing::warn!("commit to count zeroed blocks failed: {e}");
        }
        self.state.map.lock().mapped_blocks
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        if !offset.is_multiple_of(SECTOR_BYTES) || !len.is_multiple_of(SECTOR_BYTES) {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} and length {len} must be multiples of 512"
            )));
        }
        let map = self.state.map.lock();
        if map.deleted {
            return Err(Error::NotFound(self.state.name.clone()));
        }
        match offset.checked_add(len) {
            Some(end) if end <= map.size => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                size: map.size,
            }),
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.inner.note_io();
        self.inner.read_range(&self.state, offset, buf, None)
    }

    /// Reads as [`Volume::read`] does, except that the whole blocks found in the read cache
    /// are not copied into `buf`: they stay in the cache's memory, held for the caller until
    /// the returned [`HeldBlocks`] is dropped, and `buf` has holes where they go (a server
    /// sends them from where they are; [`HeldBlocks::copy_into`] fills the holes).
    pub fn read_held(&self, offset: u64, buf: &mut [u8]) -> Result<HeldBlocks> {
        self.check_range(offset, buf.len() as u64)?;
        self.inner.note_io();
        let mut held = HeldBlocks::new(&self.inner.read_cache);
        self.inner
            .read_range(&self.state, offset, buf, Some(&mut held))?;
        Ok(held)
    }

    /// Reads as [`Volume::read`] does if that needs no wait for the device: `Ok(true)` when
    /// it read (the data, metadata aside, was in memory: the page cache or the writers'
    /// buffers), `Ok(false)` — `buf` then holds nothing useful — when some record was not in
    /// memory, and the caller should [`Volume::read`] on a thread that may wait. Lets a
    /// server answer cached reads on its connection's task, without a thread hand-off. The
    /// metadata lookups may still read the store's file.
    pub fn read_if_cached(&self, offset: u64, buf: &mut [u8]) -> Result<bool> {
        self.check_range(offset, buf.len() as u64)?;
        self.inner.note_io();
        let _memory_only = crate::segment::NoWaitReads::start();
        match self.inner.read_range(&self.state, offset, buf, None) {
            Ok(()) => Ok(true),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::WouldBlock => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether this handle is a read-only snapshot.
    pub fn read_only(&self) -> bool {
        self.state.read_only
    }

    fn check_writable(&self) -> Result<()> {
        if self.state.read_only {
            return Err(Error::ReadOnly(self.state.name.clone()));
        }
        Ok(())
    }

    /// Whether a write of `len` bytes at `offset`, without FUA, runs without waiting as things
    /// stand: whole 4 KiB blocks (a partial block is read first), at most
    /// [`QUICK_WRITE_BLOCKS_MAX`] of them (larger writes spread their blocks over threads),
    /// and an uncommitted backlog under the throttle (past it, a writer waits for a commit) and
    /// not paced (past the commit threshold, a writer may wait for its slot: `pacer.rs`; with
    /// the cleaner behind, for its slot behind the cleaner: `cleaner_pace.rs`).
    /// Such a write costs CPU only (fingerprint, compression, a copy into a segment buffer),
    /// plus, once per megabyte a writer appends, that buffer's write to its file. A hint for a
    /// caller choosing whether to run the write on a thread that must not block for long:
    /// another writer may fill the backlog meanwhile.
    pub fn write_is_quick(&self, offset: u64, len: u64) -> bool {
        offset.is_multiple_of(BLOCK)
            && len.is_multiple_of(BLOCK)
            && len / BLOCK <= QUICK_WRITE_BLOCKS_MAX
            && self.backlog_is_quick(len / BLOCK)
    }

    fn backlog_is_quick(&self, blocks: u64) -> bool {
        let dirty = self.inner.batches.dirty() + blocks;
        dirty < self.inner.config.dirty_blocks_throttle
            && !self.inner.pacer.as_ref().is_some_and(|p| p.paces(dirty))
            && !self.inner.cleaner_pace.paces(std::time::Instant::now())
    }

    /// Writes `data` at `offset`. With `fua`, the data is durable when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        self.write_checked(offset, data, None, fua)
    }

    /// [`Volume::write`] once the range is checked, with the blocks' fingerprints if known.
    fn write_checked(
        &self,
        offset: u64,
        data: &[u8],
        fps: Option<&[Option<[u8; 32]>]>,
        fua: bool,
    ) -> Result<()> {
        self.inner.check_failed()?;
        self.inner.note_io();
        if !data.is_empty() {
            self.inner.retry_after_commit(|| {
                self.inner.write_range_with(&self.state, offset, data, fps)
            })?;
        }
        self.after_write((data.len() as u64).div_ceil(BLOCK), fua, true)
    }

    /// [`Volume::write`] of whole blocks whose fingerprints the caller has already computed
    /// with [`crate::fingerprint::of_data`] (one per block, `None` for a zero block), so the
    /// engine does not hash them again: a restore that checked its chunks by their blocks'
    /// fingerprints hands them on. A fingerprint that is not its block's would make later
    /// writes of that block share the wrong data: give only what `of_data` computed.
    pub fn write_fingerprinted(
        &self,
        offset: u64,
        data: &[u8],
        fps: &[Option<[u8; 32]>],
        fua: bool,
    ) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        if !offset.is_multiple_of(BLOCK) || data.len() as u64 != fps.len() as u64 * BLOCK {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} and length {} must be whole blocks, one fingerprint each ({} given)",
                data.len(),
                fps.len()
            )));
        }
        debug_assert_eq!(fingerprint::of_data(data), fps, "fingerprints given");
        self.write_checked(offset, data, Some(fps), fua)
    }

    /// The fingerprint of each 4 KiB block of `[offset, offset + len)` (whole blocks), as
    /// [`crate::fingerprint::of_data`] would compute it from the blocks' bytes, taken from the
    /// metadata: `None` for a block that reads as zeros. No data is read, except for a block
    /// whose chunk has no fingerprint stored (freed and swept under a live volume's reader):
    /// that block is read and hashed.
    pub fn block_fingerprints(&self, offset: u64, len: u64) -> Result<Vec<Option<[u8; 32]>>> {
        self.check_range(offset, len)?;
        if !offset.is_multiple_of(BLOCK) || !len.is_multiple_of(BLOCK) {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} and length {len} must be whole blocks"
            )));
        }
        self.inner.note_io();
        let (b0, b1) = (offset / BLOCK, (offset + len) / BLOCK);
        let entries = self.inner.lookup_range(&self.state, b0, b1)?;
        let fingerprints = self.inner.chunk_fingerprints(entries.values().copied())?;
        let mut block = vec![0u8; BLOCK_BYTES];
        (b0..b1)
            .map(|b| {
                let Some(id) = entries.get(&b) else {
                    return Ok(None);
                };
                if let Some(&fp) = fingerprints.get(id) {
                    return Ok(Some(fp));
                }
                self.inner
                    .read_range(&self.state, b * BLOCK, &mut block, None)?;
                Ok((!fingerprint::is_zero(&block)).then(|| fingerprint::of(&block)))
            })
            .collect()
    }

    /// Makes the range read as zeros and releases its space: a metadata operation. The call
    /// costs the range's uncommitted entries, not its length nor its committed data; the
    /// commits after it release the committed blocks' space. This is also unmap, trim and
    /// discard.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        self.inner.check_failed()?;
        self.inner.note_io();
        let end = offset + len;
        let (full0, full1) = (offset.div_ceil(BLOCK), end / BLOCK);
        if full0 >= full1 {
            // Inside one block, or across one block boundary without covering a whole block.
            let zeros = vec![0u8; len as usize];
            self.inner.write_range(&self.state, offset, &zeros)?;
        } else {
            if offset < full0 * BLOCK {
                let zeros = vec![0u8; (full0 * BLOCK - offset) as usize];
                self.inner.write_range(&self.state, offset, &zeros)?;
            }
            self.inner.zero_blocks(&self.state, full0, full1)?;
            if full1 * BLOCK < end {
                let zeros = vec![0u8; (end - full1 * BLOCK) as usize];
                self.inner.write_range(&self.state, full1 * BLOCK, &zeros)?;
            }
        }
        // A metadata operation: one slot, whatever its length.
        self.after_write(1, fua, false)
    }

    /// Backpressure after a write of `blocks` blocks: a FUA write is made durable; otherwise,
    /// past the commit threshold the background commit is woken and the writer waits for its
    /// pacing slot (or, before a commit was measured, for the commit in progress once past the
    /// throttle), and at the hard limit it commits itself. A write of data (`data`, not a
    /// zeroing or a copy) also waits for its slot behind the cleaner when garbage presses on
    /// the pool's room (`cleaner_pace.rs`): the longer of the two waits.
    fn after_write(&self, blocks: u64, fua: bool, data: bool) -> Result<()> {
        if fua {
            return self.inner.flush();
        }
        let behind_cleaner = if data {
            self.inner.cleaner_pace.pace(
                blocks * self.inner.bytes_per_chunk(),
                std::time::Instant::now(),
            )
        } else {
            std::time::Duration::ZERO
        };
        let dirty = self.inner.batches.dirty();
        let max = self.inner.config.dirty_blocks_max;
        if dirty >= max {
            let t0 = std::time::Instant::now();
            self.inner.commit()?;
            let waited = t0.elapsed();
            if waited >= std::time::Duration::from_secs(1) {
                // Every writer that reaches the limit meanwhile waits as long: worth telling.
                tracing::warn!(
                    "a write waited {:.1} s for a commit: {dirty} uncommitted blocks reached \
                     the limit of {max} (commits are falling behind the writes)",
                    waited.as_secs_f64()
                );
            }
        } else if dirty >= self.inner.config.dirty_blocks_commit {
            self.inner.wake_background();
            let paced = self
                .inner
                .pacer
                .as_ref()
                .and_then(|p| p.pace(blocks, dirty, std::time::Instant::now()));
            match paced {
                Some(wait) => {
                    sleep_if_worth(wait.max(behind_cleaner));
                    return Ok(());
                }
                None if dirty >= self.inner.config.dirty_blocks_throttle => {
                    // Wait for the commit in progress (it started with an empty backlog; this
                    // one will be the next): writers then go at the pace of the commits.
                    drop(self.inner.commit.lock());
                }
                None => {}
            }
        }
        sleep_if_worth(behind_cleaner);
        Ok(())
    }

    /// Makes every write acknowledged so far (on any handle of the pool) durable.
    pub fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    /// Extents of data and zeros covering `[offset, offset + len)`, merged and in order.
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.check_range(offset, len)?;
        let end = offset + len;
        if len == 0 {
            return Ok(Vec::new());
        }
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let entries = self.inner.lookup_range(&self.state, b0, b1)?;
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |start: u64, stop: u64, kind: ExtentKind| {
            let (start, stop) = (start.max(offset), stop.min(end));
            if start >= stop {
                return;
            }
            match out.last_mut() {
                Some(last) if last.kind == kind && last.offset + last.length == start => {
                    last.length += stop - start
                }
                _ => out.push(Extent {
                    offset: start,
                    length: stop - start,
                    kind,
                }),
            }
        };
        let mut cursor = b0;
        for &b in entries.keys() {
            push(cursor * BLOCK, b * BLOCK, ExtentKind::Zero);
            push(b * BLOCK, (b + 1) * BLOCK, ExtentKind::Data);
            cursor = b + 1;
        }
        push(cursor * BLOCK, b1 * BLOCK, ExtentKind::Zero);
        Ok(out)
    }

    /// Atomically compares `expected` with the data at `offset` and, if equal, writes `new`
    /// there (SCSI COMPARE AND WRITE). Atomic against every other writer of the volume: no
    /// write to these blocks can land between the compare and the write. Returns `None` when
    /// the write happened, or `Some(i)` with the offset (relative to `offset`) of the first
    /// differing byte, in which case nothing changed.
    pub fn compare_and_write(
        &self,
        offset: u64,
        expected: &[u8],
        new: &[u8],
        fua: bool,
    ) -> Result<Option<u64>> {
        if expected.len() != new.len() {
            return Err(Error::InvalidArgument(
                "compare and write: buffers differ in length".into(),
            ));
        }
        self.check_writable()?;
        self.check_range(offset, new.len() as u64)?;
        self.inner.check_failed()?;
        self.inner.note_io();
        // Nothing is installed unless everything was prepared, so a retry is safe.
        let outcome = self.inner.retry_after_commit(|| {
            self.inner
                .compare_and_write(&self.state, offset, expected, new)
        })?;
        if outcome.is_none() {
            self.after_write((new.len() as u64).div_ceil(BLOCK), fua, true)?;
        }
        Ok(outcome)
    }

    /// Commits the pool's uncommitted changes when they are many (over 16 MiB of blocks,
    /// counting a commit under way, whose end this then waits for). A copy by frames
    /// ([`Volume::copy_from`]) commits its volumes' changes before it applies; after this, that
    /// commit is short. A caller that stops writes to the volumes during copies (the iSCSI
    /// target's EXTENDED COPY) calls this before it stops them, so that the writes wait for
    /// the copy's short commit, not for a backlog of fresh writes.
    pub fn commit_backlog(&self) -> Result<()> {
        if self.inner.batches.uncommitted() > COPY_BACKLOG_BLOCKS {
            self.inner.commit()?;
        }
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_offset` to this volume at `dst_offset`, like
    /// `memmove` (the ranges may overlap when `src` is this volume). Where both offsets have
    /// the same alignment within a 4 KiB block, whole blocks are shared: nothing is read or
    /// written and no space is added (the SCSI EXTENDED COPY case). From
    /// [`crate::PoolConfig::frame_copy_blocks_min`] blocks on, the cost does not depend on the
    /// length (the source's frozen layers are put in this volume's stack, see `copy/`);
    /// shorter copies share each block's reference. Partial blocks at the edges, and ranges
    /// whose alignments differ, are copied as data.
    pub fn copy_from(
        &self,
        src: &Volume,
        src_offset: u64,
        dst_offset: u64,
        len: u64,
    ) -> Result<CopyReport> {
        if !Arc::ptr_eq(&self.inner, &src.inner) {
            return Err(Error::InvalidArgument(
                "copy between volumes of different pools".into(),
            ));
        }
        self.check_writable()?;
        src.check_range(src_offset, len)?;
        self.check_range(dst_offset, len)?;
        self.inner.check_failed()?;
        self.inner.note_io();
        let report = self
            .inner
            .copy_range(&src.state, src_offset, &self.state, dst_offset, len)?;
        self.after_write(1, false, false)?;
        Ok(report)
    }

    /// Like [`Volume::block_status`], but stops after about `max_extents` extents: the cost is
    /// bounded by the extents returned, not by `len`. The extents cover a prefix of the range
    /// (the last one may end early); callers that need more ask again from where it ends.
    /// This is what protocol front ends use: clients ask for block status from every offset
    /// in turn, so an unbounded answer would make a walk over a fragmented volume quadratic.
    pub fn block_status_max(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<Extent>> {
        self.check_range(offset, len)?;
        let end = offset + len;
        let mut out: Vec<Extent> = Vec::new();
        let mut pos = offset;
        let mut window_blocks = 64u64;
        while pos < end && out.len() <= max_extents.max(1) {
            let window_end = end.min(
                (pos / BLOCK)
                    .saturating_add(window_blocks)
                    .saturating_mul(BLOCK),
            );
            for e in self.block_status(pos, window_end - pos)? {
                match out.last_mut() {
                    Some(last) if last.kind == e.kind && last.offset + last.length == e.offset => {
                        last.length += e.length
                    }
                    _ => out.push(e),
                }
            }
            pos = window_end;
            window_blocks = window_blocks.saturating_mul(4);
        }
        out.truncate(max_extents.max(1));
        Ok(out)
    }

    /// Where this volume's space went: walks its committed map (commits first). A block is
    /// exclusive when nothing else can reach its data: its map layer belongs to this volume
    /// alone (not shared with a clone or snapshot) and its chunk has no other reference (no
    /// duplicate elsewhere, no hidden entry in a layer awaiting flattening).
    pub fn space(&self) -> Result<VolumeSpace> {
        self.inner.commit()?;
        self.inner.settle_zeroed(Some(&self.state))?;
        let size = self.size();
        let stack = {
            let map = self.state.map.lock();
            if map.deleted {
                return Err(Error::NotFound(self.state.name.clone()));
            }
            map.stack.clone()
        };
        let txn = self.inner.db.read()?;
        // A frame's layer is shared when another stack, or another frame of this one, shows it.
        let mut shared_frame = Vec::with_capacity(stack.len());
        for f in &stack {
            let in_this_stack = stack.iter().filter(|g| g.layer == f.layer).count() as u64;
            let refs = txn.get(meta::LAYERS, &f.layer)?.unwrap_or(0);
            shared_frame.push(refs > 1 || in_this_stack > 1);
        }
        // Chunk -> (blocks of this volume showing it, whether any is in a shared layer).
        let mut counts: HashMap<u64, (u64, bool)> = HashMap::new();
        let visit = |_b, id, frame: usize| {
            if id == format::ZERO_TOMBSTONE {
                return;
            }
            let c = counts.entry(id).or_default();
            c.0 += 1;
            c.1 |= shared_frame[frame];
        };
        let (filters, blocks) = (&self.inner.layer_filters, size.div_ceil(BLOCK));
        resolve_stored_each(&txn, filters, &stack, 0, blocks, visit)?;
        let mut s = VolumeSpace {
            size_bytes: size,
            distinct_chunks: counts.len() as u64,
            ..Default::default()
        };
        // A chunk's count is its record's plus the deltas logged for it (see `ref_log.rs`).
        let logged = crate::ref_log::pending(&txn)?;
        for (&id, &(n, in_shared_layer)) in &counts {
            let rec = crate::chunk_table::load(&txn, id)?;
            let refs = rec.refs as i64 + logged.get(&id).copied().unwrap_or(0);
            s.mapped_blocks += n;
            if refs == n as i64 && !in_shared_layer {
                s.exclusive_blocks += n;
                s.exclusive_physical_bytes += rec.physical_bytes();
            } else {
                s.shared_blocks += n;
                s.shared_physical_bytes += rec.physical_bytes();
            }
        }
        Ok(s)
    }
}

/// How a copy was carried out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Bytes copied by sharing references (no data read or written, no space added).
    pub shared_bytes: u64,
    /// Bytes copied by reading and writing data (unaligned edges or mismatched alignment).
    pub data_bytes: u64,
}

/// The data writer this thread appends through when it is free: threads spread over the
/// writers (assigned in turn at their first append), and each keeps its own.
fn preferred_writer() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static WRITER: Cell<Option<usize>> = const { Cell::new(None) });
    WRITER.with(|w| match w.get() {
        Some(writer) => writer,
        None => {
            let writer = NEXT.fetch_add(1, Ordering::Relaxed) % DATA_WRITERS;
            w.set(Some(writer));
            writer
        }
    })
}

fn stripe_of(block: u64) -> usize {
    (block % STRIPES as u64) as usize
}

pub(crate) fn shard_of_chunk(id: u64) -> usize {
    (id & ((1 << SHARD_BITS) - 1)) as usize
}

/// Sleeps for `wait` unless it is shorter than a sleep can be ([`crate::pacer::SLEEP_MIN`]; the
/// pacing schedules make up for slots not slept).
fn sleep_if_worth(wait: std::time::Duration) {
    if wait >= crate::pacer::SLEEP_MIN {
        std::thread::sleep(wait);
    }
}
