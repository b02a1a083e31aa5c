//! Shared test support: an in-process target on a random loopback port.
#![allow(dead_code)]

use ibid_iscsi::memory::{MemLun, MemLuns, MemPool};
use ibid_iscsi::{serve, ChapConfig, TargetConfig};
use std::process::Command;
use std::sync::Arc;

/// Target IQN used by the tests.
pub const IQN: &str = "iqn.2026-11.org.ibid:test";
/// Size of each test LUN.
pub const LUN_SIZE: u64 = 64 << 20;

/// A running in-process target.
pub struct TestTarget {
    /// TCP port on 127.0.0.1.
    pub port: u16,
    /// The pool behind the LUNs.
    pub pool: Arc<MemPool>,
    /// Direct handles on LUN 0, 1, 2 for checking what initiators did.
    pub luns: Vec<Arc<MemLun>>,
}

impl TestTarget {
    /// `iscsi://` URL of `lun`.
    pub fn url(&self, lun: u64) -> String {
        format!("iscsi://127.0.0.1:{}/{IQN}/{lun}", self.port)
    }
}

/// Start a target with LUN 0 and 1 (read-write) and LUN 2 (read-only),
/// `capacity` bytes of pool, optional CHAP.
pub fn start_with(capacity: u64, chap: Option<ChapConfig>) -> TestTarget {
    start_cfg(capacity, |c| c.chap = chap)
}

/// Like [`start_with`], with any configuration change.
pub fn start_cfg(capacity: u64, tweak: impl FnOnce(&mut TargetConfig)) -> TestTarget {
    let mut luns = MemLuns::new(capacity, 80);
    let handles = vec![
        luns.add(0, LUN_SIZE, false),
        luns.add(1, LUN_SIZE, false),
        luns.add(2, LUN_SIZE, true),
    ];
    let pool = luns.pool();
    let mut cfg = TargetConfig::new(IQN);
    tweak(&mut cfg);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).expect("listener");
            let _ = serve(l, Arc::new(luns), cfg).await;
        });
    });
    TestTarget {
        port,
        pool,
        luns: handles,
    }
}

/// Start a target with a 4 GiB pool and no CHAP.
pub fn start() -> TestTarget {
    start_with(4 << 30, None)
}

/// Panic with a clear message unless `tool` is on PATH.
pub fn require(tool: &str, package: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "required tool `{tool}` is missing: install the Debian package `{package}`"
    );
}

/// Build tests/c/ibid_initiator.c against libiscsi once per test binary;
/// returns the binary path.
pub fn build_initiator() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_initiator_now).clone()
}

fn build_initiator_now() -> std::path::PathBuf {
    require("cc", "gcc");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/ibid_initiator.c");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("ibid_initiator");
    let st = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-liscsi")
        .status()
        .expect("run cc");
    assert!(
        st.success(),
        "building {src:?} failed: is `libiscsi-dev` installed?"
    );
    out
}
