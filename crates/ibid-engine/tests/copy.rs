//! Range copies by frames (`copy.rs`): a copy of any length is one catalog transaction — no
//! map entry per block, no reference count change — that reads back exactly like the source
//! did, survives a crash, keeps the source's old data alive only while the copy needs it, and
//! becomes an ordinary layer when the cleaner makes it permanent.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{Pool, PoolConfig, Volume};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;

fn config() -> PoolConfig {
    quiet_config(1 << 30)
}

/// `blocks` blocks of unique data, block i from seed `seed + i`.
fn data(seed: u64, blocks: u64) -> Vec<u8> {
    (0..blocks).flat_map(|i| random_block(seed + i)).collect()
}

fn read_all(v: &Volume) -> Vec<u8> {
    let mut buf = vec![0u8; v.size() as usize];
    v.read(0, &mut buf).expect("read");
    buf
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} (block {}) differs", i as u64 / BLOCK);
    }
}

#[test]
fn a_large_copy_adds_no_map_entry_until_the_cleaner_makes_it_permanent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let src = pool.create_volume("src", 16 * MIB).expect("src");
    let dst = pool.create_volume("dst", 16 * MIB).expect("dst");
    let content = data(1, 4096);
    src.write(0, &content, false).expect("write");
    pool.sync().expect("sync");
    let before = pool.verify().expect("verify");
    let stats_before = pool.stats();

    let report = dst.copy_from(&src, 0, 0, 16 * MIB).expect("copy");
    assert_eq!((report.shared_bytes, report.data_bytes), (16 * MIB, 0));
    assert_eq!(dst.mapped_blocks(), 4096);
    pool.sync().expect("sync");
    let after = pool.verify().expect("verify");
    assert_eq!(
        after.map_entries, before.map_entries,
        "a copy by frames adds no map entry"
    );
    assert_eq!(after.chunks, before.chunks);
    assert_eq!(pool.stats().physical_bytes, stats_before.physical_bytes);
    assert_eq!(pool.stats().logical_written_bytes, 2 * 16 * MIB);
    assert_same(&read_all(&dst), &content, "dst after the copy");

    // The source moves on; the copy keeps what it copied.
    let newer = data(100_000, 256);
    src.write(0, &newer, false).expect("overwrite");
    src.write_zeroes(4 * MIB, MIB, false).expect("zero");
    assert_same(&read_all(&dst), &content, "dst after the source changed");
    let mut src_model = content.clone();
    src_model[..MIB as usize].copy_from_slice(&newer);
    src_model[4 * MIB as usize..5 * MIB as usize].fill(0);
    assert_same(&read_all(&src), &src_model, "src");

    // Made permanent: one entry per mapped block of the copy, the same data, and the
    // source's overwritten blocks still alive (the copy references them).
    pool.gc_now().expect("gc");
    assert_eq!(
        dst.stack_depth(),
        1,
        "the copy's frames became a layer, merged into the top"
    );
    assert_eq!(
        src.stack_depth(),
        1,
        "the source flattened its frozen layer"
    );
    let permanent = pool.verify().expect("verify");
    assert_eq!(permanent.map_entries, 4096 + (4096 - 256));
    assert_eq!(permanent.chunks, 4096 + 256);
    assert_same(&read_all(&dst), &content, "dst made permanent");
    assert_same(&read_all(&src), &src_model, "src after gc");

    // Deleting the source keeps the copy; deleting both gives everything back.
    pool.delete_volume("src").expect("delete src");
    pool.gc_now().expect("gc");
    assert_same(&read_all(&dst), &content, "dst without its source");
    assert_eq!(pool.verify().expect("verify").chunks, 4096);
    pool.delete_volume("dst").expect("delete dst");
    pool.gc_now().expect("gc");
    let empty = pool.verify().expect("verify");
    assert_eq!((empty.chunks, empty.map_entries), (0, 0));
    assert_eq!(pool.stats().physical_bytes, 0);
}

#[test]
fn sequential_segment_copies_widen_one_group_of_frames() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let src = pool.create_volume("src", 32 * MIB).expect("src");
    let dst = pool.create_volume("dst", 40 * MIB).expect("dst");
    let content = data(7, 8192);
    src.write(0, &content, false).expect("write");
    // Like an XCOPY of the whole disk in 1 MiB segments, 8 MiB further on.
    for seg in 0..32 {
        dst.copy_from(&src, seg * MIB, 8 * MIB + seg * MIB, MIB)
            .expect("copy segment");
    }
    assert_eq!(
        dst.stack_depth(),
        3,
        "top layer, one floor and one source frame"
    );
    let got = read_all(&dst);
    assert!(got[..8 * MIB as usize].iter().all(|&b| b == 0));
    assert_same(&got[8 * MIB as usize..], &content, "dst");
    assert_eq!(dst.mapped_blocks(), 8192);
    pool.verify().expect("verify");
}

#[test]
fn segments_arriving_out_of_order_and_in_parallel_join_into_one_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let vol = pool.create_volume("vol", 96 * MIB).expect("vol");
    let other = pool.create_volume("other", 48 * MIB).expect("other");
    let content = data(11, 8192);
    vol.write(0, &content, false).expect("write");
    // ESXi's pattern: 1 MiB segments (frame copies from 256 blocks), several in flight, so
    // they arrive in no particular order: first a fixed scramble, then 8 threads at once.
    let order = [3, 0, 7, 1, 2, 6, 5, 4, 11, 8, 15, 9, 10, 14, 13, 12];
    for &seg in &order {
        vol.copy_from(&vol, seg * MIB, 48 * MIB + seg * MIB, MIB)
            .expect("copy segment");
    }
    let next = std::sync::atomic::AtomicU64::new(16);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| loop {
                let seg = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if seg >= 32 {
                    return;
                }
                vol.copy_from(&vol, seg * MIB, 48 * MIB + seg * MIB, MIB)
                    .expect("copy segment");
                other
                    .copy_from(&vol, seg * MIB, 16 * MIB + seg * MIB, MIB)
                    .expect("copy segment across volumes");
            });
        }
    });
    for &seg in order.iter().rev() {
        other
            .copy_from(&vol, seg * MIB, 16 * MIB + seg * MIB, MIB)
            .expect("copy segment across volumes");
    }
    // Joined groups: the source's frozen layer, one floor and one window, and the top.
    assert!(
        vol.stack_depth() <= 4,
        "stack of {} frames",
        vol.stack_depth()
    );
    assert!(
        other.stack_depth() <= 4,
        "stack of {} frames",
        other.stack_depth()
    );
    let got = read_all(&vol);
    assert_same(&got[..32 * MIB as usize], &content, "source range");
    assert!(got[32 * MIB as usize..48 * MIB as usize]
        .iter()
        .all(|&b| b == 0));
    assert_same(&got[48 * MIB as usize..80 * MIB as usize], &content, "copy");
    let got = read_all(&other);
    assert!(got[..16 * MIB as usize].iter().all(|&b| b == 0));
    assert_same(&got[16 * MIB as usize..], &content, "copy across volumes");
    assert_eq!(vol.mapped_blocks(), 2 * 8192);
    assert_eq!(other.mapped_blocks(), 8192);
    pool.verify().expect("verify");
    // The layer references the joined frames gave back were counted right: made permanent,
    // then reopened, everything reads the same and verifies.
    pool.gc_now().expect("gc");
    pool.verify()
        .expect("verify after making the copies permanent");
    drop((vol, other));
    pool.close().expect("close");
    let pool = Pool::open(dir.path().join("pool"), config()).expect("reopen");
    let vol = pool.volume("vol").expect("vol");
    assert_same(
        &read_all(&vol)[48 * MIB as usize..80 * MIB as usize],
        &content,
        "copy after reopen",
    );
    pool.verify().expect("verify after reopen");
}

/// ESXi's heartbeats beside a clone: a block outside the copies' windows written before every
/// segment. The source's top then holds nothing the copies show, so no segment freezes it,
/// and each segment's group shows only the frames with data in its window: the groups join
/// as if nothing else were written, instead of a frozen layer and a group per segment that
/// fill the stack and send the later copies to share block references one by one.
#[test]
fn writes_beside_copies_add_no_frames() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let vol = pool.create_volume("vol", 160 * MIB).expect("vol");
    let other = pool.create_volume("other", 80 * MIB).expect("other");
    let content = data(3, 64 * 256);
    vol.write(MIB, &content, false).expect("write");
    let beat = |i: u64| {
        vol.write(0, &random_block(1_000_000 + i), false)
            .expect("beat")
    };
    pool.sync().expect("sync");
    let entries = pool.verify().expect("verify").map_entries;
    // More segments than a stack has room for frames, within the volume and across.
    for seg in 0..64 {
        beat(seg);
        vol.copy_from(&vol, MIB + seg * MIB, 80 * MIB + seg * MIB, MIB)
            .expect("copy within");
        beat(seg + 100);
        other
            .copy_from(&vol, MIB + seg * MIB, 16 * MIB + seg * MIB, MIB)
            .expect("copy across");
    }
    // The volume: its data layer (frozen by the first copy, which met the data in the top),
    // one joined group (floor and window) and the top; the other volume: one group and its
    // top.
    assert!(
        vol.stack_depth() <= 4,
        "stack of {} frames",
        vol.stack_depth()
    );
    assert!(
        other.stack_depth() <= 3,
        "stack of {} frames",
        other.stack_depth()
    );
    pool.sync().expect("sync");
    assert_eq!(
        pool.verify().expect("verify").map_entries,
        entries + 2,
        "copies by frames: no map entry but the heartbeat block's, in the frozen layer and the top"
    );
    let got = read_all(&vol);
    assert_same(&got[MIB as usize..65 * MIB as usize], &content, "source");
    assert_same(
        &got[80 * MIB as usize..144 * MIB as usize],
        &content,
        "copy within",
    );
    assert_same(&got[..4096], &random_block(1_000_163), "last heartbeat");
    assert_same(
        &read_all(&other)[16 * MIB as usize..],
        &content,
        "copy across",
    );
    pool.gc_now().expect("make the copies permanent");
    pool.verify().expect("verify after");
    assert_same(
        &read_all(&vol)[80 * MIB as usize..144 * MIB as usize],
        &content,
        "copy within, permanent",
    );
}

/// Races two copies in opposite directions between the same windows of two volumes (`len`
/// bytes at `at`), beside a copy that conflicts with neither and a sync that keeps the commit
/// lock busy, `rounds` times. One copy after the other leaves both windows equal (both `x`,
/// or both `y`); applied from the state before both they would swap, and interleaved steps
/// could leave either anything else. Fresh volumes each round when `fresh` (stacks stay
/// short); otherwise the same two, whose stacks grow with each round's frozen layers.
fn race_opposite_copies(pool: &Pool, rounds: u64, at: u64, len: u64, fresh: bool) {
    let blocks = len.div_ceil(BLOCK);
    let (x, y) = (data(1, blocks), data(10_000, blocks));
    let (x, y) = (&x[..len as usize], &y[..len as usize]);
    let mut volumes = None;
    for round in 0..rounds {
        if fresh || volumes.is_none() {
            if let Some((a, b)) = volumes.take() {
                drop((a, b));
                pool.delete_volume("a").expect("delete a");
                pool.delete_volume("b").expect("delete b");
            }
            let a = pool.create_volume("a", 8 * MIB).expect("a");
            let b = pool.create_volume("b", 8 * MIB).expect("b");
            b.write(2 * MIB, &data(20_000, 256), false).expect("write");
            volumes = Some((a, b));
        }
        let (a, b) = volumes.as_ref().expect("made above");
        a.write(at, x, false).expect("write a");
        b.write(at, y, false).expect("write b");
        let start = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            s.spawn(|| {
                start.wait();
                b.copy_from(a, at, at, len).expect("a to b");
            });
            s.spawn(|| {
                start.wait();
                a.copy_from(b, at, at, len).expect("b to a");
            });
            s.spawn(|| {
                start.wait();
                a.copy_from(b, 2 * MIB, 4 * MIB, MIB).expect("disjoint");
            });
            start.wait();
            pool.sync().expect("sync");
        });
        let mut got_a = vec![0u8; len as usize];
        let mut got_b = vec![0u8; len as usize];
        a.read(at, &mut got_a).expect("read a");
        b.read(at, &mut got_b).expect("read b");
        assert!(
            got_a == got_b,
            "round {round}: the two windows differ (swapped: {})",
            got_a == y && got_b == x
        );
        assert!(
            got_a == x || got_a == y,
            "round {round}: neither source's data"
        );
    }
    pool.verify().expect("verify");
    drop(volumes);
    pool.delete_volume("a").expect("delete a");
    pool.delete_volume("b").expect("delete b");
}

#[test]
fn conflicting_copies_by_frames_in_flight_apply_one_after_the_other() {
    // Copies waiting for the commit lock are applied together by the first to take it, each
    // from its source as it was before the batch: two that conflict must never be in one.
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    race_opposite_copies(&pool, 40, 0, MIB, true);
}

#[test]
fn conflicting_copies_of_every_other_kind_apply_one_after_the_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    // Bytes copied as data (an unaligned window).
    race_opposite_copies(&pool, 20, 512, MIB - 1024, false);
    // Block references shared: past the stack's frame limit (the same volumes, whose
    // stacks grow a frozen layer per round and are not flattened) a copy shares references.
    race_opposite_copies(&pool, 100, 0, MIB, false);
}

#[test]
fn a_volume_deleted_under_copies_in_flight_fails_only_the_copies_that_use_it() {
    // Copies in flight into two volumes, one deleted meanwhile: a batch that meets the
    // deleted volume fails its copies with NotFound and still applies the others.
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let src = pool.create_volume("src", 16 * MIB).expect("src");
    let kept = pool.create_volume("kept", 16 * MIB).expect("kept");
    let content = data(5, 4096);
    src.write(0, &content, false).expect("write");
    for round in 0..20 {
        let doomed = pool.create_volume("doomed", 16 * MIB).expect("doomed");
        let next = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| loop {
                    let seg = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seg >= 16 {
                        return;
                    }
                    match doomed.copy_from(&src, seg * MIB, seg * MIB, MIB) {
                        Ok(_) | Err(ibid_engine::Error::NotFound(_)) => {}
                        Err(e) => panic!("round {round}: copy into the deleted volume: {e}"),
                    }
                    kept.copy_from(&src, seg * MIB, seg * MIB, MIB)
                        .unwrap_or_else(|e| {
                            panic!("round {round}: a copy not into the deleted volume: {e}")
                        });
                });
            }
            while next.load(std::sync::atomic::Ordering::Relaxed) < 4 {
                std::thread::yield_now();
            }
            pool.delete_volume("doomed").expect("delete");
        });
    }
    assert_same(&read_all(&kept), &content, "kept");
    assert_eq!(kept.mapped_blocks(), 4096);
    pool.verify().expect("verify");
}

#[test]
fn copies_within_a_volume_overlap_like_memmove_and_nest_through_other_copies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let a = pool.create_volume("a", 16 * MIB).expect("a");
    let b = pool.create_volume("b", 16 * MIB).expect("b");
    let mut model_a = data(11, 4096);
    // Holes and zeros in the source: a copy must carry them too.
    model_a[3 * MIB as usize..4 * MIB as usize].fill(0);
    a.write(0, &model_a, false).expect("write a");
    let mut model_b = data(50_000, 4096);
    b.write(0, &model_b, false).expect("write b");

    // Forward and backward overlapping copies within a (with a 512-byte unaligned edge).
    a.copy_from(&a, 512, 2 * MIB + 512, 6 * MIB)
        .expect("forward");
    model_a.copy_within(512..512 + 6 * MIB as usize, 2 * MIB as usize + 512);
    assert_same(&read_all(&a), &model_a, "a after the forward copy");
    a.copy_from(&a, 5 * MIB, 4 * MIB, 8 * MIB)
        .expect("backward");
    model_a.copy_within(5 * MIB as usize..13 * MIB as usize, 4 * MIB as usize);
    assert_same(&read_all(&a), &model_a, "a after the backward copy");

    // b gets part of a, shifted; then a writes over it; then a copy of b's window goes back
    // into a, shifted again: frames of frames.
    b.copy_from(&a, 2 * MIB, 9 * MIB, 5 * MIB).expect("a to b");
    model_b[9 * MIB as usize..14 * MIB as usize]
        .copy_from_slice(&model_a[2 * MIB as usize..7 * MIB as usize]);
    let patch = data(90_000, 64);
    a.write(2 * MIB, &patch, false).expect("patch a");
    model_a[2 * MIB as usize..2 * MIB as usize + patch.len()].copy_from_slice(&patch);
    b.write_zeroes(10 * MIB, 256 * 1024, false)
        .expect("zero in b's window");
    model_b[10 * MIB as usize..10 * MIB as usize + 256 * 1024].fill(0);
    a.copy_from(&b, 8 * MIB, MIB, 7 * MIB).expect("b to a");
    model_a[MIB as usize..8 * MIB as usize]
        .copy_from_slice(&model_b[8 * MIB as usize..15 * MIB as usize]);
    assert_same(&read_all(&a), &model_a, "a");
    assert_same(&read_all(&b), &model_b, "b");
    assert_eq!(
        a.mapped_blocks(),
        model_a
            .chunks(BLOCK as usize)
            .filter(|c| c.iter().any(|&x| x != 0))
            .count() as u64
    );
    pool.verify().expect("verify");
    pool.gc_now().expect("gc");
    assert_same(&read_all(&a), &model_a, "a made permanent");
    assert_same(&read_all(&b), &model_b, "b made permanent");
    pool.verify().expect("verify after gc");
}

#[test]
fn a_copy_survives_a_crash_and_later_writes_replay_over_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let pool = Pool::create(&path, config()).expect("create");
    let src = pool.create_volume("src", 8 * MIB).expect("src");
    let dst = pool.create_volume("dst", 8 * MIB).expect("dst");
    let content = data(3, 2048);
    src.write(0, &content, false).expect("write");
    dst.copy_from(&src, 0, 0, 8 * MIB).expect("copy");
    let mut model = content.clone();
    let patch = data(70_000, 16);
    dst.write(MIB, &patch, false).expect("write over the copy");
    model[MIB as usize..MIB as usize + patch.len()].copy_from_slice(&patch);
    pool.flush().expect("flush");
    drop((src, dst));
    pool.simulate_crash();
    let pool = Pool::open(&path, config()).expect("reopen");
    assert_same(
        &read_all(&pool.volume("dst").expect("dst")),
        &model,
        "dst after the crash",
    );
    assert_same(
        &read_all(&pool.volume("src").expect("src")),
        &content,
        "src after the crash",
    );
    pool.verify().expect("verify");
}

#[test]
fn scattered_copies_stop_adding_frames_at_the_limit_and_stay_correct() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let src = pool.create_volume("src", 64 * MIB).expect("src");
    let dst = pool.create_volume("dst", 64 * MIB).expect("dst");
    let content = data(5, 16384);
    src.write(0, &content, false).expect("write");
    let mut model = vec![0u8; 64 * MIB as usize];
    // Every copy lands 2 MiB further but reads 1 MiB further: no two groups can merge.
    for i in 0..40u64 {
        let (s, d) = (
            (i * MIB) % (63 * MIB),
            (i * 2 * MIB + 512 * 1024) % (62 * MIB),
        );
        dst.copy_from(&src, s, d, MIB).expect("copy");
        model[d as usize..(d + MIB) as usize]
            .copy_from_slice(&content[s as usize..(s + MIB) as usize]);
    }
    assert!(dst.stack_depth() <= 64, "depth {}", dst.stack_depth());
    assert_same(&read_all(&dst), &model, "dst");
    pool.verify().expect("verify");
    pool.gc_now().expect("gc");
    assert_eq!(dst.stack_depth(), 1);
    assert_same(&read_all(&dst), &model, "dst made permanent");
    pool.verify().expect("verify after gc");
}

#[test]
fn a_copy_of_a_layered_source_reads_the_same_before_and_after_it_is_made_permanent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let src = pool.create_volume("src", 8 * MIB).expect("src");
    let mut model = vec![0u8; 8 * MIB as usize];
    for (i, at) in [0u64, 3 * MIB, MIB + 4096].into_iter().enumerate() {
        let d = data(1000 * (i as u64 + 1), 512);
        src.write(at, &d, false).expect("write");
        model[at as usize..at as usize + d.len()].copy_from_slice(&d);
        src.write_zeroes(at + 4 * 4096, 8 * 4096, false)
            .expect("zero");
        model[(at + 4 * 4096) as usize..(at + 12 * 4096) as usize].fill(0);
        pool.create_snapshot("src", &format!("s{i}"))
            .expect("snapshot");
    }
    let dst = pool.create_volume("dst", 8 * MIB).expect("dst");
    dst.copy_from(&src, 0, 0, 8 * MIB).expect("copy");
    assert_same(&read_all(&dst), &model, "dst before it is made permanent");
    for i in 0..3 {
        pool.delete_snapshot("src", &format!("s{i}"))
            .expect("delete");
    }
    pool.gc_now().expect("gc");
    assert_same(&read_all(&dst), &model, "dst made permanent");
    assert_same(&read_all(&src), &model, "src");
    pool.verify().expect("verify");
}

/// A full clone counts the bytes it walked; stopped before its walk, it is still a clone that
/// reads like its source (through the source's layers) and verifies, and the walk done later
/// by the background leaves the same bytes.
#[test]
fn a_full_clone_reports_its_walk_and_can_stop_early() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), config()).expect("create");
    let src = pool.create_volume("src", 8 * MIB).expect("src");
    let want = data(5, 8 * MIB / BLOCK);
    src.write(0, &want, false).expect("write");
    let walked = AtomicU64::new(0);
    let whole = pool
        .full_clone_with("src", "whole", &AtomicBool::new(false), &walked)
        .expect("full clone");
    assert_eq!(walked.load(Ordering::Relaxed), 8 * MIB);
    assert_same(&read_all(&whole), &want, "whole");
    let walked = AtomicU64::new(0);
    let stopped = pool
        .full_clone_with("src", "stopped", &AtomicBool::new(true), &walked)
        .expect("stopped clone");
    assert!(walked.load(Ordering::Relaxed) < 8 * MIB);
    assert_same(&read_all(&stopped), &want, "stopped");
    pool.verify().expect("verify");
    pool.gc_now().expect("gc");
    assert_same(
        &read_all(&stopped),
        &want,
        "stopped, after the background walk",
    );
    pool.close().expect("close");
}
