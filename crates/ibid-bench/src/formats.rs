//! `ibid-bench formats`: creation time of thin, lazy- and eager-zeroed thick volumes at 1 GiB,
//! 1 TiB and 1 PiB, and `inflate` / `eagerzero` of a 1 TiB volume (issue 5, "Measure it").
//!
//! Each measurement is repeated `--runs` times on one pool (capacity set high enough for the
//! reservations; capacity is an accounting figure, not disk space) and reported as the median
//! and spread, next to the goal (< 10 ms, flat in size). The verdict is on the median and says
//! when every run met it: each run includes a metadata fsync, which stalls under load.
//! Creation and conversion must write no data: the segment files' size is checked.

use super::{fresh_pool, median, uptime, MIB};
use anyhow::{ensure, Result};
use clap::Args;
use ibid_engine::VolumeFormat;
use std::path::PathBuf;
use std::time::Instant;

const GIB: u64 = 1024 * MIB;
const TIB: u64 = 1024 * GIB;
const PIB: u64 = 1024 * TIB;

#[derive(Args, Clone)]
pub(crate) struct FormatsArgs {
    /// Fewer runs (finishes in a second or two; for tests and smoke runs).
    #[arg(long)]
    quick: bool,
    /// Directory under which the temporary pool is created (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs of each measurement (median and spread are reported).
    #[arg(long)]
    runs: Option<usize>,
}

fn row(what: &str, ms: &[f64]) {
    let lo = ms.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ms.iter().copied().fold(0.0, f64::max);
    let med = median(ms.to_vec());
    let verdict = if med < 10.0 { "met" } else { "missed" };
    let all = if hi < 10.0 { ", every run" } else { "" };
    println!("| {what} | {med:.3} ({lo:.3}–{hi:.3}) | < 10 ms: {verdict}{all} |");
}

fn human(size: u64) -> &'static str {
    match size {
        GIB => "1 GiB",
        TIB => "1 TiB",
        PIB => "1 PiB",
        _ => "?",
    }
}

pub(crate) fn formats(a: &FormatsArgs) -> Result<()> {
    let runs = a.runs.unwrap_or(if a.quick { 2 } else { 20 }).max(1);
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    println!("# ibid-bench formats: runs={runs} (load avg {})", uptime());
    let (_dir, pool) = fresh_pool(&base)?;
    pool.set_capacity_forced(4 * PIB)?;
    // Some data in the pool, so creation does not run on an empty metadata store.
    let seed = pool.create_volume("seed", GIB)?;
    let block: Vec<u8> = (0..64 * MIB).map(|i| (i * 7 + i / 4096) as u8).collect();
    seed.write(0, &block, false)?;
    pool.sync()?;
    let data_before = pool.stats().segment_file_bytes;
    println!();
    println!("| measurement | ms, median (min–max) | goal |");
    println!("|---|---|---|");
    let mut n = 0;
    for format in VolumeFormat::ALL {
        for size in [GIB, TIB, PIB] {
            let mut ms = Vec::with_capacity(runs);
            for _ in 0..runs {
                n += 1;
                let name = format!("v{n}");
                let t = Instant::now();
                pool.create_volume_with_format(&name, size, format)?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
                pool.delete_volume(&name)?;
            }
            row(&format!("create {format} {}", human(size)), &ms);
        }
    }
    let mut inflate = Vec::with_capacity(runs);
    let mut eagerzero = Vec::with_capacity(runs);
    for _ in 0..runs {
        n += 1;
        let name = format!("v{n}");
        let v = pool.create_volume(&name, TIB)?;
        v.write(0, &block[..(16 * MIB) as usize], true)?;
        let t = Instant::now();
        pool.set_volume_format(&name, VolumeFormat::EagerZeroedThick)?;
        inflate.push(t.elapsed().as_secs_f64() * 1e3);
        pool.delete_volume(&name)?;
        n += 1;
        let name = format!("v{n}");
        pool.create_volume_with_format(&name, TIB, VolumeFormat::LazyZeroedThick)?;
        let t = Instant::now();
        pool.set_volume_format(&name, VolumeFormat::EagerZeroedThick)?;
        eagerzero.push(t.elapsed().as_secs_f64() * 1e3);
        pool.delete_volume(&name)?;
    }
    row(
        "inflate 1 TiB thin (16 MiB written) -> eagerzeroedthick",
        &inflate,
    );
    row(
        "eagerzero 1 TiB lazyzeroedthick -> eagerzeroedthick",
        &eagerzero,
    );
    pool.sync()?;
    let added = pool.stats().segment_file_bytes.saturating_sub(data_before);
    // The inflate runs wrote 16 MiB of duplicate data each (deduplicated against `seed`).
    println!();
    println!("segment-file bytes added by creations and conversions: {added}");
    ensure!(
        added < 16 * MIB,
        "creating or converting volumes wrote {added} bytes of data"
    );
    println!("# done");
    Ok(())
}
