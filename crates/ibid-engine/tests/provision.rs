//! Provisioning formats: thin, lazy-zeroed thick and eager-zeroed thick are space policies.
//! Thick volumes reserve their space (and the pool headroom for their overwrites), keep their
//! promise when thin volumes fill the pool, and every creation and conversion is a metadata
//! operation.

mod common;

use common::{quiet_config, random_block};
use ibid_engine::{
    Error, Pool, VolumeFormat, OVERWRITE_HEADROOM_BLOCKS_MAX, RESERVED_BYTES_PER_BLOCK,
};

const BLOCK: u64 = 4096;
const PIB: u64 = 1 << 50;

/// What the pool reserves for thick volumes of `blocks` blocks in all, `unwritten` of them
/// without data: those, and the overwrite headroom.
fn reservation(unwritten: u64, blocks: u64) -> u64 {
    (unwritten + blocks.min(OVERWRITE_HEADROOM_BLOCKS_MAX)) * RESERVED_BYTES_PER_BLOCK
}

fn info(pool: &Pool, name: &str) -> ibid_engine::VolumeInfo {
    pool.list_volumes()
        .into_iter()
        .find(|v| v.name == name)
        .expect("volume listed")
}

/// Every format creates a 1 PiB volume without writing data, and reports its reservation and
/// tbz as the format promises; the pool's sums hold.
#[test]
fn every_format_creates_a_petabyte_volume_as_metadata() {
    let dir = tempfile::tempdir().expect("tempdir");
    let capacity = 4 * PIB / BLOCK * RESERVED_BYTES_PER_BLOCK;
    let pool = Pool::create(dir.path().join("p"), quiet_config(capacity)).expect("create");
    let before = pool.stats().segment_file_bytes;
    for f in VolumeFormat::ALL {
        pool.create_volume_with_format(f.as_str(), PIB, f)
            .expect("create 1 PiB");
    }
    assert_eq!(
        pool.stats().segment_file_bytes,
        before,
        "creation wrote data"
    );
    let blocks = PIB / BLOCK;
    let thin = info(&pool, "thin");
    assert_eq!(
        (thin.format, thin.tbz_blocks, thin.reserved_bytes),
        (VolumeFormat::Thin, 0, 0)
    );
    let lazy = info(&pool, "lazyzeroedthick");
    assert_eq!(lazy.tbz_blocks, blocks);
    assert_eq!(lazy.reserved_bytes, blocks * RESERVED_BYTES_PER_BLOCK);
    let eager = info(&pool, "eagerzeroedthick");
    assert_eq!(eager.tbz_blocks, 0);
    assert_eq!(eager.reserved_bytes, blocks * RESERVED_BYTES_PER_BLOCK);
    let s = pool.stats();
    assert_eq!(s.provisioned_bytes, 3 * PIB);
    assert_eq!(s.thick_provisioned_bytes, 2 * PIB);
    assert_eq!(s.reserved_bytes, reservation(2 * blocks, 2 * blocks));
    assert_eq!(
        s.overwrite_headroom_bytes,
        OVERWRITE_HEADROOM_BLOCKS_MAX * RESERVED_BYTES_PER_BLOCK
    );
    assert_eq!(
        s.free_bytes,
        s.capacity_bytes - s.used_bytes - s.reserved_bytes
    );
    // A write consumes the block's reservation; zeroing it gives the reservation back.
    let v = pool.volume("lazyzeroedthick").expect("open");
    v.write(PIB - BLOCK, &random_block(1), true).expect("write");
    let lazy = info(&pool, "lazyzeroedthick");
    assert_eq!(lazy.tbz_blocks, blocks - 1);
    assert_eq!(
        pool.stats().reserved_bytes,
        reservation(2 * blocks - 1, 2 * blocks)
    );
    v.write_zeroes(PIB - BLOCK, BLOCK, true).expect("zero");
    assert_eq!(info(&pool, "lazyzeroedthick").tbz_blocks, blocks);
}

/// A thick volume the pool cannot guarantee is refused, precisely, and nothing changes.
#[test]
fn thick_creation_and_growth_beyond_the_pool_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(64 << 20)).expect("create");
    // The filter build's commit must not grow the store between `before` and the refusal.
    pool.wait_filters_built();
    let before = pool.stats();
    let result = pool.create_volume_with_format("big", 64 << 20, VolumeFormat::EagerZeroedThick);
    match result
        .map(|_| ())
        .expect_err("64 MiB thick in a 64 MiB pool with metadata")
    {
        Error::CannotReserve { needed, available } => {
            let blocks = (64 << 20) / BLOCK;
            assert_eq!(needed, reservation(blocks, blocks));
            assert_eq!(available, before.free_bytes);
        }
        e => panic!("expected CannotReserve, got {e:?}"),
    }
    assert!(pool.list_volumes().is_empty());
    assert_eq!(pool.stats().reserved_bytes, 0);
    // Thin volumes of any size are fine: they reserve nothing.
    pool.create_volume("thin", PIB).expect("thin 1 PiB");
    // A thick volume that fits (its blocks and as many again of overwrite headroom); growing
    // it reserves the difference, or is refused.
    pool.create_volume_with_format("t", 8 << 20, VolumeFormat::LazyZeroedThick)
        .expect("8 MiB thick");
    let reserved = pool.stats().reserved_bytes;
    let blocks = (8 << 20) / BLOCK;
    assert_eq!(reserved, reservation(blocks, blocks));
    pool.resize_volume("t", 16 << 20).expect("grow to 16 MiB");
    assert_eq!(pool.stats().reserved_bytes, 2 * reserved);
    let err = pool
        .resize_volume("t", 64 << 20)
        .expect_err("grow past the pool");
    assert!(matches!(err, Error::CannotReserve { .. }), "{err:?}");
    assert_eq!(info(&pool, "t").size_bytes, 16 << 20);
    assert_eq!(pool.stats().reserved_bytes, 2 * reserved);
    // Inflating a thin volume is refused the same way and leaves it thin.
    let err = pool
        .set_volume_format("thin", VolumeFormat::EagerZeroedThick)
        .expect_err("inflate 1 PiB");
    assert!(matches!(err, Error::CannotReserve { .. }), "{err:?}");
    assert_eq!(info(&pool, "thin").format, VolumeFormat::Thin);
    // Deleting the thick volume returns its reservation.
    pool.delete_volume("t").expect("delete");
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// Thin volumes fill the pool until their writes fail; a thick volume still writes every one
/// of its blocks with unique data, then (thin volumes having taken what its data left over)
/// overwrites every one with new data, and after a zero of the whole volume whose range
/// settles over many commits, writes every one again; freeing thin data lets thin volumes
/// write again.
#[test]
fn thick_volume_writes_every_block_after_thin_volumes_fill_the_pool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ibid_engine::PoolConfig {
        // The zero below settles 64 entries per commit: 32 commits for the volume.
        zero_settle_entries_max: 64,
        ..quiet_config(48 << 20)
    };
    let pool = Pool::create(dir.path().join("p"), config).expect("create");
    let thick_blocks = (8 << 20) / BLOCK;
    let thick = pool
        .create_volume_with_format("thick", 8 << 20, VolumeFormat::EagerZeroedThick)
        .expect("thick");
    let thin = pool.create_volume("thin", 1 << 30).expect("thin");
    let mut written = 0u64;
    let mut fill_thin = |what: &str| {
        let err = loop {
            match thin.write(written * BLOCK, &random_block(written), false) {
                Ok(()) => written += 1,
                Err(e) => break e,
            }
            assert!(written < 100_000, "{what}: the pool never filled");
            if written.is_multiple_of(1024) {
                pool.sync().expect("sync");
            }
        };
        assert!(matches!(err, Error::NoSpace), "{what}: got {err:?}");
        pool.sync().expect("sync");
    };
    fill_thin("thin volumes fill the pool");
    let s = pool.stats();
    assert!(s.reserved_bytes > 0 && s.free_bytes < 64 << 10, "{s:?}");
    let write_every_block = |seed: u64, what: &str| {
        for b in 0..thick_blocks {
            thick
                .write(b * BLOCK, &random_block(seed + b), false)
                .unwrap_or_else(|e| {
                    panic!(
                        "{what}: thick block {b} of {thick_blocks}: {e}; before {s:?} now {:?}",
                        pool.stats()
                    )
                });
            if b % 512 == 511 {
                pool.sync().expect("sync");
            }
        }
        thick.flush().expect("flush");
        let mut buf = vec![0u8; BLOCK as usize];
        for b in (0..thick_blocks).step_by(61) {
            thick.read(b * BLOCK, &mut buf).expect("read");
            assert_eq!(buf, random_block(seed + b), "{what}: thick block {b}");
        }
    };
    write_every_block(1_000_000, "first write");
    // What stays reserved is the overwrite headroom.
    let headroom = thick_blocks * RESERVED_BYTES_PER_BLOCK;
    let s = pool.stats();
    assert_eq!(
        (s.reserved_bytes, s.overwrite_headroom_bytes),
        (headroom, headroom)
    );
    // The reservation's allowance for metadata that the thick data did not need is free again;
    // thin writes take it and fail again soon.
    fill_thin("thin volumes fill the pool again");
    write_every_block(2_000_000, "overwrite");
    thick.write_zeroes(0, 8 << 20, false).expect("zero");
    write_every_block(3_000_000, "write after a zero");
    assert_eq!(pool.stats().reserved_bytes, headroom);
    pool.verify().expect("verify");
    // Until thin data goes away.
    thin.write_zeroes(0, written * BLOCK, true).expect("unmap");
    pool.gc_now().expect("gc");
    thin.write(0, &random_block(7_777_777), true)
        .expect("thin writes again");
    pool.verify().expect("verify");
}

/// Conversions are metadata-only, survive a reopen, and move the reservation as promised.
#[test]
fn conversions_move_the_reservation_and_survive_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let pool = Pool::create(&path, quiet_config(1 << 30)).expect("create");
    let v = pool.create_volume("v", 64 << 20).expect("thin");
    v.write(0, &random_block(1), true).expect("write");
    v.write(BLOCK, &random_block(2), true).expect("write");
    drop(v);
    let blocks = (64 << 20) / BLOCK;
    // Stats are exact as of a commit (FUA only journals: the records may still be buffered).
    pool.sync().expect("commit");
    let data_before = pool.stats().segment_file_bytes;
    // thin -> lazy (reserve), lazy -> eager (vmkfstools -k), eager -> thin, thin -> eager
    // (inflate).
    let prev = pool
        .set_volume_format("v", VolumeFormat::LazyZeroedThick)
        .expect("reserve");
    assert_eq!(prev, VolumeFormat::Thin);
    let i = info(&pool, "v");
    assert_eq!(i.tbz_blocks, blocks - 2);
    assert_eq!(i.reserved_bytes, (blocks - 2) * RESERVED_BYTES_PER_BLOCK);
    pool.set_volume_format("v", VolumeFormat::EagerZeroedThick)
        .expect("eagerzero");
    assert_eq!(info(&pool, "v").tbz_blocks, 0);
    assert_eq!(pool.stats().reserved_bytes, reservation(blocks - 2, blocks));
    pool.close().expect("close");
    let pool = Pool::open(&path, quiet_config(0)).expect("reopen");
    let i = info(&pool, "v");
    assert_eq!(i.format, VolumeFormat::EagerZeroedThick);
    assert_eq!(pool.stats().reserved_bytes, reservation(blocks - 2, blocks));
    pool.set_volume_format("v", VolumeFormat::Thin)
        .expect("back to thin");
    assert_eq!(pool.stats().reserved_bytes, 0);
    pool.set_volume_format("v", VolumeFormat::EagerZeroedThick)
        .expect("inflate");
    assert_eq!(
        pool.stats().segment_file_bytes,
        data_before,
        "a conversion wrote data"
    );
    let mut buf = vec![0u8; BLOCK as usize];
    pool.volume("v")
        .expect("open")
        .read(BLOCK, &mut buf)
        .expect("read");
    assert_eq!(buf, random_block(2));
    // Clones and snapshots of a thick volume are thin: they reserve nothing.
    pool.clone_volume("v", "c").expect("clone");
    assert_eq!(info(&pool, "c").format, VolumeFormat::Thin);
    assert_eq!(pool.stats().reserved_bytes, reservation(blocks - 2, blocks));
    assert!(matches!(
        pool.set_volume_format("nope", VolumeFormat::Thin),
        Err(Error::NotFound(_))
    ));
    pool.verify().expect("verify");
}

/// Capacity and soft threshold change at run time, persist, and refuse what would break a
/// promise.
#[test]
fn capacity_and_soft_threshold_are_adjustable_within_the_promises() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("p");
    let pool = Pool::create(&path, quiet_config(64 << 20)).expect("create");
    pool.create_volume_with_format("t", 16 << 20, VolumeFormat::EagerZeroedThick)
        .expect("thick");
    let s = pool.stats();
    let floor = s.used_bytes + s.reserved_bytes;
    let err = pool
        .set_capacity(floor - 1)
        .expect_err("below the reservations");
    assert!(matches!(err, Error::CannotReserve { .. }), "{err:?}");
    assert_eq!(pool.stats().capacity_bytes, 64 << 20);
    // With 85 % used or reserved, the soft threshold (80 %) is crossed.
    let capacity = floor * 100 / 85;
    pool.set_capacity(capacity).expect("shrink");
    assert!(pool.stats().soft_threshold_exceeded);
    assert!(pool.soft_threshold_exceeded());
    pool.set_soft_threshold(95).expect("raise the threshold");
    assert!(!pool.stats().soft_threshold_exceeded);
    assert!(!pool.soft_threshold_exceeded());
    assert!(matches!(
        pool.set_soft_threshold(0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        pool.set_soft_threshold(101),
        Err(Error::InvalidArgument(_))
    ));
    pool.close().expect("close");
    let pool = Pool::open(&path, quiet_config(0)).expect("reopen");
    let s = pool.stats();
    assert_eq!((s.capacity_bytes, s.soft_threshold_pct), (capacity, 95));
}

/// Writers at once overwrite a fully written thick volume on a pool thin volumes filled, each
/// 64 KiB at a time with no flush of their own: the headroom and the commits that free what
/// they replaced admit every write.
#[test]
fn concurrent_overwrites_of_a_full_thick_volume_on_a_full_pool_all_succeed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Pool::create(dir.path().join("p"), quiet_config(64 << 20)).expect("create");
    let blocks = (8 << 20) / BLOCK;
    let thick = pool
        .create_volume_with_format("thick", 8 << 20, VolumeFormat::EagerZeroedThick)
        .expect("thick");
    let thin = pool.create_volume("thin", 1 << 30).expect("thin");
    for b in 0..blocks {
        thick
            .write(b * BLOCK, &random_block(1_000_000 + b), false)
            .expect("first write");
    }
    pool.sync().expect("sync");
    let mut written = 0u64;
    loop {
        match thin.write(written * BLOCK, &random_block(written), false) {
            Ok(()) => written += 1,
            Err(Error::NoSpace) => break,
            Err(e) => panic!("thin: {e}"),
        }
        if written.is_multiple_of(1024) {
            pool.sync().expect("sync");
        }
    }
    pool.sync().expect("sync");
    const WRITERS: u64 = 8;
    const BATCH: u64 = 16;
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let thick = &thick;
            s.spawn(move || {
                for round in 0..4u64 {
                    // Writer w's share of the volume, 16 blocks at a time.
                    for first in (w * BATCH..blocks).step_by((WRITERS * BATCH) as usize) {
                        let data: Vec<u8> = (first..first + BATCH)
                            .flat_map(|b| random_block((round + 2) * 1_000_000 + b))
                            .collect();
                        thick
                            .write(first * BLOCK, &data, false)
                            .unwrap_or_else(|e| {
                                panic!("writer {w} round {round} block {first}: {e}")
                            });
                    }
                }
            });
        }
    });
    pool.sync().expect("sync");
    let mut buf = vec![0u8; BLOCK as usize];
    for b in (0..blocks).step_by(7) {
        thick.read(b * BLOCK, &mut buf).expect("read");
        assert_eq!(buf, random_block(5_000_000 + b), "block {b}");
    }
    pool.verify().expect("verify");
}
