//! Block contents for the crate's unit tests.

use crate::format::BLOCK_BYTES;

/// A block of xorshift noise: incompressible, and different for every `seed` (so never
/// deduplicated against another seed's block).
pub(crate) fn noise_block(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..BLOCK_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A xorshift generator of u64 from `seed` (not 0), for tests' random operation sequences.
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
