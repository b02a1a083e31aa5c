//! The journal: a flush makes writes durable without a metadata commit, and a pool that
//! crashes after it (nothing committed since) recovers every flushed write by replaying the
//! journal on top of the last commit.
//!
//! The crash is simulated in-process ([`Pool::simulate_crash`]: nothing more is committed or
//! written; buffered segment data is lost). The SIGKILL crash test (`crash.rs`) covers the same
//! path with a background committer racing the flushes.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{Pool, PoolConfig, VolumeFormat};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 8 * MIB;

/// Volumes and the content every byte must have.
struct Model {
    content: HashMap<&'static str, Vec<u8>>,
}

impl Model {
    fn new(names: &[&'static str]) -> Model {
        Model {
            content: names
                .iter()
                .map(|&n| (n, vec![0u8; VOLUME_BYTES as usize]))
                .collect(),
        }
    }

    fn write(&mut self, vol: &str, offset: u64, data: &[u8]) {
        let c = self.content.get_mut(vol).expect("volume");
        c[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    fn check(&self, pool: &Pool) {
        for (name, want) in &self.content {
            let mut got = vec![0u8; want.len()];
            pool.volume(name)
                .expect("volume")
                .read(0, &mut got)
                .expect("read");
            if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                panic!("{name}: byte {i} differs after recovery");
            }
        }
    }
}

fn config() -> PoolConfig {
    quiet_config(1 << 30)
}

fn reopen(dir: &Path) -> Pool {
    Pool::open(dir, config()).expect("reopen after crash")
}

/// Random data of `sectors` sectors: unique, duplicate of a small set, zeros, or half zeros.
fn data(rng: &mut impl Rng, sectors: u64) -> Vec<u8> {
    let len = (sectors * 512) as usize;
    let kind = rng.random_range(0..4);
    let seed: u64 = if kind == 1 {
        rng.random_range(0..4)
    } else {
        rng.random()
    };
    let mut out: Vec<u8> = (0..len.div_ceil(4096))
        .flat_map(|i| random_block(seed.wrapping_add(i as u64)))
        .take(len)
        .collect();
    match kind {
        2 => out.fill(0),
        3 => out[..len / 2].fill(0),
        _ => {}
    }
    out
}

/// Random writes, zeroing, copies and compare-and-writes on two volumes (one of them
/// lazy-zeroed thick), mirrored in the model.
fn random_ops(pool: &Pool, model: &mut Model, rng: &mut impl Rng, ops: usize) {
    let names = ["j-thin", "j-lazy"];
    for _ in 0..ops {
        let name = names[rng.random_range(0..2)];
        let vol = pool.volume(name).expect("volume");
        let sectors = *[1u64, 7, 8, 9, 64, 300]
            .get(rng.random_range(0..6))
            .expect("len");
        let sector = rng.random_range(0..VOLUME_BYTES / 512 - sectors);
        match rng.random_range(0..10) {
            0 | 1 => {
                vol.write_zeroes(sector * 512, sectors * 512, false)
                    .expect("zero");
                model.write(name, sector * 512, &vec![0u8; (sectors * 512) as usize]);
            }
            2 => {
                let src_name = names[rng.random_range(0..2)];
                let src = pool.volume(src_name).expect("volume");
                // Mostly 4 KiB-aligned alike (shared by reference), sometimes not (data).
                let shift = if rng.random_bool(0.8) { 0 } else { 1 };
                let from = (rng.random_range(0..VOLUME_BYTES / 4096 - 64) * 8 + shift) * 512;
                let len = sectors * 512;
                if from + len > VOLUME_BYTES {
                    continue;
                }
                vol.copy_from(&src, from, sector * 512, len).expect("copy");
                let moved = model.content[src_name][from as usize..(from + len) as usize].to_vec();
                model.write(name, sector * 512, &moved);
            }
            3 => {
                let expected = model.content[name]
                    [(sector * 512) as usize..((sector + sectors) * 512) as usize]
                    .to_vec();
                let new = data(rng, sectors);
                let outcome = vol
                    .compare_and_write(sector * 512, &expected, &new, false)
                    .expect("compare and write");
                assert_eq!(outcome, None, "the model's content must compare equal");
                model.write(name, sector * 512, &new);
            }
            _ => {
                let d = data(rng, sectors);
                vol.write(sector * 512, &d, false).expect("write");
                model.write(name, sector * 512, &d);
            }
        }
    }
}

fn setup(dir: &Path) -> (Pool, Model) {
    let pool = Pool::create(dir, config()).expect("create");
    pool.create_volume("j-thin", VOLUME_BYTES).expect("thin");
    pool.create_volume_with_format("j-lazy", VOLUME_BYTES, VolumeFormat::LazyZeroedThick)
        .expect("lazy");
    (pool, Model::new(&["j-thin", "j-lazy"]))
}

/// After a flush and a crash, every write is back, and the pool passes its full check.
fn crash_and_check(pool: Pool, dir: &Path, model: &Model) -> Pool {
    let before = pool.stats().committed_batches;
    pool.volume("j-thin")
        .expect("volume")
        .flush()
        .expect("flush");
    assert_eq!(
        pool.stats().committed_batches,
        before,
        "a flush must not commit (the journal makes it durable)"
    );
    pool.simulate_crash();
    let pool = reopen(dir);
    model.check(&pool);
    pool.verify().expect("verify after replay");
    model.check(&pool);
    pool
}

#[test]
fn flushed_changes_survive_a_crash_without_a_commit() {
    for seed in 0..6u64 {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pool");
        let (pool, mut model) = setup(&path);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        // Some committed state first, then only journaled changes on top of it.
        random_ops(&pool, &mut model, &mut rng, 40);
        pool.sync().expect("commit");
        random_ops(&pool, &mut model, &mut rng, 60);
        let pool = crash_and_check(pool, &path, &model);
        // Replayed once, committed, and never again: more changes, another crash.
        random_ops(&pool, &mut model, &mut rng, 60);
        let pool = crash_and_check(pool, &path, &model);
        pool.close().expect("close");
        let pool = reopen(&path);
        model.check(&pool);
    }
}

#[test]
fn a_large_flush_syncs_segments_and_journals_only_metadata() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let (pool, mut model) = setup(&path);
    // 4 MiB of unique data: more than a flush carries inline.
    let d: Vec<u8> = (0..1024).flat_map(random_block).collect();
    pool.volume("j-thin")
        .expect("volume")
        .write(MIB, &d, false)
        .expect("write");
    model.write("j-thin", MIB, &d);
    let pool = crash_and_check(pool, &path, &model);
    let stats = pool.stats();
    assert_eq!(stats.unique_chunks, 1024);
    assert_eq!(stats.logical_written_bytes, 4 * MIB);
}

#[test]
fn a_journal_too_full_for_inline_data_takes_metadata_instead_of_a_commit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let (pool, mut model) = setup(&path);
    let vol = pool.volume("j-thin").expect("volume");
    pool.wait_filters_built();
    let before = pool.stats().committed_batches;
    // Flushes of 1020 KiB of new data each (inline: 1.02 MiB a flush with the records'
    // headers). 125 of them fill most of a journal file (128 MiB); the next one's inline data
    // does not fit, so it and the next few sync the segments and journal only metadata
    // (26 KiB each: about 12 fit in what is left). None of them may need a commit (which
    // could wait behind a long one); before, the 126th did.
    for i in 0..130u64 {
        let d: Vec<u8> = (0..255).flat_map(|b| random_block(i * 1000 + b)).collect();
        vol.write(0, &d, false).expect("write");
        model.write("j-thin", 0, &d);
        vol.flush().expect("flush");
    }
    assert_eq!(
        pool.stats().committed_batches,
        before,
        "a full journal file must not force a commit while metadata still fits"
    );
    drop(vol);
    let pool = crash_and_check(pool, &path, &model);
    assert_eq!(pool.stats().unique_chunks, 255);
}

/// A flush that leaves its journal file three quarters full wakes the background thread, which
/// commits while the file still has room: the flushes after it go on journaling, and none has
/// to commit on its caller's time (before, flushes filled the file and the one that found it
/// full committed: up to 0.9 s for a database's log writer, docs/BENCHMARKS.md). The background
/// thread here commits only when woken (its timed rounds and quiet-time commits are off).
#[test]
fn a_filling_journal_file_has_the_background_thread_commit_before_a_flush_must() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let events = std::sync::Arc::new(ibid_engine::event_log::EventLog::new(100_000));
    let config = PoolConfig {
        background: true,
        commit_interval_ms: 600_000,
        io_quiet_ms: 600_000,
        events: Some(events.clone()),
        ..config()
    };
    let pool = Pool::create(&path, config).expect("create");
    pool.create_volume("j-thin", VOLUME_BYTES).expect("thin");
    let mut model = Model::new(&["j-thin"]);
    let vol = pool.volume("j-thin").expect("volume");
    pool.wait_filters_built();
    let before = pool.stats().committed_batches;
    // Flushes of 1020 KiB of new data each, inline (as in the test above): 125 fill a file.
    let mut filling_at = None;
    for i in 0..160u64 {
        let d: Vec<u8> = (0..255).flat_map(|b| random_block(i * 1000 + b)).collect();
        vol.write(0, &d, false).expect("write");
        model.write("j-thin", 0, &d);
        vol.flush().expect("flush");
        if filling_at.is_none() && events.recent().iter().any(|l| l.contains("file filling")) {
            filling_at = Some(i);
            // The woken background thread commits; wait for it (its cut sends the next
            // flushes to the other file).
            let asked = std::time::Instant::now();
            while pool.stats().committed_batches == before {
                assert!(
                    asked.elapsed() < std::time::Duration::from_secs(20),
                    "no background commit after the journal said it was filling"
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
    let filling_at = filling_at.expect("no flush said the journal file was filling");
    assert!(
        (90..110).contains(&filling_at),
        "filling said at flush {filling_at}, not at three quarters of the file"
    );
    let forced: Vec<String> = events
        .recent()
        .into_iter()
        .filter(|l| l.contains("needs a commit"))
        .collect();
    assert!(forced.is_empty(), "flushes committed: {forced:?}");
    drop(vol);
    let pool = crash_and_check(pool, &path, &model);
    assert_eq!(pool.stats().unique_chunks, 255);
}

#[test]
fn flushes_between_commits_accumulate_and_unflushed_writes_may_be_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let (pool, mut model) = setup(&path);
    let vol = pool.volume("j-lazy").expect("volume");
    for i in 0..50u64 {
        let b = random_block(1000 + i);
        vol.write(i * 4096, &b, i % 5 == 0).expect("write");
        model.write("j-lazy", i * 4096, &b);
        if i % 7 == 0 {
            vol.flush().expect("flush");
        }
        if i == 25 {
            pool.sync().expect("commit in the middle");
        }
    }
    vol.flush().expect("flush");
    // Written after the last flush: may or may not survive, but must not corrupt anything.
    vol.write(60 * 4096, &random_block(7), false)
        .expect("unflushed write");
    drop(vol);
    pool.simulate_crash();
    let pool = reopen(&path);
    let mut block = vec![0u8; 4096];
    pool.volume("j-lazy")
        .expect("volume")
        .read(60 * 4096, &mut block)
        .expect("read");
    if block != vec![0u8; 4096] {
        assert_eq!(block, random_block(7), "an unflushed block is old or new");
        model.write("j-lazy", 60 * 4096, &block);
    }
    model.check(&pool);
    pool.verify().expect("verify");
    // Accounting agrees with the data: thick reservations follow the replayed writes.
    let info = pool
        .list_volumes()
        .into_iter()
        .find(|v| v.name == "j-lazy")
        .expect("listed");
    let written = model.content["j-lazy"]
        .chunks(4096)
        .filter(|b| b.iter().any(|&x| x != 0))
        .count() as u64;
    assert_eq!(info.mapped_blocks, written);
    assert_eq!(info.tbz_blocks, VOLUME_BYTES / 4096 - written);
}

#[test]
fn a_torn_journal_tail_loses_only_the_unfinished_flush() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let (pool, mut model) = setup(&path);
    let vol = pool.volume("j-thin").expect("volume");
    let first = random_block(1);
    vol.write(0, &first, false).expect("write");
    vol.flush().expect("flush");
    model.write("j-thin", 0, &first);
    let journal_bytes = |p: &Path| -> Vec<(std::path::PathBuf, Vec<u8>)> {
        (0..2)
            .map(|i| {
                let f = p.join(format!("journal.{i}"));
                let b = std::fs::read(&f).expect("journal");
                (f, b)
            })
            .collect()
    };
    let after_first = journal_bytes(&path);
    vol.write(4096, &random_block(2), false).expect("write");
    vol.flush().expect("flush");
    drop(vol);
    pool.simulate_crash();
    // Tear the second flush: keep its first 30 bytes, as if the machine lost power mid-write.
    let after_second = journal_bytes(&path);
    let mut torn = false;
    for ((file, old), (_, new)) in after_first.iter().zip(&after_second) {
        if let Some(start) = old.iter().zip(new).position(|(a, b)| a != b) {
            let mut b = new.clone();
            b[start + 30..].copy_from_slice(&old[start + 30..]);
            std::fs::write(file, &b).expect("tear journal");
            torn = true;
        }
    }
    assert!(torn, "the second flush wrote to a journal file");
    let pool = reopen(&path);
    model.check(&pool);
    pool.verify().expect("verify");
}

/// A flush no longer commits, so space freed by zeroing is only counted back at the next
/// commit: a write that would fail for lack of space commits first and tries again.
#[test]
fn space_freed_since_the_last_commit_is_used_before_reporting_no_space() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("pool"), quiet_config(16 * MIB)).expect("create");
    let vol = pool.create_volume("v", 64 * MIB).expect("volume");
    let mut written = 0u64;
    loop {
        match vol.write(written * 4096, &random_block(written), false) {
            Ok(()) => written += 1,
            Err(ibid_engine::Error::NoSpace) => break,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert!(written > 1000, "only {written} blocks fit");
    vol.flush().expect("flush");
    vol.write_zeroes(0, written * 4096, false).expect("zero");
    vol.flush().expect("flush");
    // No commit in between: the write itself must find the freed space.
    vol.write(0, &random_block(u64::MAX), false)
        .expect("write after zeroing");
    pool.verify().expect("verify");
}

/// Empty commits use batch numbers without writing the store; after a crash the numbering must
/// still resume past every batch that can have journaled before it (the last one committed in
/// memory and the two after it), or a record of such a batch lying unread further into a
/// journal file could later pass for part of a new batch of the same number.
#[test]
fn batch_numbers_resume_past_empty_commits_after_a_crash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let pool = Pool::create(&path, config()).expect("create");
    let v = pool.create_volume("v", VOLUME_BYTES).expect("volume");
    v.write(0, &random_block(1), true).expect("write");
    drop(v);
    for _ in 0..300 {
        pool.commit_once().expect("empty commit");
    }
    let before = pool.stats().committed_batches;
    pool.simulate_crash();
    let pool = reopen(&path);
    let after = pool.stats().committed_batches;
    assert!(
        after >= before + 2,
        "batches resume at {after} after a crash; {before} had been committed and the next \
         two may have journaled"
    );
}
