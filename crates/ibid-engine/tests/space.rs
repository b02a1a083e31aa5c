//! Space behaviour: running out of space is graceful and reversible, deleted and overwritten
//! data comes back through the cleaner, zeroing is a metadata operation at any size, and
//! concurrent writers lose no update.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{Error, ExtentKind, Pool, PoolConfig};
use std::sync::Arc;

/// A pool whose capacity leaves `room` bytes beyond its empty metadata, and its directory.
fn pool_with_room(room: u64) -> (tempfile::TempDir, Pool) {
    let probe = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(probe.path().join("p"), quiet_config(u64::MAX)).expect("create");
    let meta = pool.stats().metadata_bytes;
    drop(pool);
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(meta + room)).expect("create");
    (dir, pool)
}

/// A full pool fails only the writes that need new space; data stays readable; freeing space
/// makes writes work again without a restart.
#[test]
fn full_pool_fails_new_data_only_and_recovers_after_delete() {
    let (_dir, pool) = pool_with_room(8 << 20);
    let a = pool.create_volume("a", 1 << 30).expect("a");
    let b = pool.create_volume("b", 1 << 30).expect("b");
    b.write(0, &random_block(999_999), false)
        .expect("b's first block");
    let mut written = 0u64;
    let err = loop {
        match a.write(written * 4096, &random_block(written), false) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        assert!(written < 10_000, "the pool never filled");
    };
    assert!(matches!(err, Error::NoSpace), "got {err:?}");
    assert!(written > 1000, "only {written} blocks fit in 8 MiB");
    // Existing data on both volumes reads back.
    let mut buf = vec![0u8; 4096];
    for i in (0..written).step_by(97) {
        a.read(i * 4096, &mut buf).expect("read when full");
        assert_eq!(buf, random_block(i));
    }
    b.read(0, &mut buf).expect("read b when full");
    assert_eq!(buf, random_block(999_999));
    // Writes that need no new space still work: zeros, and data already stored.
    b.write(4096, &vec![0u8; 4096], false)
        .expect("zero write when full");
    b.write(8192, &random_block(3), false)
        .expect("duplicate write when full");
    pool.sync().expect("sync");
    assert!(pool.stats().soft_threshold_exceeded);
    // Free space by deleting, and writes work again.
    drop(a);
    pool.delete_volume("a").expect("delete");
    pool.gc_now().expect("gc");
    let s = pool.stats();
    assert!(
        s.free_bytes > 7 << 20,
        "free after delete: {}",
        s.free_bytes
    );
    assert!(!s.soft_threshold_exceeded);
    b.write(1 << 20, &random_block(123_456), true)
        .expect("write after freeing space");
    pool.verify().expect("verify");
}

/// Overwritten and zeroed data is released: the cleaner shrinks segment files back.
#[test]
fn overwrite_and_zero_release_physical_space() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(1 << 30)).expect("create");
    let v = pool.create_volume("v", 64 << 20).expect("v");
    for round in 0..3u64 {
        for i in 0..1024 {
            v.write(i * 4096, &random_block(round * 10_000 + i), false)
                .expect("write");
        }
        pool.sync().expect("sync");
    }
    pool.gc_now().expect("gc");
    let s = pool.stats();
    assert_eq!(s.unique_chunks, 1024);
    assert!(
        s.segment_file_bytes < 1024 * 4200 + (2 << 20),
        "segments hold {} bytes",
        s.segment_file_bytes
    );
    v.write_zeroes(0, 64 << 20, false).expect("zero all");
    pool.gc_now().expect("gc");
    let s = pool.stats();
    assert_eq!(
        (s.unique_chunks, s.physical_bytes, s.logical_written_bytes),
        (0, 0, 0)
    );
    assert!(
        s.segment_file_bytes < 2 << 20,
        "segments hold {} bytes after zeroing",
        s.segment_file_bytes
    );
    pool.verify().expect("verify");
}

/// Blocks of the volume [`garbage_pool`] fills.
const GARBAGE_BLOCKS: u64 = 4096;

/// A pool of `capacity` bytes whose background thread wakes every 5 ms, and a volume of
/// [`GARBAGE_BLOCKS`] blocks, written, then three blocks in four overwritten: every
/// first-pass segment is a quarter live, which the cleaner relocates (a segment with nothing
/// live is dropped by the commit itself). Returns them and the garbage that leaves.
fn garbage_pool(dir: &std::path::Path, capacity: u64) -> (Pool, ibid_engine::Volume, u64) {
    let config = PoolConfig {
        background: true,
        background_interval_ms: 5,
        commit_interval_ms: 5,
        segment_bytes_max: 256 << 10,
        ..quiet_config(capacity)
    };
    let pool = Pool::create(dir.join("p"), config).expect("create");
    let v = pool.create_volume("v", GARBAGE_BLOCKS * 4096).expect("v");
    for i in 0..GARBAGE_BLOCKS {
        v.write(i * 4096, &random_block(i), false).expect("write");
    }
    for i in (0..GARBAGE_BLOCKS).filter(|i| i % 4 != 0) {
        v.write(i * 4096, &random_block(1 << 32 | i), false)
            .expect("overwrite");
    }
    v.flush().expect("flush");
    pool.sync().expect("sync");
    let garbage = pool.stats().garbage_bytes;
    (pool, v, garbage)
}

/// Waits up to 20 s for the garbage to fall under `below`, doing `io` meanwhile.
fn garbage_falls_under(pool: &Pool, below: u64, mut io: impl FnMut()) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(20) {
        if pool.stats().garbage_bytes < below {
            return true;
        }
        io();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    false
}

/// The background cleaner yields to foreground I/O (a cleaning pass takes device time from
/// reads and writes, and its fsync delays flushes): while reads run, or flushes, it waits;
/// once they stop it cleans, so overwritten space still comes back without `gc_now`.
#[test]
fn background_cleaner_yields_to_io() {
    const BLOCKS: u64 = GARBAGE_BLOCKS;
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, v, before) = garbage_pool(dir.path(), 1 << 30);
    assert!(before > 8 << 20, "garbage after overwriting: {before}");
    let mut buf = vec![0u8; 4096];
    let t0 = std::time::Instant::now();
    let mut i = 0;
    while t0.elapsed() < std::time::Duration::from_millis(500) {
        v.read(i % BLOCKS * 4096, &mut buf).expect("read");
        i += 1;
    }
    while t0.elapsed() < std::time::Duration::from_millis(1000) {
        v.flush().expect("flush");
    }
    let during = pool.stats().garbage_bytes;
    assert!(
        during > before / 2,
        "the cleaner ran while reads and flushes did: garbage {before} -> {during}"
    );
    assert!(
        garbage_falls_under(&pool, before / 4, || {}),
        "the cleaner did not run after the I/O stopped: garbage {before} -> {}",
        pool.stats().garbage_bytes
    );
    let mut buf = vec![0u8; 4096];
    for i in (0..BLOCKS).step_by(61) {
        v.read(i * 4096, &mut buf).expect("read");
        let expect = if i % 4 == 0 { i } else { 1 << 32 | i };
        assert!(buf == random_block(expect)[..], "block {i} read wrong");
    }
    pool.verify().expect("verify");
}

/// Once garbage reaches a quarter of the pool's free space, the cleaner runs however busy
/// the pool is: garbage is not counted as used space, and it occupies the filesystem below.
#[test]
fn background_cleaner_runs_under_load_once_garbage_is_large() {
    const BLOCKS: u64 = GARBAGE_BLOCKS;
    let dir = tempfile::tempdir().expect("tempdir");
    // 16 MiB written, 12 MiB of it overwritten: more garbage than a quarter of what is free.
    let (pool, v, before) = garbage_pool(dir.path(), 56 << 20);
    let free = pool.stats().free_bytes;
    assert!(
        before > free / 4 && before > 8 << 20,
        "garbage {before} of free {free}"
    );
    let mut buf = vec![0u8; 4096];
    let mut i = 0;
    // It cleans until garbage is back under the limit, then yields again.
    assert!(
        garbage_falls_under(&pool, free / 4 + 1, || {
            for _ in 0..64 {
                v.read(i % BLOCKS * 4096, &mut buf).expect("read");
                i += 1;
            }
            v.flush().expect("flush");
        }),
        "the cleaner did not run under load: garbage {before} -> {} (free {free})",
        pool.stats().garbage_bytes
    );
}

/// Zeroing and block status cost per mapped extent, not per byte: a 1 PiB volume.
#[test]
fn petabyte_volume_zero_and_block_status_are_metadata_operations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(1 << 30)).expect("create");
    let size = 1u64 << 50;
    let v = pool.create_volume("huge", size).expect("1 PiB volume");
    assert!(matches!(
        pool.create_volume("bigger", size + 512),
        Err(Error::InvalidArgument(_))
    ));
    v.write(size - 4096, &random_block(1), false)
        .expect("write at the end");
    v.write(1 << 40, &random_block(2), false)
        .expect("write at 1 TiB");
    let t = std::time::Instant::now();
    let extents = v.block_status(0, size).expect("status");
    assert_eq!(
        extents
            .iter()
            .filter(|e| e.kind == ExtentKind::Data)
            .count(),
        2
    );
    assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), size);
    v.write_zeroes(0, size, false).expect("zero 1 PiB");
    assert_eq!(v.block_status(0, size).expect("status").len(), 1);
    assert!(
        t.elapsed().as_secs() < 5,
        "zeroing 1 PiB took {:?}",
        t.elapsed()
    );
    let mut buf = vec![1u8; 4096];
    v.read(size - 4096, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0));
}

/// Bad arguments are refused precisely and change nothing.
#[test]
fn bad_arguments_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(1 << 30)).expect("create");
    let v = pool.create_volume("v", 1 << 20).expect("v");
    let mut buf = vec![0u8; 512];
    assert!(matches!(
        v.read(100, &mut buf),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        v.read(1 << 20, &mut buf),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        v.write(u64::MAX - 511, &buf, false),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        pool.create_volume("v", 1 << 20),
        Err(Error::AlreadyExists(_))
    ));
    assert!(matches!(
        pool.create_volume("bad/name", 1 << 20),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        pool.create_volume("odd", 1000),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(pool.volume("missing"), Err(Error::NotFound(_))));
    assert!(matches!(
        pool.delete_volume("missing"),
        Err(Error::NotFound(_))
    ));
    assert!(
        Pool::create(dir.path().join("p"), quiet_config(1 << 30)).is_err(),
        "a second pool in the same place"
    );
    assert_eq!(pool.stats().logical_written_bytes, 0);
}

/// A 1 GiB pool whose background thread commits every 5 ms, for tests of concurrent writers.
fn busy_pool(dir: &std::path::Path) -> Arc<Pool> {
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        background_interval_ms: 5,
        commit_interval_ms: 5,
        ..PoolConfig::default()
    };
    Arc::new(Pool::create(dir.join("p"), config).expect("create"))
}

/// Many threads on one volume and on several: sectors of one block written concurrently by
/// different threads (read-modify-write) never lose each other's updates.
#[test]
fn concurrent_writers_lose_no_update() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = busy_pool(dir.path());
    pool.create_volume("shared", 16 << 20).expect("shared");
    pool.create_volume("other", 16 << 20).expect("other");
    const THREADS: u64 = 8;
    const ROUNDS: u64 = 300;
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let shared = pool.volume("shared").expect("shared");
                let other = pool.volume("other").expect("other");
                for r in 0..ROUNDS {
                    // Sector t of block 0: a partial-block write racing the other threads'.
                    shared
                        .write(t * 512, &[(r % 251) as u8 + 1; 512], false)
                        .expect("sector");
                    // A whole block of its own, and a block on another volume.
                    shared
                        .write((1 + t) * 4096, &random_block(t * 1000 + r), false)
                        .expect("block");
                    other
                        .write(t * 4096 * 16, &random_block(t * 7777 + r), r % 50 == 0)
                        .expect("other");
                    if r % 64 == 0 {
                        shared.flush().expect("flush");
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer thread");
    }
    let shared = pool.volume("shared").expect("shared");
    let mut block = vec![0u8; 4096];
    shared.read(0, &mut block).expect("read");
    for t in 0..THREADS as usize {
        assert!(
            block[t * 512..(t + 1) * 512]
                .iter()
                .all(|&b| b == ((ROUNDS - 1) % 251) as u8 + 1),
            "sector {t} lost an update"
        );
    }
    for t in 0..THREADS {
        shared.read((1 + t) * 4096, &mut block).expect("read");
        assert_eq!(block, random_block(t * 1000 + ROUNDS - 1));
    }
    pool.sync().expect("sync");
    pool.verify().expect("verify");
}

/// Threads writing the same new data at the same moment (one volume each) store each block
/// once: the first to store it appends it, the others wait for it to be placed and refer to
/// it. Writes of 16 blocks prepare on the writer's thread, writes of 128 spread over the
/// helper threads; every block reads back and the pool verifies.
#[test]
fn writers_of_the_same_new_data_store_it_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = busy_pool(dir.path());
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 40;
    for t in 0..THREADS {
        pool.create_volume(&format!("v{t}"), 64 << 20)
            .expect("volume");
    }
    let data = |round: u64| -> Vec<u8> {
        let blocks = if round.is_multiple_of(2) { 16 } else { 128 };
        (0..blocks)
            .flat_map(|b| random_block(round * 1000 + b))
            .collect()
    };
    let barrier = Arc::new(std::sync::Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            std::thread::spawn(move || {
                let vol = pool.volume(&format!("v{t}")).expect("volume");
                for r in 0..ROUNDS {
                    let buf = data(r);
                    barrier.wait();
                    vol.write(r * (512 << 10), &buf, false).expect("write");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer thread");
    }
    let blocks: u64 = (0..ROUNDS).map(|r| data(r).len() as u64 / 4096).sum();
    pool.sync().expect("sync");
    assert_eq!(
        pool.stats().unique_chunks,
        blocks,
        "blocks written at once by {THREADS} threads were stored more than once"
    );
    for t in 0..THREADS {
        let vol = pool.volume(&format!("v{t}")).expect("volume");
        for r in 0..ROUNDS {
            let want = data(r);
            let mut got = vec![0u8; want.len()];
            vol.read(r * (512 << 10), &mut got).expect("read");
            assert!(got == want, "volume v{t}, round {r} reads back wrong");
        }
    }
    pool.verify().expect("verify");
}

/// Threads writing the same few new blocks at once, each in its own order and with blocks
/// repeated inside a write (inside one group of fingerprinted blocks and across groups): no
/// writer waits forever for another (a group placing its new blocks never waits for a block
/// another writer is placing), each block is stored once, and every repeat holds its own
/// reference (verify checks the counts; the volumes read back).
#[test]
fn writers_of_the_same_blocks_in_other_orders_store_each_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = busy_pool(dir.path());
    const THREADS: usize = 4;
    const ROUNDS: u64 = 60;
    const DISTINCT: u64 = 5;
    for t in 0..THREADS {
        pool.create_volume(&format!("v{t}"), 16 << 20)
            .expect("volume");
    }
    // Round `r`, thread `t`: 24 blocks (three groups) cycling through the round's five blocks
    // from a place and in a direction of the thread's own.
    let data = |r: u64, t: usize| -> Vec<u8> {
        (0..24u64)
            .flat_map(|i| {
                let k = if t.is_multiple_of(2) {
                    i + t as u64
                } else {
                    1000 - i - t as u64
                };
                random_block(r * 100 + k % DISTINCT)
            })
            .collect()
    };
    let barrier = Arc::new(std::sync::Barrier::new(THREADS));
    let (done, finished) = std::sync::mpsc::channel();
    for t in 0..THREADS {
        let (pool, barrier, done) = (pool.clone(), barrier.clone(), done.clone());
        std::thread::spawn(move || {
            let vol = pool.volume(&format!("v{t}")).expect("volume");
            for r in 0..ROUNDS {
                let buf = data(r, t);
                barrier.wait();
                vol.write(r * (128 << 10), &buf, false).expect("write");
            }
            done.send(()).expect("report");
        });
    }
    for _ in 0..THREADS {
        finished
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("a writer is still waiting after 60 s: writers of the same blocks deadlocked");
    }
    pool.sync().expect("sync");
    assert_eq!(pool.stats().unique_chunks, ROUNDS * DISTINCT);
    for t in 0..THREADS {
        let vol = pool.volume(&format!("v{t}")).expect("volume");
        for r in 0..ROUNDS {
            let want = data(r, t);
            let mut got = vec![0u8; want.len()];
            vol.read(r * (128 << 10), &mut got).expect("read");
            assert!(got == want, "volume v{t}, round {r} reads back wrong");
        }
    }
    pool.verify().expect("verify");
}

/// Many threads increment one counter with compare-and-write (the VMFS heartbeat / ATS
/// pattern): every increment that reported success is counted exactly once.
#[test]
fn compare_and_write_increments_lose_no_update() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = busy_pool(dir.path());
    pool.create_volume("ats", 1 << 20).expect("volume");
    const THREADS: u64 = 6;
    const INCREMENTS: u64 = 150;
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let v = pool.volume("ats").expect("volume");
                let mut done = 0;
                let mut misses = 0u64;
                while done < INCREMENTS {
                    let mut cur = vec![0u8; 512];
                    v.read(4096, &mut cur).expect("read");
                    let n = u64::from_le_bytes(cur[..8].try_into().expect("8"));
                    let mut next = cur.clone();
                    next[..8].copy_from_slice(&(n + 1).to_le_bytes());
                    match v.compare_and_write(4096, &cur, &next, false).expect("caw") {
                        None => done += 1,
                        Some(at) => {
                            assert!(at < 8, "miscompare must be in the counter bytes, got {at}");
                            misses += 1;
                        }
                    }
                }
                misses
            })
        })
        .collect();
    let misses: u64 = handles.into_iter().map(|h| h.join().expect("thread")).sum();
    let v = pool.volume("ats").expect("volume");
    let mut cur = vec![0u8; 512];
    v.read(4096, &mut cur).expect("read");
    assert_eq!(
        u64::from_le_bytes(cur[..8].try_into().expect("8")),
        THREADS * INCREMENTS,
        "{misses} miscompares"
    );
    pool.verify().expect("verify");
}

/// Copying a range by reference adds no physical space and reads no data, at any size: a
/// 370 GiB mostly-unwritten range and a fully written one.
#[test]
fn copy_by_reference_adds_no_space() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(1 << 30)).expect("create");
    let src = pool.create_volume("src", 370 << 30).expect("src");
    let dst = pool.create_volume("dst", 370 << 30).expect("dst");
    for i in 0..256u64 {
        src.write(i * (1 << 30), &random_block(i), false)
            .expect("write");
    }
    for i in 0..2048u64 {
        src.write((1 << 20) + i * 4096, &random_block(10_000 + i), false)
            .expect("write");
    }
    pool.sync().expect("sync");
    let before = pool.stats();
    let t = std::time::Instant::now();
    let report = dst.copy_from(&src, 0, 0, 370 << 30).expect("copy");
    let took = t.elapsed();
    assert_eq!(report.shared_bytes, 370 << 30);
    assert_eq!(report.data_bytes, 0);
    pool.sync().expect("sync");
    let after = pool.stats();
    assert_eq!(
        after.physical_bytes, before.physical_bytes,
        "copy added physical space"
    );
    assert_eq!(after.unique_chunks, before.unique_chunks);
    assert_eq!(
        after.logical_written_bytes,
        2 * before.logical_written_bytes
    );
    let mut a = vec![0u8; 4096];
    let mut b = vec![0u8; 4096];
    for off in [0u64, 7 << 30, (1 << 20) + 4096 * 77] {
        src.read(off, &mut a).expect("read");
        dst.read(off, &mut b).expect("read");
        assert_eq!(a, b);
    }
    // Writing the copy breaks sharing for that block only.
    dst.write(7 << 30, &random_block(424_242), false)
        .expect("write");
    src.read(7 << 30, &mut a).expect("read");
    assert_eq!(a, random_block(7));
    eprintln!("370 GiB copy by reference: {took:?}");
    assert!(took.as_secs() < 10, "copy took {took:?}");
    pool.verify().expect("verify");
}

/// Snapshots and clones cost no data I/O and no space, clones survive their sources, a write
/// to a clone breaks sharing for that block only, and deleting the last sharer releases space.
#[test]
fn snapshots_and_clones_share_everything_and_survive_their_sources() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(1 << 30)).expect("create");
    let v = pool.create_volume("vm", 64 << 20).expect("vm");
    for i in 0..4096u64 {
        v.write(i * 4096, &random_block(i), false).expect("write");
    }
    pool.sync().expect("sync");
    let before = pool.stats();
    let segments_before = before.segment_file_bytes;
    let t = std::time::Instant::now();
    pool.create_snapshot("vm", "golden").expect("snapshot");
    let mut names = Vec::new();
    for gen in 0..20 {
        let source = if gen == 0 {
            "vm@golden".to_string()
        } else {
            format!("gen{}", gen - 1)
        };
        let name = format!("gen{gen}");
        pool.clone_volume(&source, &name).expect("clone");
        names.push(name);
    }
    let took = t.elapsed();
    eprintln!("1 snapshot + 20 chained clones of 16 MiB of data: {took:?}");
    pool.sync().expect("sync");
    let after = pool.stats();
    assert_eq!(
        after.physical_bytes, before.physical_bytes,
        "snapshots and clones added space"
    );
    assert_eq!(
        after.segment_file_bytes, segments_before,
        "snapshots and clones wrote data"
    );
    // Write to the deepest clone: only that block diverges.
    let deep = pool.volume("gen19").expect("gen19");
    deep.write(4096 * 10, &random_block(777_777), false)
        .expect("write clone");
    let mut buf = vec![0u8; 4096];
    deep.read(4096 * 10, &mut buf).expect("read");
    assert_eq!(buf, random_block(777_777));
    v.read(4096 * 10, &mut buf).expect("read source");
    assert_eq!(buf, random_block(10));
    // Delete every source: the deepest clone still reads everything.
    pool.delete_snapshot("vm", "golden")
        .expect("delete snapshot");
    drop(v);
    pool.delete_volume("vm").expect("delete source");
    for name in &names[..19] {
        pool.delete_volume(name).expect("delete intermediate clone");
    }
    pool.gc_now().expect("gc");
    for i in (0..4096u64).step_by(61) {
        deep.read(i * 4096, &mut buf).expect("read");
        let want = if i == 10 {
            random_block(777_777)
        } else {
            random_block(i)
        };
        assert_eq!(buf, want, "block {i} of the surviving clone");
    }
    let space = deep.space().expect("space");
    assert_eq!(space.mapped_blocks, 4096);
    assert_eq!(
        space.exclusive_blocks, 4096,
        "with every sharer gone the clone holds its data alone"
    );
    // The overwritten block of the original is gone; everything else is still stored once.
    let s = pool.stats();
    assert_eq!(s.unique_chunks, 4096);
    pool.verify().expect("verify");
}

/// Large reads (whose records are read in groups, several per `pread`) of data that never
/// changes stay exact while other writes churn the same segments and the cleaner relocates
/// the live records and deletes the old segment files under the readers.
#[test]
fn grouped_reads_stay_exact_while_the_cleaner_moves_their_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    // No background thread: the churn thread commits and cleans (`gc_now`), so `verify` at
    // the end runs on a quiet pool.
    let config = PoolConfig {
        segment_bytes_max: 256 << 10,
        ..quiet_config(1 << 30)
    };
    let pool = Arc::new(Pool::create(dir.path().join("p"), config).expect("create"));
    let v = pool.create_volume("v", 64 << 20).expect("v");
    // Stable blocks (even) and churned blocks (odd) interleaved, so every segment holds both.
    const BLOCKS: u64 = 1024;
    for b in 0..BLOCKS {
        v.write(b * 4096, &random_block(b), false).expect("fill");
    }
    pool.sync().expect("sync");
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let (rounds, cleaned) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    std::thread::scope(|s| {
        let churn = {
            let (pool, stop) = (pool.clone(), stop.clone());
            let (rounds, cleaned) = (rounds.clone(), cleaned.clone());
            s.spawn(move || {
                let v = pool.volume("v").expect("v");
                while !stop.load(Ordering::Relaxed) {
                    let round = rounds.load(Ordering::Relaxed) + 1;
                    for b in (1..BLOCKS).step_by(2) {
                        v.write(b * 4096, &random_block(round << 32 | b), false)
                            .expect("churn");
                    }
                    cleaned.fetch_add(pool.gc_now().expect("gc"), Ordering::Relaxed);
                    rounds.store(round, Ordering::Relaxed);
                }
            })
        };
        let v = pool.volume("v").expect("v");
        let mut buf = vec![0u8; (BLOCKS * 4096) as usize];
        // Read until the cleaner has run several times under the readers.
        let mut reads = 0;
        while reads < 40 || rounds.load(Ordering::Relaxed) < 5 {
            reads += 1;
            assert!(reads < 100_000, "the churn thread made no progress");
            v.read(0, &mut buf).expect("read");
            for b in (0..BLOCKS).step_by(2) {
                let at = (b * 4096) as usize;
                assert!(
                    buf[at..at + 4096] == random_block(b)[..],
                    "stable block {b} read wrong"
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        churn.join().expect("churn thread");
    });
    assert!(
        cleaned.load(Ordering::Relaxed) >= 5,
        "the cleaner cleaned only {} segments",
        cleaned.load(Ordering::Relaxed)
    );
    assert!(pool.stats().garbage_bytes < 1 << 20);
    pool.verify().expect("verify");
}

/// One large write of unique data (its blocks prepared on several threads) that runs out of
/// space part way: the blocks before the first failed one are installed and read back, every
/// later one reads as zeros, and no chunk keeps a reference the map does not hold (blocks
/// prepared after the failure give theirs back): verify counts exactly the installed chunks,
/// and deleting the volume frees them all.
#[test]
fn a_large_write_that_runs_out_of_space_leaves_no_stray_references() {
    let (_dir, pool) = pool_with_room(2 << 20);
    let v = pool.create_volume("v", 64 << 20).expect("v");
    let blocks = 1024u64;
    let data: Vec<u8> = (0..blocks).flat_map(random_block).collect();
    let err = v
        .write(0, &data, false)
        .expect_err("4 MiB cannot fit in 2 MiB");
    assert!(matches!(err, Error::NoSpace), "got {err:?}");
    pool.sync().expect("sync");
    let mut buf = vec![0u8; 4096];
    let mut installed = 0u64;
    for b in 0..blocks {
        v.read(b * 4096, &mut buf).expect("read");
        if buf == random_block(b) {
            assert_eq!(installed, b, "block {b} installed after a missing one");
            installed += 1;
        } else {
            assert!(buf.iter().all(|&x| x == 0), "block {b} holds other data");
        }
    }
    assert!(installed < blocks);
    let report = pool.verify().expect("verify");
    assert_eq!(report.chunks, installed);
    assert_eq!(report.orphans, 0);
    drop(v);
    pool.delete_volume("v").expect("delete");
    pool.gc_now().expect("gc");
    let s = pool.stats();
    assert_eq!((s.unique_chunks, s.physical_bytes), (0, 0));
}

/// `gc_now` on a busy pool (the background thread committing every few milliseconds, a writer
/// overwriting blocks all along) cleans each segment that was there when it started at most
/// once, and returns while the writes go on (a cleaner that took whatever qualified could
/// follow the dead bytes the writer keeps making for as long as the writes last; in this
/// setting it did not, so this guards the bound rather than reproducing a stall).
#[test]
fn gc_now_ends_while_writes_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        background_interval_ms: 2,
        commit_interval_ms: 2,
        segment_bytes_max: 256 << 10,
        ..PoolConfig::default()
    };
    let pool = Pool::create(&path, config).expect("create");
    let blocks = 2048u64;
    let v = pool.create_volume("v", blocks * 4096).expect("v");
    let mut seeds: Vec<u64> = (0..blocks).collect();
    for i in 0..blocks {
        v.write(i * 4096, &random_block(seeds[i as usize]), false)
            .expect("write");
    }
    pool.sync().expect("sync");
    let before = pool.segment_paths().len() as u64;
    let done = std::sync::atomic::AtomicBool::new(false);
    let writes_max = std::time::Duration::from_secs(30);
    let (cleaned, writes_ended_first) = std::thread::scope(|s| {
        let (v, done, seeds) = (&v, &done, &mut seeds);
        let writer = s.spawn(move || {
            let t0 = std::time::Instant::now();
            let mut next = blocks;
            while !done.load(std::sync::atomic::Ordering::Acquire) && t0.elapsed() < writes_max {
                let i = next.wrapping_mul(7919) % blocks;
                v.write(i * 4096, &random_block(next), false)
                    .expect("overwrite");
                seeds[i as usize] = next;
                next += 1;
            }
            t0.elapsed() >= writes_max
        });
        let cleaned = pool.gc_now().expect("gc");
        done.store(true, std::sync::atomic::Ordering::Release);
        (cleaned, writer.join().expect("writer"))
    });
    assert!(
        !writes_ended_first,
        "gc_now ran until the writer stopped ({writes_max:?})"
    );
    // It cleans what is there when it lists the segments: those before the writer started
    // and the few the writer sealed until then, not the stream of 256 KiB segments it goes on
    // making (thousands in 30 s).
    assert!(
        cleaned <= 2 * before,
        "gc_now cleaned {cleaned} segments, {before} existed before the writer started"
    );
    drop(v);
    pool.close().expect("close");
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    let v = pool.volume("v").expect("v");
    let mut got = vec![0u8; 4096];
    for (i, &seed) in seeds.iter().enumerate() {
        v.read(i as u64 * 4096, &mut got).expect("read");
        assert_eq!(got, random_block(seed), "block {i}");
    }
    pool.verify().expect("verify");
}

/// A write stops trying to compress during a run of incompressible blocks (all but a sample,
/// see `compression.rs`), and where its data turns compressible the next sampled block
/// notices. A write of fewer than 64 blocks is prepared in order on one thread: of its 23
/// compressible blocks after 40 of noise, at most 7 are stored as they are. A larger write is
/// prepared by several threads at once, which share the count: of 256 compressible blocks
/// after 256 of noise, nearly all are stored compressed.
#[test]
fn a_write_that_turns_compressible_stores_the_rest_compressed() {
    const RECORD: u64 = 4096 + 24;
    let text = |i: u64| {
        let t = format!("block {i}: all work and no play makes a dull disk. ").repeat(100);
        t.as_bytes()[..4096].to_vec()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(1 << 30)).expect("create");
    let v = pool.create_volume("v", 8 << 20).expect("volume");
    let mut stored = 0;
    for (noise, compressible, uncompressed_max, at) in
        [(40u64, 23u64, 7u64, 0u64), (256, 256, 32, 63)]
    {
        let mut data = Vec::new();
        for i in 0..noise {
            data.extend_from_slice(&random_block(at + i));
        }
        for i in 0..compressible {
            data.extend_from_slice(&text(at + i));
        }
        v.write(at * 4096, &data, false).expect("write");
        pool.sync().expect("sync");
        let stats = pool.stats();
        assert_eq!(stats.unique_chunks, at + noise + compressible);
        let text_stored = stats.physical_bytes - stored - noise * RECORD;
        assert!(
            text_stored <= uncompressed_max * RECORD + compressible * 1024,
            "{compressible} compressible blocks after {noise} of noise took {text_stored} bytes"
        );
        stored = stats.physical_bytes;
        let mut back = vec![0u8; data.len()];
        v.read(at * 4096, &mut back).expect("read");
        assert!(back == data, "the data read back differs");
    }
    pool.verify().expect("verify");
}

/// Writes that failed for lack of space, written again once there is space, read back as
/// written (a failed write must leave nothing behind that a later write of the same data
/// would share).
#[test]
fn writes_that_failed_for_lack_of_space_succeed_in_full_once_space_returns() {
    let (_dir, pool) = pool_with_room(8 << 20);
    let v = pool.create_volume("v", 1 << 30).expect("v");
    let chunk = |i: u64| -> Vec<u8> { (0..256).flat_map(|k| random_block(i * 256 + k)).collect() };
    let mut n = 0u64;
    while v.write(n << 20, &chunk(n), false).is_ok() {
        n += 1;
        assert!(n < 64, "the pool never filled");
    }
    v.flush().expect("flush");
    // The next writes fail too; then the pool grows and they are written again.
    for i in n..n + 4 {
        assert!(matches!(
            v.write(i << 20, &chunk(i), false),
            Err(Error::NoSpace)
        ));
    }
    pool.set_capacity(1 << 30).expect("grow");
    for i in n..n + 8 {
        v.write(i << 20, &chunk(i), false)
            .expect("write after growing");
    }
    v.flush().expect("flush");
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..n + 8 {
        v.read(i << 20, &mut buf).expect("read");
        assert!(buf == chunk(i), "MiB {i} (the pool filled at {n})");
    }
    pool.verify().expect("verify");
}

/// Overwritten chunks die when the reference log's slice holding them is folded, not at the
/// commit that overwrote them; on an idle pool the background thread folds the log within a
/// few wake-ups, with no sync: the freed chunks leave the space figures on their own.
#[test]
fn an_idle_pool_folds_its_reference_log_in_the_background() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = PoolConfig {
        background: true,
        background_interval_ms: 20,
        commit_interval_ms: 20,
        ..quiet_config(1 << 30)
    };
    let pool = Pool::create(dir.path().join("p"), config).expect("create");
    pool.wait_filters_built();
    let v = pool.create_volume("v", 64 << 20).expect("volume");
    for i in 0..64u64 {
        v.write(i * 4096, &random_block(i), false).expect("write");
    }
    pool.sync().expect("sync");
    for i in 0..64u64 {
        v.write(i * 4096, &random_block(1000 + i), false)
            .expect("overwrite");
    }
    pool.commit_once().expect("commit");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while pool.stats().unique_chunks > 64 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} chunks after 20 s",
            pool.stats().unique_chunks
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(pool.verify().expect("verify").chunks, 64);
}

/// `store::redb::file_space` accounts for a closed pool's store file: one map page per 16
/// blocks written in order (none left in the per-block table), a chunk page per 16 chunk ids at most, and no more pages in the tables than redb
/// allocated nor than the file holds.
#[test]
fn the_store_file_space_is_told_per_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
    let v = pool.create_volume("v", 16 << 20).expect("v");
    for i in 0..300u64 {
        v.write(i * 4096, &random_block(i), false).expect("write");
    }
    drop(v);
    pool.sync().expect("sync");
    pool.close().expect("close");
    let s = ibid_engine::store::redb::file_space(&path.join(ibid_engine::store::redb::FILE))
        .expect("measure");
    let table = |name: &str| {
        s.tables
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no table {name} in {:?}", s.tables))
    };
    assert_eq!(table("map.pages").rows, 300u64.div_ceil(16));
    let old_rows = s
        .tables
        .iter()
        .find(|t| t.name == "map.bytes")
        .map_or(0, |t| t.rows);
    assert_eq!(old_rows, 0);
    let pages = table("chunk.pages").rows;
    assert!((300 / 16..=300).contains(&pages), "{pages} chunk pages");
    let table_pages: u64 = s.tables.iter().map(|t| t.leaf_pages + t.branch_pages).sum();
    assert!(table_pages > 0 && table_pages <= s.allocated_pages, "{s:?}");
    assert!(s.allocated_pages * s.page_bytes <= s.file_bytes, "{s:?}");
}
