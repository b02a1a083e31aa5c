//! A lock-free Bloom filter over chunk fingerprints: the dedup index's RAM-resident part.
//!
//! The index itself (fingerprint → chunk) lives in the metadata store; this filter answers
//! "certainly absent" without touching it, so writing unique data costs no index read. It is
//! only a hint: a false positive costs one lookup, and a missing filter (`ready == false`, while
//! it is rebuilt after open) just means every lookup goes to the store. A filter that grows is
//! rebuilt beside the one it replaces, which answers for the older fingerprints until the new
//! one is complete, so growing never sends every lookup to the store.
//!
//! A Bloom filter cannot forget: the fingerprints of chunks that died stay in it. A pool whose
//! data is rewritten keeps its live chunk count while its filter fills with the dead, and the
//! false positives (each a lookup in the runs and the store) grew pass after pass — from ~1 %
//! to ~64 % of unique writes after eight rewrites of the same 2 GiB (BENCHMARKS.md, "The
//! dedup filter forgets nothing"). So a filter counts what it was given, and one given more
//! than it was sized for is rebuilt like one outgrown ([`Bloom::needs_rebuild`]). So is one
//! whose fingerprints are mostly of freed chunks after a large deletion: writing the deleted
//! data again (a volume restored after it was deleted, a VM image copied in again) found each
//! block "maybe present" and searched the runs and the store for it, a third of a restore's CPU
//! (BENCHMARKS.md, "A deletion leaves the filter full of the dead").

use parking_lot::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Bits per expected entry: ~1 % false positives with [`HASHES`] probes.
pub const BITS_PER_ENTRY: u64 = 10;
/// Number of probes per key.
pub const HASHES: u32 = 7;

/// How many times its capacity in fingerprints a filter is given before it is rebuilt
/// without those of the chunks freed since. A rebuild scans the whole index (~0.5 µs per live
/// chunk), a false positive costs a lookup in the runs and the store (~4.5 µs with 2 GiB of
/// live data). Rebuilt at 1×, a filter holding half its capacity in live fingerprints is
/// rescanned every half capacity of new chunks for false positives below 1 %; at 2× they reach
/// 14 % just before the rebuild (`(1 − e^(−7·2/10))^7`), average ~5 %, and the scans come a
/// third as often: the least total of the two by those costs.
pub const SATURATION: u64 = 2;

/// A filter holding more than this many fingerprints of freed chunks per live one (and at
/// least an eighth of its capacity of them) is rebuilt, if chunks were freed or added since it
/// was built: after a deletion of most of the pool's data, rewriting that data would otherwise
/// search the index for every block. (Rewrites in place reach it where they reach
/// [`SATURATION`] in a filter sized for 1.5 × the live chunks — 2 stale per live is 3 × live
/// inserted, twice its capacity — and sooner in one kept at its minimum size for fewer.)
pub const STALE_PER_LIVE: u64 = 2;

/// A fixed-size Bloom filter keyed by BLAKE3 fingerprints (already uniformly distributed).
pub struct Bloom {
    words: Vec<AtomicU64>,
    bits: u64,
    capacity: u64,
    /// Fingerprints inserted so far (live or since dead: the filter holds them all).
    inserted: AtomicU64,
    /// `inserted` when the filter was made ready: what its build put in (the index's keys,
    /// some of chunks already freed but not yet merged out of it).
    filled: AtomicU64,
    /// The pool's live chunks when the filter was made ready.
    live_at_build: AtomicU64,
    ready: AtomicBool,
    /// While not ready: the filter this one replaces, which holds every fingerprint inserted
    /// before this one was installed. Dropped when this one is ready.
    previous: RwLock<Option<Arc<Bloom>>>,
}

impl Bloom {
    /// A filter sized for `capacity` fingerprints.
    pub fn with_capacity(capacity: u64, ready: bool) -> Self {
        let capacity = capacity.max(1 << 16);
        let bits = (capacity * BITS_PER_ENTRY).next_multiple_of(64);
        let words = (0..bits / 64).map(|_| AtomicU64::new(0)).collect();
        Bloom {
            words,
            bits,
            capacity,
            inserted: AtomicU64::new(0),
            filled: AtomicU64::new(0),
            live_at_build: AtomicU64::new(0),
            ready: AtomicBool::new(ready),
            previous: RwLock::new(None),
        }
    }

    /// An empty filter sized for `capacity` fingerprints, to be filled in the background while
    /// `previous` (the filter it replaces) answers for the fingerprints inserted before it.
    pub fn growing_from(capacity: u64, previous: Arc<Bloom>) -> Self {
        let bloom = Bloom::with_capacity(capacity, false);
        *bloom.previous.write() = Some(previous);
        bloom
    }

    /// The number of fingerprints the filter was sized for.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Fingerprints inserted into this filter so far (each insert counts, repeats too).
    pub fn inserted(&self) -> u64 {
        self.inserted.load(Ordering::Relaxed)
    }

    /// Whether the filter should be rebuilt: the pool holds more chunks than it was sized for;
    /// or it was given more than [`SATURATION`] times that many fingerprints (most of them of
    /// chunks since dead) and a quarter of its capacity since it was built; or it holds more
    /// than [`STALE_PER_LIVE`] fingerprints of freed chunks per live chunk, at least an eighth
    /// of its capacity, and an eighth of its capacity of chunks were added or freed since it was
    /// built. (A rebuild puts in the live fingerprints only, at most 2/3 of its capacity, and
    /// the writes meanwhile; a filter that came out fuller all the same must not ask for the
    /// same rebuild at every wake-up.)
    pub fn needs_rebuild(&self, live_chunks: u64) -> bool {
        let inserted = self.inserted();
        let since_built = inserted.saturating_sub(self.filled.load(Ordering::Relaxed));
        // Every live chunk's fingerprint is in the filter at least once.
        let stale = inserted.saturating_sub(live_chunks);
        let freed_since_built = self
            .live_at_build
            .load(Ordering::Relaxed)
            .saturating_sub(live_chunks);
        let eighth = self.capacity / 8;
        live_chunks > self.capacity
            || (inserted > SATURATION * self.capacity && since_built > self.capacity / 4)
            || (stale > STALE_PER_LIVE * live_chunks
                && stale > eighth
                && (since_built > eighth || freed_since_built > eighth))
    }

    /// Bytes of RAM the filter uses.
    pub fn ram_bytes(&self) -> u64 {
        self.bits / 8
    }

    /// Marks the filter complete, built when the pool had `live_chunks`: from now on
    /// `may_contain == false` is trusted, and the filter it replaces is released.
    pub fn set_ready(&self, live_chunks: u64) {
        self.filled.store(self.inserted(), Ordering::Relaxed);
        self.live_at_build.store(live_chunks, Ordering::Relaxed);
        self.ready.store(true, Ordering::Release);
        self.previous.write().take();
    }

    fn probes(&self, prefix: u64) -> impl Iterator<Item = u64> + '_ {
        // The prefix is uniformly random (a BLAKE3 output); the second hash is a bijective
        // mix of it (splitmix64's finalizer), made odd.
        let h1 = prefix;
        let mut h2 = prefix ^ (prefix >> 30);
        h2 = h2.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h2 ^= h2 >> 27;
        h2 = h2.wrapping_mul(0x94d0_49bb_1331_11eb);
        h2 = (h2 ^ (h2 >> 31)) | 1;
        let bits = self.bits as u128;
        // Multiply-shift maps a 64-bit hash onto [0, bits) without a power-of-two size.
        (0..HASHES as u64)
            .map(move |i| ((h1.wrapping_add(i.wrapping_mul(h2)) as u128 * bits) >> 64) as u64)
    }

    /// Adds a fingerprint, given by its prefix ([`crate::meta::fp_prefix`]).
    pub fn insert(&self, prefix: u64) {
        self.inserted.fetch_add(1, Ordering::Relaxed);
        for bit in self.probes(prefix) {
            self.words[(bit / 64) as usize].fetch_or(1 << (bit % 64), Ordering::Relaxed);
        }
    }

    /// False only if the fingerprint was certainly never inserted: in this filter once it is
    /// ready; before, in neither this filter nor the one it replaces (if it has one).
    pub fn may_contain(&self, prefix: u64) -> bool {
        if !self.ready.load(Ordering::Acquire) {
            return match &*self.previous.read() {
                Some(previous) => previous.may_contain(prefix) || self.holds(prefix),
                // Ready meanwhile (`set_ready` sets the flag before dropping `previous`).
                None if self.ready.load(Ordering::Acquire) => self.holds(prefix),
                None => true,
            };
        }
        self.holds(prefix)
    }

    /// Whether every bit of `prefix` is set in this filter.
    fn holds(&self, prefix: u64) -> bool {
        self.probes(prefix).all(|bit| {
            self.words[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserted_keys_are_found_and_most_others_are_not() {
        let b = Bloom::with_capacity(100_000, true);
        let fp = |i: u64| crate::meta::fp_prefix(blake3::hash(&i.to_le_bytes()).as_bytes());
        for i in 0..100_000 {
            b.insert(fp(i));
        }
        assert!((0..100_000).all(|i| b.may_contain(fp(i))));
        let false_positives = (100_000..200_000).filter(|&i| b.may_contain(fp(i))).count();
        assert!(
            false_positives < 2_000,
            "{false_positives} false positives in 100k"
        );
    }

    /// A filter given more fingerprints than it was sized for asks to be rebuilt even while
    /// the pool's live chunks fit it: the dead ones it still holds raise its false positives.
    #[test]
    fn a_filter_given_more_than_its_capacity_asks_for_a_rebuild() {
        let fp = |i: u64| crate::meta::fp_prefix(blake3::hash(&i.to_le_bytes()).as_bytes());
        let b = Bloom::with_capacity(100_000, true);
        // Enough live chunks that the stale fingerprints stay within two per live one.
        let live = 70_000;
        for i in 0..100_000 {
            b.insert(fp(i));
        }
        assert_eq!(b.inserted(), 100_000);
        assert!(!b.needs_rebuild(live));
        assert!(b.needs_rebuild(100_001), "outgrown by live chunks");
        // Rewrites: new fingerprints, the live count unchanged.
        for i in 100_000..200_000 {
            b.insert(fp(i));
        }
        assert!(!b.needs_rebuild(live));
        b.insert(fp(200_000));
        assert!(b.needs_rebuild(live));
        let false_positives = (1_000_000..1_100_000)
            .filter(|&i| b.may_contain(fp(i)))
            .count();
        assert!(
            false_positives > 5_000,
            "twice the capacity in: {false_positives} false positives in 100k (~14 % expected)"
        );
    }

    /// A filter that came out of its build holding more than twice its capacity asks for a
    /// rebuild only once it has been given a quarter of its capacity since, not at once (each
    /// rebuild would find the same).
    #[test]
    fn a_filter_built_over_its_saturation_waits_for_new_fingerprints() {
        let fp = |i: u64| crate::meta::fp_prefix(blake3::hash(&i.to_le_bytes()).as_bytes());
        let b = Bloom::growing_from(100_000, Arc::new(Bloom::with_capacity(1, true)));
        for i in 0..250_000 {
            b.insert(fp(i));
        }
        b.set_ready(100_000);
        assert!(!b.needs_rebuild(100_000));
        for i in 250_000..275_000 {
            b.insert(fp(i));
        }
        assert!(!b.needs_rebuild(100_000));
        b.insert(fp(275_000));
        assert!(b.needs_rebuild(100_000));
    }

    /// A filter whose fingerprints are mostly of chunks freed since it was built asks for a
    /// rebuild (the pool deleted most of its data); one built with fewer live chunks than it
    /// holds, and given nothing since, does not ask again.
    #[test]
    fn a_filter_left_mostly_dead_by_a_deletion_asks_for_a_rebuild() {
        let fp = |i: u64| crate::meta::fp_prefix(blake3::hash(&i.to_le_bytes()).as_bytes());
        let b = Bloom::with_capacity(1_000_000, true);
        for i in 0..300_000 {
            b.insert(fp(i));
        }
        assert!(!b.needs_rebuild(300_000), "all live");
        assert!(!b.needs_rebuild(150_000), "half deleted");
        assert!(!b.needs_rebuild(100_001), "two stale per live");
        assert!(b.needs_rebuild(99_999), "over two stale per live");
        assert!(b.needs_rebuild(0), "all deleted");
        let small = Bloom::with_capacity(1_000_000, true);
        for i in 0..100_000 {
            small.insert(fp(i));
        }
        assert!(
            !small.needs_rebuild(0),
            "an eighth of the capacity at least"
        );

        // Built (ready) holding 300,000 with 10,000 live: only what changes after counts.
        let built = Bloom::growing_from(1_000_000, Arc::new(Bloom::with_capacity(1, true)));
        for i in 0..300_000 {
            built.insert(fp(i));
        }
        built.set_ready(10_000);
        assert!(!built.needs_rebuild(10_000));
        for i in 300_000..425_001 {
            built.insert(fp(i));
        }
        assert!(built.needs_rebuild(10_000), "added since the build");
        let deleted = Bloom::growing_from(1_000_000, Arc::new(Bloom::with_capacity(1, true)));
        for i in 0..300_000 {
            deleted.insert(fp(i));
        }
        deleted.set_ready(200_000);
        assert!(
            !deleted.needs_rebuild(80_000),
            "fewer than an eighth of the capacity freed since the build"
        );
        assert!(deleted.needs_rebuild(70_000), "freed since the build");
    }

    /// A growing filter answers from the one it replaces until it is ready, then from itself
    /// alone: no fingerprint inserted in either is ever reported absent, and unknown ones are
    /// (not "maybe", as a filter under construction without a predecessor must answer).
    #[test]
    fn a_growing_filter_answers_from_its_predecessor_until_ready() {
        let fp = |i: u64| crate::meta::fp_prefix(blake3::hash(&i.to_le_bytes()).as_bytes());
        let old = Arc::new(Bloom::with_capacity(1_000, true));
        for i in 0..1_000 {
            old.insert(fp(i));
        }
        let new = Bloom::growing_from(10_000, old.clone());
        for i in 1_000..2_000 {
            new.insert(fp(i));
        }
        assert!((0..2_000).all(|i| new.may_contain(fp(i))));
        let unknown = (2_000..12_000).filter(|&i| new.may_contain(fp(i))).count();
        assert!(unknown < 1_000, "{unknown} of 10k unknown reported present");
        // The rebuild's scan fills in the older fingerprints, then the filter is ready and
        // lets its predecessor go.
        for i in 0..1_000 {
            new.insert(fp(i));
        }
        new.set_ready(2_000);
        assert_eq!(Arc::strong_count(&old), 1);
        assert!((0..2_000).all(|i| new.may_contain(fp(i))));
        let unknown = (2_000..12_000).filter(|&i| new.may_contain(fp(i))).count();
        assert!(unknown < 300, "{unknown} of 10k unknown reported present");
        let fresh = Bloom::with_capacity(10_000, false);
        assert!(fresh.may_contain(fp(5_000)));
    }
}
