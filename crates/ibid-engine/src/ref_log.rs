//! Reference-count changes to committed chunks, logged and folded into the chunk records one
//! slice at a time.
//!
//! An overwrite takes a reference from the chunk it replaces. Applied at the commit, each such
//! change read and rewrote that chunk's page of the chunk table: on a volume overwritten at
//! random, a random leaf of the table's B-tree copied per block, about two thirds of a commit's
//! store work (BENCHMARKS.md, "The reference-count log"). Instead a commit appends its changes
//! to committed chunks here, one row per slice, and **folds** one slice: it takes the slice's
//! rows, adds them up with its own changes to that slice, applies the sums to the records in
//! chunk-id order (a chunk left with no reference dies there, see `commit.rs`) and deletes the
//! rows. A slice is every [`SLICES`]th stretch of [`SPAN_PAGES`] chunk pages, so a fold rewrites
//! the pages of about a [`SLICES`]th of the table, each once, in key order, for about
//! [`SLICES`] commits' worth of changes.
//!
//! A chunk's reference count is its record's `refs` plus the deltas logged for it. Every change
//! to a chunk is logged in the chunk's own slice, so a fold sees them all: a chunk dies only
//! when its slice is folded and the sum is zero (until then it is found and shared like any
//! other, which is correct: its data is still there). Readers that need exact counts add
//! [`pending`] to the records. Which slice a commit folds: the next in turn; all of them when
//! asked ([`FoldRequest::All`]: [`crate::Pool::sync`]); the [`PRESSED_SLICES`] fullest when
//! the log holds more than [`ENTRIES_MAX`] deltas or when the space it may free is over a
//! quarter of the free space (`commit.rs`: a nearly full pool gets its space back within a few
//! commits); on an idle pool the background thread asks for the next slice that holds any
//! ([`FoldRequest::Next`]), a commit at a time.
//!
//! # Rows (`chunk.deltas`)
//!
//! ```text
//! key:    slice << 56 | row number   (u64; row numbers are never reused)
//! value:  entry*                     (ascending chunk id, each in the key's slice, no zero delta)
//! entry:  chunk id u64 LE | delta i64 LE
//! ```
//!
//! Pools of format 12 and older cut the log in 16 slices (key `slice << 60 | row number`);
//! [`upgrade`] sums their rows' deltas and logs them again in this layout.

use crate::chunk_table::page_of;
use crate::error::{Error, Result};
use crate::meta;
use crate::store::{ReadTxn, WriteTxn};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Number of slices. A fold rewrites the chunk pages of one slice whatever the number of
/// deltas it applies (on a volume overwritten at random every page of the slice has some), so
/// the table's bytes rewritten per commit are its size over `SLICES`; 64 rather than 16 cut
/// an overwrite commit's time per block by about a third (BENCHMARKS.md, "Folds of a
/// sixty-fourth", session 53), for deaths found up to 64 commits later.
pub(crate) const SLICES: usize = 64;
/// Chunk pages per stretch of a slice: 256 pages, 4 Ki sequence numbers.
pub(crate) const SPAN_PAGES: u64 = 256;
/// Logged deltas past which every commit folds [`PRESSED_SLICES`] slices.
pub(crate) const ENTRIES_MAX: u64 = 4 << 20;
/// Slices a commit folds when the log is long or the space it may free is needed: the fullest
/// ones. Not all of them: on a full pool of 2 Mi chunks that one transaction rewrote most of
/// the chunk table in a second, and its new pages (the old ones free only after the commit)
/// doubled the store's file for good (BENCHMARKS.md, session 37).
pub(crate) const PRESSED_SLICES: usize = 4;
/// A row key's slice is its top bits.
const SLICE_SHIFT: u32 = 56;
/// Encoded size of one entry.
const ENTRY_BYTES: usize = 16;

/// The slice of chunk `id`.
pub(crate) fn slice_of(id: u64) -> usize {
    (page_of(id) / SPAN_PAGES % SLICES as u64) as usize
}

/// Reference deltas, ascending by chunk id.
pub(crate) type Deltas = BTreeMap<u64, i64>;

/// What the next commit was asked to fold beyond its turn.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FoldRequest {
    /// Nothing: the slice whose turn it is.
    #[default]
    None,
    /// The next slice that holds anything, even if the commit has nothing else to do.
    Next,
    /// Every slice.
    All,
}

/// The log's state in memory: what it holds per slice (the rows themselves are only in the
/// store). Owned by the committer; changed only with the commit lock held.
#[derive(Debug)]
pub(crate) struct RefLog {
    next_row: u64,
    /// Deltas logged per slice.
    entries: [u64; SLICES],
    /// The slice the next commit folds.
    next_slice: usize,
    /// What the next commit folds beyond its turn.
    request: FoldRequest,
}

impl Default for RefLog {
    fn default() -> Self {
        RefLog {
            next_row: 0,
            entries: [0; SLICES],
            next_slice: 0,
            request: FoldRequest::None,
        }
    }
}

fn row_key(slice: usize, row: u64) -> u64 {
    debug_assert!(slice < SLICES && row < 1 << SLICE_SHIFT);
    (slice as u64) << SLICE_SHIFT | row
}

/// Packs `deltas` as a row's value, leaving out zero deltas.
fn encode(deltas: &Deltas) -> Vec<u8> {
    let mut out = Vec::with_capacity(deltas.len() * ENTRY_BYTES);
    for (&id, &d) in deltas.iter().filter(|&(_, &d)| d != 0) {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}

/// Decodes row `key`, checking its entries; calls `f` with each (chunk id, delta).
fn decode(key: u64, v: &[u8], f: impl FnMut(u64, i64)) -> Result<()> {
    let slice = (key >> SLICE_SHIFT) as usize;
    if slice >= SLICES {
        return Err(Error::Corrupt(format!(
            "reference log row {key:#x}: slice {slice}"
        )));
    }
    decode_entries(key, v, Some(slice), f)
}

/// [`decode`], with each entry's slice checked against `slice` only when given (a format-12
/// row's keys name one of 16 slices).
fn decode_entries(
    key: u64,
    v: &[u8],
    slice: Option<usize>,
    mut f: impl FnMut(u64, i64),
) -> Result<()> {
    if !v.len().is_multiple_of(ENTRY_BYTES) || v.is_empty() {
        return Err(Error::Corrupt(format!(
            "reference log row {key:#x} of {} bytes",
            v.len()
        )));
    }
    let mut prev = None;
    for e in v.chunks_exact(ENTRY_BYTES) {
        let id = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
        let d = i64::from_le_bytes(e[8..].try_into().expect("8 bytes"));
        let elsewhere = slice.is_some_and(|s| slice_of(id) != s);
        if d == 0 || elsewhere || prev.is_some_and(|p| p >= id) {
            return Err(Error::Corrupt(format!(
                "reference log row {key:#x}: entry for chunk {id:#x} ({d:+})"
            )));
        }
        prev = Some(id);
        f(id, d);
    }
    Ok(())
}

impl RefLog {
    /// The log as committed in `txn`'s snapshot.
    pub fn load(txn: &ReadTxn) -> Result<RefLog> {
        let mut log = RefLog::default();
        for item in txn.iter(meta::CHUNK_DELTAS)? {
            let (key, v) = item?;
            let mut n = 0;
            decode(key, &v, |_, _| n += 1)?;
            log.entries[(key >> SLICE_SHIFT) as usize] += n;
            log.next_row = log.next_row.max((key & ((1 << SLICE_SHIFT) - 1)) + 1);
        }
        Ok(log)
    }

    /// Deltas logged, all slices.
    pub fn entries(&self) -> u64 {
        self.entries.iter().sum()
    }

    /// Asks the next commit to fold more than its turn's slice.
    pub fn request(&mut self, what: FoldRequest) {
        self.request = what;
    }

    /// What the next commit was asked to fold (clears the request).
    pub fn take_request(&mut self) -> FoldRequest {
        std::mem::take(&mut self.request)
    }

    /// The slices a commit folds, asked for `asked`: every one for [`FoldRequest::All`]; the
    /// [`PRESSED_SLICES`] holding the most deltas if `tight` or if the log is long; the next
    /// that holds anything for [`FoldRequest::Next`] (none if the log is empty); else the next
    /// in turn.
    pub fn slices_to_fold(&mut self, asked: FoldRequest, tight: bool) -> Vec<usize> {
        if asked == FoldRequest::All {
            return (0..SLICES).collect();
        }
        if tight || self.entries() > ENTRIES_MAX {
            let mut by_size: Vec<usize> = (0..SLICES).filter(|&i| self.entries[i] > 0).collect();
            by_size.sort_by_key(|&i| std::cmp::Reverse(self.entries[i]));
            by_size.truncate(PRESSED_SLICES);
            by_size.sort_unstable();
            return by_size;
        }
        let mut s = self.next_slice;
        if asked == FoldRequest::Next {
            match (0..SLICES)
                .map(|i| (s + i) % SLICES)
                .find(|&i| self.entries[i] > 0)
            {
                Some(i) => s = i,
                None => return Vec::new(),
            }
        }
        self.next_slice = (s + 1) % SLICES;
        vec![s]
    }

    /// Appends `deltas` (each map holding one slice's changes; zero deltas are skipped) as one
    /// row per slice that has any.
    pub fn append(&mut self, txn: &mut WriteTxn, deltas: &[Deltas; SLICES]) {
        for (slice, d) in deltas.iter().enumerate() {
            let row = encode(d);
            if row.is_empty() {
                continue;
            }
            txn.insert(
                meta::CHUNK_DELTAS,
                &row_key(slice, self.next_row),
                row.as_slice(),
            );
            self.next_row += 1;
            self.entries[slice] += (row.len() / ENTRY_BYTES) as u64;
        }
    }

    /// Takes every delta logged for `slice` out of the log (its rows deleted in `txn`) and adds
    /// them to `into`.
    pub fn take(&mut self, txn: &mut WriteTxn, slice: usize, into: &mut Deltas) -> Result<()> {
        let lo = row_key(slice, 0);
        let hi = row_key(slice, (1 << SLICE_SHIFT) - 1);
        for (key, v) in txn.extract_range_if(meta::CHUNK_DELTAS, lo..=hi, |_, _| true)? {
            decode(key, &v, |id, d| *into.entry(id).or_default() += d)?;
        }
        self.entries[slice] = 0;
        Ok(())
    }
}

/// Splits `deltas` by slice.
pub(crate) fn by_slice(deltas: &Deltas) -> [Deltas; SLICES] {
    let mut out: [Deltas; SLICES] = std::array::from_fn(|_| Deltas::new());
    for (&id, &d) in deltas {
        out[slice_of(id)].insert(id, d);
    }
    out
}

/// Moves a format-12 (or older) log to this layout, in the upgrade's transaction: its rows'
/// deltas, summed per chunk, logged again as one row per slice (of [`SLICES`]). Returns the
/// deltas moved. The old rows are checked like this format's but for their entries' slices.
pub(crate) fn upgrade(txn: &mut WriteTxn) -> Result<u64> {
    let rows = txn.extract_range_if(meta::CHUNK_DELTAS, .., |_, _| true)?;
    let mut sums = Deltas::new();
    for (key, v) in &rows {
        decode_entries(*key, v, None, |id, d| *sums.entry(id).or_default() += d)?;
    }
    sums.retain(|_, d| *d != 0);
    let moved = sums.len() as u64;
    RefLog::default().append(txn, &by_slice(&sums));
    Ok(moved)
}

/// Every delta logged in `txn`'s snapshot, summed per chunk (a chunk's count is its record's
/// `refs` plus this).
pub(crate) fn pending(txn: &ReadTxn) -> Result<FxHashMap<u64, i64>> {
    let mut out: FxHashMap<u64, i64> = FxHashMap::default();
    for item in txn.iter(meta::CHUNK_DELTAS)? {
        let (key, v) = item?;
        decode(key, &v, |id, d| *out.entry(id).or_default() += d)?;
    }
    out.retain(|_, d| *d != 0);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk_table::PAGE_SHIFT;

    fn id_in(slice: usize, n: u64) -> u64 {
        // Stretch `slice` of the first round, then every SLICES stretches further.
        ((n * SLICES as u64 + slice as u64) * SPAN_PAGES) << PAGE_SHIFT
    }

    /// A format-12 log (16 slices, keys `slice << 60 | row`) moves to this layout with every
    /// chunk's sum kept, opposite deltas cancelled, and every row readable as this format's.
    #[test]
    fn an_older_log_is_logged_again_in_this_layout() -> Result<()> {
        use crate::store::{Backend, Store};
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        // Chunks of many of today's slices, so that an old row holds several of them.
        let old_slice = |id: u64| page_of(id) / SPAN_PAGES % 16;
        let ids: Vec<u64> = (0..200u64)
            .map(|n| (n * 37 * SPAN_PAGES + n) << PAGE_SHIFT)
            .collect();
        let mut want: FxHashMap<u64, i64> = FxHashMap::default();
        let mut rows: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for round in 0..3u64 {
            let mut by_old: BTreeMap<u64, Deltas> = BTreeMap::new();
            for (n, &id) in ids.iter().enumerate() {
                let d = match (round, n % 3) {
                    (0, 0) => 1,
                    (1, 0) => -1, // cancels round 0's: these chunks are left out
                    (_, 1) => -(n as i64),
                    _ => continue,
                };
                by_old.entry(old_slice(id)).or_default().insert(id, d);
                *want.entry(id).or_default() += d;
            }
            for (slice, d) in by_old {
                rows.insert(slice << 60 | (round * 16 + slice), encode(&d));
            }
        }
        want.retain(|_, d| *d != 0);
        assert_eq!(
            want.len(),
            (0..ids.len()).filter(|n| n % 3 == 1).count(),
            "the chunks whose deltas cancel out are left out"
        );
        assert!(
            rows.keys().any(|&k| (k >> SLICE_SHIFT) as usize >= SLICES),
            "old keys are not this format's"
        );
        let mut txn = store.write()?;
        for (k, v) in &rows {
            txn.insert(meta::CHUNK_DELTAS, k, v.as_slice());
        }
        txn.commit()?;

        let mut txn = store.write()?;
        assert_eq!(upgrade(&mut txn)?, want.len() as u64);
        txn.commit()?;
        let r = store.read()?;
        assert_eq!(pending(&r)?, want, "every chunk's sum kept");
        let log = RefLog::load(&r)?;
        assert_eq!(log.entries(), want.len() as u64);
        assert!(
            log.entries.iter().filter(|&&n| n > 0).count() > 16,
            "spread over this format's slices"
        );
        Ok(())
    }

    #[test]
    fn slices_cover_stretches_of_pages_in_turn() {
        assert_eq!(slice_of(0), 0);
        assert_eq!(slice_of((SPAN_PAGES << PAGE_SHIFT) - 1), 0);
        assert_eq!(slice_of(SPAN_PAGES << PAGE_SHIFT), 1);
        assert_eq!(slice_of(id_in(5, 3)), 5);
        assert_eq!(
            slice_of(id_in(SLICES - 1, 0) + (SPAN_PAGES << PAGE_SHIFT)),
            0
        );
    }

    #[test]
    fn rows_round_trip_and_malformed_ones_are_corrupt() {
        let d: Deltas = [(id_in(3, 0), -1), (id_in(3, 2) + 7, 2)].into();
        let key = row_key(3, 9);
        let mut got = Vec::new();
        decode(key, &encode(&d), |id, v| got.push((id, v))).expect("decodes");
        assert_eq!(got, d.clone().into_iter().collect::<Vec<_>>());
        // Wrong slice, unordered ids, a zero delta, a partial entry.
        let wrong_slice = encode(&[(id_in(4, 0), 1)].into());
        assert!(decode(key, &wrong_slice, |_, _| {}).is_err());
        let mut unordered = encode(&[(id_in(3, 1), 1)].into());
        unordered.extend(encode(&[(id_in(3, 0), 1)].into()));
        assert!(decode(key, &unordered, |_, _| {}).is_err());
        let mut zero = id_in(3, 0).to_le_bytes().to_vec();
        zero.extend(0i64.to_le_bytes());
        assert!(decode(key, &zero, |_, _| {}).is_err());
        assert!(decode(key, &encode(&d)[..20], |_, _| {}).is_err());
    }

    #[test]
    fn folds_go_round_the_slices_and_idle_ones_skip_empty_slices() {
        let mut log = RefLog::default();
        assert_eq!(log.slices_to_fold(FoldRequest::None, false), vec![0]);
        assert_eq!(log.slices_to_fold(FoldRequest::None, false), vec![1]);
        assert!(
            log.slices_to_fold(FoldRequest::Next, false).is_empty(),
            "nothing logged"
        );
        log.entries[7] = 3;
        assert_eq!(log.slices_to_fold(FoldRequest::Next, false), vec![7]);
        assert_eq!(log.slices_to_fold(FoldRequest::None, false), vec![8]);
        assert_eq!(
            log.slices_to_fold(FoldRequest::None, true),
            vec![7],
            "tight: what holds any"
        );
        for (i, n) in [(1, 5), (4, 9), (9, 2), (11, 7), (12, 1)] {
            log.entries[i] = n;
        }
        assert_eq!(
            log.slices_to_fold(FoldRequest::None, true),
            vec![1, 4, 7, 11],
            "tight: the fullest"
        );
        assert_eq!(log.slices_to_fold(FoldRequest::All, false).len(), SLICES);
        log.entries = [0; SLICES];
        assert_eq!(log.take_request(), FoldRequest::None, "not asked");
        log.request(FoldRequest::All);
        assert_eq!(log.take_request(), FoldRequest::All);
        assert_eq!(log.take_request(), FoldRequest::None, "asked once");
        log.entries[2] = ENTRIES_MAX;
        log.entries[3] = 1;
        assert_eq!(
            log.slices_to_fold(FoldRequest::None, false),
            vec![2, 3],
            "too long"
        );
    }
}
