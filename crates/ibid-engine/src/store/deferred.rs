//! The deferred table: committed changes to [`DEFERRED`] (the map's pages) are appended to a
//! log ([`LOG`]) and written back to the table's B-tree later, a sixteenth of the key space at
//! a time.
//!
//! Why: random overwrites of a large volume change one map page per block, and a commit of a
//! second's worth of them (30–100 Ki blocks over a 16 GiB volume's 256 Ki pages) touched
//! nearly every leaf of the map's copy-on-write B-tree: ~1 KB written per overwrite, the
//! whole map per commit (`ibid-bench map-overwrites`, the store alone: 288 bytes and a third
//! less time deferred; BENCHMARKS.md, "The map's writes deferred"). Here a
//! commit writes its changed pages once, packed into a few log rows, and writes back one
//! **slice** of the pending pages: each page written back once for up to sixteen commits'
//! changes, the leaves of a slice rewritten together.
//!
//! - **Slices**: a key's slice is that of its stretch of 256 neighbouring pages ([`slice_of`]),
//!   so a slice's pages are whole runs of B-tree leaves.
//! - **Log rows** ([`LOG`]): key `slice << 56 | sequence` (a sequence number per row, from one
//!   counter for all slices), value: the changes of one commit to one slice, in key order
//!   (format below). The rows of a slice are deleted by the commit that writes the slice back.
//! - **Pending** (in memory, [`Pending`]): every change logged and not yet written back, per
//!   slice a few layers (a log row's changes, or several rows' merged), the newest change to a
//!   key winning; loaded from the log at open. Reads of the table see pending over the B-tree.
//! - **Each commit** (of a non-empty batch): its changes to the table leave the batch for one
//!   log row per slice they touch; the pending changes of the slice whose turn it is (slices
//!   with nothing pending are skipped) go into the batch as the table's writes, with deletes
//!   of that slice's log rows; more slices, the fullest first, while pending would hold more
//!   than [`PENDING_MAX`] changes. The commit's own changes always stay pending, even in a
//!   slice written back now. A commit's cost follows its own changes and the slices it writes
//!   back, not all that is pending.
//!
//! Readers pair a pending state with a snapshot of the backend ([`super::Store::read`] takes
//! both under one lock). A commit publishes its pending state only after the backend's new
//! snapshot is in place, so a reader gets either both from before, the new snapshot with the
//! pending state from before, or both new. The second reads as the state before the commit:
//! what the commit wrote back to the B-tree is exactly what that pending state holds for the
//! slices written back (its own changes went only to the log), and pending shadows the
//! B-tree. The old pending state with an even newer snapshot cannot happen: commits are
//! serialized, and each publishes before the next begins.
//!
//! # Log row format (value of a [`LOG`] row)
//!
//! ```text
//! count u32 LE
//! count times, in key order:
//!   key_len u16 LE | key | tag u8 | tag 1: value_len u32 LE | value
//!                                   tag 2: a page delta (`map_page.rs`)
//! ```
//!
//! Tag 0: the key is deleted; 1: set to the value; 2: the page it held (as of the row before
//! in its slice, or the B-tree if none) changed by the delta. A commit logs a change to a page
//! that exists as a delta (12 bytes for one changed entry, instead of the whole page's ~130:
//! random overwrites change one entry per page), a new page whole. Rows of pool format 13 and
//! older hold tags 0 and 1 only.

use super::{Batch, Codec, Snapshot, Table};
use crate::error::{Error, Result};
use crate::map_page;
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Bound;
use std::sync::Arc;

/// The table whose writes are deferred.
pub const DEFERRED: Table = Table::MapPages;
/// Its log.
pub const LOG: Table = Table::MapLog;
/// Slices of the key space.
pub const SLICES: usize = 16;
/// Pending changes (counted as in [`Pending::len`]) past which a commit writes back more than
/// one slice (~200 bytes of memory each with a map page's value).
pub const PENDING_MAX: usize = 512 << 10;
/// Log row keys: the slice in the top byte, the sequence below.
const SEQ_BITS: u32 = 56;

/// A key or value shared between pending states (a commit's new state reuses the old one's).
pub type Bytes = Arc<[u8]>;
/// A pending change: the key, and its value (`None`: deleted).
pub type Change = (Bytes, Option<Bytes>);
/// Reads a key's value as of before a commit's changes (`None`: absent): the base of the
/// commit's page deltas.
pub type Before<'a> = dyn Fn(&[u8]) -> Result<Option<Vec<u8>>> + 'a;

/// How a commit's changes are logged: `deltas`, the page deltas its writers gave (over the
/// committed pages), by key; for any other change, `committed` reads the value the change
/// replaces (the base of a delta computed here).
pub struct Logged<'a> {
    /// Deltas given, by key.
    pub deltas: &'a FxHashMap<[u8; 16], Vec<u8>>,
    /// Reads a key's committed value.
    pub committed: &'a Before<'a>,
}

/// The slice of `key`: its stretch of 256 keys, taken from the last 8 bytes (a map page key's
/// page number) with the first 8 (its layer) mixed in so every layer's first stretch is not in
/// slice 0.
pub fn slice_of(key: &[u8]) -> usize {
    let word = |b: &[u8]| {
        let mut w = [0u8; 8];
        let n = b.len().min(8);
        w[8 - n..].copy_from_slice(&b[b.len() - n..]);
        u64::from_be_bytes(w)
    };
    let (head, tail) = key.split_at(key.len().saturating_sub(8));
    let stretch = (word(tail) >> 8).wrapping_add(word(&head[..head.len().min(8)]));
    (stretch % SLICES as u64) as usize
}

/// Commits' changes to one slice, in key order, and by key: one log row's, or the merge of
/// several (the newest change to a key kept).
///
/// The index is for point reads: every 4 KiB overwrite reads its block's committed entry,
/// and a binary search of half a million keys, each behind its own pointer, was 14 % of the
/// writers' CPU in a steady random overwrite.
#[derive(Debug)]
struct Layer {
    changes: Vec<Change>,
    index: FxHashMap<Bytes, Option<Bytes>>,
}

impl Layer {
    fn new(changes: Vec<Change>) -> Arc<Layer> {
        let index = changes.iter().cloned().collect();
        Arc::new(Layer { changes, index })
    }

    /// The changes with keys in `(lo, hi)`.
    fn within(&self, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> &[Change] {
        let c = &self.changes;
        let start = match lo {
            Bound::Included(l) => c.partition_point(|(k, _)| &**k < l),
            Bound::Excluded(l) => c.partition_point(|(k, _)| &**k <= l),
            Bound::Unbounded => 0,
        };
        let end = match hi {
            Bound::Included(h) => c.partition_point(|(k, _)| &**k <= h),
            Bound::Excluded(h) => c.partition_point(|(k, _)| &**k < h),
            Bound::Unbounded => c.len(),
        };
        &c[start..end.max(start)]
    }
}

/// Layers a slice may stack before its newest ones are merged whatever their sizes.
const LAYERS_MAX: usize = 8;

/// Changes logged and not yet written back: per slice, a stack of layers, the newest change
/// to a key winning.
///
/// A commit adds a layer per slice it changes and drops the layers of the slices it writes
/// back: its cost follows its own changes, not what is pending (cloning one map of every
/// pending change per commit was 12 % of the commit thread under random overwrites). The
/// newest layer is merged into the one below while that one is no larger (a binary
/// counter: a change is copied about log₂ of the commits its slice stays pending, and a
/// slice holds about that many layers), so a point read looks in a few small maps.
#[derive(Debug, Default, Clone)]
pub struct Pending {
    /// Per slice, its layers, oldest first.
    slices: [Vec<Arc<Layer>>; SLICES],
}

impl Pending {
    /// The pending change to `key`, if any: `Some(None)` for a delete.
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.slices[slice_of(key)]
            .iter()
            .rev()
            .find_map(|layer| layer.index.get(key))
            .map(Option::as_deref)
    }

    /// The pending changes with keys in `(lo, hi)`, in key order.
    pub fn range(&self, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Vec<&Change> {
        let slices = slices_within(lo, hi);
        newest_per_key(
            (0..SLICES)
                .filter(|&s| slices[s])
                .flat_map(|s| self.slices[s].iter().map(|l| l.within(lo, hi))),
        )
    }

    /// Changes pending, counted once per layer they are in.
    pub fn len(&self) -> usize {
        (0..SLICES).map(|s| self.in_slice(s)).sum()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Changes pending in slice `s`, counted as in [`Pending::len`].
    fn in_slice(&self, s: usize) -> usize {
        self.slices[s].iter().map(|l| l.changes.len()).sum()
    }

    /// Stacks `changes` (in key order, one per key, all of slice `s`) over the slice's layers.
    fn push(&mut self, s: usize, changes: Vec<Change>) {
        let layers = &mut self.slices[s];
        layers.push(Layer::new(changes));
        while let [.., older, newer] = &layers[..] {
            if older.changes.len() > newer.changes.len() && layers.len() <= LAYERS_MAX {
                break;
            }
            let merged: Vec<Change> = newest_per_key([&older.changes[..], &newer.changes[..]])
                .into_iter()
                .cloned()
                .collect();
            layers.truncate(layers.len() - 2);
            layers.push(Layer::new(merged));
        }
    }

    /// Drops slice `s`'s layers (written back).
    fn drop_slice(&mut self, s: usize) {
        self.slices[s].clear();
    }
}

/// The newest change to each key in `runs` (each in key order; a run's changes newer than an
/// earlier run's for the same key), in key order.
fn newest_per_key<'a>(runs: impl IntoIterator<Item = &'a [Change]>) -> Vec<&'a Change> {
    let runs: Vec<&[Change]> = runs.into_iter().filter(|r| !r.is_empty()).collect();
    match runs[..] {
        [run] => return run.iter().collect(),
        [older, newer] => return newer_over(older, newer),
        _ => {}
    }
    // A min-heap of each run's next change (key, newest run first, position in its run).
    type Head<'k> = Reverse<(&'k [u8], Reverse<usize>, usize)>;
    let mut heap: BinaryHeap<Head> = runs
        .iter()
        .enumerate()
        .map(|(r, run)| Reverse((&*run[0].0, Reverse(r), 0)))
        .collect();
    let mut out: Vec<&Change> = Vec::with_capacity(runs.iter().map(|r| r.len()).sum());
    while let Some(Reverse((key, Reverse(r), at))) = heap.pop() {
        if out.last().is_none_or(|c| *c.0 != *key) {
            out.push(&runs[r][at]);
        }
        if let Some(next) = runs[r].get(at + 1) {
            heap.push(Reverse((&*next.0, Reverse(r), at + 1)));
        }
    }
    out
}

/// [`newest_per_key`] of two runs (a layer's merge): one pass, no heap.
fn newer_over<'a>(older: &'a [Change], newer: &'a [Change]) -> Vec<&'a Change> {
    let mut out = Vec::with_capacity(older.len() + newer.len());
    let (mut o, mut n) = (older.iter().peekable(), newer.iter().peekable());
    while let (Some(a), Some(b)) = (o.peek(), n.peek()) {
        match a.0.cmp(&b.0) {
            std::cmp::Ordering::Less => out.extend(o.next()),
            std::cmp::Ordering::Greater => out.extend(n.next()),
            std::cmp::Ordering::Equal => {
                o.next();
                out.extend(n.next());
            }
        }
    }
    out.extend(o);
    out.extend(n);
    out
}

/// The slices that may hold keys in `(lo, hi)`: those of the stretches between two map keys
/// of one layer, fewer than [`SLICES`] of them; else every slice.
fn slices_within(lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> [bool; SLICES] {
    fn key(b: Bound<&[u8]>) -> Option<&[u8]> {
        match b {
            Bound::Included(k) | Bound::Excluded(k) => Some(k),
            Bound::Unbounded => None,
        }
    }
    let (Some(l), Some(h)) = (key(lo), key(hi)) else {
        return [true; SLICES];
    };
    let stretch = |k: &[u8]| u64::from_be_bytes(k[8..].try_into().expect("8 bytes")) >> 8;
    if l.len() != 16 || h.len() != 16 || l[..8] != h[..8] {
        return [true; SLICES];
    }
    let (first, last) = (stretch(l), stretch(h));
    if last < first || last - first >= SLICES as u64 {
        return [true; SLICES];
    }
    let mut out = [false; SLICES];
    let mut probe = [0u8; 16];
    probe[..8].copy_from_slice(&l[..8]);
    for st in first..=last {
        probe[8..].copy_from_slice(&(st << 8).to_be_bytes());
        out[slice_of(&probe)] = true;
    }
    out
}

/// The log's bookkeeping: changed only by commits (which the store serializes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct LogState {
    /// Per slice, the keys of its log rows.
    rows: [Vec<u64>; SLICES],
    /// Sequence number of the next row.
    next_seq: u64,
    /// The slice whose turn it is to be written back.
    next_slice: usize,
}

/// A commit's plan: what to publish once its batch is durable.
pub struct Staged {
    pending: Arc<Pending>,
    log: LogState,
}

/// The deferred table's state: the pending changes readers see, and the log's bookkeeping.
#[derive(Debug, Default)]
pub struct Deferred {
    /// Read-locked by readers while they take their snapshot (they never wait for each
    /// other), write-locked by a commit to publish.
    published: RwLock<Arc<Pending>>,
    log: Mutex<LogState>,
}

impl Deferred {
    /// Loads the pending changes and the log's bookkeeping from `snap`'s log rows.
    pub fn load(snap: &dyn Snapshot) -> Result<Deferred> {
        let started = std::time::Instant::now();
        let mut log = LogState::default();
        let mut pending = Pending::default();
        // Rows in key order: each slice's in sequence order, so a later change stacks higher.
        let rows: Vec<(u64, Vec<u8>)> = snap
            .range(LOG, Bound::Unbounded, Bound::Unbounded)?
            .map(|item| {
                let (k, v) = item?;
                Ok((u64::decode(&k)?, v))
            })
            .collect::<Result<_>>()?;
        // The B-tree's pages under the keys whose first logged change is a delta, read in key
        // order before the rows are applied.
        let mut seen: rustc_hash::FxHashSet<&[u8]> = Default::default();
        let mut bases: Vec<&[u8]> = Vec::new();
        for (row, v) in &rows {
            for (key, stored) in parse_row(*row, v)? {
                if seen.insert(key) && matches!(stored, Stored::Delta(_)) {
                    bases.push(key);
                }
            }
        }
        bases.sort_unstable();
        let read_at = std::time::Instant::now();
        let bases = read_bases(snap, &bases)?;
        let bases_took = read_at.elapsed();
        for (row, v) in &rows {
            let row = *row;
            let slice = (row >> SEQ_BITS) as usize;
            if slice >= SLICES {
                return Err(Error::Corrupt(format!(
                    "map log row {row:#x}: slice {slice}"
                )));
            }
            let changes = decode_row(row, v, &mut |key: &[u8]| match pending.get(key) {
                Some(v) => Ok(v.map(Bytes::from)),
                None => match bases.get(key) {
                    Some(v) => Ok(v.clone()),
                    None => Ok(snap.get(DEFERRED, key)?.map(Bytes::from)),
                },
            })?;
            if let Some((k, _)) = changes.iter().find(|(k, _)| slice_of(k) != slice) {
                return Err(Error::Corrupt(format!(
                    "map log row {row:#x}: key {k:02x?} not of slice {slice}"
                )));
            }
            pending.push(slice, changes);
            log.rows[slice].push(row);
            log.next_seq = log.next_seq.max((row & ((1 << SEQ_BITS) - 1)) + 1);
        }
        if !rows.is_empty() {
            tracing::info!(
                "map log: {} rows, {} changes pending, {} base pages read in {:.3} s; \
                 loaded in {:.3} s",
                rows.len(),
                pending.len(),
                bases.len(),
                bases_took.as_secs_f64(),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(Deferred {
            published: RwLock::new(Arc::new(pending)),
            log: Mutex::new(log),
        })
    }

    /// The pending state commits have published; `with` runs while no commit can publish,
    /// so that what it takes (a backend snapshot) goes with it.
    pub fn pending_with<T>(&self, with: impl FnOnce() -> T) -> (Arc<Pending>, T) {
        let published = self.published.read();
        let t = with();
        (published.clone(), t)
    }

    /// Moves the deferred table's changes in `batch` over `pending` (the state the batch was
    /// made on) into log rows, and adds the writes back of the slices due (see the module
    /// documentation), or of every slice with `all`. Nothing changes here until
    /// [`Deferred::publish`].
    ///
    /// `logged` gives the changes' page deltas, or their bases (`pending` over the table's
    /// B-tree).
    pub fn stage(
        &self,
        batch: &mut Batch,
        pending: &Pending,
        all: bool,
        logged: &Logged,
    ) -> Result<Staged> {
        let mut log = self.log.lock().clone();
        let ops = &mut batch.tables[DEFERRED.index()];
        let mut new: [Vec<Change>; SLICES] = Default::default();
        for (k, v) in ops.sorted() {
            new[slice_of(k)].push((Bytes::from(k), v.map(Bytes::from)));
        }
        ops.clear();

        // The slices written back: the next one with anything pending, then the fullest while
        // too much would stay.
        let per_slice: [usize; SLICES] = std::array::from_fn(|s| pending.in_slice(s));
        let mut back = [all; SLICES];
        let new_len: usize = new.iter().map(Vec::len).sum();
        let mut staying = if all {
            new_len
        } else {
            per_slice.iter().sum::<usize>() + new_len
        };
        if let Some(s) = (0..SLICES)
            .filter(|_| !all)
            .map(|i| (log.next_slice + i) % SLICES)
            .find(|&s| per_slice[s] > 0)
        {
            back[s] = true;
            staying -= per_slice[s];
            log.next_slice = (s + 1) % SLICES;
        }
        while staying > PENDING_MAX {
            let Some(s) = (0..SLICES)
                .filter(|&s| !back[s] && per_slice[s] > 0)
                .max_by_key(|&s| per_slice[s])
            else {
                break;
            };
            back[s] = true;
            staying -= per_slice[s];
        }

        let mut next = pending.clone();
        for s in (0..SLICES).filter(|&s| back[s]) {
            let table = &mut batch.tables[DEFERRED.index()];
            let layers = pending.slices[s].iter().map(|l| &l.changes[..]);
            let mut stretch: Option<Vec<u8>> = None;
            for (k, v) in newest_per_key(layers) {
                // Each stretch written back is offered for packing (see `WriteTxn::pack`).
                let head = &k[..k.len().saturating_sub(1)];
                if stretch.as_deref() != Some(head) {
                    let (mut lo, mut hi) = (head.to_vec(), head.to_vec());
                    lo.push(0);
                    hi.push(u8::MAX);
                    table.pack(lo, hi);
                    stretch = Some(head.to_vec());
                }
                table.set(k.to_vec(), v.as_deref().map(<[u8]>::to_vec));
            }
            let rows = &mut batch.tables[LOG.index()];
            for row in std::mem::take(&mut log.rows[s]) {
                rows.set(row.encode(), None);
            }
            next.drop_slice(s);
        }
        // The commit's own changes: a log row and a layer per slice they touch.
        for (s, changes) in new.into_iter().enumerate() {
            if changes.is_empty() {
                continue;
            }
            let row = (s as u64) << SEQ_BITS | log.next_seq;
            log.next_seq += 1;
            log.rows[s].push(row);
            let row_value = encode_row(&changes, logged)?;
            batch.tables[LOG.index()].set(row.encode(), Some(row_value));
            next.push(s, changes);
        }
        Ok(Staged {
            pending: Arc::new(next),
            log,
        })
    }

    /// Makes a staged commit's state current, once its batch is durable and the backend's
    /// snapshot shows it.
    pub fn publish(&self, staged: Staged) {
        *self.log.lock() = staged.log;
        *self.published.write() = staged.pending;
    }

    /// Checks the pending state against the log rows of `snap` (a snapshot of the last commit:
    /// no commit may run meanwhile): an error names the first difference.
    pub fn check(&self, snap: &dyn Snapshot) -> Result<()> {
        let stored = Deferred::load(snap)?;
        let (mine, stored_pending) = (self.published.read().clone(), stored.published.read());
        let all = (Bound::Unbounded, Bound::Unbounded);
        let (ours, theirs) = (mine.range(all.0, all.1), stored_pending.range(all.0, all.1));
        if ours != theirs {
            let first = ours
                .iter()
                .zip(theirs.iter())
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(theirs.len()));
            return Err(Error::Corrupt(format!(
                "map log: {} keys pending in memory, {} in the log rows; first difference at {first}",
                ours.len(),
                theirs.len()
            )));
        }
        let layers = mine
            .slices
            .iter()
            .enumerate()
            .flat_map(|(s, l)| l.iter().map(move |l| (s, l)));
        for (s, layer) in layers {
            let sound = layer.index.len() == layer.changes.len()
                && layer.changes.windows(2).all(|w| w[0].0 < w[1].0)
                && layer
                    .changes
                    .iter()
                    .all(|(k, v)| slice_of(k) == s && layer.index.get(k) == Some(v));
            if !sound {
                return Err(Error::Corrupt(format!(
                    "map log: a layer of slice {s} is out of order, in another slice or differs from its index"
                )));
            }
        }
        if self.log.lock().rows != stored.log.lock().rows {
            return Err(Error::Corrupt(
                "map log: rows differ from the ones in memory".into(),
            ));
        }
        Ok(())
    }
}

/// The log row of `changes` (one slice's, in key order), with the page deltas `logged` gives
/// or lets compute.
fn encode_row(changes: &[Change], logged: &Logged) -> Result<Vec<u8>> {
    let mut out = (changes.len() as u32).to_le_bytes().to_vec();
    for (k, v) in changes {
        out.extend_from_slice(&(k.len() as u16).to_le_bytes());
        out.extend_from_slice(k);
        let Some(v) = v else {
            out.push(0);
            continue;
        };
        let given = <&[u8; 16]>::try_from(&**k)
            .ok()
            .and_then(|k| logged.deltas.get(k));
        if let Some(delta) = given {
            debug_assert_eq!(
                Some(delta),
                map_page::delta(k, (logged.committed)(k)?.as_deref(), Some(v)).as_ref(),
                "the delta given for {k:02x?}"
            );
            out.push(2);
            out.extend_from_slice(delta);
            continue;
        }
        match map_page::delta(k, (logged.committed)(k)?.as_deref(), Some(v)) {
            Some(delta) => {
                out.push(2);
                out.extend_from_slice(&delta);
            }
            None => {
                out.push(1);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
        }
    }
    Ok(out)
}

/// Rows a scan for the next of [`read_bases`]' keys passes before it seeks to that key.
const BASE_SCAN_GAP_MAX: usize = 32;

/// The deferred table's B-tree values under `keys` (sorted, distinct; `None`: absent), read by
/// scans that seek again past gaps of more than [`BASE_SCAN_GAP_MAX`] rows: where the keys are
/// most of the table (a large pending state at open), one pass over it instead of a B-tree
/// descent per key.
fn read_bases<'k>(
    snap: &dyn Snapshot,
    keys: &[&'k [u8]],
) -> Result<FxHashMap<&'k [u8], Option<Bytes>>> {
    let mut out = FxHashMap::default();
    let mut i = 0;
    while i < keys.len() {
        let mut rows = snap.range(DEFERRED, Bound::Included(keys[i]), Bound::Unbounded)?;
        let mut gap = 0;
        while i < keys.len() && gap <= BASE_SCAN_GAP_MAX {
            let Some(row) = rows.next() else {
                // The table ends: the keys left are absent.
                out.extend(keys[i..].iter().map(|k| (*k, None)));
                i = keys.len();
                break;
            };
            let (k, v) = row?;
            while i < keys.len() && keys[i] < &k[..] {
                out.insert(keys[i], None);
                i += 1;
                gap = 0;
            }
            match keys.get(i) {
                Some(key) if *key == &k[..] => {
                    out.insert(*key, Some(Bytes::from(v)));
                    i += 1;
                    gap = 0;
                }
                _ => gap += 1,
            }
        }
    }
    Ok(out)
}

/// One change of a log row, as stored.
enum Stored<'a> {
    /// Tag 0.
    Deleted,
    /// Tag 1: the value.
    Set(&'a [u8]),
    /// Tag 2: a page delta over the value before.
    Delta(&'a [u8]),
}

/// The changes of log row `row` (value `b`) as stored, in key order.
fn parse_row(row: u64, mut b: &[u8]) -> Result<Vec<(&[u8], Stored<'_>)>> {
    let corrupt = |what: &str| Error::Corrupt(format!("map log row {row:#x}: {what}"));
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (b.len() >= n).then(|| b.split_at(n))?;
        *b = rest;
        Some(head)
    }
    let truncated = || corrupt("truncated");
    let count = u32::from_le_bytes(
        take(&mut b, 4)
            .ok_or_else(truncated)?
            .try_into()
            .expect("4"),
    );
    let mut out: Vec<(&[u8], Stored)> = Vec::new();
    for _ in 0..count {
        let n = u16::from_le_bytes(
            take(&mut b, 2)
                .ok_or_else(truncated)?
                .try_into()
                .expect("2"),
        );
        let key = take(&mut b, n as usize).ok_or_else(truncated)?;
        if out.last().is_some_and(|(k, _)| *k >= key) {
            return Err(corrupt("keys out of order"));
        }
        let stored = match take(&mut b, 1).ok_or_else(truncated)?[0] {
            0 => Stored::Deleted,
            1 => {
                let n = take(&mut b, 4).ok_or_else(truncated)?;
                let n = u32::from_le_bytes(n.try_into().expect("4"));
                Stored::Set(take(&mut b, n as usize).ok_or_else(truncated)?)
            }
            2 => {
                let n = map_page::delta_len(b).ok_or_else(truncated)?;
                Stored::Delta(take(&mut b, n).ok_or_else(truncated)?)
            }
            t => return Err(corrupt(&format!("tag {t}"))),
        };
        out.push((key, stored));
    }
    if !b.is_empty() {
        return Err(corrupt("bytes after the last change"));
    }
    Ok(out)
}

/// The changes of log row `row` (value `b`); `old` gives a key's value before them (the base
/// of a page delta).
fn decode_row(
    row: u64,
    b: &[u8],
    old: &mut dyn FnMut(&[u8]) -> Result<Option<Bytes>>,
) -> Result<Vec<Change>> {
    let mut out = Vec::new();
    for (key, stored) in parse_row(row, b)? {
        let value = match stored {
            Stored::Deleted => None,
            Stored::Set(v) => Some(Bytes::from(v)),
            Stored::Delta(mut d) => map_page::apply_delta(key, old(key)?.as_deref(), &mut d)
                .map_err(|e| Error::Corrupt(format!("map log row {row:#x}: {e}")))?
                .map(Bytes::from),
        };
        out.push((Bytes::from(key), value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map page holding `entries` (slot, chunk id; a later one for a slot wins).
    fn page(entries: &[(u64, u64)]) -> Bytes {
        let slots: BTreeMap<u64, u64> = entries.iter().copied().collect();
        let present = slots.keys().fold(0u16, |m, &slot| m | 1 << slot);
        let mut b = present.to_le_bytes().to_vec();
        for id in slots.values() {
            b.extend_from_slice(&id.to_le_bytes());
        }
        Bytes::from(b)
    }

    /// A new redb store in a temporary directory (which goes when the first is dropped).
    fn redb_store() -> Result<(tempfile::TempDir, Store)> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        Ok((dir, store))
    }

    /// The bases read by scans are the B-tree's values, present or absent, whether the keys
    /// lie close together, far apart, before or past every row.
    #[test]
    fn bases_are_read_by_scans_as_by_point_reads() -> Result<()> {
        let (_dir, store) = redb_store()?;
        let mut txn = store.write()?;
        txn.write_through();
        for n in (0..2000).filter(|n| n % 3 != 0) {
            txn.insert(meta::MAP_PAGES, &key(n), page(&[(n % 16, n)]).as_ref());
        }
        txn.commit()?;
        let snap = store.backend.snapshot()?;
        let mut next = crate::test_data::xorshift(0xba5e);
        for round in 0..20 {
            // Dense runs, sparse picks and keys past the last row.
            let mut wanted: Vec<[u8; 16]> = match round % 3 {
                0 => (0..2100)
                    .filter(|_| next().is_multiple_of(2))
                    .map(key)
                    .collect(),
                1 => (0..40).map(|_| key(next() % 2100)).collect(),
                _ => (0..300)
                    .map(|_| key(next() % 300 + (next() % 8) * 250))
                    .collect(),
            };
            wanted.sort_unstable();
            wanted.dedup();
            let keys: Vec<&[u8]> = wanted.iter().map(|k| &k[..]).collect();
            let got = read_bases(&*snap, &keys)?;
            assert_eq!(got.len(), keys.len(), "round {round}");
            for k in &keys {
                assert_eq!(
                    got[k].as_deref(),
                    snap.get(DEFERRED, k)?.as_deref(),
                    "round {round}"
                );
            }
        }
        Ok(())
    }

    fn logged<'a>(deltas: &'a FxHashMap<[u8; 16], Vec<u8>>, committed: &'a Before) -> Logged<'a> {
        Logged { deltas, committed }
    }

    /// Rows decode to what was encoded — values, deletes, and changes to existing pages as
    /// deltas over the old pages; a cut, a bad tag or a delta over another page than its own
    /// is corrupt, not misread.
    #[test]
    fn rows_round_trip_and_reject_damage() {
        let a: Change = (Bytes::from(&b"aa"[..]), Some(Bytes::from(&b"value"[..])));
        let b: Change = (Bytes::from(&b"ab"[..]), None);
        let (k1, k2) = (key(1), key(3));
        let c: Change = (Bytes::from(&k1[..]), Some(page(&[(0, 7), (4, 9)])));
        let d: Change = (Bytes::from(&k2[..]), Some(page(&[(1, 5)])));
        let old: BTreeMap<Vec<u8>, Bytes> = [(k1.to_vec(), page(&[(0, 7), (4, 8)]))].into();
        let changes = vec![c, d, a.clone(), b.clone()];
        let deltas = FxHashMap::default();
        let committed = |k: &[u8]| Ok(old.get(k).map(|v| v.to_vec()));
        let row = encode_row(&changes, &logged(&deltas, &committed)).expect("encoded");
        let mut base = |k: &[u8]| Ok(old.get(k).cloned());
        assert_eq!(decode_row(1, &row, &mut base).expect("good"), changes);
        // The change to the page that existed is a delta (12 bytes), the new one whole.
        let none = |_: &[u8]| Ok(None);
        let whole = encode_row(&changes, &logged(&deltas, &none)).expect("encoded");
        assert_eq!(whole.len() - row.len(), (4 + 2 + 16) - 12);
        assert_eq!(
            decode_row(1, &whole, &mut |_: &[u8]| Ok(None)).expect("good"),
            changes
        );
        for cut in 1..row.len() {
            assert!(
                decode_row(1, &row[..cut], &mut base).is_err(),
                "cut at {cut}"
            );
        }
        let mut bad = row.clone();
        bad[8] = 7;
        assert!(matches!(
            decode_row(1, &bad, &mut base),
            Err(Error::Corrupt(_))
        ));
        let mut elsewhere = |k: &[u8]| Ok(old.get(k).map(|_| page(&[(1, 7), (4, 8)])));
        assert!(matches!(
            decode_row(1, &row, &mut elsewhere),
            Err(Error::Corrupt(_))
        ));
        let swapped = encode_row(&[b, a], &logged(&deltas, &none)).expect("encoded");
        assert!(decode_row(1, &swapped, &mut base).is_err(), "order");
    }

    use crate::meta;
    use crate::store::{Backend, Reader, Store};
    use std::collections::BTreeMap;

    fn key(n: u64) -> [u8; 16] {
        // Pages spread over stretches of every slice, in two layers.
        crate::format::map_key(1 + n % 2, (n / 2) * 97)
    }

    fn committed_b_tree(store: &Store) -> Result<BTreeMap<Vec<u8>, Vec<u8>>> {
        store
            .backend
            .snapshot()?
            .range(DEFERRED, Bound::Unbounded, Bound::Unbounded)?
            .collect()
    }

    /// Both backends: the table reads like a table through pending changes and the B-tree
    /// (point reads, ranges, a write transaction's view), a reopened store loads what was
    /// pending from the log, the B-tree lags behind what readers see (the changes are
    /// deferred), is all written back on request, and catches up within a round of the slices
    /// once the changes stop.
    #[test]
    fn pending_changes_read_like_the_table_and_survive_reopen() -> Result<()> {
        for kind in [Backend::Redb, Backend::Fjall] {
            let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
            let mut store = Store::create(dir.path(), kind)?;
            let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            let mut next = crate::test_data::xorshift(0x5eed ^ kind as u64);
            let mut lagged = false;
            for round in 0..80u64 {
                let mut txn = store.write()?;
                if round < 60 {
                    for _ in 0..next() % 40 {
                        let k = key(next() % 300);
                        if next().is_multiple_of(4) {
                            txn.remove(meta::MAP_PAGES, &k);
                            model.remove(&k[..]);
                        } else {
                            // Mostly map pages (logged as deltas over the pages they
                            // change), some other values (logged whole).
                            let v = match next() % 3 {
                                0 => format!("{round}-{}", next() % 1000).into_bytes(),
                                _ => page(&[(next() % 16, next() % 1000), (next() % 16, round)])
                                    .to_vec(),
                            };
                            txn.insert(meta::MAP_PAGES, &k, v.as_slice());
                            model.insert(k.to_vec(), v);
                        }
                    }
                    let seen: BTreeMap<Vec<u8>, Vec<u8>> = txn
                        .iter(meta::MAP_PAGES)?
                        .into_iter()
                        .map(|(k, v)| (k.to_vec(), v))
                        .collect();
                    assert_eq!(seen, model, "write view, round {round}");
                }
                // Something else changes too, so commits go on after the map's stop.
                txn.insert(meta::LAYERS, &round, &round);
                txn.commit()?;
                if round % 20 == 19 {
                    drop(store);
                    store = Store::open(dir.path())?;
                }
                store.check_pending()?;
                let r = store.read()?;
                let all: BTreeMap<Vec<u8>, Vec<u8>> = r
                    .iter(meta::MAP_PAGES)?
                    .map(|i| i.map(|(k, v)| (k.to_vec(), v)))
                    .collect::<Result<_>>()?;
                assert_eq!(all, model, "round {round}");
                for n in 0..300 {
                    let k = key(n);
                    assert_eq!(r.get(meta::MAP_PAGES, &k)?, model.get(&k[..]).cloned());
                }
                let (lo, hi) = (key(40), key(41 + next() % 200));
                let want: Vec<_> = model
                    .range(lo.to_vec()..=hi.to_vec())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let got: Vec<_> = r
                    .range(meta::MAP_PAGES, lo..=hi)?
                    .map(|i| i.map(|(k, v)| (k.to_vec(), v)))
                    .collect::<Result<_>>()?;
                assert_eq!(got, want, "range, round {round}");
                lagged |= committed_b_tree(&store)? != model;
                if round == 45 {
                    store.write_back_all()?;
                    assert_eq!(committed_b_tree(&store)?, model, "all written back");
                    assert_eq!(store.pending_map_changes(), 0);
                    store.check_pending()?;
                }
            }
            assert!(
                lagged,
                "{kind:?}: the B-tree was never behind: nothing was deferred"
            );
            assert_eq!(committed_b_tree(&store)?, model, "{kind:?}: written back");
            assert_eq!(store.pending_map_changes(), 0);
        }
        Ok(())
    }

    /// A transaction written through puts its map changes in the table itself while nothing
    /// is pending, and is deferred like any other once something is.
    #[test]
    fn written_through_changes_skip_the_log_only_while_nothing_is_pending() -> Result<()> {
        let (_dir, store) = redb_store()?;
        let mut txn = store.write()?;
        txn.write_through();
        txn.insert(meta::MAP_PAGES, &key(1), b"one".as_slice());
        txn.commit()?;
        assert_eq!(store.pending_map_changes(), 0);
        assert_eq!(committed_b_tree(&store)?.len(), 1);
        let mut txn = store.write()?;
        txn.insert(meta::MAP_PAGES, &key(2), b"two".as_slice());
        txn.commit()?;
        assert_eq!(store.pending_map_changes(), 1, "deferred");
        let mut txn = store.write()?;
        txn.write_through();
        txn.insert(meta::MAP_PAGES, &key(3), b"three".as_slice());
        txn.commit()?;
        assert_eq!(
            store.pending_map_changes(),
            1,
            "key 3 deferred, key 2 written back"
        );
        let tree = committed_b_tree(&store)?;
        assert!(tree.contains_key(&key(2)[..]) && !tree.contains_key(&key(3)[..]));
        let r = store.read()?;
        for (n, v) in [(1, "one"), (2, "two"), (3, "three")] {
            assert_eq!(
                r.get(meta::MAP_PAGES, &key(n))?,
                Some(v.as_bytes().to_vec())
            );
        }
        store.check_pending()
    }

    /// Readers racing commits never see half of one: each commit sets a group of keys, one
    /// per slice, to its number, while slices are written back in turn; every snapshot must
    /// show every group's keys equal, by point reads and by a scan.
    #[test]
    fn readers_see_whole_commits_while_slices_are_written_back() -> Result<()> {
        let (_dir, store) = redb_store()?;
        const GROUPS: u64 = 8;
        // Group g's keys: page g·16 + s·256 of layer 1, for s in 0..16: one in each slice.
        let group = |g: u64| -> Vec<[u8; 16]> {
            (0..SLICES as u64)
                .map(|s| crate::format::map_key(1, g * 16 + s * 256))
                .collect()
        };
        assert_eq!(
            group(0)
                .iter()
                .map(|k| slice_of(k))
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            SLICES
        );
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| -> Result<()> {
            let reader = scope.spawn(|| -> Result<u64> {
                let mut checked = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = store.read()?;
                    let scanned: BTreeMap<[u8; 16], Vec<u8>> =
                        r.iter(meta::MAP_PAGES)?.collect::<Result<_>>()?;
                    for g in 0..GROUPS {
                        let got: Vec<Option<Vec<u8>>> = group(g)
                            .iter()
                            .map(|k| r.get(meta::MAP_PAGES, k))
                            .collect::<Result<_>>()?;
                        assert!(got.windows(2).all(|w| w[0] == w[1]), "group {g}: {got:?}");
                        let by_scan: Vec<Option<&Vec<u8>>> =
                            group(g).iter().map(|k| scanned.get(k)).collect();
                        assert!(by_scan.windows(2).all(|w| w[0] == w[1]), "scan, group {g}");
                    }
                    checked += 1;
                }
                Ok(checked)
            });
            let mut next = crate::test_data::xorshift(7);
            for n in 0..400u64 {
                let mut txn = store.write()?;
                let g = next() % GROUPS;
                for k in group(g) {
                    txn.insert(meta::MAP_PAGES, &k, n.to_be_bytes().as_slice());
                }
                txn.commit()?;
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let checked = reader.join().expect("reader")?;
            assert!(checked > 0);
            Ok(())
        })
    }

    /// Layers stacked commit after commit read like the last change per key (point reads and
    /// ranges, narrowed to the slices a range can hold or not), stay few, and merge away the
    /// changes they supersede.
    #[test]
    fn stacked_layers_read_as_the_newest_change_per_key() {
        let mut next = crate::test_data::xorshift(0x1a7e);
        let mut pending = Pending::default();
        let mut model: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut pushed = 0;
        for commit in 0..300u64 {
            let mut by_slice: [BTreeMap<Vec<u8>, Option<Vec<u8>>>; SLICES] = Default::default();
            for _ in 0..next() % 60 {
                let k = crate::format::map_key(1 + next() % 2, next() % 600);
                let v = (!next().is_multiple_of(5)).then(|| commit.to_be_bytes().to_vec());
                by_slice[slice_of(&k)].insert(k.to_vec(), v);
            }
            for (s, changes) in by_slice.into_iter().enumerate() {
                if changes.is_empty() {
                    continue;
                }
                pushed += changes.len();
                model.extend(changes.clone());
                let changes = changes
                    .into_iter()
                    .map(|(k, v)| (Bytes::from(k), v.map(Bytes::from)))
                    .collect();
                pending.push(s, changes);
            }
            if commit % 70 == 69 {
                let s = (next() % SLICES as u64) as usize;
                pending.drop_slice(s);
                model.retain(|k, _| slice_of(k) != s);
            }
            for _ in 0..20 {
                let k = crate::format::map_key(1 + next() % 2, next() % 600);
                let want = model.get(&k[..]).map(Option::as_deref);
                assert_eq!(pending.get(&k), want, "commit {commit}");
            }
            let layer = 1 + next() % 2;
            let first = next() % 600;
            let (lo, hi) = (
                crate::format::map_key(layer, first),
                crate::format::map_key(
                    layer,
                    first + next() % (if next().is_multiple_of(2) { 600 } else { 6000 }),
                ),
            );
            let want: Vec<(Vec<u8>, Option<Vec<u8>>)> = model
                .range(lo.to_vec()..hi.to_vec())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let got: Vec<(Vec<u8>, Option<Vec<u8>>)> = pending
                .range(Bound::Included(&lo), Bound::Excluded(&hi))
                .into_iter()
                .map(|(k, v)| (k.to_vec(), v.as_deref().map(<[u8]>::to_vec)))
                .collect();
            assert_eq!(got, want, "range, commit {commit}");
            for layers in &pending.slices {
                assert!(layers.len() <= LAYERS_MAX, "{} layers", layers.len());
            }
            let counted: usize = (0..SLICES).map(|s| pending.in_slice(s)).sum();
            assert_eq!(pending.len(), counted);
        }
        let all = pending.range(Bound::Unbounded, Bound::Unbounded);
        assert_eq!(all.len(), model.len());
        assert!(
            pending.len() < pushed / 2 && pushed > 4 * model.len(),
            "{} changes kept for {} keys ({pushed} pushed): the merges dropped too few",
            pending.len(),
            model.len()
        );
    }

    /// A range between two keys of one map layer is narrowed to slices that hold every key
    /// between them.
    #[test]
    fn a_narrowed_range_keeps_every_slice_its_keys_are_in() {
        let mut next = crate::test_data::xorshift(0x51ce);
        for _ in 0..2000 {
            let layer = next() % 4;
            let first = next() % 100_000;
            let last = first + next() % 5000;
            let (lo, hi) = (
                crate::format::map_key(layer, first),
                crate::format::map_key(layer, last),
            );
            let marked = slices_within(Bound::Included(&lo), Bound::Included(&hi));
            for page in first..=last {
                let s = slice_of(&crate::format::map_key(layer, page));
                assert!(marked[s], "page {page} of {first}..={last}");
            }
            if last - first < 256 {
                assert!(marked.iter().filter(|&&m| m).count() <= 2);
            }
        }
    }

    /// A map key's slice follows its stretch of 256 pages.
    #[test]
    fn slices_are_stretches_of_pages() {
        let key = |layer: u64, page: u64| crate::format::map_key(layer, page);
        assert_eq!(slice_of(&key(3, 0)), slice_of(&key(3, 255)));
        assert_ne!(slice_of(&key(3, 255)), slice_of(&key(3, 256)));
        assert_eq!(slice_of(&key(3, 256 * 16)), slice_of(&key(3, 0)));
        assert_ne!(slice_of(&key(1, 0)), slice_of(&key(2, 0)));
    }
}
