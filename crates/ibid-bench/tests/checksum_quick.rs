//! `ibid-bench checksum` runs on a small buffer: it checks that the engine's CRC-32C and the
//! `crc32c` crate's agree before it measures (a disagreement fails the command), then prints a
//! positive figure for both implementations.

use std::process::Command;

#[test]
fn checksum_agrees_and_prints_both_implementations() {
    let out = Command::new(env!("CARGO_BIN_EXE_ibid-bench"))
        .args(["checksum", "--rounds", "1", "--memory-mib", "4"])
        .output()
        .expect("run ibid-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ibid-bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in ["crc-fast (engine)", "crc32c crate"] {
        let line = stdout
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("missing {name:?} in:\n{stdout}"));
        let figures: Vec<f64> = line
            .split('\t')
            .skip(2)
            .map(|f| f.parse().expect("a number"))
            .collect();
        assert_eq!(figures.len(), 2, "{line}");
        assert!(figures.iter().all(|&f| f > 0.0), "{line}");
    }
}
