//! Push, restore, GC and verify against the engine (a real pool in a temporary directory) and
//! `object_store`'s in-memory store. The same paths run against Ceph RGW in the binary's
//! integration tests (crates/ibid/tests/offload.rs).

use super::*;
use ibid_engine::{Pool, PoolConfig};
use object_store::memory::InMemory;
use object_store::PutPayload;

const MIB: u64 = 1 << 20;

fn pool() -> (tempfile::TempDir, Pool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), PoolConfig::default()).expect("pool");
    (dir, pool)
}

/// Deterministic incompressible-ish bytes (xorshift), different per `seed`.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn read_all(pool: &Pool, name: &str) -> Vec<u8> {
    let v = pool.volume(name).expect("volume");
    let mut buf = vec![0u8; v.size() as usize];
    v.read(0, &mut buf).expect("read");
    buf
}

fn read_snapshot(pool: &Pool, volume: &str, snap: &str) -> Vec<u8> {
    let v = pool.snapshot(volume, snap).expect("snapshot");
    let mut buf = vec![0u8; v.size() as usize];
    v.read(0, &mut buf).expect("read");
    buf
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A volume with data, zeros and a repeated region: a snapshot of it restores byte for byte,
/// repeated chunks are stored once, and pushing the same snapshot again is refused.
#[test]
fn push_then_restore_gives_the_same_bytes() {
    let (_d, pool) = pool();
    let v = pool.create_volume("v", 24 * MIB + 512 * 7).expect("create");
    v.write(0, &noise(1, (8 * MIB) as usize), false)
        .expect("write");
    v.write(12 * MIB, &noise(1, (2 * MIB) as usize), false)
        .expect("write dup");
    v.write(24 * MIB, &noise(2, 512 * 7), false)
        .expect("write tail");
    pool.create_snapshot("v", "s1").expect("snapshot");
    let remote = Remote::new(Arc::new(InMemory::new()));
    let rt = rt();
    let progress = Arc::new(Progress::default());
    let report = rt
        .block_on(remote.push(&pool, "v", "s1", progress.clone()))
        .expect("push");
    let done = progress.bytes_done.load(Relaxed);
    assert_eq!(done, progress.bytes_total.load(Relaxed));
    assert_eq!(done, 8 * MIB + 2 * MIB + 512 * 7);
    // 8 MiB + the tail unique; the 2 MiB copy is skipped.
    assert_eq!(report.chunks_sent, 128 + 1);
    assert_eq!(report.chunks_skipped, 32);
    assert!(
        report.bytes_sent >= 8 * MIB && report.bytes_sent < 9 * MIB,
        "{report:?}"
    );
    // Read: the sent chunks, whole (the tail's 7 sectors in the last).
    assert_eq!(report.bytes_read, 8 * MIB + 512 * 7, "{report:?}");
    let again = rt.block_on(remote.push(&pool, "v", "s1", Arc::default()));
    assert!(matches!(again, Err(Error::AlreadyExists(_))), "{again:?}");
    let restored = rt
        .block_on(remote.restore(&pool, "v", "s1", "copy", Arc::default()))
        .expect("restore");
    assert_eq!(restored.size_bytes, 24 * MIB + 512 * 7);
    assert_eq!(read_all(&pool, "copy"), read_snapshot(&pool, "v", "s1"));
    let list = rt.block_on(remote.list()).expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].volume.as_str(), list[0].name.as_str()),
        ("v", "s1")
    );
    assert_eq!(list[0].data_bytes, 10 * MIB + 512 * 7);
}

/// After 1 % of the volume changes (writes of 2 MiB and 512 KiB at 4 KiB-aligned offsets that
/// are not chunk-aligned), the next push sends at most 1.2 % of the volume's data (the changed
/// chunks, the new manifest, one index segment), and both snapshots restore exactly.
#[test]
fn incremental_push_sends_only_what_changed() {
    let (_d, pool) = pool();
    let size = 256 * MIB;
    let v = pool.create_volume("v", size).expect("create");
    for i in 0..64 {
        v.write(i * 4 * MIB, &noise(100 + i, (4 * MIB) as usize), false)
            .expect("fill");
    }
    pool.create_snapshot("v", "a").expect("snapshot a");
    let remote = Remote::new(Arc::new(InMemory::new()));
    let rt = rt();
    rt.block_on(remote.push(&pool, "v", "a", Arc::default()))
        .expect("push a");
    // 1 % of 256 MiB: 2.56 MiB.
    let changes = [
        (37 * MIB + 4096 * 5, 2 * MIB),
        (201 * MIB + 4096 * 77, 573 * 1024),
    ];
    for (i, (off, len)) in changes.into_iter().enumerate() {
        v.write(off, &noise(900 + i as u64, len as usize), false)
            .expect("change");
    }
    pool.create_snapshot("v", "b").expect("snapshot b");
    let report = rt
        .block_on(remote.push(&pool, "v", "b", Arc::default()))
        .expect("push b");
    let limit = size * 12 / 1000;
    assert!(
        report.bytes_sent <= limit,
        "sent {} > {limit}: {report:?}",
        report.bytes_sent
    );
    assert!(report.chunks_sent >= 41, "{report:?}");
    // Unchanged chunks are named from the pool's fingerprints, not read.
    assert_eq!(report.data_bytes, size, "{report:?}");
    assert_eq!(
        report.bytes_read,
        report.chunks_sent * format::CHUNK_BYTES,
        "{report:?}"
    );
    for s in ["a", "b"] {
        let name = format!("r{s}");
        rt.block_on(remote.restore(&pool, "v", s, &name, Arc::default()))
            .expect("restore");
        assert_eq!(read_all(&pool, &name), read_snapshot(&pool, "v", s), "{s}");
    }
}

/// A push stopped after its first packs (as a kill would stop it) leaves no snapshot in the
/// remote; pushing again completes, reuses the packs already there, and restores exactly.
#[test]
fn an_interrupted_push_completes_when_run_again() {
    let (_d, pool) = pool();
    let v = pool.create_volume("v", 48 * MIB).expect("create");
    v.write(0, &noise(7, (48 * MIB) as usize), false)
        .expect("fill");
    pool.create_snapshot("v", "s").expect("snapshot");
    let remote = Remote::new(Arc::new(InMemory::new()));
    let rt = rt();
    let progress = Arc::new(Progress::default());
    let watcher = {
        let progress = progress.clone();
        std::thread::spawn(move || {
            while progress.bytes_transferred.load(Relaxed) < 16 * MIB {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            progress.cancel();
        })
    };
    let first = rt.block_on(remote.push(&pool, "v", "s", progress.clone()));
    watcher.join().expect("watcher");
    assert!(matches!(first, Err(Error::Cancelled)), "{first:?}");
    assert!(rt.block_on(remote.list()).expect("list").is_empty());
    let report = rt
        .block_on(remote.push(&pool, "v", "s", Arc::default()))
        .expect("push again");
    assert!(
        report.chunks_skipped > 0 || report.pack_bytes_sent < 48 * MIB,
        "{report:?}"
    );
    rt.block_on(remote.restore(&pool, "v", "s", "r", Arc::default()))
        .expect("restore");
    assert_eq!(read_all(&pool, "r"), read_snapshot(&pool, "v", "s"));
    let verify = rt.block_on(remote.verify()).expect("verify");
    assert!(verify.ok, "{verify:?}");
}

/// A 32 MiB volume `v` with snapshots pushed to an in-memory remote: `old` (16 MiB of noise),
/// then `new` (the first `rewrite_mib` MiB written again).
fn old_and_new_pushed(
    rt: &tokio::runtime::Runtime,
    rewrite_mib: u64,
) -> (tempfile::TempDir, Pool, Arc<InMemory>, Remote) {
    let (d, pool) = pool();
    let v = pool.create_volume("v", 32 * MIB).expect("create");
    v.write(0, &noise(1, (16 * MIB) as usize), false)
        .expect("fill");
    pool.create_snapshot("v", "old").expect("snapshot");
    v.write(0, &noise(2, (rewrite_mib * MIB) as usize), false)
        .expect("rewrite");
    pool.create_snapshot("v", "new").expect("snapshot");
    let store = Arc::new(InMemory::new());
    let remote = Remote::new(store.clone());
    for s in ["old", "new"] {
        rt.block_on(remote.push(&pool, "v", s, Arc::default()))
            .expect("push");
    }
    (d, pool, store, remote)
}

/// Deleting a remote snapshot and collecting frees the packs only it named, keeps the other
/// snapshot whole (it verifies and restores), and a GC is refused while a push holds its lock.
#[test]
fn gc_deletes_only_unreferenced_packs() {
    let rt = rt();
    let (_d, pool, _store, remote) = old_and_new_pushed(&rt, 16);
    let busy = rt.block_on(async {
        let held = remote.lock(lock::Kind::Push).await.expect("push lock");
        let gc = remote.gc().await;
        held.release().await;
        gc
    });
    assert!(matches!(busy, Err(Error::Busy(_))), "{busy:?}");
    rt.block_on(remote.delete("v", "old")).expect("delete");
    assert!(matches!(
        rt.block_on(remote.delete("v", "old")),
        Err(Error::NotFound(_))
    ));
    let gc = rt.block_on(remote.gc()).expect("gc");
    assert!(
        gc.packs_deleted >= 2 && gc.bytes_freed >= 15 * MIB,
        "{gc:?}"
    );
    let verify = rt.block_on(remote.verify()).expect("verify");
    assert!(verify.ok && verify.unreferenced_packs == 0, "{verify:?}");
    rt.block_on(remote.restore(&pool, "v", "new", "r", Arc::default()))
        .expect("restore");
    assert_eq!(read_all(&pool, "r"), read_snapshot(&pool, "v", "new"));
    // A second GC finds nothing to do.
    assert_eq!(rt.block_on(remote.gc()).expect("gc").packs_deleted, 0);
}

/// GC repacks a pack that deleted snapshots left mostly garbage: its live chunks move to a
/// new pack, the manifest naming them is rewritten, the old pack goes. Restores that read the
/// manifest before (a full one, an instant one) follow the moved chunks; a deletion and a
/// second GC wait while a GC holds the remote.
#[test]
fn gc_repacks_mostly_garbage_packs_and_restores_follow() {
    let rt = rt();
    // Packs seal at 8 MiB: "old" has chunks of 0..8 MiB in one pack, 8..16 MiB in another;
    // "new" keeps only 14..16 MiB of it, a quarter of the second pack.
    let (_d, pool, store, remote) = old_and_new_pushed(&rt, 14);
    let stale = Arc::new(rt.block_on(remote.manifest("v", "new")).expect("manifest"));
    let marks = tempfile::tempdir().expect("marks dir");
    let ir = rt
        .block_on(remote.instant_restore(&pool, "v", "new", "ir", marks.path()))
        .expect("instant restore");
    rt.block_on(remote.delete("v", "old")).expect("delete");
    let before = bucket_bytes(&rt, &store);

    let (deletion, second) = rt.block_on(async {
        let held = remote.lock(lock::Kind::Gc).await.expect("gc lock");
        let deletion = remote.delete("v", "new").await;
        let second = remote.gc().await;
        held.release().await;
        (deletion, second)
    });
    assert!(matches!(deletion, Err(Error::Busy(_))), "{deletion:?}");
    assert!(matches!(second, Err(Error::Busy(_))), "{second:?}");

    let gc = rt.block_on(remote.gc()).expect("gc");
    assert_eq!(
        (gc.packs_repacked, gc.chunks_moved, gc.manifests_rewritten),
        (1, 32, 1),
        "{gc:?}"
    );
    assert!(gc.packs_deleted >= 2, "{gc:?}");
    assert!(
        gc.bytes_written > 2 * MIB && gc.bytes_written < 2 * MIB + 64 * 1024,
        "{gc:?}"
    );
    let after = bucket_bytes(&rt, &store);
    assert!(before - after >= 13 * MIB, "{before} -> {after}");
    let verify = rt.block_on(remote.verify()).expect("verify");
    assert!(verify.ok && verify.unreferenced_packs == 0, "{verify:?}");
    assert_eq!(verify.chunks_checked, 256, "{verify:?}");

    let want = read_snapshot(&pool, "v", "new");
    rt.block_on(remote.restore(&pool, "v", "new", "r1", Arc::default()))
        .expect("restore");
    assert_eq!(read_all(&pool, "r1"), want);
    // A restore that read the manifest before the GC finds the moved chunks.
    rt.block_on(remote.restore_from(
        &pool,
        stale,
        "r2",
        Arc::default(),
        std::time::Instant::now(),
    ))
    .expect("restore from the stale manifest");
    assert_eq!(read_all(&pool, "r2"), want);
    assert_eq!(read_through(&ir, 0, (32 * MIB) as usize), want);
    rt.block_on(ir.fill(Arc::default(), None)).expect("fill");
    assert!(ir.is_complete());

    // Nothing left to repack.
    let again = rt.block_on(remote.gc()).expect("gc");
    assert_eq!(
        (again.packs_repacked, again.packs_deleted),
        (0, 0),
        "{again:?}"
    );
}

/// A flipped byte in a pack is reported by verify and fails a restore, which then leaves no
/// half-restored volume behind.
#[test]
fn damage_is_found_by_verify_and_refused_by_restore() {
    let (_d, pool) = pool();
    let v = pool.create_volume("v", 8 * MIB).expect("create");
    v.write(0, &noise(3, (8 * MIB) as usize), false)
        .expect("fill");
    pool.create_snapshot("v", "s").expect("snapshot");
    let store = Arc::new(InMemory::new());
    let remote = Remote::new(store.clone());
    let rt = rt();
    rt.block_on(remote.push(&pool, "v", "s", Arc::default()))
        .expect("push");
    rt.block_on(async {
        let packs: Vec<_> = store
            .list(Some(&Path::from("packs")))
            .try_collect()
            .await
            .expect("list");
        let path = &packs[0].location;
        let mut bytes = store
            .get(path)
            .await
            .expect("get")
            .bytes()
            .await
            .expect("bytes")
            .to_vec();
        bytes[100_000] ^= 0x40;
        store.put(path, PutPayload::from(bytes)).await.expect("put");
    });
    let verify = rt.block_on(remote.verify()).expect("verify");
    assert!(!verify.ok && verify.problem_count == 1, "{verify:?}");
    let restore = rt.block_on(remote.restore(&pool, "v", "s", "r", Arc::default()));
    assert!(matches!(restore, Err(Error::Corrupt(_))), "{restore:?}");
    assert!(
        pool.volume("r").is_err(),
        "the failed restore left its volume"
    );
}

/// Bytes of every object in `store`.
fn bucket_bytes(rt: &tokio::runtime::Runtime, store: &InMemory) -> u64 {
    rt.block_on(async {
        let all: Vec<_> = store.list(None).try_collect().await.expect("list");
        all.iter().map(|m| m.size).sum()
    })
}

/// Seven clones of one image, each snapshotted and pushed, add at most 2 % to the bucket:
/// their chunks are the image's (only manifests and index segments are new).
#[test]
fn clones_of_one_image_add_almost_nothing() {
    let (_d, pool) = pool();
    let v = pool.create_volume("golden", 32 * MIB).expect("create");
    v.write(0, &noise(11, (32 * MIB) as usize), false)
        .expect("fill");
    pool.create_snapshot("golden", "s").expect("snapshot");
    let store = Arc::new(InMemory::new());
    let remote = Remote::new(store.clone());
    let rt = rt();
    rt.block_on(remote.push(&pool, "golden", "s", Arc::default()))
        .expect("push golden");
    let before = bucket_bytes(&rt, &store);
    for i in 0..7 {
        let name = format!("vm{i}");
        pool.clone_volume("golden", &name).expect("clone");
        pool.create_snapshot(&name, "s").expect("snapshot");
        let r = rt
            .block_on(remote.push(&pool, &name, "s", Arc::default()))
            .expect("push clone");
        assert_eq!((r.chunks_sent, r.chunks_skipped), (0, 512), "{r:?}");
    }
    let after = bucket_bytes(&rt, &store);
    assert!(
        (after - before) * 100 <= before * 2,
        "7 clones added {} bytes to {before}",
        after - before
    );
}

/// A volume and a remote holding its snapshot `v@s`: 4 MiB of noise at 0, 1 MiB at 8 MiB, a
/// tail of 7 sectors at 12 MiB; the rest zeros.
fn pushed_volume(rt: &tokio::runtime::Runtime) -> (tempfile::TempDir, Pool, Remote) {
    let (d, pool) = pool();
    let v = pool.create_volume("v", 12 * MIB + 512 * 7).expect("create");
    v.write(0, &noise(21, (4 * MIB) as usize), false)
        .expect("write");
    v.write(8 * MIB, &noise(22, MIB as usize), false)
        .expect("write");
    v.write(12 * MIB, &noise(23, 512 * 7), false)
        .expect("write tail");
    pool.create_snapshot("v", "s").expect("snapshot");
    let remote = Remote::new(Arc::new(InMemory::new()));
    rt.block_on(remote.push(&pool, "v", "s", Arc::default()))
        .expect("push");
    (d, pool, remote)
}

/// The bytes of volume `r` as a host sees them through the instant restore's hooks.
fn read_through(ir: &InstantRestore, off: u64, len: usize) -> Vec<u8> {
    ir.before_read(off, len as u64).expect("fetch");
    let mut buf = vec![0u8; len];
    ir.volume().read(off, &mut buf).expect("read");
    buf
}

/// An instant-restored volume reads as the snapshot at once, fetching only the chunks read; a
/// write in part of a chunk keeps the rest of it, a write of a whole chunk fetches nothing, and
/// the fill then completes the volume without writing over either.
#[test]
fn instant_restore_fetches_on_demand_and_fills_around_writes() {
    let rt = rt();
    let (d, pool, remote) = pushed_volume(&rt);
    let snap = read_snapshot(&pool, "v", "s");
    let marks = d.path().join("marks");
    let ir = rt
        .block_on(remote.instant_restore(&pool, "v", "s", "r", &marks))
        .expect("instant restore");
    assert!(!ir.is_complete());
    assert_eq!(ir.unfetched(0, 64 << 10), vec![0..64 << 10]);
    assert_eq!(
        ir.unfetched(4 * MIB, 4 * MIB),
        vec![],
        "zeros are not fetched"
    );
    // A 4 KiB read in the second chunk fetches that chunk alone.
    let got = read_through(&ir, (64 << 10) + 4096, 4096);
    assert_eq!(got, snap[(64 << 10) + 4096..(64 << 10) + 8192]);
    let one = ir.received_bytes();
    assert!(one > 60 << 10 && one < 70 << 10, "received {one}");
    // Part of chunk 2: fetched first, then written.
    let claim = ir.before_write(2 * (64 << 10) + 512, 512).expect("partial");
    ir.volume()
        .write(2 * (64 << 10) + 512, &[7u8; 512], false)
        .expect("write");
    ir.after_write(claim, true);
    assert!(ir.received_bytes() > one);
    // Chunk 3 whole: nothing fetched.
    let before = ir.received_bytes();
    let claim = ir.before_write(3 * (64 << 10), 64 << 10).expect("whole");
    ir.volume()
        .write(3 * (64 << 10), &[9u8; 64 << 10], false)
        .expect("write");
    ir.after_write(claim, true);
    assert_eq!(ir.received_bytes(), before);
    let progress = Arc::new(Progress::default());
    rt.block_on(ir.fill(progress.clone(), None)).expect("fill");
    assert!(ir.is_complete());
    assert_eq!(
        progress.bytes_done.load(Relaxed),
        progress.bytes_total.load(Relaxed)
    );
    let mut want = snap.clone();
    want[2 * (64 << 10) + 512..2 * (64 << 10) + 1024].fill(7);
    want[3 * (64 << 10)..4 * (64 << 10)].fill(9);
    assert!(read_all(&pool, "r") == want, "restored volume differs");
    assert_eq!(ir.unfetched(0, 13 * MIB), vec![]);
}

/// After a stop, a resumed instant restore keeps what a host wrote and flushed (its marks
/// were logged) and fetches again what was written but not flushed (the snapshot's bytes: the
/// old content of a write never flushed); a torn mark at the log's end is cut.
#[test]
fn a_resumed_instant_restore_keeps_flushed_writes() {
    let rt = rt();
    let (d, pool, remote) = pushed_volume(&rt);
    let snap = read_snapshot(&pool, "v", "s");
    let dir = d.path().join("marks");
    let ir = rt
        .block_on(remote.instant_restore(&pool, "v", "s", "r", &dir))
        .expect("instant restore");
    let id = ir.volume().id();
    let marks = crate::instant::marks_file(&dir, id);
    let whole = |ir: &InstantRestore, chunk: u64, byte: u8| {
        let claim = ir.before_write(chunk << 16, 64 << 10).expect("claim");
        ir.volume()
            .write(chunk << 16, &vec![byte; 64 << 10], false)
            .expect("write");
        ir.after_write(claim, true);
    };
    whole(&ir, 5, 1);
    ir.flush().expect("flush");
    whole(&ir, 6, 2);
    // A failed write gives its claim back: the chunk is fetched later.
    let claim = ir.before_write(7 << 16, 64 << 10).expect("claim");
    ir.after_write(claim, false);
    drop(ir);
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&marks)
            .expect("open marks");
        f.write_all(&[0xAB; 11]).expect("tear");
    }
    let ir = rt
        .block_on(remote.resume_instant_restore(&pool, id, "v", "s", &dir))
        .expect("resume");
    assert_eq!(
        ir.unfetched(5 << 16, 64 << 10),
        vec![],
        "flushed write kept"
    );
    assert_eq!(ir.unfetched(6 << 16, 64 << 10), vec![6 << 16..7 << 16]);
    rt.block_on(ir.fill(Arc::default(), None)).expect("fill");
    let mut want = snap.clone();
    want[5 << 16..6 << 16].fill(1);
    assert!(read_all(&pool, "r") == want, "resumed volume differs");
    assert_eq!(
        std::fs::metadata(&marks).expect("marks").len() % 16,
        8,
        "torn tail cut (24-byte header + 16-byte records)"
    );
    // Marks of another volume's log are refused.
    assert!(matches!(
        rt.block_on(remote.resume_instant_restore(&pool, id + 1, "v", "s", &dir)),
        Err(Error::NotFound(_) | Error::Engine(_) | Error::Corrupt(_))
    ));
}

/// A fetch that was under way when a host claimed its chunk (it looked before the claim)
/// installs nothing over the host's write.
#[test]
fn a_fetch_racing_a_claim_leaves_the_host_write() {
    let rt = rt();
    let (d, pool, remote) = pushed_volume(&rt);
    let ir = rt
        .block_on(remote.instant_restore(&pool, "v", "s", "r", d.path()))
        .expect("instant restore");
    let stale = ir.absent_in(3 << 16, 64 << 10);
    assert_eq!(stale.len(), 1);
    let claim = ir.before_write(3 << 16, 64 << 10).expect("claim");
    ir.volume()
        .write(3 << 16, &[9u8; 64 << 10], false)
        .expect("write");
    ir.after_write(claim, true);
    ir.fetch_and_install(&stale).expect("late fetch");
    assert!(read_through(&ir, 3 << 16, 64 << 10) == vec![9u8; 64 << 10]);
}

/// Every chunk fetched is not yet complete: the hooks keep working until a flush has made the
/// marks of all chunks durable (a restore resumed before that would fetch again, and must not
/// write over what hosts wrote since).
#[test]
fn an_instant_restore_is_complete_once_its_marks_are_durable() {
    let rt = rt();
    let (d, pool, remote) = pushed_volume(&rt);
    let ir = rt
        .block_on(remote.instant_restore(&pool, "v", "s", "r", d.path()))
        .expect("instant restore");
    let size = ir.volume().size();
    read_through(&ir, 0, size as usize);
    assert_eq!(ir.unfetched(0, size), vec![]);
    assert!(!ir.is_complete(), "marks not durable yet");
    ir.flush().expect("flush");
    assert!(ir.is_complete());
    assert!(read_all(&pool, "r") == read_snapshot(&pool, "v", "s"));
}

/// A bucket written by format 1 (chunks named by the BLAKE3 of their bytes, packs by theirs,
/// the manifest at version 1) — built here record by record as that format wrote it —
/// verifies clean and restores exactly; a push of the same data beside it names its chunks by
/// their blocks and restores too.
#[test]
fn a_format_1_bucket_restores_beside_format_2_pushes() {
    let (_d, pool) = pool();
    let size = 2 * MIB + 512 * 3;
    let v = pool.create_volume("v", size).expect("create");
    let mut data = noise(5, size as usize);
    data[(MIB as usize)..(MIB as usize + 65536)].fill(0);
    v.write(0, &data, false).expect("write");
    pool.create_snapshot("v", "old").expect("snapshot");
    let store = Arc::new(InMemory::new());
    let remote = Remote::new(store.clone());
    let rt = rt();
    // Format 1: one pack of bytes-named records, one manifest.
    let mut pack = Vec::new();
    let mut entries = Vec::new();
    for (i, plain) in data.chunks(format::CHUNK_BYTES as usize).enumerate() {
        if plain.iter().all(|&b| b == 0) {
            continue;
        }
        let hash = *blake3::hash(plain).as_bytes();
        let offset = pack.len();
        format::encode_record(&hash, format::Naming::Bytes, plain, &mut pack);
        entries.push(format::Entry {
            chunk: i as u64,
            hash,
            at: format::Location {
                pack: 0,
                offset: offset as u32,
                stored_len: (pack.len() - offset - format::RECORD_HEADER_BYTES) as u32,
                plain_len: plain.len() as u32,
            },
        });
    }
    let pack_name = *blake3::hash(&pack).as_bytes();
    let manifest = format::Table {
        header: format::ManifestHeader {
            volume: "v".into(),
            snapshot: "old".into(),
            size_bytes: size,
            chunk_bytes: format::CHUNK_BYTES,
            created_unix_s: 1,
            pushed_unix_s: 2,
            data_bytes: entries.iter().map(|e| e.at.plain_len as u64).sum(),
        },
        packs: vec![pack_name],
        entries,
    };
    let mut bytes = format::encode_table(format::MANIFEST_MAGIC, &manifest);
    bytes.truncate(bytes.len() - 32);
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    let sum = blake3::hash(&bytes);
    bytes.extend_from_slice(sum.as_bytes());
    rt.block_on(async {
        store
            .put(&pack_path(&pack_name), PutPayload::from(pack))
            .await
            .expect("put pack");
        store
            .put(
                &manifest_path("v", "old").expect("path"),
                PutPayload::from(bytes),
            )
            .await
            .expect("put manifest");
    });
    let verify = rt.block_on(remote.verify()).expect("verify");
    assert!(verify.ok && verify.chunks_checked == 32, "{verify:?}");
    rt.block_on(remote.restore(&pool, "v", "old", "from-old", Arc::default()))
        .expect("restore format 1");
    assert_eq!(read_all(&pool, "from-old"), data);

    // A push now: the same data under other names, sent again (format 1's names are not
    // its) but for the tail, not whole blocks, which both formats name by its bytes.
    pool.create_snapshot("v", "new").expect("snapshot");
    let report = rt
        .block_on(remote.push(&pool, "v", "new", Arc::default()))
        .expect("push");
    assert_eq!(
        (report.chunks_sent, report.chunks_skipped),
        (31, 1),
        "{report:?}"
    );
    rt.block_on(remote.restore(&pool, "v", "new", "from-new", Arc::default()))
        .expect("restore format 2");
    assert_eq!(read_all(&pool, "from-new"), data);
    let verify = rt.block_on(remote.verify()).expect("verify");
    assert!(verify.ok && verify.snapshots == 2, "{verify:?}");
}

/// A resumable restore cut off after a checkpoint (here: cancelled from the checkpoint) leaves
/// its volume; run again with the packs the checkpoint named, it fetches only the others and
/// the volume equals the snapshot. Checkpoints come every `CHECKPOINT_PACKS` packs, each
/// naming more packs than the last.
#[test]
fn a_restore_cut_off_after_a_checkpoint_goes_on_from_it() {
    let (_d, pool) = pool();
    let size = 96 * MIB;
    let v = pool.create_volume("v", size).expect("create");
    v.write(0, &noise(77, size as usize), false).expect("write");
    pool.create_snapshot("v", "s").expect("snapshot");
    let remote = Remote::new(Arc::new(InMemory::new()));
    let rt = rt();
    let pushed = rt
        .block_on(remote.push(&pool, "v", "s", Arc::default()))
        .expect("push");
    assert!(pushed.packs_sent as usize > CHECKPOINT_PACKS, "{pushed:?}");
    let progress = Arc::new(Progress::default());
    let seen: Arc<parking_lot::Mutex<Vec<RestoreDone>>> = Arc::default();
    let checkpoint: Checkpoint = {
        let (seen, progress) = (seen.clone(), progress.clone());
        Arc::new(move |done: &RestoreDone| {
            seen.lock().push(done.clone());
            progress.cancel();
            Ok(())
        })
    };
    let cut = rt.block_on(remote.restore_resumable(
        &pool,
        "v",
        "s",
        "r",
        progress,
        None,
        checkpoint.clone(),
    ));
    assert!(matches!(cut, Err(Error::Cancelled)), "{cut:?}");
    let done = seen.lock().last().cloned().expect("a checkpoint");
    assert_eq!(done.len(), CHECKPOINT_PACKS);
    assert!(
        pool.volume("r").is_ok(),
        "the cut-off restore left its volume"
    );

    // Going on: only the packs not done are fetched.
    seen.lock().clear();
    let report = rt
        .block_on(remote.restore_resumable(
            &pool,
            "v",
            "s",
            "r",
            Arc::default(),
            Some(done.clone()),
            Arc::new(|_: &RestoreDone| Ok(())),
        ))
        .expect("restore goes on");
    let per_pack = pushed.pack_bytes_sent / pushed.packs_sent;
    assert!(
        report.bytes_received <= pushed.pack_bytes_sent - (done.len() as u64 - 1) * per_pack,
        "{report:?} after {} packs done of {pushed:?}",
        done.len()
    );
    assert_eq!(read_all(&pool, "r"), read_snapshot(&pool, "v", "s"));
    // A volume of another size is not gone on.
    pool.create_volume("small", MIB).expect("create");
    let wrong = rt.block_on(remote.restore_resumable(
        &pool,
        "v",
        "s",
        "small",
        Arc::default(),
        Some(done),
        checkpoint,
    ));
    assert!(matches!(wrong, Err(Error::Invalid(_))), "{wrong:?}");
    // A restore into a name another volume holds fails and leaves that volume alone.
    let other = pool.create_volume("other", MIB).expect("create");
    other.write(0, &noise(3, 4096), false).expect("write");
    let clash = rt.block_on(remote.restore(&pool, "v", "s", "other", Arc::default()));
    assert!(clash.as_ref().is_err_and(Error::before_target), "{clash:?}");
    assert_eq!(read_all(&pool, "other")[..4096], noise(3, 4096)[..]);
}
