//! The map page format (the value of a `map.pages` row: the entries of [`PAGE_BLOCKS`]
//! neighbouring blocks of one layer, `map_table.rs`), and page deltas: how the map's log
//! (`store/deferred.rs`) records a change to a page that already exists — the slots that
//! changed, not the whole page.
//!
//! # Page format
//!
//! ```text
//! present u16 LE   bit i set: block (page << PAGE_BLOCKS_BITS) + i has an entry (never 0:
//!                  a page left with no entry is deleted)
//! value   u64 LE   one per set bit, in bit order: a chunk id, or format::ZERO_TOMBSTONE
//! ```
//!
//! # Delta format
//!
//! ```text
//! present u16 LE   the new page's bitmap (0: the page is deleted)
//! changed u16 LE   bit i set: slot i's entry changed (set, replaced or removed)
//! value   u64 LE   one per slot set in both `changed` and `present`, in bit order: its new entry
//! ```
//!
//! A delta applies to the page as it was when the delta was made; applying it checks that the
//! result's bitmap is `present` (a delta applied to another page than its own is corrupt, not
//! a silently wrong map). A random 4 KiB overwrite changes one slot: 12 bytes instead of the
//! page's ~130.

use crate::error::{Error, Result};
use crate::format;

/// Blocks per page, as a power of two.
pub const PAGE_BLOCKS_BITS: u32 = 4;
/// Blocks per page.
pub const PAGE_BLOCKS: u64 = 1 << PAGE_BLOCKS_BITS;
/// Largest encoded page.
const PAGE_BYTES_MAX: usize = 2 + 8 * PAGE_BLOCKS as usize;
/// Bytes of a delta before its values.
const DELTA_HEAD: usize = 4;

/// One page, decoded: which of its blocks have an entry, and their values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Page {
    /// Bit i set: slot i has an entry.
    pub(crate) present: u16,
    /// Each slot's entry (0 where absent).
    pub(crate) values: [u64; PAGE_BLOCKS as usize],
}

impl Page {
    /// The presence bitmap of encoded page `b`, checked against its length.
    pub(crate) fn present(key: &[u8; 16], b: &[u8]) -> Result<u16> {
        let present = match b {
            [lo, hi, ..] => u16::from_le_bytes([*lo, *hi]),
            _ => 0,
        };
        if present == 0 || b.len() != 2 + 8 * present.count_ones() as usize {
            let (layer, page) = format::decode_map_key(key);
            return Err(Error::Corrupt(format!(
                "map page {page} of layer {layer}: {} bytes",
                b.len()
            )));
        }
        Ok(present)
    }

    /// The entry in `slot` of encoded page `b`, read without decoding the others.
    pub(crate) fn value_in(key: &[u8; 16], b: &[u8], slot: usize) -> Result<Option<u64>> {
        let present = Page::present(key, b)?;
        if present & (1 << slot) == 0 {
            return Ok(None);
        }
        let at = 2 + 8 * (present & ((1 << slot) - 1)).count_ones() as usize;
        Ok(Some(u64::from_le_bytes(
            b[at..at + 8].try_into().expect("8 bytes"),
        )))
    }

    pub(crate) fn decode(key: &[u8; 16], b: &[u8]) -> Result<Page> {
        let present = Page::present(key, b)?;
        let mut page = Page {
            present,
            ..Page::default()
        };
        let mut at = 2;
        for i in 0..PAGE_BLOCKS as usize {
            if present & (1 << i) != 0 {
                page.values[i] = u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
                at += 8;
            }
        }
        Ok(page)
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(PAGE_BYTES_MAX);
        out.extend_from_slice(&self.present.to_le_bytes());
        for i in 0..PAGE_BLOCKS as usize {
            if self.present & (1 << i) != 0 {
                out.extend_from_slice(&self.values[i].to_le_bytes());
            }
        }
        out
    }

    pub(crate) fn get(&self, slot: usize) -> Option<u64> {
        (self.present & (1 << slot) != 0).then_some(self.values[slot])
    }

    pub(crate) fn set(&mut self, slot: usize, value: Option<u64>) {
        match value {
            Some(v) => {
                self.present |= 1 << slot;
                self.values[slot] = v;
            }
            None => {
                self.present &= !(1 << slot);
                self.values[slot] = 0;
            }
        }
    }

    /// The (slot, value) pairs of its entries, ascending.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        (0..PAGE_BLOCKS as usize).filter_map(|i| self.get(i).map(|v| (i, v)))
    }
}

/// The page `b` (absent: no page) decoded, `None` if `key` is not a page key or `b` not a page.
fn decoded(key: &[u8], b: Option<&[u8]>) -> Option<Page> {
    let key: &[u8; 16] = key.try_into().ok()?;
    match b {
        None => Some(Page::default()),
        Some(b) => Page::decode(key, b).ok(),
    }
}

/// The delta that turns page `old` into `new` (either absent: no page) at `key`, or `None`
/// where a delta does not pay: `old` absent (the whole new page is as small, and needs no
/// base to apply to), or either not a page.
pub(crate) fn delta(key: &[u8], old: Option<&[u8]>, new: Option<&[u8]>) -> Option<Vec<u8>> {
    old?;
    Some(delta_of(&decoded(key, old)?, &decoded(key, new)?))
}

/// The delta that turns page `old` into `new` (an empty page: none).
pub(crate) fn delta_of(old: &Page, new: &Page) -> Vec<u8> {
    let changed = (0..PAGE_BLOCKS as usize)
        .filter(|&i| old.get(i) != new.get(i))
        .fold(0u16, |m, i| m | 1 << i);
    let mut out =
        Vec::with_capacity(DELTA_HEAD + 8 * (changed & new.present).count_ones() as usize);
    out.extend_from_slice(&new.present.to_le_bytes());
    out.extend_from_slice(&changed.to_le_bytes());
    for i in (0..PAGE_BLOCKS as usize).filter(|&i| (changed & new.present) & (1 << i) != 0) {
        out.extend_from_slice(&new.values[i].to_le_bytes());
    }
    out
}

/// The length of the delta at the front of `b`, `None` if `b` is shorter than its head says.
pub(crate) fn delta_len(b: &[u8]) -> Option<usize> {
    let head = b.get(..DELTA_HEAD)?;
    let (present, changed) = (
        u16::from_le_bytes([head[0], head[1]]),
        u16::from_le_bytes([head[2], head[3]]),
    );
    let n = DELTA_HEAD + 8 * (changed & present).count_ones() as usize;
    (b.len() >= n).then_some(n)
}

/// Takes a delta from the front of `b` and applies it to page `old` at `key` (absent: no
/// page): the new page, `None` if the delta deletes it.
pub(crate) fn apply_delta(
    key: &[u8],
    old: Option<&[u8]>,
    b: &mut &[u8],
) -> Result<Option<Vec<u8>>> {
    let corrupt = |what: &str| Error::Corrupt(format!("map page delta at {key:02x?}: {what}"));
    let page_key: &[u8; 16] = key.try_into().map_err(|_| corrupt("not a page key"))?;
    if b.len() < DELTA_HEAD {
        return Err(corrupt("truncated"));
    }
    let present = u16::from_le_bytes([b[0], b[1]]);
    let changed = u16::from_le_bytes([b[2], b[3]]);
    let values = 8 * (changed & present).count_ones() as usize;
    if b.len() < DELTA_HEAD + values {
        return Err(corrupt("truncated"));
    }
    let mut page = match old {
        Some(old) => Page::decode(page_key, old)?,
        None => Page::default(),
    };
    let mut at = DELTA_HEAD;
    for i in (0..PAGE_BLOCKS as usize).filter(|&i| changed & (1 << i) != 0) {
        let value = (present & (1 << i) != 0).then(|| {
            at += 8;
            u64::from_le_bytes(b[at - 8..at].try_into().expect("8 bytes"))
        });
        page.set(i, value);
    }
    *b = &b[DELTA_HEAD + values..];
    if page.present != present {
        return Err(corrupt("its bitmap is not the page's it applies to"));
    }
    Ok((present != 0).then(|| page.encode()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(entries: &[(usize, u64)]) -> Option<Vec<u8>> {
        let mut p = Page::default();
        for &(i, v) in entries {
            p.set(i, Some(v));
        }
        (p.present != 0).then(|| p.encode())
    }

    /// A delta turns its old page into the new one: entries set, replaced and removed, the
    /// page deleted; one changed slot costs 12 bytes; a new page or a value that is not a
    /// page gets none.
    #[test]
    fn deltas_turn_the_old_page_into_the_new() {
        let key = format::map_key(3, 77);
        let cases = [
            (page(&[(0, 1), (5, 9)]), page(&[(0, 1), (5, 10)])),
            (page(&[(0, 1), (5, 9)]), page(&[(0, 1), (5, 9), (15, 4)])),
            (page(&[(0, 1), (5, 9)]), page(&[(5, 9)])),
            (page(&[(0, 1), (5, 9)]), None),
            (page(&[(0, 1)]), page(&[(1, 2), (2, 3), (3, 4)])),
            (page(&[(0, 1)]), page(&[(0, 1)])),
        ];
        for (old, new) in &cases {
            let d = delta(&key, old.as_deref(), new.as_deref()).expect("a delta");
            let mut rest = &d[..];
            assert_eq!(
                &apply_delta(&key, old.as_deref(), &mut rest).expect("applies"),
                new
            );
            assert!(rest.is_empty());
        }
        let one = delta(&key, cases[0].0.as_deref(), cases[0].1.as_deref()).expect("a delta");
        assert_eq!(one.len(), 12);
        assert_eq!(delta(&key, None, page(&[(1, 1)]).as_deref()), None);
        assert_eq!(
            delta(&key, Some(b"not a page"), page(&[(1, 1)]).as_deref()),
            None
        );
        assert_eq!(delta(b"short", page(&[(1, 1)]).as_deref(), None), None);
    }

    /// A delta applied to another page than its own, or cut short, is corrupt.
    #[test]
    fn a_delta_on_the_wrong_page_or_cut_short_is_corrupt() {
        let key = format::map_key(3, 77);
        let (old, new) = (page(&[(0, 1), (5, 9)]), page(&[(0, 1), (5, 10)]));
        let d = delta(&key, old.as_deref(), new.as_deref()).expect("a delta");
        let other = page(&[(1, 1), (5, 9)]);
        assert!(matches!(
            apply_delta(&key, other.as_deref(), &mut &d[..]),
            Err(Error::Corrupt(_))
        ));
        assert!(matches!(
            apply_delta(&key, None, &mut &d[..]),
            Err(Error::Corrupt(_))
        ));
        assert_eq!(delta_len(&d), Some(d.len()));
        for cut in 0..d.len() {
            assert_eq!(delta_len(&d[..cut]), None);
            assert!(matches!(
                apply_delta(&key, old.as_deref(), &mut &d[..cut]),
                Err(Error::Corrupt(_))
            ));
        }
        assert!(apply_delta(b"short", old.as_deref(), &mut &d[..]).is_err());
    }
}
