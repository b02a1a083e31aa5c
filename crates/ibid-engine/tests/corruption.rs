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

fn corrupt_and_check(flip_at_record_offset: u64) {
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
    // The first record starts right after the 64-byte segment header.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&segments[0])
        .expect("segment");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, 64 + flip_at_record_offset)
        .expect("read byte");
    byte[0] ^= 0x40;
    file.write_all_at(&byte, 64 + flip_at_record_offset)
        .expect("flip byte");
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
    corrupt_and_check(24 + 100);
}

#[test]
fn flipped_header_byte_is_reported_not_returned() {
    corrupt_and_check(13);
}

#[test]
fn flipped_magic_is_reported_not_returned() {
    corrupt_and_check(1);
}
