//! A captive `ibid serve` for tests: started on a private pool and ephemeral ports, stopped
//! (SIGTERM, clean close) when dropped. Real clients are run against it as subprocesses.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// The target name `ibid serve` uses by default.
pub const IQN: &str = "iqn.2026-11.org.ibid:pool";

/// A running server.
pub struct Server {
    child: Option<Child>,
    /// Directory holding the pool.
    pub dir: tempfile::TempDir,
    /// NBD address, host:port.
    pub nbd: String,
    /// iSCSI portal, host:port, if the target runs.
    pub iscsi: Option<String>,
    /// HTTP API address, host:port.
    pub http: Option<String>,
}

impl Server {
    /// Starts `ibid serve` with `args` added; waits until it prints its NBD address.
    pub fn start(args: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, args)
    }

    /// Starts on an existing directory (to restart a server on the same pool).
    pub fn start_in(dir: tempfile::TempDir, args: &[&str]) -> Server {
        Self::start_command(Command::new(env!("CARGO_BIN_EXE_ibid")), dir, args)
    }

    /// Starts with a soft and hard limit of `limit` open files (as `ulimit -n` sets both).
    pub fn start_with_open_files_limit(limit: u64, args: &[&str]) -> Server {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(env!("CARGO_BIN_EXE_ibid"));
        // SAFETY: the closure only makes one async-signal-safe system call in the child.
        unsafe {
            command.pre_exec(move || {
                let l = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: limit,
                };
                match libc::setrlimit(libc::RLIMIT_NOFILE, &l) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
        Self::start_command(command, tempfile::tempdir().expect("tempdir"), args)
    }

    fn start_command(mut command: Command, dir: tempfile::TempDir, args: &[&str]) -> Server {
        let mut child = command
            .arg("serve")
            .arg("--data")
            .arg(dir.path().join("pool"))
            .args([
                "--nbd",
                "127.0.0.1:0",
                "--iscsi",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
            ])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start ibid serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut nbd = None;
        let mut iscsi = None;
        let mut http = None;
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("read banner");
            if let Some(rest) = line.trim().strip_prefix("NBD   nbd://") {
                nbd = Some(rest.trim_end_matches("/VOLUME").to_string());
            }
            if let Some(rest) = line.trim().strip_prefix("iSCSI iscsi://") {
                iscsi = rest.split('/').next().map(str::to_string);
            }
            if let Some(rest) = line.trim().strip_prefix("API   http://") {
                http = rest.split('/').next().map(str::to_string);
            }
            if line.starts_with("Ctrl-C") {
                break;
            }
        }
        let nbd = nbd.expect("ibid serve printed no NBD address");
        Server {
            child: Some(child),
            dir,
            nbd,
            iscsi,
            http,
        }
    }

    /// `nbd://127.0.0.1:PORT/VOLUME`.
    pub fn url(&self, volume: &str) -> String {
        format!("nbd://{}/{}", self.nbd, volume)
    }

    /// `iscsi://127.0.0.1:PORT/IQN/LUN`.
    pub fn iscsi_url(&self, lun: u64) -> String {
        format!(
            "iscsi://{}/{IQN}/{lun}",
            self.iscsi.as_deref().expect("iSCSI target running")
        )
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The pool directory.
    pub fn pool_dir(&self) -> PathBuf {
        self.dir.path().join("pool")
    }

    /// Stops the server (SIGTERM) and waits for a clean exit; returns the directory.
    pub fn stop(mut self) -> tempfile::TempDir {
        self.terminate();
        let dir = tempfile::tempdir().expect("tempdir");
        std::mem::replace(&mut self.dir, dir)
    }

    /// Kills the server (SIGKILL: no clean close) and returns the directory.
    pub fn kill(mut self) -> tempfile::TempDir {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let dir = tempfile::tempdir().expect("tempdir");
        std::mem::replace(&mut self.dir, dir)
    }

    fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: sending a signal to our own child process.
            unsafe { libc_kill(child.id() as i32, 15) };
            for _ in 0..100 {
                if let Ok(Some(status)) = child.try_wait() {
                    assert!(status.success(), "ibid serve exited with {status}");
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            panic!("ibid serve did not stop within 5 s of SIGTERM");
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// Sends an API request with curl (and a bearer token, if given); returns (HTTP status, parsed
/// JSON body or Null).
pub fn api_call_as(
    srv: &Server,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let url = format!("http://{}{path}", srv.http.as_deref().expect("API running"));
    let auth = token.map(|t| format!("authorization: Bearer {t}"));
    let mut args = vec![
        "-s",
        "-S",
        "-X",
        method,
        "-w",
        "\n%{http_code}",
        "-H",
        "content-type: application/json",
        "-H",
        "x-ibid-request: 1",
    ];
    if let Some(a) = &auth {
        args.extend(["-H", a]);
    }
    if let Some(b) = body {
        args.extend(["-d", b]);
    }
    args.push(&url);
    let out = run("curl", &args);
    let (json, status) = out.rsplit_once('\n').expect("status line");
    let value = if json.trim().is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(json).unwrap_or_else(|e| panic!("JSON body ({e}): {json}"))
    };
    (status.trim().parse().expect("status"), value)
}

/// [`api_call_as`] without a token.
pub fn api_call(
    srv: &Server,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    api_call_as(srv, None, method, path, body)
}

/// Fails the test with a clear message if a required client is missing (the test script
/// installs them; a missing one is a broken machine, not a reason to skip).
pub fn require(tool: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success());
    assert!(
        found.unwrap_or(false),
        "required tool {tool:?} is missing: run scripts/install-test-tools.sh"
    );
}

/// Runs a command, fails the test with its output if it fails, returns its stdout.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = output(cmd, args);
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command and returns its output whatever its status.
pub fn output(cmd: &str, args: &[&str]) -> Output {
    require(cmd);
    let t = std::time::Instant::now();
    let _log = Defer(move || {
        eprintln!(
            "[{:>6.2}s] {cmd} {}",
            t.elapsed().as_secs_f64(),
            args.join(" ")
        )
    });
    Command::new(cmd)
        .args(args)
        .env(
            "PATH",
            format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default()),
        )
        .output()
        .unwrap_or_else(|e| panic!("run {cmd}: {e}"))
}

/// Writes a file of `len` bytes mixing random, zero, duplicate and compressible regions.
pub fn make_image(path: &Path, len: usize) {
    let mut data = vec![0u8; len];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for (i, chunk) in data.chunks_mut(4096).enumerate() {
        match i % 8 {
            0..=2 => chunk.iter_mut().for_each(|b| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }),
            3 => chunk.fill(0),
            4 => chunk.copy_from_slice(&[0x5a; 4096][..chunk.len()]),
            5 => chunk
                .iter_mut()
                .enumerate()
                .for_each(|(j, b)| *b = (j / 64) as u8),
            _ => {}
        }
    }
    std::fs::write(path, data).expect("write image");
}

/// Runs a closure when dropped.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// `scripts/faultfs.py` mounted for a test (a FUSE filesystem that fails chosen operations
/// with EIO): unmounted and stopped when dropped.
pub struct FaultFs {
    child: Child,
    /// Where it is mounted: put the pool under it.
    pub mount: PathBuf,
    control: PathBuf,
    _dirs: tempfile::TempDir,
}

impl FaultFs {
    /// Mounts it on a new temporary directory.
    pub fn mount() -> FaultFs {
        let dirs = tempfile::tempdir().expect("tempdir");
        let (backing, mount) = (dirs.path().join("backing"), dirs.path().join("mnt"));
        std::fs::create_dir(&backing).expect("backing dir");
        std::fs::create_dir(&mount).expect("mount point");
        let control = dirs.path().join("control");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/faultfs.py");
        let child = Command::new("/usr/bin/python3")
            .arg(script)
            .args([&backing, &mount, &control])
            .spawn()
            .expect("start faultfs.py");
        let fs = FaultFs {
            child,
            mount,
            control,
            _dirs: dirs,
        };
        for _ in 0..100 {
            let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
            if mounts.contains(fs.mount.to_str().expect("utf-8")) {
                return fs;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("faultfs did not mount within 10 s");
    }

    /// Makes every `op` (read, write, fsync) on a path containing `what` fail with EIO.
    pub fn fail(&self, op: &str, what: &str) {
        std::fs::write(&self.control, format!("{op} {what} 5\n")).expect("control");
    }

    /// Ends the failures.
    pub fn heal(&self) {
        std::fs::write(&self.control, "").expect("control");
    }

    /// The backing directory of `path` on the mount (to change files behind the server).
    pub fn backing(&self, path: &Path) -> PathBuf {
        let rel = path.strip_prefix(&self.mount).expect("a path on the mount");
        self.mount.with_file_name("backing").join(rel)
    }
}

impl Drop for FaultFs {
    fn drop(&mut self) {
        let _ = Command::new("fusermount")
            .arg("-u")
            .arg(&self.mount)
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Opens the pool at `path` that a stopped server left, without the background thread, so a
/// test sees it as the server left it.
pub fn open_quiet(path: &Path) -> ibid_engine::Pool {
    ibid_engine::Pool::open(
        path,
        ibid_engine::PoolConfig {
            background: false,
            ..ibid_engine::PoolConfig::default()
        },
    )
    .expect("open the pool")
}
