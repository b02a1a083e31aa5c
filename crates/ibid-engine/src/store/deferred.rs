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
//! - **Pending** (in memory, [`Pending`]): every change logged and not yet written back, last
//!   one per key, in key order; loaded from the log at open. Reads of the table see pending
//!   over the B-tree.
//! - **Each commit** (of a non-empty batch): its changes to the table leave the batch for one
//!   log row per slice they touch; the pending changes of the slice whose turn it is (slices
//!   with nothing pending are skipped) go into the batch as the table's writes, with deletes
//!   of that slice's log rows; more slices, the fullest first, while pending would hold more
//!   than [`PENDING_MAX`] keys. The commit's own changes always stay pending, even in a slice
//!   written back now.
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
//!   key_len u16 LE | key | tag u8 (0: deleted, 1: set) | if set: value_len u32 LE | value
//! ```

use super::{Batch, Codec, Snapshot, Table};
use crate::error::{Error, Result};
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;
use std::ops::Bound;
use std::sync::Arc;

/// The table whose writes are deferred.
pub const DEFERRED: Table = Table::MapPages;
/// Its log.
pub const LOG: Table = Table::MapLog;
/// Slices of the key space.
pub const SLICES: usize = 16;
/// Pending keys past which a commit writes back more than one slice (~200 bytes of memory
/// each with a map page's value).
pub const PENDING_MAX: usize = 512 << 10;
/// Log row keys: the slice in the top byte, the sequence below.
const SEQ_BITS: u32 = 56;

/// A key or value shared between pending states (a commit's new state reuses the old one's).
pub type Bytes = Arc<[u8]>;
/// A pending change: the key, and its value (`None`: deleted).
pub type Change = (Bytes, Option<Bytes>);

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

/// Changes logged and not yet written back, last one per key: in key order, and by key.
///
/// The index is for point reads: every 4 KiB overwrite reads its block's committed entry,
/// and a binary search of half a million keys, each behind its own pointer, was 14 % of the
/// writers' CPU in a steady random overwrite.
#[derive(Debug, Default)]
pub struct Pending {
    changes: Vec<Change>,
    index: FxHashMap<Bytes, Option<Bytes>>,
}

impl Pending {
    /// The state holding `changes` (in key order, one per key).
    fn new(changes: Vec<Change>) -> Pending {
        let index = changes.iter().cloned().collect();
        Pending { changes, index }
    }

    /// The pending change to `key`, if any: `Some(None)` for a delete.
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.index.get(key).map(Option::as_deref)
    }

    /// The pending changes with keys in `(lo, hi)`, in key order.
    pub fn range(&self, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> &[Change] {
        let start = match lo {
            Bound::Included(l) => self.changes.partition_point(|(k, _)| &**k < l),
            Bound::Excluded(l) => self.changes.partition_point(|(k, _)| &**k <= l),
            Bound::Unbounded => 0,
        };
        let end = match hi {
            Bound::Included(h) => self.changes.partition_point(|(k, _)| &**k <= h),
            Bound::Excluded(h) => self.changes.partition_point(|(k, _)| &**k < h),
            Bound::Unbounded => self.changes.len(),
        };
        &self.changes[start..end.max(start)]
    }

    /// Keys pending.
    pub fn len(&self) -> usize {
        self.changes.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
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
        let mut log = LogState::default();
        let mut latest: std::collections::BTreeMap<Bytes, Option<Bytes>> = Default::default();
        // Rows in key order: each slice's in sequence order, so a later change wins.
        for item in snap.range(LOG, Bound::Unbounded, Bound::Unbounded)? {
            let (k, v) = item?;
            let row = u64::decode(&k)?;
            let slice = (row >> SEQ_BITS) as usize;
            if slice >= SLICES {
                return Err(Error::Corrupt(format!(
                    "map log row {row:#x}: slice {slice}"
                )));
            }
            for (key, value) in decode_row(row, &v)? {
                latest.insert(key, value);
            }
            log.rows[slice].push(row);
            log.next_seq = log.next_seq.max((row & ((1 << SEQ_BITS) - 1)) + 1);
        }
        Ok(Deferred {
            published: RwLock::new(Arc::new(Pending::new(latest.into_iter().collect()))),
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
    pub fn stage(&self, batch: &mut Batch, pending: &Pending, all: bool) -> Staged {
        let mut log = self.log.lock().clone();
        let ops = &mut batch.tables[DEFERRED.index()];
        let new: Vec<Change> = ops
            .sorted()
            .into_iter()
            .map(|(k, v)| (Bytes::from(k), v.map(Bytes::from)))
            .collect();
        ops.clear();

        // The slices written back: the next one with anything pending, then the fullest while
        // too much would stay.
        let mut per_slice = [0usize; SLICES];
        for (k, _) in &pending.changes {
            per_slice[slice_of(k)] += 1;
        }
        let mut back = [all; SLICES];
        let mut staying = if all {
            new.len()
        } else {
            pending.len() + new.len()
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

        let table = &mut batch.tables[DEFERRED.index()];
        for (k, v) in pending.changes.iter().filter(|(k, _)| back[slice_of(k)]) {
            table.set(k.to_vec(), v.as_deref().map(<[u8]>::to_vec));
        }
        let rows = &mut batch.tables[LOG.index()];
        for s in (0..SLICES).filter(|&s| back[s]) {
            for row in std::mem::take(&mut log.rows[s]) {
                rows.set(row.encode(), None);
            }
        }
        let mut by_slice: [Vec<&Change>; SLICES] = Default::default();
        for c in &new {
            by_slice[slice_of(&c.0)].push(c);
        }
        for (s, changes) in by_slice.iter().enumerate().filter(|(_, c)| !c.is_empty()) {
            let row = (s as u64) << SEQ_BITS | log.next_seq;
            log.next_seq += 1;
            log.rows[s].push(row);
            rows.set(row.encode(), Some(encode_row(changes)));
        }

        // The new pending state: the old one less the slices written back, with the new
        // changes over it (both in key order), and its index made the same way from the old
        // one's (cheaper than building it anew).
        let mut index = pending.index.clone();
        if back.iter().any(|&b| b) {
            for (k, _) in pending.changes.iter().filter(|(k, _)| back[slice_of(k)]) {
                index.remove(k);
            }
        }
        for (k, v) in &new {
            index.insert(k.clone(), v.clone());
        }
        let mut changes = Vec::with_capacity(staying);
        let mut old = pending
            .changes
            .iter()
            .filter(|(k, _)| !back[slice_of(k)])
            .peekable();
        for c in new {
            while let Some(o) = old.next_if(|o| o.0 < c.0) {
                changes.push(o.clone());
            }
            old.next_if(|o| o.0 == c.0);
            changes.push(c);
        }
        changes.extend(old.cloned());
        Staged {
            pending: Arc::new(Pending { changes, index }),
            log,
        }
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
        if mine.changes != stored_pending.changes {
            let first = mine
                .changes
                .iter()
                .zip(stored_pending.changes.iter())
                .position(|(a, b)| a != b)
                .unwrap_or(mine.len().min(stored_pending.len()));
            return Err(Error::Corrupt(format!(
                "map log: {} changes pending in memory, {} in the log rows; first difference at {first}",
                mine.len(),
                stored_pending.len()
            )));
        }
        let indexed = mine.index.len() == mine.len()
            && mine
                .changes
                .iter()
                .all(|(k, v)| mine.index.get(k) == Some(v));
        if !indexed {
            return Err(Error::Corrupt(
                "map log: pending index differs from the changes".into(),
            ));
        }
        if self.log.lock().rows != stored.log.lock().rows {
            return Err(Error::Corrupt(
                "map log: rows differ from the ones in memory".into(),
            ));
        }
        Ok(())
    }
}

fn encode_row(changes: &[&Change]) -> Vec<u8> {
    let mut out = (changes.len() as u32).to_le_bytes().to_vec();
    for (k, v) in changes {
        out.extend_from_slice(&(k.len() as u16).to_le_bytes());
        out.extend_from_slice(k);
        match v {
            None => out.push(0),
            Some(v) => {
                out.push(1);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
        }
    }
    out
}

fn decode_row(row: u64, mut b: &[u8]) -> Result<Vec<Change>> {
    let corrupt = |what: &str| Error::Corrupt(format!("map log row {row:#x}: {what}"));
    let take = |b: &mut &[u8], n: usize| -> Result<Vec<u8>> {
        if b.len() < n {
            return Err(corrupt("truncated"));
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Ok(head.to_vec())
    };
    let count = u32::from_le_bytes(take(&mut b, 4)?.try_into().expect("4 bytes"));
    let mut out: Vec<Change> = Vec::new();
    for _ in 0..count {
        let n = u16::from_le_bytes(take(&mut b, 2)?.try_into().expect("2 bytes")) as usize;
        let key = take(&mut b, n)?;
        let value = match take(&mut b, 1)?[0] {
            0 => None,
            1 => {
                let n = u32::from_le_bytes(take(&mut b, 4)?.try_into().expect("4 bytes"));
                Some(Bytes::from(take(&mut b, n as usize)?))
            }
            t => return Err(corrupt(&format!("tag {t}"))),
        };
        if out.last().is_some_and(|(k, _)| **k >= *key) {
            return Err(corrupt("keys out of order"));
        }
        out.push((Bytes::from(key), value));
    }
    if !b.is_empty() {
        return Err(corrupt("bytes after the last change"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows decode to what was encoded; a cut or a bad tag is corrupt, not misread.
    #[test]
    fn rows_round_trip_and_reject_damage() {
        let a: Change = (Bytes::from(&b"aa"[..]), Some(Bytes::from(&b"value"[..])));
        let b: Change = (Bytes::from(&b"ab"[..]), None);
        let row = encode_row(&[&a, &b]);
        assert_eq!(
            decode_row(1, &row).expect("good"),
            vec![a.clone(), b.clone()]
        );
        for cut in 1..row.len() {
            assert!(decode_row(1, &row[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = row.clone();
        bad[8] = 7;
        assert!(matches!(decode_row(1, &bad), Err(Error::Corrupt(_))));
        assert!(decode_row(1, &encode_row(&[&b, &a])).is_err(), "order");
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
                            let v = format!("{round}-{}", next() % 1000).into_bytes();
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
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
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
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
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
