//! `ibid-bench map-overwrites`: what the map's store work costs per random overwrite, with the
//! map's writes deferred (`store/deferred.rs`: a log, written back a slice at a time) and
//! written straight into the B-tree (as before format 12), the store alone (no server, no
//! client, no cleaner): the comparison the server's benchmarks were too noisy to settle.
//!
//! Each mode fills a fresh store's map with `--blocks` blocks written in order (transactions
//! of 64 Ki blocks, written straight through), then commits `--txns` transactions of
//! `--batch` random overwrites each through `map_table::Changes` (a commit's map step), and
//! reports µs per overwrite and the bytes the process passed to write calls per overwrite
//! (`wchar` of `/proc/self/io`: redb's page writes).

use anyhow::{Context, Result};
use clap::Args;
use ibid_engine::map_table::Changes;
use ibid_engine::store::{Backend, Store};
use std::path::PathBuf;
use std::time::Instant;

/// Options of `ibid-bench map-overwrites`.
#[derive(Args, Clone)]
pub struct MapOverwritesArgs {
    /// Directory for the temporary stores (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Blocks in the map (4 Mi: a 16 GiB volume).
    #[arg(long, default_value_t = 4 << 20)]
    blocks: u64,
    /// Overwrites per transaction (a commit under goal 2's load holds 30–45 Ki).
    #[arg(long, default_value_t = 40_000)]
    batch: u64,
    /// Transactions of random overwrites.
    #[arg(long, default_value_t = 48)]
    txns: u64,
}

/// Bytes this process has passed to write calls so far.
fn written_bytes() -> Result<u64> {
    let io = std::fs::read_to_string("/proc/self/io").context("read /proc/self/io")?;
    io.lines()
        .find_map(|l| l.strip_prefix("wchar: "))
        .context("no wchar in /proc/self/io")?
        .trim()
        .parse()
        .context("parse wchar")
}

/// Runs both modes and prints one Markdown table.
pub fn map_overwrites(a: &MapOverwritesArgs) -> Result<()> {
    println!(
        "# ibid-bench map-overwrites: {} blocks, {} transactions of {} random overwrites",
        a.blocks, a.txns, a.batch
    );
    println!("| map writes | µs per overwrite | store bytes written per overwrite |");
    println!("|---|---|---|");
    for deferred in [false, true] {
        let base = match &a.dir {
            Some(d) => tempfile::tempdir_in(d),
            None => tempfile::tempdir(),
        }
        .context("temp dir")?;
        let store = Store::create(base.path(), Backend::Redb)?;
        for start in (0..a.blocks).step_by(64 << 10) {
            let mut txn = store.write()?;
            txn.write_through();
            let mut changes = Changes::new();
            for b in start..(start + (64 << 10)).min(a.blocks) {
                changes.set(1, b, b + 1);
            }
            changes.write(&mut txn)?;
            txn.commit()?;
        }
        let mut next = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = || {
            next ^= next << 13;
            next ^= next >> 7;
            next ^= next << 17;
            next
        };
        let (w0, t0) = (written_bytes()?, Instant::now());
        for _ in 0..a.txns {
            let mut txn = store.write()?;
            if !deferred {
                txn.write_through();
            }
            let mut changes = Changes::new();
            for _ in 0..a.batch {
                let b = rand() % a.blocks;
                changes.set(1, b, rand() >> 24);
            }
            changes.write(&mut txn)?;
            txn.commit()?;
        }
        let (secs, bytes) = (t0.elapsed().as_secs_f64(), written_bytes()? - w0);
        let n = (a.txns * a.batch) as f64;
        println!(
            "| {} | {:.2} | {:.0} |",
            if deferred {
                "deferred (log)"
            } else {
                "straight into the B-tree"
            },
            secs * 1e6 / n,
            bytes as f64 / n
        );
    }
    Ok(())
}
