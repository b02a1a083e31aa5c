//! Unit tests of the volume paths.
use super::{format, Neighbours, PlacingMark, SHARDS};
use crate::{Pool, PoolConfig};
use std::sync::mpsc;
use std::time::Duration;

/// A writer that panics while placing a new chunk takes its `placing` mark with it (the
/// mark's drop), so the next writer of that block does not wait forever; on the normal
/// path, `clear` removes it and hands back the shard to register the chunk in.
#[test]
fn a_placing_mark_does_not_outlive_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), PoolConfig::default()).expect("create");
    let inner = &*pool.inner;
    let (shard, fp) = (5, [9u8; 32]);
    let place = |panic: bool| {
        inner.shards[shard].lock().placing.insert(fp);
        let mark = PlacingMark { inner, shard, fp };
        assert!(!panic, "placing failed");
        drop(mark.clear());
    };
    place(false);
    assert!(inner.shards[shard].lock().placing.is_empty());
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| place(true)));
    assert!(unwound.is_err());
    assert!(
        inner.shards[shard].lock().placing.is_empty(),
        "the mark survived the panic"
    );
    let (tx, rx) = mpsc::channel();
    let later = pool.inner.clone();
    std::thread::spawn(move || {
        drop(later.lock_settled(shard, &fp));
        tx.send(()).expect("send");
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("a later writer of the block waited");
}

/// Past `dirty_blocks_throttle` uncommitted blocks, a writer waits for the commit in
/// progress (here: the commit lock, held by the test) and goes on as soon as it ends;
/// below it, writers do not wait.
#[test]
fn writers_past_the_throttle_wait_for_the_commit_in_progress() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        background: false,
        dirty_blocks_commit: 4,
        dirty_blocks_throttle: 8,
        dirty_blocks_max: 1 << 20,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("pool"), config).expect("create");
    pool.wait_filters_built();
    let vol = pool.create_volume("v", 1 << 20).expect("volume");
    let held = pool.inner.commit.lock();
    // 4 blocks: at the background threshold, under the throttle.
    vol.write(0, &[1u8; 4 * 4096], false)
        .expect("write under the throttle");
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let vol = &vol;
        s.spawn(move || {
            vol.write(4 * 4096, &[2u8; 8 * 4096], false).expect("write");
            tx.send(()).expect("send");
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "a writer past the throttle must wait for the commit in progress"
        );
        drop(held);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the writer goes on once the commit ends");
    });
    let mut back = vec![0u8; 12 * 4096];
    vol.read(0, &mut back).expect("read");
    assert!(back[..4 * 4096].iter().all(|&b| b == 1) && back[4 * 4096..].iter().all(|&b| b == 2));
}

/// A pool under `dir` with no background thread (commits by hand), its dedup filter
/// built, and a 1 MiB volume.
fn stepped_pool_with_a_volume(dir: &std::path::Path) -> (Pool, super::Volume) {
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        background: false,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.join("pool"), config).expect("create");
    pool.wait_filters_built();
    let vol = pool.create_volume("v", 1 << 20).expect("volume");
    (pool, vol)
}

/// `find_duplicate` of `fp` with `near` as the write's neighbours, its shard locked.
fn find_with(inner: &crate::inner::Inner, fp: &[u8; 32], near: &Neighbours) -> Option<u64> {
    let s = inner.shards[fp[0] as usize % SHARDS].lock();
    inner.find_duplicate(&s, fp, Some(near)).expect("lookup")
}

/// A neighbour counts only while the committed state holds that chunk with that
/// fingerprint: one that died since the neighbours were read, or one listed under another
/// block's fingerprint, is passed over for the index's answer.
#[test]
fn stale_neighbours_are_checked_against_the_committed_chunks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, vol) = stepped_pool_with_a_volume(dir.path());
    let (gone, kept) = ([1u8; 4096], [2u8; 4096]);
    vol.write(0, &gone, false).expect("write");
    vol.write(4096, &kept, false).expect("write");
    vol.write(8192, &[4u8; 4096], false).expect("write");
    pool.sync().expect("commit");
    let inner = &pool.inner;
    let chunk = |b: u64| match inner.lookup_range(&vol.state, b, b + 1).expect("map")[&b] {
        id if id != format::ZERO_TOMBSTONE => id,
        _ => panic!("block {b} holds no data"),
    };
    let (gone_id, kept_id, other_id) = (chunk(0), chunk(1), chunk(2));
    vol.write(0, &[3u8; 4096], false).expect("overwrite");
    pool.sync().expect("commit: the first chunk dies");
    let fp = |b: &[u8]| *blake3::hash(b).as_bytes();
    let (fp_gone, fp_kept) = (fp(&gone), fp(&kept));
    let find = |fp: &[u8; 32], near: &Neighbours| find_with(inner, fp, near);
    let mut near = rustc_hash::FxHashMap::default();
    near.insert(fp_gone, gone_id);
    assert_eq!(
        find(&fp_gone, &Neighbours::loaded(near)),
        None,
        "a dead neighbour"
    );
    let mut near = rustc_hash::FxHashMap::default();
    near.insert(fp_kept, other_id);
    assert_eq!(
        find(&fp_kept, &Neighbours::loaded(near)),
        Some(kept_id),
        "a neighbour under the wrong fingerprint"
    );
    let mut near = rustc_hash::FxHashMap::default();
    near.insert(fp_kept, kept_id);
    assert_eq!(find(&fp_kept, &Neighbours::loaded(near)), Some(kept_id));
}

/// Neighbours read by a scan are taken without a re-check only while no commit has freed
/// a chunk since: one freed after the scan is passed over, one still stored is found.
#[test]
fn neighbours_read_before_a_free_are_checked_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, vol) = stepped_pool_with_a_volume(dir.path());
    let (gone, kept) = ([5u8; 4096], [6u8; 4096]);
    vol.write(0, &gone, false).expect("write");
    vol.write(4096, &kept, false).expect("write");
    pool.sync().expect("commit");
    let inner = &pool.inner;
    let chunk = |b: u64| inner.lookup_range(&vol.state, b, b + 1).expect("map")[&b];
    let fp = |b: &[u8]| *blake3::hash(b).as_bytes();
    let (fp_gone, fp_kept) = (fp(&gone), fp(&kept));
    let loaded = || {
        let near = Neighbours::for_write(16);
        near.found_in_index(chunk(0));
        near.load_if_pending(&inner.db, inner.dedup.frees());
        assert_eq!(near.get(&fp_gone).map(|(id, _)| id), Some(chunk(0)));
        near
    };
    let find = |fp: &[u8; 32], near: &Neighbours| find_with(inner, fp, near);
    let near = loaded();
    assert_eq!(
        find(&fp_gone, &near),
        Some(chunk(0)),
        "no free since the scan"
    );
    let near = loaded();
    vol.write(0, &[7u8; 4096], false).expect("overwrite");
    pool.sync().expect("commit: the first chunk dies");
    assert_eq!(
        find(&fp_gone, &near),
        None,
        "a neighbour freed after the scan"
    );
    assert_eq!(find(&fp_kept, &near), Some(chunk(1)));
}

/// A write is quick when it is whole blocks, at most `QUICK_WRITE_BLOCKS_MAX` of them, and
/// keeps the uncommitted backlog under the throttle; a commit makes room again.
#[test]
fn quick_writes_are_small_whole_blocks_under_the_throttle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        background: false,
        dirty_blocks_commit: 4,
        dirty_blocks_throttle: 32,
        dirty_blocks_max: 1 << 20,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("pool"), config).expect("create");
    pool.wait_filters_built();
    let vol = pool.create_volume("v", 1 << 20).expect("volume");
    let max = super::QUICK_WRITE_BLOCKS_MAX;
    assert!(vol.write_is_quick(0, 4096));
    assert!(vol.write_is_quick(8192, max * 4096));
    assert!(!vol.write_is_quick(0, (max + 1) * 4096), "too many blocks");
    assert!(!vol.write_is_quick(512, 4096), "not block-aligned");
    assert!(!vol.write_is_quick(0, 512), "a partial block");
    for i in 0..24u8 {
        vol.write(u64::from(i) * 4096, &[i + 1; 4096], false)
            .expect("write");
    }
    assert!(
        vol.write_is_quick(0, 7 * 4096),
        "24 + 7 blocks stay under 32"
    );
    assert!(
        !vol.write_is_quick(0, 8 * 4096),
        "24 + 8 blocks reach the throttle"
    );
    pool.sync().expect("commit");
    assert!(vol.write_is_quick(0, max * 4096));
}

/// Zeroing committed data records one range: no map entry and no reference change per
/// block until the commit, which then unmaps every block and frees every chunk.
#[test]
fn zeroing_committed_data_records_one_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, vol) = stepped_pool_with_a_volume(dir.path());
    let data: Vec<u8> = (0..256u32)
        .flat_map(|b| {
            let mut block = [0u8; 4096];
            block[..4].copy_from_slice(&b.to_le_bytes());
            block[4] = 1;
            block
        })
        .collect();
    vol.write(0, &data, false).expect("write");
    pool.sync().expect("commit");
    vol.write_zeroes(0, 1 << 20, false).expect("zero");
    {
        let map = vol.state().map.lock();
        assert_eq!(map.dirty.all_entries().count(), 0, "entries per block");
        assert_eq!(map.dirty.zeroed().collect::<Vec<_>>(), vec![(0, 256)]);
    }
    let deltas: usize = vol
        .inner
        .shards
        .iter()
        .map(|s| s.lock().dirty.deltas.len())
        .sum();
    assert_eq!(deltas, 0, "reference changes before the commit");
    assert_eq!(vol.inner.batches.dirty(), 1);
    assert_eq!(vol.mapped_blocks(), 0);
    pool.sync().expect("commit");
    assert_eq!(pool.stats().unique_chunks, 0);
}

/// `read_if_cached` reads exactly what `read` reads when it reads at all; it declines data
/// written with `O_DIRECT` and not read since (where the filesystem allows direct I/O), reads
/// it once a plain read has brought it into the page cache, and reads a never-written range
/// (zeros, no I/O) and a pool on the simulated disk (memory) always. (`RWF_NOWAIT` is best
/// effort: the kernel starts readahead for a range it lacks and may return it when the device
/// answers at once — on a loaded machine, eight 64 KiB probes 1 MiB apart all did — so 4 KiB
/// blocks 64 KiB apart are probed, up to 120, until one declines. The data is noise:
/// compressible data took a few hundred KiB of segment, which the first probe's readahead
/// brought in whole.)
#[test]
fn a_cached_read_reads_what_a_read_does_or_declines() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let data: Vec<u8> = (0..2048).flat_map(crate::test_data::noise_block).collect();
    {
        let pool = Pool::create(&path, PoolConfig::default()).expect("create");
        let v = pool.create_volume("v", 16 << 20).expect("volume");
        v.write(0, &data, false).expect("write");
        pool.close().expect("close");
    }
    let pool = Pool::open(&path, PoolConfig::default()).expect("open");
    let v = pool.volume("v").expect("v");
    let mut got = vec![0u8; 64 << 10];
    let direct = pool.inner.config.direct_io;
    if v.read_if_cached(64 << 10, &mut got).expect("cached read") {
        assert_eq!(got, data[64 << 10..128 << 10]);
    }
    if direct {
        let mut declined = 0;
        let mut one = vec![0u8; 4096];
        for r in 8..128 {
            let at = r * (64 << 10) + 4096;
            if v.read_if_cached(at, &mut one).expect("cached read") {
                assert!(
                    one == data[at as usize..at as usize + 4096],
                    "block at {at}: other bytes than a read's"
                );
            } else {
                declined += 1;
                break;
            }
        }
        assert!(
            declined > 0,
            "data written with O_DIRECT and never read came from memory"
        );
    }
    v.read(64 << 10, &mut got).expect("read");
    got.fill(0);
    assert!(v.read_if_cached(64 << 10, &mut got).expect("cached read"));
    assert_eq!(got, data[64 << 10..128 << 10]);
    got.fill(1);
    assert!(v.read_if_cached(8 << 20, &mut got).expect("cached read"));
    assert!(got.iter().all(|&b| b == 0), "a never-written range");
    assert!(matches!(
        v.read_if_cached(16 << 20, &mut got),
        Err(crate::Error::OutOfRange { .. })
    ));

    let sim = crate::disk::SimDisk::new(7, 1 << 30);
    let config = PoolConfig {
        disk: std::sync::Arc::new(sim),
        meta_backend: crate::store::Backend::Redb,
        capacity_bytes: Some(512 << 20),
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("sim"), config).expect("create on the simulated disk");
    let v = pool.create_volume("v", 16 << 20).expect("volume");
    v.write(0, &data, false).expect("write");
    pool.sync().expect("sync");
    assert!(v.read_if_cached(64 << 10, &mut got).expect("cached read"));
    assert_eq!(got, data[64 << 10..128 << 10]);
}

/// The read cache: a block read twice is cached, and later reads — copied into the buffer or
/// held in the cache's memory — return its bytes; an overwrite is never served stale (it makes
/// a new chunk), committed or not; a held block keeps its bytes while the cache churns past
/// its size; with no cache, nothing is held.
#[test]
fn the_read_cache_serves_what_was_written_and_never_stale_bytes() {
    const MIB: usize = 1 << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        read_cache_bytes: 4 << 20,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("p"), config).expect("create");
    let v = pool.create_volume("v", 64 << 20).expect("volume");
    let mut expected = vec![0u8; 2 * MIB];
    fill_unique(&mut expected, 1);
    v.write(0, &expected, false).expect("write");
    pool.sync().expect("sync");
    let mut got = vec![0u8; 2 * MIB];
    for _ in 0..2 {
        v.read(0, &mut got).expect("read");
        assert!(got == expected);
    }
    let s = pool.read_cache_stats();
    // (A few may be admitted on the first read: the doorkeeper is a Bloom filter.)
    assert_eq!(s.admitted, 512, "admitted by the second read");
    got.fill(0xee);
    let held = v.read_held(0, &mut got).expect("held read");
    assert_eq!(held.len(), 512, "every block held");
    held.copy_into(&mut got);
    assert!(got == expected);
    drop(held);

    // Overwrite the middle: read before and after its commit, copied and held.
    let mut new = vec![0u8; MIB];
    fill_unique(&mut new, 2);
    v.write(MIB as u64 / 2, &new, false).expect("overwrite");
    expected[MIB / 2..MIB / 2 * 3].copy_from_slice(&new);
    for round in 0..2 {
        for _ in 0..2 {
            got.fill(0xee);
            v.read(0, &mut got).expect("read");
            assert!(got == expected, "round {round}: stale bytes read");
            got.fill(0xee);
            let held = v.read_held(0, &mut got).expect("held read");
            held.copy_into(&mut got);
            assert!(got == expected, "round {round}: stale bytes held");
        }
        pool.sync().expect("sync");
    }
    // Reads of partial blocks.
    let mut part = vec![0u8; 10_240];
    v.read(4096 + 512, &mut part).expect("partial read");
    assert!(part[..] == expected[4096 + 512..4096 + 512 + 10_240]);

    // Hold the first 256 KiB while 8 MiB of other data goes through the 4 MiB cache, each
    // MiB read twice.
    let mut first = vec![0xeeu8; 256 << 10];
    let held = v.read_held(0, &mut first).expect("held read");
    assert_eq!(held.len(), 64);
    let mut other = vec![0u8; 8 * MIB];
    fill_unique(&mut other, 3);
    v.write(32 << 20, &other, false).expect("write other");
    let mut scratch = vec![0u8; MIB];
    for (i, expected) in other.chunks(MIB).enumerate() {
        for _ in 0..2 {
            v.read((32 << 20) + (i * MIB) as u64, &mut scratch)
                .expect("read other");
            assert!(scratch == expected);
        }
    }
    assert!(pool.read_cache_stats().evicted > 0, "the cache churned");
    for (at, bytes) in held.iter() {
        assert!(
            bytes == &expected[at..at + 4096],
            "held block at {at} changed"
        );
    }
    drop(held);
    let s = pool.read_cache_stats();
    assert!(
        s.used_bytes <= 4 << 20 && s.capacity_bytes <= 4 << 20,
        "{s:?}"
    );

    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        read_cache_bytes: 0,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("none"), config).expect("create");
    let v = pool.create_volume("v", 64 << 20).expect("volume");
    v.write(0, &expected, false).expect("write");
    for _ in 0..3 {
        got.fill(0xee);
        let held = v.read_held(0, &mut got).expect("held read");
        assert!(held.is_empty());
        assert!(got == expected);
    }
    assert_eq!(pool.read_cache_stats(), crate::ReadCacheStats::default());
}

/// Overwrites of unique data on a pool whose filesystem holds its data about eight times, with
/// no cleaner thread: every segment keeps some data that is never overwritten (one write in 16
/// goes to a cold area, the rest overwrite a hot one at random), so none ever dies whole, and
/// garbage fills the filesystem long before the pool. Each writer the filesystem refuses cleans
/// segments itself and goes on, instead of answering `NoSpace` with the pool three-quarters
/// empty.
#[test]
fn writes_refused_by_a_filesystem_full_of_garbage_clean_and_go_on() {
    const PIECE: u64 = 64 << 10;
    const HOT: u64 = 256; // pieces: 16 MiB
    const WRITES: u64 = 8192; // 512 MiB
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = crate::disk::SimDisk::new(11, 384 << 20);
    let config = PoolConfig {
        disk: std::sync::Arc::new(sim),
        meta_backend: crate::store::Backend::Redb,
        background: false,
        segment_bytes_max: 4 << 20,
        ..PoolConfig::default()
    };
    let pool = Pool::create(dir.path().join("p"), config).expect("create");
    let capacity = pool.stats().capacity_bytes;
    let v = pool.create_volume("v", 128 << 20).expect("volume");
    let mut next = crate::test_data::xorshift(0x9e37_79b9_7f4a_7c15);
    let mut model = vec![0u64; (128 << 20) / PIECE as usize];
    let mut block = vec![0u8; PIECE as usize];
    for i in 0..WRITES {
        let at = match i % 16 {
            0 => HOT + i / 16,
            _ => next() % HOT,
        } as usize;
        let seed = next() | 1;
        fill_unique(&mut block, seed);
        v.write(at as u64 * PIECE, &block, false)
            .unwrap_or_else(|e| panic!("write {i}: {e} ({:?})", pool.stats()));
        model[at] = seed;
    }
    pool.sync().expect("sync");
    let stats = pool.stats();
    assert!(
        stats.physical_bytes < capacity / 4,
        "the volume's data is a fraction of the pool: {stats:?}"
    );
    let mut got = vec![0u8; PIECE as usize];
    for (at, &seed) in model.iter().enumerate() {
        v.read(at as u64 * PIECE, &mut got).expect("read");
        if seed == 0 {
            assert!(got.iter().all(|&b| b == 0));
            continue;
        }
        fill_unique(&mut block, seed);
        assert!(got == block, "piece {at} reads what was last written there");
    }
    pool.verify().expect("verify");
}

/// Fills `buf` with incompressible bytes that depend on `seed` (xorshift).
fn fill_unique(buf: &mut [u8], seed: u64) {
    let mut x = seed;
    for w in buf.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
}

/// `block_fingerprints` answers from the metadata what `fingerprint::of_data` computes from
/// the bytes read — uncommitted, committed and in a snapshot, zeros as `None` — and
/// `write_fingerprinted` stores what `write` would: the data reads back and a block written
/// before is shared, not stored again. Unaligned ranges and miscounted fingerprints are
/// refused and change nothing.
#[test]
fn block_fingerprints_come_from_the_metadata_and_writes_can_take_them() {
    use crate::fingerprint;
    use crate::test_data::noise_block;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), PoolConfig::default()).expect("create");
    pool.wait_filters_built();
    let vol = pool.create_volume("v", 64 * 4096).expect("volume");
    let noise = |first: u64| -> Vec<u8> { (first..first + 16).flat_map(noise_block).collect() };
    // Blocks 0..16: random, a zero block at 3, block 9 repeating block 1; 16.. unwritten.
    let mut data = noise(1);
    data[3 * 4096..4 * 4096].fill(0);
    data.copy_within(4096..2 * 4096, 9 * 4096);
    vol.write(0, &data, false).expect("write");
    let check = |vol: &super::Volume, what: &str| {
        let mut back = vec![0u8; 64 * 4096];
        vol.read(0, &mut back).expect("read");
        assert_eq!(
            vol.block_fingerprints(0, 64 * 4096).expect("fingerprints"),
            fingerprint::of_data(&back),
            "{what}"
        );
    };
    check(&vol, "uncommitted");
    let fps = vol.block_fingerprints(0, 16 * 4096).expect("fingerprints");
    assert_eq!(fps[3], None);
    assert_eq!(fps[1], fps[9]);
    assert!(fps.iter().filter(|f| f.is_some()).count() == 15);
    pool.sync().expect("sync");
    check(&vol, "committed");
    pool.create_snapshot("v", "s").expect("snapshot");
    check(&pool.snapshot("v", "s").expect("open snapshot"), "snapshot");

    // Blocks 16..32: new random blocks and a copy of blocks 4..8, written with their
    // fingerprints given.
    let unique_before = pool.stats().unique_chunks;
    let mut more = noise(100);
    more[..4 * 4096].copy_from_slice(&data[4 * 4096..8 * 4096]);
    let given = fingerprint::of_data(&more);
    vol.write_fingerprinted(16 * 4096, &more, &given, false)
        .expect("write with fingerprints");
    pool.sync().expect("sync");
    let mut back = vec![0u8; 16 * 4096];
    vol.read(16 * 4096, &mut back).expect("read");
    assert!(
        back == more,
        "written with fingerprints, read back otherwise"
    );
    assert_eq!(
        pool.stats().unique_chunks,
        unique_before + 12,
        "the 4 repeats are shared"
    );
    check(&vol, "after the fingerprinted write");

    for (offset, len, fps) in [
        (512, 4096, 1),     // not on a block
        (0, 2 * 4096, 1),   // one fingerprint short
        (0, 4096 + 512, 2), // not whole blocks
    ] {
        let junk = vec![5u8; len];
        assert!(vol
            .write_fingerprinted(offset, &junk, &vec![Some([1; 32]); fps], false)
            .is_err());
    }
    assert!(vol.block_fingerprints(512, 4096).is_err());
    assert!(vol.block_fingerprints(0, 65 * 4096).is_err());
    let mut first = vec![0u8; 16 * 4096];
    vol.read(0, &mut first).expect("read");
    assert!(first == data, "a refused write changed data");
}
