//! A volume's map changes not yet committed: entries by block, and zeroed ranges.
//!
//! Zeroing (also unmap and trim) records the range, not one entry per mapped block, so its
//! cost does not depend on the range's length or on how much of it holds data. The commit
//! applies a range to the store (`commit.rs`): it removes the top layer's committed entries
//! inside it, dropping their chunk references, writes tombstones where lower frames have data,
//! and counts the blocks that stopped showing data (the volume's mapped count is settled then).
//!
//! Precedence: an entry inside a zeroed range is always newer than the range (zeroing removes
//! the entries it covers), so a block reads as its entry if it has one, else as zeros if a
//! range covers it, else as whatever lies under the overlay.
//!
//! **Settled blocks.** An entry that replaced a committed top-layer entry dropped that entry's
//! reference and adjusted the mapped count when it was installed. If a zeroed range then
//! removes it, the commit must not drop that reference or count that block again: such blocks
//! are recorded as *settled*. An entry installed inside an existing range replaced nothing
//! committed (the range already hides it), so removing it settles nothing.

use std::collections::{BTreeMap, BTreeSet};

/// A map entry in memory: a block either references a chunk or reads as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entry {
    Data(u64),
    Zero,
}

/// Uncommitted map changes of one volume (one batch: dirty, or being committed).
#[derive(Debug, Default)]
pub(crate) struct Overlay {
    entries: BTreeMap<u64, Entry>,
    /// Zeroed ranges, start → end (exclusive): disjoint and never adjacent.
    zeroed: BTreeMap<u64, u64>,
    /// Blocks in `zeroed` whose committed top-layer entry this batch already released and
    /// counted (see the module doc).
    settled: BTreeSet<u64>,
}

impl Overlay {
    /// An empty overlay.
    pub fn new() -> Self {
        Self::default()
    }

    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.zeroed.is_empty()
    }

    /// Whether it holds a zeroed range (whose unmapped blocks only its commit counts).
    pub fn has_zeroed(&self) -> bool {
        !self.zeroed.is_empty()
    }

    /// Entries plus ranges (for logs).
    pub fn len(&self) -> usize {
        self.entries.len() + self.zeroed.len()
    }

    /// What this overlay says about block `b`: its entry, [`Entry::Zero`] inside a zeroed
    /// range, `None` when it says nothing.
    pub fn get(&self, b: u64) -> Option<Entry> {
        match self.entries.get(&b) {
            Some(&e) => Some(e),
            None => self.covers(b).then_some(Entry::Zero),
        }
    }

    /// Sets block `b`'s entry (newer than any range covering it).
    pub fn insert(&mut self, b: u64, e: Entry) {
        self.entries.insert(b, e);
    }

    /// The entries in `[b0, b1)`, in block order (ranges not included).
    pub fn entries(&self, b0: u64, b1: u64) -> impl Iterator<Item = (u64, Entry)> + '_ {
        self.entries.range(b0..b1).map(|(&b, &e)| (b, e))
    }

    /// Every entry, in block order.
    pub fn all_entries(&self) -> impl Iterator<Item = (u64, Entry)> + '_ {
        self.entries.iter().map(|(&b, &e)| (b, e))
    }

    /// The zeroed ranges, in order.
    pub fn zeroed(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.zeroed.iter().map(|(&s, &e)| (s, e))
    }

    /// The zeroed ranges clipped to `[b0, b1)`, in order.
    pub fn zeroed_in(&self, b0: u64, b1: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        // The range starting at or before b0 may reach into the window.
        let first = self.zeroed.range(..=b0).next_back().map_or(b0, |(&s, _)| s);
        self.zeroed
            .range(first..b1)
            .map(move |(&s, &e)| (s.max(b0), e.min(b1)))
            .filter(|(s, e)| s < e)
    }

    /// A copy of what this overlay says about `[b0, b1)`: its entries there and its ranges
    /// clipped to it (no settled blocks: a reader's view, not something to commit).
    pub fn window(&self, b0: u64, b1: u64) -> Overlay {
        Overlay {
            entries: self.entries.range(b0..b1).map(|(&b, &e)| (b, e)).collect(),
            zeroed: self.zeroed_in(b0, b1).collect(),
            settled: BTreeSet::new(),
        }
    }

    /// Whether a zeroed range covers block `b`.
    pub fn covers(&self, b: u64) -> bool {
        self.zeroed
            .range(..=b)
            .next_back()
            .is_some_and(|(_, &e)| b < e)
    }

    /// Whether one zeroed range covers all of `[b0, b1)` (ranges never touch, so one must).
    pub fn covers_all(&self, b0: u64, b1: u64) -> bool {
        self.zeroed
            .range(..=b0)
            .next_back()
            .is_some_and(|(_, &e)| b1 <= e)
    }

    /// Whether the commit must neither release nor count block `b`'s committed entry.
    pub fn settled(&self, b: u64) -> bool {
        self.settled.contains(&b)
    }

    /// Zeroes `[b0, b1)`: removes and returns the entries inside it, records the blocks they
    /// settle, and adds the range (merged with ranges it overlaps or touches). `under` is the
    /// overlay being committed beneath this one: an entry installed where a range of `under`
    /// hid the committed entry replaced nothing committed, so it settles nothing either.
    pub fn zero(&mut self, b0: u64, b1: u64, under: &Overlay) -> Vec<(u64, Entry)> {
        if b0 >= b1 {
            return Vec::new();
        }
        let removed: Vec<(u64, Entry)> = self.entries(b0, b1).collect();
        for &(b, _) in &removed {
            self.entries.remove(&b);
            if !self.covers(b) && !under.hides_by_range(b) {
                self.settled.insert(b);
            }
        }
        self.add_range(b0, b1);
        removed
    }

    /// Adds `[b0, b1)` as a range older than every entry here: one a commit left to settle
    /// (see `commit.rs`). The entries inside it stay and settle nothing (they were installed
    /// while that range already hid the committed entries).
    pub fn zero_under(&mut self, b0: u64, b1: u64) {
        if b0 < b1 {
            self.add_range(b0, b1);
        }
    }

    /// Whether block `b` reads as zeros here because of a range (not an entry).
    pub fn hides_by_range(&self, b: u64) -> bool {
        !self.entries.contains_key(&b) && self.covers(b)
    }

    /// The settled blocks inside `ranges`, in order.
    pub fn settled_in<'a>(&'a self, ranges: &'a [(u64, u64)]) -> impl Iterator<Item = u64> + 'a {
        ranges
            .iter()
            .flat_map(move |&(s, e)| self.settled.range(s..e).copied())
    }

    /// Adds `[b0, b1)` to the ranges, merged with those it overlaps or touches.
    fn add_range(&mut self, b0: u64, b1: u64) {
        let (mut s, mut e) = (b0, b1);
        if let Some((&ps, &pe)) = self.zeroed.range(..=b0).next_back() {
            if pe >= b0 {
                s = ps;
                e = e.max(pe);
            }
        }
        let merged: Vec<(u64, u64)> = self
            .zeroed
            .range(s..=e)
            .map(|(&rs, &re)| (rs, re))
            .collect();
        for (rs, re) in merged {
            self.zeroed.remove(&rs);
            e = e.max(re);
        }
        self.zeroed.insert(s, e);
    }

    /// Applies this overlay to `out` (committed data entries of `[b0, b1)`, block → chunk):
    /// zeroed ranges remove, then entries set or remove.
    pub fn apply_to(&self, b0: u64, b1: u64, out: &mut BTreeMap<u64, u64>) {
        for (s, e) in self.zeroed_in(b0, b1) {
            let inside: Vec<u64> = out.range(s..e).map(|(&b, _)| b).collect();
            for b in inside {
                out.remove(&b);
            }
        }
        for (b, e) in self.entries(b0, b1) {
            match e {
                Entry::Data(id) => {
                    out.insert(b, id);
                }
                Entry::Zero => {
                    out.remove(&b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Set(u64, Option<u64>),
        Zero(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..64u64, proptest::option::of(1..5u64)).prop_map(|(b, v)| Op::Set(b, v)),
            (0..64u64, 0..20u64).prop_map(|(b, n)| Op::Zero(b, b + n)),
        ]
    }

    proptest! {
        /// Against a block-by-block model over a committed base: what each block reads as, the
        /// ranges' shape (disjoint, not touching), and which blocks are settled (an entry that
        /// was not inside a range when zeroed).
        #[test]
        fn overlay_matches_a_block_model(
            base in proptest::collection::btree_map(0..64u64, 1..5u64, 0..40),
            ops in proptest::collection::vec(op(), 0..40),
        ) {
            let mut o = Overlay::new();
            // Entries the overlay should hold, and the blocks zeroed since (reading as zeros).
            let mut entries: BTreeMap<u64, Option<u64>> = BTreeMap::new();
            let mut in_range: BTreeSet<u64> = BTreeSet::new();
            let mut settled: BTreeSet<u64> = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Set(b, v) => {
                        o.insert(b, v.map_or(Entry::Zero, Entry::Data));
                        entries.insert(b, v);
                    }
                    Op::Zero(b0, b1) => {
                        let mut removed = o.zero(b0, b1, &Overlay::new());
                        removed.sort_unstable_by_key(|&(b, _)| b);
                        let mut want = Vec::new();
                        for b in b0..b1 {
                            if let Some(v) = entries.remove(&b) {
                                want.push((b, v.map_or(Entry::Zero, Entry::Data)));
                                if !in_range.contains(&b) {
                                    settled.insert(b);
                                }
                            }
                            in_range.insert(b);
                        }
                        prop_assert_eq!(removed, want);
                    }
                }
            }
            let mut out: BTreeMap<u64, u64> = base.clone();
            o.apply_to(0, 100, &mut out);
            for b in 0..100u64 {
                let want = match entries.get(&b) {
                    Some(v) => *v,
                    None if in_range.contains(&b) => None,
                    None => base.get(&b).copied(),
                };
                prop_assert_eq!(out.get(&b).copied(), want, "block {}", b);
                prop_assert_eq!(o.covers(b), in_range.contains(&b));
                prop_assert_eq!(o.settled(b), settled.contains(&b));
            }
            let ranges: Vec<(u64, u64)> = o.zeroed().collect();
            for w in ranges.windows(2) {
                prop_assert!(w[0].1 < w[1].0, "ranges {:?} touch", ranges);
            }
            for &(s, e) in &ranges {
                prop_assert!(s < e);
                prop_assert!(o.covers_all(s, e));
                prop_assert!(!o.covers_all(s, e + 1));
            }
            // A window's clipped ranges are exactly the covered blocks in it.
            let clipped: BTreeSet<u64> = o.zeroed_in(10, 40).flat_map(|(s, e)| s..e).collect();
            let want: BTreeSet<u64> = in_range.range(10..40).copied().collect();
            prop_assert_eq!(clipped, want);
        }
    }
}
