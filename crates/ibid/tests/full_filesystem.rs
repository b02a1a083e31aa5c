//! The filesystem under the pool fills (issue 36, item 1): through the real server on a small
//! tmpfs (the suite runs as root), writes of new data get ENOSPC while the pool stays up for
//! reads, flushes and the API; writes resume when space returns, without a restart; the pool
//! opens on a filesystem filled to the last byte; and a capacity the filesystem cannot hold is
//! refused unless forced.

mod common;

use common::{api_call, require, run, Server};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted for the test, unmounted when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(mib: u64) -> Tmpfs {
        let dir = tempfile::tempdir().expect("tempdir");
        let size = format!("size={mib}m");
        let path = dir.path().to_str().expect("utf-8 path");
        run("mount", &["-t", "tmpfs", "-o", &size, "tmpfs", path]);
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Fills the filesystem holding `dir` to the last byte with a file `name`; returns its path.
fn fill(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let out = Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "status=none"])
        .arg(format!("of={}", path.display()))
        .output()
        .expect("run dd");
    // dd stops at ENOSPC: that is the point.
    assert!(
        !out.status.success(),
        "dd filled nothing: the filesystem is larger than expected"
    );
    path
}

/// Runs a Python script in nbdsh against `url`; returns its stdout.
fn nbdsh(url: &str, script: &str) -> String {
    run("nbdsh", &["-u", url, "-c", script])
}

/// Writes 1 MiB blocks of a seeded pattern from block `first` until one fails or `max`
/// are written; prints the count and the failing errno (0 if none failed).
const WRITE_UNTIL_FULL: &str = r#"
import errno, random
def block(i):
    return random.Random(i).randbytes(1 << 20)
n = 0
err = 0
while n < MAX:
    try:
        h.pwrite(block(FIRST + n), (FIRST + n) << 20)
        n += 1
    except nbd.Error as e:
        # libnbd gives the errno's name (e.g. "ENOSPC") or its number.
        err = e.errno if isinstance(e.errno, int) else getattr(errno, str(e.errno), -1)
        break
h.flush()
print(n, err)
"#;

/// Checks blocks `[0, n)` hold the pattern; prints "ok" or the first bad block.
const CHECK: &str = r#"
import random
bad = None
for i in range(COUNT):
    if h.pread(1 << 20, i << 20) != random.Random(i).randbytes(1 << 20):
        bad = i
        break
print("ok" if bad is None else "bad %d" % bad)
"#;

fn write_until_full(url: &str, first: u64, max: u64) -> (u64, i64) {
    let script = WRITE_UNTIL_FULL
        .replace("FIRST", &first.to_string())
        .replace("MAX", &max.to_string());
    let out = nbdsh(url, &script);
    let mut it = out.split_whitespace();
    let n = it.next().and_then(|s| s.parse().ok());
    let err = it.next().and_then(|s| s.parse().ok());
    n.zip(err)
        .unwrap_or_else(|| panic!("nbdsh printed {out:?}"))
}

fn check(url: &str, n: u64) {
    let out = nbdsh(url, &CHECK.replace("COUNT", &n.to_string()));
    assert_eq!(
        out.trim(),
        "ok",
        "data written before the filesystem filled"
    );
}

const ENOSPC: i64 = 28;

#[test]
fn a_full_filesystem_gives_enospc_keeps_the_pool_up_and_writes_resume_when_space_returns() {
    require("nbdsh");
    let fs = Tmpfs::mount(448);
    // Space another program holds, given back later.
    let spare = fs.path().join("spare");
    run(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={}", spare.display()),
            "bs=1M",
            "count=96",
            "status=none",
        ],
    );
    let dir = tempfile::tempdir_in(fs.path()).expect("tempdir on the tmpfs");
    // A capacity the filesystem cannot hold is refused unless forced.
    let refused = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args(["serve", "--data"])
        .arg(dir.path().join("pool"))
        .args([
            "--capacity",
            "4G",
            "--nbd",
            "127.0.0.1:0",
            "--iscsi",
            "off",
            "--http",
            "off",
        ])
        .output()
        .expect("run ibid serve");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("more than the filesystem") && stderr.contains("available"),
        "{stderr}"
    );
    let srv = Server::start_in(
        dir,
        &[
            "--capacity",
            "4G",
            "--capacity-force",
            "--volume",
            "v=2G",
            "--no-default-volume",
        ],
    );
    let url = srv.url("v");

    // 1. Writes of new data fill the filesystem: ENOSPC, not EIO, and the pool stays up.
    let (n, err) = write_until_full(&url, 0, 2048);
    assert_eq!(err, ENOSPC, "after {n} MiB");
    assert!((64..448).contains(&n), "{n} MiB written before ENOSPC");
    check(&url, n);
    let (status, pool) = api_call(&srv, "GET", "/api/v1/pool", None);
    assert_eq!(status, 200);
    let free = pool["filesystem_free_bytes"]
        .as_u64()
        .expect("filesystem_free_bytes");
    let reserve = pool["filesystem_reserve_bytes"].as_u64().expect("reserve");
    assert!(free < 2 * reserve, "{pool}");
    assert_eq!(pool["soft_threshold_exceeded"], true, "{pool}");
    // Zeroing and metadata operations still work on the full filesystem.
    nbdsh(&url, "h.zero(1 << 20, 0); h.flush()");
    let (status, _) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes/v/snapshots",
        Some(r#"{"name":"s"}"#),
    );
    assert_eq!(status, 201);
    // So do creating and deleting volumes.
    let (status, body) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"w","size":"1G"}"#),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = api_call(&srv, "DELETE", "/api/v1/volumes/w", None);
    assert!(status == 200 || status == 204, "{status} {body}");
    let (status, body) = api_call(&srv, "GET", "/api/v1/volumes/w", None);
    assert_eq!(status, 404, "{body}");
    let metrics = run(
        "curl",
        &[
            "-s",
            &format!("http://{}/metrics", srv.http.as_deref().unwrap()),
        ],
    );
    assert!(
        metrics.contains("ibid_pool_filesystem_free_bytes"),
        "metrics"
    );

    // 2. The other program gives its space back: writes resume without a restart.
    std::fs::remove_file(&spare).expect("remove spare");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (m, err) = write_until_full(&url, n, 16);
    assert_eq!((m, err), (16, 0), "writes after space returned");

    // 3. Flushed writes not yet committed, the server killed, the filesystem filled to the
    // last byte by someone else, the server restarted: the pool opens (its reserve file makes
    // room for the journal's replay), every flushed write is there, new data gets ENOSPC.
    let (m, err) = write_until_full(&url, n + 16, 4);
    assert_eq!((m, err), (4, 0));
    let dir = srv.kill();
    let filler = fill(fs.path(), "filler");
    let srv = Server::start_in(dir, &["--volume", "v=2G", "--no-default-volume"]);
    let url = srv.url("v");
    nbdsh(&url, "assert h.pread(1 << 20, 0) == bytes(1 << 20)");
    let (status, _) = api_call(&srv, "GET", "/api/v1/volumes", None);
    assert_eq!(status, 200);
    let (m, err) = write_until_full(&url, n + 20, 64);
    assert_eq!(
        err, ENOSPC,
        "after {m} MiB on a filesystem filled to the last byte"
    );
    std::fs::remove_file(&filler).expect("remove filler");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (m, err) = write_until_full(&url, n + 20, 8);
    assert_eq!((m, err), (8, 0), "writes after the filler went");
    // Everything written before and after is there.
    let script = format!(
        "import random\nfor i in [2, 5, {}, {}, {}]:\n    assert h.pread(1 << 20, i << 20) == random.Random(i).randbytes(1 << 20), i",
        n - 1,
        n + 17,
        n + 27
    );
    nbdsh(&url, &script);

    // 4. The capacity check at run time: refused, then forced.
    let (status, body) = api_call(&srv, "PATCH", "/api/v1/pool", Some(r#"{"capacity":"1P"}"#));
    assert_eq!(status, 400, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("filesystem"),
        "{body}"
    );
    let (status, body) = api_call(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"capacity":"1P","force":true}"#),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["capacity_bytes"].as_u64(), Some(1 << 50));
    drop(srv);
    drop(fs);
}
