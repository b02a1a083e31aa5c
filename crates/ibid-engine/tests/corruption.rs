//! Corruption: bytes flipped in a segment file make the read of the affected block fail with
//! `Error::Corrupt`; every other block still reads back exactly. Never silently wrong data.
//! `Pool::verify` and a scrub (`Pool::scrub_step`) report the damage, naming the chunk and the
//! block that reads it.

use ibid_engine::{Error, Pool, PoolConfig};
use std::os::unix::fs::FileExt;

const BLOCKS: u64 = 64;

fn block_content(i: u64) -> Vec<u8> {
    // Half compressible, half not, so both record kinds are covered.
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..4096)
        .map(|j| {
            if i.is_multiple_of(2) && j % 64 != 0 {
                return (i as u8).wrapping_add(1);
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The record whose byte a test flips.
#[derive(Clone, Copy)]
enum Target {
    /// The first record of the first segment that holds one.
    First,
    /// The first record stored uncompressed (read straight into a reader's buffer by grouped
    /// reads).
    FirstUncompressed,
}

/// Where in the segment file `target`'s record starts, if the file holds one. (A writer's
/// records can land in another writer's segment while its own is busy, so any segment may
/// hold only a few, or only compressed ones.)
fn record_start(file: &std::fs::File, target: Target) -> Option<u64> {
    // Records follow the 64-byte segment header; a header holds its magic at bytes 0..4, its
    // flags at 4..6 and its payload's length at 8..12; after the last one, the file ends or
    // holds zeros.
    let mut at = 64;
    loop {
        let mut header = [0u8; 24];
        file.read_exact_at(&mut header, at).ok()?;
        if header[..4] != ibid_engine::format::RECORD_MAGIC.to_le_bytes() {
            return None;
        }
        let flags = u16::from_le_bytes([header[4], header[5]]);
        let stored = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        match target {
            Target::First => return Some(at),
            Target::FirstUncompressed if flags & 1 == 0 => return Some(at),
            Target::FirstUncompressed => at += 24 + stored as u64,
        }
    }
}

fn corrupt_and_check(target: Target, flip_at_record_offset: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let config = PoolConfig {
        capacity_bytes: Some(1 << 30),
        background: false,
        ..PoolConfig::default()
    };
    let pool = Pool::create(&path, config.clone()).expect("create");
    let vol = pool.create_volume("v", BLOCKS * 4096).expect("volume");
    for i in 0..BLOCKS {
        vol.write(i * 4096, &block_content(i), false)
            .expect("write");
    }
    drop(vol);
    let segments = pool.segment_paths();
    pool.close().expect("close");
    let (file, start) = segments
        .iter()
        .find_map(|path| {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .expect("segment");
            record_start(&file, target).map(|at| (file, at))
        })
        .expect("a segment holds the target record");
    let at = start + flip_at_record_offset;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at).expect("read byte");
    byte[0] ^= 0x40;
    file.write_all_at(&byte, at).expect("flip byte");
    drop(file);

    let pool = Pool::open(&path, config).expect("reopen");
    let vol = pool.volume("v").expect("volume");
    let mut corrupt = 0;
    let mut bad_block = None;
    for i in 0..BLOCKS {
        let mut buf = vec![0u8; 4096];
        match vol.read(i * 4096, &mut buf) {
            Ok(()) => assert_eq!(
                buf,
                block_content(i),
                "block {i} read back wrong data without an error"
            ),
            Err(Error::Corrupt(msg)) => {
                assert!(msg.contains("checksum") || msg.contains("magic"), "{msg}");
                corrupt += 1;
                bad_block = Some(i);
            }
            Err(e) => panic!("block {i}: unexpected error {e}"),
        }
    }
    assert_eq!(
        corrupt, 1,
        "exactly the block whose record was damaged fails"
    );
    // Reads of many blocks (records read together, payloads stored whole straight into the
    // reader's buffer): one that covers the damaged block fails, whatever its alignment; one
    // that does not reads exactly.
    let bad = bad_block.expect("a damaged block");
    let all = (0..BLOCKS).flat_map(block_content).collect::<Vec<u8>>();
    // (Reads are in 512-byte sectors.)
    let ranges = [
        (0, BLOCKS * 4096),
        (bad * 4096 - 4096.min(bad * 4096) + 512, 3 * 4096 - 1024),
        (bad * 4096 + 3584, 512),
        (0, bad * 4096),
        ((bad + 1) * 4096, (BLOCKS - bad - 1) * 4096),
        (((bad + 1) * 4096 + 512).min(BLOCKS * 4096 - 1024), 1024),
    ];
    for (start, len) in ranges {
        if len == 0 {
            continue;
        }
        let mut buf = vec![0u8; len as usize];
        let covers = start / 4096 <= bad && bad <= (start + len - 1) / 4096;
        match vol.read(start, &mut buf) {
            Ok(()) => {
                assert!(
                    !covers,
                    "a read of {start}+{len} hid the damaged block {bad}"
                );
                assert!(
                    buf == all[start as usize..(start + len) as usize],
                    "{start}+{len}"
                );
            }
            Err(Error::Corrupt(_)) => assert!(covers, "{start}+{len} failed without damage"),
            Err(e) => panic!("{start}+{len}: unexpected error {e}"),
        }
    }
    // A scrub in steps of 5 chunks finds the one damaged chunk and the block that reads it.
    let (mut from, mut checked, mut damaged) = (0, 0, Vec::new());
    loop {
        let step = pool.scrub_step(from, 5).expect("scrub step");
        checked += step.checked;
        damaged.extend(step.damaged);
        match step.next {
            Some(next) => from = next,
            None => break,
        }
    }
    assert_eq!(
        checked,
        pool.stats().unique_chunks,
        "a pass checks every live chunk"
    );
    assert_eq!(damaged.len(), 1, "{damaged:?}");
    assert_eq!(
        damaged[0].places,
        vec![("v".to_string(), bad_block.expect("a damaged block"))]
    );
    let verify = pool.verify();
    assert!(
        matches!(verify, Err(Error::Corrupt(_))),
        "verify must report the damage: {verify:?}"
    );
    // It names the damaged chunk and the block that reads it.
    let message = verify.expect_err("damage").to_string();
    let bad_block = bad_block.expect("a damaged block");
    assert!(
        message.contains("1 damaged chunk: chunk ")
            && message.contains(&format!(") is block {bad_block} of \"v\"")),
        "{message}"
    );
}

#[test]
fn flipped_payload_byte_is_reported_not_returned() {
    corrupt_and_check(Target::First, 24 + 100);
}

#[test]
fn flipped_byte_of_a_payload_stored_whole_is_reported_not_returned() {
    corrupt_and_check(Target::FirstUncompressed, 24 + 4000);
}

#[test]
fn flipped_header_byte_of_a_payload_stored_whole_is_reported_not_returned() {
    corrupt_and_check(Target::FirstUncompressed, 9);
}

#[test]
fn flipped_header_byte_is_reported_not_returned() {
    corrupt_and_check(Target::First, 13);
}

#[test]
fn flipped_magic_is_reported_not_returned() {
    corrupt_and_check(Target::First, 1);
}
