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

/// A pool under `dir` whose filter starts at [`FILTER_MIN`] and whose background runs every
/// 50 ms.
fn create_pool(dir: &std::path::Path) -> Pool {
    let config = PoolConfig {
        capacity_bytes: Some(4 << 30),
        background_interval_ms: 50,
        commit_interval_ms: 50,
        dedup_filter_min: FILTER_MIN,
        ..PoolConfig::default()
    };
    Pool::create(dir.join("pool"), config).expect("create")
}

/// Writes blocks `0..blocks` of `vol`, block `b` as `random_block(seed + b)`, with 1 MiB
/// writes.
fn write_blocks(vol: &ibid_engine::Volume, blocks: u64, seed: u64) {
    let per = 256;
    let mut buf = Vec::with_capacity((per * BLOCK) as usize);
    for first in (0..blocks).step_by(per as usize) {
        buf.clear();
        for b in first..first + per {
            buf.extend_from_slice(&random_block(seed + b));
        }
        vol.write(first * BLOCK, &buf, false).expect("write");
    }
}

/// Writes blocks `0..BLOCKS` of `vol`, block `b` as `random_block(b)`.
fn write_all(vol: &ibid_engine::Volume) {
    write_blocks(vol, BLOCKS, 0);
}

#[test]
fn the_filter_grows_in_the_background_and_keeps_every_fingerprint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = create_pool(dir.path());
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

/// Blocks of the volume the rewrite test rewrites: fewer than the filter's minimum, so the
/// pool never outgrows it and only the fingerprints of freed chunks can fill it.
const REWRITTEN: u64 = 48 * 1024;

/// Writes blocks `0..REWRITTEN` of `vol`, block `b` as `random_block(pass * REWRITTEN + b)`
/// (new data every pass).
fn write_pass(vol: &ibid_engine::Volume, pass: u64) {
    write_blocks(vol, REWRITTEN, pass * REWRITTEN);
}

/// Waits until `done(stats)` holds, or fails with `what` after a minute.
fn wait_for(pool: &Pool, what: &str, done: impl Fn(&ibid_engine::PoolStats) -> bool) {
    let t0 = Instant::now();
    loop {
        let st = pool.stats();
        if done(&st) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {st:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Rewrites keep the live chunk count while every new chunk's fingerprint goes into the
/// filter, which cannot drop those of the chunks freed: once it holds more than twice what it
/// was sized for it is rebuilt from the index, without them. (Before, a filter was rebuilt only
/// when the live chunks outgrew it: after eight rewrites of the same 2 GiB most unique writes
/// looked in the index for nothing.) The rebuilt filter still holds every live fingerprint:
/// writing the live data again stores nothing new.
#[test]
fn rewrites_get_the_filter_rebuilt_without_the_freed_fingerprints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = create_pool(dir.path());
    pool.wait_filters_built();
    assert_eq!(pool.stats().dedup_filter_capacity, FILTER_MIN);
    let a = pool
        .create_volume("a", REWRITTEN * BLOCK)
        .expect("volume a");
    // Chunks are freed lazily (the reference log), so the live count first grows past the
    // minimum and the filter is rebuilt larger once; after that only the fingerprints of
    // freed chunks fill it. Fourteen passes put ~14 × 48 Ki into it, past twice any capacity it
    // takes here (1.5 × the chunks not yet freed, about two passes' worth at once: capacities
    // of 126–155 Ki seen).
    let passes = 14;
    let mut capacity = 0;
    for pass in 0..passes {
        write_pass(&a, pass);
        pool.sync().expect("sync");
        capacity = capacity.max(pool.stats().dedup_filter_capacity);
        wait_for(&pool, "fingerprints within twice the capacity", |st| {
            st.dedup_filter_fingerprints <= 2 * st.dedup_filter_capacity
        });
    }
    eprintln!("largest filter capacity: {capacity}");
    // The passes put more into the filter than twice any capacity it had (a few repeats of
    // the random blocks aside): only rebuilds for the freed fingerprints kept it under.
    assert!(
        2 * capacity < passes * REWRITTEN * 9 / 10,
        "a filter for {capacity} fingerprints never needed a rebuild for freed ones"
    );
    pool.wait_filters_built();
    wait_for(&pool, "freed chunks", |st| st.unique_chunks == REWRITTEN);

    // The last pass's data written again to another volume: every block found, none stored.
    let b = pool
        .create_volume("b", REWRITTEN * BLOCK)
        .expect("volume b");
    write_pass(&b, passes - 1);
    pool.sync().expect("sync");
    assert_eq!(
        pool.stats().unique_chunks,
        REWRITTEN,
        "blocks stored twice after the filter was rebuilt"
    );
    let mut got = vec![0u8; BLOCK as usize];
    for blk in [0, REWRITTEN / 2, REWRITTEN - 1] {
        b.read(blk * BLOCK, &mut got).expect("read");
        assert_eq!(
            got,
            random_block((passes - 1) * REWRITTEN + blk),
            "block {blk}"
        );
    }
    pool.close().expect("close");
}

/// Deleting most of the pool's data leaves the filter holding fingerprints of freed chunks
/// only; it is rebuilt without them, so that writing the same data again (a volume restored
/// after it was deleted) does not search the index for every block. The data written again is
/// stored and reads back.
#[test]
fn a_deletion_gets_the_filter_rebuilt_without_the_freed_fingerprints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = create_pool(dir.path());
    pool.wait_filters_built();
    let a = pool
        .create_volume("a", REWRITTEN * BLOCK)
        .expect("volume a");
    write_pass(&a, 0);
    pool.sync().expect("sync");
    assert!(pool.stats().dedup_filter_fingerprints >= REWRITTEN);
    drop(a);
    pool.delete_volume("a").expect("delete a");
    wait_for(&pool, "freed chunks", |st| st.unique_chunks == 0);
    wait_for(&pool, "a filter without the freed fingerprints", |st| {
        st.dedup_filter_fingerprints < REWRITTEN / 8
    });
    pool.wait_filters_built();

    let b = pool
        .create_volume("b", REWRITTEN * BLOCK)
        .expect("volume b");
    write_pass(&b, 0);
    pool.sync().expect("sync");
    assert_eq!(pool.stats().unique_chunks, REWRITTEN);
    let mut got = vec![0u8; BLOCK as usize];
    for blk in [0, REWRITTEN / 2, REWRITTEN - 1] {
        b.read(blk * BLOCK, &mut got).expect("read");
        assert_eq!(got, random_block(blk), "block {blk}");
    }
    pool.close().expect("close");
}
