//! `ibid-bench store-shapes` runs on a small count and prints a number for every shape (10
//! transactions: `flat-runs16` merges its runs once and keeps two, and every shape's lookups
//! must find every stored fingerprint, through the runs and the B-tree).

use std::process::Command;

#[test]
fn store_shapes_prints_every_shape() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(env!("CARGO_BIN_EXE_ibid-bench"))
        .args([
            "store-shapes",
            "--blocks",
            "10000",
            "--batch",
            "1000",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .expect("run ibid-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ibid-bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for shape in [
        "flat",
        "flat-fps16",
        "grouped",
        "grouped-fps16",
        "grouped-nofps",
        "flat-runs16",
    ] {
        let prefix = format!("| {shape} | ");
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("missing {prefix:?} in:\n{stdout}"));
        let value = line[prefix.len()..].split(' ').next().unwrap_or("");
        let us: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("not a number: {line}"));
        assert!(us > 0.0, "{line}");
    }
    assert!(stdout.contains("# done"), "{stdout}");
}

/// `ibid-bench map-overwrites` runs on a small map and prints a time and a byte count for
/// both modes.
#[test]
fn map_overwrites_prints_both_modes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(env!("CARGO_BIN_EXE_ibid-bench"))
        .args(["map-overwrites", "--blocks", "20000", "--batch", "500"])
        .args(["--txns", "20", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run ibid-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ibid-bench failed:\n{stdout}");
    for mode in ["straight into the B-tree", "deferred (log)"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {mode} | ")))
            .unwrap_or_else(|| panic!("missing {mode:?} in:\n{stdout}"));
        let cells: Vec<f64> = line
            .split('|')
            .filter_map(|c| c.trim().parse().ok())
            .collect();
        assert!(cells.len() == 2 && cells.iter().all(|&v| v > 0.0), "{line}");
    }
}
