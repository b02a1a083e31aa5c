//! Snapshots and clones: metadata operations whose cost does not depend on the data size.
//!
//! A volume's map is a stack of layers; only the top one is written. A **snapshot** freezes
//! the top layer (the snapshot's stack is the volume's stack as it was) and gives the volume a
//! new, empty top layer. A **clone** is a new volume whose stack is its source's frozen stack
//! plus a new top layer of its own. Layers are reference-counted by the stacks that include
//! them (`layers` table); a layer no stack includes is deleted at the next commit, dropping its
//! chunk references. Snapshot and clone change no chunk reference counts and touch no data.
//!
//! Freezing a live volume's top layer needs a moment with no uncommitted change to it: the
//! operation commits, then takes the gate exclusively (no write in flight) and checks the
//! volume has no dirty entries, retrying if a write slipped in between.

use crate::commit_state::CommitState;
use crate::error::{Error, Result};
use crate::format::{self, Frame, VolumeFormat, VolumeRecord, LAYERS_MAX};
use crate::inner::Inner;
use crate::layer_filter::LayerFilters;
use crate::map_table;
use crate::meta;
use crate::pool::{validate_volume_name, Pool};
use crate::ref_log::RefLog;
use crate::store::{Reader, WriteTxn};
use crate::volume::Volume;
use crate::volume_state::{new_volume_state, VolumeMap, VolumeState};
use parking_lot::MutexGuard;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Attempts to catch a volume with no uncommitted changes before giving up.
const QUIESCE_TRIES_MAX: usize = 64;

/// Describes a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The volume it was taken of.
    pub volume: String,
    /// Snapshot name (unique per volume).
    pub name: String,
    /// Id (from the same counter as volume ids).
    pub id: u64,
    /// Size of the volume when the snapshot was taken.
    pub size_bytes: u64,
    /// Blocks mapped to data in the snapshot.
    pub mapped_blocks: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix_s: u64,
}

fn now_unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn snapshot_key(volume: &str, snapshot: &str) -> String {
    format!("{volume}@{snapshot}")
}

fn snapshot_info(key: &str, v: &VolumeState) -> SnapshotInfo {
    let (volume, name) = key.split_once('@').unwrap_or((key, ""));
    let map = v.map.lock();
    SnapshotInfo {
        volume: volume.to_string(),
        name: name.to_string(),
        id: v.id,
        size_bytes: map.size,
        mapped_blocks: map.mapped_blocks,
        created_unix_s: v.created_unix_s,
    }
}

impl Inner {
    /// Runs `f` with the commit lock, the gate held exclusively and `v`'s map locked, at a
    /// moment when `v` has no uncommitted change.
    fn with_quiesced<T>(
        &self,
        v: &VolumeState,
        f: impl FnOnce(&Inner, &mut CommitState, &mut VolumeMap) -> Result<T>,
    ) -> Result<T> {
        let mut cs = self.commit.lock();
        self.with_quiesced_in(&mut cs, &[v], |inner, cs, maps| f(inner, cs, &mut maps[0]))
    }

    /// Runs `f` with the gate held exclusively and the maps of `volumes` (distinct) locked in
    /// that order, at a moment when none has an uncommitted change. The caller holds the
    /// commit lock (`cs` is its content).
    pub(crate) fn with_quiesced_in<T>(
        &self,
        cs: &mut CommitState,
        volumes: &[&VolumeState],
        f: impl FnOnce(&Inner, &mut CommitState, &mut [MutexGuard<'_, VolumeMap>]) -> Result<T>,
    ) -> Result<T> {
        let mut tries = 0;
        let mut settling = 0;
        while tries < QUIESCE_TRIES_MAX {
            self.commit_with(cs)?;
            // Zeroed ranges take several commits to settle: those do not count as tries.
            if settling < crate::inner::SETTLE_COMMITS_MAX
                && volumes.iter().any(|v| v.map.lock().has_zeroed())
            {
                settling += 1;
                continue;
            }
            tries += 1;
            let _gate = self.gate.write();
            // Only holders of the commit lock take two maps at once, so the order is free.
            let mut maps = Vec::with_capacity(volumes.len());
            for v in volumes {
                let map = v.map.lock();
                if map.deleted {
                    return Err(Error::NotFound(v.name.clone()));
                }
                maps.push(map);
            }
            if maps
                .iter()
                .all(|m| m.dirty.is_empty() && m.committing.is_empty())
            {
                let out = f(self, cs, &mut maps)?;
                for m in maps.iter_mut() {
                    m.generation += 1;
                }
                return Ok(out);
            }
        }
        let names: Vec<&str> = volumes.iter().map(|v| v.name.as_str()).collect();
        Err(Error::Metadata(format!(
            "volume {} kept changing; try again",
            names.join(", ")
        )))
    }

    /// The record of `v` with `stack`, from its locked (quiesced) map.
    pub(crate) fn record_of(
        &self,
        v: &VolumeState,
        map: &VolumeMap,
        stack: Vec<Frame>,
    ) -> VolumeRecord {
        VolumeRecord {
            id: v.id,
            size: map.size,
            mapped_blocks: map.mapped_blocks,
            created_unix_s: v.created_unix_s,
            layers: stack,
            format: v.format(),
        }
    }

    /// Writes records and layer refcount changes in one durable transaction.
    fn write_catalog(
        &self,
        cs: &mut CommitState,
        volumes: &[(&str, &VolumeRecord)],
        snapshots: &[(&str, &VolumeRecord)],
        layer_increments: &[u64],
        new_layers: &[u64],
        ids_used: u64,
    ) -> Result<()> {
        self.write_catalog_with(
            cs,
            volumes,
            snapshots,
            layer_increments,
            new_layers,
            ids_used,
            |_, _| Ok(()),
        )
    }

    /// [`Inner::write_catalog`] with more changes (`extra`) in the same transaction.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_catalog_with(
        &self,
        cs: &mut CommitState,
        volumes: &[(&str, &VolumeRecord)],
        snapshots: &[(&str, &VolumeRecord)],
        layer_increments: &[u64],
        new_layers: &[u64],
        ids_used: u64,
        extra: impl FnOnce(&mut WriteTxn, &mut RefLog) -> Result<()>,
    ) -> Result<()> {
        let mut pool_rec = cs.record.clone();
        pool_rec.next_volume_id += ids_used;
        pool_rec.next_layer_id += new_layers.len() as u64;
        let mut txn = self.db.write()?;
        {
            extra(&mut txn, &mut cs.ref_log)?;
            for (name, r) in volumes {
                txn.insert(meta::VOLUMES, *name, r.encode().as_slice());
            }
            for (name, r) in snapshots {
                txn.insert(meta::SNAPSHOTS, *name, r.encode().as_slice());
            }
            for &l in layer_increments {
                let refs = txn.get(meta::LAYERS, &l)?.unwrap_or(0);
                if refs == 0 {
                    return Err(Error::Corrupt(format!(
                        "layer {l} is in a stack but has no refcount"
                    )));
                }
                txn.insert(meta::LAYERS, &l, &(refs + 1));
            }
            for &l in new_layers {
                txn.insert(meta::LAYERS, &l, &1);
                self.layer_filters.fresh(l);
            }
            txn.insert(meta::POOL, meta::POOL_KEY, pool_rec.encode().as_slice());
        }
        txn.commit()?;
        cs.record = pool_rec;
        Ok(())
    }
}

impl Pool {
    fn snapshot_state(&self, key: &str) -> Result<Arc<VolumeState>> {
        self.inner.catalog.snapshot(key)
    }

    /// Takes a read-only point-in-time snapshot of `volume`: O(1), no data I/O, no space.
    pub fn create_snapshot(&self, volume: &str, snapshot: &str) -> Result<SnapshotInfo> {
        validate_volume_name(snapshot)?;
        self.inner.check_failed()?;
        let key = snapshot_key(volume, snapshot);
        let v = self.live_state(volume)?;
        let adding = self.inner.catalog.adding();
        let state = self.inner.with_quiesced(&v, |inner, cs, map| {
            adding.check_free(cs, &key)?;
            if map.stack.len() >= LAYERS_MAX {
                return Err(Error::InvalidArgument(format!(
                    "{volume} has {LAYERS_MAX} layers; delete snapshots first"
                )));
            }
            let new_top = cs.record.next_layer_id;
            let snap = VolumeRecord {
                id: cs.record.next_volume_id,
                size: map.size,
                mapped_blocks: map.mapped_blocks,
                created_unix_s: now_unix_s(),
                layers: map.stack.clone(),
                format: VolumeFormat::Thin,
            };
            let mut stack = map.stack.clone();
            stack.push(Frame::plain(new_top));
            let vol = VolumeRecord {
                id: v.id,
                size: map.size,
                mapped_blocks: map.mapped_blocks,
                created_unix_s: v.created_unix_s,
                layers: stack.clone(),
                format: v.format(),
            };
            let shown: Vec<u64> = format::referenced_layers(&snap.layers).collect();
            inner.write_catalog(
                cs,
                &[(volume, &vol)],
                &[(&key, &snap)],
                &shown,
                &[new_top],
                1,
            )?;
            map.stack = stack;
            Ok(Arc::new(new_volume_state(key.clone(), &snap, true)))
        })?;
        let info = snapshot_info(&key, &state);
        adding.insert(state);
        Ok(info)
    }

    /// Lists snapshots, of one volume or of all.
    pub fn list_snapshots(&self, volume: Option<&str>) -> Vec<SnapshotInfo> {
        self.inner
            .catalog
            .snapshots()
            .iter()
            .map(|s| snapshot_info(&s.name, s))
            .filter(|s| volume.is_none_or(|v| s.volume == v))
            .collect()
    }

    /// A read-only handle on a snapshot.
    pub fn snapshot(&self, volume: &str, snapshot: &str) -> Result<Volume> {
        let state = self.snapshot_state(&snapshot_key(volume, snapshot))?;
        Ok(Volume::new(self.inner.clone(), state))
    }

    /// Deletes a snapshot; clones made from it are not affected. Space only it held comes back
    /// through the cleaner.
    pub fn delete_snapshot(&self, volume: &str, snapshot: &str) -> Result<()> {
        self.inner.check_failed()?;
        let key = snapshot_key(volume, snapshot);
        {
            let _gate = self.inner.gate.write();
            self.inner.catalog.remove_snapshot(&key)?;
        }
        self.inner.commit()
    }

    /// Creates volume `new_name` as a writable clone of `source` — a volume name or
    /// `VOLUME@SNAPSHOT` — sharing all its data: O(1), no data I/O, no space. Deleting the
    /// source later does not affect the clone.
    pub fn clone_volume(&self, source: &str, new_name: &str) -> Result<Volume> {
        validate_volume_name(new_name)?;
        self.inner.check_failed()?;
        let adding = self.inner.catalog.adding();
        let record = if source.contains('@') {
            let snap = self.snapshot_state(source)?;
            let mut cs = self.inner.commit.lock();
            adding.check_free(&cs, new_name)?;
            let map = snap.map.lock();
            let clone_top = cs.record.next_layer_id;
            let mut layers = map.stack.clone();
            layers.push(Frame::plain(clone_top));
            let rec = VolumeRecord {
                id: cs.record.next_volume_id,
                size: map.size,
                mapped_blocks: map.mapped_blocks,
                created_unix_s: now_unix_s(),
                layers,
                format: VolumeFormat::Thin,
            };
            let shown: Vec<u64> = format::referenced_layers(&map.stack).collect();
            self.inner
                .write_catalog(&mut cs, &[(new_name, &rec)], &[], &shown, &[clone_top], 1)?;
            rec
        } else {
            let v = self.live_state(source)?;
            self.inner.with_quiesced(&v, |inner, cs, map| {
                adding.check_free(cs, new_name)?;
                if map.stack.len() >= LAYERS_MAX {
                    return Err(Error::InvalidArgument(format!(
                        "{source} has {LAYERS_MAX} layers"
                    )));
                }
                let (vol_top, clone_top) = (cs.record.next_layer_id, cs.record.next_layer_id + 1);
                let mut vol_stack = map.stack.clone();
                vol_stack.push(Frame::plain(vol_top));
                let mut clone_stack = map.stack.clone();
                clone_stack.push(Frame::plain(clone_top));
                let vol = VolumeRecord {
                    id: v.id,
                    size: map.size,
                    mapped_blocks: map.mapped_blocks,
                    created_unix_s: v.created_unix_s,
                    layers: vol_stack.clone(),
                    format: v.format(),
                };
                let rec = VolumeRecord {
                    id: cs.record.next_volume_id,
                    size: map.size,
                    mapped_blocks: map.mapped_blocks,
                    created_unix_s: now_unix_s(),
                    layers: clone_stack,
                    format: VolumeFormat::Thin,
                };
                let shown: Vec<u64> = format::referenced_layers(&map.stack).collect();
                inner.write_catalog(
                    cs,
                    &[(source, &vol), (new_name, &rec)],
                    &[],
                    &shown,
                    &[vol_top, clone_top],
                    1,
                )?;
                map.stack = vol_stack;
                Ok(rec)
            })?
        };
        let state = Arc::new(new_volume_state(new_name.to_string(), &record, false));
        adding.insert(state.clone());
        Ok(Volume::new(self.inner.clone(), state))
    }

    /// Creates volume `new_name` as a full clone of `source` (a volume or `VOLUME@SNAPSHOT`):
    /// its map refers to no other volume's layers, yet it still shares every chunk, so no data
    /// is read or written and no space is added. Cost: proportional to the mapped blocks (a
    /// range copy, made permanent at once).
    pub fn full_clone(&self, source: &str, new_name: &str) -> Result<Volume> {
        self.full_clone_with(
            source,
            new_name,
            &AtomicBool::new(false),
            &AtomicU64::new(0),
        )
    }

    /// [`Pool::full_clone`], counting in `walked` the bytes of the volume walked so far, and
    /// ending the walk early once `stop` is set: the clone then exists but still reads
    /// through its source's layers until the background makes it permanent (or it is deleted).
    pub fn full_clone_with(
        &self,
        source: &str,
        new_name: &str,
        stop: &AtomicBool,
        walked: &AtomicU64,
    ) -> Result<Volume> {
        let src = match source.split_once('@') {
            Some((v, s)) => self.snapshot(v, s)?,
            None => self.volume(source)?,
        };
        let dst = self.create_volume(new_name, src.size())?;
        dst.copy_from(&src, 0, 0, src.size())?;
        self.inner
            .materialize_frames(dst.state(), stop, Some(walked))?;
        if !stop.load(Ordering::Acquire) {
            walked.store(src.size(), Ordering::Relaxed);
        }
        Ok(dst)
    }
}

impl Inner {
    /// Flattens every live volume's stack: a frozen layer that no other stack includes (its
    /// snapshots and clones are gone) is merged into the layer above it, so reads stay shallow
    /// and the data the upper layer hides is released. Returns the number of merges.
    /// First, a volume's range-copy frames are made permanent (`copy/`) when it has had no
    /// range copy for a while, or at once with `now`.
    ///
    /// Gives up between steps (and inside a copy's walk) once `stop` is set, so that closing
    /// the pool waits for one step at most; what is left is done after the next open.
    pub(crate) fn flatten_all(&self, now: bool, stop: &AtomicBool) -> Result<u64> {
        let volumes = self.catalog.volumes();
        let mut merged = 0;
        let stopped = || stop.load(Ordering::Acquire);
        // All copies first: a source's frozen layers become private only once every copy of
        // them is permanent.
        for v in &volumes {
            if stopped() {
                return Ok(merged);
            }
            let due = now
                || v.frames_copied_at
                    .lock()
                    .is_none_or(|t| t.elapsed() >= crate::copy::MATERIALIZE_DELAY);
            if due && self.materialize_frames(v, stop, None)? {
                merged += 1;
            }
        }
        for v in volumes {
            while !stopped() && self.flatten_one(&v, stop)? {
                merged += 1;
            }
        }
        Ok(merged)
    }

    /// The lowest frozen layer of `stack` that only this stack includes, shown by a plain
    /// frame with a plain frame above it (windowed frames are made permanent first, see
    /// `copy/`).
    fn private_frozen_layer(&self, stack: &[Frame]) -> Result<Option<usize>> {
        if stack.len() < 2 {
            return Ok(None);
        }
        let txn = self.db.read()?;
        for (i, pair) in stack.windows(2).enumerate() {
            let (f, above) = (pair[0], pair[1]);
            if !f.is_plain() || !above.is_plain() {
                continue;
            }
            let in_this_stack = stack.iter().filter(|g| g.layer == f.layer).count();
            if in_this_stack == 1 && txn.get(meta::LAYERS, &f.layer)? == Some(1) {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// Merges one private frozen layer of `v` with the layer above it, moving the entries of
    /// the one with fewer into the other ([`merge_up`], or [`merge_down`] when the upper layer
    /// is private too): entries the upper layer overrides are dropped (their references
    /// released in the same transaction). The entries move in steps of
    /// `PoolConfig::flatten_step_entries` blocks' worth ([`Inner::merge_step`]), each with the
    /// volume quiesced, so what holds writers up is one step, not the layers' size (one
    /// transaction for 1 Mi entries held every write of the pool for ~2.5 s, and a closing
    /// pool waited for it). Gives up between steps once `stop` is set, or when the stack
    /// changed meanwhile; every state between steps reads the same, and a later call merges
    /// the rest. Returns whether the merge completed.
    fn flatten_one(&self, v: &VolumeState, stop: &AtomicBool) -> Result<bool> {
        let Some(merge) = self.plan_merge(v)? else {
            return Ok(false);
        };
        let t0 = std::time::Instant::now();
        let (mut start, mut steps) = (0, 0);
        let outcome = loop {
            steps += 1;
            match self.merge_step(v, &merge, start)? {
                MergeStep::Done => break "done",
                MergeStep::Changed => break "stopped: the stack changed",
                MergeStep::More(next) => start = next,
            }
            if stop.load(Ordering::Acquire) {
                break "stopped: the pool is closing";
            }
        };
        tracing::debug!(
            "flatten {}: layers {} and {} ({}): {outcome} after {steps} steps in {:?}",
            v.name,
            merge.lower,
            merge.upper,
            if merge.down { "down" } else { "up" },
            t0.elapsed()
        );
        Ok(outcome == "done")
    }

    /// Which layers of `v`'s stack [`Inner::flatten_one`] merges, and which way.
    fn plan_merge(&self, v: &VolumeState) -> Result<Option<Merge>> {
        let stack = v.map.lock().stack.clone();
        let Some(i) = self.private_frozen_layer(&stack)? else {
            return Ok(None);
        };
        let (lower, upper) = (stack[i].layer, stack[i + 1].layer);
        let upper_private = stack.iter().filter(|f| f.layer == upper).count() == 1
            && self.db.read()?.get(meta::LAYERS, &upper)? == Some(1);
        let smaller_above = match (
            self.layer_filters.count(lower),
            self.layer_filters.count(upper),
        ) {
            (Some(l), Some(u)) => u < l,
            _ => false,
        };
        Ok(Some(Merge {
            at: i,
            lower,
            upper,
            down: upper_private && smaller_above,
        }))
    }

    /// One step of `merge`: moves the moving layer's entries with blocks from `start` up to
    /// the block of its `flatten_step_entries`-th entry after it, in one transaction with the
    /// volume quiesced. The last step takes every entry left (for a merge down, also those
    /// the top received between steps), removes the emptied layer from the stack and writes
    /// the volume's record.
    fn merge_step(&self, v: &VolumeState, merge: &Merge, start: u64) -> Result<MergeStep> {
        let moving = if merge.down { merge.upper } else { merge.lower };
        let step = self.config.flatten_step_entries.max(1) as usize;
        // The window's end, read without locks: the step moves whatever the window holds
        // when it runs, so a write meanwhile changes only how many entries that is.
        let end = map_table::nth_block(&self.db.read()?, moving, start, step)?;
        self.with_quiesced(v, |inner, cs, map| {
            let (at, lower, upper) = (merge.at, merge.lower, merge.upper);
            if inner.private_frozen_layer(&map.stack)? != Some(at)
                || map.stack[at].layer != lower
                || map.stack[at + 1].layer != upper
            {
                return Ok(MergeStep::Changed);
            }
            let mut txn = inner.db.write()?;
            if merge.down
                && (map.stack.iter().filter(|f| f.layer == upper).count() != 1
                    || txn.get(meta::LAYERS, &upper)? != Some(1))
            {
                return Ok(MergeStep::Changed);
            }
            let bottom = at == 0;
            let filters = &inner.layer_filters;
            let mut released: BTreeMap<u64, i64> = BTreeMap::new();
            let window = start..=end.map_or(u64::MAX, |e| e - 1);
            if merge.down {
                // The top may have received entries below `start` since the earlier steps:
                // the last step takes them too, since the layer leaves the stack.
                let window = if end.is_none() { 0..=u64::MAX } else { window };
                merge_down(&mut txn, filters, lower, upper, bottom, window, &mut released)?;
            } else {
                // `lower` is frozen: nothing is written to it between the steps.
                merge_up(&mut txn, filters, lower, upper, bottom, window, &mut released)?;
            }
            cs.ref_log
                .append(&mut txn, &crate::ref_log::by_slice(&released));
            let Some(end) = end else {
                let mut stack = map.stack.clone();
                let gone = if merge.down {
                    stack.remove(at + 1);
                    upper
                } else {
                    stack.remove(at);
                    lower
                };
                txn.remove(meta::LAYERS, &gone);
                let record = inner.record_of(v, map, stack.clone());
                txn.insert(meta::VOLUMES, v.name.as_str(), record.encode().as_slice());
                txn.commit()?;
                map.merge_steps += 1;
                inner.layer_filters.forget(gone);
                inner.event(|| {
                    let (from, to) = if merge.down {
                        (upper, lower)
                    } else {
                        (lower, upper)
                    };
                    format!(
                        "flatten {}: layer {from} merged {} layer {to} from block {start}: {} -> {}",
                        v.name,
                        if merge.down { "down into" } else { "up into" },
                        format::describe_stack(&map.stack),
                        format::describe_stack(&stack)
                    )
                });
                map.stack = stack;
                return Ok(MergeStep::Done);
            };
            txn.commit()?;
            map.merge_steps += 1;
            inner.event(|| {
                format!(
                    "flatten {}: layer {moving} blocks {start}..{end} moved {} layer {}",
                    v.name,
                    if merge.down { "down into" } else { "up into" },
                    if merge.down { lower } else { upper },
                )
            });
            Ok(MergeStep::More(end))
        })
    }
}

/// Two adjacent layers of a stack that flattening merges: `lower` (frozen, private to the
/// stack) at index `at` and `upper` above it; `down`: `upper`'s entries move into `lower`,
/// which takes its place, else `lower`'s move up.
struct Merge {
    at: usize,
    lower: u64,
    upper: u64,
    down: bool,
}

/// The outcome of one [`Inner::merge_step`].
#[derive(Debug, PartialEq, Eq)]
enum MergeStep {
    /// The next step starts at this block.
    More(u64),
    /// The merge is complete: one layer left the stack.
    Done,
    /// The stack changed since the merge was planned; nothing was moved by this step.
    Changed,
}

/// The block range `blocks` as `[b0, b1)`.
fn span(blocks: &std::ops::RangeInclusive<u64>) -> (u64, u64) {
    (*blocks.start(), blocks.end().saturating_add(1))
}

/// A window's entries taken from one layer, (block, chunk id) ascending, and the receiving
/// layer's entries there, by block.
type Taken = (Vec<(u64, u64)>, BTreeMap<u64, u64>);

/// Removes the entries of layer `from` with blocks in `blocks` in `txn` and returns them as
/// (block, chunk id), having grown layer `into`'s filter with their blocks (before the
/// commit, as the filters require: `layer_filter.rs`), with `into`'s own entries in `blocks`
/// (one range read, not a lookup per moved entry).
fn take_entries(
    txn: &mut WriteTxn,
    filters: &LayerFilters,
    from: u64,
    into: u64,
    blocks: &std::ops::RangeInclusive<u64>,
) -> Result<Taken> {
    let (b0, b1) = span(blocks);
    let taken = map_table::take_all(txn, from, b0, b1)?;
    filters.grow(into, taken.iter().map(|&(block, _)| block));
    let there = map_table::entries(txn, into, b0, b1)?.into_iter().collect();
    Ok((taken, there))
}

/// Moves frozen layer `lower`'s entries with blocks in `blocks` up into `upper`, the layer
/// above it, where `upper` has none (an entry `upper` has overrides; its reference goes to
/// `released`). `bottom`: `lower` is the stack's lowest layer, so once its entries in
/// `blocks` are gone, `upper`'s tombstones there hide nothing and go too.
fn merge_up(
    txn: &mut WriteTxn,
    filters: &LayerFilters,
    lower: u64,
    upper: u64,
    bottom: bool,
    blocks: std::ops::RangeInclusive<u64>,
    released: &mut BTreeMap<u64, i64>,
) -> Result<()> {
    let (moved, above) = take_entries(txn, filters, lower, upper, &blocks)?;
    let mut map = map_table::Changes::new();
    for (block, id) in moved {
        if above.contains_key(&block) {
            if id != format::ZERO_TOMBSTONE {
                *released.entry(id).or_default() -= 1;
            }
        } else if id != format::ZERO_TOMBSTONE || !bottom {
            map.set(upper, block, id);
        }
    }
    if bottom {
        for (&block, &id) in &above {
            if id == format::ZERO_TOMBSTONE {
                map.remove(upper, block);
            }
        }
    }
    map.write(txn)
}

/// Moves layer `upper`'s entries with blocks in `blocks` down into frozen layer `lower`, the
/// layer below it, which takes its place in the stack once all have moved (both are private
/// to the stack). An entry of `upper`
/// replaces `lower`'s (whose reference goes to `released`); a tombstone of `upper` removes
/// `lower`'s entry when `lower` is the stack's lowest layer (`bottom`: it hides nothing), and
/// replaces it otherwise.
fn merge_down(
    txn: &mut WriteTxn,
    filters: &LayerFilters,
    lower: u64,
    upper: u64,
    bottom: bool,
    blocks: std::ops::RangeInclusive<u64>,
    released: &mut BTreeMap<u64, i64>,
) -> Result<()> {
    let (moved, below) = take_entries(txn, filters, upper, lower, &blocks)?;
    let mut map = map_table::Changes::new();
    for (block, id) in moved {
        if let Some(&old) = below.get(&block) {
            if old != format::ZERO_TOMBSTONE {
                *released.entry(old).or_default() -= 1;
            }
        }
        if id == format::ZERO_TOMBSTONE && bottom {
            map.remove(lower, block);
        } else {
            map.set(lower, block, id);
        }
    }
    map.write(txn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolConfig;

    const BLOCK: usize = 4096;
    const BLOCKS: u64 = 64;

    use crate::test_data::noise_block as block;

    /// A merge between its steps reads the same and takes writes in the windows moved and not
    /// yet moved; its remaining steps then complete it, or, left as a closing pool leaves it,
    /// it survives a reopen and the background completes it: one merge up (a rewritten
    /// volume's deleted snapshot) and one down (a snapshot's layer under a few writes; its
    /// last step must also take what the top received behind the steps), each with `verify`
    /// passing at every stage.
    #[test]
    fn a_merge_stopped_between_steps_reads_the_same_and_completes_later() {
        for (few_above, reopen) in [(false, false), (true, false), (false, true), (true, true)] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("pool");
            let config = PoolConfig {
                capacity_bytes: Some(1 << 30),
                capacity_force: true,
                background: false,
                flatten_step_entries: 8,
                ..PoolConfig::default()
            };
            let pool = Pool::create(&path, config.clone()).expect("create");
            let v = pool
                .create_volume("v", BLOCKS * BLOCK as u64)
                .expect("volume");
            let mut want: Vec<Vec<u8>> = (0..BLOCKS).map(|b| block(b + 1)).collect();
            let put = |want: &mut Vec<Vec<u8>>, b: u64, seed: u64| {
                if seed == 0 {
                    v.write_zeroes(b * BLOCK as u64, BLOCK as u64, false)
                        .expect("zero");
                    want[b as usize] = vec![0; BLOCK];
                } else {
                    v.write(b * BLOCK as u64, &block(seed), false)
                        .expect("write");
                    want[b as usize] = block(seed);
                }
            };
            for b in 0..BLOCKS {
                put(&mut want, b, b + 1);
            }
            pool.create_snapshot("v", "s").expect("snapshot");
            let rewritten = if few_above { 0..20 } else { 0..BLOCKS };
            for b in rewritten {
                put(&mut want, b, 100 + b);
            }
            pool.sync().expect("sync");
            pool.delete_snapshot("v", "s").expect("delete snapshot");

            let inner = &pool.inner;
            let merge = inner
                .plan_merge(v.state())
                .expect("plan")
                .expect("a layer to merge");
            assert_eq!(merge.down, few_above, "direction");
            let next = match inner.merge_step(v.state(), &merge, 0).expect("step") {
                MergeStep::More(next) => next,
                other => panic!("first step: {other:?}"),
            };
            assert_eq!(v.stack_depth(), 2, "both layers stay until the last step");
            let check = |want: &Vec<Vec<u8>>, when: &str| {
                let v = pool.volume("v").expect("volume");
                for (b, w) in want.iter().enumerate() {
                    let mut one = vec![0u8; BLOCK];
                    v.read(b as u64 * BLOCK as u64, &mut one).expect("read");
                    assert!(
                        &one == w,
                        "{when} (down: {few_above}, reopen: {reopen}): block {b}"
                    );
                }
                let mapped = want.iter().filter(|w| w.iter().any(|&x| x != 0)).count();
                assert_eq!(v.mapped_blocks(), mapped as u64, "{when}: mapped");
                pool.verify()
                    .unwrap_or_else(|e| panic!("{when} (down: {few_above}): verify: {e}"));
            };
            check(&want, "after one step");
            // Writes and zeroes in the moved window and beyond it.
            let (moved, not_moved) = (next - 1, BLOCKS - 2);
            put(&mut want, moved, 7000);
            put(&mut want, 0, 0);
            put(&mut want, not_moved, 7001);
            put(&mut want, not_moved + 1, 0);
            pool.sync().expect("sync");
            check(&want, "written between steps");
            if !reopen {
                let mut start = next;
                while let MergeStep::More(next) =
                    inner.merge_step(v.state(), &merge, start).expect("step")
                {
                    start = next;
                }
                assert_eq!(v.stack_depth(), 1, "merged by its steps");
                check(&want, "merged by its steps");
            }
            drop(v);
            pool.close().expect("close");

            let pool = Pool::open(&path, config).expect("open");
            let v = pool.volume("v").expect("volume");
            assert_eq!(v.stack_depth(), if reopen { 2 } else { 1 }, "reopened");
            pool.gc_now().expect("gc");
            assert_eq!(v.stack_depth(), 1, "merged after the reopen");
            for (b, w) in want.iter().enumerate() {
                let mut one = vec![0u8; BLOCK];
                v.read(b as u64 * BLOCK as u64, &mut one).expect("read");
                assert!(&one == w, "merged (down: {few_above}): block {b}");
            }
            let mapped = want.iter().filter(|w| w.iter().any(|&x| x != 0)).count();
            assert_eq!(v.mapped_blocks(), mapped as u64, "merged: mapped");
            pool.verify().expect("verify once merged");
        }
    }
}
