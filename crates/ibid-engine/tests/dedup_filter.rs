//! The dedup filter grows with the pool: rebuilt larger on the filter thread when the pool
//! outgrows it, within its RAM bound, and with every stored fingerprint in it (a block the
//! grown filter forgot would be stored again instead of deduplicated).

mod common;

use common::random_block;
use ibid_engine::{Pool, PoolConfig};
use std::time::{Duration, Instant};

const BLOCK: u64 = 4096;
/// The filter's smallest size here (the default is larger, to keep the test short).
const FILTER_MIN: u64 = 64 * 1024;
/// Past [`FILTER_MIN`], so the pool must outgrow it.
const BLOCKS: u64 = 96 * 1024;

/// Writes blocks `0..BLOCKS` (each `random_block(seed)`) to `vol` with 1 MiB writes.
fn write_all(vol: &ibid_engine::Volume) {
    let per = 256;
    let mut buf = Vec::with_capacity((per * BLOCK) as usize);
    for first in (0..BLOCKS).step_by(per as usize) {
        buf.clear();
        for b in first..first + per {
            buf.extend_from_slice(&random_block(b));
        }
        vol.write(first * BLOCK, &buf, false).expect("write");
    }
}

#[test]
fn the_filter_grows_in_the_background_and_keeps_every_fingerprint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = PoolConfig {
        capacity_bytes: Some(4 << 30),
        background_interval_ms: 50,
        dedup_filter_min: FILTER_MIN,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("pool"), config).expect("create");
    pool.wait_filters_built();
    assert_eq!(
        pool.stats().dedup_filter_ram_bytes,
        FILTER_MIN * 10 / 8,
        "an empty pool's filter is sized for the configured minimum"
    );
    let first_ram = pool.stats().dedup_filter_ram_bytes;
    let a = pool.create_volume("a", BLOCKS * BLOCK).expect("volume a");
    write_all(&a);
    pool.sync().expect("sync");
    assert_eq!(pool.stats().unique_chunks, BLOCKS);

    // The background thread notices the pool outgrew the filter and starts a larger one.
    let t0 = Instant::now();
    while pool.stats().dedup_filter_ram_bytes == first_ram {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the dedup filter did not grow past {first_ram} bytes with {BLOCKS} chunks stored"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    pool.wait_filters_built();
    let ram = pool.stats().dedup_filter_ram_bytes;
    // Sized for 1.5 × the chunks stored at 10 bits each (some chunks may have been stored
    // after the size was chosen; none here, the writes are over).
    let bound = BLOCKS * 3 / 2 * 10 / 8 + 8;
    assert!(
        ram * 8 >= BLOCKS * 10 && ram <= bound,
        "filter of {ram} B for {BLOCKS} chunks (expected between 1.25 and 1.875 B per chunk)"
    );

    // Every block written again, to another volume: all found, none stored twice.
    let b = pool.create_volume("b", BLOCKS * BLOCK).expect("volume b");
    write_all(&b);
    pool.sync().expect("sync");
    let st = pool.stats();
    assert_eq!(
        st.unique_chunks, BLOCKS,
        "blocks stored twice after the filter grew"
    );
    let mut got = vec![0u8; BLOCK as usize];
    for blk in [0, BLOCKS / 2, BLOCKS - 1] {
        b.read(blk * BLOCK, &mut got).expect("read");
        assert_eq!(got, random_block(blk), "block {blk} of volume b");
    }
    pool.close().expect("close");
}
