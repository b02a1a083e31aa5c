//! When the background thread commits: under steady foreground I/O a timed round commits only
//! once `commit_interval_ms` has passed since its last commit (fewer, larger commits), and as
//! soon as the I/O pauses for `io_quiet_ms`. Commits are counted by
//! `PoolStats::committed_batches`.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{Pool, PoolConfig, Volume};
use std::time::{Duration, Instant};

/// A pool whose background thread wakes every 10 ms, with the given commit interval and
/// quiet time.
fn pool(dir: &std::path::Path, commit_interval_ms: u64, io_quiet_ms: u64) -> (Pool, Volume) {
    let config = PoolConfig {
        background: true,
        background_interval_ms: 10,
        commit_interval_ms,
        io_quiet_ms,
        ..quiet_config(1 << 30)
    };
    let pool = Pool::create(dir.join("p"), config).expect("create");
    pool.wait_filters_built();
    let volume = pool.create_volume("v", 64 << 20).expect("volume");
    (pool, volume)
}

/// Writes a new 4 KiB block every 2 ms for `span` (far more often than any quiet time here).
fn write_steadily(volume: &Volume, span: Duration, seed: &mut u64) {
    let started = Instant::now();
    while started.elapsed() < span {
        *seed += 1;
        let block = *seed % 16_384;
        volume
            .write(block * 4096, &random_block(*seed), false)
            .expect("write");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// With a commit interval longer than the test, 1.5 s of steady writes see no background
/// commit at all although its thread wakes every 10 ms; once the writes stop, one comes
/// within the quiet time, and it makes them durable in the store.
#[test]
fn steady_writes_wait_for_the_commit_interval_and_a_pause_commits_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A quiet time far longer than any pause of the writing thread on a busy machine.
    let (pool, volume) = pool(dir.path(), 600_000, 1000);
    // Let the creation's own work settle (the pool is idle: rounds may commit).
    std::thread::sleep(Duration::from_millis(1200));
    let mut seed = 0;
    volume.write(0, &random_block(0), false).expect("write");
    // A round that found the pool quiet just before that write may still be committing.
    std::thread::sleep(Duration::from_millis(50));
    let before = pool.stats().committed_batches;
    write_steadily(&volume, Duration::from_millis(1500), &mut seed);
    assert_eq!(
        pool.stats().committed_batches,
        before,
        "a timed round committed while writes went on"
    );
    let stopped = Instant::now();
    while pool.stats().committed_batches == before {
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "no commit 10 s after the writes stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The commit came after the quiet time, not before.
    assert!(stopped.elapsed() >= Duration::from_millis(900));
    // Every block written (each a new one at its own offset) is a live chunk of the store.
    assert!(seed < 16_384);
    assert!(pool.stats().unique_chunks >= seed);
}

/// With a short commit interval and I/O that never counts as paused, timed rounds commit
/// about every interval: 2 s of steady writes at 200 ms see between 4 and 20 commits.
#[test]
fn under_steady_writes_a_timed_round_commits_every_commit_interval() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pool, volume) = pool(dir.path(), 200, 600_000);
    let mut seed = 0;
    volume.write(0, &random_block(0), false).expect("write");
    let before = pool.stats().committed_batches;
    write_steadily(&volume, Duration::from_secs(2), &mut seed);
    let commits = pool.stats().committed_batches - before;
    assert!(
        (4..=20).contains(&commits),
        "{commits} commits in 2 s of writes with a 200 ms commit interval"
    );
}
