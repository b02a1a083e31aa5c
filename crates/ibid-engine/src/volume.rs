//! A volume handle: block I/O, zeroing, block status.
//!
//! Offsets and lengths are bytes, multiples of 512. Inside, the engine works in 4 KiB blocks:
//! a write that covers part of a block reads the block, patches it and writes it whole, holding
//! the block's stripe lock so concurrent partial writes to one block never lose each other.

use crate::compression;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::format::{self, Frame, BLOCK_BYTES, RECORD_FLAG_LZ4, RECORD_HEADER_BYTES, SECTOR_BYTES};
use crate::journal::Change;
use crate::layer_filter::LayerFilters;
use crate::meta;
use crate::neighbours::Neighbours;
use crate::pool::{
    Entry, Inner, ShardState, VolumeMap, VolumeState, DATA_WRITERS, SHARDS, SHARD_BITS, STRIPES,
};
use crate::segment::NewRecord;
use crate::stack::{Found, Resolved};
use crate::stats::VolumeSpace;
use crate::store::{ReadTxn, Reader};
use parking_lot::MutexGuard;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

const BLOCK: u64 = BLOCK_BYTES as u64;

/// Most commits a write that found no space retries after ([`Inner::retry_after_commit`]).
const RETRIES_AFTER_COMMIT_MAX: usize = 16;
/// Blocks of a write fingerprinted together.
const LANES: u64 = fingerprint::LANES as u64;
/// Times a read retries when the chunk it found was concurrently freed or moved.
const READ_RETRIES_MAX: usize = 8;

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

/// Whole blocks from which one write prepares its blocks on several threads (rayon's pool, one
/// thread per core), when fewer writes than cores are preparing blocks: hashing and compressing
/// a 1 MiB write then uses every core instead of one. With more writes in flight, each stays on
/// its own thread (the cores are busy already, and a hand-off would only add latency).
const PARALLEL_BLOCKS_MIN: u64 = 64;
/// Most blocks of a write [`Volume::write_is_quick`] calls quick: 64 KiB, a few hundred
/// microseconds of fingerprinting and compression at most.
pub const QUICK_WRITE_BLOCKS_MAX: u64 = 16;

/// A fingerprint marked `placing` in its shard: the mark comes off when the chunk is
/// registered ([`PlacingMark::register`]) or, should placing it panic, when this is dropped —
/// a mark left behind would keep every later writer of that block waiting in
/// `lock_settled`, holding the gate, and so stop every commit.
struct PlacingMark<'a> {
    inner: &'a Inner,
    shard: usize,
    fp: [u8; 32],
}

impl<'a> PlacingMark<'a> {
    /// Removes the mark and registers the placed chunk `id` (record `rec`) in the shard, with
    /// `refs` references of the current batch, under one hold of the shard lock.
    fn register(self, id: u64, rec: format::ChunkRecord, refs: i64) {
        let fp = self.fp;
        let mut s = self.clear();
        s.dirty.new_chunks.insert(id, rec);
        s.dirty.fps.insert(fp, id);
        *s.dirty.deltas.entry(id).or_default() += refs;
    }

    /// Removes the mark; returns the shard, still locked.
    fn clear(self) -> MutexGuard<'a, ShardState> {
        let mut s = self.inner.shards[self.shard].lock();
        s.placing.remove(&self.fp);
        std::mem::forget(self);
        s
    }
}

impl Drop for PlacingMark<'_> {
    fn drop(&mut self) {
        self.inner.shards[self.shard]
            .lock()
            .placing
            .remove(&self.fp);
    }
}

/// One write counted in `Inner::preparing` while it prepares blocks (uncounted when dropped,
/// also by a panic).
struct Preparing<'a> {
    counter: &'a std::sync::atomic::AtomicUsize,
    /// Writes preparing, this one included, when it entered.
    count: usize,
}

impl<'a> Preparing<'a> {
    fn enter(counter: &'a std::sync::atomic::AtomicUsize) -> Self {
        let count = counter.fetch_add(1, Ordering::AcqRel) + 1;
        Preparing { counter, count }
    }
}

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The fingerprints of whole blocks (at most [`fingerprint::LANES`]), `None` for an all-zero
/// block (never fingerprinted: it becomes a zero entry).
fn fingerprints(blocks: &[&[u8]]) -> Vec<Option<[u8; 32]>> {
    if let [block] = blocks {
        // One block (a small write): nothing to hash beside it.
        return vec![(!all_zero(block)).then(|| fingerprint::of(block))];
    }
    let zero: Vec<bool> = blocks.iter().map(|b| all_zero(b)).collect();
    if zero.iter().all(|&z| z) {
        return vec![None; blocks.len()];
    }
    let nonzero: Vec<&[u8]> = blocks
        .iter()
        .zip(&zero)
        .filter(|(_, &z)| !z)
        .map(|(b, _)| *b)
        .collect();
    let mut fps = [[0u8; 32]; fingerprint::LANES];
    fingerprint::of_blocks(&nonzero, &mut fps);
    let mut next = fps.into_iter();
    zero.iter()
        .map(|&z| (!z).then(|| next.next().expect("one per nonzero block")))
        .collect()
}

fn all_zero(b: &[u8]) -> bool {
    let (prefix, words, suffix) = unsafe { b.align_to::<u128>() };
    prefix.iter().all(|&x| x == 0)
        && words.iter().all(|&x| x == 0)
        && suffix.iter().all(|&x| x == 0)
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
        self.inner.read_range(&self.state, offset, buf)
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
    /// and an uncommitted backlog under the throttle (past it, a writer waits for a commit).
    /// Such a write costs CPU only (fingerprint, compression, a copy into a segment buffer),
    /// plus, once per megabyte a writer appends, that buffer's write to its file. A hint for a
    /// caller choosing whether to run the write on a thread that must not block for long:
    /// another writer may fill the backlog meanwhile.
    pub fn write_is_quick(&self, offset: u64, len: u64) -> bool {
        offset.is_multiple_of(BLOCK)
            && len.is_multiple_of(BLOCK)
            && len / BLOCK <= QUICK_WRITE_BLOCKS_MAX
            && self.inner.dirty_blocks.load(Ordering::Relaxed) + len / BLOCK
                < self.inner.config.dirty_blocks_throttle
    }

    /// Writes `data` at `offset`. With `fua`, the data is durable when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        self.inner.check_failed()?;
        self.inner.note_io();
        if !data.is_empty() {
            self.inner
                .retry_after_commit(|| self.inner.write_range(&self.state, offset, data))?;
        }
        self.after_write(fua)
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
        self.after_write(fua)
    }

    fn after_write(&self, fua: bool) -> Result<()> {
        if fua {
            return self.inner.flush();
        }
        let dirty = self.inner.dirty_blocks.load(Ordering::Relaxed);
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
            if dirty >= self.inner.config.dirty_blocks_throttle {
                // Wait for the commit in progress (it started with an empty backlog; this
                // one will be the next): writers then go at the pace of the commits.
                drop(self.inner.commit.lock());
            }
        }
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
            self.after_write(fua)?;
        }
        Ok(outcome)
    }

    /// Copies `len` bytes from `src` at `src_offset` to this volume at `dst_offset`, like
    /// `memmove` (the ranges may overlap when `src` is this volume). Where both offsets have
    /// the same alignment within a 4 KiB block, whole blocks are shared: nothing is read or
    /// written and no space is added (the SCSI EXTENDED COPY case). From
    /// [`crate::PoolConfig::frame_copy_blocks_min`] blocks on, the cost does not depend on the
    /// length (the source's frozen layers are put in this volume's stack, see `copy.rs`);
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
        self.after_write(false)?;
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
        let visible = resolve_stored(
            &txn,
            &self.inner.layer_filters,
            &stack,
            0,
            size.div_ceil(BLOCK),
            true,
        )?;
        // Chunk -> (blocks of this volume showing it, whether any is in a shared layer).
        let mut counts: HashMap<u64, (u64, bool)> = HashMap::new();
        for (b, id) in visible.entries {
            if id == format::ZERO_TOMBSTONE {
                continue;
            }
            let shared = shared_frame[visible.frames[&b]];
            let c = counts.entry(id).or_default();
            c.0 += 1;
            c.1 |= shared;
        }
        let mut s = VolumeSpace {
            size_bytes: size,
            distinct_chunks: counts.len() as u64,
            ..Default::default()
        };
        for (&id, &(n, in_shared_layer)) in &counts {
            let rec = crate::chunk_table::load(&txn, id)?;
            s.mapped_blocks += n;
            if rec.refs == n && !in_shared_layer {
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

/// Blocks a metadata copy handles per step (bounds the entries it holds in memory).
const COPY_WINDOW_BLOCKS: u64 = 1 << 20;
/// Bytes a data copy moves per step.
const COPY_DATA_STEP_BYTES: u64 = 1 << 20;

/// One step of a copy: bytes copied as data, or whole blocks shared (by frames, or by
/// reference for small copies).
enum CopyPiece {
    Data { src: u64, dst: u64, len: u64 },
    Share { src: u64, dst: u64, blocks: u64 },
}

/// A new chunk to place: its fingerprint and shard, and its record's flags and payload.
struct NewChunk<'a> {
    fp: [u8; 32],
    shard: usize,
    flags: u16,
    payload: &'a [u8],
}

/// A block prepared for installation in a volume map.
struct Prepared {
    block: u64,
    entry: Entry,
}

impl Prepared {
    /// The chunk this entry references, if any.
    fn data(&self) -> Option<u64> {
        match self.entry {
            Entry::Data(id) => Some(id),
            Entry::Zero => None,
        }
    }
}

impl Inner {
    /// Reads `buf.len()` bytes at `offset` (range already checked). The records of the range's
    /// blocks that lie close together in a segment (data written sequentially, spread over
    /// the segment writers) are read with one read per group; a lone record, or anything
    /// unusual (a chunk gone or moved meanwhile), goes by the block-by-block path with its
    /// retries.
    pub(crate) fn read_range(&self, v: &VolumeState, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset + buf.len() as u64;
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let entries = self.lookup_range(v, b0, b1)?;
        for b in (b0..b1).filter(|b| !entries.contains_key(b)) {
            copy_part(buf, offset, b, None);
        }
        let locations = self.chunk_locations(entries.values().copied())?;
        let mut block = vec![0u8; BLOCK_BYTES];
        let mut lone = Vec::new();
        for group in read_groups(&entries, &locations, &mut lone) {
            let (first, last) = (group[0].2, group[group.len() - 1].2);
            let len = (last.offset as u64 + last.physical_bytes() - first.offset as u64) as usize;
            let Some(bytes) = self.segments.read_span(first.segment, first.offset, len)? else {
                lone.extend(group.iter().map(|&(b, id, _)| (b, id)));
                continue;
            };
            for &(b, id, rec) in &group {
                let at = (rec.offset - first.offset) as usize;
                decode_chunk(
                    id,
                    &rec,
                    &bytes[at..at + rec.physical_bytes() as usize],
                    &mut block,
                )?;
                copy_part(buf, offset, b, Some(&block));
            }
        }
        for (b, chunk) in lone {
            // Located already: one read; the block-by-block path (which looks it up again)
            // only if the chunk was not found or its segment is gone.
            let read = match locations.get(&chunk) {
                Some(rec) => self.read_located(chunk, rec, &mut block)?,
                None => false,
            };
            if !read {
                self.read_block(v, b, chunk, &mut block)?;
            }
            copy_part(buf, offset, b, Some(&block));
        }
        Ok(())
    }

    /// Where each of `ids` is (those found: uncommitted records first, then one read of the
    /// store).
    fn chunk_locations(
        &self,
        ids: impl Iterator<Item = u64>,
    ) -> Result<HashMap<u64, format::ChunkRecord>> {
        let mut out = HashMap::new();
        let mut stored = Vec::new();
        for id in ids {
            match self.uncommitted_location(id) {
                Some(r) => {
                    out.insert(id, r);
                }
                None => stored.push(id),
            }
        }
        if !stored.is_empty() {
            let txn = self.db.read()?;
            for id in stored {
                if let Some(rec) = crate::chunk_table::get(&txn, id)? {
                    out.insert(id, rec);
                }
            }
        }
        Ok(out)
    }

    /// Compare-and-write under the stripe locks of every block it touches.
    fn compare_and_write(
        &self,
        v: &VolumeState,
        offset: u64,
        expected: &[u8],
        new: &[u8],
    ) -> Result<Option<u64>> {
        let end = offset + new.len() as u64;
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let _gate = self.gate.read();
        let mut stripes: Vec<usize> = (b0..b1.min(b0 + STRIPES as u64)).map(stripe_of).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let _guards: Vec<MutexGuard<()>> = stripes.iter().map(|&s| v.stripes[s].lock()).collect();
        let mut current = vec![0u8; ((b1 - b0) * BLOCK) as usize];
        self.read_range(v, b0 * BLOCK, &mut current)?;
        let start = (offset - b0 * BLOCK) as usize;
        let window = &mut current[start..start + new.len()];
        if let Some(i) = window.iter().zip(expected).position(|(a, b)| a != b) {
            return Ok(Some(i as u64));
        }
        window.copy_from_slice(new);
        let stamp = self.cut.load(Ordering::Acquire) + 1;
        let mut prepared = Vec::with_capacity((b1 - b0) as usize);
        for (i, block) in current.chunks(BLOCK_BYTES).enumerate() {
            match self.prepare_block(v, block, stamp, None) {
                Ok(entry) => prepared.push(Prepared {
                    block: b0 + i as u64,
                    entry,
                }),
                Err(e) => {
                    self.release(&prepared.iter().filter_map(|p| p.data()).collect::<Vec<_>>());
                    return Err(e);
                }
            }
        }
        self.install(v, b0, b1, prepared, true)?;
        Ok(None)
    }

    /// Copies a range between (or within) volumes of this pool; see [`Volume::copy_from`].
    fn copy_range(
        &self,
        src: &VolumeState,
        src_off: u64,
        dst: &VolumeState,
        dst_off: u64,
        len: u64,
    ) -> Result<CopyReport> {
        let mut report = CopyReport::default();
        if len == 0 {
            return Ok(report);
        }
        if src_off % BLOCK != dst_off % BLOCK {
            self.copy_data(src, src_off, dst, dst_off, len)?;
            report.data_bytes = len;
            return Ok(report);
        }
        // Same alignment: [head | whole blocks | tail], head and tail partial.
        let head = ((BLOCK - dst_off % BLOCK) % BLOCK).min(len);
        let blocks = (len - head) / BLOCK;
        let tail = len - head - blocks * BLOCK;
        let (sb, db) = ((src_off + head) / BLOCK, (dst_off + head) / BLOCK);
        let mut pieces = Vec::new();
        if head > 0 {
            pieces.push(CopyPiece::Data {
                src: src_off,
                dst: dst_off,
                len: head,
            });
        }
        if blocks > 0 {
            pieces.push(CopyPiece::Share {
                src: sb,
                dst: db,
                blocks,
            });
        }
        if tail > 0 {
            let at = head + blocks * BLOCK;
            pieces.push(CopyPiece::Data {
                src: src_off + at,
                dst: dst_off + at,
                len: tail,
            });
        }
        // memmove order: copying forward within one volume, do the far end first.
        if std::ptr::eq(src, dst) && dst_off > src_off {
            pieces.reverse();
        }
        for piece in pieces {
            match piece {
                CopyPiece::Data {
                    src: s,
                    dst: d,
                    len,
                } => self.copy_data(src, s, dst, d, len)?,
                CopyPiece::Share {
                    src: s,
                    dst: d,
                    blocks,
                } => {
                    let framed = blocks >= self.config.frame_copy_blocks_min
                        && self.copy_by_frames(src, s, dst, d, blocks)?;
                    if !framed {
                        self.share_windows(src, s, dst, d, blocks)?;
                    }
                }
            }
        }
        report.data_bytes = head + tail;
        report.shared_bytes = blocks * BLOCK;
        Ok(report)
    }

    /// Shares `n` blocks in windows of [`COPY_WINDOW_BLOCKS`], in memmove order.
    fn share_windows(
        &self,
        src: &VolumeState,
        sb: u64,
        dst: &VolumeState,
        db: u64,
        n: u64,
    ) -> Result<()> {
        for w in memmove_steps(src, sb, dst, db, n, COPY_WINDOW_BLOCKS) {
            let len = COPY_WINDOW_BLOCKS.min(n - w);
            self.share_blocks(src, sb + w, dst, db + w, len)?;
        }
        Ok(())
    }

    /// Makes `n` blocks of `dst` from `db` reference the chunks of `src` from `sb`: no data I/O.
    /// The source's references are captured, and taken, before the destination changes, so an
    /// overlapping copy within one volume is correct.
    fn share_blocks(
        &self,
        src: &VolumeState,
        sb: u64,
        dst: &VolumeState,
        db: u64,
        n: u64,
    ) -> Result<()> {
        let _gate = self.gate.read();
        let entries = self.lookup_range(src, sb, sb + n)?;
        self.add_refs(entries.values().copied(), 1);
        self.zero_blocks_gated(dst, db, db + n)?;
        let prepared = entries
            .into_iter()
            .map(|(b, id)| Prepared {
                block: b - sb + db,
                entry: Entry::Data(id),
            })
            .collect();
        self.install(dst, db, db + n, prepared, false)
    }

    /// Copies bytes by reading and writing them, in steps, in memmove order.
    fn copy_data(
        &self,
        src: &VolumeState,
        src_off: u64,
        dst: &VolumeState,
        dst_off: u64,
        len: u64,
    ) -> Result<()> {
        let mut buf = Vec::new();
        for at in memmove_steps(src, src_off, dst, dst_off, len, COPY_DATA_STEP_BYTES) {
            let n = COPY_DATA_STEP_BYTES.min(len - at);
            buf.resize(n as usize, 0);
            self.read_range(src, src_off + at, &mut buf)?;
            self.write_range(dst, dst_off + at, &buf)?;
        }
        Ok(())
    }

    /// The data-mapped blocks in `[b0, b1)`: uncommitted changes over the committed map.
    pub(crate) fn lookup_range(
        &self,
        v: &VolumeState,
        b0: u64,
        b1: u64,
    ) -> Result<BTreeMap<u64, u64>> {
        // The stack can change under a reader (a range copy's frames made permanent drop
        // layers); the map's generation moves when it does, and the walk is done again.
        let out = loop {
            let (generation, stack, committing, dirty) = {
                let map = v.map.lock();
                if map.deleted {
                    return Err(Error::NotFound(v.name.clone()));
                }
                // Cheap to hold: the committing overlay is shared, the dirty one is copied
                // only over the range (and only when it changed anything there).
                let dirty = map.dirty.window(b0, b1);
                (
                    map.generation,
                    map.stack.clone(),
                    map.committing.clone(),
                    dirty,
                )
            };
            // A zeroed range hiding the whole window: nothing below it to read.
            let hidden = dirty.covers_all(b0, b1) || committing.covers_all(b0, b1);
            let mut out = if hidden {
                BTreeMap::new()
            } else {
                self.stored_stack(&stack, b0, b1)?
            };
            if v.map.lock().generation == generation {
                out.retain(|_, id| *id != format::ZERO_TOMBSTONE);
                committing.apply_to(b0, b1, &mut out);
                dirty.apply_to(b0, b1, &mut out);
                break out;
            }
        };
        Ok(out)
    }

    /// Committed entries visible through `stack` (top first wins) in `[b0, b1)`, tombstones
    /// included (as [`format::ZERO_TOMBSTONE`]). A block absent from the result reads as zeros.
    pub(crate) fn stored_stack(
        &self,
        stack: &[Frame],
        b0: u64,
        b1: u64,
    ) -> Result<BTreeMap<u64, u64>> {
        if stack.is_empty() {
            return Ok(BTreeMap::new());
        }
        // One read transaction for the whole walk.
        let txn = self.db.read()?;
        Ok(resolve_stored(&txn, &self.layer_filters, stack, b0, b1, false)?.entries)
    }

    /// Reads block `b` (mapped to `chunk` when looked up) into `out`, retrying if the chunk was
    /// concurrently overwritten and freed, or moved by the cleaner.
    pub(crate) fn read_block(
        &self,
        v: &VolumeState,
        b: u64,
        mut chunk: u64,
        out: &mut [u8],
    ) -> Result<()> {
        for _ in 0..READ_RETRIES_MAX {
            match self.read_chunk(chunk, out)? {
                true => return Ok(()),
                false => match self.lookup_range(v, b, b + 1)?.get(&b) {
                    Some(&c) => chunk = c,
                    None => {
                        out.fill(0);
                        return Ok(());
                    }
                },
            }
        }
        Err(Error::Corrupt(format!(
            "block {b} of {}: chunk {chunk:#x} keeps vanishing",
            v.name
        )))
    }

    /// Where a chunk is: uncommitted records first, then the store. `None` if it is gone.
    fn chunk_location(&self, id: u64) -> Result<Option<format::ChunkRecord>> {
        if let Some(r) = self.uncommitted_location(id) {
            return Ok(Some(r));
        }
        crate::chunk_table::get(&self.db.read()?, id)
    }

    /// Where a chunk created since the last commit is (`None` for committed chunks).
    fn uncommitted_location(&self, id: u64) -> Option<format::ChunkRecord> {
        let s = self.shards[shard_of_chunk(id)].lock();
        s.dirty
            .new_chunks
            .get(&id)
            .or_else(|| s.committing.new_chunks.get(&id))
            .copied()
    }

    /// Reads and verifies chunk `id` into `out` (4 KiB). `Ok(false)` if the chunk is gone.
    pub(crate) fn read_chunk(&self, id: u64, out: &mut [u8]) -> Result<bool> {
        match self.chunk_location(id)? {
            Some(rec) => self.read_located(id, &rec, out),
            None => Ok(false),
        }
    }

    /// Reads and verifies chunk `id`, whose record is at `rec`, into `out`. `Ok(false)` if its
    /// segment is gone (cleaned: the caller looks the chunk up again).
    fn read_located(&self, id: u64, rec: &format::ChunkRecord, out: &mut [u8]) -> Result<bool> {
        let Some(raw) = self
            .segments
            .read_record(rec.segment, rec.offset, rec.stored_len)?
        else {
            return Ok(false);
        };
        decode_chunk(id, rec, &raw, out)?;
        Ok(true)
    }

    /// Writes `data` at byte `offset` (512-aligned): partial head and tail blocks first, by
    /// read-modify-write while holding their stripe locks; then the whole blocks, whose stripes
    /// are taken only to install them. Stripes are always taken in ascending order with no
    /// other stripe held, so writers cannot deadlock. The gate is held throughout, so each
    /// block's reference changes land in the same commit batch as its map entry.
    pub(crate) fn write_range(&self, v: &VolumeState, offset: u64, data: &[u8]) -> Result<()> {
        let end = offset + data.len() as u64;
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let mut partial: Vec<u64> = Vec::new();
        if !offset.is_multiple_of(BLOCK) || end < (b0 + 1) * BLOCK {
            partial.push(b0);
        }
        if !end.is_multiple_of(BLOCK) && !partial.contains(&(b1 - 1)) {
            partial.push(b1 - 1);
        }
        let _gate = self.gate.read();
        if !partial.is_empty() {
            let mut stripes: Vec<usize> = partial.iter().map(|&b| stripe_of(b)).collect();
            stripes.sort_unstable();
            stripes.dedup();
            let _guards: Vec<MutexGuard<()>> =
                stripes.iter().map(|&s| v.stripes[s].lock()).collect();
            for &b in &partial {
                let block = self.patched_block(v, b, offset, data)?;
                let stamp = self.cut.load(Ordering::Acquire) + 1;
                let entry = self.prepare_block(v, &block, stamp, None)?;
                self.install(v, b, b + 1, vec![Prepared { block: b, entry }], true)?;
            }
        }
        let (f0, f1) = (offset.div_ceil(BLOCK), end / BLOCK);
        if f0 >= f1 {
            return Ok(());
        }
        let stamp = self.cut.load(Ordering::Acquire) + 1;
        // Small writes look every block up in the index: a neighbourhood scan would cost more
        // than it could spare them.
        let neighbours = (f1 - f0 >= PARALLEL_BLOCKS_MIN).then(|| Neighbours::for_write(f1 - f0));
        let attempts = compression::Attempts::default();
        // Blocks go in groups of `fingerprint::LANES`, fingerprinted together; a group stops
        // at its first failure (the blocks after a failure are only released, below, so the
        // groups after a short one need not line up).
        let prepare_group = |g: usize| {
            let g = g as u64;
            let (lo, hi) = (f0 + g * LANES, (f0 + (g + 1) * LANES).min(f1));
            let blocks: Vec<&[u8]> = (lo..hi)
                .map(|b| {
                    let start = (b * BLOCK - offset) as usize;
                    &data[start..start + BLOCK_BYTES]
                })
                .collect();
            let fps = fingerprints(&blocks);
            self.prepare_group(v, &blocks, &fps, stamp, neighbours.as_ref(), &attempts)
        };
        let groups = (f1 - f0).div_ceil(LANES) as usize;
        let busy = Preparing::enter(&self.preparing);
        let results: Vec<Result<Entry>> =
            if f1 - f0 >= PARALLEL_BLOCKS_MIN && busy.count < self.cores {
                let per_task = (PARALLEL_BLOCKS_MIN / 2 / LANES) as usize;
                let grouped: Vec<Vec<Result<Entry>>> = (0..groups)
                    .into_par_iter()
                    .with_min_len(per_task)
                    .map(prepare_group)
                    .collect();
                grouped.into_iter().flatten().collect()
            } else {
                let mut results = Vec::with_capacity((f1 - f0) as usize);
                for g in 0..groups {
                    let group = prepare_group(g);
                    let failed = group.last().is_some_and(|r| r.is_err());
                    results.extend(group);
                    if failed {
                        break;
                    }
                }
                results
            };
        drop(busy);
        // Install the blocks before the first failure; give back the references the blocks
        // prepared after it (in parallel) took.
        let mut prepared = Vec::with_capacity(results.len());
        let mut failure = None;
        let mut unused = Vec::new();
        for (b, r) in (f0..).zip(results) {
            match (r, &failure) {
                (Ok(entry), None) => prepared.push(Prepared { block: b, entry }),
                (Ok(Entry::Data(id)), Some(_)) => unused.push(id),
                (Ok(Entry::Zero), Some(_)) => {}
                (Err(e), None) => failure = Some(e),
                (Err(_), Some(_)) => {}
            }
        }
        self.release(&unused);
        self.install(v, f0, f1, prepared, false)?;
        failure.map_or(Ok(()), Err)
    }

    /// The current content of block `b` with the part of `data` (written at `offset`) that
    /// falls in it patched in.
    fn patched_block(&self, v: &VolumeState, b: u64, offset: u64, data: &[u8]) -> Result<Vec<u8>> {
        let mut block = vec![0u8; BLOCK_BYTES];
        if let Some(&chunk) = self.lookup_range(v, b, b + 1)?.get(&b) {
            self.read_block(v, b, chunk, &mut block)?;
        }
        let block_start = b * BLOCK;
        let lo = offset.max(block_start);
        let hi = (offset + data.len() as u64).min(block_start + BLOCK);
        block[(lo - block_start) as usize..(hi - block_start) as usize]
            .copy_from_slice(&data[(lo - offset) as usize..(hi - offset) as usize]);
        Ok(block)
    }

    /// Turns one 4 KiB block into a map entry: zero, a reference to an existing chunk with the
    /// same fingerprint, or a new chunk (compressed if that saves space). `neighbours`: the
    /// write's dedup neighbourhood, if it has one.
    fn prepare_block(
        &self,
        v: &VolumeState,
        block: &[u8],
        stamp: u64,
        neighbours: Option<&Neighbours>,
    ) -> Result<Entry> {
        let fp = (!all_zero(block)).then(|| fingerprint::of(block));
        self.prepare_fingerprinted(v, block, fp, stamp, neighbours)
    }

    /// [`Self::prepare_block`] with the block's fingerprint already computed (`None`: the block
    /// is all zero).
    fn prepare_fingerprinted(
        &self,
        v: &VolumeState,
        block: &[u8],
        fp: Option<[u8; 32]>,
        stamp: u64,
        neighbours: Option<&Neighbours>,
    ) -> Result<Entry> {
        let Some(fp) = fp else {
            return Ok(Entry::Zero);
        };
        let shard = fp[0] as usize % SHARDS;
        {
            let mut s = self.lock_settled(shard, &fp);
            if let Some(id) = self.find_duplicate(&s, &fp, neighbours)? {
                *s.dirty.deltas.entry(id).or_default() += 1;
                drop(s);
                if let Some(n) = neighbours {
                    n.load_if_pending(&self.db, &self.frees);
                }
                return Ok(Entry::Data(id));
            }
        }
        compression::with_compressed(block, |compressed| {
            self.store_new_block(v, block, compressed, fp, shard, stamp)
        })
    }

    /// [`Self::prepare_fingerprinted`] for a group of whole blocks (at most
    /// [`fingerprint::LANES`], `fps` as [`fingerprints`] gives them), with the new chunks
    /// among them placed together: one segment append and one journal append for the group,
    /// and one shard lock per block to look it up (it is marked `placing` in the same hold
    /// when nothing matches) and one to register it — instead of a lock of each per block.
    /// Results in block order, ending at the first failure; the blocks after it took no
    /// references (those they took are given back here).
    ///
    /// No deadlock with other writers: while the group holds `placing` marks it never waits for
    /// one. A block another writer is placing is set aside and prepared alone once the group's
    /// own marks are cleared; a block repeating an earlier new block of the group refers to it.
    /// `attempts`: the write's record of how its blocks compressed (which new blocks to try).
    fn prepare_group(
        &self,
        v: &VolumeState,
        blocks: &[&[u8]],
        fps: &[Option<[u8; 32]>],
        stamp: u64,
        neighbours: Option<&Neighbours>,
        attempts: &compression::Attempts,
    ) -> Vec<Result<Entry>> {
        /// What became of one block of the group.
        enum Slot {
            Done(Result<Entry>),
            /// The `i`th new chunk of the group (also for a repeat of its block).
            New(usize),
            /// Another writer was placing this block: prepared alone, after the group's own.
            Later,
        }
        let mut slots: Vec<Slot> = Vec::with_capacity(blocks.len());
        let mut marks: Vec<PlacingMark> = Vec::new();
        // Repeats of each new chunk's block within the group (references to add at its
        // registration).
        let mut repeats: Vec<i64> = Vec::new();
        let mut new_blocks: Vec<usize> = Vec::new();
        for (i, fp) in fps.iter().enumerate() {
            let Some(fp) = *fp else {
                slots.push(Slot::Done(Ok(Entry::Zero)));
                continue;
            };
            if let Some(j) = marks.iter().position(|m| m.fp == fp) {
                repeats[j] += 1;
                slots.push(Slot::New(j));
                continue;
            }
            let shard = fp[0] as usize % SHARDS;
            let mut s = self.shards[shard].lock();
            if s.placing.contains(&fp) {
                slots.push(Slot::Later);
                continue;
            }
            match self.find_duplicate(&s, &fp, neighbours) {
                Ok(Some(id)) => {
                    *s.dirty.deltas.entry(id).or_default() += 1;
                    drop(s);
                    if let Some(n) = neighbours {
                        n.load_if_pending(&self.db, &self.frees);
                    }
                    slots.push(Slot::Done(Ok(Entry::Data(id))));
                }
                Ok(None) => {
                    s.placing.insert(fp);
                    drop(s);
                    marks.push(PlacingMark {
                        inner: self,
                        shard,
                        fp,
                    });
                    repeats.push(1);
                    new_blocks.push(i);
                    slots.push(Slot::New(marks.len() - 1));
                }
                Err(e) => {
                    slots.push(Slot::Done(Err(e)));
                    break;
                }
            }
        }
        let mut placed = Ok(Vec::new());
        if !marks.is_empty() {
            // Compressed forms, back to back in one buffer (the scratch is per call).
            let mut packed: Vec<u8> = Vec::new();
            let forms: Vec<Option<std::ops::Range<usize>>> = new_blocks
                .iter()
                .map(|&i| {
                    attempts.with_compressed(blocks[i], |c| {
                        c.map(|c| {
                            packed.extend_from_slice(c);
                            packed.len() - c.len()..packed.len()
                        })
                    })
                })
                .collect();
            let chunks: Vec<NewChunk> = marks
                .iter()
                .zip(&new_blocks)
                .zip(&forms)
                .map(|((m, &i), form)| {
                    let (flags, payload) = match form {
                        Some(r) => (RECORD_FLAG_LZ4, &packed[r.clone()]),
                        None => (0, blocks[i]),
                    };
                    NewChunk {
                        fp: m.fp,
                        shard: m.shard,
                        flags,
                        payload,
                    }
                })
                .collect();
            placed = self.place_chunks(v, &chunks, stamp);
            let bloom = self.bloom();
            match &placed {
                Ok(chunks) => {
                    for ((mark, &(id, rec)), &refs) in marks.drain(..).zip(chunks).zip(&repeats) {
                        let fp = mark.fp;
                        mark.register(id, rec, refs);
                        bloom.insert(meta::fp_prefix(&fp));
                    }
                }
                // Nothing registered: the marks come off as they drop.
                Err(_) => marks.clear(),
            }
        }
        let (ids, mut place_error): (Vec<u64>, _) = match placed {
            Ok(p) => (p.into_iter().map(|(id, _)| id).collect(), None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let mut results = Vec::with_capacity(slots.len());
        let mut unused = Vec::new();
        let mut failed = false;
        for (i, slot) in slots.into_iter().enumerate() {
            if failed {
                // References taken past the failure are given back.
                match slot {
                    Slot::Done(Ok(Entry::Data(id))) => unused.push(id),
                    Slot::New(j) => unused.extend(ids.get(j)),
                    _ => {}
                }
                continue;
            }
            let r = match slot {
                Slot::Done(r) => r,
                // The first new block reports a failed placement (and ends the group).
                Slot::New(j) => match place_error.take() {
                    Some(e) => Err(e),
                    None => Ok(Entry::Data(ids[j])),
                },
                Slot::Later => self.prepare_fingerprinted(v, blocks[i], fps[i], stamp, neighbours),
            };
            failed = r.is_err();
            results.push(r);
        }
        self.release(&unused);
        results
    }

    /// Locks shard `shard` once no writer is placing a new chunk with fingerprint `fp`.
    /// Waiting is rare (two writers storing the same new block at once): a poll will do.
    fn lock_settled(&self, shard: usize, fp: &[u8; 32]) -> MutexGuard<'_, ShardState> {
        loop {
            let s = self.shards[shard].lock();
            if !s.placing.contains(fp) {
                return s;
            }
            drop(s);
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }

    /// [`Self::prepare_block`] for a block no stored chunk matched (`shard`: its fingerprint's
    /// shard; `compressed`: its LZ4 form when that is smaller): looks again in case another writer stored the
    /// same block meanwhile, and appends it as a new chunk.
    ///
    /// The shard is locked only to decide: the fingerprint is marked `placing` while the record
    /// is appended and journaled without the lock (a segment writer or the journal may be busy,
    /// and every writer whose block falls in the shard would wait behind them), then the chunk
    /// is registered. A writer of the same block meanwhile waits for the registration
    /// ([`Self::lock_settled`]), so its map entry is journaled after the chunk it refers to.
    /// No commit cuts the batch meanwhile: the caller holds the gate.
    fn store_new_block(
        &self,
        v: &VolumeState,
        block: &[u8],
        compressed: Option<&[u8]>,
        fp: [u8; 32],
        shard: usize,
        stamp: u64,
    ) -> Result<Entry> {
        let (flags, payload) = match compressed {
            Some(c) => (RECORD_FLAG_LZ4, c),
            None => (0, block),
        };
        {
            let mut s = self.lock_settled(shard, &fp);
            if let Some(id) = self.find_duplicate(&s, &fp, None)? {
                *s.dirty.deltas.entry(id).or_default() += 1;
                return Ok(Entry::Data(id));
            }
            s.placing.insert(fp);
        }
        let mark = PlacingMark {
            inner: self,
            shard,
            fp,
        };
        let chunk = NewChunk {
            fp,
            shard,
            flags,
            payload,
        };
        // On an error the mark comes off as it drops.
        let (id, rec) = self.place_chunks(v, &[chunk], stamp)?[0];
        mark.register(id, rec, 1);
        self.bloom().insert(meta::fp_prefix(&fp));
        Ok(Entry::Data(id))
    }

    /// Appends new chunks' records to a segment, back to back through one writer, and journals
    /// them; returns their ids and records, in order (not yet registered in their shards: the
    /// caller registers them, and their space stays counted as pending until then).
    fn place_chunks(
        &self,
        v: &VolumeState,
        chunks: &[NewChunk<'_>],
        stamp: u64,
    ) -> Result<Vec<(u64, format::ChunkRecord)>> {
        let physical: u64 = chunks
            .iter()
            .map(|c| (RECORD_HEADER_BYTES + c.payload.len()) as u64)
            .sum();
        let claim = self.reserve_space(physical, v)?;
        let seq = self
            .chunk_seq
            .fetch_add(chunks.len() as u64, Ordering::Relaxed);
        let records: Vec<NewRecord> = (seq..)
            .zip(chunks)
            .map(|(seq, c)| NewRecord {
                chunk_id: (seq << SHARD_BITS) | c.shard as u64,
                flags: c.flags,
                payload: c.payload,
            })
            .collect();
        let placed =
            self.segments
                .append_all(0..DATA_WRITERS, preferred_writer(), &records, stamp)?;
        let placed: Vec<(u64, format::ChunkRecord)> = records
            .iter()
            .zip(chunks)
            .zip(placed)
            .map(|((r, c), at)| {
                let rec = format::ChunkRecord {
                    segment: at.segment,
                    offset: at.offset,
                    stored_len: c.payload.len() as u32,
                    crc: at.crc,
                    flags: c.flags,
                    refs: 0,
                    fingerprint: c.fp,
                };
                (r.chunk_id, rec)
            })
            .collect();
        self.journal.append_chunks(
            stamp,
            (placed.iter().zip(chunks)).map(|(&(id, rec), c)| (id, rec, c.payload)),
        );
        claim.keep();
        Ok(placed)
    }

    /// A live chunk with this fingerprint, if any. Called with the fingerprint's shard locked,
    /// so no commit can free the chunk between this lookup and the caller's reference.
    /// `neighbours` are asked before the index and told what the index found.
    fn find_duplicate(
        &self,
        s: &ShardState,
        fp: &[u8; 32],
        neighbours: Option<&Neighbours>,
    ) -> Result<Option<u64>> {
        if let Some(&id) = s.dirty.fps.get(fp) {
            return Ok(Some(id));
        }
        if s.dead_fps.contains(fp) {
            return Ok(None);
        }
        if let Some(&id) = s.committing.fps.get(fp) {
            return Ok(Some(id));
        }
        // A neighbour is a hint from an earlier snapshot: it counts only if the committed
        // state still holds that chunk with this fingerprint (then its shard is `s`, and no
        // commit frees it while `s` is locked, as for an index hit; one dying in the commit in
        // progress is in `dead_fps`, checked above).
        if let Some((id, frees)) = neighbours.and_then(|n| n.get(fp)) {
            // No chunk freed since the neighbours were read: still stored (see neighbours.rs).
            if frees == self.frees.load(Ordering::Acquire) || self.holds_chunk(id, fp)? {
                return Ok(Some(id));
            }
        }
        if !self.bloom().may_contain(meta::fp_prefix(fp)) {
            return Ok(None);
        }
        // The index gives the chunks whose fingerprint starts like `fp`; the one whose record
        // holds all of `fp` is the duplicate (same snapshot, so it exists; the shard lock
        // keeps it alive, as for a neighbour). The runs are taken before the snapshot (see
        // `dedup_index.rs`).
        let runs = self.dedup_runs();
        let txn = self.db.read()?;
        let mut found = first_holding(&txn, runs.candidates(meta::fp_prefix(fp)).map(Ok), fp)?;
        if found.is_none() {
            let in_tree = txn.range(meta::FPS, meta::fps_range(fp))?;
            found = first_holding(
                &txn,
                in_tree.map(|e| e.map(|(k, ())| meta::fps_key_chunk(k))),
                fp,
            )?;
        }
        if let (Some(n), Some(id)) = (neighbours, found) {
            n.found_in_index(id);
        }
        Ok(found)
    }

    /// Whether the committed state holds chunk `id` with fingerprint `fp`.
    fn holds_chunk(&self, id: u64, fp: &[u8; 32]) -> Result<bool> {
        holds_chunk_in(&self.db.read()?, id, fp)
    }

    /// Installs prepared entries in the volume's map and drops the references they replace.
    /// `stripes_held`: the caller already holds the stripe locks of `[b0, b1)`.
    fn install(
        &self,
        v: &VolumeState,
        b0: u64,
        b1: u64,
        prepared: Vec<Prepared>,
        stripes_held: bool,
    ) -> Result<()> {
        let mut stripes: Vec<usize> = if stripes_held {
            Vec::new()
        } else {
            (b0..b1.min(b0 + STRIPES as u64)).map(stripe_of).collect()
        };
        stripes.sort_unstable();
        stripes.dedup();
        let _guards: Vec<MutexGuard<()>> = stripes.iter().map(|&s| v.stripes[s].lock()).collect();
        let (mut map, stored_top, stored_lower) = match self.lock_map_with_committed(v, b0, b1) {
            Ok(locked) => locked,
            Err(e) => {
                // The entries will never be installed: give back the references they took.
                self.release(
                    &prepared
                        .iter()
                        .filter_map(Prepared::data)
                        .collect::<Vec<_>>(),
                );
                return Err(e);
            }
        };
        let mut released = Vec::new();
        let mut mapped = map.mapped_blocks as i64;
        let mut added = 0u64;
        for p in &prepared {
            // What the top layer holds (its references are ours to drop), and what the volume
            // shows (for the mapped count, and whether a zero must hide a lower layer).
            // A zeroed range in either overlay reads as `Zero` here: it hides the committed
            // entry, whose reference the range's commit drops.
            let top_old = match map
                .dirty
                .get(p.block)
                .or_else(|| map.committing.get(p.block))
            {
                Some(e) => Some(e),
                None => stored_top.get(&p.block).map(|&id| entry_of(id)),
            };
            let visible_old = top_old.unwrap_or_else(|| {
                stored_lower
                    .get(&p.block)
                    .map_or(Entry::Zero, |&id| entry_of(id))
            });
            if let Some(Entry::Data(id)) = top_old {
                released.push(id);
            }
            if let Entry::Data(_) = visible_old {
                mapped -= 1;
            }
            if let Entry::Data(_) = p.entry {
                mapped += 1;
            }
            if visible_old != Entry::Zero || p.entry != Entry::Zero {
                map.dirty.insert(p.block, p.entry);
                added += 1;
            }
        }
        self.note_mapped_change(v, mapped - map.mapped_blocks as i64);
        map.mapped_blocks = mapped as u64;
        // The caller holds the gate, so no cut moves the stamp meanwhile.
        let stamp = self.cut.load(Ordering::Acquire) + 1;
        self.journal.append(
            stamp,
            Change::Install {
                volume: v.id,
                entries: prepared.iter().map(|p| (p.block, p.entry)).collect(),
            },
        );
        drop(map);
        self.dirty_blocks.fetch_add(added, Ordering::Relaxed);
        self.release(&released);
        Ok(())
    }

    /// Runs `op`; if it fails for lack of space, commits (space freed by overwrites, zeroing
    /// and deletes since the last commit is only counted back then) and runs it once more, and
    /// again (up to [`RETRIES_AFTER_COMMIT_MAX`] times) while each commit freed space.
    /// `op` must be safe to repeat after a partial run (a plain write is).
    pub(crate) fn retry_after_commit<T>(&self, op: impl Fn() -> Result<T>) -> Result<T> {
        let mut result = op();
        // Again while the commits free space (what overwrites replaced): other writers may
        // take what one commit freed before this one retries. Bounded, so a pool that fills
        // under a stream of overwrites of shared data still answers `NoSpace`.
        for _ in 0..RETRIES_AFTER_COMMIT_MAX {
            if !matches!(result, Err(Error::NoSpace)) {
                break;
            }
            let before = self.used_now();
            self.commit()?;
            let freed = self.used_now() < before;
            result = op();
            if !freed {
                break;
            }
        }
        result
    }

    /// Replays a journaled chunk: it becomes an uncommitted new chunk again, with no reference
    /// yet (the journaled map entries that use it add theirs).
    pub(crate) fn adopt_chunk(&self, id: u64, rec: format::ChunkRecord) {
        self.chunk_seq
            .fetch_max((id >> SHARD_BITS) + 1, Ordering::Relaxed);
        let mut s = self.shards[shard_of_chunk(id)].lock();
        s.dirty.fps.insert(rec.fingerprint, id);
        s.dirty.new_chunks.insert(id, rec);
        s.dirty.deltas.entry(id).or_default();
        drop(s);
        self.pending_bytes
            .fetch_add(rec.physical_bytes() as i64, Ordering::Relaxed);
        self.bloom().insert(meta::fp_prefix(&rec.fingerprint));
    }

    /// Replays journaled map entries: each data entry takes its reference again, and the
    /// entries are installed as the original write installed them.
    pub(crate) fn replay_install(&self, v: &VolumeState, entries: Vec<(u64, Entry)>) -> Result<()> {
        let (Some(b0), Some(last)) = (
            entries.iter().map(|e| e.0).min(),
            entries.iter().map(|e| e.0).max(),
        ) else {
            return Ok(());
        };
        let _gate = self.gate.read();
        let prepared: Vec<Prepared> = entries
            .into_iter()
            .map(|(block, entry)| Prepared { block, entry })
            .collect();
        self.add_refs(prepared.iter().filter_map(Prepared::data), 1);
        self.install(v, b0, last + 1, prepared, false)
    }

    /// Drops one reference to each chunk (applied at the next commit).
    fn release(&self, ids: &[u64]) {
        self.add_refs(ids.iter().copied(), -1);
    }

    /// Adds `delta` references to each chunk (applied at the next commit).
    fn add_refs(&self, ids: impl IntoIterator<Item = u64>, delta: i64) {
        for id in ids {
            *self.shards[shard_of_chunk(id)]
                .lock()
                .dirty
                .deltas
                .entry(id)
                .or_default() += delta;
        }
    }

    /// Zeroes whole blocks `[b0, b1)`: records the range in the volume's dirty overlay (see
    /// `overlay.rs`). Costs the uncommitted entries inside the range, not its length or its
    /// committed data: the commit drops the committed entries and their references.
    pub(crate) fn zero_blocks(&self, v: &VolumeState, b0: u64, b1: u64) -> Result<()> {
        let _gate = self.gate.read();
        self.zero_blocks_gated(v, b0, b1)
    }

    /// [`Inner::zero_blocks`] for a caller that already holds the gate.
    fn zero_blocks_gated(&self, v: &VolumeState, b0: u64, b1: u64) -> Result<()> {
        if b0 >= b1 {
            return Ok(());
        }
        // Every stripe: no read-modify-write of a partial block in the range is half done.
        let _guards: Vec<MutexGuard<()>> = v.stripes.iter().map(|s| s.lock()).collect();
        let mut map = v.map.lock();
        if map.deleted {
            return Err(Error::NotFound(v.name.clone()));
        }
        // The dirty entries the range replaces: their references are ours to drop and what
        // they showed is known now; the rest of the range is settled by the commit.
        let under = map.committing.clone();
        let removed = map.dirty.zero(b0, b1, &under);
        let mut released = Vec::new();
        for (_, e) in removed {
            if let Entry::Data(id) = e {
                released.push(id);
            }
        }
        let unmapped = released.len() as u64;
        map.mapped_blocks -= unmapped;
        self.note_mapped_change(v, -(unmapped as i64));
        // The caller holds the gate, so no cut moves the stamp meanwhile.
        let stamp = self.cut.load(Ordering::Acquire) + 1;
        self.journal.append(
            stamp,
            Change::Zero {
                volume: v.id,
                b0,
                b1,
            },
        );
        drop(map);
        self.dirty_blocks.fetch_add(1, Ordering::Relaxed);
        self.release(&released);
        if v.format().is_thick() {
            // Its reservation grows back only when the range's blocks are counted: soon.
            self.wake_background();
        }
        Ok(())
    }

    /// `v`'s map, locked, with the committed entries in `[b0, b1)` of its top layer and of the
    /// layers below, read consistently with it: if a commit published between the read and the
    /// lock (the map's generation moved), read again.
    fn lock_map_with_committed<'a>(
        &self,
        v: &'a VolumeState,
        b0: u64,
        b1: u64,
    ) -> Result<LockedMap<'a>> {
        loop {
            let (generation, stack) = {
                let m = v.map.lock();
                (m.generation, m.stack.clone())
            };
            let (top, lower) = stack.split_last().expect("a stack has a layer");
            // One read transaction for the top layer and the frames below it.
            let txn = self.db.read()?;
            let mut stored_top = BTreeMap::new();
            scan_layer(&txn, &self.layer_filters, top.layer, b0, b1, &mut |b, v| {
                stored_top.insert(b, v);
            })?;
            // The layers below matter only where the top has no entry (an overwrite of a
            // block already in the top layer reads nothing below it).
            let stored_lower = if lower.is_empty() || stored_top.len() as u64 == b1 - b0 {
                BTreeMap::new()
            } else {
                resolve_stored(&txn, &self.layer_filters, lower, b0, b1, false)?.entries
            };
            drop(txn);
            let map = v.map.lock();
            if map.deleted {
                return Err(Error::NotFound(v.name.clone()));
            }
            if map.generation == generation {
                return Ok((map, stored_top, stored_lower));
            }
        }
    }
}

/// A volume's locked map with the committed entries of its top layer and of the layers below.
type LockedMap<'a> = (
    MutexGuard<'a, VolumeMap>,
    BTreeMap<u64, u64>,
    BTreeMap<u64, u64>,
);

/// Resolves `[b0, b1)` through `stack` from the committed map in `txn`, skipping the layers
/// whose filters rule the range out.
pub(crate) fn resolve_stored(
    txn: &ReadTxn,
    filters: &LayerFilters,
    stack: &[Frame],
    b0: u64,
    b1: u64,
    track_frames: bool,
) -> Result<Resolved> {
    crate::stack::resolve(stack, b0, b1, track_frames, |layer, s0, s1, found| {
        scan_layer(txn, filters, layer, s0, s1, found)
    })
}

/// Calls `found(block, value)` for `layer`'s committed entries in `[b0, b1)`; reads nothing
/// when the layer's filter rules the range out.
pub(crate) fn scan_layer(
    txn: &ReadTxn,
    filters: &LayerFilters,
    layer: u64,
    b0: u64,
    b1: u64,
    found: &mut Found<'_>,
) -> Result<()> {
    if !filters.may_hold(layer, b0, b1) {
        return Ok(());
    }
    if b1 == b0 + 1 {
        if let Some(v) = txn.get(meta::MAP, &format::map_key(layer, b0))? {
            found(b0, v);
        }
        return Ok(());
    }
    for item in txn.range(
        meta::MAP,
        format::map_key(layer, b0)..format::map_key(layer, b1),
    )? {
        let (k, v) = item?;
        found(format::decode_map_key(&k).1, v);
    }
    Ok(())
}

/// Offsets `0, step, 2 * step, ...` below `len`, in the order a copy of `len` units from
/// `src_at` to `dst_at` must take them: from the far end when copying forward within one
/// volume, so no step overwrites source units a later step still reads.
fn memmove_steps(
    src: &VolumeState,
    src_at: u64,
    dst: &VolumeState,
    dst_at: u64,
    len: u64,
    step: u64,
) -> Vec<u64> {
    let mut steps: Vec<u64> = (0..len).step_by(step as usize).collect();
    if std::ptr::eq(src, dst) && dst_at > src_at {
        steps.reverse();
    }
    steps
}

/// Checks a chunk's record `raw` (header and payload, as found at `rec`) and decodes its
/// 4 KiB block into `out`.
fn decode_chunk(id: u64, rec: &format::ChunkRecord, raw: &[u8], out: &mut [u8]) -> Result<()> {
    let h = format::decode_record_header(raw).map_err(|e| {
        Error::Corrupt(format!(
            "chunk {id:#x} in segment {:016x}: {e}",
            rec.segment
        ))
    })?;
    if h.chunk_id != id
        || h.stored_len != rec.stored_len
        || h.crc != rec.crc
        || !format::record_crc_ok(raw, rec.crc)
    {
        return Err(Error::Corrupt(format!(
            "chunk {id:#x} in segment {:016x} at offset {}: checksum or header mismatch",
            rec.segment, rec.offset
        )));
    }
    let payload = &raw[RECORD_HEADER_BYTES..];
    if rec.flags & RECORD_FLAG_LZ4 != 0 {
        match lz4_flex::block::decompress_into(payload, out) {
            Ok(n) if n == BLOCK_BYTES => Ok(()),
            _ => Err(Error::Corrupt(format!(
                "chunk {id:#x}: bad compressed payload"
            ))),
        }
    } else if payload.len() == BLOCK_BYTES {
        out.copy_from_slice(payload);
        Ok(())
    } else {
        Err(Error::Corrupt(format!(
            "chunk {id:#x}: payload of {} bytes",
            payload.len()
        )))
    }
}

/// Most bytes one grouped read covers.
const READ_SPAN_BYTES_MAX: u64 = 4 << 20;
/// Largest gap between two records that one grouped read still spans (the gap is read and
/// thrown away: other writes' records).
const READ_GAP_BYTES_MAX: u64 = 16 << 10;

/// A block, its chunk and where the chunk's record is.
type Located = (u64, u64, format::ChunkRecord);

/// Groups the mapped blocks of a read by where their records are: each group is two or more
/// records of one segment, in file order, each within [`READ_GAP_BYTES_MAX`] of the previous
/// one, spanning at most [`READ_SPAN_BYTES_MAX`]. Blocks left alone (or whose chunk was not
/// located) go to `lone` as (block, chunk).
fn read_groups(
    entries: &BTreeMap<u64, u64>,
    locations: &HashMap<u64, format::ChunkRecord>,
    lone: &mut Vec<(u64, u64)>,
) -> Vec<Vec<Located>> {
    let mut located: Vec<Located> = Vec::with_capacity(entries.len());
    for (&b, &id) in entries {
        match locations.get(&id) {
            Some(rec) => located.push((b, id, *rec)),
            None => lone.push((b, id)),
        }
    }
    located.sort_unstable_by_key(|&(b, _, rec)| (rec.segment, rec.offset, b));
    let mut groups: Vec<Vec<Located>> = Vec::new();
    let mut current: Vec<Located> = Vec::new();
    for item in located {
        let joins = current.last().is_some_and(|&(_, _, prev)| {
            let first = current[0].2;
            let prev_end = prev.offset as u64 + prev.physical_bytes();
            item.2.segment == prev.segment
                && item.2.offset as u64 >= prev_end
                && item.2.offset as u64 - prev_end <= READ_GAP_BYTES_MAX
                && item.2.offset as u64 + item.2.physical_bytes() - first.offset as u64
                    <= READ_SPAN_BYTES_MAX
        });
        if !joins {
            flush_group(&mut current, &mut groups, lone);
        }
        current.push(item);
    }
    flush_group(&mut current, &mut groups, lone);
    groups
}

/// Ends the group being built: a group of one goes to `lone`.
fn flush_group(
    current: &mut Vec<Located>,
    groups: &mut Vec<Vec<Located>>,
    lone: &mut Vec<(u64, u64)>,
) {
    match current.len() {
        0 => {}
        1 => lone.push((current[0].0, current[0].1)),
        _ => groups.push(std::mem::take(current)),
    }
    current.clear();
}

/// Copies the part of block `b` (`None`: zeros) that falls in the read `[offset, offset +
/// buf.len())` into `buf`.
fn copy_part(buf: &mut [u8], offset: u64, b: u64, block: Option<&[u8]>) {
    let block_start = b * BLOCK;
    let lo = offset.max(block_start);
    let hi = (offset + buf.len() as u64).min(block_start + BLOCK);
    let dst = &mut buf[(lo - offset) as usize..(hi - offset) as usize];
    match block {
        None => dst.fill(0),
        Some(block) => {
            dst.copy_from_slice(&block[(lo - block_start) as usize..(hi - block_start) as usize])
        }
    }
}

/// A committed map value as an entry.
fn entry_of(id: u64) -> Entry {
    if id == format::ZERO_TOMBSTONE {
        Entry::Zero
    } else {
        Entry::Data(id)
    }
}

/// Whether `store` holds chunk `id` with fingerprint `fp`.
fn holds_chunk_in(store: &impl Reader, id: u64, fp: &[u8; 32]) -> Result<bool> {
    Ok(crate::chunk_table::get(store, id)?.is_some_and(|rec| rec.fingerprint == *fp))
}

/// The first of the chunk ids `ids` that `store` holds with fingerprint `fp`.
fn first_holding(
    store: &impl Reader,
    ids: impl Iterator<Item = Result<u64>>,
    fp: &[u8; 32],
) -> Result<Option<u64>> {
    for id in ids {
        let id = id?;
        if holds_chunk_in(store, id, fp)? {
            return Ok(Some(id));
        }
    }
    Ok(None)
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

#[cfg(test)]
mod tests {
    use super::{format, Neighbours, PlacingMark, SHARDS};
    use crate::{Pool, PoolConfig};
    use std::sync::mpsc;
    use std::time::Duration;

    /// A writer that panics while placing a new chunk takes its `placing` mark with it (the
    /// mark's drop), so the next writer of that block does not wait forever; on the normal
    /// path, `clear` removes it and hands back the shard to register the chunk in.
    #[test]
    fn a_placing_mark_does_not_outlive_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = Pool::create(dir.path().join("p"), PoolConfig::default()).expect("create");
        let inner = &*pool.inner;
        let (shard, fp) = (5, [9u8; 32]);
        let place = |panic: bool| {
            inner.shards[shard].lock().placing.insert(fp);
            let mark = PlacingMark { inner, shard, fp };
            assert!(!panic, "placing failed");
            drop(mark.clear());
        };
        place(false);
        assert!(inner.shards[shard].lock().placing.is_empty());
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| place(true)));
        assert!(unwound.is_err());
        assert!(
            inner.shards[shard].lock().placing.is_empty(),
            "the mark survived the panic"
        );
        let (tx, rx) = mpsc::channel();
        let later = pool.inner.clone();
        std::thread::spawn(move || {
            drop(later.lock_settled(shard, &fp));
            tx.send(()).expect("send");
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("a later writer of the block waited");
    }

    /// Past `dirty_blocks_throttle` uncommitted blocks, a writer waits for the commit in
    /// progress (here: the commit lock, held by the test) and goes on as soon as it ends;
    /// below it, writers do not wait.
    #[test]
    fn writers_past_the_throttle_wait_for_the_commit_in_progress() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = PoolConfig {
            capacity_bytes: Some(1 << 30),
            background: false,
            dirty_blocks_commit: 4,
            dirty_blocks_throttle: 8,
            dirty_blocks_max: 1 << 20,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.path().join("pool"), config).expect("create");
        pool.wait_filters_built();
        let vol = pool.create_volume("v", 1 << 20).expect("volume");
        let held = pool.inner.commit.lock();
        // 4 blocks: at the background threshold, under the throttle.
        vol.write(0, &[1u8; 4 * 4096], false)
            .expect("write under the throttle");
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            let vol = &vol;
            s.spawn(move || {
                vol.write(4 * 4096, &[2u8; 8 * 4096], false).expect("write");
                tx.send(()).expect("send");
            });
            assert!(
                rx.recv_timeout(Duration::from_millis(300)).is_err(),
                "a writer past the throttle must wait for the commit in progress"
            );
            drop(held);
            rx.recv_timeout(Duration::from_secs(10))
                .expect("the writer goes on once the commit ends");
        });
        let mut back = vec![0u8; 12 * 4096];
        vol.read(0, &mut back).expect("read");
        assert!(
            back[..4 * 4096].iter().all(|&b| b == 1) && back[4 * 4096..].iter().all(|&b| b == 2)
        );
    }

    /// A pool under `dir` with no background thread (commits by hand), its dedup filter
    /// built, and a 1 MiB volume.
    fn stepped_pool_with_a_volume(dir: &std::path::Path) -> (Pool, super::Volume) {
        let config = PoolConfig {
            capacity_bytes: Some(1 << 30),
            background: false,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.join("pool"), config).expect("create");
        pool.wait_filters_built();
        let vol = pool.create_volume("v", 1 << 20).expect("volume");
        (pool, vol)
    }

    /// `find_duplicate` of `fp` with `near` as the write's neighbours, its shard locked.
    fn find_with(inner: &crate::pool::Inner, fp: &[u8; 32], near: &Neighbours) -> Option<u64> {
        let s = inner.shards[fp[0] as usize % SHARDS].lock();
        inner.find_duplicate(&s, fp, Some(near)).expect("lookup")
    }

    /// A neighbour counts only while the committed state holds that chunk with that
    /// fingerprint: one that died since the neighbours were read, or one listed under another
    /// block's fingerprint, is passed over for the index's answer.
    #[test]
    fn stale_neighbours_are_checked_against_the_committed_chunks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, vol) = stepped_pool_with_a_volume(dir.path());
        let (gone, kept) = ([1u8; 4096], [2u8; 4096]);
        vol.write(0, &gone, false).expect("write");
        vol.write(4096, &kept, false).expect("write");
        vol.write(8192, &[4u8; 4096], false).expect("write");
        pool.sync().expect("commit");
        let inner = &pool.inner;
        let chunk = |b: u64| match inner.lookup_range(&vol.state, b, b + 1).expect("map")[&b] {
            id if id != format::ZERO_TOMBSTONE => id,
            _ => panic!("block {b} holds no data"),
        };
        let (gone_id, kept_id, other_id) = (chunk(0), chunk(1), chunk(2));
        vol.write(0, &[3u8; 4096], false).expect("overwrite");
        pool.sync().expect("commit: the first chunk dies");
        let fp = |b: &[u8]| *blake3::hash(b).as_bytes();
        let (fp_gone, fp_kept) = (fp(&gone), fp(&kept));
        let find = |fp: &[u8; 32], near: &Neighbours| find_with(inner, fp, near);
        let mut near = rustc_hash::FxHashMap::default();
        near.insert(fp_gone, gone_id);
        assert_eq!(
            find(&fp_gone, &Neighbours::loaded(near)),
            None,
            "a dead neighbour"
        );
        let mut near = rustc_hash::FxHashMap::default();
        near.insert(fp_kept, other_id);
        assert_eq!(
            find(&fp_kept, &Neighbours::loaded(near)),
            Some(kept_id),
            "a neighbour under the wrong fingerprint"
        );
        let mut near = rustc_hash::FxHashMap::default();
        near.insert(fp_kept, kept_id);
        assert_eq!(find(&fp_kept, &Neighbours::loaded(near)), Some(kept_id));
    }

    /// Neighbours read by a scan are taken without a re-check only while no commit has freed
    /// a chunk since: one freed after the scan is passed over, one still stored is found.
    #[test]
    fn neighbours_read_before_a_free_are_checked_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, vol) = stepped_pool_with_a_volume(dir.path());
        let (gone, kept) = ([5u8; 4096], [6u8; 4096]);
        vol.write(0, &gone, false).expect("write");
        vol.write(4096, &kept, false).expect("write");
        pool.sync().expect("commit");
        let inner = &pool.inner;
        let chunk = |b: u64| inner.lookup_range(&vol.state, b, b + 1).expect("map")[&b];
        let fp = |b: &[u8]| *blake3::hash(b).as_bytes();
        let (fp_gone, fp_kept) = (fp(&gone), fp(&kept));
        let loaded = || {
            let near = Neighbours::for_write(16);
            near.found_in_index(chunk(0));
            near.load_if_pending(&inner.db, &inner.frees);
            assert_eq!(near.get(&fp_gone).map(|(id, _)| id), Some(chunk(0)));
            near
        };
        let find = |fp: &[u8; 32], near: &Neighbours| find_with(inner, fp, near);
        let near = loaded();
        assert_eq!(
            find(&fp_gone, &near),
            Some(chunk(0)),
            "no free since the scan"
        );
        let near = loaded();
        vol.write(0, &[7u8; 4096], false).expect("overwrite");
        pool.sync().expect("commit: the first chunk dies");
        assert_eq!(
            find(&fp_gone, &near),
            None,
            "a neighbour freed after the scan"
        );
        assert_eq!(find(&fp_kept, &near), Some(chunk(1)));
    }

    /// A write is quick when it is whole blocks, at most `QUICK_WRITE_BLOCKS_MAX` of them, and
    /// keeps the uncommitted backlog under the throttle; a commit makes room again.
    #[test]
    fn quick_writes_are_small_whole_blocks_under_the_throttle() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = PoolConfig {
            capacity_bytes: Some(1 << 30),
            background: false,
            dirty_blocks_commit: 4,
            dirty_blocks_throttle: 32,
            dirty_blocks_max: 1 << 20,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.path().join("pool"), config).expect("create");
        pool.wait_filters_built();
        let vol = pool.create_volume("v", 1 << 20).expect("volume");
        let max = super::QUICK_WRITE_BLOCKS_MAX;
        assert!(vol.write_is_quick(0, 4096));
        assert!(vol.write_is_quick(8192, max * 4096));
        assert!(!vol.write_is_quick(0, (max + 1) * 4096), "too many blocks");
        assert!(!vol.write_is_quick(512, 4096), "not block-aligned");
        assert!(!vol.write_is_quick(0, 512), "a partial block");
        for i in 0..24u8 {
            vol.write(u64::from(i) * 4096, &[i + 1; 4096], false)
                .expect("write");
        }
        assert!(
            vol.write_is_quick(0, 7 * 4096),
            "24 + 7 blocks stay under 32"
        );
        assert!(
            !vol.write_is_quick(0, 8 * 4096),
            "24 + 8 blocks reach the throttle"
        );
        pool.sync().expect("commit");
        assert!(vol.write_is_quick(0, max * 4096));
    }

    /// Zeroing committed data records one range: no map entry and no reference change per
    /// block until the commit, which then unmaps every block and frees every chunk.
    #[test]
    fn zeroing_committed_data_records_one_range() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pool, vol) = stepped_pool_with_a_volume(dir.path());
        let data: Vec<u8> = (0..256u32)
            .flat_map(|b| {
                let mut block = [0u8; 4096];
                block[..4].copy_from_slice(&b.to_le_bytes());
                block[4] = 1;
                block
            })
            .collect();
        vol.write(0, &data, false).expect("write");
        pool.sync().expect("commit");
        vol.write_zeroes(0, 1 << 20, false).expect("zero");
        {
            let map = vol.state().map.lock();
            assert_eq!(map.dirty.all_entries().count(), 0, "entries per block");
            assert_eq!(map.dirty.zeroed().collect::<Vec<_>>(), vec![(0, 256)]);
        }
        let deltas: usize = vol
            .inner
            .shards
            .iter()
            .map(|s| s.lock().dirty.deltas.len())
            .sum();
        assert_eq!(deltas, 0, "reference changes before the commit");
        assert_eq!(
            vol.inner
                .dirty_blocks
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        assert_eq!(vol.mapped_blocks(), 0);
        pool.sync().expect("commit");
        assert_eq!(pool.stats().unique_chunks, 0);
    }
}
