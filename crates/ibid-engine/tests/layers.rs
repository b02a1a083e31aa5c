//! Deep stacks of layers (clone of clone of ..., snapshots) read through the layer filters
//! (`layer_filter.rs`): every generation shows exactly its own writes over its ancestors',
//! whether the filters were grown by commits, built by the scan after a reopen, or are still
//! pending; `verify` checks that no filter lacks an entry of its layer.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{Pool, Volume};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;
const GENERATIONS: u64 = 20;

/// What generation `g` shows at block `b`: generation `j <= g` wrote block `j` (seed 1000 + j)
/// and zeroed block `32 + j`; the base holds seed `b` everywhere.
fn expected(g: u64, b: u64) -> Vec<u8> {
    if (1..=g).contains(&b) {
        random_block(1000 + b)
    } else if b >= 32 && (1..=g).contains(&(b - 32)) {
        vec![0u8; BLOCK as usize]
    } else {
        random_block(b)
    }
}

/// Checks every block of `v` one 4 KiB read at a time (the single-block lookup path), then
/// the whole volume in one read (the range path).
fn check(v: &Volume, g: u64, when: &str) {
    let mut all = vec![0u8; (BLOCKS * BLOCK) as usize];
    v.read(0, &mut all).expect("read all");
    for b in 0..BLOCKS {
        let want = expected(g, b);
        let mut one = vec![0u8; BLOCK as usize];
        v.read(b * BLOCK, &mut one).expect("read");
        assert!(one == want, "{when}: gen {g} block {b} (4 KiB read)");
        let range = &all[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize];
        assert!(range == want, "{when}: gen {g} block {b} (range read)");
    }
}

fn build_chain(pool: &Pool) {
    let base = pool.create_volume("gen0", BLOCKS * BLOCK).expect("base");
    let data: Vec<u8> = (0..BLOCKS).flat_map(random_block).collect();
    base.write(0, &data, false).expect("write base");
    for g in 1..=GENERATIONS {
        let v = pool
            .clone_volume(&format!("gen{}", g - 1), &format!("gen{g}"))
            .expect("clone");
        // Every other generation commits its writes before the next clone; the others
        // leave them uncommitted (the clone then waits for them, see snapshot.rs).
        v.write(g * BLOCK, &random_block(1000 + g), false)
            .expect("write");
        v.write_zeroes((32 + g) * BLOCK, BLOCK, false)
            .expect("zero");
        if g % 2 == 0 {
            pool.sync().expect("sync");
        }
        pool.create_snapshot(&format!("gen{g}"), "s")
            .expect("snapshot");
    }
}

#[test]
fn every_generation_of_a_deep_clone_chain_reads_its_own_writes_over_its_ancestors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
    build_chain(&pool);
    for g in 0..=GENERATIONS {
        check(&pool.volume(&format!("gen{g}")).expect("volume"), g, "live");
    }
    pool.verify().expect("verify");
    pool.close().expect("close");

    // After a reopen the filters are pending, then built by a scan; reads are exact throughout.
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("open");
    check(
        &pool.volume("gen20").expect("gen20"),
        GENERATIONS,
        "just reopened",
    );
    pool.wait_filters_built();
    assert_eq!(pool.layer_filters_pending(), 0, "layer filters not built");
    assert!(pool.stats().layer_filter_ram_bytes > 0);
    for g in 0..=GENERATIONS {
        check(
            &pool.volume(&format!("gen{g}")).expect("volume"),
            g,
            "filters built",
        );
        let snap = pool.snapshot(&format!("gen{g}"), "s");
        if g > 0 {
            check(&snap.expect("snapshot"), g, "snapshot");
        }
    }
    pool.verify().expect("verify after reopen");

    // Writes after the reopen grow the filters they need; deleting the middle of the chain
    // and flattening moves entries into upper layers, whose filters grow first.
    let top = pool.volume("gen20").expect("gen20");
    top.write(0, &random_block(5000), false).expect("write");
    for g in 1..GENERATIONS {
        pool.delete_snapshot(&format!("gen{g}"), "s")
            .expect("delete snapshot");
        pool.delete_volume(&format!("gen{g}")).expect("delete");
    }
    pool.gc_now().expect("gc");
    pool.verify().expect("verify after flattening");
    let mut b0 = vec![0u8; BLOCK as usize];
    top.read(0, &mut b0).expect("read");
    assert!(b0 == random_block(5000), "gen20 block 0 after flattening");
    for b in 1..BLOCKS {
        let mut one = vec![0u8; BLOCK as usize];
        top.read(b * BLOCK, &mut one).expect("read");
        assert!(
            one == expected(GENERATIONS, b),
            "gen20 block {b} after flattening"
        );
    }
}
