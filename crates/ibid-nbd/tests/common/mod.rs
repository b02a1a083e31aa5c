//! Shared test harness: a captive server on a random loopback port (stopped on drop), the
//! real-client runner that fails loudly when a tool is missing, and captured server logs
//! (echoed to stderr when `IBID_TEST_LOG` is set).
#![allow(dead_code)]

use ibid_nbd::memory::{MemoryExport, MemoryExports};
use ibid_nbd::{Exports, ServerConfig, TlsConfig, TlsCredentials};
use std::io::Write;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, Once};

/// Server log lines, so tests can check what was negotiated.
pub static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;
impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        if std::env::var_os("IBID_TEST_LOG").is_some() {
            std::io::stderr().write_all(buf)?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub fn init_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("ibid_nbd=info"));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .init();
    });
}

pub fn logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

/// A server running on its own runtime thread for the duration of one test.
pub struct TestServer {
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    pub fn start(exports: Arc<dyn Exports>, config: ServerConfig) -> TestServer {
        init_logs();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("local addr").port();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                ibid_nbd::serve_until(listener, exports, config, async {
                    let _ = stop_rx.await;
                })
                .await
                .expect("serve");
            });
        });
        TestServer {
            port,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.port, export)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A set of in-memory exports: `disk` (64 MiB) plus whatever the test adds.
pub fn exports() -> Arc<MemoryExports> {
    let e = Arc::new(MemoryExports::new());
    e.insert("disk", MemoryExport::new(64 << 20));
    e
}

/// Fails the test with a clear message when a required client is not installed.
pub fn require(tool: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "required test tool `{tool}` is not installed: run scripts/install-test-tools.sh"
    );
}

/// Runs `tool args...` under a 120 s timeout, with the system Python first on PATH.
pub fn cmd(tool: &str, args: &[&str]) -> Output {
    require(tool);
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    Command::new("timeout")
        .arg("120")
        .arg(tool)
        .args(args)
        .env("PATH", path)
        .env("LIBNBD_DEBUG", "0")
        .output()
        .unwrap_or_else(|e| panic!("run {tool}: {e}"))
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a command that must succeed; returns its stdout.
pub fn ok(tool: &str, args: &[&str]) -> String {
    let o = cmd(tool, args);
    assert!(o.status.success(), "{tool} {args:?} failed:\n{}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs an nbdsh (Python) script that must succeed.
pub fn nbdsh(script: &str) -> String {
    ok("nbdsh", &["-c", script])
}

/// Generates a CA and a server certificate for `localhost`/127.0.0.1 into `dir` (the file
/// names qemu's and libnbd's `tls-creds` directories expect) and returns a TLS-required config.
/// `dir/client/` also holds a client certificate signed by the same CA, for mutual TLS.
pub fn tls_material(dir: &std::path::Path) -> TlsConfig {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa};
    use rcgen::{KeyPair, KeyUsagePurpose, SanType};
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca.distinguished_name
        .push(DnType::CommonName, "ibid test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().expect("ca key");
    let ca_cert = ca.self_signed(&ca_key).expect("ca cert");
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).expect("leaf params");
    leaf.distinguished_name
        .push(DnType::CommonName, "localhost");
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().expect("ip")));
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf_cert = leaf
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .expect("leaf cert");
    let write = |name: &str, pem: String| std::fs::write(dir.join(name), pem).expect("write pem");
    write("ca-cert.pem", ca_cert.pem());
    write("server-cert.pem", leaf_cert.pem());
    write("server-key.pem", leaf_key.serialize_pem());

    // A client certificate, in its own directory (`client/`), for mutual TLS.
    let mut client = CertificateParams::new(Vec::<String>::new()).expect("client params");
    client
        .distinguished_name
        .push(DnType::CommonName, "ibid test client");
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    // qemu insists on key encipherment in client certificates too.
    client.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let client_key = KeyPair::generate().expect("client key");
    let client_cert = client
        .signed_by(&client_key, &ca_cert, &ca_key)
        .expect("client cert");
    std::fs::create_dir_all(dir.join("client")).expect("mkdir client");
    write("client/ca-cert.pem", ca_cert.pem());
    write("client/client-cert.pem", client_cert.pem());
    write("client/client-key.pem", client_key.serialize_pem());
    TlsConfig {
        credentials: TlsCredentials::X509 {
            cert_chain_pem: dir.join("server-cert.pem"),
            private_key_pem: dir.join("server-key.pem"),
            client_ca_pem: None,
        },
        required: true,
    }
}
