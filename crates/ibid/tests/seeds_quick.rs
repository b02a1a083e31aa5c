//! The seed benchmark suite (`bench/seeds/seeds.py`, issue 7) in its quick mode, against this
//! build of ibid, so that it cannot rot: every experiment must run on every system, the report
//! and plots must be written, and the script's own checks must pass (the VM image and its
//! clones read back equal through NBD on every system, ibid's clones and range copies add no
//! data, copies compare equal).

use std::path::Path;
use std::process::Command;

#[test]
fn seeds_quick_mode_runs_and_reports() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = tempfile::tempdir().expect("tempdir");
    let status = Command::new("/usr/bin/python3")
        .arg(repo.join("bench/seeds/seeds.py"))
        .args(["--quick", "--ibid", env!("CARGO_BIN_EXE_ibid"), "--out"])
        .arg(out.path())
        .status()
        .expect("run bench/seeds/seeds.py");
    assert!(status.success(), "bench/seeds/seeds.py --quick failed");
    let report = std::fs::read_to_string(out.path().join("report.md")).expect("report.md");
    for heading in [
        "## Headline",
        "## Machine and versions",
        "## 1. Provisioning time",
        "## 2. First write vs later writes",
        "## 3. Mixed database workload",
        "## 4. Space for a VM image, and 5. its clones",
        "## 6. Copy offload",
        "## 7. WRITE SAME / zeroing",
        "## Checks",
    ] {
        assert!(report.contains(heading), "report.md lacks {heading:?}");
    }
    assert!(!report.contains("**FAILED**"), "a check failed:\n{report}");
    assert!(
        !report.contains("## Errors"),
        "an experiment failed:\n{report}"
    );
    for png in [
        "provision.png",
        "format.png",
        "jetstress.png",
        "clones.png",
        "copy.png",
        "zero.png",
    ] {
        let meta = std::fs::metadata(out.path().join(png)).expect(png);
        assert!(meta.len() > 1000, "{png} is empty");
    }
    let results = std::fs::read_to_string(out.path().join("results.json")).expect("results.json");
    assert!(results.contains("\"checks\""));
}
