//! `ibid-bench engine --quick` runs and prints every row of its tables.

mod common;

use common::run_bench;

#[test]
fn engine_quick_prints_the_table() {
    let stdout = run_bench(&["engine", "--quick"]);
    for row in [
        "| test | MB/s | IOPS | p50 µs | p99 µs | CPU cores | MB per CPU-s | goal |",
        "| seq write 1 MiB unique incompressible |",
        "| seq write 1 MiB duplicate |",
        "| seq write 1 MiB all-zero |",
        "| rand write 4 KiB, N threads |",
        "| seq read 1 MiB |",
        "| rand read 4 KiB, N threads |",
        "| rand read 4 KiB, QD1 |",
        "| rand write 4 KiB, QD1 |",
        "| write+flush 4 KiB, QD1 |",
        "| dedup filter RAM (live pool) |",
        "| process RSS growth while writing |",
        "| dedup filter RAM after reopen |",
        "open after crash: median",
    ] {
        assert!(stdout.contains(row), "missing {row:?} in:\n{stdout}");
    }
    // Every throughput row has a number in its MB/s and IOPS columns.
    for line in stdout
        .lines()
        .filter(|l| l.starts_with("| seq") || l.starts_with("| rand") || l.starts_with("| write"))
    {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        assert!(
            cols[3]
                .split(' ')
                .next()
                .unwrap_or("")
                .parse::<f64>()
                .is_ok(),
            "IOPS not a number: {line}"
        );
    }
}

/// `ibid-bench offload --memory --quick` pushes and restores through the in-memory store and
/// prints each round's rates and CPU seconds per GiB, and their medians.
#[test]
fn offload_memory_quick_prints_cpu_per_gib() {
    let stdout = run_bench(&["offload", "--memory", "--quick", "--rounds", "1"]);
    let row = stdout
        .lines()
        .find(|l| l.starts_with("0\t"))
        .unwrap_or_else(|| panic!("no round 0 in:\n{stdout}"));
    let figures: Vec<f64> = row
        .split('\t')
        .skip(1)
        .map(|c| c.parse().expect("a number"))
        .collect();
    assert!(
        figures.len() == 4 && figures.iter().all(|&x| x > 0.0),
        "{row}"
    );
    assert!(stdout.contains("medians: push "), "{stdout}");
}
