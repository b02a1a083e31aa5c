//! Pools made by older engines open with this one. Each fixture in `tests/fixtures/` is a pool
//! built by the engine of an older commit (`make.sh` names them; `make_fixture.rs` is what they
//! ran) with the blocks every volume and snapshot read back then. Opened here, the pool is
//! upgraded to the current format, replays the old journal where the fixture was left as a
//! crash leaves it, reads exactly what the old engine read, verifies, and goes on living: new
//! writes (some deduplicated against old chunks), deletions, collection and a reopen.

mod common;

use common::{quiet_config, random_block, stored_version};
use ibid_engine::meta::POOL_FORMAT_VERSION;
use ibid_engine::Pool;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const BLOCK: u64 = 4096;

/// What a pool holds: per volume or snapshot (`VOLUME@SNAPSHOT`), its size and the BLAKE3 of
/// every block that is not all zeros.
#[derive(Clone, Debug, Default, PartialEq)]
struct Contents {
    volumes: BTreeMap<String, (u64, BTreeMap<u64, String>)>,
    snapshots: BTreeMap<String, (u64, BTreeMap<u64, String>)>,
}

impl Contents {
    /// Parses a fixture's `expected.txt` (format in `make_fixture.rs`).
    fn parse(text: &str) -> Contents {
        let mut c = Contents::default();
        let mut current: Option<(bool, String)> = None;
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            match f[..] {
                [kind @ ("volume" | "snapshot"), name, size] => {
                    let is_volume = kind == "volume";
                    let size: u64 = size.parse().expect("size");
                    let table = if is_volume {
                        &mut c.volumes
                    } else {
                        &mut c.snapshots
                    };
                    table.insert(name.to_string(), (size, BTreeMap::new()));
                    current = Some((is_volume, name.to_string()));
                }
                [name, block, hash] => {
                    let (is_volume, cur) = current.as_ref().expect("a block before its volume");
                    assert_eq!(name, cur, "block line of another volume: {line}");
                    let table = if *is_volume {
                        &mut c.volumes
                    } else {
                        &mut c.snapshots
                    };
                    let blocks = &mut table.get_mut(cur).expect("volume").1;
                    blocks.insert(block.parse().expect("block"), hash.to_string());
                }
                _ => panic!("bad line in expected.txt: {line}"),
            }
        }
        c
    }

    /// Records a write of whole blocks at block `first` of `volume`.
    fn wrote(&mut self, volume: &str, first: u64, data: &[u8]) {
        let blocks = &mut self.volumes.get_mut(volume).expect("volume").1;
        for (i, b) in data.chunks(BLOCK as usize).enumerate() {
            let at = first + i as u64;
            if b.iter().all(|&x| x == 0) {
                blocks.remove(&at);
            } else {
                blocks.insert(at, blake3::hash(b).to_hex().to_string());
            }
        }
    }
}

/// Reads every volume and snapshot of `pool` as `Contents`.
fn read_all(pool: &Pool) -> Contents {
    let mut c = Contents::default();
    let read = |v: &ibid_engine::Volume| {
        let mut blocks = BTreeMap::new();
        let mut buf = vec![0u8; BLOCK as usize];
        for b in 0..v.size() / BLOCK {
            v.read(b * BLOCK, &mut buf).expect("read");
            if buf.iter().any(|&x| x != 0) {
                blocks.insert(b, blake3::hash(&buf).to_hex().to_string());
            }
        }
        (v.size(), blocks)
    };
    for info in pool.list_volumes() {
        let v = pool.volume(&info.name).expect("volume");
        c.volumes.insert(info.name.clone(), read(&v));
    }
    for s in pool.list_snapshots(None) {
        let snap = pool.snapshot(&s.volume, &s.name).expect("snapshot");
        c.snapshots
            .insert(format!("{}@{}", s.volume, s.name), read(&snap));
    }
    c
}

/// Asserts that `pool` holds `want`, naming the first differing block.
fn assert_holds(pool: &Pool, want: &Contents, when: &str) {
    let got = read_all(pool);
    for (kind, w, g) in [
        ("volume", &want.volumes, &got.volumes),
        ("snapshot", &want.snapshots, &got.snapshots),
    ] {
        assert_eq!(
            w.keys().collect::<Vec<_>>(),
            g.keys().collect::<Vec<_>>(),
            "{when}: {kind}s"
        );
        for (name, (size, blocks)) in w {
            let (got_size, got_blocks) = &g[name];
            assert_eq!(size, got_size, "{when}: size of {kind} {name}");
            let all: std::collections::BTreeSet<&u64> =
                blocks.keys().chain(got_blocks.keys()).collect();
            for b in all {
                assert_eq!(
                    blocks.get(b),
                    got_blocks.get(b),
                    "{when}: block {b} of {kind} {name} (None: zeros)"
                );
            }
        }
    }
}

/// Unpacks fixture `name` into a new temporary directory; (the directory, the pool's path,
/// what its volumes and snapshots held).
fn unpack(name: &str) -> (tempfile::TempDir, std::path::PathBuf, Contents) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let dir = tempfile::tempdir().expect("tempdir");
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(&fixture)
        .arg("-C")
        .arg(dir.path())
        .status()
        .expect("run tar");
    assert!(status.success(), "unpacking {}", fixture.display());
    let expected = std::fs::read_to_string(dir.path().join("expected.txt")).expect("expected");
    let pool = dir.path().join("pool");
    (dir, pool, Contents::parse(&expected))
}

/// Opens the pool of fixture `name` (format `version`) and checks it as the module doc says.
fn opens_and_lives_on(name: &str, version: u64) {
    let (_dir, path, mut want) = unpack(name);
    assert_eq!(stored_version(&path), version, "the fixture's format");
    assert!(!want.volumes.is_empty(), "the fixture lists its volumes");

    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open the old pool");
    // The record is read once the pool is closed: a second redb database on a file the pool
    // is writing can find it mid-commit (and would repair it under the pool).
    assert_holds(&pool, &want, "opened");
    pool.verify().expect("verify after the upgrade");

    // New life: a snapshot and a clone of an old volume, overwrites, a block deduplicated
    // against an old chunk, deletions.
    pool.create_snapshot("plain", "after")
        .expect("snapshot an old volume");
    let plain_then = want.volumes["plain"].clone();
    want.snapshots
        .insert("plain@after".to_string(), plain_then.clone());
    pool.clone_volume("plain@after", "later")
        .expect("clone the new snapshot");
    want.volumes.insert("later".to_string(), plain_then);
    let plain = pool.volume("plain").expect("plain");
    let fresh_blocks: Vec<u8> = (0..4).flat_map(|i| random_block(90_000 + i)).collect();
    plain.write(0, &fresh_blocks, false).expect("overwrite");
    want.wrote("plain", 0, &fresh_blocks);
    let mut old = vec![0u8; BLOCK as usize];
    plain.read(32 * BLOCK, &mut old).expect("read an old block");
    assert!(old.iter().any(|&x| x != 0), "block 32 of plain holds data");
    let fresh = pool.create_volume("fresh", 1 << 20).expect("fresh");
    fresh.write(0, &old, false).expect("write a duplicate");
    want.volumes
        .insert("fresh".to_string(), (1 << 20, BTreeMap::new()));
    want.wrote("fresh", 0, &old);
    drop((plain, fresh));
    pool.delete_volume("grown").expect("delete grown");
    want.volumes.remove("grown");
    if want.snapshots.contains_key("plain@s1") {
        pool.delete_snapshot("plain", "s1").expect("delete s1");
        want.snapshots.remove("plain@s1");
        pool.delete_volume("plain-clone").expect("delete the clone");
        want.volumes.remove("plain-clone");
    }
    pool.delete_snapshot("plain", "after")
        .expect("delete the new snapshot");
    want.snapshots.remove("plain@after");
    pool.flush().expect("flush");
    pool.gc_now().expect("collect");
    assert_holds(&pool, &want, "after new writes and deletions");
    pool.verify().expect("verify after new writes");
    pool.close().expect("close");
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");

    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    assert_holds(&pool, &want, "reopened");
    pool.verify().expect("verify after reopening");
    pool.close().expect("close");
}

#[test]
fn a_pool_made_by_the_first_engine_opens() {
    opens_and_lives_on("pool-v1.tar.gz", 1);
}

#[test]
fn a_format_5_pool_with_snapshots_clones_frames_and_an_unreplayed_journal_opens() {
    opens_and_lives_on("pool-v5.tar.gz", 5);
}

#[test]
fn a_format_7_pool_with_snapshots_clones_frames_and_an_unreplayed_journal_opens() {
    opens_and_lives_on("pool-v7.tar.gz", 7);
}

#[test]
fn a_format_8_pool_left_by_a_crash_opens() {
    opens_and_lives_on("pool-v8.tar.gz", 8);
}

#[test]
fn a_format_10_pool_has_its_map_moved_into_pages() {
    opens_and_lives_on("pool-v10.tar.gz", 10);
}

#[test]
fn a_format_11_pool_opens_with_its_map_writes_deferred_from_then_on() {
    opens_and_lives_on("pool-v11.tar.gz", 11);
}

#[test]
fn a_format_12_pool_has_its_reference_log_cut_in_this_formats_slices() {
    opens_and_lives_on("pool-v12.tar.gz", 12);
}

#[test]
fn a_format_13_pool_has_its_whole_page_log_rows_read_beside_new_deltas() {
    opens_and_lives_on("pool-v13.tar.gz", 13);
}

#[test]
fn a_format_14_pool_has_its_fingerprints_moved_out_of_its_chunk_records() {
    opens_and_lives_on("pool-v14.tar.gz", 14);
}
