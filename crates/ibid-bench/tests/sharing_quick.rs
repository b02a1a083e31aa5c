//! `ibid-bench sharing --quick` runs and prints every row of its tables.

mod common;

use common::run_bench;

#[test]
fn sharing_quick_prints_the_table() {
    let stdout = run_bench(&["sharing", "--quick"]);
    for row in [
        "| measurement | unit | median (min–max) | goal |",
        "| fill: 64 MiB unique incompressible",
        "| snapshot of 64 MiB written: time | ms |",
        "| snapshot of 64 MiB written: physical bytes added | B | 0 |",
        "| snapshot of 64 MiB written: segment-file bytes added | B | 0 |",
        "| clone of that snapshot (64 MiB written): time |",
        "| fast clone of live volume (64 MiB written): time |",
        "| snapshot of 1 TiB thin, 16 MiB written: time |",
        "| clone of that snapshot (1 TiB thin, 16 MiB written): time |",
        "| fast clone of live volume (1 TiB thin, 16 MiB written): time |",
        "| copy_from 64 MiB written: time |",
        "| copy_from 64 MiB written: then Pool::sync | ms |",
        "| copy_from 64 MiB written: CopyReport.shared_bytes | MiB | 64.0 |",
        "| copy_from 64 MiB written: CopyReport.data_bytes | B | 0 |",
        "| copy_from 64 MiB written: physical bytes added | B | 0 |",
        "| copy_from 370 GiB, first 64 MiB written: time |",
        "| 4 KiB random read: gen 20 / original (intermediates exist) | ratio |",
        "| 1 MiB seq read: gen 20 / original (intermediates exist) | ratio |",
        "| 4 KiB random read: gen 20 / original (after delete + gc_now) | ratio |",
        "| 1 MiB seq read: gen 20 / original (after delete + gc_now) | ratio |",
        "| 4 KiB write QD1 p50: after snapshot / normal | ratio |",
        "| 4 KiB write QD1 p99: after snapshot / normal | ratio |",
        "| clone | time ms | physical after (MiB) | physical added (B) | goal < 10 ms, 0 B |",
        "| 7 |",
        "# done",
    ] {
        assert!(stdout.contains(row), "missing {row:?} in:\n{stdout}");
    }
    // Every row of the main table has a number in its value column.
    for line in stdout.lines().filter(|l| {
        l.starts_with("| ") && !l.starts_with("| measurement") && !l.starts_with("| clone")
    }) {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        let value = if cols[1].parse::<u32>().is_ok() {
            cols[2] // seven-clones table: time column
        } else {
            cols[3]
        };
        assert!(
            value.split(' ').next().unwrap_or("").parse::<f64>().is_ok(),
            "value not a number: {line}"
        );
    }
}
