//! `ibid-bench formats --quick` runs and prints a number for every row.

use std::process::Command;

#[test]
fn formats_quick_prints_the_table() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(env!("CARGO_BIN_EXE_ibid-bench"))
        .args(["formats", "--quick", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run ibid-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ibid-bench failed:\n{stdout}\n{stderr}"
    );
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
