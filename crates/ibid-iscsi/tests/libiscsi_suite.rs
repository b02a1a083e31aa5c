//! Conformance: libiscsi's iscsi-test-cu, one process per suite under a
//! timeout, against an in-process target with in-memory LUNs. Asserts that no
//! test fails except the documented test defects, and prints pass/skip/fail
//! per suite (CUnit counts skips as passes, so skips are counted from the
//! verbose output). Results are recorded in docs/ISCSI.md.

mod common;

use std::process::Command;

/// Seconds one suite may run.
const SUITE_TIMEOUT_S: u32 = 180;

/// Tests that fail because the test itself is wrong for a 512e LUN; see
/// docs/ISCSI.md ("Known test defects").
const KNOWN_TEST_DEFECTS: &[&str] = &["UnmapSingle"];

/// (suite, LUN): the ReadOnly suite runs against the read-only LUN 2.
fn suites() -> Vec<(String, u64)> {
    let out = Command::new("iscsi-test-cu")
        .arg("-l")
        .output()
        .expect("iscsi-test-cu -l");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    text.lines()
        .map(str::trim)
        .filter(|l| {
            let parts: Vec<&str> = l.split('.').collect();
            parts.len() == 2 && (parts[0] == "SCSI" || parts[0] == "iSCSI")
        })
        .map(|s| (s.to_string(), if s == "SCSI.ReadOnly" { 2 } else { 0 }))
        .collect()
}

#[derive(Debug, Default)]
struct SuiteResult {
    tests: usize,
    failed: Vec<String>,
    /// Tests skipped whole: a `[SKIPPED]` line and no command checked `[OK]`.
    skipped: Vec<String>,
    /// Tests that ran but skipped some assertions (e.g. "LUN too small").
    partial: Vec<String>,
}

/// What one test's lines showed.
#[derive(Default)]
struct Seen {
    skip: bool,
    ok: bool,
}

fn close(name: Option<String>, seen: &Seen, r: &mut SuiteResult) {
    let Some(n) = name else { return };
    r.tests += 1;
    if seen.skip && !seen.ok && !r.failed.contains(&n) {
        r.skipped.push(n);
    } else if seen.skip {
        r.partial.push(n);
    }
}

/// Split verbose output into tests and classify each.
fn parse(output: &str) -> SuiteResult {
    let mut r = SuiteResult::default();
    let mut current: Option<String> = None;
    let mut seen = Seen::default();
    for line in output.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("Test: ") {
            close(current.take(), &seen, &mut r);
            let name = rest.split(" ...").next().unwrap_or(rest).trim().to_string();
            if rest.contains("FAILED") {
                r.failed.push(name.clone());
            }
            current = Some(name);
            seen = Seen {
                skip: rest.contains("[SKIPPED]"),
                ok: false,
            };
        } else if t.contains("[SKIPPED]") {
            seen.skip = true;
        } else if t.starts_with("[OK]") {
            seen.ok = true;
        } else if t.starts_with("FAILED") {
            if let Some(n) = &current {
                if !r.failed.contains(n) {
                    r.failed.push(n.clone());
                }
            }
        }
    }
    close(current, &seen, &mut r);
    r
}

#[test]
fn iscsi_test_cu_all_suites() {
    common::require("iscsi-test-cu", "libiscsi-bin");
    common::require("timeout", "coreutils");
    let t = common::start();
    let mut unexpected = Vec::new();
    let (mut total, mut total_skip, mut total_fail) = (0, 0, 0);
    for (suite, lun) in suites() {
        let out = Command::new("timeout")
            .arg(SUITE_TIMEOUT_S.to_string())
            .args([
                "iscsi-test-cu",
                "-d",
                "-V",
                "-i",
                "iqn.2026-11.org.ibid:init1",
                "-I",
                "iqn.2026-11.org.ibid:init2",
                "-t",
            ])
            .arg(&suite)
            .arg(t.url(lun))
            // Second session to the same LUN for the MultipathIO suite.
            .arg(t.url(lun))
            .output()
            .expect("run iscsi-test-cu");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        let r = parse(&text);
        let code = out.status.code();
        println!(
            "{suite:32} tests {:3} passed {:3} skipped {:3} failed {:3} failed: {:?} skipped: {:?} partly skipped: {:?}",
            r.tests,
            r.tests - r.skipped.len() - r.failed.len(),
            r.skipped.len(),
            r.failed.len(),
            r.failed,
            r.skipped,
            r.partial
        );
        total += r.tests;
        total_skip += r.skipped.len();
        total_fail += r.failed.len();
        if code == Some(124) || r.tests == 0 {
            unexpected.push(format!("{suite}: timed out or ran nothing (exit {code:?})"));
        }
        for f in r
            .failed
            .iter()
            .filter(|f| !KNOWN_TEST_DEFECTS.contains(&f.as_str()))
        {
            unexpected.push(format!("{suite}.{f}"));
        }
    }
    println!(
        "TOTAL tests {total} passed {} skipped {total_skip} failed {total_fail}",
        total - total_skip - total_fail
    );
    assert!(
        unexpected.is_empty(),
        "unexpected failures: {unexpected:#?}"
    );
}
