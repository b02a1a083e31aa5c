//! Range copies by frames: a copy whose cost does not depend on its length.
//!
//! Copying blocks `[sb, sb + n)` of `src` to `[db, db + n)` of `dst` freezes `src`'s top
//! layer (as a snapshot does; skipped when it holds nothing in `[sb, sb + n)`, so that writes
//! beside copies add no layer per copy) and puts, just below `dst`'s top layer, a **group** of
//! frames: a floor over `[db, db + n)` and, above it, each frame of `src`'s frozen stack that
//! has an entry in that window, seen through it, shifted by `db - sb`. The floor keeps
//! `dst`'s older frames from showing through blocks `src` does not map. Layer reference
//! counts keep the frozen layers alive; no chunk reference count changes, and nothing is read
//! or written but the catalog: one transaction (two when `src`'s top must be frozen), plus a
//! walk over the mapped blocks of the two ranges to keep `dst`'s mapped-block count exact (a
//! read-only range scan; the source's, usually the long one, runs with writers going on).
//!
//! Copies shorter than [`crate::PoolConfig::frame_copy_blocks_min`] blocks (default 1 MiB)
//! share each block's chunk reference instead: cheaper than a catalog transaction and a deeper
//! stack when there is little to share.
//!
//! A copy next to the previous one, from the same frozen source with the same shift (a
//! sequential XCOPY in segments), widens that group's windows instead of adding a group.
//!
//! The background later makes a volume's windowed frames **permanent** once it has had no
//! range copy for [`MATERIALIZE_DELAY`] ([`Inner::materialize_frames`]): the frames from the
//! lowest windowed one up to the top layer become one new private plain layer holding what
//! they showed, taking a chunk reference for each of its entries; the source layers lose the
//! group's references (and are deleted if nothing else shows them). That work is proportional
//! to the mapped blocks, but it runs off the copy's path; it keeps stacks shallow and lets the
//! source flatten its own layers again.

pub(crate) mod batch;
pub(crate) mod layer_build;

use crate::commit::drop_layer_refs;
use crate::commit_state::CommitState;
use crate::error::{Error, Result};
use crate::format::{self, Frame, FLOOR_LAYER};
use crate::inner::Inner;
use crate::layer_filter::LayerFilters;
use crate::map_table;
use crate::meta;
use crate::ref_log::by_slice;
use crate::store::{ReadTxn, Reader};
use crate::volume::resolve_stored;
use crate::volume_state::{VolumeMap, VolumeState};
use batch::{CopyRequest, Turn};
use layer_build::LayerBuild;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most frames a range copy lets a stack reach; past it, copies share block references
/// until the background has made the earlier copies permanent.
pub(crate) const COPY_FRAMES_MAX: usize = 64;
/// How long after its last range copy the background makes a volume's copies permanent.
pub(crate) const MATERIALIZE_DELAY: Duration = Duration::from_secs(5);
/// Blocks examined per step when counting or materializing (bounds memory, and how long a
/// materializing walk takes to notice that the pool is closing: ~0.1 s).
const WALK_WINDOW_BLOCKS: u64 = 1 << 17;

impl Inner {
    /// Makes blocks `[db, db + n)` of `dst` show what blocks `[sb, sb + n)` of `src` show now.
    /// Returns `false`, having changed at most `src`'s stack (its top frozen), when `dst`'s
    /// stack has no room for the frames.
    ///
    /// Copies arriving while another applies a batch wait in [`batch::Copies`]; the next to lead
    /// takes the commit lock and applies its own and the waiting ones that do not conflict
    /// with it ([`CopyRequest::conflicts`]) together ([`Inner::copy_batch`]): one quiesce and
    /// one catalog transaction for all, so copies in flight cost less than one at a time.
    pub(crate) fn copy_by_frames(
        &self,
        src: &Arc<VolumeState>,
        sb: u64,
        dst: &Arc<VolumeState>,
        db: u64,
        n: u64,
    ) -> Result<bool> {
        let id = self.copies.enqueue(src, sb, dst, db, n);
        let leading = match self.copies.await_turn(id) {
            Turn::Done(done) => return done,
            Turn::Lead(leading) => leading,
        };
        let mut cs = self.commit.lock();
        let batch = self.copies.take_batch(id);
        debug_assert_eq!(batch[0].id, id, "a batch starts with its leader's copy");
        let results = self.copy_batch(&mut cs, &batch);
        let now = Instant::now();
        let mut mine = None;
        let mut others = Vec::with_capacity(batch.len() - 1);
        for (request, result) in batch.iter().zip(results) {
            if matches!(result, Ok(true)) {
                *request.dst.frames_copied_at.lock() = Some(now);
            }
            if request.id == id {
                mine = Some(result);
            } else {
                others.push((request.id, result));
            }
        }
        self.copies.finish(others);
        drop(cs);
        drop(leading);
        mine.expect("the leader's copy is in its batch")
    }

    /// Applies `batch` (no two conflicting), giving each copy its result in order. A copy
    /// whose volume was deleted meanwhile fails alone; another error fails them all.
    fn copy_batch(&self, cs: &mut CommitState, batch: &[CopyRequest]) -> Vec<Result<bool>> {
        let mut results: Vec<Option<Result<bool>>> = batch.iter().map(|_| None).collect();
        loop {
            let live: Vec<&CopyRequest> = batch
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_none())
                .map(|(c, _)| c)
                .collect();
            if live.is_empty() {
                break;
            }
            match self.copy_together(cs, &live) {
                Ok(done) => {
                    let mut done = done.into_iter();
                    for r in results.iter_mut().filter(|r| r.is_none()) {
                        *r = Some(Ok(done.next().expect("one outcome per copy")));
                    }
                    break;
                }
                Err(Error::NotFound(name)) if live.iter().any(|c| c.involves(&name)) => {
                    for (c, r) in batch.iter().zip(results.iter_mut()) {
                        if r.is_none() && c.involves(&name) {
                            *r = Some(Err(Error::NotFound(name.clone())));
                        }
                    }
                }
                Err(e) => {
                    for r in results.iter_mut().filter(|r| r.is_none()) {
                        *r = Some(Err(e.duplicate()));
                    }
                    break;
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every copy has an outcome"))
            .collect()
    }

    /// The copies of `batch`, applied: whether each was (`false`: no room in its
    /// destination's stack). Holds the commit lock throughout, so the frozen layers the copies
    /// show cannot change (flattening and making copies permanent need that lock). Writers are
    /// stopped (the gate held exclusively) only while sources' tops are frozen and while the
    /// catalog transaction is prepared — not while the source ranges' mapped blocks are
    /// counted.
    fn copy_together(&self, cs: &mut CommitState, batch: &[&CopyRequest]) -> Result<Vec<bool>> {
        // The volumes involved, each once: sources first.
        let mut volumes: Vec<&Arc<VolumeState>> = Vec::new();
        for v in batch
            .iter()
            .map(|c| &c.src)
            .chain(batch.iter().map(|c| &c.dst))
        {
            if !volumes.iter().any(|w| Arc::ptr_eq(w, v)) {
                volumes.push(v);
            }
        }
        let index = |v: &Arc<VolumeState>| {
            volumes
                .iter()
                .position(|w| Arc::ptr_eq(w, v))
                .expect("listed above")
        };
        let sources = volumes
            .iter()
            .take_while(|v| batch.iter().any(|c| Arc::ptr_eq(&c.src, v)))
            .count();
        let plain: Vec<&VolumeState> = volumes.iter().map(|v| v.as_ref()).collect();
        // 1. What each source shows: its frozen frames, as of now.
        let embedded = self.with_quiesced_in(cs, &plain[..sources], |inner, cs, maps| {
            (0..sources)
                .map(|i| {
                    let windows: Vec<(u64, u64)> = batch
                        .iter()
                        .filter(|c| std::ptr::eq(c.src.as_ref(), plain[i]))
                        .map(|c| (c.sb, c.sb + c.n))
                        .collect();
                    inner.freeze_for_copy(cs, plain[i], &mut maps[i], &windows)
                })
                .collect::<Result<Vec<_>>>()
        })?;
        // 2. What each copy shows of its source (the frozen frames with an entry in its
        // window), and the blocks it maps: range scans of frozen layers; writers go on.
        let txn = self.db.read()?;
        let shown = batch
            .iter()
            .map(|c| {
                shown_in(
                    &txn,
                    &self.layer_filters,
                    &embedded[index(&c.src)],
                    c.sb,
                    c.sb + c.n,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let after = batch
            .iter()
            .zip(&shown)
            .map(|(c, frames)| count_data(&txn, &self.layer_filters, frames, c.sb, c.sb + c.n))
            .collect::<Result<Vec<_>>>()?;
        drop(txn);
        // 3. The catalog transaction.
        self.with_quiesced_in(cs, &plain, |inner, cs, maps| {
            for (i, frames) in embedded.iter().enumerate() {
                if !maps[i].stack.starts_with(frames) {
                    return Err(Error::Corrupt(format!(
                        "{}: frozen frames changed under a range copy holding the commit lock",
                        plain[i].name
                    )));
                }
            }
            let txn = inner.db.read()?;
            // Each volume's stack and mapped-block count as the copies change them.
            let mut stacks: Vec<Vec<Frame>> = maps.iter().map(|m| m.stack.clone()).collect();
            let mut mapped: Vec<u64> = maps.iter().map(|m| m.mapped_blocks).collect();
            let mut deltas: BTreeMap<u64, i64> = BTreeMap::new();
            let mut overwritten = Vec::new();
            let mut done = Vec::with_capacity(batch.len());
            for ((c, &after), frames) in batch.iter().zip(&after).zip(&shown) {
                let d = index(&c.dst);
                let old = &stacks[d];
                let group = group_for(frames, c.sb, c.db, c.n);
                let mut stack = old.clone();
                let top = stack.pop().expect("a stack has a layer");
                place_group(&mut stack, &group);
                if stack.len() + 1 > COPY_FRAMES_MAX.max(old.len()) {
                    done.push(false);
                    continue;
                }
                stack.push(top);
                // The destination's mapped-block count: what the window showed, what it
                // shows now. (The copies' windows are disjoint: the committed state read
                // here is what each window showed before its copy.)
                let before = count_data(&txn, &inner.layer_filters, old, c.db, c.db + c.n)?;
                // Entries of dst's top layer in the window are overwritten by the copy.
                map_table::scan(&txn, top.layer, c.db, c.db + c.n, |b, id| {
                    overwritten.push((top.layer, b));
                    if id != format::ZERO_TOMBSTONE {
                        *deltas.entry(id).or_default() -= 1;
                    }
                })?;
                mapped[d] = (mapped[d] + after).checked_sub(before).ok_or_else(|| {
                    Error::Corrupt(format!(
                        "{}: {before} mapped blocks in the copy's window, {} in the volume",
                        c.dst.name, mapped[d]
                    ))
                })?;
                stacks[d] = stack;
                done.push(true);
            }
            drop(txn);
            let changed: Vec<usize> = (0..plain.len())
                .filter(|&i| stacks[i] != maps[i].stack)
                .collect();
            if changed.is_empty() {
                return Ok(done);
            }
            // Layers the new stacks show in more frames (+) or fewer (joined groups: -).
            let mut shown = Vec::new();
            let mut unshown = Vec::new();
            for &i in &changed {
                for (&layer, &n) in &layer_ref_changes(&maps[i].stack, &stacks[i]) {
                    let list = if n > 0 { &mut shown } else { &mut unshown };
                    list.extend(std::iter::repeat_n(layer, n.unsigned_abs() as usize));
                }
            }
            let records: Vec<format::VolumeRecord> = changed
                .iter()
                .map(|&i| {
                    let mut r = inner.record_of(plain[i], &maps[i], stacks[i].clone());
                    r.mapped_blocks = mapped[i];
                    r
                })
                .collect();
            let named: Vec<(&str, &format::VolumeRecord)> = changed
                .iter()
                .zip(&records)
                .map(|(&i, r)| (plain[i].name.as_str(), r))
                .collect();
            inner.write_catalog_with(cs, &named, &[], &shown, &[], 0, |txn, ref_log| {
                let mut map = map_table::Changes::new();
                for &(layer, b) in &overwritten {
                    map.remove(layer, b);
                }
                map.write(txn)?;
                for layer in drop_layer_refs(txn, &inner.layer_filters, unshown)? {
                    inner.event(|| format!("layer {layer} dropped"));
                }
                ref_log.append(txn, &by_slice(&deltas));
                Ok(())
            })?;
            for i in changed {
                let map = &mut maps[i];
                inner.note_mapped_change(plain[i], mapped[i] as i64 - map.mapped_blocks as i64);
                inner.event(|| {
                    format!(
                        "copy by frames into {}: {} -> {}",
                        plain[i].name,
                        format::describe_stack(&map.stack),
                        format::describe_stack(&stacks[i])
                    )
                });
                map.mapped_blocks = mapped[i];
                map.stack = std::mem::take(&mut stacks[i]);
            }
            Ok(done)
        })
    }

    /// The frames copies from `src` of blocks `windows` show: its stack with the top frozen,
    /// as a snapshot freezes it (a new empty top takes its place, durably). A top with no
    /// entry in the windows is left out instead and stays `src`'s top: writes next to a copy
    /// (ESXi's heartbeats beside a clone) then add no layer per copy, and the copies' groups
    /// show the same frames and join. A snapshot's stack is already frozen.
    fn freeze_for_copy(
        &self,
        cs: &mut CommitState,
        src: &VolumeState,
        map: &mut VolumeMap,
        windows: &[(u64, u64)],
    ) -> Result<Vec<Frame>> {
        let stack = map.stack.clone();
        if src.read_only {
            return Ok(stack);
        }
        let top = stack.last().expect("a stack has a layer").layer;
        // Quiesced: the top's committed entries are all it holds.
        let txn = self.db.read()?;
        let mut holds = false;
        for &(b0, b1) in windows {
            if self.layer_filters.may_hold(top, b0, b1) && has_entry(&txn, top, b0, b1)? {
                holds = true;
                break;
            }
        }
        drop(txn);
        if !holds {
            return Ok(stack[..stack.len() - 1].to_vec());
        }
        self.event(|| format!("copy freezes the top of {}", src.name));
        let new_top = cs.record.next_layer_id;
        let mut frozen = stack.clone();
        frozen.push(Frame::plain(new_top));
        let record = self.record_of(src, map, frozen.clone());
        self.write_catalog_with(
            cs,
            &[(&src.name, &record)],
            &[],
            &[],
            &[new_top],
            0,
            |_, _| Ok(()),
        )?;
        map.stack = frozen;
        Ok(stack)
    }

    /// Makes `v`'s windowed frames permanent (see the module doc). Returns whether it did.
    /// The walk over the frames (frozen: nothing changes them) runs without locks; the new
    /// layer's entries are written as it goes, in steps of `flatten_step_entries` under the
    /// commit lock, into a layer no stack shows yet (`layer_build.rs`); the last step puts it in
    /// the stack. It gives up, abandoning what it wrote to the background, if the stack
    /// changed meanwhile. Writes and reads of the volume go on throughout, and see the same
    /// data through either stack. Once `stop` is set it gives up between walk windows and
    /// steps.
    /// `walked`, if given, is set to the bytes of the volume walked before each window.
    pub(crate) fn materialize_frames(
        &self,
        v: &VolumeState,
        stop: &AtomicBool,
        walked: Option<&AtomicU64>,
    ) -> Result<bool> {
        let t0 = std::time::Instant::now();
        let mut build = LayerBuild::default();
        let done = self.materialize_in_steps(v, stop, walked, &mut build);
        if build.entries > 0 {
            tracing::debug!(
                "materialize {}: {} after {} entries in {:?}",
                v.name,
                if matches!(done, Ok(true)) {
                    "done"
                } else {
                    "gave up"
                },
                build.entries,
                t0.elapsed()
            );
        }
        if !matches!(done, Ok(true)) {
            self.abandon_build(&mut self.commit.lock(), &mut build);
        }
        done
    }

    fn materialize_in_steps(
        &self,
        v: &VolumeState,
        stop: &AtomicBool,
        walked: Option<&AtomicU64>,
        build: &mut LayerBuild,
    ) -> Result<bool> {
        if v.read_only || v.map.lock().stack.iter().all(Frame::is_plain) {
            return Ok(false);
        }
        // Read before the walk's snapshot is taken: a flatten step committed after it moves
        // this count.
        let (stack, size, merge_steps) = {
            let m = v.map.lock();
            if m.deleted {
                return Ok(false);
            }
            (m.stack.clone(), m.size, m.merge_steps)
        };
        let Some(j) = stack.iter().position(|f| !f.is_plain()) else {
            return Ok(false);
        };
        let k = stack.len() - 1;
        let (lower, upper) = (&stack[..j], &stack[j..k]);
        let step = self.config.flatten_step_entries.max(1) as usize;
        // Whether `v` still shows `stack`'s frames with the entries the walk read (checked
        // under the commit lock: only commits change stacks, only these frames' layers keep
        // the entries' chunks alive until the build's references are logged, and a flatten
        // step — which moves entries between the layers, say the top's into the frozen layer
        // below, without changing the stack — also runs under it).
        let unchanged = || {
            let m = v.map.lock();
            !m.deleted && m.stack == stack && m.merge_steps == merge_steps
        };
        // The frames below the top are frozen: a snapshot shows what they show for as long as
        // the stack holds them.
        let txn = self.db.read()?;
        // The new layer: what the upper frames show, plus tombstones where they hide data
        // of the lower frames (a floor, or a tombstone of the source).
        let mut entries: Vec<(u64, u64)> = Vec::new();
        let end = size.div_ceil(format::BLOCK_BYTES as u64);
        let mut w0 = 0;
        while w0 < end {
            if stop.load(Ordering::Acquire) {
                return Ok(false);
            }
            let w1 = end.min(w0 + WALK_WINDOW_BLOCKS);
            if let Some(w) = walked {
                w.store(w0 * format::BLOCK_BYTES as u64, Ordering::Relaxed);
            }
            let shown = resolve_stored(&txn, &self.layer_filters, upper, w0, w1, false)?;
            let below = if lower.is_empty() {
                BTreeMap::new()
            } else {
                resolve_stored(&txn, &self.layer_filters, lower, w0, w1, false)?.entries
            };
            let lower_has_data = |b: u64| {
                below
                    .get(&b)
                    .is_some_and(|&id| id != format::ZERO_TOMBSTONE)
            };
            let first = entries.len();
            for (&b, &id) in &shown.entries {
                if id != format::ZERO_TOMBSTONE || lower_has_data(b) {
                    entries.push((b, id));
                }
            }
            for (&b, &id) in &below {
                let closed = shown.closed.iter().any(|&(s, e)| s <= b && b < e);
                if id != format::ZERO_TOMBSTONE && closed && !shown.entries.contains_key(&b) {
                    entries.push((b, format::ZERO_TOMBSTONE));
                }
            }
            entries[first..].sort_unstable();
            w0 = w1;
            while entries.len() >= step {
                if stop.load(Ordering::Acquire) {
                    return Ok(false);
                }
                let mut cs = self.commit.lock();
                if !unchanged() {
                    self.event(|| format!("materialize {}: the stack changed", v.name));
                    return Ok(false);
                }
                let mut wtxn = self.db.write()?;
                let mut deltas = BTreeMap::new();
                self.write_build_step(&cs, &mut wtxn, build, &entries[..step], &mut deltas)?;
                self.commit_build_step(&mut cs, wtxn, build, &deltas)?;
                entries.drain(..step);
            }
        }
        drop(txn);
        let mut cs = self.commit.lock();
        if !unchanged() {
            self.event(|| format!("materialize {}: the stack changed during the walk", v.name));
            return Ok(false);
        }
        let mut record = match self.db.read()?.get(meta::VOLUMES, v.name.as_str())? {
            Some(r) => format::VolumeRecord::decode(&r)?,
            None => return Ok(false),
        };
        if record.layers != stack {
            return Err(Error::Corrupt(format!(
                "{}: stored stack differs from the open volume's",
                v.name
            )));
        }
        let mut wtxn = self.db.write()?;
        let mut deltas = BTreeMap::new();
        let layer = self.write_build_step(&cs, &mut wtxn, build, &entries, &mut deltas)?;
        let mut new_stack = lower.to_vec();
        new_stack.push(Frame::plain(layer));
        new_stack.push(stack[k]);
        record.layers = new_stack.clone();
        wtxn.insert(meta::LAYERS, &layer, &1);
        self.finish_build(&mut wtxn, build)?;
        for layer in drop_layer_refs(
            &mut wtxn,
            &self.layer_filters,
            format::referenced_layers(upper),
        )? {
            self.event(|| format!("layer {layer} dropped"));
        }
        cs.ref_log.append(&mut wtxn, &by_slice(&deltas));
        wtxn.insert(meta::VOLUMES, v.name.as_str(), record.encode().as_slice());
        // Swap under the map lock: a reader that walked the old stack sees the generation
        // move and walks again (the old frames' layers may be gone after this commit).
        let mut map = v.map.lock();
        if map.deleted || map.stack != stack || map.merge_steps != merge_steps {
            self.event(|| format!("materialize {}: the stack changed", v.name));
            return Ok(false);
        }
        wtxn.commit()?;
        self.built_step_committed(&mut cs, build);
        self.event(|| {
            format!(
                "materialize {}: {} -> {}, {} entries",
                v.name,
                format::describe_stack(&stack),
                format::describe_stack(&new_stack),
                build.entries
            )
        });
        self.end_build(&mut cs, build);
        map.stack = new_stack;
        map.generation += 1;
        drop(map);
        Ok(true)
    }
}

/// The frames a copy of `[sb, sb + n)` to `[db, db + n)` puts in the destination's stack,
/// bottom first: a floor over the window, then each of `embedded` (the source's frozen
/// frames) clipped to the window and shifted. Frames that miss the window are left out.
fn group_for(embedded: &[Frame], sb: u64, db: u64, n: u64) -> Vec<Frame> {
    let mut group = vec![Frame {
        layer: FLOOR_LAYER,
        lo: db,
        hi: db + n,
        src_lo: 0,
    }];
    for f in embedded {
        let (lo, hi) = (f.lo.max(sb), f.hi.min(sb + n));
        if lo >= hi {
            continue;
        }
        group.push(Frame {
            layer: f.layer,
            lo: lo - sb + db,
            hi: hi - sb + db,
            src_lo: if f.is_floor() { 0 } else { f.source_block(lo) },
        });
    }
    group
}

/// Puts `group` (a copy's frames, floor first) on `stack` (the top layer removed), then
/// joins groups that show the same layers with the same shifts in adjacent windows into one
/// ([`join_groups`]): segments of one copy that arrive out of order or in parallel (ESXi sends
/// EXTENDED COPY in 4 MiB segments, 8 or more at once) end up as one group, so the stack stays
/// as shallow as for a sequential copy. Equivalent to pushing `group` alone.
fn place_group(stack: &mut Vec<Frame>, group: &[Frame]) {
    stack.extend_from_slice(group);
    while join_groups(stack) {}
}

/// The groups of `stack`: runs of windowed frames, each starting with a floor, as
/// `(start, end)` index ranges, bottom first.
fn groups(stack: &[Frame]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    let mut open: Option<usize> = None;
    for (i, f) in stack.iter().enumerate() {
        if f.is_floor() || f.is_plain() {
            if let Some(s) = open.take() {
                out.push((s, i));
            }
            if f.is_floor() {
                open = Some(i);
            }
        }
    }
    if let Some(s) = open {
        out.push((s, stack.len()));
    }
    out
}

/// Joins one pair of groups, if any can be: a lower group `x` and an upper group `y` with the
/// same layers, each frame of `y` continuing the same frame of `x` (adjacent windows, the
/// layer's blocks continuing with the same shift; on either side), and no frame between them
/// whose window meets `y`'s (moving `y` down past them then changes nothing a read sees). `y`'s
/// frames are removed and `x`'s widened. Returns whether it joined two.
fn join_groups(stack: &mut Vec<Frame>) -> bool {
    let gs = groups(stack);
    for yi in (1..gs.len()).rev() {
        let (ys, ye) = gs[yi];
        let (lo, hi) = (stack[ys].lo, stack[ys].hi);
        for xi in (0..yi).rev() {
            let (xs, xe) = gs[xi];
            // Every frame between x and y (other groups, plain frames) must miss y's window;
            // if one meets it, no lower group can take y either.
            let between = &stack[xe..ys];
            if between
                .iter()
                .any(|f| f.is_plain() || (f.lo < hi && lo < f.hi))
            {
                break;
            }
            let (x, y) = (&stack[xs..xe], &stack[ys..ye]);
            if x.len() != y.len() || x.iter().zip(y).any(|(a, b)| a.layer != b.layer) {
                continue;
            }
            let continues = |a: &Frame, b: &Frame| {
                a.hi == b.lo && (a.is_floor() || a.src_lo + (a.hi - a.lo) == b.src_lo)
            };
            if x.iter().zip(y).all(|(a, b)| continues(a, b)) {
                for i in 0..y.len() {
                    stack[xs + i].hi = stack[ys + i].hi;
                }
            } else if x.iter().zip(y).all(|(a, b)| continues(b, a)) {
                for i in 0..y.len() {
                    stack[xs + i].lo = stack[ys + i].lo;
                    stack[xs + i].src_lo = stack[ys + i].src_lo;
                }
            } else {
                continue;
            }
            stack.drain(ys..ye);
            return true;
        }
    }
    false
}

/// How many more (positive) or fewer (negative) frames of `new` than of `old` show each
/// layer: the `layers` table's changes when a stack goes from `old` to `new`.
fn layer_ref_changes(old: &[Frame], new: &[Frame]) -> BTreeMap<u64, i64> {
    let mut d: BTreeMap<u64, i64> = BTreeMap::new();
    for l in format::referenced_layers(new) {
        *d.entry(l).or_default() += 1;
    }
    for l in format::referenced_layers(old) {
        *d.entry(l).or_default() -= 1;
    }
    d.retain(|_, n| *n != 0);
    d
}

/// Whether `layer` has an entry (data or a zero tombstone) for a block in `[b0, b1)`.
fn has_entry(txn: &ReadTxn, layer: u64, b0: u64, b1: u64) -> Result<bool> {
    let mut found = false;
    map_table::scan_while(txn, layer, b0, b1, |_, _| {
        found = true;
        false
    })?;
    Ok(found)
}

/// The frames of `embedded` (a frozen stack) that may show something in blocks `[b0, b1)`:
/// floors, and frames whose layer has an entry in the part of their window inside it. The
/// others show nothing there, so a copy of the range leaves them out of its group (a copy's
/// group then holds the same frames as its neighbours' and joins them: see [`place_group`]).
fn shown_in(
    txn: &ReadTxn,
    filters: &LayerFilters,
    embedded: &[Frame],
    b0: u64,
    b1: u64,
) -> Result<Vec<Frame>> {
    let mut out = Vec::with_capacity(embedded.len());
    for f in embedded {
        let (lo, hi) = (f.lo.max(b0), f.hi.min(b1));
        if lo >= hi {
            continue;
        }
        if !f.is_floor() {
            let (s0, s1) = (f.source_block(lo), f.source_block(hi - 1) + 1);
            if !filters.may_hold(f.layer, s0, s1) || !has_entry(txn, f.layer, s0, s1)? {
                continue;
            }
        }
        out.push(*f);
    }
    Ok(out)
}

/// Blocks of `[b0, b1)` that `stack` maps to data (committed state).
fn count_data(
    txn: &ReadTxn,
    filters: &LayerFilters,
    stack: &[Frame],
    b0: u64,
    b1: u64,
) -> Result<u64> {
    let shown: Vec<&Frame> = stack.iter().filter(|f| f.lo < b1 && b0 < f.hi).collect();
    if let [f] = shown[..] {
        if !f.is_floor() {
            // One frame (a volume without snapshots or copies): count its entries in place.
            let (lo, hi) = (f.lo.max(b0), f.hi.min(b1));
            let mut count = 0;
            map_table::scan(
                txn,
                f.layer,
                f.source_block(lo),
                f.source_block(hi - 1) + 1,
                |_, id| count += u64::from(id != format::ZERO_TOMBSTONE),
            )?;
            return Ok(count);
        }
    }
    let mut count = 0;
    crate::volume::resolve_stored_each(txn, filters, stack, b0, b1, |_, id, _| {
        count += u64::from(id != format::ZERO_TOMBSTONE)
    })?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(layer: u64, lo: u64, hi: u64, src_lo: u64) -> Frame {
        Frame {
            layer,
            lo,
            hi,
            src_lo,
        }
    }

    #[test]
    fn group_clips_and_shifts_the_source_frames() {
        let embedded = [
            Frame::plain(3),
            window(FLOOR_LAYER, 5, 50, 0),
            window(4, 5, 50, 100),
        ];
        let g = group_for(&embedded, 40, 1000, 20);
        assert_eq!(
            g,
            vec![
                window(FLOOR_LAYER, 1000, 1020, 0),
                window(3, 1000, 1020, 40),
                window(FLOOR_LAYER, 1000, 1010, 0),
                window(4, 1000, 1010, 135),
            ]
        );
        // A source frame outside the copied range is left out.
        let g = group_for(&embedded, 60, 0, 10);
        assert_eq!(g, vec![window(FLOOR_LAYER, 0, 10, 0), window(3, 0, 10, 60)]);
    }

    #[test]
    fn a_sequential_copy_widens_the_previous_group() {
        let embedded = [Frame::plain(3)];
        let mut stack = vec![Frame::plain(1)];
        place_group(&mut stack, &group_for(&embedded, 0, 100, 10));
        place_group(&mut stack, &group_for(&embedded, 10, 110, 10));
        assert_eq!(stack[1..], [window(0, 100, 120, 0), window(3, 100, 120, 0)]);
        // Not adjacent, or not the next source blocks: a new group.
        place_group(&mut stack, &group_for(&embedded, 30, 130, 10));
        assert_eq!(stack.len(), 5);
        place_group(&mut stack, &group_for(&embedded, 0, 140, 10));
        assert_eq!(stack.len(), 7);
        // Plain frames never join.
        let mut plain = vec![Frame::plain(0), Frame::plain(3)];
        place_group(&mut plain, &[Frame::plain(0), Frame::plain(3)]);
        assert_eq!(plain.len(), 4);
    }

    /// Reads block `b` through `stack` the way the read path does: the top frame whose window
    /// holds it decides (a floor: zero, `None`; else the layer's block, which the test's
    /// layers hold whole).
    fn shows(stack: &[Frame], b: u64) -> Option<(u64, u64)> {
        let f = stack.iter().rev().find(|f| f.lo <= b && b < f.hi)?;
        (!f.is_floor()).then(|| (f.layer, f.source_block(b)))
    }

    #[test]
    fn segments_in_any_order_end_as_one_group_showing_the_same_blocks() {
        let embedded = [Frame::plain(3)];
        // 16 segments of 10 blocks, copied from 0 to 1000, in a scrambled order (8 in flight).
        let order = [3, 0, 7, 1, 2, 6, 5, 4, 11, 8, 15, 9, 10, 14, 13, 12];
        let mut stack = vec![Frame::plain(1)];
        let mut pushed = stack.clone();
        for &i in &order {
            let g = group_for(&embedded, i * 10, 1000 + i * 10, 10);
            place_group(&mut stack, &g);
            pushed.extend(g);
            for b in 990..1170 {
                assert_eq!(shows(&stack, b), shows(&pushed, b), "block {b}");
            }
        }
        assert_eq!(
            stack,
            [
                Frame::plain(1),
                window(0, 1000, 1160, 0),
                window(3, 1000, 1160, 0)
            ]
        );
        assert_eq!(
            layer_ref_changes(&pushed, &stack),
            BTreeMap::from([(3, -15)])
        );
    }

    #[test]
    fn a_group_never_moves_below_a_frame_that_shows_its_window() {
        let embedded = [Frame::plain(3)];
        let mut stack = vec![Frame::plain(1)];
        place_group(&mut stack, &group_for(&embedded, 0, 100, 10));
        // Another copy over [105, 115) from layer 4, then the segment [110, 120) from layer 3:
        // it may not join the first group below the layer-4 group it overlaps.
        place_group(&mut stack, &group_for(&[Frame::plain(4)], 0, 105, 10));
        let g = group_for(&embedded, 10, 110, 10);
        let mut pushed = stack.clone();
        pushed.extend(g.iter().copied());
        place_group(&mut stack, &g);
        assert_eq!(stack, pushed);
        // A snapshot (a plain frame) between: no join either.
        let mut stack = vec![Frame::plain(1)];
        place_group(&mut stack, &group_for(&embedded, 0, 100, 10));
        stack.push(Frame::plain(2));
        place_group(&mut stack, &group_for(&embedded, 10, 110, 10));
        assert_eq!(stack.len(), 6);
    }
}
