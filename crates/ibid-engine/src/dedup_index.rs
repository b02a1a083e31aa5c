//! The dedup index's write-optimized front: sorted runs of recent keys in front of the `fps`
//! B-tree.
//!
//! Inserted straight into the B-tree, a commit's new keys (random 16-byte integers, see
//! [`crate::meta`]) land on nearly every leaf once the tree is large: 64 Ki keys into a tree
//! of a few thousand leaves copy most of them on write for a handful of entries each, and the
//! index became most of a commit's store work as the pool grew (`ibid-bench store-shapes`).
//! Instead, a commit with at least [`RunPolicy::keys_min`] new keys writes them as one sorted
//! **run** (`fps.runs`: commit number → the keys packed as 16-byte big-endian integers), and
//! the runs are merged into the B-tree in key order, so that a leaf is rewritten once for
//! several commits' keys. Smaller commits insert their keys into the B-tree directly.
//!
//! The merge is **rolling** and **budgeted**: the key space is cut into
//! [`RunPolicy::slices`] slices (by the fingerprint prefix's high bits, [`slice_of`]), and a
//! commit that writes a run merges nothing while the runs keep at most
//! [`RunPolicy::keys_target`] keys; past it, it merges the slices merged longest ago (of every
//! run, of the gone rows and of its own keys), oldest first, until they keep no more. A leaf is
//! thus rewritten once for all the keys its slice gathered since its last merge — about
//! `2 × keys_target / slices` in the steady state, whatever the commits carry — so a key costs
//! about the B-tree's size over `2 × keys_target` bytes of rewritten leaves. Merging one slice
//! of 16 every commit (until session 60) rewrote a sixteenth of the tree for each commit's few
//! keys per leaf: ~9.5 MB a commit, ~390 bytes of `meta.redb` per overwritten block, on a
//! 16 GiB pool. Merging all runs at once every few commits made every one of those commits
//! several times longer than the others (seconds on a pool of millions of chunks, felt by
//! every writer paced behind it). The rows are not rewritten without the slice (that wrote
//! each key ~8 more times, ~120 bytes of metadata per new block, and was most of the merge's
//! CPU): the **merge marks** ([`crate::meta::FPS_MERGED_KEY`], one small row) hold, per slice,
//! the commit that last merged it, and a row's keys of slice `s` are merged once the row is
//! not newer than that commit. A row is deleted once every slice of it is merged; a commit
//! that would keep [`RunPolicy::runs_max`] runs or more than [`GONE_ROWS_MAX`] gone rows
//! merges the oldest slices until the oldest rows go (a few slices, not everything). Keys sort
//! by slice, so a row's keys of one slice are one range of it, found by binary search. A
//! commit past [`RUN_KEYS_MAX`] keys still merges them all, as does the one that would bring
//! the runs to `runs_max` when `slices` is 1.
//!
//! Every key is in exactly one place: the B-tree or one run. A chunk that dies leaves its key
//! where it is: the commit writes the keys of the chunks that died in it as one **gone row**
//! (`fps.gone`: commit number → the keys, packed like a run), and the merge applies them — a
//! gone key of a run is left out, a gone key of the B-tree removed — together with the runs'
//! inserts, in one pass in key order, then deletes the rows. A death therefore costs the commit
//! no B-tree work (a delete per dying chunk rewrote a random leaf of the B-tree for each, a
//! fifth of an overwrite commit's CPU), and the merge touches each leaf once for all of them.
//! Until then a gone key never misleads a lookup, which confirms every candidate against the
//! chunk's record (removed when the chunk died; a chunk id is never reused). The merge also
//! runs when the gone rows pass [`GONE_ROWS_MAX`] or their keys [`RUN_KEYS_MAX`], so that
//! deaths without new data (overwrites with duplicates, zeroing) are applied too.
//!
//! The runs' keys not merged yet, and those of them whose chunks died (*dead* keys), are kept
//! in memory ([`Runs`], loaded at open) per slice, each as a few sorted layers ([`Layers`]),
//! so a lookup is a binary search in a few layers of its slice whatever the number of runs,
//! with no store read; gone keys of the B-tree are only counted in memory and read back by
//! the merge. A commit installs its new [`Runs`]
//! after its transaction is durable and before it publishes (empties the `committing`
//! slots); a lookup, with its fingerprint's shard locked, checks the `committing` slot, then
//! takes the runs, then its store snapshot. So a key the lookup misses in the slot was
//! published, hence is in the runs it took or in the B-tree of any later snapshot; and runs it
//! took after a merge come with a snapshot that holds the merged B-tree.

use crate::error::{Error, Result};
use crate::meta;
use crate::store::{ReadTxn, Reader, WriteTxn};
use rustc_hash::FxHashSet;
use std::sync::Arc;

/// Most keys the runs hold (16 bytes each in memory): past it, the next run merges them. Also
/// the most gone keys of the B-tree left for the merge.
pub(crate) const RUN_KEYS_MAX: usize = 2 << 20;

/// Most gone rows kept: the commit that would write one more merges instead.
pub(crate) const GONE_ROWS_MAX: usize = 256;

/// When a commit writes a run, and when it merges the runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunPolicy {
    /// A commit with fewer new keys inserts them into the B-tree directly (a run of a few
    /// keys would save nothing and cost a row).
    pub keys_min: usize,
    /// Most runs kept: a commit that would keep as many merges the oldest slices until the
    /// oldest runs go (with one slice: merges them all).
    pub runs_max: usize,
    /// Slices of the key space merged separately (1: the runs are merged only all at once;
    /// see [`slice_of`]).
    pub slices: usize,
    /// Keys the runs may keep unmerged after a commit (16 bytes of memory each): past it, a
    /// commit writing a run merges slices, the oldest merged first, until they keep no more.
    pub keys_target: usize,
}

/// The slice of the key space `key` is in, of `slices` (fingerprints are uniform, so each
/// slice holds an equal share of the keys and of the B-tree's leaves).
pub(crate) fn slice_of(key: u128, slices: usize) -> usize {
    (((key >> 64) * slices as u128) >> 64) as usize
}

/// The positions in ascending `keys` of the keys of slice `slice` (of `slices`): one range,
/// since [`slice_of`] grows with the key.
fn slice_range(keys: &[u128], slice: usize, slices: usize) -> std::ops::Range<usize> {
    let start = keys.partition_point(|&k| slice_of(k, slices) < slice);
    let end = start + keys[start..].partition_point(|&k| slice_of(k, slices) == slice);
    start..end
}

/// The keys of slice `slice` (of `slices`) in packed row `no` (see [`encode`]), found by
/// binary search in the packed bytes: a merge reads each gone row for a slice or a few, and
/// unpacking whole rows of tens of thousands of keys for that was most of its time.
fn slice_of_row(no: u64, v: &[u8], slice: usize, slices: usize) -> Result<Vec<u128>> {
    if !v.len().is_multiple_of(16) {
        return Err(Error::Corrupt(format!(
            "dedup index row {no}: {} bytes, not whole 16-byte keys",
            v.len()
        )));
    }
    let at = |i: usize| u128::from_be_bytes(v[i * 16..i * 16 + 16].try_into().expect("16 bytes"));
    let first = |pred: &dyn Fn(u128) -> bool| {
        let (mut lo, mut hi) = (0, v.len() / 16);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match pred(at(mid)) {
                true => hi = mid,
                false => lo = mid + 1,
            }
        }
        lo
    };
    let start = first(&|k| slice_of(k, slices) >= slice);
    let end = first(&|k| slice_of(k, slices) > slice);
    decode(no, &v[start.min(end) * 16..end * 16])
}

/// One sorted layer of index keys.
#[derive(Debug)]
struct Layer {
    /// The keys, ascending.
    keys: Vec<u128>,
    /// The lowest and highest chunk id among the keys. A commit's new chunks have ids taken
    /// between its cut and the one before, so layers made of neighbouring commits' keys
    /// barely overlap in ids, and a key whose chunk id lies outside a layer's range is not
    /// searched for in it: a dying chunk's key costs about one binary search, not one per
    /// layer (per run, that was half of an overwrite commit's CPU, every search a chain of
    /// cache misses).
    ids: (u64, u64),
}

impl Layer {
    fn new(keys: Vec<u128>) -> Layer {
        let ids = keys
            .iter()
            .map(|&k| meta::fps_key_chunk(k))
            .fold((u64::MAX, u64::MIN), |(lo, hi), id| {
                (lo.min(id), hi.max(id))
            });
        Layer { keys, ids }
    }

    /// Whether `key` is in this layer.
    fn contains(&self, key: u128) -> bool {
        let id = meta::fps_key_chunk(key);
        self.ids.0 <= id && id <= self.ids.1 && self.keys.binary_search(&key).is_ok()
    }
}

/// A set of index keys (no key twice) as sorted layers, oldest first, shared by the [`Runs`]
/// of consecutive commits. Keys come in a commit's worth at a time; a new layer is merged into
/// the one below while that one is no larger (a binary counter), so the set holds about log₂
/// of its commits' layers and a key is copied about as many times.
#[derive(Debug, Clone, Default)]
struct Layers(Vec<Arc<Layer>>);

/// Two ascending sequences of distinct keys merged into one.
fn merge_sorted(a: &[u128], b: &[u128]) -> Vec<u128> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i] < b[j] {
            out.push(a[i]);
            i += 1;
        } else {
            out.push(b[j]);
            j += 1;
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

impl Layers {
    /// Adds `keys` (ascending, none already in the set).
    fn push(&mut self, keys: Vec<u128>) {
        if keys.is_empty() {
            return;
        }
        let mut keys = keys;
        while let Some(top) = self.0.last() {
            if top.keys.len() > keys.len() {
                break;
            }
            keys = merge_sorted(&top.keys, &keys);
            self.0.pop();
        }
        self.0.push(Arc::new(Layer::new(keys)));
    }

    fn contains(&self, key: u128) -> bool {
        self.0.iter().any(|l| l.contains(key))
    }

    fn len(&self) -> usize {
        self.0.iter().map(|l| l.keys.len()).sum()
    }

    /// Every key (ascending within a layer, not across them).
    fn iter(&self) -> impl Iterator<Item = u128> + '_ {
        self.0.iter().flat_map(|l| l.keys.iter().copied())
    }

    /// The keys with fingerprint prefix `prefix`, the newest chunk first within a layer and
    /// the newest layer first.
    fn with_prefix(&self, prefix: u64) -> impl Iterator<Item = u128> + '_ {
        let lo = (prefix as u128) << 64;
        self.0.iter().rev().flat_map(move |l| {
            let from = l.keys.partition_point(|&k| k < lo);
            let to = from + l.keys[from..].partition_point(|&k| meta::fps_key_prefix(k) == prefix);
            l.keys[from..to].iter().rev().copied()
        })
    }

    /// The set cut into `slices` sets by [`slice_of`], each layer cut along.
    fn split(&self, slices: usize) -> Vec<Layers> {
        let mut out = vec![Layers::default(); slices];
        for layer in &self.0 {
            for (s, part) in out.iter_mut().enumerate() {
                let range = slice_range(&layer.keys, s, slices);
                if !range.is_empty() {
                    part.0
                        .push(Arc::new(Layer::new(layer.keys[range].to_vec())));
                }
            }
        }
        out
    }
}

/// The index keys not (yet) in the B-tree, and the keys of chunks that died since the last
/// merge, as committed.
#[derive(Debug, Clone)]
pub(crate) struct Runs {
    /// The stored runs' commit numbers, oldest first (each holds keys of a slice not merged).
    rows: Vec<u64>,
    /// Per slice (as many as the merge marks; one while there are none), the runs' keys of the
    /// slice not merged into the B-tree yet, dead ones included.
    pending: Vec<Layers>,
    /// Per slice, like `pending`: those of its keys whose chunks died (merged out with it).
    dead: Vec<Layers>,
    /// The commit numbers of the gone rows, oldest first.
    gone_rows: Vec<u64>,
    /// Gone keys that are in the B-tree (stale there until the next merge removes them).
    gone_in_tree: usize,
    /// The merge marks: per slice, the commit that last merged it (a row's keys of slice `s`
    /// are merged unless the row is newer than `merged[s]`). Empty while nothing was merged a
    /// slice at a time since the rows kept were written; otherwise as long as the slice count
    /// that merged them.
    merged: Vec<u64>,
}

impl Default for Runs {
    fn default() -> Runs {
        Runs {
            rows: Vec::new(),
            pending: vec![Layers::default()],
            dead: vec![Layers::default()],
            gone_rows: Vec::new(),
            gone_in_tree: 0,
            merged: Vec::new(),
        }
    }
}

/// The commit that last merged `key`'s slice by `marks` (0 when there are no marks): a row's
/// keys of that slice are merged unless the row is newer.
fn mark_of(marks: &[u64], key: u128) -> u64 {
    match marks.is_empty() {
        true => 0,
        false => marks[slice_of(key, marks.len())],
    }
}

/// Packs merge marks as the value of [`meta::FPS_MERGED_KEY`].
fn encode_marks(marks: &[u64]) -> Vec<u8> {
    marks.iter().flat_map(|m| m.to_le_bytes()).collect()
}

/// Unpacks merge marks.
fn decode_marks(v: &[u8]) -> Result<Vec<u64>> {
    if v.is_empty() || !v.len().is_multiple_of(8) {
        return Err(Error::Corrupt(format!(
            "dedup index merge marks of {} bytes",
            v.len()
        )));
    }
    Ok(v.chunks_exact(8)
        .map(|m| u64::from_le_bytes(m.try_into().expect("8 bytes")))
        .collect())
}

/// Packs ascending keys as a run's value.
fn encode(keys: &[u128]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_be_bytes()).collect()
}

/// Unpacks run or gone row `no`'s value, which must hold ascending keys.
fn decode(no: u64, v: &[u8]) -> Result<Vec<u128>> {
    if !v.len().is_multiple_of(16) {
        return Err(Error::Corrupt(format!(
            "dedup index run {no}: {} bytes, not whole 16-byte keys",
            v.len()
        )));
    }
    let keys: Vec<u128> = v
        .chunks_exact(16)
        .map(|k| u128::from_be_bytes(k.try_into().expect("16 bytes")))
        .collect();
    if keys.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Corrupt(format!(
            "dedup index run {no}: keys out of order"
        )));
    }
    Ok(keys)
}

/// Moves the dead keys of a pool of format version 6 or older (`fps.dead`, one row per key)
/// into one gone row numbered `no` (the pool's last commit: later commits' rows sort after
/// it). Returns how many keys it moved.
pub(crate) fn upgrade(txn: &mut WriteTxn, no: u64) -> Result<usize> {
    let keys: Vec<u128> = txn
        .iter(meta::FPS_DEAD)?
        .into_iter()
        .map(|(k, ())| k)
        .collect();
    if keys.is_empty() {
        return Ok(0);
    }
    for k in &keys {
        txn.remove(meta::FPS_DEAD, k);
    }
    let mut gone = keys;
    gone.sort_unstable();
    if let Some(row) = txn.get(meta::FPS_GONE, &no)? {
        // Not in a pool of these versions; kept rather than overwritten all the same.
        gone.extend(decode(no, &row)?);
        gone.sort_unstable();
        gone.dedup();
    }
    txn.insert(meta::FPS_GONE, &no, encode(&gone).as_slice());
    Ok(gone.len())
}

impl Runs {
    /// The runs and gone keys committed in `txn`'s snapshot.
    pub fn load(txn: &ReadTxn) -> Result<Runs> {
        let merged = Self::load_marks(txn)?;
        let slices = merged.len().max(1);
        let mut pending: Vec<Vec<u128>> = vec![Vec::new(); slices];
        let mut rows = Vec::new();
        for item in txn.iter(meta::FPS_RUNS)? {
            let (no, v) = item?;
            let keys = decode(no, &v)?;
            rows.push(no);
            for (s, part) in pending.iter_mut().enumerate() {
                if no > merged.get(s).copied().unwrap_or(0) {
                    part.extend_from_slice(&keys[slice_range(&keys, s, slices)]);
                }
            }
        }
        let mut runs = Runs {
            rows,
            pending: pending.into_iter().map(Self::layers_of).collect(),
            dead: vec![Layers::default(); slices],
            merged,
            ..Runs::default()
        };
        let mut dead: Vec<Vec<u128>> = vec![Vec::new(); slices];
        for item in txn.iter(meta::FPS_GONE)? {
            let (no, v) = item?;
            runs.gone_rows.push(no);
            for k in decode(no, &v)? {
                if !runs.pending(no, k) {
                    continue;
                }
                if runs.contains(k) {
                    dead[runs.slice(k)].push(k);
                } else {
                    runs.gone_in_tree += 1;
                }
            }
        }
        runs.dead = dead.into_iter().map(Self::layers_of).collect();
        Ok(runs)
    }

    /// `keys` (distinct, in any order) as one sorted layer.
    fn layers_of(mut keys: Vec<u128>) -> Layers {
        keys.sort_unstable();
        let mut layers = Layers::default();
        layers.push(keys);
        layers
    }

    /// The merge marks stored in `txn`'s snapshot (empty when there are none).
    fn load_marks(txn: &impl Reader) -> Result<Vec<u64>> {
        match txn.get(meta::POOL, meta::FPS_MERGED_KEY)? {
            Some(v) => decode_marks(&v),
            None => Ok(Vec::new()),
        }
    }

    /// Every gone key stored in `txn`'s snapshot and not merged yet, each with its row (to
    /// check them).
    pub fn load_gone(txn: &ReadTxn) -> Result<Vec<(u64, u128)>> {
        let marks = Self::load_marks(txn)?;
        let mut out = Vec::new();
        for item in txn.iter(meta::FPS_GONE)? {
            let (no, v) = item?;
            out.extend(
                decode(no, &v)?
                    .into_iter()
                    .filter(|&k| no > mark_of(&marks, k))
                    .map(|k| (no, k)),
            );
        }
        Ok(out)
    }

    /// The slice `key` is held in (of as many as [`Runs::pending`] has).
    fn slice(&self, key: u128) -> usize {
        slice_of(key, self.pending.len())
    }

    /// Whether the keys of `key`'s slice in row `no` (a run or a gone row) are not merged yet.
    fn pending(&self, no: u64, key: u128) -> bool {
        no > mark_of(&self.merged, key)
    }

    /// The chunk ids of live keys with fingerprint prefix `prefix`, newest first.
    pub fn candidates(&self, prefix: u64) -> impl Iterator<Item = u64> + '_ {
        let s = self.slice((prefix as u128) << 64);
        let dead = &self.dead[s];
        self.pending[s]
            .with_prefix(prefix)
            .filter(move |&k| !dead.contains(k))
            .map(meta::fps_key_chunk)
    }

    /// Whether `key` is in a run, not merged out (dead or not).
    pub fn contains(&self, key: u128) -> bool {
        self.pending[self.slice(key)].contains(key)
    }

    /// Whether `key` is a live key of a run.
    pub fn holds(&self, key: u128) -> bool {
        let s = self.slice(key);
        self.pending[s].contains(key) && !self.dead[s].contains(key)
    }

    /// Every live key in the runs (unordered across slices and layers).
    pub fn keys(&self) -> impl Iterator<Item = u128> + '_ {
        self.pending
            .iter()
            .zip(&self.dead)
            .flat_map(|(keys, dead)| keys.iter().filter(|&k| !dead.contains(k)))
    }

    /// The merge marks (see [`Runs::merged`]'s field doc; empty when there are none).
    pub fn marks(&self) -> &[u64] {
        &self.merged
    }

    /// Every dead key.
    pub fn dead(&self) -> impl Iterator<Item = u128> + '_ {
        self.dead.iter().flat_map(|d| d.iter())
    }

    /// Number of runs.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// The runs' commit numbers, the number of keys in them not merged out, the number of
    /// dead keys, the gone rows and the number of gone keys of the B-tree (to compare two
    /// views of the runs).
    pub fn summary(&self) -> (Vec<u64>, usize, usize, Vec<u64>, usize) {
        (
            self.rows.clone(),
            self.stored_keys(),
            self.dead.iter().map(Layers::len).sum(),
            self.gone_rows.clone(),
            self.gone_in_tree,
        )
    }

    /// Keys in the runs not merged out, dead ones included.
    fn stored_keys(&self) -> usize {
        self.pending.iter().map(Layers::len).sum()
    }

    /// The held keys and dead keys cut into `slices` slices (they are held in one until the
    /// first merge a slice at a time).
    fn partitioned(&self, slices: usize) -> (Vec<Layers>, Vec<Layers>) {
        if self.pending.len() == slices {
            return (self.pending.clone(), self.dead.clone());
        }
        debug_assert_eq!(self.pending.len(), 1, "resliced without a full merge");
        (self.pending[0].split(slices), self.dead[0].split(slices))
    }

    /// Adds ascending `keys` (a new run's) to the held keys, slice by slice.
    fn hold(held: &mut [Layers], keys: &[u128]) {
        let slices = held.len();
        for (s, part) in held.iter_mut().enumerate() {
            part.push(keys[slice_range(keys, s, slices)].to_vec());
        }
    }

    /// The slices a commit adding ascending `added` as a run merges (none while the budget
    /// allows), oldest merged first (the lowest mark; marks tie at first, and the lower slice
    /// goes first), while any of these holds for what the runs would keep: more than
    /// `policy.keys_target` keys; `policy.runs_max` runs or more (the commit's own counted);
    /// more than [`GONE_ROWS_MAX`] gone rows (`gone_row`: the commit writes one). And one slice
    /// in any case while `tree_gone` (the gone keys of the B-tree after the commit) is past
    /// half of [`RUN_KEYS_MAX`], so that deaths without new keys are applied a slice at a time
    /// before they would force a merge of everything.
    fn slices_to_merge(
        &self,
        added: &[u128],
        gone_row: bool,
        tree_gone: usize,
        policy: RunPolicy,
    ) -> Vec<usize> {
        let slices = policy.slices;
        let marks = match self.merged.is_empty() {
            true => vec![0; slices],
            false => self.merged.clone(),
        };
        let mut order: Vec<usize> = (0..slices).collect();
        order.sort_by_key(|&s| (marks[s], s));
        let mut held: Vec<usize> = match self.pending.len() == slices {
            true => self.pending.iter().map(Layers::len).collect(),
            false => {
                let mut held = vec![0; slices];
                for l in self.pending.iter().flat_map(|p| &p.0) {
                    for (s, n) in held.iter_mut().enumerate() {
                        *n += slice_range(&l.keys, s, slices).len();
                    }
                }
                held
            }
        };
        for (s, n) in held.iter_mut().enumerate() {
            *n += slice_range(added, s, slices).len();
        }
        let mut left: usize = held.iter().sum();
        let mut one_more = tree_gone > RUN_KEYS_MAX / 2;
        let mut chosen = Vec::new();
        for s in order {
            // Rows no newer than the lowest mark left (this slice's) are deleted.
            let floor = marks[s];
            let runs = self.rows.iter().filter(|&&r| r > floor).count() + 1;
            let gone_rows =
                self.gone_rows.iter().filter(|&&r| r > floor).count() + gone_row as usize;
            let over = left > policy.keys_target
                || runs >= policy.runs_max
                || gone_rows > GONE_ROWS_MAX
                || std::mem::take(&mut one_more);
            if !over {
                break;
            }
            chosen.push(s);
            left -= held[s];
        }
        chosen
    }
}

/// One commit's changes to the dedup index, written by [`IndexUpdate::finish`].
pub(crate) struct IndexUpdate<'a> {
    runs: &'a Runs,
    /// Keys of the commit's new chunks.
    added: Vec<u128>,
    /// Keys of new chunks that die in the same commit: never written anywhere.
    born_dead: FxHashSet<u128>,
    /// Keys of older chunks that died in this commit (in a run or the B-tree).
    gone: Vec<u128>,
    /// Those of `gone` that are in a run.
    dead: Vec<u128>,
}

impl<'a> IndexUpdate<'a> {
    /// An update on top of the committed `runs`.
    pub fn new(runs: &'a Runs) -> Self {
        IndexUpdate {
            runs,
            added: Vec::new(),
            born_dead: FxHashSet::default(),
            gone: Vec::new(),
            dead: Vec::new(),
        }
    }

    /// Adds the key of a chunk new in this commit.
    pub fn add(&mut self, key: u128) {
        self.added.push(key);
    }

    /// Removes the key of a dying chunk. `new`: the chunk was added in this commit.
    pub fn remove(&mut self, key: u128, new: bool) {
        if new {
            self.born_dead.insert(key);
            return;
        }
        self.gone.push(key);
        if self.runs.contains(key) {
            self.dead.push(key);
        }
    }

    /// Writes the changes into `txn` as commit `no`'s; returns the runs as they are once
    /// `txn` commits, or `None` when they do not change.
    pub fn finish(
        mut self,
        txn: &mut WriteTxn,
        no: u64,
        policy: RunPolicy,
    ) -> Result<Option<Runs>> {
        if !self.born_dead.is_empty() {
            self.added.retain(|k| !self.born_dead.contains(k));
        }
        self.added.sort_unstable();
        let runs = self.runs;
        let as_run = self.added.len() >= policy.keys_min.max(1);
        let sliced = policy.slices > 1;
        let runs_full = as_run
            && ((!sliced && runs.len() + 1 >= policy.runs_max)
                || runs.stored_keys() + self.added.len() > RUN_KEYS_MAX);
        let tree_gone = runs.gone_in_tree + self.gone.len() - self.dead.len();
        let gone_full = !self.gone.is_empty()
            && ((!sliced && runs.gone_rows.len() + 1 > GONE_ROWS_MAX) || tree_gone > RUN_KEYS_MAX);
        // Rows merged a slice at a time by another slice count (the pool's setting changed):
        // merged all at once, after which the marks start afresh.
        let resliced = !runs.merged.is_empty() && runs.merged.len() != policy.slices;
        if runs_full || gone_full || resliced {
            return self.merge(txn).map(Some);
        }
        if sliced && (as_run || !self.gone.is_empty()) {
            // A commit with few new keys merges only to bound the gone rows (its keys then
            // go where a run's would).
            let chosen =
                runs.slices_to_merge(&self.added, !self.gone.is_empty(), tree_gone, policy);
            if !chosen.is_empty() {
                return self.merge_slices(txn, no, &chosen, policy.slices).map(Some);
            }
        }
        if !as_run {
            for k in &self.added {
                txn.insert(meta::FPS, k, &());
            }
            if self.gone.is_empty() {
                return Ok(None);
            }
        }
        let mut next = runs.clone();
        if !self.gone.is_empty() {
            self.gone.sort_unstable();
            txn.insert(meta::FPS_GONE, &no, encode(&self.gone).as_slice());
            next.gone_rows.push(no);
            next.gone_in_tree = tree_gone;
            self.dead.sort_unstable();
            Runs::hold(&mut next.dead, &self.dead);
        }
        if as_run {
            txn.insert(meta::FPS_RUNS, &no, encode(&self.added).as_slice());
            next.rows.push(no);
            Runs::hold(&mut next.pending, &self.added);
        }
        Ok(Some(next))
    }

    /// Commit `no`'s changes with slices `chosen` (of `slices`) merged: their live keys of
    /// every run and of the added ones go into the B-tree, their gone keys of the B-tree are
    /// removed from it, in key order; the merge marks record that the rows so far hold no more
    /// of them, and rows with every slice merged are deleted; the other added keys become run
    /// `no` and the other gone keys gone row `no`. Every key stays in exactly one place.
    fn merge_slices(
        self,
        txn: &mut WriteTxn,
        no: u64,
        chosen: &[usize],
        slices: usize,
    ) -> Result<Runs> {
        let runs = self.runs;
        debug_assert!(runs.merged.is_empty() || runs.merged.len() == slices);
        let mut ours = vec![false; slices];
        for &s in chosen {
            ours[s] = true;
        }
        let ours = |k: &u128| ours[slice_of(*k, slices)];
        // Rows newer than its mark hold keys of a slice not merged yet.
        let before = match runs.merged.is_empty() {
            true => vec![0; slices],
            false => runs.merged.clone(),
        };
        let mut merged = before.clone();
        let (mut pending, mut dead) = runs.partitioned(slices);
        let mut into_tree: Vec<u128> = Vec::new();
        for &s in chosen {
            merged[s] = no;
            let gone = std::mem::take(&mut dead[s]);
            into_tree.extend(pending[s].iter().filter(|&k| !gone.contains(k)));
            pending[s] = Layers::default();
        }
        let oldest = chosen.iter().map(|&s| before[s]).min().unwrap_or(0);
        let mut stale: Vec<u128> = Vec::new();
        for &row_no in runs.gone_rows.iter().filter(|&&r| r > oldest) {
            let row = txn.get(meta::FPS_GONE, &row_no)?.ok_or_else(|| {
                Error::Corrupt(format!("dedup index gone row {row_no} is missing"))
            })?;
            for &s in chosen.iter().filter(|&&s| row_no > before[s]) {
                let keys = slice_of_row(row_no, &row, s, slices)?;
                stale.extend(keys.into_iter().filter(|&k| !runs.contains(k)));
            }
        }
        let stale_before = stale.len();
        // This commit's gone keys of the slices: those of the B-tree go now, those of a run
        // left it above (they are dead there).
        let dead_now: FxHashSet<u128> = self.dead.iter().copied().collect();
        let (gone_now, gone_later): (Vec<u128>, Vec<u128>) =
            self.gone.into_iter().partition(|k| ours(k));
        stale.extend(gone_now.into_iter().filter(|k| !dead_now.contains(k)));
        into_tree.retain(|k| !dead_now.contains(k));
        let in_tree_later = gone_later.iter().filter(|k| !dead_now.contains(k)).count();
        let mut dead_later: Vec<u128> = self.dead.into_iter().filter(|k| !ours(k)).collect();
        dead_later.sort_unstable();
        Runs::hold(&mut dead, &dead_later);
        let (added_now, added_later): (Vec<u128>, Vec<u128>) =
            self.added.into_iter().partition(|k| ours(k));
        into_tree.extend(added_now);
        into_tree.sort_unstable();
        for k in &into_tree {
            txn.insert(meta::FPS, k, &());
        }
        stale.sort_unstable();
        for k in &stale {
            txn.remove(meta::FPS, k);
        }
        // A row no newer than every mark holds nothing unmerged.
        let done = merged.iter().copied().min().unwrap_or(0);
        let mut next = Runs {
            rows: Vec::new(),
            pending,
            dead,
            gone_rows: Vec::new(),
            gone_in_tree: runs.gone_in_tree - stale_before + in_tree_later,
            merged,
        };
        for &row_no in &runs.rows {
            if row_no <= done {
                txn.remove(meta::FPS_RUNS, &row_no);
            } else {
                next.rows.push(row_no);
            }
        }
        for &row_no in &runs.gone_rows {
            if row_no <= done {
                txn.remove(meta::FPS_GONE, &row_no);
            } else {
                next.gone_rows.push(row_no);
            }
        }
        if !gone_later.is_empty() {
            // Deaths are found in any order.
            let mut gone_later = gone_later;
            gone_later.sort_unstable();
            txn.insert(meta::FPS_GONE, &no, encode(&gone_later).as_slice());
            next.gone_rows.push(no);
        }
        if !added_later.is_empty() {
            txn.insert(meta::FPS_RUNS, &no, encode(&added_later).as_slice());
            next.rows.push(no);
            Runs::hold(&mut next.pending, &added_later);
        }
        if next.rows.is_empty() && next.gone_rows.is_empty() {
            txn.remove(meta::POOL, meta::FPS_MERGED_KEY);
            return Ok(Runs {
                gone_in_tree: next.gone_in_tree,
                ..Runs::default()
            });
        }
        txn.insert(
            meta::POOL,
            meta::FPS_MERGED_KEY,
            encode_marks(&next.merged).as_slice(),
        );
        Ok(next)
    }

    /// Moves every live key of the runs, and the added ones, into the B-tree and removes every
    /// gone key of the B-tree, in key order; removes the runs and the gone rows.
    fn merge(self, txn: &mut WriteTxn) -> Result<Runs> {
        let runs = self.runs;
        let dead: FxHashSet<u128> = runs.dead().chain(self.dead.iter().copied()).collect();
        let mut all = self.added;
        all.extend(
            runs.pending
                .iter()
                .flat_map(Layers::iter)
                .filter(|k| !dead.contains(k)),
        );
        all.sort_unstable();
        for k in &all {
            txn.insert(meta::FPS, k, &());
        }
        let mut stale: Vec<u128> = self
            .gone
            .iter()
            .copied()
            .filter(|k| !runs.contains(*k))
            .collect();
        for &no in &runs.gone_rows {
            let row = txn
                .get(meta::FPS_GONE, &no)?
                .ok_or_else(|| Error::Corrupt(format!("dedup index gone row {no} is missing")))?;
            stale.extend(
                decode(no, &row)?
                    .into_iter()
                    .filter(|&k| runs.pending(no, k) && !runs.contains(k)),
            );
            txn.remove(meta::FPS_GONE, &no);
        }
        assert_eq!(
            stale.len(),
            runs.gone_in_tree + self.gone.len() - self.dead.len(),
            "gone keys of the B-tree miscounted"
        );
        stale.sort_unstable();
        for k in &stale {
            txn.remove(meta::FPS, k);
        }
        for &no in &runs.rows {
            txn.remove(meta::FPS_RUNS, &no);
        }
        if !runs.merged.is_empty() {
            txn.remove(meta::POOL, meta::FPS_MERGED_KEY);
        }
        Ok(Runs::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Backend, Store};

    const POLICY: RunPolicy = RunPolicy {
        keys_min: 4,
        runs_max: 3,
        slices: 1,
        keys_target: 0,
    };

    /// Key `i` of prefix `p` (several chunks may share a prefix).
    fn key(p: u64, id: u64) -> u128 {
        ((p as u128) << 64) | id as u128
    }

    /// One commit (number `no`) adding `added` (new) and removing `removed` (new or not)
    /// on top of `runs`; returns the runs after it.
    fn commit(
        store: &Store,
        runs: &Runs,
        no: u64,
        added: &[u128],
        removed: &[(u128, bool)],
    ) -> Result<Runs> {
        let mut txn = store.write()?;
        let mut update = IndexUpdate::new(runs);
        for &k in added {
            update.add(k);
        }
        for &(k, new) in removed {
            update.remove(k, new);
        }
        let next = update.finish(&mut txn, no, POLICY)?;
        txn.commit()?;
        Ok(next.unwrap_or_else(|| runs.clone()))
    }

    fn btree(store: &Store) -> Result<Vec<u128>> {
        store
            .read()?
            .iter(meta::FPS)?
            .map(|e| e.map(|(k, ())| k))
            .collect()
    }

    /// Small commits go to the B-tree; large ones become runs, found by prefix (newest
    /// first) and reloaded as written; the commit that would make `runs_max` runs merges
    /// them all, leaving out keys of chunks that died in a run, and clears both tables.
    #[test]
    fn runs_are_written_found_and_merged_without_their_dead_keys() -> Result<()> {
        for kind in [Backend::Redb, Backend::Fjall] {
            let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
            let store = Store::create(dir.path(), kind)?;
            let runs = commit(&store, &Runs::default(), 1, &[key(9, 1), key(2, 2)], &[])?;
            assert_eq!(runs.len(), 0, "a small commit writes no run");
            assert_eq!(btree(&store)?, vec![key(2, 2), key(9, 1)]);

            let first = [key(7, 10), key(3, 11), key(7, 12), key(1, 13), key(5, 14)];
            let runs = commit(&store, &runs, 2, &first, &[])?;
            assert_eq!(runs.summary(), (vec![2], 5, 0, vec![], 0));
            assert_eq!(runs.candidates(7).collect::<Vec<_>>(), vec![12, 10]);
            assert_eq!(runs.candidates(4).count(), 0);
            assert_eq!(btree(&store)?.len(), 2, "a run leaves the B-tree alone");
            let second = [key(7, 20), key(6, 21), key(8, 22), key(0, 23)];
            // Chunk 11 (in a run) and chunk 2 (in the B-tree) die.
            let runs = commit(
                &store,
                &runs,
                3,
                &second,
                &[(key(3, 11), false), (key(2, 2), false)],
            )?;
            assert_eq!(runs.summary(), (vec![2, 3], 9, 1, vec![3], 1));
            assert_eq!(runs.candidates(7).collect::<Vec<_>>(), vec![20, 12, 10]);
            assert_eq!(runs.candidates(3).count(), 0, "a dead key is no candidate");
            assert!(runs.holds(key(6, 21)) && !runs.holds(key(3, 11)));
            assert_eq!(
                btree(&store)?,
                vec![key(2, 2), key(9, 1)],
                "a gone key of the B-tree waits there for the merge"
            );
            let loaded = Runs::load(&store.read()?)?;
            assert_eq!(loaded.summary(), runs.summary());
            let sorted = |r: &Runs| {
                let mut keys: Vec<u128> = r.keys().collect();
                keys.sort_unstable();
                keys
            };
            assert_eq!(sorted(&loaded), sorted(&runs));

            // The third run merges: every live key lands in the B-tree, in one place.
            let third = [key(4, 30), key(4, 31), key(9, 32), key(2, 33)];
            let runs = commit(&store, &runs, 4, &third, &[(key(7, 12), false)])?;
            assert_eq!(runs.summary(), (vec![], 0, 0, vec![], 0));
            let mut expect: Vec<u128> = [&first[..], &second, &third, &[key(9, 1)]]
                .concat()
                .into_iter()
                .filter(|&k| k != key(3, 11) && k != key(7, 12))
                .collect();
            expect.sort_unstable();
            assert_eq!(btree(&store)?, expect, "the gone key of the B-tree removed");
            let r = store.read()?;
            assert_eq!(r.iter(meta::FPS_RUNS)?.count(), 0);
            assert_eq!(r.iter(meta::FPS_GONE)?.count(), 0);
        }
        Ok(())
    }

    /// Deaths without new keys are written as gone rows (the B-tree untouched) until the rows
    /// reach [`GONE_ROWS_MAX`]: the commit that would write one more removes them all from the
    /// B-tree and deletes the rows; the rows reload as written.
    #[test]
    fn gone_rows_are_applied_when_they_pass_their_limit() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let n = GONE_ROWS_MAX as u64 + 1;
        let all: Vec<u128> = (0..n + 1).map(|i| key(i * 7 % 11, i)).collect();
        let mut runs = commit(&store, &Runs::default(), 1, &all[..3], &[])?;
        // Below keys_min: straight into the B-tree, a batch at a time.
        for (i, chunk) in all[3..].chunks(3).enumerate() {
            runs = commit(&store, &runs, 2 + i as u64, chunk, &[])?;
        }
        assert_eq!(btree(&store)?.len(), all.len());
        let first = 1000;
        for i in 0..GONE_ROWS_MAX as u64 {
            runs = commit(&store, &runs, first + i, &[], &[(all[i as usize], false)])?;
        }
        let (_, _, dead, rows, in_tree) = runs.summary();
        assert_eq!(
            (dead, rows.len(), in_tree),
            (0, GONE_ROWS_MAX, GONE_ROWS_MAX)
        );
        assert_eq!(
            btree(&store)?.len(),
            all.len(),
            "deaths left the B-tree alone"
        );
        assert_eq!(Runs::load(&store.read()?)?.summary(), runs.summary());
        let last = GONE_ROWS_MAX;
        runs = commit(&store, &runs, first + n, &[], &[(all[last], false)])?;
        assert_eq!(runs.summary(), (vec![], 0, 0, vec![], 0));
        assert_eq!(btree(&store)?, {
            let mut live = all[last + 1..].to_vec();
            live.sort_unstable();
            live
        });
        assert_eq!(store.read()?.iter(meta::FPS_GONE)?.count(), 0);
        Ok(())
    }

    /// A chunk added and dead in the same commit leaves no key anywhere, in a run or not.
    #[test]
    fn keys_born_dead_are_never_written() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let added = [key(1, 1), key(2, 2), key(3, 3), key(4, 4), key(5, 5)];
        let runs = commit(&store, &Runs::default(), 1, &added, &[(key(3, 3), true)])?;
        assert_eq!(runs.summary(), (vec![1], 4, 0, vec![], 0));
        assert!(!runs.contains(key(3, 3)));
        let runs = commit(&store, &runs, 2, &[key(6, 6)], &[(key(6, 6), true)])?;
        assert_eq!(runs.summary(), (vec![1], 4, 0, vec![], 0));
        assert!(btree(&store)?.is_empty());
        Ok(())
    }

    /// A layer is searched only for keys whose chunk id lies in its range of ids, and found
    /// there whether or not other layers' ranges overlap it; layers merge like a binary counter.
    #[test]
    fn a_layer_is_searched_by_its_chunk_ids() {
        let mut layers = Layers::default();
        layers.push(vec![key(1, 10), key(5, 30)]);
        layers.push(vec![key(3, 40)]);
        assert_eq!(layers.0.len(), 2, "a smaller layer stays on top");
        for k in [key(1, 10), key(5, 30), key(3, 40)] {
            assert!(layers.contains(k), "{k:#x}");
        }
        for k in [key(1, 20), key(2, 10), key(5, 9), key(3, 41), key(4, 25)] {
            assert!(!layers.contains(k), "{k:#x}");
        }
        layers.push(vec![key(2, 20)]);
        assert_eq!(layers.0.len(), 1, "equal layers merge, and again below");
        assert_eq!(
            layers.iter().collect::<Vec<_>>(),
            vec![key(1, 10), key(2, 20), key(3, 40), key(5, 30)]
        );
        assert_eq!(layers.with_prefix(3).collect::<Vec<_>>(), vec![key(3, 40)]);
        assert_eq!(Layer::new(vec![]).ids, (u64::MAX, 0));
        assert!(!Layer::new(vec![]).contains(key(0, 0)));
    }

    /// A commit merges nothing while the runs keep at most `keys_target` keys; past it, the
    /// slices merged longest ago, oldest first, until they keep no more; a commit that would
    /// keep `runs_max` runs merges the oldest slices until the oldest rows go, and no more.
    #[test]
    fn slices_merge_past_the_budget_oldest_first() -> Result<()> {
        let budget = RunPolicy {
            keys_min: 1,
            runs_max: 100,
            slices: 4,
            keys_target: 10,
        };
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let q = u64::MAX / 4 + 1;
        // `per` keys in each slice, ids from `id`.
        let keys = |per: u64, id: u64| -> Vec<u128> {
            (0..4u64)
                .flat_map(|s| (0..per).map(move |i| key(s * q + id + i, id + s * per + i)))
                .collect()
        };
        let step = |runs: &Runs, no: u64, added: &[u128], policy: RunPolicy| -> Result<Runs> {
            let mut txn = store.write()?;
            let mut update = IndexUpdate::new(runs);
            for &k in added {
                update.add(k);
            }
            let next = update.finish(&mut txn, no, policy)?.expect("a run");
            txn.commit()?;
            assert_eq!(Runs::load(&store.read()?)?.summary(), next.summary());
            assert_eq!(Runs::load(&store.read()?)?.marks(), next.marks());
            Ok(next)
        };
        let runs = step(&Runs::default(), 1, &keys(2, 100), budget)?;
        assert!(
            runs.marks().is_empty() && btree(&store)?.is_empty(),
            "8 keys: no merge"
        );
        // 12 keys held: slice 0 (3 keys) goes.
        let runs = step(&runs, 2, &keys(1, 200), budget)?;
        assert_eq!(runs.marks(), &[2, 0, 0, 0][..]);
        assert_eq!(btree(&store)?.len(), 3);
        // 1 + 4 + 4 + 4 keys held: slice 1, the oldest of the three never merged, goes.
        let runs = step(&runs, 3, &keys(1, 300), budget)?;
        assert_eq!(runs.marks(), &[2, 3, 0, 0][..]);
        assert_eq!(btree(&store)?.len(), 7);
        assert_eq!(runs.len(), 3, "every row holds keys of slices 2 and 3");
        // A fourth run would make `runs_max`: slices 2 and 3 go, then rows 1 and 2 hold
        // nothing, and slices 0 and 1 stay.
        let rows = RunPolicy {
            runs_max: 3,
            keys_target: 1000,
            ..budget
        };
        let runs = step(&runs, 4, &keys(1, 400), rows)?;
        assert_eq!(runs.marks(), &[2, 3, 4, 4][..]);
        let stored: Vec<u64> = store
            .read()?
            .iter(meta::FPS_RUNS)?
            .map(|e| e.map(|(no, _)| no))
            .collect::<Result<_>>()?;
        assert_eq!(stored, vec![3, 4]);
        assert_eq!(
            runs.summary().1,
            3,
            "slice 0's of run 3 and 4, slice 1's of run 4"
        );
        assert_eq!(btree(&store)?.len(), 20 - 3);
        Ok(())
    }

    /// Random commits with slice merges, budgeted and bounded by `runs_max`, checked after
    /// each against a model: every live key is in exactly one place (a run or the B-tree),
    /// every gone key is dead in a run or stale in the B-tree, the runs and merge marks reload
    /// as held, fewer than `runs_max` runs are kept, and no run or gone row is ever
    /// rewritten.
    #[test]
    fn slice_merges_keep_every_key_in_one_place() -> Result<()> {
        for keys_target in [0, 12, 40] {
            slice_merges_by(RunPolicy {
                keys_min: 4,
                runs_max: 7,
                slices: 4,
                keys_target,
            })?;
        }
        Ok(())
    }

    fn slice_merges_by(policy: RunPolicy) -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut live: Vec<u128> = Vec::new();
        let mut runs = Runs::default();
        let mut id = 0u64;
        let mut slice_merges = 0;
        // Every row's value when first seen, by (table is gone, commit number).
        let mut rows: std::collections::HashMap<(bool, u64), Vec<u8>> = Default::default();
        for no in 1..=120u64 {
            let mut txn = store.write()?;
            let mut update = IndexUpdate::new(&runs);
            let adds = (next() % 12) as usize;
            let mut added = Vec::new();
            for _ in 0..adds {
                id += 1;
                let k = key(next(), id);
                update.add(k);
                added.push(k);
            }
            if adds > 0 && next() % 4 == 0 {
                let k = added.swap_remove((next() % added.len() as u64) as usize);
                update.remove(k, true);
            }
            for _ in 0..(next() % 5) {
                if live.is_empty() {
                    break;
                }
                let k = live.swap_remove((next() % live.len() as u64) as usize);
                update.remove(k, false);
            }
            let marks = runs.marks().to_vec();
            let after = update.finish(&mut txn, no, policy)?;
            txn.commit()?;
            live.extend(added);
            if let Some(after) = after {
                // Some slices merged, not all.
                if !after.marks().is_empty() && after.marks() != marks {
                    slice_merges += 1;
                }
                runs = after;
            }
            assert!(
                runs.len() < policy.runs_max,
                "commit {no}: {} runs",
                runs.len()
            );
            assert_eq!(
                Runs::load(&store.read()?)?.summary(),
                runs.summary(),
                "commit {no}"
            );
            assert_eq!(Runs::load(&store.read()?)?.marks(), runs.marks());
            for (gone, table) in [(false, meta::FPS_RUNS), (true, meta::FPS_GONE)] {
                for item in store.read()?.iter(table)? {
                    let (row, v) = item?;
                    let first = rows.entry((gone, row)).or_insert_with(|| v.clone());
                    assert_eq!(*first, v, "commit {no}: row {row} (gone: {gone}) rewritten");
                }
            }
            let tree: FxHashSet<u128> = btree(&store)?.into_iter().collect();
            let gone: Vec<u128> = Runs::load_gone(&store.read()?)?
                .into_iter()
                .map(|(_, k)| k)
                .collect();
            for &k in &gone {
                assert!(!live.contains(&k), "commit {no}: live key {k:#x} gone");
                assert!(
                    runs.dead[runs.slice(k)].contains(k) != tree.contains(&k),
                    "commit {no}: gone key {k:#x} neither dead in a run nor in the B-tree"
                );
            }
            for &k in &live {
                assert!(
                    runs.holds(k) != tree.contains(&k),
                    "commit {no}: live key {k:#x} in {} places",
                    if tree.contains(&k) { 2 } else { 0 }
                );
            }
            let stale = gone.iter().filter(|k| tree.contains(k)).count();
            assert_eq!(
                tree.len() - stale,
                live.len() - runs.keys().count(),
                "commit {no}"
            );
        }
        assert!(
            slice_merges > 10,
            "{policy:?}: only {slice_merges} slice merges"
        );
        Ok(())
    }

    /// Rows merged a slice at a time by one slice count are merged all at once by the first
    /// commit under another (the marks mean nothing to it), which leaves every live key in
    /// the B-tree and no row or mark behind; a slice's keys are one range of a sorted row.
    #[test]
    fn another_slice_count_merges_everything_first() -> Result<()> {
        let four = RunPolicy {
            keys_min: 2,
            runs_max: 16,
            slices: 4,
            keys_target: 6,
        };
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let q = u64::MAX / 4 + 1;
        let mut all = Vec::new();
        let mut runs = Runs::default();
        for no in 1..=3u64 {
            let added: Vec<u128> = (0..4).map(|s| key(s * q + no, no * 10 + s)).collect();
            let mut txn = store.write()?;
            let mut update = IndexUpdate::new(&runs);
            for &k in &added {
                update.add(k);
            }
            runs = update.finish(&mut txn, no, four)?.expect("a run");
            txn.commit()?;
            all.extend(added);
        }
        assert_eq!(runs.marks(), &[2, 3, 3, 0][..]);
        assert_eq!(runs.len(), 3, "rows with unmerged slices are kept");
        let mut txn = store.write()?;
        let two = RunPolicy { slices: 2, ..four };
        runs = IndexUpdate::new(&runs)
            .finish(&mut txn, 4, two)?
            .expect("a merge");
        txn.commit()?;
        assert_eq!(runs.summary(), (vec![], 0, 0, vec![], 0));
        assert!(runs.marks().is_empty());
        assert!(store
            .read()?
            .get(meta::POOL, meta::FPS_MERGED_KEY)?
            .is_none());
        all.sort_unstable();
        assert_eq!(btree(&store)?, all);

        let keys: Vec<u128> = (0..8u64).map(|i| key(i << 61, i)).collect();
        assert_eq!(slice_range(&keys, 0, 4), 0..2);
        assert_eq!(slice_range(&keys, 2, 4), 4..6);
        assert_eq!(slice_range(&keys, 3, 4), 6..8);
        assert_eq!(slice_range(&keys[..3], 3, 4), 3..3);
        Ok(())
    }

    /// Slices split the key space by the fingerprint prefix's high bits, evenly.
    #[test]
    fn slices_split_the_prefixes_evenly() {
        assert_eq!(slice_of(key(0, 5), 16), 0);
        assert_eq!(slice_of(key(u64::MAX, 5), 16), 15);
        assert_eq!(slice_of(key(1 << 60, 0), 16), 1);
        assert_eq!(slice_of(key((1 << 60) - 1, u64::MAX), 16), 0);
        assert_eq!(slice_of(key(u64::MAX / 3 + 1, 0), 3), 1);
        assert_eq!(slice_of(key(12345, 6), 1), 0);
    }

    /// A stored run that is not whole keys in ascending order is refused as corrupt.
    #[test]
    fn a_malformed_run_is_corrupt() {
        assert!(decode(1, &[0u8; 17]).is_err());
        let keys = encode(&[5, 3]);
        assert!(matches!(decode(1, &keys), Err(Error::Corrupt(m)) if m.contains("out of order")));
        assert_eq!(decode(1, &encode(&[3, 5])).expect("ascending"), vec![3, 5]);
    }
}
