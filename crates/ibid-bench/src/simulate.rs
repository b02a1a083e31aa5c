//! `ibid-bench simulate`: runs the engine's deterministic simulator
//! ([`ibid_engine::simulator`]) over a range of seeds, each cutting the power at random I/O
//! points, and ends with `simulated N seeds: P power cuts, O operations, F failures` (exit
//! status 1 on a failure, after printing the seed that replays it).

use anyhow::{bail, Context, Result};
use clap::Args;
use ibid_engine::simulator::{self, SimOptions};
use std::time::Instant;

/// Options of `ibid-bench simulate`.
#[derive(Args)]
pub struct SimulateArgs {
    /// Seeds to run: `A..B` (B excluded) or one seed.
    #[arg(long, default_value = "0..40")]
    seeds: String,
    /// Engine operations per seed.
    #[arg(long, default_value_t = SimOptions::default().operations)]
    operations: u64,
    /// A power cut is armed within this many mutating I/O operations.
    #[arg(long, default_value_t = SimOptions::default().cut_within_io)]
    cut_within_io: u64,
    /// Run each seed twice and fail if the two runs' I/O differ (determinism check).
    #[arg(long)]
    twice: bool,
    /// Run the engine's own threads (segment I/O and sync, ...): races are exercised, but a
    /// seed no longer replays exactly.
    #[arg(long)]
    threads: bool,
    /// Also run the pool's background thread (the committer and the segment cleaner);
    /// implies `--threads`.
    #[arg(long)]
    background: bool,
    /// After every operation, read every volume and compare it with the model.
    #[arg(long)]
    check_each_step: bool,
    /// Print one line per seed.
    #[arg(long)]
    verbose: bool,
}

/// Parses `A..B` or `A`.
fn seed_range(s: &str) -> Result<std::ops::Range<u64>> {
    let parse = |x: &str| {
        x.trim()
            .parse::<u64>()
            .with_context(|| format!("seed {x:?}"))
    };
    match s.split_once("..") {
        Some((a, b)) => Ok(parse(a)?..parse(b)?),
        None => {
            let a = parse(s)?;
            Ok(a..a + 1)
        }
    }
}

/// Runs the seeds; see the module doc.
pub fn simulate(a: &SimulateArgs) -> Result<()> {
    let options = SimOptions {
        operations: a.operations,
        cut_within_io: a.cut_within_io.max(1),
        threads: a.threads,
        background: a.background,
        check_each_step: a.check_each_step,
    };
    let seeds = seed_range(&a.seeds)?;
    let started = Instant::now();
    let (mut n, mut cuts, mut ops, mut failures, mut faults) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for seed in seeds {
        n += 1;
        match simulator::run(seed, &options) {
            Ok(out) => {
                cuts += out.power_cuts;
                ops += out.operations;
                faults += out.faults;
                if a.twice {
                    let again = simulator::run(seed, &options);
                    if again.as_ref().ok() != Some(&out) {
                        failures += 1;
                        eprintln!("seed {seed}: a second run differed: {out:?} then {again:?}");
                        eprintln!("replay: ibid-bench simulate --seeds {seed} --twice");
                    }
                }
                if a.verbose {
                    println!(
                        "seed {seed}: {} power cuts, {} operations, {} I/O operations, {} faults, \
                         digest {:016x}",
                        out.power_cuts, out.operations, out.io_operations, out.faults, out.digest
                    );
                }
            }
            Err(failure) => {
                failures += 1;
                eprint!("{failure}");
                eprintln!("replay: ibid-bench simulate --seeds {seed}");
            }
        }
    }
    println!(
        "simulated {n} seeds: {cuts} power cuts, {ops} operations, {failures} failures \
         ({faults} injected I/O errors fired, {:.1} s)",
        started.elapsed().as_secs_f64()
    );
    if failures > 0 {
        bail!("{failures} of {n} seeds failed");
    }
    Ok(())
}
