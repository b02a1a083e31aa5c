//! A lock-free Bloom filter over chunk fingerprints: the dedup index's RAM-resident part.
//!
//! The index itself (fingerprint → chunk) lives in the metadata store; this filter answers
//! "certainly absent" without touching it, so writing unique data costs no index read. It is
//! only a hint: a false positive costs one lookup, and a missing filter (`ready == false`, while
//! it is rebuilt after open) just means every lookup goes to the store.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bits per expected entry: ~1 % false positives with [`HASHES`] probes.
pub const BITS_PER_ENTRY: u64 = 10;
/// Number of probes per key.
pub const HASHES: u32 = 7;

/// A fixed-size Bloom filter keyed by BLAKE3 fingerprints (already uniformly distributed).
pub struct Bloom {
    words: Vec<AtomicU64>,
    bits: u64,
    capacity: u64,
    ready: AtomicBool,
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
            ready: AtomicBool::new(ready),
        }
    }

    /// The number of fingerprints the filter was sized for.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of RAM the filter uses.
    pub fn ram_bytes(&self) -> u64 {
        self.bits / 8
    }

    /// Marks the filter complete: from now on `may_contain == false` is trusted.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    fn probes(&self, fp: &[u8; 32]) -> impl Iterator<Item = u64> + '_ {
        let h1 = u64::from_le_bytes(fp[0..8].try_into().expect("8 bytes"));
        let h2 = u64::from_le_bytes(fp[8..16].try_into().expect("8 bytes")) | 1;
        let bits = self.bits as u128;
        // Multiply-shift maps a 64-bit hash onto [0, bits) without a power-of-two size.
        (0..HASHES as u64)
            .map(move |i| ((h1.wrapping_add(i.wrapping_mul(h2)) as u128 * bits) >> 64) as u64)
    }

    /// Adds a fingerprint.
    pub fn insert(&self, fp: &[u8; 32]) {
        for bit in self.probes(fp) {
            self.words[(bit / 64) as usize].fetch_or(1 << (bit % 64), Ordering::Relaxed);
        }
    }

    /// False only if the fingerprint was certainly never inserted (and the filter is ready).
    pub fn may_contain(&self, fp: &[u8; 32]) -> bool {
        if !self.ready.load(Ordering::Acquire) {
            return true;
        }
        self.probes(fp).all(|bit| {
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
        let fp = |i: u64| *blake3::hash(&i.to_le_bytes()).as_bytes();
        for i in 0..100_000 {
            b.insert(&fp(i));
        }
        assert!((0..100_000).all(|i| b.may_contain(&fp(i))));
        let false_positives = (100_000..200_000)
            .filter(|&i| b.may_contain(&fp(i)))
            .count();
        assert!(
            false_positives < 2_000,
            "{false_positives} false positives in 100k"
        );
    }
}
