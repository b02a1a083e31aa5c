//! A bounded cache of the rows the I/O path reads most (`map.pages`), in front of the
//! backend's snapshots: a write that overwrites a block looks up the block's committed entry,
//! and a B-tree descent through redb's page cache cost ~2.4 µs of a 4 KiB overwrite's ~21 µs
//! of server CPU (docs/BENCHMARKS.md, "Map pages cached").
//!
//! The cache holds rows as of the last committed batch, and a row is served only to a
//! transaction whose snapshot is of that batch:
//! - every read transaction notes the cache's *generation* before it takes its snapshot
//!   ([`RowCache::generation`]); hits and offers are refused to one whose generation is not the
//!   cache's (it may read an older batch);
//! - a commit first marks the rows its batch changes as *committing* ([`RowCache::begin`]):
//!   they are neither served nor offered while it runs, since a snapshot taken meanwhile may
//!   already show the new batch; when the batch is durable ([`RowCache::end`]) the generation
//!   moves on, and the batch's new rows replace the marks (write-through) — or, if the batch
//!   failed, the marks are dropped.
//!
//! A batch that changes more than [`MARKS_MAX`] cached rows (a format upgrade's, say) empties
//! the cache instead and turns it off until it ends, rather than marking each row.
//!
//! Rows absent from the store are cached too (as `None`). Eviction is first in, first out,
//! within [`ROW_CACHE_BYTES`].

use super::{Batch, Table};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

/// Tables whose rows are cached.
const CACHED: [Table; 1] = [Table::MapPages];
/// Bytes of rows (keys, values and bookkeeping) the cache holds at most.
pub const ROW_CACHE_BYTES: usize = 64 << 20;
/// What a row costs beside its key and value bytes: the map's slot, the value's allocation
/// and the eviction queue's entry.
const ROW_OVERHEAD_BYTES: usize = 80;
/// Rows marked or written through per hold of the lock, so that readers wait little behind a
/// large commit.
const ROWS_PER_LOCK: usize = 4096;
/// Most rows a batch marks; one that changes more empties the cache and turns it off while
/// it is written.
pub const MARKS_MAX: usize = 256 << 10;

/// A cached row's key: table index, key length, key bytes (keys of up to 16 bytes).
type Key = (u8, u8, [u8; 16]);

enum Row {
    /// The row as of the cache's generation (`None`: absent from the store).
    Cached(Option<Box<[u8]>>),
    /// A commit running now changes it.
    Committing,
}

struct Slot {
    row: Row,
    /// Its entry in the eviction queue (0: none).
    seq: u64,
}

#[derive(Default)]
struct State {
    rows: FxHashMap<Key, Slot>,
    /// Cached rows in insertion order; entries whose slot has another `seq` are stale.
    order: VecDeque<(u64, Key)>,
    next_seq: u64,
    bytes: usize,
    /// A batch too large to mark is being written: nothing is served or taken.
    off: bool,
}

/// The cache (see the module documentation).
pub struct RowCache {
    state: Mutex<State>,
    /// Moved on under `state`'s lock, after the batch is visible to new snapshots; read
    /// without it by transactions starting (`Acquire`: a reader that sees the new generation
    /// then takes a snapshot showing the batch).
    generation: AtomicU64,
    budget: usize,
}

/// The cache's key for `key` of `table`, if that row may be cached.
fn key_of(table: Table, key: &[u8]) -> Option<Key> {
    if !CACHED.contains(&table) || key.len() > 16 {
        return None;
    }
    let mut k = [0u8; 16];
    k[..key.len()].copy_from_slice(key);
    Some((table.index() as u8, key.len() as u8, k))
}

fn row_bytes(value: &Option<Box<[u8]>>) -> usize {
    ROW_OVERHEAD_BYTES + 18 + value.as_ref().map_or(0, |v| v.len())
}

impl State {
    /// Drops `key`'s row, if cached, from the count (its queue entry goes stale).
    fn forget(&mut self, key: &Key) {
        if let Some(slot) = self.rows.get(key) {
            if let Row::Cached(v) = &slot.row {
                self.bytes -= row_bytes(v);
            }
        }
    }

    fn put(&mut self, key: Key, value: Option<Box<[u8]>>, budget: usize) {
        self.forget(&key);
        self.next_seq += 1;
        let seq = self.next_seq;
        self.bytes += row_bytes(&value);
        self.rows.insert(
            key,
            Slot {
                row: Row::Cached(value),
                seq,
            },
        );
        self.order.push_back((seq, key));
        while self.bytes > budget {
            let Some((seq, key)) = self.order.pop_front() else {
                break;
            };
            if self.rows.get(&key).is_some_and(|s| s.seq == seq) {
                self.forget(&key);
                self.rows.remove(&key);
            }
        }
        if self.order.len() > 2 * self.rows.len() + 1024 {
            let rows = &self.rows;
            self.order
                .retain(|(seq, key)| rows.get(key).is_some_and(|s| s.seq == *seq));
        }
    }
}

impl RowCache {
    /// An empty cache holding at most `budget` bytes of rows.
    pub fn new(budget: usize) -> RowCache {
        RowCache {
            state: Mutex::new(State::default()),
            generation: AtomicU64::new(0),
            budget,
        }
    }

    /// The generation a transaction notes before it takes its snapshot.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// `key`'s row of `table` for a transaction of generation `generation`: `Some(row)` on a
    /// hit (`Some(None)`: the row is absent from the store), `None` if the caller must read it.
    pub fn get(&self, generation: u64, table: Table, key: &[u8]) -> Option<Option<Vec<u8>>> {
        let k = key_of(table, key)?;
        let state = self.state.lock();
        if self.generation() != generation || state.off {
            return None;
        }
        match &state.rows.get(&k)?.row {
            Row::Cached(v) => Some(v.as_deref().map(<[u8]>::to_vec)),
            Row::Committing => None,
        }
    }

    /// Offers `value`, read by a transaction of generation `generation`, as `key`'s row.
    pub fn offer(&self, generation: u64, table: Table, key: &[u8], value: Option<&[u8]>) {
        let Some(k) = key_of(table, key) else {
            return;
        };
        let mut state = self.state.lock();
        if self.generation() != generation
            || state.off
            || state
                .rows
                .get(&k)
                .is_some_and(|s| matches!(s.row, Row::Committing))
        {
            return;
        }
        state.put(k, value.map(Box::from), self.budget);
    }

    /// Calls `f` with the state and each change of `batch` to a cached row, in the batch's
    /// order, taking the lock once per [`ROWS_PER_LOCK`] changes.
    fn for_each_change(&self, batch: &Batch, mut f: impl FnMut(&mut State, Key, &Option<Vec<u8>>)) {
        for table in CACHED {
            for part in batch.tables[table.index()].log.chunks(ROWS_PER_LOCK) {
                let mut state = self.state.lock();
                for (key, value) in part {
                    if let Some(k) = key_of(table, key) {
                        f(&mut state, k, value);
                    }
                }
            }
        }
    }

    /// Marks the rows `batch` changes as committing (call before the batch is written).
    pub fn begin(&self, batch: &Batch) {
        let changes: usize = CACHED
            .iter()
            .map(|t| batch.tables[t.index()].log.len())
            .sum();
        if changes > MARKS_MAX {
            let mut state = self.state.lock();
            state.off = true;
            state.rows = FxHashMap::default();
            state.order = VecDeque::new();
            state.bytes = 0;
            return;
        }
        self.for_each_change(batch, |state, k, _| {
            state.forget(&k);
            state.rows.insert(
                k,
                Slot {
                    row: Row::Committing,
                    seq: 0,
                },
            );
        });
    }

    /// Ends the commit of `batch` that [`RowCache::begin`] started: the generation moves on,
    /// and the batch's rows replace their marks if it was written (`written`), else the marks
    /// go.
    pub fn end(&self, batch: &Batch, written: bool) {
        {
            let mut state = self.state.lock();
            self.generation.fetch_add(1, Ordering::Release);
            if state.off {
                // Emptied by `begin`: filled again by readers.
                state.off = false;
                return;
            }
        }
        self.for_each_change(batch, |state, k, value| {
            if written {
                // In the log's order: a key's last change is written last.
                state.put(k, value.as_deref().map(Box::from), self.budget);
            } else if state
                .rows
                .get(&k)
                .is_some_and(|s| matches!(s.row, Row::Committing))
            {
                state.rows.remove(&k);
            }
        });
    }

    /// Bytes of rows held (for tests).
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.state.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(changes: &[(&[u8], Option<&[u8]>)]) -> Batch {
        let mut b = Batch::default();
        for (k, v) in changes {
            b.tables[Table::MapPages.index()].set(k.to_vec(), v.map(<[u8]>::to_vec));
        }
        b
    }

    const T: Table = Table::MapPages;

    /// Rows are served to the generation they were offered in; other tables and long keys are
    /// never cached.
    #[test]
    fn rows_are_served_to_their_generation_only() {
        let c = RowCache::new(1 << 20);
        let g = c.generation();
        assert_eq!(c.get(g, T, b"a"), None);
        c.offer(g, T, b"a", Some(b"1"));
        c.offer(g, T, b"b", None);
        assert_eq!(c.get(g, T, b"a"), Some(Some(b"1".to_vec())));
        assert_eq!(c.get(g, T, b"b"), Some(None), "an absent row is cached too");
        assert_eq!(c.get(g + 1, T, b"a"), None);
        c.offer(g, Table::Fps, b"a", Some(b"1"));
        assert_eq!(c.get(g, Table::Fps, b"a"), None);
        c.offer(g, T, &[7u8; 17], Some(b"1"));
        assert_eq!(c.get(g, T, &[7u8; 17]), None);
    }

    /// While a commit runs, the rows it changes are neither served nor taken from readers
    /// (a snapshot may already show the new batch), the others still are; after it, only the
    /// new generation is served, with the batch's rows written through. A failed commit
    /// leaves its rows uncached.
    #[test]
    fn a_commit_hides_its_rows_then_writes_them_through() {
        let c = RowCache::new(1 << 20);
        let g = c.generation();
        c.offer(g, T, b"a", Some(b"old"));
        c.offer(g, T, b"b", Some(b"kept"));
        let b = batch(&[
            (b"a", Some(b"mid")),
            (b"c", Some(b"new")),
            (b"a", Some(b"new")),
        ]);
        c.begin(&b);
        assert_eq!(c.get(g, T, b"a"), None, "a committing row is not served");
        assert_eq!(c.get(g, T, b"b"), Some(Some(b"kept".to_vec())));
        c.offer(g, T, b"a", Some(b"old"));
        c.offer(g, T, b"c", None);
        assert_eq!(c.get(g, T, b"a"), None, "nor taken from a reader");
        assert_eq!(c.get(g, T, b"c"), None);
        c.end(&b, true);
        assert_eq!(c.get(g, T, b"b"), None, "the old generation is not served");
        c.offer(g, T, b"d", Some(b"stale"));
        let g2 = c.generation();
        assert_eq!(g2, g + 1);
        assert_eq!(
            c.get(g2, T, b"a"),
            Some(Some(b"new".to_vec())),
            "the last change wins"
        );
        assert_eq!(c.get(g2, T, b"c"), Some(Some(b"new".to_vec())));
        assert_eq!(c.get(g2, T, b"b"), Some(Some(b"kept".to_vec())));
        assert_eq!(
            c.get(g2, T, b"d"),
            None,
            "an old generation's offer is refused"
        );
        let failed = batch(&[(b"b", None)]);
        c.begin(&failed);
        c.end(&failed, false);
        let g3 = c.generation();
        assert_eq!(c.get(g3, T, b"b"), None);
        assert_eq!(c.get(g3, T, b"a"), Some(Some(b"new".to_vec())));
    }

    /// A batch too large to mark empties the cache and turns it off until it ends; then
    /// readers of the new generation fill it again.
    #[test]
    fn a_huge_batch_empties_the_cache() {
        let c = RowCache::new(1 << 20);
        let g = c.generation();
        c.offer(g, T, b"a", Some(b"1"));
        let mut b = Batch::default();
        for i in 0..=MARKS_MAX as u32 {
            b.tables[T.index()].set(i.to_be_bytes().to_vec(), Some(vec![1]));
        }
        c.begin(&b);
        assert_eq!(c.get(g, T, b"a"), None);
        c.offer(g, T, b"z", Some(b"1"));
        assert_eq!(c.get(g, T, b"z"), None, "nothing is taken while it is off");
        c.end(&b, true);
        let g2 = c.generation();
        assert_eq!(c.get(g2, T, &0u32.to_be_bytes()), None, "no write-through");
        assert_eq!(c.bytes(), 0);
        c.offer(g2, T, b"a", Some(b"2"));
        assert_eq!(c.get(g2, T, b"a"), Some(Some(b"2".to_vec())));
    }

    /// The cache stays within its budget, evicting the oldest rows first.
    #[test]
    fn the_oldest_rows_go_first_within_the_budget() {
        let one = row_bytes(&Some(vec![0u8; 100].into_boxed_slice()));
        let c = RowCache::new(10 * one);
        let g = c.generation();
        for i in 0..25u8 {
            c.offer(g, T, &[i], Some(&[i; 100]));
            // Re-offering a row counts it once.
            c.offer(g, T, &[i], Some(&[i; 100]));
            assert!(c.bytes() <= 10 * one);
        }
        for i in 0..15u8 {
            assert_eq!(c.get(g, T, &[i]), None, "row {i} should have gone");
        }
        for i in 15..25u8 {
            assert_eq!(c.get(g, T, &[i]), Some(Some(vec![i; 100])));
        }
        assert!(c.state.lock().order.len() <= 2 * 10 + 1024);
    }
}
