//! The write path: preparing blocks (zero detection, fingerprints, compression, dedup
//! lookups), placing new chunks in segments, installing entries in a volume's map, and
//! reference counting.

use super::*;

/// Whole blocks from which one write prepares its blocks on several threads (rayon's pool, one
/// thread per core), when fewer writes than cores are preparing blocks: hashing and compressing
/// a 1 MiB write then uses every core instead of one. With more writes in flight, each stays on
/// its own thread (the cores are busy already, and a hand-off would only add latency).
pub(super) const PARALLEL_BLOCKS_MIN: u64 = 64;
/// Most blocks of a write [`Volume::write_is_quick`] calls quick: 64 KiB, a few hundred
/// microseconds of fingerprinting and compression at most.
pub const QUICK_WRITE_BLOCKS_MAX: u64 = 16;

/// A fingerprint marked `placing` in its shard: the mark comes off when the chunk is
/// registered ([`PlacingMark::register`]) or, should placing it panic, when this is dropped —
/// a mark left behind would keep every later writer of that block waiting in
/// `lock_settled`, holding the gate, and so stop every commit.
pub(super) struct PlacingMark<'a> {
    pub(super) inner: &'a Inner,
    pub(super) shard: usize,
    pub(super) fp: [u8; 32],
}

impl<'a> PlacingMark<'a> {
    /// Removes the mark and registers the placed chunk `id` (record `rec`) in the shard, with
    /// `refs` references of the current batch, under one hold of the shard lock.
    pub(super) fn register(self, id: u64, rec: format::NewChunkRecord, refs: i64) {
        let fp = self.fp;
        let mut s = self.clear();
        s.dirty.new_chunks.insert(id, rec);
        s.dirty.fps.insert(fp, id);
        *s.dirty.deltas.entry(id).or_default() += refs;
    }

    /// Removes the mark; returns the shard, still locked.
    pub(super) fn clear(self) -> MutexGuard<'a, ShardState> {
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
pub(super) struct Preparing<'a> {
    counter: &'a std::sync::atomic::AtomicUsize,
    /// Writes preparing, this one included, when it entered.
    count: usize,
}

impl<'a> Preparing<'a> {
    pub(super) fn enter(counter: &'a std::sync::atomic::AtomicUsize) -> Self {
        let count = counter.fetch_add(1, Ordering::AcqRel) + 1;
        Preparing { counter, count }
    }
}

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A new chunk to place: its fingerprint and shard, and its record's flags and payload.
pub(super) struct NewChunk<'a> {
    fp: [u8; 32],
    shard: usize,
    flags: u16,
    payload: &'a [u8],
}

/// A block prepared for installation in a volume map.
pub(super) struct Prepared {
    pub(super) block: u64,
    pub(super) entry: Entry,
}

impl Prepared {
    /// The chunk this entry references, if any.
    pub(super) fn data(&self) -> Option<u64> {
        match self.entry {
            Entry::Data(id) => Some(id),
            Entry::Zero => None,
        }
    }
}

impl Inner {
    /// Writes `data` at byte `offset` (512-aligned): partial head and tail blocks first, by
    /// read-modify-write while holding their stripe locks; then the whole blocks, whose stripes
    /// are taken only to install them. Stripes are always taken in ascending order with no
    /// other stripe held, so writers cannot deadlock. The gate is held throughout, so each
    /// block's reference changes land in the same commit batch as its map entry.
    pub(crate) fn write_range(&self, v: &VolumeState, offset: u64, data: &[u8]) -> Result<()> {
        self.write_range_with(v, offset, data, None)
    }

    /// [`Inner::write_range`] with the whole blocks' fingerprints given (`known`, one per
    /// block of a block-aligned `data`, as [`fingerprint::of_data`] computes them): not
    /// computed again.
    pub(crate) fn write_range_with(
        &self,
        v: &VolumeState,
        offset: u64,
        data: &[u8],
        known: Option<&[Option<[u8; 32]>]>,
    ) -> Result<()> {
        debug_assert!(known.is_none_or(
            |k| offset.is_multiple_of(BLOCK) && data.len() as u64 == k.len() as u64 * BLOCK
        ));
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
                let stamp = self.batches.stamp();
                let entry = self.prepare_block(v, &block, stamp, None)?;
                self.install(v, b, b + 1, vec![Prepared { block: b, entry }], true)?;
            }
        }
        let (f0, f1) = (offset.div_ceil(BLOCK), end / BLOCK);
        if f0 >= f1 {
            return Ok(());
        }
        let stamp = self.batches.stamp();
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
            let fps = match known {
                Some(k) => k[(lo - f0) as usize..(hi - f0) as usize].to_vec(),
                None => fingerprint::of_blocks_or_zero(&blocks),
            };
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
    pub(super) fn patched_block(
        &self,
        v: &VolumeState,
        b: u64,
        offset: u64,
        data: &[u8],
    ) -> Result<Vec<u8>> {
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
    pub(super) fn prepare_block(
        &self,
        v: &VolumeState,
        block: &[u8],
        stamp: u64,
        neighbours: Option<&Neighbours>,
    ) -> Result<Entry> {
        let fp = (!fingerprint::is_zero(block)).then(|| fingerprint::of(block));
        self.prepare_fingerprinted(v, block, fp, stamp, neighbours)
    }

    /// [`Self::prepare_block`] with the block's fingerprint already computed (`None`: the block
    /// is all zero): a group of one ([`Self::prepare_group`]), every block trying compression.
    pub(super) fn prepare_fingerprinted(
        &self,
        v: &VolumeState,
        block: &[u8],
        fp: Option<[u8; 32]>,
        stamp: u64,
        neighbours: Option<&Neighbours>,
    ) -> Result<Entry> {
        let attempts = compression::Attempts::default();
        let mut one = self.prepare_group(v, &[block], &[fp], stamp, neighbours, &attempts);
        one.pop().expect("a group of one has one result")
    }

    /// The one block-placement path: turns a group of whole blocks (at most
    /// [`fingerprint::LANES`], `fps` as [`fingerprints`] gives them; a single block is a group
    /// of one) into map entries — zero, a reference to a live chunk with the same fingerprint,
    /// or a new chunk (compressed if that saves space) — with the new chunks among them placed
    /// together: one segment append and one journal append for the group, and one shard lock
    /// per block to look it up (it is marked `placing` in the same hold when nothing matches)
    /// and one to register it. Results in block order, ending at the first failure; the blocks
    /// after it took no references (those they took are given back here).
    ///
    /// A block another writer is placing right now (two writers storing the same new block at
    /// once) is waited for while the group holds no `placing` mark of its own, so its map entry
    /// is journaled after the chunk it refers to. Once the group holds marks it never waits
    /// (no deadlock between writers): such a block is set aside and prepared as a group of one
    /// once the group's own marks are cleared. A block repeating an earlier new block of the
    /// group refers to it. `attempts`: the write's record of how its blocks compressed (which
    /// new blocks to try).
    pub(super) fn prepare_group(
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
        let n = blocks.len();
        let mut slots: Vec<Slot> = Vec::with_capacity(n);
        let mut marks: Vec<PlacingMark> = Vec::with_capacity(n);
        // Repeats of each new chunk's block within the group (references to add at its
        // registration).
        let mut repeats: Vec<i64> = Vec::with_capacity(n);
        let mut new_blocks: Vec<usize> = Vec::with_capacity(n);
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
            let mut s = match marks.is_empty() {
                true => self.lock_settled(shard, &fp),
                false => {
                    let s = self.shards[shard].lock();
                    if s.placing.contains(&fp) {
                        slots.push(Slot::Later);
                        continue;
                    }
                    s
                }
            };
            match self.find_duplicate(&s, &fp, neighbours) {
                Ok(Some(id)) => {
                    *s.dirty.deltas.entry(id).or_default() += 1;
                    drop(s);
                    if let Some(n) = neighbours {
                        n.load_if_pending(&self.db, self.dedup.frees());
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
            // Compressed forms, back to back in one buffer (the scratch is per call), sized
            // once for the most it can hold (a form is kept only when shorter than its
            // block), not reallocated and copied as it grows.
            let mut packed: Vec<u8> = Vec::with_capacity(new_blocks.len() * BLOCK_BYTES);
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
            let bloom = self.dedup.filter();
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
                // A group of one holds no mark while it looks: it waits, never sets aside.
                Slot::Later => {
                    let one = &blocks[i..=i];
                    let mut r =
                        self.prepare_group(v, one, &fps[i..=i], stamp, neighbours, attempts);
                    r.pop().expect("a group of one has one result")
                }
            };
            failed = r.is_err();
            results.push(r);
        }
        self.release(&unused);
        results
    }

    /// Locks shard `shard` once no writer is placing a new chunk with fingerprint `fp`.
    /// Waiting is rare (two writers storing the same new block at once): a poll will do.
    pub(super) fn lock_settled(&self, shard: usize, fp: &[u8; 32]) -> MutexGuard<'_, ShardState> {
        loop {
            let s = self.shards[shard].lock();
            if !s.placing.contains(fp) {
                return s;
            }
            drop(s);
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }

    /// Appends new chunks' records to a segment, back to back through one writer, and journals
    /// them; returns their ids and records, in order (not yet registered in their shards: the
    /// caller registers them, and their space stays counted as pending until then).
    pub(super) fn place_chunks(
        &self,
        v: &VolumeState,
        chunks: &[NewChunk<'_>],
        stamp: u64,
    ) -> Result<Vec<(u64, format::NewChunkRecord)>> {
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
        let placed: Vec<(u64, format::NewChunkRecord)> = records
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
                };
                (
                    r.chunk_id,
                    format::NewChunkRecord {
                        rec,
                        fingerprint: c.fp,
                    },
                )
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
    pub(super) fn find_duplicate(
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
            if frees == self.dedup.frees().load(Ordering::Acquire) || self.holds_chunk(id, fp)? {
                return Ok(Some(id));
            }
        }
        if !self.dedup.filter().may_contain(meta::fp_prefix(fp)) {
            return Ok(None);
        }
        // The index gives the chunks whose fingerprint starts like `fp`; the one whose record
        // holds all of `fp` is the duplicate (same snapshot, so it exists; the shard lock
        // keeps it alive, as for a neighbour). The runs are taken before the snapshot (see
        // `dedup_index.rs`).
        let runs = self.dedup.runs();
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
    pub(super) fn holds_chunk(&self, id: u64, fp: &[u8; 32]) -> Result<bool> {
        holds_chunk_in(&self.db.read()?, id, fp)
    }

    /// Installs prepared entries in the volume's map and drops the references they replace.
    /// `stripes_held`: the caller already holds the stripe locks of `[b0, b1)`.
    pub(super) fn install(
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
        let stamp = self.batches.stamp();
        self.journal.append(
            stamp,
            Change::Install {
                volume: v.id,
                entries: prepared.iter().map(|p| (p.block, p.entry)).collect(),
            },
        );
        drop(map);
        self.batches.add_dirty(added);
        self.release(&released);
        Ok(())
    }

    /// Runs `op`; if it fails for lack of space, commits, deletes the entries of dropped
    /// layers and folds the reference log (space freed by overwrites, zeroing and deletes is
    /// only counted back then) and runs it once
    /// more, and again (up to [`RETRIES_AFTER_COMMIT_MAX`] times) while each commit freed
    /// space. If the pool still has room and only the filesystem refuses (garbage fills it: the
    /// cleaner fell behind the writes despite pacing, or has no thread), the writer cleans
    /// segments itself and runs `op` again after each, up to [`CLEANS_FOR_SPACE_MAX`]: a write
    /// waits for space the pool has instead of failing.
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
            let before = self.space.used_now();
            self.commit()?;
            // A deleted volume's chunks are freed once its layers' entries are gone, and
            // overwritten ones when their reference changes are folded.
            self.discard_abandoned_layers(&std::sync::atomic::AtomicBool::new(false), false)?;
            self.fold_ref_log()?;
            let freed = self.space.used_now() < before;
            result = op();
            if !freed {
                break;
            }
        }
        for _ in 0..CLEANS_FOR_SPACE_MAX {
            if !matches!(result, Err(Error::NoSpace))
                || self.space.free_bytes() < ROOM_FOR_CLEANING_MIN
                || self.garbage_bytes() == 0
                || self.clean_one(true, None)?.is_none()
            {
                break;
            }
            // The pass's move, then what it gave back, not a reading from before it.
            self.commit()?;
            self.space.fs().refresh();
            result = op();
        }
        result
    }

    /// Replays a journaled chunk: it becomes an uncommitted new chunk again, with no reference
    /// yet (the journaled map entries that use it add theirs).
    pub(crate) fn adopt_chunk(&self, id: u64, new: format::NewChunkRecord) {
        self.chunk_seq
            .fetch_max((id >> SHARD_BITS) + 1, Ordering::Relaxed);
        let mut s = self.shards[shard_of_chunk(id)].lock();
        s.dirty.fps.insert(new.fingerprint, id);
        s.dirty.new_chunks.insert(id, new);
        s.dirty.deltas.entry(id).or_default();
        drop(s);
        self.space.adopt(new.rec.physical_bytes());
        self.dedup
            .filter()
            .insert(meta::fp_prefix(&new.fingerprint));
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
    pub(super) fn release(&self, ids: &[u64]) {
        self.add_refs(ids.iter().copied(), -1);
    }

    /// Adds `delta` references to each chunk (applied at the next commit).
    pub(super) fn add_refs(&self, ids: impl IntoIterator<Item = u64>, delta: i64) {
        for id in ids {
            *self.shards[shard_of_chunk(id)]
                .lock()
                .dirty
                .deltas
                .entry(id)
                .or_default() += delta;
        }
    }
}

/// A committed map value as an entry.
pub(super) fn entry_of(id: u64) -> Entry {
    if id == format::ZERO_TOMBSTONE {
        Entry::Zero
    } else {
        Entry::Data(id)
    }
}

/// Whether `store` holds chunk `id` with fingerprint `fp` (a record, and that fingerprint: a
/// dead chunk's may still be stored, stale).
pub(super) fn holds_chunk_in(store: &impl Reader, id: u64, fp: &[u8; 32]) -> Result<bool> {
    Ok(crate::chunk_fps::get(store, id)? == Some(*fp)
        && crate::chunk_table::get(store, id)?.is_some())
}

/// The first of the chunk ids `ids` that `store` holds with fingerprint `fp`.
pub(super) fn first_holding(
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
