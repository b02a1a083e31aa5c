//! Zeroing records a range and the commit settles it (`overlay.rs`): writes and zeroes of the
//! same blocks inside one batch, over committed data, over a snapshot's frames, and across a
//! crash. Every case checks the reads, the mapped count, the pool's chunks and `verify` (which
//! recounts every reference), with no background thread so each batch holds all of it.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{Pool, PoolConfig, Volume, VolumeFormat};
use std::path::Path;

const BLOCK: u64 = 4096;

/// What each block of a volume should read as: a seed for [`random_block`], or zeros.
struct Model(Vec<Option<u64>>);

impl Model {
    fn new(blocks: usize) -> Self {
        Model(vec![None; blocks])
    }

    fn write(&mut self, v: &Volume, b: u64, seed: u64) {
        v.write(b * BLOCK, &random_block(seed), false)
            .expect("write");
        self.0[b as usize] = Some(seed);
    }

    fn zero(&mut self, v: &Volume, b0: u64, b1: u64) {
        v.write_zeroes(b0 * BLOCK, (b1 - b0) * BLOCK, false)
            .expect("zero");
        for b in b0..b1 {
            self.0[b as usize] = None;
        }
    }

    fn mapped(&self) -> u64 {
        self.0.iter().filter(|s| s.is_some()).count() as u64
    }

    fn check(&self, v: &Volume, what: &str) {
        let mut buf = vec![0u8; self.0.len() * BLOCK as usize];
        v.read(0, &mut buf).expect("read");
        for (b, want) in self.0.iter().enumerate() {
            let got = &buf[b * BLOCK as usize..(b + 1) * BLOCK as usize];
            match want {
                Some(seed) => assert!(
                    got == random_block(*seed),
                    "{what}: block {b} lost its data"
                ),
                None => assert!(
                    got.iter().all(|&x| x == 0),
                    "{what}: block {b} is not zeros"
                ),
            }
        }
        assert_eq!(v.mapped_blocks(), self.mapped(), "{what}: mapped blocks");
    }
}

/// Transaction budgets: the default (every range here settles in one transaction) and one so
/// small that each commit settles its ranges over many transactions.
const BUDGETS: [u64; 2] = [256 << 10, 3];

fn config(budget: u64) -> PoolConfig {
    PoolConfig {
        zero_settle_entries_max: budget,
        ..quiet_config(1 << 30)
    }
}

fn pool_at(dir: &Path, budget: u64) -> Pool {
    Pool::create(dir.join("p"), config(budget)).expect("create")
}

/// In one batch over committed data: overwrites then a zero over them (their old chunks were
/// released by the overwrite, not again by the zero), writes inside the zeroed range, a second
/// zero over those, a zero that reaches past the data. After the commit every chunk still
/// referenced is exactly one the volume shows.
#[test]
fn writes_and_zeroes_in_one_batch_settle_exactly() {
    for budget in BUDGETS {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = pool_at(dir.path(), budget);
        let v = pool.create_volume("v", 256 * BLOCK).expect("v");
        let mut m = Model::new(256);
        for b in 0..128 {
            m.write(&v, b, b);
        }
        pool.sync().expect("sync");
        for b in 0..16 {
            m.write(&v, b, 1000 + b); // replaces committed entries
        }
        m.zero(&v, 8, 48); // removes 8 of those, hides 32 committed blocks
        m.write(&v, 20, 2000); // inside the range
        m.write(&v, 21, 2001);
        m.zero(&v, 21, 22); // removes a write made inside a range
        m.write(&v, 40, 2002);
        m.zero(&v, 100, 200); // past the data
        m.zero(&v, 4, 10); // touches the first range: merged
        m.check(&v, "before the commit");
        pool.sync().expect("sync");
        m.check(&v, "after the commit");
        let report = pool.verify().expect("verify");
        let distinct = m.0.iter().flatten().count() as u64;
        assert_eq!(report.chunks, distinct, "chunks kept = blocks shown");
        pool.gc_now().expect("gc");
        assert_eq!(pool.stats().unique_chunks, distinct);
    }
}

/// Over a snapshot: the zeroed range hides the snapshot's blocks (tombstones in the volume's
/// own layer) while the snapshot keeps reading them; deleting the snapshot frees exactly the
/// chunks nothing shows any more.
#[test]
fn zeroing_over_a_snapshot_hides_it_and_keeps_it() {
    for budget in BUDGETS {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = pool_at(dir.path(), budget);
        let v = pool.create_volume("v", 128 * BLOCK).expect("v");
        let mut m = Model::new(128);
        for b in 0..64 {
            m.write(&v, b, b);
        }
        pool.create_snapshot("v", "s").expect("snapshot");
        let snap = Model(m.0.clone());
        for b in 32..48 {
            m.write(&v, b, 500 + b); // in the top layer, over the snapshot's
        }
        pool.sync().expect("sync");
        m.write(&v, 10, 900);
        m.zero(&v, 0, 40);
        m.write(&v, 5, 901);
        m.check(&v, "before the commit");
        pool.sync().expect("sync");
        m.check(&v, "after the commit");
        snap.check(&pool.snapshot("v", "s").expect("open snapshot"), "snapshot");
        pool.verify().expect("verify");
        pool.delete_snapshot("v", "s").expect("delete snapshot");
        pool.gc_now().expect("gc");
        m.check(&v, "after deleting the snapshot");
        let report = pool.verify().expect("verify");
        assert_eq!(report.chunks, m.0.iter().flatten().count() as u64);
    }
}

/// A flushed zero survives a crash: the journal holds the range, replay zeroes it again, and
/// the recount finds no stray reference.
#[test]
fn a_flushed_zero_survives_a_crash() {
    for budget in BUDGETS {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p");
        let pool = Pool::create(&path, config(budget)).expect("create");
        let v = pool.create_volume("v", 128 * BLOCK).expect("v");
        let mut m = Model::new(128);
        for b in 0..96 {
            m.write(&v, b, b);
        }
        pool.sync().expect("sync");
        m.write(&v, 3, 300);
        m.zero(&v, 0, 64);
        m.write(&v, 7, 700);
        v.flush().expect("flush");
        drop(v);
        pool.simulate_crash();
        let pool = Pool::open(&path, config(budget)).expect("reopen");
        let v = pool.volume("v").expect("v");
        m.check(&v, "after replay");
        let report = pool.verify().expect("verify");
        assert_eq!(report.chunks, m.0.iter().flatten().count() as u64);
    }
}

/// A commit that leaves part of a large zeroed range to later commits: the rest is hidden at
/// once, in the store and in memory, writes made after the zero stay, and a crash before the
/// later commits leaves the rest in the store: the reopened pool hides the data under it at
/// once (before any commit) and settles it.
#[test]
fn zeroed_ranges_left_by_a_commit_stay_hidden_and_survive_a_crash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let pool = Pool::create(&path, config(5)).expect("create");
    let v = pool.create_volume("v", 256 * BLOCK).expect("v");
    pool.create_snapshot("v", "s")
        .expect("snapshot of the empty volume");
    let mut m = Model::new(256);
    for b in 0..160 {
        m.write(&v, b, b);
    }
    pool.sync().expect("sync");
    m.zero(&v, 0, 200);
    m.write(&v, 50, 5000);
    m.write(&v, 120, 5001);
    pool.commit_once().expect("commit");
    let mut buf = vec![1u8; 4096];
    v.read(150 * BLOCK, &mut buf).expect("read");
    assert!(
        buf.iter().all(|&x| x == 0),
        "zeroed data shows while settling"
    );
    m.write(&v, 140, 5002);
    pool.commit_once().expect("commit");
    v.flush().expect("flush");
    drop(v);
    pool.simulate_crash();
    let pool = Pool::open(&path, config(5)).expect("reopen");
    let v = pool.volume("v").expect("v");
    // Read before anything commits: the ranges left must already hide the old data.
    v.read(150 * BLOCK, &mut buf).expect("read");
    assert!(
        buf.iter().all(|&x| x == 0),
        "zeroed data shows again after reopen"
    );
    m.check(&v, "after reopen");
    let report = pool.verify().expect("verify");
    assert_eq!(report.chunks, m.0.iter().flatten().count() as u64);
}

/// A close commits once and leaves what that commit did not settle of a large zeroed range in
/// the store (a close never runs a commit per part of it), and the reopened pool hides the
/// data under it at once and settles it.
#[test]
fn a_close_leaves_a_large_zeroed_range_to_the_next_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let pool = Pool::create(&path, config(5)).expect("create");
    let v = pool.create_volume("v", 256 * BLOCK).expect("v");
    let mut m = Model::new(256);
    for b in 0..160 {
        m.write(&v, b, b);
    }
    pool.sync().expect("sync");
    m.zero(&v, 0, 200);
    m.write(&v, 70, 5000);
    drop(v);
    pool.close().expect("close");
    let rows = {
        let store = ibid_engine::store::Store::open(&path).expect("store");
        let txn = store.read().expect("read");
        txn.iter(ibid_engine::meta::ZEROING)
            .expect("zeroing rows")
            .count()
    };
    assert_eq!(rows, 1, "the close left the range's rest in the store");
    let pool = Pool::open(&path, config(5)).expect("reopen");
    let v = pool.volume("v").expect("v");
    m.check(&v, "after reopen");
    pool.sync().expect("sync");
    m.check(&v, "settled");
    let report = pool.verify().expect("verify");
    assert_eq!(report.chunks, m.0.iter().flatten().count() as u64);
}

/// A thick volume whose blocks are all zeroed and written again before the zero settles
/// counts more mapped blocks than it has (the hidden committed ones, until the settlement
/// subtracts them). Deleting it, or making it thin, in that state must take out of the pool's
/// reservations exactly what it put in: `verify` recounts them from the volumes.
#[test]
fn leaving_the_reservations_while_a_rewritten_zero_settles_takes_out_the_exact_share() {
    for leave in ["delete", "thin"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = pool_at(dir.path(), 256 << 10);
        let keep = pool
            .create_volume_with_format("keep", 16 * BLOCK, VolumeFormat::EagerZeroedThick)
            .expect("keep");
        keep.write(0, &random_block(1), false).expect("write");
        let v = pool
            .create_volume_with_format("v", 64 * BLOCK, VolumeFormat::EagerZeroedThick)
            .expect("v");
        let mut m = Model::new(64);
        for b in 0..64 {
            m.write(&v, b, b);
        }
        pool.sync().expect("sync");
        m.zero(&v, 0, 64);
        for b in 0..64 {
            m.write(&v, b, 100 + b);
        }
        match leave {
            "delete" => pool.delete_volume("v").expect("delete"),
            _ => {
                pool.set_volume_format("v", VolumeFormat::Thin)
                    .expect("to thin");
            }
        }
        pool.verify()
            .unwrap_or_else(|e| panic!("{leave}: verify: {e}"));
        assert_eq!(
            pool.stats().reserved_bytes,
            (15 + 16) * ibid_engine::RESERVED_BYTES_PER_BLOCK,
            "{leave}: only keep's 15 unwritten blocks and its 16 of overwrite headroom stay \
             reserved"
        );
    }
}

/// A handle of a deleted volume whose zero never settled answers without committing:
/// nothing waits on the ranges of a volume that is gone (they are never emptied, and
/// waiting for them ran commits up to the settling loop's limit, 64 Ki, on every call). Timed
/// against commits on the same pool: the call must cost less than 4 Ki of them.
#[test]
fn a_deleted_volume_with_a_pending_zero_does_not_keep_its_handles_committing() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_at(dir.path(), 256 << 10);
    let v = pool.create_volume("v", 64 * BLOCK).expect("v");
    for b in 0..64 {
        v.write(b * BLOCK, &random_block(b), false).expect("write");
    }
    pool.sync().expect("sync");
    v.write_zeroes(0, 64 * BLOCK, false).expect("zero");
    pool.delete_volume("v").expect("delete");
    let t = Instant::now();
    for _ in 0..4096 {
        pool.commit_once().expect("commit");
    }
    let commits = t.elapsed();
    let call = (0..3)
        .map(|_| {
            let t = Instant::now();
            let _ = v.mapped_blocks();
            let _ = v.space();
            t.elapsed()
        })
        .min()
        .unwrap_or(Duration::MAX);
    assert!(
        call < commits,
        "a gone volume's handle took {call:?}; 4096 commits took {commits:?}"
    );
}

/// While a zeroed range is left to settle, the listing protocol paths and metrics use
/// (`list_volumes_now`) runs no commit and shows the lagging count; the API's exact
/// `list_volumes` commits until the range has settled.
#[test]
fn protocol_listings_do_not_commit_while_a_range_settles() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_at(dir.path(), 16);
    let v = pool.create_volume("v", 256 * BLOCK).expect("v");
    for b in 0..256 {
        v.write(b * BLOCK, &random_block(b), false).expect("write");
    }
    pool.sync().expect("sync");
    v.write_zeroes(0, 256 * BLOCK, false).expect("zero");
    pool.commit_once().expect("commit");
    let before = pool.stats().committed_batches;
    let now = pool.list_volumes_now();
    assert_eq!(
        pool.stats().committed_batches,
        before,
        "list_volumes_now committed"
    );
    assert_eq!(now.len(), 1);
    assert!(
        now[0].mapped_blocks > 0,
        "one commit of 16 entries settled all 256 blocks"
    );
    let exact = pool.list_volumes();
    assert_eq!(exact[0].mapped_blocks, 0);
    assert!(
        pool.stats().committed_batches > before + 1,
        "256 blocks settled 16 at a time in under two commits"
    );
}
