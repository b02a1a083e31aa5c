//! The chunk table: every live chunk's [`ChunkRecord`], packed in pages of neighbouring ids.
//!
//! A chunk id is `(sequence << SHARD_BITS) | shard`, and sequence numbers are handed out in
//! order, so chunks written together have neighbouring ids. One row of [`meta::CHUNK_PAGES`]
//! holds the records of [`PAGE_SEQS`] consecutive sequence numbers (key: [`page_of`]): a
//! commit of 64 Ki new chunks inserts 4 Ki rows instead of 64 Ki. Each row costs the store a
//! B-tree descent and its share of page handling whatever its size; one row per chunk was
//! a large share of the server's CPU on unique writes (measurements: `docs/benchmarks`).
//!
//! # Page format (the value of a `chunk.pages` row)
//!
//! ```text
//! entry*  (1 to PAGE_SEQS, ascending chunk id; a page left with none is deleted)
//! entry:  chunk id's low PAGE_SHIFT bits u16 LE | ChunkRecord (24 bytes, see format.rs)
//! ```
//!
//! Every id in a page has the page's key as `id >> PAGE_SHIFT`. The chunks' fingerprints are
//! kept apart (`chunk_fps.rs`): a fold or a move rewrites 26 bytes per chunk, not 72.
//!
//! Pools of format version 5 and older kept one row per chunk in `chunks`, and pools of
//! versions 6 to 14 pages of 72-byte entries (chunk id u64 | 64-byte record with the
//! fingerprint); [`upgrade`] moves either into this layout when such a pool is opened.
//!
//! Reads take one row and scan at most 16 fixed-size entries. Writes inside a transaction go
//! through [`Pages`], which reads each page once, applies every change to it in memory and
//! writes it back once.

use crate::error::{Error, Result};
use crate::format::{ChunkRecord, Fingerprint, CHUNK_RECORD_BYTES, CHUNK_RECORD_V14_BYTES};
use crate::meta;
use crate::ref_log::SPAN_PAGES;
use crate::shard::SHARD_BITS;
use crate::store::{ReadTxn, Reader, WriteTxn};
use rustc_hash::FxHashMap;

/// Sequence numbers (so chunks) per page, as a power of two.
pub const PAGE_SEQS_BITS: u32 = 4;
/// Sequence numbers (so chunks) per page.
pub const PAGE_SEQS: usize = 1 << PAGE_SEQS_BITS;
/// A chunk id shifted right by this is its page's key.
pub const PAGE_SHIFT: u32 = SHARD_BITS + PAGE_SEQS_BITS;
/// Encoded size of one page entry (the chunk id's low bits and the record).
pub const ENTRY_BYTES: usize = 2 + CHUNK_RECORD_BYTES;
/// Encoded size of an entry of a format-14 page (chunk id u64 and a 64-byte record).
const ENTRY_V14_BYTES: usize = 8 + CHUNK_RECORD_V14_BYTES;
/// The low bits of a chunk id that an entry holds (the page key holds the rest).
const LOW_MASK: u64 = (1 << PAGE_SHIFT) - 1;
const _: () = assert!(
    PAGE_SHIFT <= 16,
    "a page entry holds the id's low bits in a u16"
);

/// The key of the page holding chunk `id`.
pub fn page_of(id: u64) -> u64 {
    id >> PAGE_SHIFT
}

/// The decoded entries of a page: (chunk id, record), ascending by id.
type Entries = Vec<(u64, ChunkRecord)>;

/// Checks a page's length and returns its number of entries.
fn entry_count(key: u64, page: &[u8]) -> Result<usize> {
    let n = page.len() / ENTRY_BYTES;
    if !page.len().is_multiple_of(ENTRY_BYTES) || n == 0 || n > PAGE_SEQS {
        return Err(Error::Corrupt(format!(
            "chunk page {key:#x} of {} bytes",
            page.len()
        )));
    }
    Ok(n)
}

/// The low bits of entry `i`'s chunk id, as stored.
fn entry_low(page: &[u8], i: usize) -> u64 {
    let at = i * ENTRY_BYTES;
    u16::from_le_bytes([page[at], page[at + 1]]) as u64
}

/// The id of entry `i` of page `key`.
fn entry_id(key: u64, page: &[u8], i: usize) -> u64 {
    key << PAGE_SHIFT | entry_low(page, i)
}

fn entry_record(page: &[u8], i: usize) -> Result<ChunkRecord> {
    let at = i * ENTRY_BYTES + 2;
    ChunkRecord::decode(&page[at..at + CHUNK_RECORD_BYTES])
}

/// Decodes page `key`, checking that its ids ascend and belong to it.
fn decode(key: u64, page: &[u8]) -> Result<Entries> {
    let n = entry_count(key, page)?;
    let mut out: Entries = Vec::with_capacity(n);
    for i in 0..n {
        let id = entry_id(key, page, i);
        if entry_low(page, i) > LOW_MASK || out.last().is_some_and(|&(prev, _)| prev >= id) {
            return Err(Error::Corrupt(format!(
                "chunk page {key:#x}: entry {i} has chunk id {id:#x}"
            )));
        }
        out.push((id, entry_record(page, i)?));
    }
    Ok(out)
}

fn encode(entries: &[(u64, ChunkRecord)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * ENTRY_BYTES);
    for (id, rec) in entries {
        out.extend_from_slice(&((id & LOW_MASK) as u16).to_le_bytes());
        out.extend_from_slice(&rec.encode());
    }
    out
}

/// The record of chunk `id`, if the store holds it.
pub fn get(r: &impl Reader, id: u64) -> Result<Option<ChunkRecord>> {
    let key = page_of(id);
    let Some(page) = r.get(meta::CHUNK_PAGES, &key)? else {
        return Ok(None);
    };
    for i in 0..entry_count(key, &page)? {
        if entry_id(key, &page, i) == id {
            return entry_record(&page, i).map(Some);
        }
    }
    Ok(None)
}

/// The records of those of `ids` the store holds, each page read once (sorts `ids`).
pub fn get_many(
    r: &impl Reader,
    ids: &mut [u64],
    mut found: impl FnMut(u64, ChunkRecord),
) -> Result<()> {
    ids.sort_unstable();
    for (key, ids) in by_page(ids) {
        if let Some(page) = r.get(meta::CHUNK_PAGES, &key)? {
            let n = entry_count(key, &page)?;
            for &id in ids {
                if let Some(i) = (0..n).find(|&i| entry_id(key, &page, i) == id) {
                    found(id, entry_record(&page, i)?);
                }
            }
        }
    }
    Ok(())
}

/// Sorted chunk `ids` cut into runs of one page each: (page key, its ids).
pub(crate) fn by_page(ids: &[u64]) -> impl Iterator<Item = (u64, &[u64])> {
    let mut rest = ids;
    std::iter::from_fn(move || {
        let key = page_of(*rest.first()?);
        let (run, after) = rest.split_at(rest.partition_point(|&id| page_of(id) == key));
        rest = after;
        Some((key, run))
    })
}

/// The record of chunk `id`, which something references: corrupt if the store lacks it.
pub fn load(r: &impl Reader, id: u64) -> Result<ChunkRecord> {
    get(r, id)?.ok_or_else(|| missing(id))
}

/// The error for a chunk that is referenced but has no record.
pub fn missing(id: u64) -> Error {
    Error::Corrupt(format!("chunk {id:#x} is referenced but missing"))
}

/// The records of the chunks with ids in `lo..=hi`, ascending by id.
pub fn range(txn: &ReadTxn, lo: u64, hi: u64) -> Result<Entries> {
    let mut out = Vec::new();
    for item in txn.range(meta::CHUNK_PAGES, page_of(lo)..=page_of(hi))? {
        let (key, page) = item?;
        out.extend(
            decode(key, &page)?
                .into_iter()
                .filter(|&(id, _)| (lo..=hi).contains(&id)),
        );
    }
    Ok(out)
}

/// The records of at most about `max` chunks with ids from `lo` on, ascending by id (whole
/// pages: a few more than `max` at most).
pub fn from(txn: &ReadTxn, lo: u64, max: usize) -> Result<Entries> {
    let mut out = Vec::new();
    for item in txn.range(meta::CHUNK_PAGES, page_of(lo)..=u64::MAX)? {
        let (key, page) = item?;
        out.extend(decode(key, &page)?.into_iter().filter(|&(id, _)| id >= lo));
        if out.len() >= max {
            break;
        }
    }
    Ok(out)
}

/// The ids of the chunks whose records are in pages `lo..=hi` as `txn` sees them, ascending.
pub(crate) fn ids_in_pages(txn: &WriteTxn, lo: u64, hi: u64) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for (key, page) in txn.range(meta::CHUNK_PAGES, lo..=hi)? {
        for i in 0..entry_count(key, &page)? {
            out.push(entry_id(key, &page, i));
        }
    }
    Ok(out)
}

/// Calls `f` with every chunk's id and record, ascending by id.
pub fn for_each(txn: &ReadTxn, mut f: impl FnMut(u64, ChunkRecord) -> Result<()>) -> Result<()> {
    for item in txn.iter(meta::CHUNK_PAGES)? {
        let (key, page) = item?;
        for (id, rec) in decode(key, &page)? {
            f(id, rec)?;
        }
    }
    Ok(())
}

/// Changes to chunk records inside one write transaction, kept a page at a time: each page is
/// read from the transaction once, changed in memory, and written back by [`Pages::write`].
/// Until then the transaction itself does not see the changes: read them through here.
///
/// Changes made in ascending id order (as a commit makes most of them) append to their page.
#[derive(Default)]
pub struct Pages {
    /// Pages read so far: their entries and whether they changed.
    pages: FxHashMap<u64, (Entries, bool)>,
}

impl Pages {
    /// No page read yet.
    pub fn new() -> Pages {
        Pages::default()
    }

    fn page(&mut self, r: &impl Reader, key: u64) -> Result<&mut (Entries, bool)> {
        if let std::collections::hash_map::Entry::Vacant(e) = self.pages.entry(key) {
            let entries = match r.get(meta::CHUNK_PAGES, &key)? {
                Some(page) => decode(key, &page)?,
                None => Vec::new(),
            };
            e.insert((entries, false));
        }
        Ok(self.pages.get_mut(&key).expect("inserted"))
    }

    /// The record of chunk `id` as this transaction (with the changes made here) sees it.
    pub fn get(&mut self, r: &impl Reader, id: u64) -> Result<Option<ChunkRecord>> {
        let (entries, _) = self.page(r, page_of(id))?;
        Ok(entries
            .binary_search_by_key(&id, |&(i, _)| i)
            .ok()
            .map(|at| entries[at].1))
    }

    /// Sets chunk `id`'s record (refused if a field is beyond its encoding's range).
    pub fn put(&mut self, r: &impl Reader, id: u64, rec: ChunkRecord) -> Result<()> {
        rec.check_encodable()?;
        let (entries, dirty) = self.page(r, page_of(id))?;
        if entries.last().is_none_or(|&(last, _)| last < id) {
            entries.push((id, rec));
        } else {
            match entries.binary_search_by_key(&id, |&(i, _)| i) {
                Ok(at) => entries[at].1 = rec,
                Err(at) => entries.insert(at, (id, rec)),
            }
        }
        *dirty = true;
        Ok(())
    }

    /// Deletes chunk `id`'s record (absent or not).
    pub fn remove(&mut self, r: &impl Reader, id: u64) -> Result<()> {
        let (entries, dirty) = self.page(r, page_of(id))?;
        if let Ok(at) = entries.binary_search_by_key(&id, |&(i, _)| i) {
            entries.remove(at);
            *dirty = true;
        }
        Ok(())
    }

    /// Writes every changed page into `txn` (deleting the ones left empty).
    pub fn write(self, txn: &mut WriteTxn) {
        let mut changed: Vec<(u64, Entries)> = self
            .pages
            .into_iter()
            .filter(|(_, (_, dirty))| *dirty)
            .map(|(key, (entries, _))| (key, entries))
            .collect();
        changed.sort_unstable_by_key(|&(key, _)| key);
        let mut stretch = None;
        for (key, entries) in changed {
            // Each stretch of pages changed is offered for packing: a fold rewrites most pages
            // of its stretches, whose rows shrank as their chunks died.
            let lo = key / SPAN_PAGES * SPAN_PAGES;
            if stretch != Some(lo) {
                stretch = Some(lo);
                txn.pack(meta::CHUNK_PAGES, &lo, &(lo + SPAN_PAGES - 1));
            }
            if entries.is_empty() {
                txn.remove(meta::CHUNK_PAGES, &key);
            } else {
                txn.insert(meta::CHUNK_PAGES, &key, encode(&entries).as_slice());
            }
        }
    }
}

/// Moves the records of a pool of format version 14 or older into this layout, inside `txn`:
/// the one-row-per-chunk `chunks` table of versions 5 and older, or the 72-byte page entries
/// of versions 6 to 14, each record's fingerprint moved to `chunk.fps`. The caller commits
/// `txn` with the pool record's new version, so a crash leaves either layout whole. Returns how
/// many records moved.
pub fn upgrade(txn: &mut WriteTxn) -> Result<u64> {
    let mut moved: Vec<(u64, ChunkRecord, Fingerprint)> = Vec::new();
    for (id, v) in txn.extract_range_if(meta::CHUNKS_BY_ID, .., |_, _| true)? {
        let (rec, fp) = ChunkRecord::decode_v14(&v)?;
        moved.push((id, rec, fp));
    }
    for (key, page) in txn.extract_range_if(meta::CHUNK_PAGES, .., |_, _| true)? {
        if page.is_empty() || !page.len().is_multiple_of(ENTRY_V14_BYTES) {
            return Err(Error::Corrupt(format!(
                "format-14 chunk page {key:#x} of {} bytes",
                page.len()
            )));
        }
        for e in page.chunks_exact(ENTRY_V14_BYTES) {
            let id = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
            if page_of(id) != key {
                return Err(Error::Corrupt(format!(
                    "format-14 chunk page {key:#x} holds chunk {id:#x}"
                )));
            }
            let (rec, fp) = ChunkRecord::decode_v14(&e[8..])?;
            moved.push((id, rec, fp));
        }
    }
    moved.sort_unstable_by_key(|&(id, _, _)| id);
    if moved.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(Error::Corrupt("a chunk id recorded twice".into()));
    }
    let mut pages = Pages::new();
    let mut fps = Vec::with_capacity(moved.len());
    for &(id, rec, fp) in &moved {
        pages.put(txn, id, rec)?;
        fps.push((id, fp));
    }
    pages.write(txn);
    crate::chunk_fps::add(txn, &fps)?;
    Ok(moved.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Backend, Store};

    fn record(n: u64) -> ChunkRecord {
        ChunkRecord {
            segment: n,
            offset: n as u32 * 10,
            stored_len: 4096,
            crc: n as u32,
            flags: 0,
            refs: n + 1,
        }
    }

    /// Pages hold what was put, in id order, across page boundaries and commits; a removed
    /// record is gone and an emptied page is deleted; reads, ranges and scans agree.
    #[test]
    fn pages_round_trip() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let ids: Vec<u64> = (0..40u64).map(|s| (s << SHARD_BITS) | (s % 7)).collect();
        let mut txn = store.write()?;
        let mut pages = Pages::new();
        for &id in ids.iter().rev() {
            pages.put(&txn, id, record(id))?;
        }
        assert_eq!(pages.get(&txn, ids[3])?, Some(record(ids[3])));
        pages.write(&mut txn);
        txn.commit()?;

        let mut txn = store.write()?;
        let mut pages = Pages::new();
        for &id in &ids[..PAGE_SEQS] {
            pages.remove(&txn, id)?;
        }
        pages.put(&txn, ids[20], record(1))?;
        pages.write(&mut txn);
        txn.commit()?;

        let r = store.read()?;
        assert_eq!(r.get(meta::CHUNK_PAGES, &0)?, None, "an emptied page stays");
        assert_eq!(get(&r, ids[0])?, None);
        assert_eq!(get(&r, ids[20])?, Some(record(1)));
        assert_eq!(get(&r, ids[39])?, Some(record(ids[39])));
        assert_eq!(get(&r, ids[39] + 1)?, None);
        let all = {
            let mut all = Vec::new();
            for_each(&r, |id, rec| {
                all.push((id, rec));
                Ok(())
            })?;
            all
        };
        let want: Vec<u64> = ids[PAGE_SEQS..].to_vec();
        assert_eq!(all.iter().map(|&(id, _)| id).collect::<Vec<_>>(), want);
        // Many at once (unsorted, repeated, absent, on pages gone) as one at a time.
        let mut asked: Vec<u64> = ids
            .iter()
            .rev()
            .copied()
            .chain([ids[39] + 1, ids[25]])
            .collect();
        let mut got = Vec::new();
        get_many(&r, &mut asked, |id, rec| got.push((id, rec)))?;
        let mut one_by_one = Vec::new();
        for &id in &asked {
            if let Some(rec) = get(&r, id)? {
                one_by_one.push((id, rec));
            }
        }
        assert_eq!(got, one_by_one);
        assert_eq!(got.len(), ids.len() - PAGE_SEQS + 1);
        let some = range(&r, ids[18], ids[33])?;
        assert_eq!(
            some.iter().map(|&(id, _)| id).collect::<Vec<_>>(),
            ids[18..=33].to_vec()
        );
        Ok(())
    }

    /// A page whose length is not whole entries, or whose ids are out of order or reach past
    /// the page's low bits, is reported as corrupt rather than misread; a record beyond its
    /// encoding's range is refused before it is written.
    #[test]
    fn bad_pages_are_corrupt() {
        let good = encode(&[(1 << SHARD_BITS, record(1)), (2 << SHARD_BITS, record(2))]);
        assert!(decode(0, &good).is_ok());
        assert!(matches!(
            decode(0, &good[..ENTRY_BYTES + 3]),
            Err(Error::Corrupt(_))
        ));
        assert!(matches!(decode(0, &[]), Err(Error::Corrupt(_))));
        assert_eq!(
            decode(1, &good).expect("ids are relative to their page")[0].0,
            1 << PAGE_SHIFT | 1 << SHARD_BITS
        );
        let mut beyond = good.clone();
        beyond[ENTRY_BYTES..ENTRY_BYTES + 2].copy_from_slice(&(LOW_MASK as u16 + 1).to_le_bytes());
        assert!(matches!(decode(0, &beyond), Err(Error::Corrupt(_))));
        let mut pages = Pages::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::create(dir.path(), Backend::Redb).expect("store");
        let txn = store.write().expect("txn");
        let huge = ChunkRecord {
            refs: 1 << 48,
            ..record(1)
        };
        assert!(pages.put(&txn, 1, huge).is_err());
        assert_eq!(pages.get(&txn, 1).expect("get"), None, "nothing put");
        let swapped = encode(&[(2 << SHARD_BITS, record(2)), (1 << SHARD_BITS, record(1))]);
        assert!(matches!(decode(0, &swapped), Err(Error::Corrupt(_))));
    }
}
