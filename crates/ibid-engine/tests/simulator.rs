//! The deterministic simulator in the suite: random engine operations on a simulated disk,
//! power cuts at random I/O points (during recovery too), and the checks against the model
//! (see `ibid_engine::simulator`). `ibid-bench simulate` runs more seeds.

use ibid_engine::simulator::{self, SimOptions};

/// 48 seeds, each with several power cuts: every acknowledged durable write and catalog
/// change survives, nothing appears that was never written, and `verify` passes.
#[test]
fn power_cuts_lose_nothing_durable() {
    let options = SimOptions::default();
    let (mut cuts, mut ops, mut faults) = (0, 0, 0);
    let mut failures = Vec::new();
    for seed in 0..48 {
        match simulator::run(seed, &options) {
            Ok(out) => {
                cuts += out.power_cuts;
                ops += out.operations;
                faults += out.faults;
            }
            Err(f) => failures.push(f.to_string()),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Each seed ends with a cut, and most have several before.
    assert!(cuts >= 48 * 3, "only {cuts} power cuts in 48 seeds");
    assert_eq!(ops, 48 * options.operations);
    // Injected I/O errors fired in many seeds, and were survived like power cuts.
    assert!(faults >= 10, "only {faults} injected I/O errors fired");
}

/// Reading every volume after every operation (`check_each_step`) finds each one as the model
/// holds it, and the reads change nothing a seed checks at its cuts.
#[test]
fn every_volume_reads_as_the_model_after_every_operation() {
    let options = SimOptions {
        check_each_step: true,
        ..SimOptions::default()
    };
    for seed in 100..108 {
        let out = simulator::run(seed, &options).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(out.operations, options.operations, "seed {seed}");
    }
}

/// The same seed does the same I/O: a failure replays from its seed.
#[test]
fn a_seed_replays_bit_for_bit() {
    let options = SimOptions::default();
    for seed in [7, 1001] {
        let a = simulator::run(seed, &options).expect("run");
        let b = simulator::run(seed, &options).expect("run again");
        assert_eq!(a, b, "seed {seed}");
        assert!(a.io_operations > 100, "{a:?}");
    }
}

/// With the engine's own threads running (segment I/O and sync threads, the filters' build),
/// power cuts and injected errors also land between them and the foreground: the same checks
/// hold (a seed no longer replays exactly, so a failure here prints its seed to rerun with
/// `ibid-bench simulate --threads`).
#[test]
fn power_cuts_lose_nothing_durable_with_the_engine_threads_running() {
    let options = SimOptions {
        threads: true,
        cut_within_io: 100,
        ..SimOptions::default()
    };
    run_racing(1000..1016, &options);
}

/// With the pool's background thread running too — the committer waking every 2 ms and the
/// cleaner relocating segments between operations (`io_quiet_ms` 0) — power cuts and injected
/// errors land in their commits and passes as well: the same checks hold (a failure prints
/// its seed, to rerun with `ibid-bench simulate --background`).
#[test]
fn power_cuts_lose_nothing_durable_with_the_background_committer_and_cleaner_running() {
    let options = SimOptions {
        background: true,
        cut_within_io: 100,
        ..SimOptions::default()
    };
    run_racing(2000..2016, &options);
}

/// Runs 16 `seeds` in a racing mode (not replayable): none may fail, and each must have cut
/// the power a few times.
fn run_racing(seeds: std::ops::Range<u64>, options: &SimOptions) {
    assert_eq!(seeds.end - seeds.start, 16);
    let mut cuts = 0;
    let mut failures = Vec::new();
    for seed in seeds {
        match simulator::run(seed, options) {
            Ok(out) => cuts += out.power_cuts,
            Err(f) => failures.push(f.to_string()),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(cuts >= 16 * 5, "only {cuts} power cuts in 16 seeds");
}
