//! The pool format version: a pool of an older version is upgraded when it is opened (its
//! record rewritten, so older builds refuse it from then on), and a pool of a newer version is
//! refused with a precise error and left as it was.

mod common;

use common::{quiet_config, random_block, stored_version};
use ibid_engine::meta::{self, POOL_FORMAT_VERSION};
use ibid_engine::store::{Reader, Store};
use ibid_engine::{Error, Pool, PoolConfig};
use std::path::Path;

/// Puts the chunk records of the pool at `dir` back in format 14's layout, if they are in
/// this one: pages of 72-byte entries (chunk id u64, then the record with its fingerprint),
/// no `chunk.fps` rows, no stale counts. Returns how many records it rewrote.
fn chunk_pages_to_format_14(dir: &Path) -> usize {
    use ibid_engine::{chunk_fps, chunk_table};
    let store = Store::open(dir).expect("store");
    let mut fps = std::collections::BTreeMap::new();
    let mut records = Vec::new();
    {
        let r = store.read().expect("read");
        chunk_fps::for_each(&r, |id, fp| {
            fps.insert(id, fp);
            Ok(())
        })
        .expect("fingerprints");
        if fps.is_empty() {
            return 0;
        }
        chunk_table::for_each(&r, |id, rec| {
            records.push((id, rec));
            Ok(())
        })
        .expect("records");
    }
    let mut pages: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
    for (id, rec) in &records {
        let page = pages.entry(chunk_table::page_of(*id)).or_default();
        page.extend_from_slice(&id.to_le_bytes());
        page.extend_from_slice(&rec.encode_v14(&fps[id]));
    }
    let mut txn = store.write().expect("write");
    for key in fps.keys().map(|&id| chunk_table::page_of(id)) {
        txn.remove(meta::CHUNK_FPS, &key);
    }
    for (key, page) in &pages {
        txn.insert(meta::CHUNK_PAGES, key, page.as_slice());
    }
    txn.remove(meta::POOL, meta::FPS_STALE_KEY);
    txn.commit().expect("commit");
    records.len()
}

/// Rewrites the version field of the stored pool record (any value, known or not); a version
/// before 15 gets its chunk records in format 14's layout first.
fn set_version(dir: &Path, version: u64) {
    if version < meta::FPS_APART_VERSION {
        chunk_pages_to_format_14(dir);
    }
    let store = Store::open(dir).expect("store");
    let mut txn = store.write().expect("write");
    let mut raw = txn
        .get(meta::POOL, meta::POOL_KEY)
        .expect("get")
        .expect("pool record");
    raw[..8].copy_from_slice(&version.to_le_bytes());
    txn.insert(meta::POOL, meta::POOL_KEY, raw.as_slice());
    txn.commit().expect("commit");
}

#[test]
fn older_pools_are_upgraded_and_newer_ones_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    {
        let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
        let v = pool.create_volume("v", 1 << 20).expect("volume");
        v.write(0, &random_block(1), false).expect("write");
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION);

    set_version(&path, 1);
    {
        let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open a version 1 pool");
        let mut got = vec![0u8; 4096];
        pool.volume("v")
            .expect("v")
            .read(0, &mut got)
            .expect("read");
        assert_eq!(got, random_block(1));
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");

    let newer = POOL_FORMAT_VERSION + 1;
    set_version(&path, newer);
    match Pool::open(&path, quiet_config(1 << 30)) {
        Err(Error::Corrupt(msg)) => assert!(
            msg.contains(&format!("unknown pool format version {newer}")),
            "{msg}"
        ),
        Err(e) => panic!("a newer pool refused with the wrong error: {e}"),
        Ok(_) => panic!("a pool of format version {newer} was opened"),
    }
    assert_eq!(
        stored_version(&path),
        newer,
        "a refused pool is left as it was"
    );
}

const FPS_RUNS: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("fps.runs");
const FPS_DEAD: redb::TableDefinition<u128, ()> = redb::TableDefinition::new("fps.dead");

/// Creates a pool at `path` holding 8 random blocks in volume `v`, with its index keys in the
/// B-tree (no runs, as before format 4), and closes it.
fn pool_with_eight_blocks(path: &Path) {
    let btree_only = PoolConfig {
        dedup_runs_max: 1,
        ..quiet_config(1 << 30)
    };
    let pool = Pool::create(path, btree_only).expect("create");
    let v = pool.create_volume("v", 1 << 20).expect("volume");
    for i in 0..8u64 {
        v.write(i * 4096, &random_block(i), false).expect("write");
    }
    pool.close().expect("close");
}

const CHUNKS: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("chunks");
const CHUNK_PAGES: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("chunk.pages");

/// Puts the chunk records of the pool at `path` back in format version 5's layout: one row per
/// chunk in `chunks` (id → record) instead of pages. Returns how many records it moved.
fn unpack_chunk_pages(path: &Path) -> usize {
    use redb::{ReadableTable, ReadableTableMetadata};
    chunk_pages_to_format_14(path);
    let db = redb::Database::open(path.join("meta.redb")).expect("redb");
    let txn = db.begin_write().expect("write");
    let mut moved = 0;
    {
        let mut pages = txn.open_table(CHUNK_PAGES).expect("chunk.pages");
        let mut rows = txn.open_table(CHUNKS).expect("chunks");
        assert_eq!(rows.len().expect("len"), 0, "rows before the unpacking");
        for item in pages.iter().expect("iter") {
            let (_, page) = item.expect("page");
            for entry in page.value().chunks(72) {
                let id = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
                rows.insert(id, &entry[8..]).expect("insert");
                moved += 1;
            }
        }
        pages.retain(|_, _| false).expect("empty the pages");
    }
    txn.commit().expect("commit");
    moved
}

/// A version 5 pool (chunk records one per row) opens upgraded: every record moved into pages
/// in the transaction that rewrites the pool record, every block reads back, verify agrees,
/// a block written again is found as a duplicate, the cleaner and deletions work on the pages,
/// and a reopen finds it all.
#[test]
fn a_version_5_pool_has_its_chunk_records_moved_into_pages() {
    use redb::ReadableTableMetadata;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    {
        let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
        let v = pool.create_volume("v", 64 << 20).expect("volume");
        for i in 0..100u64 {
            v.write(i * 4096, &random_block(i), false).expect("write");
        }
        pool.close().expect("close");
    }
    assert_eq!(unpack_chunk_pages(&path), 100);
    set_version(&path, 5);
    {
        let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open a version 5 pool");
        assert_eq!(pool.verify().expect("verify after the upgrade").chunks, 100);
        let v = pool.volume("v").expect("v");
        let mut got = vec![0u8; 4096];
        for i in 0..100u64 {
            v.read(i * 4096, &mut got).expect("read");
            assert_eq!(got, random_block(i), "block {i}");
        }
        v.write(500 * 4096, &random_block(7), false)
            .expect("write a duplicate");
        v.write_zeroes(0, 50 * 4096, false).expect("zero half");
        pool.sync().expect("sync");
        // Block 7 stays: block 500 holds it too.
        assert_eq!(pool.stats().unique_chunks, 51, "chunks after the zeroing");
        assert!(
            pool.gc_now().expect("clean") > 0,
            "the cleaner moved nothing"
        );
        assert_eq!(pool.verify().expect("verify").chunks, 51);
        for i in 50..100u64 {
            v.read(i * 4096, &mut got).expect("read after cleaning");
            assert_eq!(got, random_block(i), "block {i}");
        }
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");
    {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = redb::ReadableDatabase::begin_read(&db).expect("read");
        assert_eq!(
            txn.open_table(CHUNKS).expect("chunks").len().expect("len"),
            0
        );
        let pages = txn.open_table(CHUNK_PAGES).expect("chunk.pages");
        assert!(pages.len().expect("len") > 0);
    }
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    assert_eq!(pool.verify().expect("verify").chunks, 51);
    let mut got = vec![0u8; 4096];
    pool.volume("v")
        .expect("v")
        .read(500 * 4096, &mut got)
        .expect("read");
    assert_eq!(got, random_block(7));
}

/// A pool whose dedup index is in format version 2's form (redb table `fps.bytes`: the whole
/// fingerprint → chunk id) opens upgraded: the index rewritten with prefix keys, the record at
/// the current version, every chunk in the index (verify), and a block written again found as
/// a duplicate instead of stored a second time.
#[test]
fn a_version_2_index_is_rewritten_and_still_finds_duplicates() {
    use redb::{ReadableTable, TableDefinition};
    const FPS_V2: TableDefinition<&[u8], u64> = TableDefinition::new("fps.bytes");
    const FPS_V3: TableDefinition<u128, ()> = TableDefinition::new("fps.prefix");

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    pool_with_eight_blocks(&path);
    assert_eq!(unpack_chunk_pages(&path), 8);
    // Turn the index back into version 2's table, from the fingerprints in the chunk records.
    {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = db.begin_write().expect("write");
        {
            let chunks = txn.open_table(CHUNKS).expect("chunks");
            let mut old = txn.open_table(FPS_V2).expect("fps.bytes");
            for item in chunks.iter().expect("iter") {
                let (id, rec) = item.expect("chunk");
                old.insert(&rec.value()[32..64], id.value())
                    .expect("insert");
            }
        }
        txn.delete_table(FPS_V3).expect("delete fps.prefix");
        txn.delete_table(FPS_RUNS).expect("delete fps.runs");
        txn.delete_table(FPS_DEAD).expect("delete fps.dead");
        txn.commit().expect("commit");
    }
    set_version(&path, 2);
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open a version 2 pool");
    let report = pool.verify().expect("verify after the upgrade");
    assert_eq!(report.chunks, 8);
    let chunks = pool.stats().unique_chunks;
    {
        let v = pool.volume("v").expect("v");
        v.write(100 * 4096, &random_block(3), false)
            .expect("write a duplicate");
        pool.sync().expect("sync");
        assert_eq!(pool.stats().unique_chunks, chunks, "stored twice");
        let mut got = vec![0u8; 4096];
        v.read(100 * 4096, &mut got).expect("read");
        assert_eq!(got, random_block(3));
    }
    pool.close().expect("close");
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");
}

/// A version 3 pool (no run tables: every index key in the B-tree) opens upgraded: the run
/// tables created, the record at the current version, every chunk in the index (verify), a
/// block written again found as a duplicate, and new data's keys written as runs that a
/// reopen finds.
#[test]
fn a_version_3_pool_gets_run_tables_and_keeps_its_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    pool_with_eight_blocks(&path);
    {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = db.begin_write().expect("write");
        assert!(txn.delete_table(FPS_RUNS).expect("delete fps.runs"));
        assert!(txn.delete_table(FPS_DEAD).expect("delete fps.dead"));
        txn.commit().expect("commit");
    }
    set_version(&path, 3);
    {
        let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open a version 3 pool");
        assert_eq!(pool.verify().expect("verify after the upgrade").chunks, 8);
        let v = pool.volume("v").expect("v");
        v.write(100 * 4096, &random_block(3), false)
            .expect("write a duplicate");
        for i in 0..8u64 {
            v.write((200 + i) * 4096, &random_block(1000 + i), false)
                .expect("write new data");
        }
        pool.sync().expect("sync");
        assert_eq!(
            pool.stats().unique_chunks,
            16,
            "the duplicate was stored again"
        );
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");
    {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = redb::ReadableDatabase::begin_read(&db).expect("read");
        let runs = txn.open_table(FPS_RUNS).expect("fps.runs");
        assert!(
            redb::ReadableTableMetadata::len(&runs).expect("len") > 0,
            "no run"
        );
    }
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    assert_eq!(pool.verify().expect("verify").chunks, 16);
    let v = pool.volume("v").expect("v");
    v.write(240 * 4096, &random_block(1005), false)
        .expect("write a duplicate of a key in a run");
    pool.sync().expect("sync");
    assert_eq!(
        pool.stats().unique_chunks,
        16,
        "a key in a run was not found"
    );
}

const FPS_GONE: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("fps.gone");

/// A version 6 pool (keys of chunks that died while in a run kept one per row in `fps.dead`;
/// keys of the B-tree removed at once) opens upgraded: the dead keys moved into one gone row,
/// verify agrees, the dead keys find nothing, live ones are still found as duplicates, and a
/// merge after more deaths leaves an index with exactly the live chunks.
#[test]
fn a_version_6_pool_has_its_dead_keys_moved_into_a_gone_row() {
    use redb::{ReadableTable, ReadableTableMetadata};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let runs_only = PoolConfig {
        dedup_runs_max: 64,
        dedup_merge_slices: 1,
        ..quiet_config(1 << 30)
    };
    {
        let pool = Pool::create(&path, runs_only.clone()).expect("create");
        let v = pool.create_volume("v", 64 << 20).expect("volume");
        for i in 0..16u64 {
            v.write(i * 4096, &random_block(i), false).expect("write");
        }
        pool.sync().expect("sync");
        // Blocks 0..8 die while their keys are in a run.
        for i in 0..8u64 {
            v.write(i * 4096, &random_block(100 + i), false)
                .expect("overwrite");
        }
        // They die when the reference log is folded (a close leaves it for the next open).
        pool.sync().expect("sync");
        pool.close().expect("close");
    }
    // Back to version 6's layout: the gone rows' keys (all in runs here) one per row.
    let dead = {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = db.begin_write().expect("write");
        let mut keys = Vec::new();
        {
            let mut gone = txn.open_table(FPS_GONE).expect("fps.gone");
            let mut dead = txn.open_table(FPS_DEAD).expect("fps.dead");
            for item in gone.iter().expect("iter") {
                let (_, row) = item.expect("row");
                for k in row.value().chunks(16) {
                    let k = u128::from_be_bytes(k.try_into().expect("16 bytes"));
                    dead.insert(k, ()).expect("insert");
                    keys.push(k);
                }
            }
            gone.retain(|_, _| false).expect("empty fps.gone");
        }
        txn.commit().expect("commit");
        keys.len()
    };
    assert_eq!(dead, 8, "keys of the overwritten blocks");
    set_version(&path, 6);
    {
        // Runs merge every fourth commit from here on.
        let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open a version 6 pool");
        assert_eq!(pool.verify().expect("verify after the upgrade").chunks, 16);
        let v = pool.volume("v").expect("v");
        // A dead key's data is stored anew; a live one is found.
        v.write(200 * 4096, &random_block(0), false).expect("write");
        v.write(201 * 4096, &random_block(9), false).expect("write");
        pool.sync().expect("sync");
        assert_eq!(pool.stats().unique_chunks, 17);
        // More deaths, two per commit, through merges that apply gone keys of both runs and
        // the B-tree (verify checks each gone key and the index's count).
        for i in (8..16u64).step_by(2) {
            for b in [i, i + 1] {
                v.write(b * 4096, &random_block(300 + b), false)
                    .expect("overwrite");
            }
            pool.sync().expect("sync");
            pool.verify().expect("verify");
        }
        assert_eq!(pool.verify().expect("verify").chunks, 17 + 8 - 7);
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");
    {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = redb::ReadableDatabase::begin_read(&db).expect("read");
        assert_eq!(
            txn.open_table(FPS_DEAD)
                .expect("fps.dead")
                .len()
                .expect("len"),
            0,
            "fps.dead emptied"
        );
    }
    let pool = Pool::open(&path, runs_only).expect("reopen");
    // Its gone rows and runs reload as they were written (verify compares them with memory).
    assert_eq!(pool.verify().expect("verify").chunks, 18);
    let mut got = vec![0u8; 4096];
    let v = pool.volume("v").expect("v");
    for (b, seed) in [(0, 100), (200, 0), (201, 9), (15, 315)] {
        v.read(b * 4096, &mut got).expect("read");
        assert_eq!(got, random_block(seed), "block {b}");
    }
}

const CHUNK_DELTAS: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("chunk.deltas");

/// Rows in the reference log (`chunk.deltas`) of the closed pool at `path`.
fn logged_rows(path: &Path) -> u64 {
    use redb::ReadableTableMetadata;
    let db = redb::Database::open(path.join("meta.redb")).expect("redb");
    let txn = redb::ReadableDatabase::begin_read(&db).expect("read");
    txn.open_table(CHUNK_DELTAS)
        .expect("chunk.deltas")
        .len()
        .expect("len")
}

/// A version 7 pool (no reference log: every count in its record) opens upgraded with an empty
/// log; overwrites then log their reference changes instead of rewriting the old chunks'
/// records, the log survives a close and a reopen with every count exact (verify adds it to
/// the records), and a sync folds it: the overwritten chunks are freed.
#[test]
fn a_version_7_pool_gets_a_reference_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    {
        let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
        let v = pool.create_volume("v", 64 << 20).expect("volume");
        for i in 0..64u64 {
            v.write(i * 4096, &random_block(i), false).expect("write");
        }
        pool.close().expect("close");
    }
    {
        let db = redb::Database::open(path.join("meta.redb")).expect("redb");
        let txn = db.begin_write().expect("write");
        assert!(txn.delete_table(CHUNK_DELTAS).expect("delete chunk.deltas"));
        txn.commit().expect("commit");
    }
    set_version(&path, 7);
    {
        let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open a version 7 pool");
        // The filter rebuild's commit (the first after the open, for its orphans) folds
        // slice 0 while the log is empty; the two commits below fold slices 1 and 2. All 64
        // chunks are in slice 0 (their ids are below 4 Ki sequence numbers), so every
        // overwrite's change waits in the log: one row per commit.
        pool.wait_filters_built();
        let v = pool.volume("v").expect("v");
        v.write(0, &random_block(1000), false).expect("overwrite");
        pool.commit_once().expect("commit");
        for i in 1..32u64 {
            v.write(i * 4096, &random_block(1000 + i), false)
                .expect("overwrite");
        }
        pool.commit_once().expect("commit");
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");
    assert_eq!(
        logged_rows(&path),
        2,
        "the overwrites' changes wait in the log"
    );
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    // 64 written, 32 overwritten: the old chunks wait for their slice's fold.
    assert_eq!(pool.stats().unique_chunks, 96);
    let report = pool.verify().expect("verify folds the log and agrees");
    assert_eq!(report.chunks, 64);
    assert_eq!(pool.stats().unique_chunks, 64);
    let mut got = vec![0u8; 4096];
    let v = pool.volume("v").expect("v");
    for (b, seed) in [(0, 1000), (31, 1031), (32, 32), (63, 63)] {
        v.read(b * 4096, &mut got).expect("read");
        assert_eq!(got, random_block(seed), "block {b}");
    }
    pool.close().expect("close");
    assert_eq!(logged_rows(&path), 0, "folded");
}

/// The dedup index's merge marks stored in the pool at `dir`, if any.
fn merge_marks(dir: &Path) -> Option<Vec<u8>> {
    let store = Store::open(dir).expect("store");
    let txn = store.read().expect("read");
    txn.get(meta::POOL, meta::FPS_MERGED_KEY).expect("get")
}

/// A pool whose dedup index was merged a slice at a time by another slice count (as every
/// pool before session 60's, at 16) opens under the current one: its first run merges the
/// rows all at once, verify agrees at every step, and every block written before is still
/// found as a duplicate.
#[test]
fn a_pool_merged_by_another_slice_count_opens_and_merges_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let sixteen = PoolConfig {
        dedup_run_keys_min: 2,
        dedup_runs_max: 64,
        dedup_merge_slices: 16,
        dedup_run_keys_target: 8,
        ..quiet_config(1 << 30)
    };
    {
        let pool = Pool::create(&path, sixteen).expect("create");
        let v = pool.create_volume("v", 64 << 20).expect("volume");
        for round in 0..4u64 {
            for i in 0..16u64 {
                let b = round * 16 + i;
                v.write(b * 4096, &random_block(b), false).expect("write");
            }
            pool.sync().expect("sync");
        }
        assert_eq!(pool.verify().expect("verify").chunks, 64);
        pool.close().expect("close");
    }
    assert_eq!(
        merge_marks(&path).map(|m| m.len()),
        Some(16 * 8),
        "marks of 16 slices"
    );
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open under 4 slices");
    assert_eq!(pool.verify().expect("verify after open").chunks, 64);
    let v = pool.volume("v").expect("v");
    // New data makes a run (and the merge of everything before it), then the old blocks
    // again: each found, none stored anew.
    for i in 0..16u64 {
        v.write((100 + i) * 4096, &random_block(1000 + i), false)
            .expect("write");
    }
    pool.sync().expect("sync");
    assert_eq!(pool.verify().expect("verify after the merge").chunks, 80);
    drop(v);
    pool.close().expect("close");
    assert_ne!(
        merge_marks(&path).map(|m| m.len()),
        Some(16 * 8),
        "the 16 slices' marks outlived the merge"
    );
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    let v = pool.volume("v").expect("v");
    for b in 0..64u64 {
        v.write((200 + b) * 4096, &random_block(b), false)
            .expect("duplicate");
    }
    pool.sync().expect("sync");
    assert_eq!(
        pool.stats().unique_chunks,
        80,
        "old blocks found as duplicates"
    );
    assert_eq!(pool.verify().expect("verify at the end").chunks, 80);
}

/// A version 14 pool (72-byte chunk entries holding the fingerprints) opens upgraded: its
/// pages split into 26-byte entries and fingerprint pages, every block reads back, verify
/// agrees, a block written again is found as a duplicate of an old chunk (its fingerprint
/// read from the new table), and the fold that finds overwritten chunks dead sweeps their
/// stale fingerprints.
#[test]
fn a_version_14_pool_has_its_fingerprints_moved_apart() {
    use ibid_engine::{chunk_fps, chunk_table};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    {
        let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
        let v = pool.create_volume("v", 64 << 20).expect("volume");
        for i in 0..300u64 {
            v.write(i * 4096, &random_block(i), false).expect("write");
        }
        drop(v);
        pool.close().expect("close");
    }
    assert_eq!(chunk_pages_to_format_14(&path), 300);
    set_version(&path, 14);
    {
        let store = Store::open(&path).expect("store");
        let r = store.read().expect("read");
        assert!(
            chunk_table::get(&r, 1 << 6).is_err(),
            "format 14's pages are not this format's"
        );
    }
    let config = || quiet_config(1 << 30);
    {
        let pool = Pool::open(&path, config()).expect("open a version 14 pool");
        assert_eq!(pool.verify().expect("verify after the upgrade").chunks, 300);
        let v = pool.volume("v").expect("v");
        let mut got = vec![0u8; 4096];
        for i in 0..300u64 {
            v.read(i * 4096, &mut got).expect("read");
            assert_eq!(got, random_block(i), "block {i}");
        }
        v.write(1000 * 4096, &random_block(7), false)
            .expect("write a duplicate");
        pool.sync().expect("sync");
        assert_eq!(pool.stats().unique_chunks, 300, "block 7 deduplicated");
        // Overwrites kill old chunks: their fingerprints stay, stale, until swept.
        for i in 100..300u64 {
            v.write(i * 4096, &random_block(10_000 + i), false)
                .expect("overwrite");
        }
        pool.sync().expect("sync");
        assert_eq!(pool.verify().expect("verify").chunks, 300);
        drop(v);
        pool.close().expect("close");
    }
    assert_eq!(stored_version(&path), POOL_FORMAT_VERSION, "upgraded");
    let store = Store::open(&path).expect("store");
    let r = store.read().expect("read");
    let (mut records, mut fps) = (0, 0);
    chunk_table::for_each(&r, |_, _| {
        records += 1;
        Ok(())
    })
    .expect("records");
    chunk_fps::for_each(&r, |_, _| {
        fps += 1;
        Ok(())
    })
    .expect("fingerprints");
    assert_eq!(records, 300);
    assert_eq!(
        fps, 300,
        "the sync's fold found the 200 deaths and swept their slice (more stale than live \
         chunks' sixty-fourth)"
    );
    for item in r.iter(meta::CHUNK_PAGES).expect("pages") {
        let (key, page) = item.expect("page");
        assert_eq!(page.len() % 26, 0, "page {key}: 26-byte entries");
    }
    drop(r);
    drop(store);
    let pool = Pool::open(&path, config()).expect("reopen");
    assert_eq!(pool.verify().expect("verify after a reopen").chunks, 300);
}
