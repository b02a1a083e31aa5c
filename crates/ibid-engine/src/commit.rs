//! The commit: the one place metadata changes become durable.
//!
//! 1. **Cut** (gate held exclusively, microseconds): every volume's and shard's dirty changes
//!    move to their `committing` slot, where readers still see them. Writers hold the gate
//!    shared for a whole write, so a batch holds whole writes: a map entry and the reference
//!    count it adds are always in the same batch.
//! 2. **Data first**: [`crate::segment::Segments::sync`] writes and fsyncs every segment record
//!    appended so far.
//! 3. **One metadata transaction** ([`crate::store`], durable on return): new chunks, dedup index entries,
//!    map entries, reference-count changes to older chunks appended to the log and one slice
//!    of the log folded into their records ([`crate::ref_log`]), chunk deaths, segment usage,
//!    volume records, pool counters.
//! 4. **Publish**: the `committing` slots are emptied; readers now find the data in the store.
//!
//! Crash analysis: before step 3 returns, the store still holds the previous batch and no
//! metadata points at the new records (they are dead space for the cleaner). After it, every
//! record the batch references was already durable (step 2). An error in steps 2–3 fails the
//! pool: it must be reopened, which recovers the last committed state.

use crate::chunk_fps::{self, Stale};
use crate::chunk_table::{self, page_of};
use crate::commit_state::CommitState;
use crate::dedup_index::{IndexUpdate, Runs};
use crate::error::{Error, Result};
use crate::format::{
    self, ChunkRecord, Fingerprint, Frame, NewChunkRecord, SegmentUsage, VolumeRecord,
};
use crate::inner::Inner;
use crate::journal::FlushOutcome;
use crate::layer_filter::LayerFilters;
use crate::map_table;
use crate::meta;
use crate::overlay::{Entry, Overlay};
use crate::ref_log::{self, FoldRequest, RefLog};
use crate::shard::{ShardBatch, SHARDS, SHARD_BITS};
use crate::store::{Reader, WriteTxn};
use crate::volume::shard_of_chunk;
use crate::volume_state::VolumeState;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Blocks of a zeroed range read and settled at a time (at most this many committed entries of
/// the top layer, and as many of the lower frames, are in memory at once).
const SETTLE_WINDOW_BLOCKS: u64 = 256 << 10;

/// One batch cut from the dirty state.
struct Batch {
    /// The cut number: records stamped with it or lower are in this batch or an earlier one.
    no: u64,
    volumes: Vec<(Arc<VolumeState>, Arc<Overlay>, VolumeRecord)>,
    deleted: Vec<Arc<VolumeState>>,
    shards: Vec<Arc<ShardBatch>>,
    new_bytes: u64,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.deleted.is_empty()
            && self.volumes.is_empty()
            && self
                .shards
                .iter()
                .all(|s| s.new_chunks.is_empty() && s.deltas.is_empty())
    }
}

/// A volume's zeroed ranges a commit left for later ones.
type LeftToSettle = (Arc<VolumeState>, Vec<(u64, u64)>);

/// What the transaction changed in the committed counters.
#[derive(Default)]
struct Applied {
    died: Vec<(usize, [u8; 32])>,
    dead_segments: Vec<u64>,
    /// The dedup index's runs after the transaction, if it changed them.
    runs: Option<Runs>,
    /// Volumes whose zeroed ranges unmapped blocks, and how many (see `overlay.rs`).
    unmapped: Vec<(Arc<VolumeState>, u64)>,
    /// Zeroed ranges left for later commits, per volume (also in the `zeroing` table).
    rest: Vec<LeftToSettle>,
    /// The ids of the chunks that died (for the event log).
    freed: Vec<u64>,
    /// Chunks left without a reference but kept for a newer write (for the event log).
    kept: Vec<u64>,
    /// Layers the deleted volumes left in no stack, listed for deletion (for the event log).
    dropped_layers: Vec<u64>,
    /// Stale fingerprints swept (for the event log).
    swept: u64,
}

impl Inner {
    /// Makes every write acknowledged so far durable: a journal flush, or a commit when the
    /// journal cannot take it.
    pub(crate) fn flush(&self) -> Result<()> {
        self.check_failed()?;
        self.note_io();
        match self.journal.flush(&self.segments, &self.batches) {
            Ok(FlushOutcome::Done) => {
                self.event(|| format!("flush: journaled (batch {})", self.batches.stamp()));
                Ok(())
            }
            Ok(FlushOutcome::Filling) => {
                // Journaled; the journal file is filling: the background thread commits now,
                // so that no later flush finds it full and commits on its caller's time.
                self.event(|| {
                    format!(
                        "flush: journaled (batch {}), file filling",
                        self.batches.stamp()
                    )
                });
                self.wake_background();
                Ok(())
            }
            Ok(FlushOutcome::NeedsCommit) => {
                self.event(|| "flush: needs a commit".into());
                self.commit()
            }
            Err(e) => {
                // Changes may have left the pending list without reaching the disk.
                self.fail(&e);
                Err(e)
            }
        }
    }

    /// Commits every change made so far. Concurrent callers queue; each returns after a commit
    /// that started after it was called.
    pub(crate) fn commit(&self) -> Result<()> {
        self.check_failed()?;
        let mut cs = self.commit.lock();
        self.commit_with(&mut cs)?;
        drop(cs);
        self.after_commit();
        Ok(())
    }

    /// Bookkeeping after a commit, outside the commit lock.
    pub(crate) fn after_commit(&self) {
        self.check_soft_threshold();
        let bloom = self.dedup.filter();
        if bloom.needs_rebuild(self.space.live_chunks()) {
            self.wake_background();
        }
    }

    /// Commits with the commit lock already held (`cs` is its guard's content).
    pub(crate) fn commit_with(&self, cs: &mut CommitState) -> Result<()> {
        self.check_failed()?;
        // The cleaner's passes since the last commit (their copies are durable already).
        let moves0 = std::time::Instant::now();
        let written0 = self.db.bytes_written();
        if let Err(e) = self.apply_relocations() {
            self.fail(&e);
            return Err(e);
        }
        let moves = moves0.elapsed();
        let written1 = self.db.bytes_written();
        let batch = self.cut(cs);
        // Orphans are re-checked by every applied batch; an otherwise empty one runs for them.
        let orphans = self.batches.take_orphans();
        let asked = cs.ref_log.take_request();
        let fold_only = asked != FoldRequest::None && cs.ref_log.entries() > 0;
        if batch.is_empty() && !orphans && !fold_only {
            if batch.no >= cs.record.commits + crate::journal::EMPTY_BATCHES_MAX {
                // The batch numbers empty commits used, made durable before the pool record
                // lags too far for the journal's bound (`journal::EMPTY_BATCHES_MAX`).
                if let Err(e) = self.update_pool_record(cs, |r| r.commits = batch.no) {
                    self.fail(&e);
                    return Err(e);
                }
            }
            self.publish(&batch, &Applied::default());
            self.batches.committed_through(batch.no);
            self.journal.forget_through(batch.no);
            return Ok(());
        }
        // The slices of the reference log this commit folds: the next in turn, or what was
        // asked for. When what the log may free could matter (over a quarter of the free
        // space, as 4 KiB blocks), every commit folds its fullest slices, as the cleaner stops
        // yielding at that much garbage.
        let logged_bytes = cs.ref_log.entries() * format::BLOCK_BYTES as u64;
        let fold = cs
            .ref_log
            .slices_to_fold(asked, logged_bytes > self.space.free_bytes() / 4);
        let t0 = std::time::Instant::now();
        let mut record = cs.record.clone();
        // The batch's records must be durable before the transaction that references them
        // commits, not before it is built: the segments sync on a thread of their own
        // meanwhile (hundreds of milliseconds per commit of fresh data on a slow disk).
        let mut waited = std::time::Duration::ZERO;
        let outcome = std::thread::scope(|s| {
            let log = (&mut cs.ref_log, &mut cs.fps_stale, fold.as_slice());
            if !self.config.threads {
                return self.apply(&batch, &mut record, log, || self.segments.sync());
            }
            let syncing = s.spawn(|| self.segments.sync());
            self.apply(&batch, &mut record, log, || {
                let w0 = std::time::Instant::now();
                let synced = syncing.join().unwrap_or_else(|_| {
                    Err(Error::Failed("the segment sync thread panicked".into()))
                });
                waited = w0.elapsed();
                synced
            })
        });
        let mut applied = match outcome {
            Ok(a) => a,
            Err(e) => {
                self.event(|| format!("commit {} failed: {e}", batch.no));
                self.fail(&e);
                return Err(e);
            }
        };
        cs.record = record;
        self.event(|| describe_commit(&batch, &applied, &fold));
        self.after_apply(&mut applied);
        self.space.commit(
            batch.new_bytes,
            cs.record.live_bytes,
            cs.record.live_chunks,
            self.db.disk_bytes() + self.journal.disk_bytes(),
        );
        self.publish(&batch, &applied);
        self.batches.committed_through(batch.no);
        self.journal.forget_through(batch.no);
        let entries = batch.volumes.iter().map(|(_, o, _)| o.len()).sum::<usize>();
        if let Some(pacer) = &self.pacer {
            pacer.note_commit(entries as u64, t0.elapsed());
        }
        let written2 = self.db.bytes_written();
        tracing::debug!(
            "commit {}: {} map entries, {} new chunks, {} chunks freed, {:.1} ms \
             ({:.1} ms of it waiting for the segments' sync), {} KiB to the store; after \
             {:.1} ms and {} KiB applying the cleaner's moves; {} map changes pending",
            batch.no,
            entries,
            batch
                .shards
                .iter()
                .map(|s| s.new_chunks.len())
                .sum::<usize>(),
            applied.died.len(),
            t0.elapsed().as_secs_f64() * 1e3,
            waited.as_secs_f64() * 1e3,
            (written2 - written1) >> 10,
            moves.as_secs_f64() * 1e3,
            (written1 - written0) >> 10,
            self.db.pending_map_changes()
        );
        for seg in applied.dead_segments {
            self.segments.remove(seg)?;
        }
        Ok(())
    }

    /// Changes the committed pool record in a transaction of its own (call with the commit
    /// lock held: `cs` is its content).
    pub(crate) fn update_pool_record(
        &self,
        cs: &mut CommitState,
        change: impl FnOnce(&mut meta::PoolRecord),
    ) -> Result<()> {
        let mut record = cs.record.clone();
        change(&mut record);
        let mut txn = self.db.write()?;
        txn.insert(meta::POOL, meta::POOL_KEY, record.encode().as_slice());
        txn.commit()?;
        cs.record = record;
        Ok(())
    }

    /// What an applied transaction changes in memory before the publish.
    fn after_apply(&self, applied: &mut Applied) {
        if let Some(runs) = applied.runs.take() {
            // Before publishing: see `dedup_index.rs`.
            self.dedup.set_runs(runs);
        }
    }

    fn cut(&self, cs: &CommitState) -> Batch {
        let _gate = self.gate.write();
        let no = self.batches.cut();
        let mut volumes = Vec::new();
        for v in self.catalog.volumes() {
            let mut map = v.map.lock();
            if map.dirty.is_empty() && !map.record_dirty {
                continue;
            }
            let overlay = Arc::new(std::mem::take(&mut map.dirty));
            map.committing = overlay.clone();
            map.record_dirty = false;
            let record = VolumeRecord {
                id: v.id,
                size: map.size,
                mapped_blocks: map.mapped_blocks,
                created_unix_s: v.created_unix_s,
                layers: map.stack.clone(),
                format: v.format(),
            };
            volumes.push((v.clone(), overlay, record));
        }
        let deleted = self.catalog.take_retired(cs);
        let deleted_with_overlays: Vec<Arc<VolumeState>> = deleted
            .into_iter()
            .inspect(|v| {
                let mut map = v.map.lock();
                map.committing = Arc::new(std::mem::take(&mut map.dirty));
            })
            .collect();
        let mut new_bytes = 0u64;
        let shards = self
            .shards
            .iter()
            .map(|s| {
                let mut s = s.lock();
                let next = s.dirty.sized_like();
                let b = Arc::new(std::mem::replace(&mut s.dirty, next));
                new_bytes += b
                    .new_chunks
                    .values()
                    .map(|r| r.rec.physical_bytes())
                    .sum::<u64>();
                s.committing = b.clone();
                b
            })
            .collect();
        Batch {
            no,
            volumes,
            deleted: deleted_with_overlays,
            shards,
            new_bytes,
        }
    }

    fn publish(&self, batch: &Batch, applied: &Applied) {
        for (v, _, _) in &batch.volumes {
            let mut map = v.map.lock();
            map.committing = Arc::new(Overlay::new());
            map.generation += 1;
            // Under the same lock: no reader sees the ranges left neither committing nor dirty.
            if let Some((_, rest)) = applied.rest.iter().find(|(r, _)| Arc::ptr_eq(r, v)) {
                for &(b0, b1) in rest {
                    map.dirty.zero_under(b0, b1);
                }
                self.batches.add_dirty(1);
            }
        }
        if !applied.rest.is_empty() && self.io_quiet() {
            // Settle the rest now, a bounded commit at a time, while nothing else runs (under
            // load the commits the writes cause settle it; see `gc.rs`).
            self.wake_background();
        }
        for (v, unmapped) in &applied.unmapped {
            // The in-memory count kept every change since the cut exact; only the ranges'
            // committed blocks were left to subtract (under the map lock, as every change of
            // a mapped count and its reservation).
            let mut map = v.map.lock();
            map.mapped_blocks -= unmapped;
            // A volume deleted since the cut took its whole share out of the reservations,
            // these blocks included.
            if !map.deleted {
                self.note_mapped_change(v, -(*unmapped as i64));
            }
        }
        for s in &self.shards {
            s.lock().committing = Arc::new(ShardBatch::default());
        }
        if !applied.died.is_empty() {
            // Before any fingerprint leaves `dead_fps`: see `neighbours.rs`.
            self.dedup.note_frees();
        }
        for (shard, fp) in &applied.died {
            self.shards[*shard].lock().dead_fps.remove(fp);
        }
    }

    /// Writes the batch's transaction and commits it once `durable` (which makes the batch's
    /// records durable) has returned.
    fn apply(
        &self,
        batch: &Batch,
        record: &mut meta::PoolRecord,
        (ref_log, stale, fold): (&mut RefLog, &mut Stale, &[usize]),
        durable: impl FnOnce() -> Result<()>,
    ) -> Result<Applied> {
        let mut txn = self.db.write()?;
        let applied = self.apply_tables(&mut txn, batch, record, (ref_log, stale), fold)?;
        record.commits = batch.no;
        // Past every chunk and segment of the batch: they were made before its cut.
        record.next_chunk_seq = self.chunk_seq.load(Ordering::Relaxed);
        record.next_segment_id = self.segments.next_id();
        txn.insert(meta::POOL, meta::POOL_KEY, record.encode().as_slice());
        // The store's own work (redb's B-tree inserts) goes on while the segments sync; the
        // transaction commits once they have.
        txn.commit_after(durable)?;
        Ok(applied)
    }

    fn apply_tables(
        &self,
        txn: &mut WriteTxn,
        batch: &Batch,
        record: &mut meta::PoolRecord,
        (ref_log, stale): (&mut RefLog, &mut Stale),
        fold: &[usize],
    ) -> Result<Applied> {
        let mut usage: BTreeMap<u64, SegmentUsage> = BTreeMap::new();
        let stale_before = stale.total();
        let runs = self.dedup.runs();
        let mut index = IndexUpdate::new(&runs);
        // Sorted by chunk id: the reference count updates then read the chunk pages in key
        // order (ids grow with time, so a copy of data written together reads neighbours).
        // A new chunk's references are counted into its record below, from its shard's deltas
        // (where every change to them is recorded: a chunk id names its fingerprint's shard),
        // so they stay out of this map: a 64 Ki-block commit of new data otherwise inserted
        // and removed each one (a tenth of the commit thread).
        let mut deltas: BTreeMap<u64, i64> = BTreeMap::new();
        for shard in &batch.shards {
            for (&id, &d) in &shard.deltas {
                if !shard.new_chunks.contains_key(&id) {
                    *deltas.entry(id).or_default() += d;
                }
            }
        }
        // Chunks no longer referenced, to free unless something still or again refers to them,
        // with their records when already at hand (a dying chunk's record is not written back,
        // only removed).
        let mut zero_refs: Vec<(u64, Option<ChunkRecord>)> = Vec::new();
        // Every chunk record this commit reads or changes goes through here, a page at a time.
        let mut chunks = chunk_table::Pages::new();
        // In id order across the shards, so each record appends to its page.
        let mut new_chunks: Vec<(u64, &NewChunkRecord, &ShardBatch)> = batch
            .shards
            .iter()
            .flat_map(|shard| {
                shard
                    .new_chunks
                    .iter()
                    .map(move |(&id, rec)| (id, rec, &**shard))
            })
            .collect();
        new_chunks.sort_unstable_by_key(|&(id, _, _)| id);
        let mut new_fps = Vec::with_capacity(new_chunks.len());
        for (id, new, shard) in new_chunks {
            // A new chunk is stored with its references already counted (no second
            // lookup and rewrite of its record below).
            let refs = shard.deltas.get(&id).copied().unwrap_or(0);
            if refs < 0 {
                return Err(Error::Corrupt(format!(
                    "new chunk {id:#x} would have {refs} references"
                )));
            }
            let rec = ChunkRecord {
                refs: refs as u64,
                ..new.rec
            };
            chunks.put(txn, id, rec)?;
            index.add(meta::fps_key(&new.fingerprint, id));
            new_fps.push((id, new.fingerprint));
            let u = segment_usage(&mut usage, txn, rec.segment)?;
            u.total_bytes += rec.physical_bytes();
            u.live_bytes += rec.physical_bytes();
            record.live_chunks += 1;
            record.live_bytes += rec.physical_bytes();
            if refs == 0 {
                // Written, then overwritten before this commit: never referenced.
                zero_refs.push((id, Some(rec)));
            }
        }
        chunk_fps::add(txn, &new_fps)?;
        let mut applied = Applied::default();
        let mut budget = self.config.zero_settle_entries_max.max(1);
        for (v, overlay, vrec) in &batch.volumes {
            let (unmapped, rest) =
                self.write_overlay(txn, &vrec.layers, overlay, &mut deltas, &mut budget)?;
            // The record was cut with the mapped count its zeroed ranges had not settled yet.
            let mapped_blocks = vrec.mapped_blocks.checked_sub(unmapped).ok_or_else(|| {
                Error::Corrupt(format!(
                    "{}: zeroing would unmap {unmapped} of {} mapped blocks",
                    v.name, vrec.mapped_blocks
                ))
            })?;
            let vrec = VolumeRecord {
                mapped_blocks,
                ..vrec.clone()
            };
            txn.insert(meta::VOLUMES, v.name.as_str(), vrec.encode().as_slice());
            if unmapped > 0 {
                applied.unmapped.push((v.clone(), unmapped));
            }
            if !rest.is_empty() {
                txn.insert(meta::ZEROING, &v.id, meta::encode_ranges(&rest).as_slice());
                applied.rest.push((v.clone(), rest));
            } else if overlay.has_zeroed() {
                txn.remove(meta::ZEROING, &v.id);
            }
        }
        for v in &batch.deleted {
            let (stack, committing) = {
                let m = v.map.lock();
                (m.stack.clone(), m.committing.clone())
            };
            // A top layer only this stack shows is dropped below, and its entries deleted in
            // the background's steps, each dropping its reference: its zeroed ranges need not
            // settle here (which would cost their committed entries, unbounded). With no
            // budget, only the blocks the overlay has entries for or settled are settled (see
            // `write_overlay`): the rest keep their entries, whose references the discard
            // drops once, as the settlement would have.
            let top = stack.last().expect("a stack has a layer").layer;
            let private = stack.iter().filter(|f| f.layer == top).count() == 1
                && txn.get(meta::LAYERS, &top)? == Some(1);
            let mut budget = if private { 0 } else { u64::MAX };
            self.write_overlay(txn, &stack, &committing, &mut deltas, &mut budget)?;
            txn.remove(meta::ZEROING, &v.id);
            let dropped =
                drop_layer_refs(txn, &self.layer_filters, format::referenced_layers(&stack))?;
            applied.dropped_layers.extend(dropped);
            if v.read_only {
                txn.remove(meta::SNAPSHOTS, v.name.as_str());
            } else {
                txn.remove(meta::VOLUMES, v.name.as_str());
            }
        }
        // Only ids in this set get an orphan delete: in an LSM store a delete of an absent key
        // still writes a tombstone, which this very scan would then wade through every commit.
        let orphan_ids: HashSet<u64> = txn
            .iter(meta::ORPHANS)?
            .into_iter()
            .map(|(k, ())| k)
            .collect();
        // The batch's reference changes to committed chunks go to the log, but for the slices
        // folded now: those are added up with what the log holds for them and applied (see
        // `ref_log.rs`). A chunk, and so an orphan, is decided only when its slice is folded.
        let mut by_slice = ref_log::by_slice(&deltas);
        drop(deltas);
        for &slice in fold {
            let mut sums = std::mem::take(&mut by_slice[slice]);
            ref_log.take(txn, slice, &mut sums)?;
            for (&id, &d) in &sums {
                if d == 0 {
                    continue;
                }
                let rec = add_refs(&mut chunks, txn, id, d)?;
                if rec.refs == 0 {
                    zero_refs.push((id, Some(rec)));
                } else {
                    chunks.put(txn, id, rec)?;
                    if orphan_ids.contains(&id) {
                        txn.remove(meta::ORPHANS, &id);
                    }
                }
            }
            zero_refs.extend(
                orphan_ids
                    .iter()
                    .copied()
                    .filter(|&id| {
                        ref_log::slice_of(id) == slice && sums.get(&id).is_none_or(|&d| d == 0)
                    })
                    .map(|id| (id, None)),
            );
        }
        ref_log.append(txn, &by_slice);
        // The chunks left without a reference, with their records.
        let mut unreferenced = Vec::with_capacity(zero_refs.len());
        for (id, known) in zero_refs {
            let stored = known.is_none();
            let rec = match known {
                Some(rec) => rec,
                None => load_chunk(&mut chunks, txn, id)?,
            };
            if rec.refs > 0 {
                if orphan_ids.contains(&id) {
                    txn.remove(meta::ORPHANS, &id);
                }
                continue;
            }
            unreferenced.push((id, rec, stored));
        }
        // Their fingerprints (a dying chunk's dedup key): a new chunk's from the batch, the
        // others' from the store.
        let mut fps: FxHashMap<u64, Fingerprint> = FxHashMap::default();
        let mut stored_ids: Vec<u64> = Vec::new();
        for &(id, _, _) in &unreferenced {
            match batch.shards[shard_of_chunk(id)].new_chunks.get(&id) {
                Some(new) => {
                    fps.insert(id, new.fingerprint);
                }
                None => stored_ids.push(id),
            }
        }
        chunk_fps::get_many(txn, &mut stored_ids, |id, fp| {
            fps.insert(id, fp);
        })?;
        let fp_of = |id: u64| {
            fps.get(&id)
                .copied()
                .ok_or_else(|| Error::Corrupt(format!("chunk {id:#x} has no fingerprint")))
        };
        // Which of them die: each shard locked once for all of its chunks. A chunk that a
        // newer, uncommitted write references again is kept (with no reference) until that
        // commits; one that dies has its fingerprint marked dead under the same lock.
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); SHARDS];
        for (i, &(id, _, _)) in unreferenced.iter().enumerate() {
            by_shard[(id & ((1 << SHARD_BITS) - 1)) as usize].push(i);
        }
        let mut kept = vec![false; unreferenced.len()];
        for (shard, chunks_of) in by_shard.iter().enumerate() {
            if chunks_of.is_empty() {
                continue;
            }
            let mut s = self.shards[shard].lock();
            for &i in chunks_of {
                let (id, _, _) = &unreferenced[i];
                if s.dirty.deltas.get(id).is_some_and(|&d| d != 0) {
                    kept[i] = true;
                } else {
                    s.dead_fps.insert(fp_of(*id)?);
                }
            }
        }
        for ((id, rec, stored), kept) in unreferenced.into_iter().zip(kept) {
            let shard = (id & ((1 << SHARD_BITS) - 1)) as usize;
            if kept {
                if !stored {
                    chunks.put(txn, id, rec)?;
                }
                txn.insert(meta::ORPHANS, &id, &());
                applied.kept.push(id);
                continue;
            }
            if orphan_ids.contains(&id) {
                txn.remove(meta::ORPHANS, &id);
            }
            chunks.remove(txn, id)?;
            // Its fingerprint stays in `chunk.fps`, stale, until its slice is swept.
            stale.died(id);
            let fp = fp_of(id)?;
            let new = batch.shards[shard].new_chunks.contains_key(&id);
            index.remove(meta::fps_key(&fp, id), new);
            let u = segment_usage(&mut usage, txn, rec.segment)?;
            u.live_bytes -= rec.physical_bytes().min(u.live_bytes);
            record.live_chunks -= 1;
            record.live_bytes -= rec.physical_bytes();
            applied.died.push((shard, fp));
            applied.freed.push(id);
        }
        chunks.write(txn);
        // Slices folded now with as many stale fingerprints as a slice's share of the live
        // chunks are swept (`chunk_fps.rs`), against the records as this transaction leaves
        // them.
        let end = page_of(self.chunk_seq.load(Ordering::Relaxed) << SHARD_BITS);
        for &slice in fold {
            if stale.due(slice, record.live_chunks) {
                applied.swept += chunk_fps::sweep(txn, slice, end)?;
                stale.swept(slice);
            }
        }
        if stale.total() != stale_before || applied.swept > 0 {
            stale.write(txn);
        }
        applied.runs = index.finish(txn, batch.no, self.run_policy())?;
        for (seg, u) in usage {
            if u.live_bytes == 0 && self.segments.fully_committed(seg, batch.no) {
                txn.remove(meta::SEGMENTS, &seg);
                applied.dead_segments.push(seg);
            } else {
                txn.insert(meta::SEGMENTS, &seg, u.encode().as_slice());
            }
        }
        Ok(applied)
    }
}

/// Drops one stack reference from each of `layers` (once per occurrence); a layer no stack
/// includes any more has its filter forgotten and is listed for the background to delete its
/// entries, and drop their chunk references, in bounded steps (`copy/layer_build.rs`): the
/// transaction does not grow with the layer. Returns the layers dropped.
pub(crate) fn drop_layer_refs(
    txn: &mut WriteTxn,
    filters: &LayerFilters,
    layers: impl IntoIterator<Item = u64>,
) -> Result<Vec<u64>> {
    let mut dropped = Vec::new();
    for layer in layers {
        let refs = txn.get(meta::LAYERS, &layer)?.unwrap_or(0);
        if refs > 1 {
            txn.insert(meta::LAYERS, &layer, &(refs - 1));
            continue;
        }
        txn.remove(meta::LAYERS, &layer);
        filters.forget(layer);
        crate::copy::layer_build::list_dropped(txn, layer)?;
        dropped.push(layer);
    }
    Ok(dropped)
}

/// A committed chunk's record with `delta` added to its reference count (not written back).
fn add_refs(
    chunks: &mut chunk_table::Pages,
    txn: &WriteTxn,
    id: u64,
    delta: i64,
) -> Result<ChunkRecord> {
    let mut rec = load_chunk(chunks, txn, id)?;
    let refs = rec.refs as i64 + delta;
    if refs < 0 {
        return Err(Error::Corrupt(format!(
            "chunk {id:#x} refcount would go below zero ({refs})"
        )));
    }
    rec.refs = refs as u64;
    Ok(rec)
}

impl Inner {
    /// Writes a volume's changes into its top layer. Returns how many blocks its zeroed
    /// ranges unmapped beyond what the overlay already counted (see `overlay.rs`), and the
    /// ranges left for later commits once `budget` is spent (one unit per window and per
    /// committed entry read; the ranges left exclude the blocks this overlay has entries for:
    /// those entries are newer and stay).
    ///
    /// A zeroed range, a window at a time, removes the top layer's committed entries inside
    /// it (a data entry's reference goes to `deltas`, unless settled) and puts tombstones where
    /// the lower frames show data; then the entries are written: a zeroed block is removed
    /// when nothing lies below the top layer, and becomes a tombstone hiding the lower layers
    /// otherwise. The layer's filter learns the new entries first (they become visible when
    /// `txn` commits).
    fn write_overlay(
        &self,
        txn: &mut WriteTxn,
        stack: &[Frame],
        overlay: &Overlay,
        deltas: &mut BTreeMap<u64, i64>,
        budget: &mut u64,
    ) -> Result<(u64, Vec<(u64, u64)>)> {
        let (top, lower) = stack.split_last().expect("a stack has a layer");
        let top = top.layer;
        let tombstones = !lower.is_empty();
        let mut unmapped = 0u64;
        let mut hide = Vec::new();
        let mut rest: Vec<(u64, u64)> = Vec::new();
        let window = SETTLE_WINDOW_BLOCKS.min(self.config.zero_settle_entries_max.max(1));
        // This transaction holds the store's writer lock and has not touched this layer's
        // entries: a read snapshot shows them as it does (frozen lower layers change in no
        // transaction while this volume's stack shows them).
        let read = if overlay.has_zeroed() {
            Some(self.db.read()?)
        } else {
            None
        };
        let mut map = map_table::Changes::new();
        let mut span = Span {
            top,
            lower,
            overlay,
            deltas,
            hide: &mut hide,
            unmapped: &mut unmapped,
            map: &mut map,
        };
        for (b0, b1) in overlay.zeroed() {
            let read = read.as_ref().expect("opened when there are ranges");
            let mut w0 = b0;
            while w0 < b1 {
                if *budget == 0 {
                    rest.push((w0, b1));
                    break;
                }
                let w1 = b1.min(w0.saturating_add(window));
                // A window costs one unit even when it finds nothing, so a range over an
                // empty petabyte also settles in a bounded number of commits (64 at the
                // defaults).
                let found = span.settle(self, read, w0, w1)?;
                *budget = budget.saturating_sub(1 + found);
                w0 = w1;
            }
        }
        if !rest.is_empty() {
            // The blocks of what is left that this overlay has entries for, or settled: done
            // here, since the transactions that settle the rest will not know them (an entry
            // is newer than the range and is written below; a settled block's reference was
            // dropped and its block counted when an entry replaced it).
            let read = read.as_ref().expect("opened when there are ranges");
            let now: BTreeSet<u64> = overlay
                .settled_in(&rest)
                .chain(
                    rest.iter()
                        .flat_map(|&(s, e)| overlay.entries(s, e).map(|(b, _)| b)),
                )
                .collect();
            for &b in &now {
                span.settle(self, read, b, b + 1)?;
            }
            rest = without_blocks(&rest, &now);
        }
        self.layer_filters.grow(
            top,
            hide.iter().copied().chain(
                overlay
                    .all_entries()
                    .filter(|(_, e)| tombstones || *e != Entry::Zero)
                    .map(|(b, _)| b),
            ),
        );
        for b in hide {
            map.set(top, b, format::ZERO_TOMBSTONE);
        }
        for (block, entry) in overlay.all_entries() {
            match entry {
                Entry::Data(id) => map.set(top, block, id),
                Entry::Zero if tombstones => map.set(top, block, format::ZERO_TOMBSTONE),
                Entry::Zero => map.remove(top, block),
            }
        }
        map.write(txn)?;
        Ok((unmapped, rest))
    }
}

/// Settles zeroed blocks of one volume's top layer inside a commit transaction.
struct Span<'a> {
    top: u64,
    lower: &'a [Frame],
    overlay: &'a Overlay,
    deltas: &'a mut BTreeMap<u64, i64>,
    /// Blocks that need a tombstone (the lower frames show data there).
    hide: &'a mut Vec<u64>,
    /// Blocks that stopped showing data and were not counted yet.
    unmapped: &'a mut u64,
    /// The top layer's entries removed.
    map: &'a mut map_table::Changes,
}

impl Span<'_> {
    /// Settles `[w0, w1)`: removes the top layer's committed entries (dropping the references
    /// of data entries and counting their blocks, unless settled), marks for a tombstone each
    /// block the lower frames show data in (counted where the top had nothing and the block is
    /// not settled). `read` shows the committed state this transaction started from. Returns
    /// the committed entries read.
    fn settle(
        &mut self,
        inner: &Inner,
        read: &crate::store::ReadTxn,
        w0: u64,
        w1: u64,
    ) -> Result<u64> {
        let mut removed: Vec<(u64, u64)> = Vec::new();
        crate::volume::scan_layer(read, &inner.layer_filters, self.top, w0, w1, &mut |b, v| {
            removed.push((b, v))
        })?;
        let mut found = removed.len() as u64;
        let mut top_had = HashSet::with_capacity(removed.len());
        for (b, chunk) in removed {
            self.map.remove(self.top, b);
            top_had.insert(b);
            if chunk != format::ZERO_TOMBSTONE && !self.overlay.settled(b) {
                *self.deltas.entry(chunk).or_default() -= 1;
                *self.unmapped += 1;
            }
        }
        if !self.lower.is_empty() {
            let below = crate::volume::resolve_stored(
                read,
                &inner.layer_filters,
                self.lower,
                w0,
                w1,
                false,
            )?;
            found += below.entries.len() as u64;
            for (b, id) in below.entries {
                if id == format::ZERO_TOMBSTONE {
                    continue;
                }
                self.hide.push(b);
                if !top_had.contains(&b) && !self.overlay.settled(b) {
                    *self.unmapped += 1;
                }
            }
        }
        Ok(found)
    }
}

/// One line for the event log: what a commit changed.
fn describe_commit(batch: &Batch, applied: &Applied, fold: &[usize]) -> String {
    use std::fmt::Write;
    let mut line = format!("commit {}:", batch.no);
    for (v, overlay, rec) in &batch.volumes {
        let _ = write!(
            line,
            " {} {} entries {}",
            v.name,
            format::describe_stack(&rec.layers),
            crate::event_log::block_runs(overlay.all_entries().map(|(b, _)| b))
        );
        let zeroed: Vec<(u64, u64)> = overlay.zeroed().collect();
        if !zeroed.is_empty() {
            let _ = write!(line, " zeroed {zeroed:?}");
        }
        if let Some((_, rest)) = applied.rest.iter().find(|(r, _)| Arc::ptr_eq(r, v)) {
            let _ = write!(line, " left {rest:?}");
        }
        line.push(';');
    }
    for v in &batch.deleted {
        let _ = write!(line, " deleted {};", v.name);
    }
    if !applied.dropped_layers.is_empty() {
        let _ = write!(line, " layers dropped {:?};", applied.dropped_layers);
    }
    let new: usize = batch.shards.iter().map(|s| s.new_chunks.len()).sum();
    let _ = write!(line, " {new} new chunks, folded slices {fold:?}");
    if !applied.freed.is_empty() {
        let ids: Vec<String> = applied.freed.iter().map(|id| format!("{id:#x}")).collect();
        let _ = write!(line, ", freed {}", ids.join(" "));
    }
    if !applied.kept.is_empty() {
        let _ = write!(line, ", kept {:x?}", applied.kept);
    }
    if applied.swept > 0 {
        let _ = write!(line, ", {} stale fingerprints swept", applied.swept);
    }
    line
}

/// `ranges` (disjoint, in order) without the blocks in `holes`.
fn without_blocks(ranges: &[(u64, u64)], holes: &BTreeSet<u64>) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(s, e) in ranges {
        let mut from = s;
        for &b in holes.range(s..e) {
            if from < b {
                out.push((from, b));
            }
            from = b + 1;
        }
        if from < e {
            out.push((from, e));
        }
    }
    out
}

/// A chunk's record as `txn` sees it with the changes in `chunks`; corrupt if it is missing.
fn load_chunk(chunks: &mut chunk_table::Pages, txn: &WriteTxn, id: u64) -> Result<ChunkRecord> {
    chunks.get(txn, id)?.ok_or_else(|| chunk_table::missing(id))
}

fn segment_usage<'a>(
    usage: &'a mut BTreeMap<u64, SegmentUsage>,
    store: &impl Reader,
    seg: u64,
) -> Result<&'a mut SegmentUsage> {
    if let std::collections::btree_map::Entry::Vacant(e) = usage.entry(seg) {
        let u = match store.get(meta::SEGMENTS, &seg)? {
            Some(v) => SegmentUsage::decode(&v)?,
            None => SegmentUsage::default(),
        };
        e.insert(u);
    }
    Ok(usage.get_mut(&seg).expect("inserted"))
}
