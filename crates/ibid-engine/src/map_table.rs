//! The volume maps: every layer's entries (block → chunk id, or a zero tombstone), packed in
//! pages of neighbouring blocks.
//!
//! One row of [`meta::MAP_PAGES`] holds the entries of [`PAGE_BLOCKS`] consecutive blocks of
//! one layer (key: [`page_key`], the layer and the block's page number, both big-endian, so a
//! range scan walks a layer's blocks in order). A commit of 64 Ki new blocks written in order
//! inserts 4 Ki rows instead of 64 Ki: each row costs the store a B-tree descent and its share
//! of page handling whatever its size, and one row per block was, after the chunk records
//! (`chunk_table.rs`), the largest per-block cost of a commit of new data.
//!
//! The page format (the value of a `map.pages` row) is in `map_page.rs`.
//!
//! Pools of format version 10 and older kept one row per block in `map` ([`meta::MAP`]);
//! [`upgrade`] moves them into pages when such a pool is opened.
//!
//! Every read and change of a map entry goes through this module. Reads see the committed
//! state ([`ReadTxn`]) or a write transaction's own view ([`WriteTxn`]); changes inside a
//! transaction are gathered in [`Changes`], which reads each page once, applies every change
//! to it and writes it back once, or made by [`take`], which removes a range's entries.

use crate::error::Result;
use crate::format;
use crate::map_page::Page;
use crate::meta;
use crate::store::{ReadTxn, Reader, WriteTxn};
use std::collections::BTreeMap;

pub use crate::map_page::{PAGE_BLOCKS, PAGE_BLOCKS_BITS};

/// The key of the page holding `layer`'s entry for `block`.
pub fn page_key(layer: u64, block: u64) -> [u8; 16] {
    format::map_key(layer, block >> PAGE_BLOCKS_BITS)
}

fn slot(block: u64) -> usize {
    (block & (PAGE_BLOCKS - 1)) as usize
}

/// Called with each page's key and encoded value in a scan; answers whether to go on.
pub type PageVisitor<'a> = dyn FnMut(&[u8; 16], &[u8]) -> Result<bool> + 'a;

/// A view of the map that can be scanned in key order: the committed state or a write
/// transaction's.
pub trait Source: Reader {
    /// Calls `f(key, page)` for the pages with keys in `lo..=hi`, in key order, until it
    /// answers `false`.
    fn pages_while(&self, lo: [u8; 16], hi: [u8; 16], f: &mut PageVisitor<'_>) -> Result<()>;
}

/// Pages a scan of the committed state reads one by one, through the store's row cache,
/// rather than by a range scan of the B-tree (a database's 8–64 KiB I/O spans one to five).
const POINT_READ_PAGES_MAX: u64 = 8;

impl Source for ReadTxn<'_> {
    fn pages_while(&self, lo: [u8; 16], hi: [u8; 16], f: &mut PageVisitor<'_>) -> Result<()> {
        let ((layer, p0), (hi_layer, p1)) =
            (format::decode_map_key(&lo), format::decode_map_key(&hi));
        if layer == hi_layer && p0 <= p1 && p1 - p0 < POINT_READ_PAGES_MAX {
            for page in p0..=p1 {
                let key = format::map_key(layer, page);
                if let Some(v) = self.get(meta::MAP_PAGES, &key)? {
                    if !f(&key, &v)? {
                        break;
                    }
                }
            }
            return Ok(());
        }
        for item in self.range(meta::MAP_PAGES, lo..=hi)? {
            let (k, v) = item?;
            if !f(&k, &v)? {
                break;
            }
        }
        Ok(())
    }
}

impl Source for WriteTxn<'_> {
    fn pages_while(&self, lo: [u8; 16], hi: [u8; 16], f: &mut PageVisitor<'_>) -> Result<()> {
        for (k, v) in self.range(meta::MAP_PAGES, lo..=hi)? {
            if !f(&k, &v)? {
                break;
            }
        }
        Ok(())
    }
}

/// `layer`'s entry for `block`.
pub fn get(r: &impl Reader, layer: u64, block: u64) -> Result<Option<u64>> {
    let key = page_key(layer, block);
    match r.get(meta::MAP_PAGES, &key)? {
        Some(b) => Page::value_in(&key, &b, slot(block)),
        None => Ok(None),
    }
}

/// Calls `f(block, value)` for `layer`'s entries with blocks in `[b0, b1)`, ascending, until
/// it answers `false`.
pub fn scan_while(
    r: &impl Source,
    layer: u64,
    b0: u64,
    b1: u64,
    mut f: impl FnMut(u64, u64) -> bool,
) -> Result<()> {
    if b0 >= b1 {
        return Ok(());
    }
    let (lo, hi) = (page_key(layer, b0), page_key(layer, b1 - 1));
    r.pages_while(lo, hi, &mut |key, b| {
        let page = Page::decode(key, b)?;
        let base = format::decode_map_key(key).1 << PAGE_BLOCKS_BITS;
        for (i, v) in page.entries() {
            let block = base + i as u64;
            if block >= b0 && block < b1 && !f(block, v) {
                return Ok(false);
            }
        }
        Ok(true)
    })
}

/// Calls `f(block, value)` for every entry of `layer` with a block in `[b0, b1)`, ascending.
pub fn scan(
    r: &impl Source,
    layer: u64,
    b0: u64,
    b1: u64,
    mut f: impl FnMut(u64, u64),
) -> Result<()> {
    scan_while(r, layer, b0, b1, |b, v| {
        f(b, v);
        true
    })
}

/// `layer`'s entries with blocks in `[b0, b1)` as (block, value), ascending.
pub fn entries(r: &impl Source, layer: u64, b0: u64, b1: u64) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    scan(r, layer, b0, b1, |b, v| out.push((b, v)))?;
    Ok(out)
}

/// Every entry of `layer`, as (block, value), ascending.
pub fn layer_entries(r: &impl Source, layer: u64) -> Result<Vec<(u64, u64)>> {
    entries(r, layer, 0, u64::MAX)
}

/// The block of `layer`'s `n`-th entry (counting from 0) at or after block `start`, if it has
/// that many.
pub fn nth_block(r: &impl Source, layer: u64, start: u64, n: usize) -> Result<Option<u64>> {
    let mut seen = 0;
    let mut found = None;
    scan_while(r, layer, start, u64::MAX, |b, _| {
        if seen == n {
            found = Some(b);
            return false;
        }
        seen += 1;
        true
    })?;
    Ok(found)
}

/// Calls `f(layer, block, value)` for every entry of the map, in (layer, block) order.
pub fn for_each(txn: &ReadTxn, mut f: impl FnMut(u64, u64, u64) -> Result<()>) -> Result<()> {
    for item in txn.iter(meta::MAP_PAGES)? {
        let (key, b) = item?;
        let page = Page::decode(&key, &b)?;
        let (layer, p) = format::decode_map_key(&key);
        for (i, v) in page.entries() {
            f(layer, (p << PAGE_BLOCKS_BITS) + i as u64, v)?;
        }
    }
    Ok(())
}

/// Removes `layer`'s entries with blocks in `[b0, b1)` for which `pick(value)` holds, in
/// `txn`, and returns them as (block, value), ascending.
pub fn take(
    txn: &mut WriteTxn,
    layer: u64,
    b0: u64,
    b1: u64,
    mut pick: impl FnMut(u64) -> bool,
) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    if b0 >= b1 {
        return Ok(out);
    }
    let mut rewritten: Vec<([u8; 16], Page)> = Vec::new();
    txn.pages_while(
        page_key(layer, b0),
        page_key(layer, b1 - 1),
        &mut |key, b| {
            let old = Page::decode(key, b)?;
            let mut page = old;
            let base = format::decode_map_key(key).1 << PAGE_BLOCKS_BITS;
            for (i, v) in old.entries() {
                let block = base + i as u64;
                if block >= b0 && block < b1 && pick(v) {
                    page.set(i, None);
                    out.push((block, v));
                }
            }
            if page != old {
                rewritten.push((*key, page));
            }
            Ok(true)
        },
    )?;
    for (key, page) in rewritten {
        write_page(txn, &key, &page);
    }
    Ok(out)
}

/// Takes every entry of `layer` with a block in `[b0, b1)` (see [`take`]).
pub fn take_all(txn: &mut WriteTxn, layer: u64, b0: u64, b1: u64) -> Result<Vec<(u64, u64)>> {
    take(txn, layer, b0, b1, |_| true)
}

fn write_page(txn: &mut WriteTxn, key: &[u8; 16], page: &Page) {
    if page.present == 0 {
        txn.remove(meta::MAP_PAGES, key);
    } else {
        txn.insert(meta::MAP_PAGES, key, page.encode().as_slice());
    }
}

/// Entries to set or remove in a write transaction, gathered by page: [`Changes::write`]
/// reads each touched page once (as the transaction sees it), applies its changes (the last
/// change of each block wins) and writes it back once.
#[derive(Debug, Default)]
pub struct Changes {
    pages: BTreeMap<[u8; 16], Edit>,
}

/// The changes to one page: the entries set, and the slots removed.
#[derive(Debug, Default)]
struct Edit {
    set: Page,
    removed: u16,
}

impl Changes {
    /// No changes.
    pub fn new() -> Changes {
        Changes::default()
    }

    /// Sets `layer`'s entry for `block` to `value` (a chunk id or a zero tombstone).
    pub fn set(&mut self, layer: u64, block: u64, value: u64) {
        let edit = self.pages.entry(page_key(layer, block)).or_default();
        let s = slot(block);
        edit.set.set(s, Some(value));
        edit.removed &= !(1 << s);
    }

    /// Removes `layer`'s entry for `block` (absent or not).
    pub fn remove(&mut self, layer: u64, block: u64) {
        let edit = self.pages.entry(page_key(layer, block)).or_default();
        let s = slot(block);
        edit.set.set(s, None);
        edit.removed |= 1 << s;
    }

    /// Applies the changes to `txn`.
    pub fn write(self, txn: &mut WriteTxn) -> Result<()> {
        for (key, edit) in self.pages {
            let read: Option<Vec<u8>> = txn.get(meta::MAP_PAGES, &key)?;
            let mut page = match &read {
                Some(b) => Page::decode(&key, b)?,
                None => Page::default(),
            };
            let before = page;
            for i in 0..PAGE_BLOCKS as usize {
                if edit.removed & (1 << i) != 0 {
                    page.set(i, None);
                }
            }
            for (i, v) in edit.set.entries() {
                page.set(i, Some(v));
            }
            if page != before {
                let value = (page.present != 0).then(|| page.encode());
                let delta = read
                    .is_some()
                    .then(|| crate::map_page::delta_of(&before, &page));
                txn.set_deferred(&key, value, delta);
            }
        }
        Ok(())
    }
}

/// Moves the entries of a pool of format version 10 or older (one row per block in the `map`
/// table) into pages, inside `txn`: the caller commits it with the pool record's new version,
/// so a crash leaves either layout whole. Returns how many entries moved.
pub fn upgrade(txn: &mut WriteTxn) -> Result<u64> {
    let rows = txn.extract_range_if(meta::MAP, .., |_, _| true)?;
    let moved = rows.len() as u64;
    let mut changes = Changes::new();
    for (k, v) in rows {
        let (layer, block) = format::decode_map_key(&k);
        changes.set(layer, block, v);
    }
    changes.write(txn)?;
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::store::{Backend, Store};

    /// Entries set, removed and taken across page and layer boundaries read back as a
    /// `BTreeMap` model says, through the committed state and the transaction's own view;
    /// emptied pages are deleted.
    #[test]
    fn pages_follow_a_model() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let mut model: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        let mut next = crate::test_data::xorshift(0x9e37_79b9_7f4a_7c15);
        for round in 0..40 {
            let mut txn = store.write()?;
            let mut changes = Changes::new();
            for _ in 0..50 {
                let (layer, block) = (1 + next() % 3, next() % 100);
                if next().is_multiple_of(3) {
                    changes.remove(layer, block);
                    model.remove(&(layer, block));
                } else {
                    let v = next() % 5;
                    changes.set(layer, block, v);
                    model.insert((layer, block), v);
                }
            }
            // A run of neighbouring blocks (the common case: one page after another).
            let (layer, start) = (1 + next() % 3, next() % 100);
            for block in start..start + next() % 40 {
                if next().is_multiple_of(4) {
                    changes.remove(layer, block);
                    model.remove(&(layer, block));
                } else {
                    changes.set(layer, block, block);
                    model.insert((layer, block), block);
                }
            }
            changes.write(&mut txn)?;
            if round % 4 == 3 {
                let (layer, b0) = (1 + next() % 3, next() % 100);
                let b1 = b0 + next() % 40;
                let want: Vec<(u64, u64)> = model
                    .range((layer, b0)..(layer, b1))
                    .filter(|(_, &v)| v % 2 == 0)
                    .map(|(&(_, b), &v)| (b, v))
                    .collect();
                let got = take(&mut txn, layer, b0, b1, |v| v % 2 == 0)?;
                assert_eq!(got, want);
                for (b, _) in got {
                    model.remove(&(layer, b));
                }
            }
            for layer in 1..=3 {
                let want: Vec<(u64, u64)> = model
                    .range((layer, 0)..=(layer, u64::MAX))
                    .map(|(&(_, b), &v)| (b, v))
                    .collect();
                assert_eq!(layer_entries(&txn, layer)?, want, "write view");
            }
            txn.commit()?;
            let r = store.read()?;
            let mut all = BTreeMap::new();
            for_each(&r, |layer, block, v| {
                all.insert((layer, block), v);
                Ok(())
            })?;
            assert_eq!(all, model, "round {round}");
            for ((layer, block), v) in &model {
                assert_eq!(get(&r, *layer, *block)?, Some(*v));
            }
            assert_eq!(get(&r, 2, 1000)?, None);
            let want: Vec<(u64, u64)> = model
                .range((2, 17)..(2, 61))
                .map(|(&(_, b), &v)| (b, v))
                .collect();
            assert_eq!(entries(&r, 2, 17, 61)?, want);
            let from: Vec<u64> = model
                .range((1, 30)..=(1, u64::MAX))
                .map(|(&(_, b), _)| b)
                .collect();
            assert_eq!(nth_block(&r, 1, 30, 3)?, from.get(3).copied());
            for item in r.iter(meta::MAP_PAGES)? {
                let (key, b) = item?;
                assert!(Page::decode(&key, &b)?.present != 0, "no empty page stays");
            }
        }
        Ok(())
    }

    /// A page whose bitmap is empty or disagrees with its length is corrupt, not misread.
    #[test]
    fn bad_pages_are_corrupt() {
        let key = page_key(1, 0);
        let mut page = Page::default();
        page.set(3, Some(7));
        page.set(9, Some(0));
        let good = page.encode();
        assert_eq!(Page::decode(&key, &good).expect("good"), page);
        for bad in [&good[..good.len() - 1], &good[..1], &[0, 0][..], &[][..]] {
            assert!(matches!(Page::decode(&key, bad), Err(Error::Corrupt(_))));
        }
    }

    /// A page changed twice in one transaction — by two map steps, or a map step and a plain
    /// insert — is logged as its last change over the committed page (the first step's delta
    /// is not its change any more), and reads back so after a reopen that replays the log.
    #[test]
    fn a_page_changed_twice_in_a_transaction_logs_its_last_change() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let mut txn = store.write()?;
        let mut first = Changes::new();
        for b in 0..40 {
            first.set(1, b, 100 + b);
        }
        first.write(&mut txn)?;
        txn.commit()?;
        // Something else in every commit, so the map's changes stay in the log for a while.
        let mut txn = store.write()?;
        let mut a = Changes::new();
        a.set(1, 1, 7);
        a.set(1, 17, 8);
        a.write(&mut txn)?;
        let mut b = Changes::new();
        b.set(1, 2, 9);
        b.remove(1, 17);
        b.write(&mut txn)?;
        let mut c = Changes::new();
        c.set(1, 33, 10);
        c.write(&mut txn)?;
        let mut plain = Page::default();
        plain.set(0, Some(5));
        txn.insert(meta::MAP_PAGES, &page_key(1, 32), plain.encode().as_slice());
        txn.commit()?;
        let want = |b: u64| match b {
            1 => Some(7),
            2 => Some(9),
            32 => Some(5),
            17 | 33.. => None,
            b => Some(100 + b),
        };
        let check = |store: &Store, when: &str| -> Result<()> {
            let r = store.read()?;
            for b in 0..48 {
                assert_eq!(get(&r, 1, b)?, want(b), "block {b}, {when}");
            }
            Ok(())
        };
        check(&store, "committed")?;
        assert!(
            store.pending_map_changes() > 0,
            "the changes are in the log"
        );
        drop(store);
        check(&Store::open(dir.path())?, "reopened")
    }

    /// A pool's per-block rows (format 10) move into pages, and read back the same.
    #[test]
    fn rows_move_into_pages() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let mut txn = store.write()?;
        let rows: Vec<(u64, u64, u64)> = (0..100).map(|i| (1 + i % 2, i * 7, i)).collect();
        for &(layer, block, v) in &rows {
            txn.insert(meta::MAP, &format::map_key(layer, block), &v);
        }
        txn.commit()?;
        let mut txn = store.write()?;
        assert_eq!(upgrade(&mut txn)?, 100);
        txn.commit()?;
        let r = store.read()?;
        assert_eq!(r.iter(meta::MAP)?.count(), 0);
        for &(layer, block, v) in &rows {
            assert_eq!(get(&r, layer, block)?, Some(v));
        }
        Ok(())
    }
}
