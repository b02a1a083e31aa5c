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
//! The merge is **rolling**: the key space is cut into [`RunPolicy::slices`] slices (by the
//! fingerprint prefix's high bits, [`slice_of`]), and every commit that writes a run also
//! merges one slice (commit number modulo slices) of every run, of the gone rows and of its
//! own keys. Each such commit thus rewrites about one slice of the B-tree's leaves, the same
//! work every time, where merging all runs at once every few commits made every one of those
//! commits several times longer than the others (seconds on a pool of millions of chunks, felt
//! by every writer paced behind it). The rows are not rewritten without the slice (that wrote
//! each key ~8 more times, ~120 bytes of metadata per new block, and was most of the merge's
//! CPU): the **merge marks** ([`crate::meta::FPS_MERGED_KEY`], one small row) hold, per slice,
//! the commit that last merged it, and a row's keys of slice `s` are merged once the row is
//! not newer than that commit. A row is deleted once every slice of it is merged, within
//! `slices` commits that write runs. Keys sort by slice, so a row's keys of one slice are one
//! range of it, found by binary search. The commit that would bring the runs to
//! [`RunPolicy::runs_max`] (or past [`RUN_KEYS_MAX`] keys) still merges them all, as does
//! every one when `slices` is 1.
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
//! The runs and the gone keys of runs (*dead* keys) are kept in memory ([`Runs`], loaded at
//! open), so a lookup in them is a binary search per run, with no store read; gone keys of the
//! B-tree are only counted in memory and read back by the merge. A commit installs its new [`Runs`]
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
    /// Most runs kept: the commit that would write one more merges them all instead.
    pub runs_max: usize,
    /// Slices of the key space merged in turn (1: the runs are merged only all at once).
    /// With more, every commit that writes a run also merges one slice of every run (see
    /// [`slice_of`]), so a run empties within that many such commits.
    pub slices: usize,
}

/// The slice of the key space `key` is in, of `slices` (fingerprints are uniform, so each
/// slice holds an equal share of the keys and of the B-tree's leaves).
pub(crate) fn slice_of(key: u128, slices: usize) -> usize {
    (((key >> 64) * slices as u128) >> 64) as usize
}

/// One commit's new index keys, sorted.
#[derive(Debug)]
pub(crate) struct Run {
    /// The commit (batch) number that wrote it: its key in `fps.runs`.
    pub no: u64,
    /// The keys, ascending.
    pub keys: Vec<u128>,
    /// The lowest and highest chunk id among the keys. A commit's new chunks have ids taken
    /// between its cut and the one before, so the runs' id ranges barely overlap, and a key
    /// whose chunk id lies outside a run's range is not searched for in it: a dying chunk's
    /// key costs one binary search, not one per run (which was half of an overwrite
    /// commit's CPU, every search a chain of cache misses).
    ids: (u64, u64),
}

impl Run {
    fn new(no: u64, keys: Vec<u128>) -> Run {
        let ids = keys
            .iter()
            .map(|&k| meta::fps_key_chunk(k))
            .fold((u64::MAX, u64::MIN), |(lo, hi), id| {
                (lo.min(id), hi.max(id))
            });
        Run { no, keys, ids }
    }

    /// Whether `key` is in this run (merged out or not).
    fn contains(&self, key: u128) -> bool {
        let id = meta::fps_key_chunk(key);
        self.ids.0 <= id && id <= self.ids.1 && self.keys.binary_search(&key).is_ok()
    }
}

/// The positions in ascending `keys` of the keys of slice `slice` (of `slices`): one range,
/// since [`slice_of`] grows with the key.
fn slice_range(keys: &[u128], slice: usize, slices: usize) -> std::ops::Range<usize> {
    let start = keys.partition_point(|&k| slice_of(k, slices) < slice);
    let end = start + keys[start..].partition_point(|&k| slice_of(k, slices) == slice);
    start..end
}

/// The index keys not (yet) in the B-tree, and the keys of chunks that died since the last
/// merge, as committed.
#[derive(Debug, Default, Clone)]
pub(crate) struct Runs {
    /// Oldest first, each with its keys as written (those of merged slices included).
    runs: Vec<Arc<Run>>,
    /// Keys of chunks that died while in a run (not merged out yet).
    dead: FxHashSet<u128>,
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
        let mut runs = Runs {
            merged: Self::load_marks(txn)?,
            ..Runs::default()
        };
        for item in txn.iter(meta::FPS_RUNS)? {
            let (no, v) = item?;
            runs.runs.push(Arc::new(Run::new(no, decode(no, &v)?)));
        }
        for item in txn.iter(meta::FPS_GONE)? {
            let (no, v) = item?;
            runs.gone_rows.push(no);
            for k in decode(no, &v)? {
                if !runs.pending(no, k) {
                    continue;
                }
                if runs.contains(k) {
                    runs.dead.insert(k);
                } else {
                    runs.gone_in_tree += 1;
                }
            }
        }
        Ok(runs)
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

    /// Whether the keys of `key`'s slice in row `no` (a run or a gone row) are not merged yet.
    fn pending(&self, no: u64, key: u128) -> bool {
        no > mark_of(&self.merged, key)
    }

    /// The runs whose keys of `key`'s slice are not merged yet.
    fn pending_runs(&self, key: u128) -> impl DoubleEndedIterator<Item = &Arc<Run>> + '_ {
        let mark = mark_of(&self.merged, key);
        self.runs.iter().filter(move |r| r.no > mark)
    }

    /// The chunk ids of live keys with fingerprint prefix `prefix`, newest run first.
    pub fn candidates(&self, prefix: u64) -> impl Iterator<Item = u64> + '_ {
        let lo = (prefix as u128) << 64;
        self.pending_runs(lo).rev().flat_map(move |run| {
            let from = run.keys.partition_point(|&k| k < lo);
            run.keys[from..]
                .iter()
                .take_while(move |&&k| meta::fps_key_prefix(k) == prefix)
                .filter(|k| !self.dead.contains(k))
                .map(|&k| meta::fps_key_chunk(k))
        })
    }

    /// Whether `key` is in a run, not merged out (dead or not).
    pub fn contains(&self, key: u128) -> bool {
        self.pending_runs(key).any(|r| r.contains(key))
    }

    /// Whether `key` is a live key of a run.
    pub fn holds(&self, key: u128) -> bool {
        !self.dead.contains(&key) && self.contains(key)
    }

    /// Every live key in the runs (unordered across runs).
    pub fn keys(&self) -> impl Iterator<Item = u128> + '_ {
        self.runs
            .iter()
            .flat_map(|r| self.pending_keys(r))
            .filter(|k| !self.dead.contains(k))
    }

    /// The positions in `run.keys` of its keys not merged out yet, ascending.
    fn pending_ranges<'a>(
        &'a self,
        run: &'a Run,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
        // Without marks, one slice holding every key, never merged (commit numbers start at 1).
        let slices = self.merged.len().max(1);
        (0..slices)
            .filter(move |&s| run.no > self.merged.get(s).copied().unwrap_or(0))
            .map(move |s| slice_range(&run.keys, s, slices))
    }

    /// The keys of `run` not merged out yet (dead ones included), ascending.
    fn pending_keys<'a>(&'a self, run: &'a Run) -> impl Iterator<Item = u128> + 'a {
        self.pending_ranges(run)
            .flat_map(move |range| run.keys[range].iter().copied())
    }

    /// How many keys of `run` are not merged out yet.
    fn pending_len(&self, run: &Run) -> usize {
        self.pending_ranges(run).map(|r| r.len()).sum()
    }

    /// The merge marks (see [`Runs::merged`]'s field doc; empty when there are none).
    pub fn marks(&self) -> &[u64] {
        &self.merged
    }

    /// Every dead key.
    pub fn dead(&self) -> impl Iterator<Item = u128> + '_ {
        self.dead.iter().copied()
    }

    /// Number of runs.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// The runs' commit numbers and counts of keys not merged out, the number of dead keys,
    /// the gone rows and the number of gone keys of the B-tree (to compare two views of the
    /// runs).
    pub fn summary(&self) -> (Vec<(u64, usize)>, usize, Vec<u64>, usize) {
        let runs = self
            .runs
            .iter()
            .map(|r| (r.no, self.pending_len(r)))
            .collect();
        (
            runs,
            self.dead.len(),
            self.gone_rows.clone(),
            self.gone_in_tree,
        )
    }

    /// Keys in the runs not merged out, dead ones included.
    fn stored_keys(&self) -> usize {
        self.runs.iter().map(|r| self.pending_len(r)).sum()
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
        let runs_full = as_run
            && (runs.len() + 1 >= policy.runs_max
                || runs.stored_keys() + self.added.len() > RUN_KEYS_MAX);
        let tree_gone = runs.gone_in_tree + self.gone.len() - self.dead.len();
        let gone_full = !self.gone.is_empty()
            && (runs.gone_rows.len() + 1 > GONE_ROWS_MAX || tree_gone > RUN_KEYS_MAX);
        // Rows merged a slice at a time by another slice count (the pool's setting changed):
        // merged all at once, after which the marks start afresh.
        let resliced = !runs.merged.is_empty() && runs.merged.len() != policy.slices;
        if runs_full || gone_full || resliced {
            return self.merge(txn).map(Some);
        }
        if as_run && policy.slices > 1 {
            return self
                .merge_slice(txn, no, (no % policy.slices as u64) as usize, policy.slices)
                .map(Some);
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
            next.dead.extend(self.dead);
        }
        if as_run {
            txn.insert(meta::FPS_RUNS, &no, encode(&self.added).as_slice());
            next.runs.push(Arc::new(Run::new(no, self.added)));
        }
        Ok(Some(next))
    }

    /// Commit `no`'s changes with slice `slice` (of `slices`) merged: the slice's live keys of
    /// every run and of the added ones go into the B-tree, its gone keys of the B-tree are
    /// removed from it, in key order; the merge marks record that the rows so far hold no more
    /// of the slice, and rows with every slice merged are deleted; the other added keys become
    /// run `no` and the other gone keys gone row `no`. Every key stays in exactly one place.
    fn merge_slice(self, txn: &mut WriteTxn, no: u64, slice: usize, slices: usize) -> Result<Runs> {
        let runs = self.runs;
        debug_assert!(runs.merged.is_empty() || runs.merged.len() == slices);
        let ours = |k: &u128| slice_of(*k, slices) == slice;
        let mut merged = match runs.merged.is_empty() {
            true => vec![0; slices],
            false => runs.merged.clone(),
        };
        // Rows newer than this hold keys of the slice not merged yet.
        let last = merged[slice];
        merged[slice] = no;
        let mut into_tree: Vec<u128> = Vec::new();
        for run in runs.runs.iter().filter(|r| r.no > last) {
            let range = slice_range(&run.keys, slice, slices);
            into_tree.extend(
                run.keys[range]
                    .iter()
                    .copied()
                    .filter(|k| !runs.dead.contains(k)),
            );
        }
        // Dead keys of the slice left the runs with it; the others stay dead.
        let mut dead: FxHashSet<u128> = runs.dead.iter().copied().filter(|k| !ours(k)).collect();
        let mut stale: Vec<u128> = Vec::new();
        for &row_no in runs.gone_rows.iter().filter(|&&r| r > last) {
            let row = txn.get(meta::FPS_GONE, &row_no)?.ok_or_else(|| {
                Error::Corrupt(format!("dedup index gone row {row_no} is missing"))
            })?;
            let keys = decode(row_no, &row)?;
            let range = slice_range(&keys, slice, slices);
            stale.extend(keys[range].iter().copied().filter(|k| !runs.contains(*k)));
        }
        let stale_before = stale.len();
        // This commit's gone keys of the slice: those of the B-tree go now, those of a run
        // left it above (they are dead there).
        let dead_now: FxHashSet<u128> = self.dead.iter().copied().collect();
        let (gone_now, gone_later): (Vec<u128>, Vec<u128>) =
            self.gone.into_iter().partition(|k| ours(k));
        stale.extend(gone_now.into_iter().filter(|k| !dead_now.contains(k)));
        into_tree.retain(|k| !dead_now.contains(k));
        let in_tree_later = gone_later.iter().filter(|k| !dead_now.contains(k)).count();
        dead.extend(self.dead.into_iter().filter(|k| !ours(k)));
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
            runs: Vec::new(),
            dead,
            gone_rows: Vec::new(),
            gone_in_tree: runs.gone_in_tree - stale_before + in_tree_later,
            merged,
        };
        for run in &runs.runs {
            if run.no <= done {
                txn.remove(meta::FPS_RUNS, &run.no);
            } else {
                next.runs.push(run.clone());
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
            next.runs.push(Arc::new(Run::new(no, added_later)));
        }
        if next.runs.is_empty() && next.gone_rows.is_empty() {
            next.merged.clear();
            txn.remove(meta::POOL, meta::FPS_MERGED_KEY);
        } else {
            txn.insert(
                meta::POOL,
                meta::FPS_MERGED_KEY,
                encode_marks(&next.merged).as_slice(),
            );
        }
        Ok(next)
    }

    /// Moves every live key of the runs, and the added ones, into the B-tree and removes every
    /// gone key of the B-tree, in key order; removes the runs and the gone rows.
    fn merge(self, txn: &mut WriteTxn) -> Result<Runs> {
        let runs = self.runs;
        let dead: FxHashSet<u128> = runs.dead.iter().chain(&self.dead).copied().collect();
        let mut all = self.added;
        all.extend(
            runs.runs
                .iter()
                .flat_map(|r| runs.pending_keys(r))
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
        for r in &runs.runs {
            txn.remove(meta::FPS_RUNS, &r.no);
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
            assert_eq!(runs.summary(), (vec![(2, 5)], 0, vec![], 0));
            assert_eq!(runs.candidates(7).collect::<Vec<_>>(), vec![10, 12]);
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
            assert_eq!(runs.summary(), (vec![(2, 5), (3, 4)], 1, vec![3], 1));
            assert_eq!(runs.candidates(7).collect::<Vec<_>>(), vec![20, 10, 12]);
            assert_eq!(runs.candidates(3).count(), 0, "a dead key is no candidate");
            assert!(runs.holds(key(6, 21)) && !runs.holds(key(3, 11)));
            assert_eq!(
                btree(&store)?,
                vec![key(2, 2), key(9, 1)],
                "a gone key of the B-tree waits there for the merge"
            );
            let loaded = Runs::load(&store.read()?)?;
            assert_eq!(loaded.summary(), runs.summary());
            assert_eq!(
                loaded.keys().collect::<Vec<_>>(),
                runs.keys().collect::<Vec<_>>()
            );

            // The third run merges: every live key lands in the B-tree, in one place.
            let third = [key(4, 30), key(4, 31), key(9, 32), key(2, 33)];
            let runs = commit(&store, &runs, 4, &third, &[(key(7, 12), false)])?;
            assert_eq!(runs.summary(), (vec![], 0, vec![], 0));
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
        let (_, dead, rows, in_tree) = runs.summary();
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
        assert_eq!(runs.summary(), (vec![], 0, vec![], 0));
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
        assert_eq!(runs.summary(), (vec![(1, 4)], 0, vec![], 0));
        assert!(!runs.contains(key(3, 3)));
        let runs = commit(&store, &runs, 2, &[key(6, 6)], &[(key(6, 6), true)])?;
        assert_eq!(runs.summary(), (vec![(1, 4)], 0, vec![], 0));
        assert!(btree(&store)?.is_empty());
        Ok(())
    }

    /// A run is searched only for keys whose chunk id lies in its range of ids, and found there
    /// whether or not other runs' ranges overlap it.
    #[test]
    fn a_run_is_searched_by_its_chunk_ids() {
        let runs = Runs {
            runs: vec![
                Arc::new(Run::new(1, vec![key(1, 10), key(5, 30)])),
                Arc::new(Run::new(2, vec![key(2, 20), key(3, 40)])),
            ],
            ..Runs::default()
        };
        for k in [key(1, 10), key(5, 30), key(2, 20), key(3, 40)] {
            assert!(runs.contains(k), "{k:#x}");
        }
        for k in [key(1, 20), key(2, 10), key(5, 9), key(3, 41), key(4, 25)] {
            assert!(!runs.contains(k), "{k:#x}");
        }
        assert_eq!(Run::new(3, vec![]).ids, (u64::MAX, 0));
        assert!(!Run::new(3, vec![]).contains(key(0, 0)));
    }

    /// Random commits with slice merges (and full merges past `runs_max`), checked after
    /// each against a model: every live key is in exactly one place (a run or the B-tree),
    /// every gone key is dead in a run or stale in the B-tree, the runs and merge marks reload
    /// as held, a run empties within `slices` commits that write runs, and no run or gone row
    /// is ever rewritten.
    #[test]
    fn slice_merges_keep_every_key_in_one_place() -> Result<()> {
        let policy = RunPolicy {
            keys_min: 4,
            runs_max: 7,
            slices: 4,
        };
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
            let before = runs.len();
            let after = update.finish(&mut txn, no, policy)?;
            txn.commit()?;
            live.extend(added);
            if let Some(after) = after {
                if after.len() > 0 && after.len() <= before + 1 && adds >= policy.keys_min {
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
                    runs.dead.contains(&k) != tree.contains(&k),
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
        assert!(slice_merges > 20, "only {slice_merges} slice merges");
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
        assert_eq!(runs.marks(), &[0, 1, 2, 3][..]);
        assert_eq!(runs.len(), 3, "rows with unmerged slices are kept");
        let mut txn = store.write()?;
        let two = RunPolicy { slices: 2, ..four };
        runs = IndexUpdate::new(&runs)
            .finish(&mut txn, 4, two)?
            .expect("a merge");
        txn.commit()?;
        assert_eq!(runs.summary(), (vec![], 0, vec![], 0));
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
