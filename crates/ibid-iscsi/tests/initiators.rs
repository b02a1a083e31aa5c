//! Real-initiator tests through libiscsi (a small C program built here):
//! EXTENDED COPY between and within LUNs, concurrent COMPARE AND WRITE from
//! many sessions, header digests, and CHAP (one-way, mutual, wrong secret).

mod common;

use ibid_iscsi::{ChapConfig, Lun};
use std::process::Command;

/// Sessions hammering one block with COMPARE AND WRITE.
const CAW_SESSIONS: usize = 8;
/// Successful increments per session.
const CAW_ITERATIONS: usize = 100;

fn portal(t: &common::TestTarget) -> String {
    format!("127.0.0.1:{}", t.port)
}

/// XCOPY LUN0→LUN1 and LUN0→LUN0 via EXTENDED COPY; the C program reads back
/// and compares; we also compare on the backend.
#[test]
fn xcopy_between_and_within_luns() {
    let bin = common::build_initiator();
    let t = common::start();
    let out = Command::new(&bin)
        .args(["xcopy", &portal(&t), common::IQN])
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "xcopy failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (mut a, mut b, mut c) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    t.luns[0].read(0, &mut a).unwrap();
    t.luns[1].read(4096 * 512, &mut b).unwrap();
    t.luns[0].read(8192 * 512, &mut c).unwrap();
    assert!(a.iter().any(|&x| x != 0));
    assert_eq!(a, b);
    assert_eq!(a, c);
}

/// The VMFS heartbeat pattern: many sessions increment one counter with
/// COMPARE AND WRITE; no update may be lost. Prints p50/p99 latency.
#[test]
fn concurrent_compare_and_write_loses_no_update() {
    let bin = common::build_initiator();
    let t = common::start();
    let children: Vec<_> = (0..CAW_SESSIONS)
        .map(|i| {
            Command::new(&bin)
                .args(["caw", &portal(&t), common::IQN, &CAW_ITERATIONS.to_string()])
                .arg(format!("iqn.2026-11.org.ibid:caw{i}"))
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let mut lat = Vec::new();
    let mut miscompares = 0;
    for c in children {
        let out = c.wait_with_output().expect("wait");
        assert!(out.status.success(), "caw session failed");
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            match l.split_once(' ') {
                Some(("latency", v)) => lat.push(v.parse::<u64>().unwrap()),
                Some(("miscompare", _)) => miscompares += 1,
                _ => {}
            }
        }
    }
    let mut block = [0u8; 512];
    t.luns[0].read(0, &mut block).unwrap();
    let counter = u64::from_le_bytes(block[..8].try_into().unwrap());
    assert_eq!(
        counter as usize,
        CAW_SESSIONS * CAW_ITERATIONS,
        "lost updates"
    );
    lat.sort_unstable();
    let p = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize];
    println!(
        "COMPARE AND WRITE: {} sessions, {} ok, {} miscompares, p50 {} us, p99 {} us",
        CAW_SESSIONS,
        lat.len(),
        miscompares,
        p(0.5),
        p(0.99)
    );
}

/// Login with CRC32C header digests, then a write and read-back.
#[test]
fn header_digest_io() {
    let bin = common::build_initiator();
    let t = common::start();
    let out = Command::new(&bin)
        .args(["digest", &portal(&t), common::IQN])
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "digest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn chap_login(bin: &std::path::Path, t: &common::TestTarget, args: &[&str]) -> bool {
    let out = Command::new(bin)
        .args(["chap", &portal(t), common::IQN])
        .args(args)
        .output()
        .expect("run");
    out.status.success()
}

/// One-way CHAP: the right secret logs in, a wrong one does not.
#[test]
fn chap_one_way() {
    let bin = common::build_initiator();
    let chap = ChapConfig {
        user: "alice".into(),
        secret: "secret-one-way".into(),
        mutual: None,
    };
    let t = common::start_with(1 << 30, Some(chap));
    assert!(chap_login(&bin, &t, &["alice", "secret-one-way"]));
    assert!(!chap_login(&bin, &t, &["alice", "wrong-secret-xx"]));
    assert!(!chap_login(&bin, &t, &["mallory", "secret-one-way"]));
}

/// Mutual CHAP: the target proves its own secret to the initiator.
#[test]
fn chap_mutual() {
    let bin = common::build_initiator();
    let chap = ChapConfig {
        user: "alice".into(),
        secret: "secret-initiator".into(),
        mutual: Some(("target".into(), "secret-target-xx".into())),
    };
    let t = common::start_with(1 << 30, Some(chap));
    assert!(chap_login(
        &bin,
        &t,
        &["alice", "secret-initiator", "target", "secret-target-xx"]
    ));
    assert!(!chap_login(
        &bin,
        &t,
        &["alice", "secret-initiator", "target", "not-the-secret"]
    ));
}

/// SendTargets discovery through libiscsi's iscsi-ls: the target, its portal
/// and every LUN are listed.
#[test]
fn sendtargets_discovery_lists_target_and_luns() {
    common::require("iscsi-ls", "libiscsi-bin");
    let t = common::start();
    let out = Command::new("timeout")
        .args(["30", "iscsi-ls", "-s"])
        .arg(format!("iscsi://127.0.0.1:{}", t.port))
        .output()
        .expect("run iscsi-ls");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "iscsi-ls failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!(
            "Target:{} Portal:127.0.0.1:{},1",
            common::IQN,
            t.port
        )),
        "{text}"
    );
    for lun in 0..3 {
        assert!(
            text.contains(&format!("Lun:{lun} ")),
            "LUN {lun} missing: {text}"
        );
    }
}
