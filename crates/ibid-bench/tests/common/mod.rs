//! What the `--quick` tests of `ibid-bench` share.

use std::process::Command;

/// Runs `ibid-bench ARGS --dir DIR` with a fresh temporary `DIR`, checks that it succeeded,
/// and returns what it printed on standard output.
pub fn run_bench(args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(env!("CARGO_BIN_EXE_ibid-bench"))
        .args(args)
        .arg("--dir")
        .arg(dir.path())
        .output()
        .expect("run ibid-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ibid-bench failed:\n{stdout}\n{stderr}"
    );
    stdout
}
