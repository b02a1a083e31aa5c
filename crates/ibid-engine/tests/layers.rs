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

/// A private frozen layer merges with the layer above it by moving the smaller one's entries:
/// a whole volume frozen by a snapshot under a top of a few writes moves the top's entries
/// down (the frozen layer becomes the top), and a few writes frozen under a fully rewritten
/// top move up; at the bottom of the stack and in its middle (where a zeroed block's
/// tombstone must keep hiding the layers below). Every block reads as before each merge,
/// `verify` passes (references, mapped counts, filters), and again after a reopen. Once with
/// each merge in one step, once in steps of three entries.
#[test]
fn flattening_moves_the_smaller_layers_entries() {
    for step in [u64::MAX, 3] {
        flatten_in_steps_of(step);
    }
}

fn flatten_in_steps_of(step: u64) {
    let events = std::sync::Arc::new(ibid_engine::event_log::EventLog::new(100_000));
    let config = ibid_engine::PoolConfig {
        flatten_step_entries: step,
        events: Some(events.clone()),
        ..quiet_config(1 << 30)
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let pool = Pool::create(&path, config.clone()).expect("create");
    let v = pool.create_volume("v", BLOCKS * BLOCK).expect("volume");
    let mut want: Vec<Vec<u8>> = (0..BLOCKS).map(|b| random_block(b + 1)).collect();
    let write = |want: &mut Vec<Vec<u8>>, b: u64, seed: u64| {
        let data = if seed == 0 {
            vec![0u8; BLOCK as usize]
        } else {
            random_block(seed)
        };
        if seed == 0 {
            v.write_zeroes(b * BLOCK, BLOCK, false).expect("zero");
        } else {
            v.write(b * BLOCK, &data, false).expect("write");
        }
        want[b as usize] = data;
    };
    let check = |want: &Vec<Vec<u8>>, when: &str| {
        let v = pool.volume("v").expect("volume");
        for (b, w) in want.iter().enumerate() {
            let mut one = vec![0u8; BLOCK as usize];
            v.read(b as u64 * BLOCK, &mut one).expect("read");
            assert!(&one == w, "{when} (steps of {step}): block {b}");
        }
        let mapped = want.iter().filter(|w| w.iter().any(|&x| x != 0)).count() as u64;
        assert_eq!(v.mapped_blocks(), mapped, "{when}: mapped blocks");
        pool.verify()
            .unwrap_or_else(|e| panic!("{when}: verify: {e}"));
    };
    for b in 0..BLOCKS {
        write(&mut want, b, b + 1);
    }
    // Frozen: every block. Above it: two writes and a zeroed block.
    pool.create_snapshot("v", "s1").expect("snapshot");
    write(&mut want, 3, 500);
    write(&mut want, 4, 0);
    write(&mut want, 5, 501);
    pool.sync().expect("sync");
    check(&want, "before the first merge");
    pool.delete_snapshot("v", "s1").expect("delete snapshot");
    pool.gc_now().expect("gc");
    assert_eq!(v.stack_depth(), 1, "merged at the bottom");
    check(&want, "merged down at the bottom");

    // A middle: base (every block) < s2 (every block rewritten) < s3 (three blocks) < top.
    pool.create_snapshot("v", "base").expect("snapshot");
    for b in 0..BLOCKS {
        write(&mut want, b, 1000 + b);
    }
    pool.create_snapshot("v", "s2").expect("snapshot");
    write(&mut want, 7, 0);
    write(&mut want, 8, 2000);
    write(&mut want, 9, 0);
    pool.create_snapshot("v", "s3").expect("snapshot");
    write(&mut want, 9, 2001);
    write(&mut want, 10, 2002);
    pool.sync().expect("sync");
    assert_eq!(v.stack_depth(), 4);
    // s3's layer (three entries, two tombstones) is private once s3 goes, under the top (two
    // entries): the top moves down into it, keeping the tombstone of block 7 over s2's data.
    pool.delete_snapshot("v", "s3").expect("delete snapshot");
    pool.gc_now().expect("gc");
    assert_eq!(v.stack_depth(), 3, "s3's layer merged");
    check(&want, "merged down in the middle");
    // s2's layer (every block) is private once s2 goes, under the merged top (four entries).
    pool.delete_snapshot("v", "s2").expect("delete snapshot");
    pool.gc_now().expect("gc");
    assert_eq!(v.stack_depth(), 2, "s2's layer merged");
    check(&want, "merged down over the base");
    // Rewrite every block, then let the base go: the top is the larger, the base moves up.
    for b in 0..BLOCKS {
        let seed = if b % 5 == 0 { 0 } else { 3000 + b };
        write(&mut want, b, seed);
    }
    pool.sync().expect("sync");
    pool.delete_snapshot("v", "base").expect("delete snapshot");
    pool.gc_now().expect("gc");
    assert_eq!(v.stack_depth(), 1, "the base merged");
    check(&want, "merged up at the bottom");
    // The partial steps each merge took (the last step of each is logged as the merge).
    let steps = events
        .recent()
        .iter()
        .filter(|l| l.contains("flatten v:") && l.contains(" moved "))
        .count();
    let merges = events
        .recent()
        .iter()
        .filter(|l| l.contains("flatten v:") && l.contains(" merged "))
        .count();
    assert_eq!(merges, 4, "merges");
    if step == u64::MAX {
        assert_eq!(steps, 0, "one step per merge");
    } else {
        // The base's 64 entries moved up in steps of three, at least.
        assert!(steps >= 64 / 3, "{steps} partial steps in steps of {step}");
    }
    drop(v);
    pool.close().expect("close");
    let pool = Pool::open(&path, config).expect("open");
    let v = pool.volume("v").expect("volume");
    for (b, w) in want.iter().enumerate() {
        let mut one = vec![0u8; BLOCK as usize];
        v.read(b as u64 * BLOCK, &mut one).expect("read");
        assert!(&one == w, "after a reopen: block {b}");
    }
    pool.verify().expect("verify after a reopen");
}
