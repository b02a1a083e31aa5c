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

/// Deleting a remote snapshot and collecting frees the packs only it named, keeps the other
/// snapshot whole (it verifies and restores), and a GC is refused while a push holds its lock.
#[test]
fn gc_deletes_only_unreferenced_packs() {
    let (_d, pool) = pool();
    let v = pool.create_volume("v", 32 * MIB).expect("create");
    v.write(0, &noise(1, (16 * MIB) as usize), false)
        .expect("fill");
    pool.create_snapshot("v", "old").expect("snapshot");
    v.write(0, &noise(2, (16 * MIB) as usize), false)
        .expect("rewrite");
    pool.create_snapshot("v", "new").expect("snapshot");
    let store = Arc::new(InMemory::new());
    let remote = Remote::new(store.clone());
    let rt = rt();
    for s in ["old", "new"] {
        rt.block_on(remote.push(&pool, "v", s, Arc::default()))
            .expect("push");
    }
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
