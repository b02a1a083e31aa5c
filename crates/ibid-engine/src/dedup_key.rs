//! How the dedup index (`meta::FPS`) keys a chunk: the first 8 bytes of its fingerprint above
//! its chunk id, in one `u128`, so the chunks whose fingerprints share a prefix are adjacent.

/// The first 8 bytes of a fingerprint, as the dedup index and filter key it.
pub fn fp_prefix(fp: &[u8; 32]) -> u64 {
    u64::from_be_bytes(fp[..8].try_into().expect("8 bytes"))
}

/// The dedup index key of chunk `id`, whose fingerprint is `fp`.
pub fn fps_key(fp: &[u8; 32], id: u64) -> u128 {
    ((fp_prefix(fp) as u128) << 64) | id as u128
}

/// The chunk id of a dedup index key.
pub fn fps_key_chunk(key: u128) -> u64 {
    key as u64
}

/// The fingerprint prefix of a dedup index key.
pub fn fps_key_prefix(key: u128) -> u64 {
    (key >> 64) as u64
}

/// The dedup index keys of every chunk whose fingerprint starts like `fp`'s.
pub fn fps_range(fp: &[u8; 32]) -> std::ops::RangeInclusive<u128> {
    let high = (fp_prefix(fp) as u128) << 64;
    high..=high | u64::MAX as u128
}
