//! The chunks' fingerprints, kept apart from their records and swept of the dead in bulk.
//!
//! A chunk's record (`chunk_table.rs`) is rewritten by every fold of reference changes that
//! touches its page and every move by the cleaner; its 32-byte fingerprint never changes. In
//! one 72-byte entry the fingerprint was more than half of what a fold of a slice and a move
//! rewrote (BENCHMARKS.md, "Fingerprints apart from the chunk records"). Here each is written
//! once, when its chunk is committed, in pages of neighbouring ids — new ids grow, so the
//! pages are appended — and read to confirm a dedup candidate, to find a dying chunk's dedup
//! key, and by verify and scrub.
//!
//! A chunk's death does not delete its fingerprint: deaths come at random all over the id
//! space, and deleting each one rewrote a page of this table per death. A fingerprint whose
//! chunk has no record is **stale**: harmless, since every reader asks the chunk table first
//! (or after), and counted per slice of the reference log ([`Stale`]). When a fold of a
//! slice leaves the slice's stale fingerprints at least as many as a slice's share of the
//! live chunks (a sixty-fourth), the same commit **sweeps** the slice: it rewrites the slice's
//! pages with only the live chunks' fingerprints. With the live chunks spread evenly over the
//! slices, each sweep drops about as many entries as it keeps or more, so the table stays
//! near twice the live chunks' at most and a death costs about two entries' bytes, once.
//!
//! # Page format (the value of a `chunk.fps` row; key: `id >> chunk_table::PAGE_SHIFT`)
//!
//! ```text
//! entry*  (1 to PAGE_SEQS, ascending chunk id; a page left with none is deleted)
//! entry:  chunk id's low PAGE_SHIFT bits u16 LE | fingerprint [u8; 32]
//! ```
//!
//! # Stale counts (the value of the `pool` row [`meta::FPS_STALE_KEY`])
//!
//! `u64 LE` per slice of the reference log ([`ref_log::SLICES`]): fingerprints of that slice
//! whose chunk died and which no sweep dropped yet. Absent while all are zero.

use crate::chunk_table::{by_page, page_of, PAGE_SEQS, PAGE_SHIFT};
use crate::error::{Error, Result};
use crate::format::Fingerprint;
use crate::meta;
use crate::ref_log::{self, SLICES, SPAN_PAGES};
use crate::store::{ReadTxn, Reader, WriteTxn};

/// Encoded size of one entry.
const ENTRY_BYTES: usize = 2 + 32;
/// The low bits of a chunk id that an entry holds.
const LOW_MASK: u64 = (1 << PAGE_SHIFT) - 1;

/// The decoded entries of a page: (chunk id, fingerprint), ascending by id.
type Entries = Vec<(u64, Fingerprint)>;

/// Checks page `key`'s length; returns its number of entries.
fn check_len(key: u64, page: &[u8]) -> Result<usize> {
    let n = page.len() / ENTRY_BYTES;
    if !page.len().is_multiple_of(ENTRY_BYTES) || n == 0 || n > PAGE_SEQS {
        return Err(Error::Corrupt(format!(
            "fingerprint page {key:#x} of {} bytes",
            page.len()
        )));
    }
    Ok(n)
}

/// Decodes page `key`, checking its length and that its ids ascend and belong to it.
fn decode(key: u64, page: &[u8]) -> Result<Entries> {
    let n = check_len(key, page)?;
    let mut out: Entries = Vec::with_capacity(n);
    for e in page.chunks_exact(ENTRY_BYTES) {
        let low = u16::from_le_bytes([e[0], e[1]]) as u64;
        let id = key << PAGE_SHIFT | low;
        if low > LOW_MASK || out.last().is_some_and(|&(prev, _)| prev >= id) {
            return Err(Error::Corrupt(format!(
                "fingerprint page {key:#x}: an entry for chunk {id:#x}"
            )));
        }
        out.push((id, e[2..].try_into().expect("32 bytes")));
    }
    Ok(out)
}

fn encode(entries: &[(u64, Fingerprint)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * ENTRY_BYTES);
    for (id, fp) in entries {
        out.extend_from_slice(&((id & LOW_MASK) as u16).to_le_bytes());
        out.extend_from_slice(fp);
    }
    out
}

/// The fingerprint stored for chunk `id`, if any (of a live chunk, or a stale one: ask the
/// chunk table whether the chunk lives).
pub fn get(r: &impl Reader, id: u64) -> Result<Option<Fingerprint>> {
    let key = page_of(id);
    let Some(page) = r.get(meta::CHUNK_FPS, &key)? else {
        return Ok(None);
    };
    check_len(key, &page)?;
    // A dedup candidate's confirmation reads one entry: scanned in place, not decoded.
    Ok(find(&page, id))
}

/// The fingerprints stored for those of `ids` that have one, each page read once (sorts
/// `ids`).
pub fn get_many(
    r: &impl Reader,
    ids: &mut [u64],
    mut found: impl FnMut(u64, Fingerprint),
) -> Result<()> {
    ids.sort_unstable();
    for (key, ids) in by_page(ids) {
        if let Some(page) = r.get(meta::CHUNK_FPS, &key)? {
            check_len(key, &page)?;
            for &id in ids {
                if let Some(fp) = find(&page, id) {
                    found(id, fp);
                }
            }
        }
    }
    Ok(())
}

/// The fingerprint of chunk `id` in its `page` (of checked length), scanned in place.
fn find(page: &[u8], id: u64) -> Option<Fingerprint> {
    let low = (id & LOW_MASK) as u16;
    page.chunks_exact(ENTRY_BYTES)
        .find(|e| u16::from_le_bytes([e[0], e[1]]) == low)
        .map(|e| e[2..].try_into().expect("32 bytes"))
}

/// The fingerprint of chunk `id`, which has a record: corrupt if none is stored.
pub fn load(r: &impl Reader, id: u64) -> Result<Fingerprint> {
    get(r, id)?.ok_or_else(|| Error::Corrupt(format!("chunk {id:#x} has no fingerprint")))
}

/// The fingerprints stored for ids in `lo..=hi`, ascending by id (stale ones included).
pub fn range(txn: &ReadTxn, lo: u64, hi: u64) -> Result<Entries> {
    let mut out = Vec::new();
    for item in txn.range(meta::CHUNK_FPS, page_of(lo)..=page_of(hi))? {
        let (key, page) = item?;
        out.extend(
            decode(key, &page)?
                .into_iter()
                .filter(|&(id, _)| (lo..=hi).contains(&id)),
        );
    }
    Ok(out)
}

/// Calls `f` with every stored fingerprint (stale ones included), ascending by id.
pub fn for_each(txn: &ReadTxn, mut f: impl FnMut(u64, Fingerprint) -> Result<()>) -> Result<()> {
    for item in txn.iter(meta::CHUNK_FPS)? {
        let (key, page) = item?;
        for (id, fp) in decode(key, &page)? {
            f(id, fp)?;
        }
    }
    Ok(())
}

/// Stores the fingerprints of new chunks (`new`: ascending ids none of which has one yet) in
/// `txn`, each page read and written once.
pub fn add(txn: &mut WriteTxn, new: &[(u64, Fingerprint)]) -> Result<()> {
    debug_assert!(new.windows(2).all(|w| w[0].0 < w[1].0));
    let mut at = 0;
    while at < new.len() {
        let key = page_of(new[at].0);
        let end = at + new[at..].partition_point(|&(id, _)| page_of(id) == key);
        let mut entries = match txn.get(meta::CHUNK_FPS, &key)? {
            Some(page) => decode(key, &page)?,
            None => Vec::new(),
        };
        for &(id, fp) in &new[at..end] {
            match entries.binary_search_by_key(&id, |&(i, _)| i) {
                Ok(_) => {
                    return Err(Error::Corrupt(format!(
                        "new chunk {id:#x} already has a fingerprint"
                    )))
                }
                Err(i) => entries.insert(i, (id, fp)),
            }
        }
        txn.insert(meta::CHUNK_FPS, &key, encode(&entries).as_slice());
        at = end;
    }
    Ok(())
}

/// Rewrites the pages of reference-log slice `slice` below page `end` (the page of the next
/// chunk id to be handed out) with only the fingerprints of chunks `txn` holds a record of
/// (`chunk_table`: call after the transaction's record changes are written into it). Returns
/// the fingerprints dropped.
pub(crate) fn sweep(txn: &mut WriteTxn, slice: usize, end: u64) -> Result<u64> {
    let mut dropped = 0;
    let mut stretch = slice as u64 * SPAN_PAGES;
    while stretch <= end {
        let hi = stretch + SPAN_PAGES - 1;
        let pages = txn.range(meta::CHUNK_FPS, stretch..=hi)?;
        if !pages.is_empty() {
            let live: Vec<u64> = crate::chunk_table::ids_in_pages(txn, stretch, hi)?;
            txn.pack(meta::CHUNK_FPS, &stretch, &hi);
            for (key, page) in pages {
                let entries = decode(key, &page)?;
                let kept: Entries = entries
                    .iter()
                    .copied()
                    .filter(|(id, _)| live.binary_search(id).is_ok())
                    .collect();
                dropped += (entries.len() - kept.len()) as u64;
                if kept.is_empty() {
                    txn.remove(meta::CHUNK_FPS, &key);
                } else if kept.len() < entries.len() {
                    txn.insert(meta::CHUNK_FPS, &key, encode(&kept).as_slice());
                }
            }
        }
        stretch += SLICES as u64 * SPAN_PAGES;
    }
    Ok(dropped)
}

/// Stale fingerprints (their chunk dead, not swept yet) per slice of the reference log: what
/// decides the sweeps. Owned by the committer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stale {
    per_slice: [u64; SLICES],
}

impl Default for Stale {
    fn default() -> Self {
        Stale {
            per_slice: [0; SLICES],
        }
    }
}

impl Stale {
    /// The counts as committed in `r`'s snapshot.
    pub fn load(r: &impl Reader) -> Result<Stale> {
        let mut out = Stale::default();
        if let Some(v) = r.get(meta::POOL, meta::FPS_STALE_KEY)? {
            if v.len() != SLICES * 8 {
                return Err(Error::Corrupt(format!(
                    "stale fingerprint counts of {} bytes",
                    v.len()
                )));
            }
            for (n, b) in out.per_slice.iter_mut().zip(v.chunks_exact(8)) {
                *n = u64::from_le_bytes(b.try_into().expect("8 bytes"));
            }
        }
        Ok(out)
    }

    /// All stale fingerprints.
    pub fn total(&self) -> u64 {
        self.per_slice.iter().sum()
    }

    /// Counts the fingerprint of chunk `id`, which died, as stale.
    pub fn died(&mut self, id: u64) {
        self.per_slice[ref_log::slice_of(id)] += 1;
    }

    /// Whether `slice` is to be swept now: it holds at least as many stale fingerprints as a
    /// slice's share of the `live_chunks`.
    pub fn due(&self, slice: usize, live_chunks: u64) -> bool {
        let n = self.per_slice[slice];
        n > 0 && n >= live_chunks / SLICES as u64
    }

    /// Records that `slice` was swept.
    pub fn swept(&mut self, slice: usize) {
        self.per_slice[slice] = 0;
    }

    /// Writes the counts into `txn` (the row deleted when all are zero).
    pub fn write(&self, txn: &mut WriteTxn) {
        if self.total() == 0 {
            txn.remove(meta::POOL, meta::FPS_STALE_KEY);
            return;
        }
        let v: Vec<u8> = self
            .per_slice
            .iter()
            .flat_map(|n| n.to_le_bytes())
            .collect();
        txn.insert(meta::POOL, meta::FPS_STALE_KEY, v.as_slice());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk_table;
    use crate::format::ChunkRecord;
    use crate::shard::SHARD_BITS;
    use crate::store::{Backend, Store};

    fn rec(n: u64) -> ChunkRecord {
        ChunkRecord {
            segment: n,
            offset: 0,
            stored_len: 4096,
            crc: 0,
            flags: 0,
            refs: 1,
        }
    }

    /// The id of sequence number `seq` (shard 5).
    fn id(seq: u64) -> u64 {
        seq << SHARD_BITS | 5
    }

    /// Fingerprints added over several commits (a page filled in two) read back one by one,
    /// many at once, by range and by scan; a sweep of a slice keeps exactly the fingerprints
    /// of the chunks with records, in that slice only, and deletes pages left empty.
    #[test]
    fn fingerprints_round_trip_and_sweeps_keep_the_live_ones() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let span_seqs = SPAN_PAGES * PAGE_SEQS as u64;
        // Sequences in slice 0's first stretch, slice 1's, and slice 0's second stretch.
        let seqs: Vec<u64> = (0..40)
            .chain(span_seqs..span_seqs + 40)
            .chain(SLICES as u64 * span_seqs..SLICES as u64 * span_seqs + 40)
            .collect();
        let fp = |id: u64| [id as u8 ^ (id >> 8) as u8; 32];
        for half in [&seqs[..30], &seqs[30..]] {
            let mut txn = store.write()?;
            let new: Vec<(u64, Fingerprint)> = half.iter().map(|&s| (id(s), fp(id(s)))).collect();
            let mut pages = chunk_table::Pages::new();
            for &(i, _) in &new {
                pages.put(&txn, i, rec(i))?;
            }
            pages.write(&mut txn);
            add(&mut txn, &new)?;
            txn.commit()?;
        }
        let r = store.read()?;
        assert_eq!(get(&r, id(3))?, Some(fp(id(3))));
        assert_eq!(get(&r, id(41))?, None);
        let mut asked: Vec<u64> = vec![id(39), id(0), id(41), id(span_seqs + 1)];
        let mut got = Vec::new();
        get_many(&r, &mut asked, |i, f| got.push((i, f)))?;
        assert_eq!(
            got,
            [id(0), id(39), id(span_seqs + 1)]
                .map(|i| (i, fp(i)))
                .to_vec()
        );
        assert_eq!(range(&r, id(10), id(19))?.len(), 10);
        let mut all = Vec::new();
        for_each(&r, |i, _| {
            all.push(i);
            Ok(())
        })?;
        assert_eq!(all, seqs.iter().map(|&s| id(s)).collect::<Vec<_>>());
        drop(r);

        // Every chunk of slice 0's first stretch dies but one; half of the second stretch's;
        // one of slice 1's.
        let mut txn = store.write()?;
        let mut pages = chunk_table::Pages::new();
        let mut dead = Vec::new();
        for &s in seqs[1..40]
            .iter()
            .chain(&seqs[80..100])
            .chain(&seqs[40..41])
        {
            pages.remove(&txn, id(s))?;
            dead.push(id(s));
        }
        pages.write(&mut txn);
        let mut stale = Stale::default();
        for &i in &dead {
            stale.died(i);
        }
        assert_eq!((stale.per_slice[0], stale.per_slice[1]), (59, 1));
        assert!(stale.due(0, 59 * SLICES as u64));
        assert!(!stale.due(0, 60 * SLICES as u64));
        assert!(!stale.due(2, 0), "nothing stale there");
        assert_eq!(sweep(&mut txn, 0, page_of(id(seqs[119] + 1)))?, 59);
        stale.swept(0);
        stale.write(&mut txn);
        txn.commit()?;

        let r = store.read()?;
        let mut left = Vec::new();
        for_each(&r, |i, f| {
            assert_eq!(f, fp(i));
            left.push(i);
            Ok(())
        })?;
        let want: Vec<u64> = seqs
            .iter()
            .map(|&s| id(s))
            .filter(|i| !dead.contains(i) || *i == id(seqs[40]))
            .collect();
        assert_eq!(left, want, "slice 0 swept, slice 1's stale one kept");
        assert_eq!(
            r.get(meta::CHUNK_FPS, &page_of(id(16)))?,
            None,
            "a page left empty is deleted"
        );
        assert_eq!(Stale::load(&r)?, stale);
        assert_eq!(Stale::load(&r)?.total(), 1);
        Ok(())
    }

    /// Malformed pages are corrupt, not misread; a fingerprint added twice is refused.
    #[test]
    fn bad_pages_are_corrupt() -> Result<()> {
        let good = encode(&[(1, [1; 32]), (2, [2; 32])]);
        assert_eq!(decode(3, &good)?[1].0, 3 << PAGE_SHIFT | 2);
        assert!(decode(0, &good[..ENTRY_BYTES + 1]).is_err());
        assert!(decode(0, &[]).is_err());
        assert!(decode(0, &encode(&[(2, [2; 32]), (1, [1; 32])])).is_err());
        let mut beyond = good.clone();
        beyond[..2].copy_from_slice(&(LOW_MASK as u16 + 1).to_le_bytes());
        assert!(decode(0, &beyond).is_err());
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let store = Store::create(dir.path(), Backend::Redb)?;
        let mut txn = store.write()?;
        add(&mut txn, &[(1, [1; 32])])?;
        assert!(add(&mut txn, &[(1, [9; 32])]).is_err());
        Ok(())
    }
}
