//! `ibid-bench checksum`: the engine's CRC-32C ([`ibid_engine::checksum`]) against the
//! `crc32c` crate's (CRC32 instructions, what the engine used before), per record as the
//! engine checks one (20 header bytes, then a 4 KiB payload) from the cache, and over a
//! buffer larger than the last-level cache in record-sized pieces (the memory-bound case of a
//! read from the page cache).

use anyhow::{ensure, Result};
use clap::Args;
use ibid_engine::checksum;
use std::time::Instant;

/// Arguments of `ibid-bench checksum`.
#[derive(Args)]
pub struct ChecksumArgs {
    /// Rounds (each measures both implementations in turn).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Size of the from-memory buffer, MiB.
    #[arg(long, default_value_t = 512)]
    memory_mib: usize,
}

/// A record as stored: header bytes checksummed, then the payload.
const RECORD: usize = 20 + 4096;

/// Runs the measurement and prints one line per round and implementation.
pub fn checksum(a: &ChecksumArgs) -> Result<()> {
    let mut rng = crate::Rng(7);
    let mut hot = vec![0u8; 256 * RECORD];
    rng.fill(&mut hot);
    let mut big = vec![0u8; a.memory_mib << 20];
    rng.fill(&mut big);
    let engine = |r: &[u8]| checksum::crc32c_parts(&r[..20], &r[20..]);
    let reference = |r: &[u8]| crc32c::crc32c_append(crc32c::crc32c(&r[..20]), &r[20..]);
    for r in hot.chunks(RECORD).chain(big.chunks(RECORD).take(1000)) {
        ensure!(engine(r) == reference(r), "the implementations disagree");
    }
    println!("round\timplementation\tns_per_record_cached\tGBps_from_memory");
    for round in 1..=a.rounds {
        for (name, f) in [
            ("crc-fast (engine)", &engine as &dyn Fn(&[u8]) -> u32),
            ("crc32c crate", &reference),
        ] {
            let passes = 2000;
            let t = Instant::now();
            let mut acc = 0u32;
            for _ in 0..passes {
                for r in hot.chunks(RECORD) {
                    acc ^= f(r);
                }
            }
            let cached = t.elapsed().as_nanos() as f64 / (passes * 256) as f64;
            let t = Instant::now();
            for r in big.chunks(RECORD) {
                acc ^= f(r);
            }
            let memory = big.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
            std::hint::black_box(acc);
            println!("{round}\t{name}\t{cached:.0}\t{memory:.1}");
        }
    }
    Ok(())
}
