//! `ibid-bench formats --quick` runs and prints a number for every row.

mod common;

use common::run_bench;

#[test]
fn formats_quick_prints_the_table() {
    let stdout = run_bench(&["formats", "--quick"]);
    let mut rows = 0;
    for f in ["thin", "lazyzeroedthick", "eagerzeroedthick"] {
        for size in ["1 GiB", "1 TiB", "1 PiB"] {
            let prefix = format!("| create {f} {size} | ");
            let line = stdout
                .lines()
                .find(|l| l.starts_with(&prefix))
                .unwrap_or_else(|| panic!("missing {prefix:?} in:\n{stdout}"));
            let value = line[prefix.len()..].split(' ').next().unwrap_or("");
            assert!(value.parse::<f64>().is_ok(), "not a number: {line}");
            rows += 1;
        }
    }
    assert_eq!(rows, 9);
    assert!(stdout.contains("| inflate 1 TiB thin"), "{stdout}");
    assert!(
        stdout.contains("| eagerzero 1 TiB lazyzeroedthick"),
        "{stdout}"
    );
    assert!(stdout.contains("# done"), "{stdout}");
}
