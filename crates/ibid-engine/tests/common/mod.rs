//! Helpers shared by the engine's integration tests.

#![allow(dead_code)]

use ibid_engine::PoolConfig;

/// 4 KiB of incompressible pseudo-random bytes, different for each seed.
pub fn random_block(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A pool of `capacity` bytes with no background thread and small segments, stepped by hand.
pub fn quiet_config(capacity: u64) -> PoolConfig {
    PoolConfig {
        capacity_bytes: Some(capacity),
        // Tests model pools of any capacity, whatever the filesystem under them holds.
        capacity_force: true,
        background: false,
        segment_bytes_max: 1 << 20,
        // Most commits write their dedup index keys as a run; past a few keys held, or at
        // the fifth run, they merge the oldest slices (of 4), so tests exercise every place a
        // key can be.
        dedup_run_keys_min: 2,
        dedup_runs_max: 5,
        dedup_merge_slices: 4,
        dedup_run_keys_target: 8,
        ..PoolConfig::default()
    }
}

/// The version field of the stored pool record (its first little-endian u64), read without
/// decoding the record, which refuses unknown versions.
pub fn stored_version(dir: &std::path::Path) -> u64 {
    use ibid_engine::store::Reader;
    let store = ibid_engine::store::Store::open(dir).expect("store");
    let raw = store
        .read()
        .expect("read")
        .get(ibid_engine::meta::POOL, ibid_engine::meta::POOL_KEY)
        .expect("get")
        .expect("pool record");
    u64::from_le_bytes(raw[..8].try_into().expect("8 bytes"))
}
