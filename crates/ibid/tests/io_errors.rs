//! I/O errors under the real server (issue 32, item 4): the pool lives on a FUSE filesystem
//! (`scripts/faultfs.py`) that fails chosen reads, writes and syncs with EIO, and a segment
//! file is damaged behind the server's back. A read that meets EIO or a checksum mismatch
//! gives the NBD client an error, never wrong data; a write or flush that meets one fails the
//! request, and the pool reopens consistent with every block flushed before intact.

mod common;

use common::{api_call, output, require, FaultFs, Server};
use std::path::{Path, PathBuf};

/// MiB of the pattern written and checked.
const MIB: u64 = 12;

/// Runs a Python script in nbdsh against `url`; its stdout, or its stderr as the error.
fn nbdsh(url: &str, script: &str) -> Result<String, String> {
    let out = output("nbdsh", &["-u", url, "-c", script]);
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

const WRITE: &str = r#"
import random
for i in range(COUNT):
    h.pwrite(random.Random(SEED * 1000 + i).randbytes(1 << 20), i << 20)
h.flush()
"#;

/// Reads each MiB; prints per MiB "ok", "bad" (other bytes than written) or "error ERRNO".
const CHECK: &str = r#"
import random
out = []
for i in range(COUNT):
    try:
        got = h.pread(1 << 20, i << 20)
        out.append("ok" if got == random.Random(SEED * 1000 + i).randbytes(1 << 20) else "bad")
    except nbd.Error as e:
        out.append("error")
print(" ".join(out))
"#;

fn write(url: &str, seed: u64) -> Result<String, String> {
    let script = WRITE
        .replace("COUNT", &MIB.to_string())
        .replace("SEED", &seed.to_string());
    nbdsh(url, &script)
}

/// Per MiB: "ok", "bad" or "error".
fn check(url: &str, seed: u64) -> Vec<String> {
    let script = CHECK
        .replace("COUNT", &MIB.to_string())
        .replace("SEED", &seed.to_string());
    let out = nbdsh(url, &script).expect("nbdsh runs");
    out.split_whitespace().map(str::to_string).collect()
}

/// Reads each MiB; per MiB "ok" if each 4 KiB block holds what seed A or seed B wrote there.
const CHECK_EITHER: &str = r#"
import random
out = []
for i in range(COUNT):
    a = random.Random(SEED_A * 1000 + i).randbytes(1 << 20)
    b = random.Random(SEED_B * 1000 + i).randbytes(1 << 20)
    try:
        got = h.pread(1 << 20, i << 20)
        ok = all(got[j:j + 4096] in (a[j:j + 4096], b[j:j + 4096]) for j in range(0, 1 << 20, 4096))
        out.append("ok" if ok else "bad")
    except nbd.Error as e:
        out.append("error")
print(" ".join(out))
"#;

fn check_either(url: &str, a: u64, b: u64) -> Vec<String> {
    let script = CHECK_EITHER
        .replace("COUNT", &MIB.to_string())
        .replace("SEED_A", &a.to_string())
        .replace("SEED_B", &b.to_string());
    let out = nbdsh(url, &script).expect("nbdsh runs");
    out.split_whitespace().map(str::to_string).collect()
}

fn largest_segment(pool: &Path) -> PathBuf {
    let mut segs: Vec<(u64, PathBuf)> = std::fs::read_dir(pool.join("segments"))
        .expect("segments")
        .map(|e| e.expect("entry").path())
        .map(|p| (std::fs::metadata(&p).expect("stat").len(), p))
        .collect();
    segs.sort();
    segs.pop().expect("a segment file").1
}

#[test]
fn io_errors_and_damage_give_errors_never_wrong_data_and_the_pool_reopens_consistent() {
    require("nbdsh");
    require("fusermount");
    let fs = FaultFs::mount();
    let dir = tempfile::tempdir_in(&fs.mount).expect("tempdir on faultfs");
    // No read cache: every read must reach the faulty files (blocks read twice would be
    // served, checked, from memory).
    let args = [
        "--volume",
        "v=64M",
        "--no-default-volume",
        "--read-cache",
        "0",
    ];
    let srv = Server::start_in(dir, &args);
    let url = srv.url("v");
    write(&url, 1).expect("write the pattern");
    // Restarted, the server reads everything from the segment files (nothing from memory).
    let srv = Server::start_in(srv.stop(), &args);
    assert!(check(&url_of(&srv), 1).iter().all(|w| w == "ok"));

    // 1. Reads that meet EIO fail; none returns other bytes.
    fs.fail("read", ".seg");
    let got = check(&url_of(&srv), 1);
    assert!(got.iter().all(|w| w == "error"), "reads under EIO: {got:?}");
    fs.heal();
    let got = check(&url_of(&srv), 1);
    assert!(got.iter().all(|w| w == "ok"), "reads once healed: {got:?}");

    // 2. A damaged record (checksum mismatch) fails its read; the others read as written.
    let seg = largest_segment(&srv.pool_dir());
    let backing = fs.backing(&seg);
    let mut bytes = std::fs::read(&backing).expect("read segment");
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&backing, &bytes).expect("damage the segment");
    let got = check(&url_of(&srv), 1);
    assert!(
        !got.iter().any(|w| w == "bad"),
        "wrong data returned: {got:?}"
    );
    assert!(
        got.iter().any(|w| w == "error"),
        "the damage went unseen: {got:?}"
    );
    bytes[at] ^= 0xff;
    std::fs::write(&backing, &bytes).expect("repair the segment");
    assert!(check(&url_of(&srv), 1).iter().all(|w| w == "ok"));

    // 3. Writes whose data writes, journal writes or syncs fail: the request fails. The pool
    // stops writing after a failed write or sync (a failed fsync is never retried), so it is
    // restarted: it reopens consistent, every block flushed before the failure holds that or
    // what the failed request wrote, and `verify` is clean.
    let mut srv = srv;
    for (op, what) in [("write", ".seg"), ("write", "journal"), ("fsync", "pool")] {
        fs.fail(op, what);
        let err = write(&url_of(&srv), 2).expect_err("a write under EIO succeeded");
        assert!(
            err.contains("EIO") || err.contains("Input/output"),
            "{op} {what}: {err}"
        );
        fs.heal();
        srv = Server::start_in(srv.kill(), &args);
        let got = check_either(&url_of(&srv), 1, 2);
        assert!(
            got.iter().all(|w| w == "ok"),
            "{op} {what}: after restart: {got:?}"
        );
        let (status, body) = api_call(&srv, "POST", "/api/v1/pool/verify", Some("{}"));
        assert_eq!(status, 200, "{op} {what}: verify after the failure: {body}");
        // The next round starts from the first pattern again.
        write(&url_of(&srv), 1).expect("write the pattern again");
    }
}

fn url_of(srv: &Server) -> String {
    srv.url("v")
}
