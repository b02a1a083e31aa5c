//! The background thread (periodic commits, dedup filter growth) and the segment cleaner's
//! thread.
//!
//! The cleaner picks the sealed, fully committed segment with the smallest live fraction,
//! copies its live records to the cleaner's own segment, makes them durable, and queues the
//! move ([`crate::relocations::Relocations`]); the next commit, before its batch, points the chunks at their new
//! places and forgets the old segments in one transaction for every queued move, and deletes
//! their files afterwards. Writers and readers are never stopped: the copy runs without locks,
//! the cleaner never waits for the commit lock, and the transaction only moves chunks still
//! found at their old place (a chunk freed meanwhile simply isn't moved; its copy is dead space
//! in the new segment). Until the move is applied, neither the old segment nor the segments
//! holding the copies may be cleaned (the copies' segments' usage rows do not count them yet).
//!
//! Crash analysis: before the transaction commits, the old segment is intact and referenced;
//! the copies are unreferenced dead space. After it, the copies are durable and referenced; the
//! old file is unreferenced and is deleted at once or at the next open.

use crate::cleaner_pace;
use crate::error::Result;
use crate::format::{self, ChunkRecord, SegmentUsage, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use crate::inner::Inner;
use crate::meta;
use crate::ref_log::FoldRequest;
use crate::relocations::Relocation;
use crate::segment::DATA_WRITERS;
use crate::store::Reader;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Segments the cleaner's thread cleans per round at most (it decides between rounds whether
/// to go on).
const CLEAN_PER_WAKE_MAX: usize = 4;

/// Filesystem room a cleaning pass leaves for metadata beyond the records it copies: it does not
/// start with less.
const CLEAN_ROOM_MIN: u64 = 16 << 20;

/// Cleaned segments whose moves may wait for a commit; the cleaner waits (polling every
/// [`QUEUE_POLL`]) while this many do.
const QUEUED_MAX: usize = 4;
const QUEUE_POLL: Duration = Duration::from_millis(5);

/// Whether the cleaner should skip this wake-up: foreground I/O has paused (`quiet`) or not,
/// the pool is (`full`) or is not past its soft threshold, and garbage presses on the pool's
/// room with `pressure` (`cleaner_pace.rs`). Under steady load garbage grows to
/// [`cleaner_pace::CLEAN_ALWAYS_FROM`], and from there the cleaner runs whatever the load (and
/// writers are paced to it if it falls further behind); when the load pauses it cleans
/// everything eligible.
fn cleaner_waits(quiet: bool, full: bool, pressure: f64) -> bool {
    !quiet && !full && pressure < cleaner_pace::CLEAN_ALWAYS_FROM
}

/// The background thread: commit, settle zeroed ranges and fold the reference log while no
/// I/O runs, flatten layers, grow the dedup filter when outgrown (the cleaner has its own
/// thread: [`cleaner_loop`]).
///
/// It wakes every `interval`, and early when asked ([`Inner::wake_background`]: the backlog
/// reached `dirty_blocks_commit`, the cleaner has moves to apply, ...). A wake-up it was asked
/// for commits; a timed one commits only once `commit_every` has passed since its last commit,
/// or when foreground I/O has paused: under steady small writes each commit then covers more
/// blocks, and the store's pages it rewrites are shared among more of them (commits of ~35 Ki
/// random overwrites of 8 GiB of data rewrote ~1.6 KiB of pages per block, of ~140 Ki
/// ~0.9 KiB: docs/BENCHMARKS.md, "Fewer, larger commits under steady writes").
pub(crate) fn background_loop(
    weak: Weak<Inner>,
    stop: Arc<AtomicBool>,
    interval: Duration,
    commit_every: Duration,
) {
    let mut last_commit = Instant::now();
    loop {
        let woken = {
            let Some(inner) = weak.upgrade() else { return };
            inner.threads.wait(interval, &stop)
        };
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Some(inner) = weak.upgrade() else { return };
        if inner.check_failed().is_err() {
            return;
        }
        match inner.space.fs().release_if_full() {
            Ok(true) => tracing::warn!(
                "pool {}: the filesystem is full; the pool's reserve file was released so that \
                 commits go on (new data gets ENOSPC until space is freed)",
                inner.dir.display()
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!("pool reserve file: {e}"),
        }
        if woken || inner.io_quiet() || last_commit.elapsed() >= commit_every {
            last_commit = Instant::now();
            if let Err(e) = inner.commit() {
                tracing::error!("background commit: {e}");
                continue;
            }
        }
        if inner.io_quiet() && inner.catalog.any_volume(|v| v.map.lock().has_zeroed()) {
            // Zeroed ranges left to settle and no I/O: the next part at once (under load,
            // each commit the writes cause settles a part).
            continue;
        }
        if inner.io_quiet() {
            // No I/O: the next slice of the reference log, and the one after at once (freed
            // space shows within seconds; under load each commit folds a slice).
            match inner.fold_ref_log_with(FoldRequest::Next) {
                Ok(true) => {
                    inner.wake_background();
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!("reference log fold: {e}");
                    continue;
                }
            }
        }
        if let Err(e) = inner.space.fs().restore_reserve_file() {
            tracing::warn!("pool reserve file: {e}");
        }
        if let Err(e) = inner.flatten_all(false, &stop) {
            tracing::error!("flatten volume layers: {e}");
        }
        if let Err(e) = inner.discard_abandoned_layers(&stop, true) {
            tracing::error!("discard abandoned layers: {e}");
        }
        let bloom = inner.dedup.filter();
        if bloom.needs_rebuild(inner.space.live_chunks()) {
            inner.spawn_filter_work(false);
        }
    }
}

/// The cleaner's thread: a round of up to [`CLEAN_PER_WAKE_MAX`] segments every `interval`,
/// and the next round at once while the last one found a full round of work. It runs beside
/// the commits, whose next one applies its moves, so that neither waits for the other
/// (BENCHMARKS.md, "The cleaner's pace"). Woken early only to stop.
pub(crate) fn cleaner_loop(weak: Weak<Inner>, stop: Arc<AtomicBool>, interval: Duration) {
    let mut busy = false;
    loop {
        if !busy {
            std::thread::park_timeout(interval);
        }
        busy = false;
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Some(inner) = weak.upgrade() else { return };
        if inner.check_failed().is_err() {
            return;
        }
        let full = inner.space.soft_warned();
        if cleaner_waits(inner.io_quiet(), full, inner.update_pressure()) {
            continue;
        }
        let mut cleaned = 0;
        while cleaned < CLEAN_PER_WAKE_MAX && !stop.load(Ordering::Acquire) {
            // Under pacing pressure any dead bytes qualify (the emptiest segment first): a
            // segment past the live fraction frees less, but writers wait for what it frees.
            let thorough = inner.cleaner_pace.pressure() >= cleaner_pace::PACE_FROM;
            let t0 = Instant::now();
            match inner.clean_one(thorough, None) {
                Ok(Some(c)) => {
                    cleaned += 1;
                    inner
                        .cleaner_pace
                        .note_pass(c.freed, t0.elapsed(), Instant::now());
                    inner.update_pressure();
                    // The moves wait for a commit: not too many of them.
                    while inner.relocations.queued() >= QUEUED_MAX
                        && !stop.load(Ordering::Acquire)
                        && inner.check_failed().is_ok()
                    {
                        inner.wake_background();
                        std::thread::sleep(QUEUE_POLL);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!("segment cleaner: {e}");
                    break;
                }
            }
        }
        if cleaned > 0 {
            // A commit applies the round's moves (at once on an idle pool).
            inner.wake_background();
        }
        // A full round: more may qualify (the pool is idle, or garbage still presses), so the
        // next round at once; `cleaner_waits` decides again whether it may run.
        busy = cleaned == CLEAN_PER_WAKE_MAX;
    }
}

/// A cleaning pass's outcome.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cleaned {
    /// The segment cleaned.
    pub segment: u64,
    /// Bytes of segment files it gave back (the file, less the live records it moved).
    pub freed: u64,
}

impl Inner {
    /// How long ago the last foreground request ran (since the pool opened, if none has).
    pub(crate) fn since_last_io(&self) -> Duration {
        self.health.since_last_io()
    }

    /// Whether foreground I/O has paused for [`crate::PoolConfig::io_quiet_ms`].
    pub(crate) fn io_quiet(&self) -> bool {
        self.since_last_io() >= Duration::from_millis(self.config.io_quiet_ms)
    }

    /// Segment file bytes that no live record occupies.
    pub(crate) fn garbage_bytes(&self) -> u64 {
        self.segment_file_bytes()
            .saturating_sub(self.space.live_bytes())
    }

    /// Bytes a live chunk takes in its segment on average (a block's record when none is).
    pub(crate) fn bytes_per_chunk(&self) -> u64 {
        let chunks = self.space.live_chunks();
        match chunks {
            0 => (RECORD_HEADER_BYTES + format::BLOCK_BYTES) as u64,
            n => (self.space.live_bytes() / n).max(1),
        }
    }

    /// Works out garbage's pressure on the pool's room (`cleaner_pace.rs`) from the figures
    /// now, sets it for the writers, and returns it.
    pub(crate) fn update_pressure(&self) -> f64 {
        let (_, fs_avail) = self.space.fs().now();
        let fs_room = fs_avail.saturating_sub(self.space.fs().reserve_bytes());
        let (garbage, free) = (self.garbage_bytes(), self.space.free_bytes());
        let p = cleaner_pace::pressure(garbage, free, fs_room);
        let rate = || {
            let r = self.cleaner_pace.freeing_rate().unwrap_or(0.0);
            crate::units::format_size(r as u64)
        };
        match self.cleaner_pace.set_pressure(p) {
            Some(true) => tracing::warn!(
                "pool {}: garbage ({}) outgrows the cleaner (frees {}/s lately) with {} free \
                 and {} on the filesystem beyond its reserve; writes of new data are paced to \
                 the cleaner",
                self.dir.display(),
                crate::units::format_size(garbage),
                rate(),
                crate::units::format_size(free),
                crate::units::format_size(fs_room),
            ),
            Some(false) => tracing::info!(
                "pool {}: the cleaner caught up (garbage {}); writes go unpaced by it",
                self.dir.display(),
                crate::units::format_size(garbage),
            ),
            None => {}
        }
        p
    }

    /// Cleans the emptiest eligible segment (among `only`, if given). With `thorough`, any
    /// segment with dead bytes qualifies; otherwise only those under the configured live
    /// fraction. Returns the segment cleaned and the bytes that gave back, if one was.
    pub(crate) fn clean_one(
        &self,
        thorough: bool,
        only: Option<&HashSet<u64>>,
    ) -> Result<Option<Cleaned>> {
        let _gc = self.gc_lock.lock();
        let committed = self.batches.committed();
        // Passes queue only under `gc_lock`: the set can only shrink meanwhile.
        let busy = self.relocations.busy();
        // Each candidate's live bytes (none without a usage row): one pass over the usage
        // table, not a lookup per segment (a large pool has hundreds of thousands).
        let mut candidates: HashMap<u64, u64> = self
            .segments
            .cleanable(committed)
            .into_iter()
            .filter(|s| only.is_none_or(|o| o.contains(s)))
            .filter(|s| !busy.contains(s))
            .map(|s| (s, 0))
            .collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        {
            let txn = self.db.read()?;
            for row in txn.iter(meta::SEGMENTS)? {
                let (seg, usage) = row?;
                if let Some(live) = candidates.get_mut(&seg) {
                    *live = SegmentUsage::decode(&usage)?.live_bytes;
                }
            }
        }
        let mut best: Option<(u64, u64, u64)> = None; // (segment, live, file bytes)
        for (seg, live) in candidates {
            let file_bytes = self.segments.file_bytes(seg);
            let dead = file_bytes.saturating_sub(live + SEGMENT_HEADER_BYTES);
            let qualifies = if thorough {
                dead > 0 || live == 0
            } else {
                live * 100 < file_bytes * self.config.gc_live_pct_max as u64
            };
            if qualifies && best.is_none_or(|(_, l, f)| live * f < l * file_bytes) {
                best = Some((seg, live, file_bytes));
            }
        }
        let Some((seg, live, file_bytes)) = best else {
            return Ok(None);
        };
        // The pass writes the live records again, and the commit that applies it writes
        // metadata: on a filesystem without room for both (something else filled it), a pass
        // would fail the pool instead of freeing anything.
        self.space.fs().refresh();
        let (_, avail) = self.space.fs().now();
        if avail < live + CLEAN_ROOM_MIN {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        if live == 0 {
            self.drop_segment(seg)?;
        } else {
            self.relocate_segment(seg)?;
        }
        self.event(|| format!("cleaner: segment {seg:#x} ({live} live bytes) queued"));
        tracing::debug!(
            "cleaned segment {seg:#x}: {live} live bytes moved in {:.1} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(Some(Cleaned {
            segment: seg,
            freed: file_bytes.saturating_sub(live),
        }))
    }

    /// Queues segment `seg`'s removal (it holds no live record) for the next commit.
    fn drop_segment(&self, seg: u64) -> Result<()> {
        self.relocations.push(Relocation {
            segment: seg,
            moved: Vec::new(),
        });
        Ok(())
    }

    /// Copies segment `seg`'s live records to the cleaner's writer, makes the copies durable,
    /// and queues the move for the next commit ([`Inner::apply_relocations`]).
    fn relocate_segment(&self, seg: u64) -> Result<()> {
        let Some(bytes) = self.segments.read_all(seg)? else {
            return Ok(());
        };
        format::decode_segment_header(&bytes)?;
        let live = self.live_records(seg, &bytes)?;
        let gc_writer = DATA_WRITERS;
        let mut moved = Vec::with_capacity(live.len());
        for (id, offset, rec) in live {
            let start = offset as usize + RECORD_HEADER_BYTES;
            let payload = &bytes[start..start + rec.stored_len as usize];
            let placed = self.segments.append(gc_writer, id, rec.flags, payload, 0)?;
            debug_assert_eq!(rec.crc, placed.crc);
            moved.push((id, offset, placed.segment, placed.offset));
        }
        self.segments.sync_writer(gc_writer)?;
        self.relocations.push(Relocation {
            segment: seg,
            moved,
        });
        Ok(())
    }

    /// Applies every queued relocation in one transaction (call with the commit lock held):
    /// chunks still at their old place point at their copies, each cleaned segment's usage
    /// row goes, and its file is deleted once the transaction is durable. A chunk freed or
    /// moved meanwhile is left alone (its copy is dead space in the new segment).
    pub(crate) fn apply_relocations(&self) -> Result<()> {
        let queued = self.relocations.take();
        if queued.is_empty() {
            return Ok(());
        }
        self.event(|| {
            let moves: Vec<String> = queued
                .iter()
                .map(|r| {
                    let ids: Vec<String> = r.moved.iter().map(|m| format!("{:#x}", m.0)).collect();
                    format!("{:#x} [{}]", r.segment, ids.join(" "))
                })
                .collect();
            format!("relocations applied: {}", moves.join("; "))
        });
        let applied = self.relocations_txn(&queued).and_then(|()| {
            queued
                .iter()
                .try_for_each(|r| self.segments.remove(r.segment))
        });
        // Only now may their segments be chosen again: the copies' segments count them, the
        // sources are gone (or, after a failure, are still there to be cleaned again).
        self.relocations.applied(&queued);
        applied
    }

    fn relocations_txn(&self, queued: &[Relocation]) -> Result<()> {
        let mut txn = self.db.write()?;
        let mut usage: std::collections::BTreeMap<u64, SegmentUsage> = Default::default();
        let mut chunks = crate::chunk_table::Pages::new();
        for r in queued {
            for &(id, old_offset, segment, offset) in &r.moved {
                let Some(mut rec) = chunks.get(&txn, id)? else {
                    continue;
                };
                let u = match usage.entry(segment) {
                    std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::btree_map::Entry::Vacant(e) => {
                        e.insert(match txn.get(meta::SEGMENTS, &segment)? {
                            Some(v) => SegmentUsage::decode(&v)?,
                            None => SegmentUsage::default(),
                        })
                    }
                };
                u.total_bytes += rec.physical_bytes();
                if rec.segment == r.segment && rec.offset == old_offset {
                    u.live_bytes += rec.physical_bytes();
                    rec.segment = segment;
                    rec.offset = offset;
                    chunks.put(&txn, id, rec)?;
                }
            }
        }
        chunks.write(&mut txn);
        for (s, u) in usage {
            txn.insert(meta::SEGMENTS, &s, u.encode().as_slice());
        }
        for r in queued {
            txn.remove(meta::SEGMENTS, &r.segment);
        }
        txn.commit()
    }

    /// The records of segment `seg` (its file's `bytes`) that their chunks' records still point
    /// at, with the chunk record, each checked against its checksum. The chunk records are read
    /// a page at a time (a segment's records mostly have neighbouring ids), not a B-tree
    /// lookup per record.
    fn live_records(&self, seg: u64, bytes: &[u8]) -> Result<Vec<(u64, u32, ChunkRecord)>> {
        let mut found = Vec::new(); // (chunk id, offset, end)
        let mut pos = SEGMENT_HEADER_BYTES as usize;
        while pos + RECORD_HEADER_BYTES <= bytes.len() {
            let Ok(h) = format::decode_record_header(&bytes[pos..]) else {
                break;
            };
            let end = pos + RECORD_HEADER_BYTES + h.stored_len as usize;
            if end > bytes.len() {
                break;
            }
            found.push((h.chunk_id, pos, end));
            pos = end;
        }
        let mut ids: Vec<u64> = found.iter().map(|&(id, _, _)| id).collect();
        let mut records = HashMap::with_capacity(ids.len());
        crate::chunk_table::get_many(&self.db.read()?, &mut ids, |id, rec| {
            records.insert(id, rec);
        })?;
        let mut out = Vec::new();
        for (id, pos, end) in found {
            let Some(&rec) = records.get(&id) else {
                continue;
            };
            if rec.segment == seg && rec.offset as usize == pos {
                if !format::record_crc_ok(&bytes[pos..end], rec.crc) {
                    return Err(crate::Error::Corrupt(format!(
                        "cleaner: chunk {id:#x} in segment {seg:016x} fails its checksum"
                    )));
                }
                out.push((id, pos as u32, rec));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cleaner waits only while foreground I/O ran lately, while the pool is under its
    /// soft threshold and garbage presses on the pool's room less than `CLEAN_ALWAYS_FROM`.
    #[test]
    fn cleaner_yields_to_io_only_while_garbage_is_small() {
        let gib = 1u64 << 30;
        let p = |garbage, free| cleaner_pace::pressure(garbage, free, u64::MAX);
        assert!(cleaner_waits(false, false, p(0, gib)));
        assert!(cleaner_waits(false, false, p(gib / 4 - 1, gib)));
        // No I/O lately.
        assert!(!cleaner_waits(true, false, p(0, gib)));
        // Past the soft threshold.
        assert!(!cleaner_waits(false, true, p(0, gib)));
        // Too much garbage (a quarter of the free space), or garbage and no free space.
        assert!(!cleaner_waits(false, false, p(gib / 4, gib)));
        assert!(!cleaner_waits(false, false, p(1, 0)));
        // The filesystem's room counts when it is the smaller: a quarter of it is garbage.
        assert!(!cleaner_waits(
            false,
            false,
            cleaner_pace::pressure(gib, 100 * gib, 3 * gib)
        ));
        // An unbounded free space does not overflow.
        assert!(cleaner_waits(false, false, p(u64::MAX / 5, u64::MAX)));
        assert!(!cleaner_waits(false, false, p(u64::MAX / 3, u64::MAX)));
    }
}
