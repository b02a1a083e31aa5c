//! How a stack of frames resolves blocks: the one walk shared by reads, writes, range
//! copies, space accounting, flattening and verification.
//!
//! A volume's map is a stack of [`Frame`]s, bottom first. Block `b` shows the entry of the
//! topmost frame whose window holds `b` and whose layer has an entry for the block the frame
//! shows there; a floor whose window holds `b` stops the walk (the block reads as zeros unless
//! a frame above it had an entry). A map value of [`crate::format::ZERO_TOMBSTONE`] is an
//! entry too: it hides the frames below.

use crate::format::Frame;
use std::collections::{BTreeMap, HashMap};

/// What a stack shows in a block range.
#[derive(Debug, Default)]
pub(crate) struct Resolved {
    /// Block → map value; tombstones included.
    pub entries: BTreeMap<u64, u64>,
    /// Block → index in the stack of the frame its entry came from (only when asked for).
    pub frames: BTreeMap<u64, usize>,
    /// Ranges closed by floors (sorted, disjoint, clipped to the asked range): blocks there
    /// without an entry read as zeros whatever the frames below hold.
    pub closed: Vec<(u64, u64)>,
}

/// A layer scanner: `scan(layer, s0, s1, found)` calls `found(block, value)` for every entry
/// of `layer` with block in `[s0, s1)`, in any order.
pub(crate) type Found<'a> = dyn FnMut(u64, u64) + 'a;

/// Map entries loaded in memory: layer → block → map value.
pub(crate) type LoadedMap = HashMap<u64, BTreeMap<u64, u64>>;

/// What `stack` shows at every block (tombstones included), its layers read from `loaded`
/// (verify and scrub, which read the whole map once).
pub(crate) fn resolve_loaded(
    stack: &[Frame],
    loaded: &LoadedMap,
) -> crate::error::Result<BTreeMap<u64, u64>> {
    let scan = |layer: u64, s0: u64, s1: u64, found: &mut Found<'_>| {
        for (&b, &id) in loaded.get(&layer).into_iter().flat_map(|m| m.range(s0..s1)) {
            found(b, id);
        }
        Ok::<(), crate::error::Error>(())
    };
    Ok(resolve(stack, 0, u64::MAX, false, scan)?.entries)
}

/// Resolves `[b0, b1)` through `stack` with `scan` reading the layers (top frame first; the
/// walk stops once every block is decided). With `track_frames`, also records which frame
/// each entry came from.
pub(crate) fn resolve<E>(
    stack: &[Frame],
    b0: u64,
    b1: u64,
    track_frames: bool,
    mut scan: impl FnMut(u64, u64, u64, &mut Found<'_>) -> Result<(), E>,
) -> Result<Resolved, E> {
    let mut r = Resolved::default();
    if b0 >= b1 {
        return Ok(r);
    }
    if b1 == b0 + 1 {
        // One block (a 4 KiB read or write): the same walk without the range bookkeeping.
        for (i, f) in stack.iter().enumerate().rev() {
            if b0 < f.lo || b0 >= f.hi {
                continue;
            }
            if f.is_floor() {
                r.closed.push((b0, b1));
                break;
            }
            let src = f.source_block(b0);
            let mut hit = None;
            scan(f.layer, src, src + 1, &mut |_, value| hit = Some(value))?;
            if let Some(value) = hit {
                r.entries.insert(b0, value);
                if track_frames {
                    r.frames.insert(b0, i);
                }
                break;
            }
        }
        return Ok(r);
    }
    let (entries, frames) = (&mut r.entries, &mut r.frames);
    walk(stack, b0, b1, &mut r.closed, scan, |b, value, i| {
        let std::collections::btree_map::Entry::Vacant(v) = entries.entry(b) else {
            return false;
        };
        v.insert(value);
        if track_frames {
            frames.insert(b, i);
        }
        true
    })?;
    Ok(r)
}

/// Blocks [`resolve_each`] decides per step: its memory is a bit per block of one.
#[cfg(not(test))]
const EACH_WINDOW_BLOCKS: u64 = 1 << 20;
/// Small in tests, so that the proptest's ranges span several windows.
#[cfg(test)]
const EACH_WINDOW_BLOCKS: u64 = 16;

/// Calls `visit(block, value, frame)` once for every block of `[b0, b1)` that shows an entry
/// (tombstones included), in no particular order, with the index in the stack of the frame the
/// entry came from: what [`resolve`] finds, without the maps it builds (the space breakdown
/// walks whole volumes: the maps' inserts and lookups were most of its time). Walks any range
/// in windows of [`EACH_WINDOW_BLOCKS`], with a bit per block of one in memory.
pub(crate) fn resolve_each<E>(
    stack: &[Frame],
    b0: u64,
    b1: u64,
    mut scan: impl FnMut(u64, u64, u64, &mut Found<'_>) -> Result<(), E>,
    mut visit: impl FnMut(u64, u64, usize),
) -> Result<(), E> {
    // Blocks of the window whose entry was found (a frame above decided them).
    let mut found_at =
        vec![0u64; (b1.saturating_sub(b0).min(EACH_WINDOW_BLOCKS)).div_ceil(64) as usize];
    let mut w0 = b0;
    while w0 < b1 {
        let w1 = b1.min(w0.saturating_add(EACH_WINDOW_BLOCKS));
        found_at.fill(0);
        walk(stack, w0, w1, &mut Vec::new(), &mut scan, |b, value, i| {
            let k = (b - w0) as usize;
            let (word, bit) = (k / 64, 1u64 << (k % 64));
            if found_at[word] & bit != 0 {
                return false;
            }
            found_at[word] |= bit;
            visit(b, value, i);
            true
        })?;
        w0 = w1;
    }
    Ok(())
}

/// The walk [`resolve`] and [`resolve_each`] share: the frames of `stack` top first over
/// `[b0, b1)`. A floor closes the parts of its window still open (`closed`: sorted, disjoint);
/// any other frame's layer is scanned over the open parts, and `entry(block, value, frame)`
/// called for each entry found, answering whether it decided the block (no frame above had).
/// Stops once every block is decided.
fn walk<E>(
    stack: &[Frame],
    b0: u64,
    b1: u64,
    closed: &mut Vec<(u64, u64)>,
    mut scan: impl FnMut(u64, u64, u64, &mut Found<'_>) -> Result<(), E>,
    mut entry: impl FnMut(u64, u64, usize) -> bool,
) -> Result<(), E> {
    let mut decided = 0u64;
    for (i, f) in stack.iter().enumerate().rev() {
        let (lo, hi) = (f.lo.max(b0), f.hi.min(b1));
        if lo >= hi {
            continue;
        }
        let open = if closed.is_empty() {
            vec![(lo, hi)]
        } else {
            subtract(closed, lo, hi)
        };
        for (s, e) in open {
            if f.is_floor() {
                close(closed, s, e);
                continue;
            }
            let mut found = |src, value| {
                let b = f.volume_block(src);
                debug_assert!((s..e).contains(&b), "a scan went past its range");
                decided += u64::from(entry(b, value, i));
            };
            scan(
                f.layer,
                f.source_block(s),
                f.source_block(e - 1) + 1,
                &mut found,
            )?;
        }
        let all_closed = closed.first() == Some(&(b0, b1));
        if all_closed || (closed.is_empty() && decided == b1 - b0) {
            break;
        }
    }
    Ok(())
}

/// The parts of `[lo, hi)` outside the sorted, disjoint ranges `closed`.
fn subtract(closed: &[(u64, u64)], lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = lo;
    for &(s, e) in closed {
        if e <= at {
            continue;
        }
        if s >= hi {
            break;
        }
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
        if at >= hi {
            break;
        }
    }
    if at < hi {
        out.push((at, hi));
    }
    out
}

/// Adds `[lo, hi)` to the sorted, disjoint ranges `closed`, merging neighbours.
fn close(closed: &mut Vec<(u64, u64)>, lo: u64, hi: u64) {
    closed.push((lo, hi));
    closed.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(closed.len());
    for &(s, e) in closed.iter() {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    *closed = merged;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::FLOOR_LAYER;
    use proptest::prelude::*;
    use std::collections::HashMap;

    type Layers = HashMap<u64, BTreeMap<u64, u64>>;

    fn scan_mem(
        layers: &Layers,
    ) -> impl FnMut(u64, u64, u64, &mut Found<'_>) -> Result<(), ()> + '_ {
        move |layer, s0, s1, found| {
            for (&b, &v) in layers.get(&layer).into_iter().flat_map(|m| m.range(s0..s1)) {
                found(b, v);
            }
            Ok(())
        }
    }

    /// The definition, block by block.
    fn naive(stack: &[Frame], layers: &Layers, b: u64) -> Option<u64> {
        for f in stack.iter().rev() {
            if b < f.lo || b >= f.hi {
                continue;
            }
            if f.is_floor() {
                return None;
            }
            if let Some(&v) = layers.get(&f.layer).and_then(|m| m.get(&f.source_block(b))) {
                return Some(v);
            }
        }
        None
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        (0u64..4, 0u64..40, 1u64..40, 0u64..40, any::<bool>()).prop_map(
            |(layer, lo, len, src_lo, plain)| {
                if plain && layer != FLOOR_LAYER {
                    Frame::plain(layer)
                } else {
                    Frame {
                        layer,
                        lo,
                        hi: lo + len,
                        src_lo,
                    }
                }
            },
        )
    }

    proptest! {
        #[test]
        fn resolve_matches_the_block_by_block_definition(
            stack in proptest::collection::vec(arb_frame(), 1..8),
            entries in proptest::collection::vec((1u64..4, 0u64..80, 0u64..5), 0..120),
            b0 in 0u64..60,
            len in 1u64..40,
        ) {
            let mut layers: Layers = HashMap::new();
            for (layer, b, v) in entries {
                layers.entry(layer).or_default().insert(b, v);
            }
            let r = resolve(&stack, b0, b0 + len, true, scan_mem(&layers)).expect("in memory");
            for b in b0..b0 + len {
                let want = naive(&stack, &layers, b);
                prop_assert_eq!(r.entries.get(&b).copied(), want, "block {}", b);
                if let Some(&i) = r.frames.get(&b) {
                    prop_assert!(stack[i].lo <= b && b < stack[i].hi);
                }
                prop_assert_eq!(r.frames.contains_key(&b), want.is_some());
            }
            prop_assert!(r.entries.keys().all(|&b| b >= b0 && b < b0 + len));
            // `resolve_each` visits each block with an entry once, with its value and frame.
            let mut visited: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
            let mut twice = Vec::new();
            resolve_each(&stack, b0, b0 + len, scan_mem(&layers), |b, v, i| {
                if visited.insert(b, (v, i)).is_some() {
                    twice.push(b);
                }
            })
            .expect("in memory");
            prop_assert!(twice.is_empty(), "visited twice: {:?}", twice);
            let want: BTreeMap<u64, (u64, usize)> =
                r.entries.iter().map(|(&b, &v)| (b, (v, r.frames[&b]))).collect();
            prop_assert_eq!(visited, want);
            // Single blocks take their own path.
            for b in b0..b0 + len {
                let one = resolve(&stack, b, b + 1, true, scan_mem(&layers)).expect("in memory");
                prop_assert_eq!(one.entries.get(&b).copied(), naive(&stack, &layers, b));
                prop_assert_eq!(one.frames.get(&b), r.frames.get(&b), "block {}", b);
                if one.entries.is_empty() {
                    // Closed (reads as zeros whatever lies below) only matters without an entry.
                    let closed = one.closed.first() == Some(&(b, b + 1));
                    let in_closed = r.closed.iter().any(|&(s, e)| s <= b && b < e);
                    prop_assert_eq!(closed, in_closed, "block {} closed", b);
                }
            }
        }
    }

    #[test]
    fn subtract_and_close_keep_ranges_sorted_and_disjoint() {
        let mut closed = Vec::new();
        close(&mut closed, 10, 20);
        close(&mut closed, 30, 40);
        close(&mut closed, 20, 25);
        assert_eq!(closed, vec![(10, 25), (30, 40)]);
        assert_eq!(subtract(&closed, 0, 50), vec![(0, 10), (25, 30), (40, 50)]);
        assert_eq!(subtract(&closed, 12, 24), vec![]);
        assert_eq!(subtract(&closed, 24, 31), vec![(25, 30)]);
    }
}
