//! Protocol tests with a hand-written raw client over TCP: exact error numbers, extended
//! headers framing, pipelining, option handling, and hostile input (bad magic, truncation,
//! 4 GiB lengths, option floods) that must end only the offending connection.

mod common;

use common::{exports, TestServer};
use ibid_nbd::memory::MemoryExport;
use ibid_nbd::wire::*;
use ibid_nbd::ServerConfig;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

const EINVAL: u32 = 22;
const EPERM: u32 = 1;
const ENOSPC: u32 = 28;

struct Raw {
    s: TcpStream,
    extended: bool,
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

impl Raw {
    fn connect(port: u16) -> Raw {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut r = Raw { s, extended: false };
        let g = r.read_n(GREETING_LEN);
        assert_eq!(be64(&g), NBDMAGIC);
        assert_eq!(be64(&g[8..]), IHAVEOPT);
        r.send(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
        r
    }

    fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).expect("send");
    }

    fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b).expect("read");
        b
    }

    fn option(&mut self, code: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&code.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// (option, reply type, data)
    fn reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = self.read_n(OPTION_REPLY_HEADER_LEN);
        assert_eq!(be64(&h), OPTION_REPLY_MAGIC);
        let len = be32(&h[16..]) as usize;
        (be32(&h[8..]), be32(&h[12..]), self.read_n(len))
    }

    fn expect_reply(&mut self, code: u32, data: &[u8], want: u32) {
        self.option(code, data);
        let (opt, kind, _) = self.reply();
        assert_eq!((opt, kind), (code, want));
    }

    /// Negotiates and enters transmission on `name`; returns (size, flags).
    fn go(&mut self, name: &str, extended: bool, meta: bool) -> (u64, u16) {
        if extended {
            self.expect_reply(OPT_EXTENDED_HEADERS, &[], REP_ACK);
            self.extended = true;
        }
        if meta {
            let mut d = (name.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(&1u32.to_be_bytes());
            d.extend_from_slice(&(META_BASE_ALLOCATION.len() as u32).to_be_bytes());
            d.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
            self.option(OPT_SET_META_CONTEXT, &d);
            assert_eq!(self.reply().1, REP_META_CONTEXT);
            assert_eq!(self.reply().1, REP_ACK);
        }
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        self.option(OPT_GO, &d);
        let mut export = None;
        loop {
            let (_, kind, data) = self.reply();
            match kind {
                REP_INFO if u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                    export = Some((be64(&data[2..]), u16::from_be_bytes([data[10], data[11]])));
                }
                REP_INFO => {}
                REP_ACK => return export.expect("NBD_INFO_EXPORT before ACK"),
                other => panic!("GO failed with {other:#x}"),
            }
        }
    }

    fn request(&mut self, kind: u16, flags: u16, cookie: u64, offset: u64, len: u64) {
        let mut b = Vec::new();
        if self.extended {
            b.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        if self.extended {
            b.extend_from_slice(&len.to_be_bytes());
        } else {
            b.extend_from_slice(&(len as u32).to_be_bytes());
        }
        self.send(&b);
    }

    /// Simple reply: (error, cookie).
    fn simple(&mut self) -> (u32, u64) {
        let h = self.read_n(SIMPLE_REPLY_LEN);
        assert_eq!(be32(&h), SIMPLE_REPLY_MAGIC);
        (be32(&h[4..]), be64(&h[8..]))
    }

    /// Extended chunk: (flags, type, cookie, payload).
    fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let h = self.read_n(EXTENDED_REPLY_HEADER_LEN);
        assert_eq!(be32(&h), EXTENDED_REPLY_MAGIC);
        let len = be64(&h[24..]) as usize;
        let flags = u16::from_be_bytes([h[4], h[5]]);
        let kind = u16::from_be_bytes([h[6], h[7]]);
        (flags, kind, be64(&h[8..]), self.read_n(len))
    }

    /// True if the server closed the connection (EOF or reset) within the read timeout.
    fn closed(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// A healthy client does a write/read round trip (proves the server still serves others).
fn round_trip(c: &mut Raw, cookie: u64) {
    c.request(CMD_WRITE, 0, cookie, 4096, 512);
    c.send(&[cookie as u8; 512]);
    let (err, ck) = c.simple();
    assert_eq!((err, ck), (0, cookie));
    c.request(CMD_READ, 0, cookie + 1, 4096, 512);
    assert_eq!(c.simple(), (0, cookie + 1));
    assert_eq!(c.read_n(512), vec![cookie as u8; 512]);
}

fn healthy(port: u16) -> Raw {
    let mut c = Raw::connect(port);
    c.go("disk", false, false);
    round_trip(&mut c, 1);
    c
}

/// Proves bad magic, unknown client flags and truncated packets end just that connection.
#[test]
fn hostile_bad_magic_and_truncation() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let mut good = healthy(srv.port);

    let mut c = Raw::connect(srv.port);
    c.send(&[0x55; OPTION_HEADER_LEN]);
    assert!(c.closed(), "bad option magic");

    let mut c = Raw::connect(srv.port);
    c.go("disk", false, false);
    c.send(&[0xff; REQUEST_HEADER_LEN]);
    assert!(c.closed(), "bad request magic");

    let s = TcpStream::connect(("127.0.0.1", srv.port)).expect("connect");
    let mut c = Raw { s, extended: false };
    c.read_n(GREETING_LEN);
    c.send(&0x8000_0000u32.to_be_bytes());
    assert!(c.closed(), "unknown client flags");

    let mut c = Raw::connect(srv.port);
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&100u32.to_be_bytes());
    b.extend_from_slice(&[0u8; 10]);
    c.send(&b);
    c.s.shutdown(Shutdown::Write).expect("shutdown");
    assert!(c.closed(), "truncated option");

    let mut c = Raw::connect(srv.port);
    c.go("disk", false, false);
    c.send(&REQUEST_MAGIC.to_be_bytes());
    c.send(&[0u8; 6]);
    c.s.shutdown(Shutdown::Write).expect("shutdown");
    assert!(c.closed(), "truncated request header");

    let mut c = Raw::connect(srv.port);
    c.go("disk", false, false);
    c.request(CMD_WRITE, 0, 7, 0, 4096);
    c.send(&[1u8; 100]);
    c.s.shutdown(Shutdown::Write).expect("shutdown");
    assert!(c.closed(), "truncated write payload");

    round_trip(&mut good, 10);
}

/// Proves 4 GiB lengths (option data, compact and extended write payloads) end the connection
/// without the server trying to buffer them.
#[test]
fn hostile_huge_lengths() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let mut good = healthy(srv.port);

    let mut c = Raw::connect(srv.port);
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&u32::MAX.to_be_bytes());
    c.send(&b);
    assert!(c.closed(), "4 GiB option");

    let mut c = Raw::connect(srv.port);
    c.go("disk", false, false);
    c.request(CMD_WRITE, 0, 1, 0, u64::from(u32::MAX));
    assert!(c.closed(), "4 GiB compact write");

    let mut c = Raw::connect(srv.port);
    c.go("disk", true, false);
    c.request(CMD_WRITE, 0, 1, 0, 4 << 30);
    assert!(c.closed(), "4 GiB extended write");

    round_trip(&mut good, 20);
}

/// Proves an option flood (10k options) is cut off at the per-handshake bound.
#[test]
fn hostile_option_flood() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let mut good = healthy(srv.port);
    let mut c = Raw::connect(srv.port);
    let mut flood = Vec::new();
    for _ in 0..10_000 {
        flood.extend_from_slice(&IHAVEOPT.to_be_bytes());
        flood.extend_from_slice(&0x7777u32.to_be_bytes());
        flood.extend_from_slice(&0u32.to_be_bytes());
    }
    // The server may hang up before taking it all: a failed send is expected.
    let _ = c.s.write_all(&flood);
    let mut replies = 0;
    let mut all = Vec::new();
    let _ = c.s.read_to_end(&mut all);
    let mut at = 0;
    while at + OPTION_REPLY_HEADER_LEN <= all.len() {
        assert_eq!(be32(&all[at + 12..]), REP_ERR_UNSUP);
        at += OPTION_REPLY_HEADER_LEN + be32(&all[at + 16..]) as usize;
        replies += 1;
    }
    assert!(
        replies <= ibid_nbd::OPTIONS_PER_HANDSHAKE_MAX,
        "{replies} replies"
    );
    assert!(replies < 10_000);
    round_trip(&mut good, 30);
}

/// Proves option handling: LIST, INFO of an unknown export, STARTTLS without TLS, duplicate
/// STRUCTURED_REPLY, invalid data, unknown options, and ABORT.
#[test]
fn option_replies() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let mut c = Raw::connect(srv.port);
    c.option(OPT_LIST, &[]);
    let (_, kind, data) = c.reply();
    assert_eq!(kind, REP_SERVER);
    assert_eq!(&data[4..8], b"disk");
    assert_eq!(c.reply().1, REP_ACK);
    c.expect_reply(OPT_LIST, b"junk", REP_ERR_INVALID);
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"nope");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.expect_reply(OPT_INFO, &d, REP_ERR_UNKNOWN);
    c.expect_reply(OPT_INFO, &[0, 0], REP_ERR_INVALID);
    c.expect_reply(OPT_STARTTLS, &[], REP_ERR_UNSUP);
    c.expect_reply(OPT_SET_META_CONTEXT, &[0; 8], REP_ERR_INVALID);
    c.expect_reply(OPT_STRUCTURED_REPLY, &[], REP_ACK);
    c.expect_reply(OPT_STRUCTURED_REPLY, &[], REP_ERR_INVALID);
    c.expect_reply(0x4242, &[1, 2, 3], REP_ERR_UNSUP);
    c.expect_reply(OPT_ABORT, &[], REP_ACK);
    assert!(c.closed());

    // EXPORT_NAME of an unknown export cannot be answered: the server hangs up.
    let mut c = Raw::connect(srv.port);
    c.option(OPT_EXPORT_NAME, b"nope");
    assert!(c.closed());
    // EXPORT_NAME of a known one: size, flags, and no zero padding (NO_ZEROES agreed).
    let mut c = Raw::connect(srv.port);
    c.option(OPT_EXPORT_NAME, b"disk");
    let r = c.read_n(EXPORT_NAME_REPLY_LEN);
    assert_eq!(be64(&r), 64 << 20);
    round_trip(&mut c, 40);
}

/// Proves the error numbers: EINVAL for unaligned, out-of-range and unknown requests, ENOSPC
/// for writes past the end, EPERM for writes to a read-only export.
#[test]
fn error_numbers_simple_replies() {
    let ex = exports();
    ex.insert("ro", MemoryExport::new(1 << 20).read_only());
    let srv = TestServer::start(ex, ServerConfig::default());
    let mut c = Raw::connect(srv.port);
    let (size, flags) = c.go("disk", false, false);
    assert_eq!(size, 64 << 20);
    assert_ne!(flags & TFLAG_CAN_MULTI_CONN, 0);
    c.request(CMD_READ, 0, 1, 100, 512);
    assert_eq!(c.simple(), (EINVAL, 1));
    c.request(CMD_READ, 0, 2, size, 512);
    assert_eq!(c.simple(), (EINVAL, 2));
    c.request(CMD_WRITE, 0, 3, size - 512, 1024);
    c.send(&[0u8; 1024]);
    assert_eq!(c.simple(), (ENOSPC, 3));
    c.request(42, 0, 4, 0, 0);
    assert_eq!(c.simple(), (EINVAL, 4));
    c.request(CMD_BLOCK_STATUS, 0, 5, 0, 4096);
    assert_eq!(
        c.simple(),
        (EINVAL, 5),
        "block status without a meta context"
    );
    c.request(CMD_FLUSH, 0, 6, 0, 0);
    assert_eq!(c.simple(), (0, 6));
    round_trip(&mut c, 7);
    c.request(CMD_DISC, 0, 9, 0, 0);
    assert!(c.closed());

    let mut c = Raw::connect(srv.port);
    let (_, flags) = c.go("ro", false, false);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    c.request(CMD_WRITE, 0, 1, 0, 512);
    c.send(&[1u8; 512]);
    assert_eq!(c.simple(), (EPERM, 1));
    c.request(CMD_WRITE_ZEROES, 0, 2, 0, 512);
    assert_eq!(c.simple(), (EPERM, 2));
    c.request(CMD_READ, 0, 3, 0, 512);
    assert_eq!(c.simple(), (0, 3));
    assert_eq!(c.read_n(512), vec![0u8; 512]);
}

/// Proves the extended-header framing: 64-bit requests, OFFSET_DATA and BLOCK_STATUS_EXT
/// chunks, error chunks, and a whole-export 64-bit zeroing request.
#[test]
fn extended_headers_framing() {
    let ex = exports();
    ex.insert("big", MemoryExport::new(8 << 30));
    let srv = TestServer::start(ex, ServerConfig::default());
    let mut c = Raw::connect(srv.port);
    let (size, _) = c.go("big", true, true);
    c.request(CMD_WRITE, CMD_FLAG_FUA, 1, 8192, 4096);
    c.send(&[0x5a; 4096]);
    let (flags, kind, cookie, payload) = c.chunk();
    assert_eq!(
        (flags, kind, cookie, payload.len()),
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 1, 0)
    );

    c.request(CMD_READ, 0, 2, 8192, 4096);
    let (_, kind, cookie, payload) = c.chunk();
    assert_eq!((kind, cookie), (REPLY_TYPE_OFFSET_DATA, 2));
    assert_eq!(be64(&payload), 8192);
    assert!(payload[8..].iter().all(|&b| b == 0x5a));

    // 5 GiB in one request: only extended headers can ask this.
    c.request(CMD_BLOCK_STATUS, 0, 3, 0, 5 << 30);
    let (_, kind, cookie, p) = c.chunk();
    assert_eq!((kind, cookie), (REPLY_TYPE_BLOCK_STATUS_EXT, 3));
    assert_eq!(be32(&p), 1, "context id");
    assert_eq!(be32(&p[4..]), 3, "descriptor count");
    let desc: Vec<(u64, u64)> = (0..3)
        .map(|i| (be64(&p[8 + 16 * i..]), be64(&p[16 + 16 * i..])))
        .collect();
    let hz = u64::from(STATE_HOLE | STATE_ZERO);
    assert_eq!(desc[0], (8192, hz));
    assert_eq!(desc[1], (4096, 0));
    assert_eq!(desc[2].1, hz);
    assert!(desc[2].0 >= 1 << 30);

    c.request(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 4, 0, size);
    assert_eq!(c.chunk().1, REPLY_TYPE_NONE);
    c.request(CMD_READ, 0, 5, 8192, 4096);
    let (_, _, _, payload) = c.chunk();
    assert!(payload[8..].iter().all(|&b| b == 0));

    c.request(CMD_READ, 0, 6, size, 4096);
    let (flags, kind, cookie, p) = c.chunk();
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6)
    );
    assert_eq!(be32(&p), EINVAL);
}

/// Proves pipelining: 300 requests sent before reading any reply (more than the in-flight
/// bound) all get exactly one reply each.
#[test]
fn pipelined_requests_all_answered() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let mut c = Raw::connect(srv.port);
    c.go("disk", true, false);
    let n = 300u64;
    let mut batch = Vec::new();
    for i in 0..n {
        let kind = if i % 2 == 0 { CMD_WRITE } else { CMD_READ };
        batch.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        batch.extend_from_slice(&0u16.to_be_bytes());
        batch.extend_from_slice(&kind.to_be_bytes());
        batch.extend_from_slice(&i.to_be_bytes());
        batch.extend_from_slice(&(i * 4096).to_be_bytes());
        batch.extend_from_slice(&4096u64.to_be_bytes());
        if kind == CMD_WRITE {
            batch.extend_from_slice(&[i as u8; 4096]);
        }
    }
    let mut writer = c.s.try_clone().expect("clone");
    let sender = std::thread::spawn(move || writer.write_all(&batch).expect("send batch"));
    let mut seen = vec![false; n as usize];
    for _ in 0..n {
        let (flags, _, cookie, _) = c.chunk();
        assert_eq!(flags, REPLY_FLAG_DONE);
        assert!(!seen[cookie as usize], "duplicate reply {cookie}");
        seen[cookie as usize] = true;
    }
    sender.join().expect("sender");
    assert!(seen.iter().all(|&s| s));
}

/// Proves stopping the server closes an idle client's connection.
#[test]
fn shutdown_closes_connections() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let mut c = healthy(srv.port);
    drop(srv);
    assert!(c.closed());
}

/// Proves FORCEDTLS: before STARTTLS every option but STARTTLS/ABORT gets ERR_TLS_REQD,
/// EXPORT_NAME hangs up, and STARTTLS is acknowledged.
#[test]
fn tls_required_refuses_options_before_starttls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServerConfig {
        tls: Some(common::tls_material(dir.path())),
        ..ServerConfig::default()
    };
    let srv = TestServer::start(exports(), config);
    let mut c = Raw::connect(srv.port);
    c.expect_reply(OPT_LIST, &[], REP_ERR_TLS_REQD);
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"disk");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.expect_reply(OPT_GO, &d, REP_ERR_TLS_REQD);
    c.expect_reply(OPT_STRUCTURED_REPLY, &[], REP_ERR_TLS_REQD);
    c.expect_reply(OPT_STARTTLS, &[], REP_ACK);
    // Plain bytes where a TLS ClientHello belongs end the connection.
    c.send(&[0u8; 64]);
    assert!(c.closed());

    let mut c = Raw::connect(srv.port);
    c.option(OPT_EXPORT_NAME, b"disk");
    assert!(c.closed());
}

/// A backend whose reads panic at offset 0 and fail with `Io` elsewhere; writes succeed.
struct BrokenExport;

impl ibid_nbd::Export for BrokenExport {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, _buf: &mut [u8]) -> Result<(), ibid_nbd::ExportError> {
        assert!(offset != 0, "injected backend panic");
        Err(ibid_nbd::ExportError::Io("injected read error".into()))
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn block_status(&self, _: u64, _: u64) -> Result<Vec<ibid_nbd::Extent>, ibid_nbd::ExportError> {
        Ok(Vec::new())
    }
}

struct BrokenExports;

impl ibid_nbd::Exports for BrokenExports {
    fn list(&self) -> Vec<ibid_nbd::ExportInfo> {
        Vec::new()
    }
    fn open(&self, _name: &str) -> Option<std::sync::Arc<dyn ibid_nbd::Export>> {
        Some(std::sync::Arc::new(BrokenExport))
    }
}

/// Proves backend failures become error replies on a connection that keeps working: `Io` and
/// a panicking backend call give EIO, an empty block status answer gives EIO.
#[test]
fn backend_errors_and_panics_give_eio() {
    const EIO: u32 = 5;
    let srv = TestServer::start(std::sync::Arc::new(BrokenExports), ServerConfig::default());
    let mut c = Raw::connect(srv.port);
    c.go("any", true, true);
    for (cookie, offset) in [(1u64, 4096u64), (2, 0)] {
        c.request(CMD_READ, 0, cookie, offset, 512);
        let (flags, kind, ck, p) = c.chunk();
        assert_eq!(
            (flags, kind, ck),
            (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie)
        );
        assert_eq!(be32(&p), EIO);
    }
    c.request(CMD_BLOCK_STATUS, 0, 3, 0, 4096);
    let (_, kind, _, p) = c.chunk();
    assert_eq!((kind, be32(&p)), (REPLY_TYPE_ERROR, EIO));
    c.request(CMD_WRITE, 0, 4, 0, 512);
    c.send(&[1u8; 512]);
    assert_eq!(c.chunk().1, REPLY_TYPE_NONE);
}

/// A backend whose reads wait until the test opens the gate, and whose writes of one block or
/// less are quick ([`ibid_nbd::Export::write_is_quick`]).
struct GatedExport {
    gate: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl ibid_nbd::Export for GatedExport {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), ibid_nbd::ExportError> {
        let (open, cv) = &*self.gate;
        let mut open = open.lock().expect("gate");
        while !*open {
            open = cv.wait(open).expect("gate");
        }
        buf.fill(7);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn write_is_quick(&self, _: u64, len: u64) -> bool {
        len <= 4096
    }
    /// Offsets from 512 KiB on are "in memory": answered at once, with 9s.
    fn read_if_cached(
        &self,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Result<(), ibid_nbd::ExportError>> {
        (offset >= 512 << 10).then(|| {
            buf.fill(9);
            Ok(())
        })
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), ibid_nbd::ExportError> {
        Ok(())
    }
    fn block_status(&self, _: u64, _: u64) -> Result<Vec<ibid_nbd::Extent>, ibid_nbd::ExportError> {
        Ok(Vec::new())
    }
}

struct GatedExports(std::sync::Arc<GatedExport>);

impl ibid_nbd::Exports for GatedExports {
    fn list(&self) -> Vec<ibid_nbd::ExportInfo> {
        Vec::new()
    }
    fn open(&self, _name: &str) -> Option<std::sync::Arc<dyn ibid_nbd::Export>> {
        Some(self.0.clone())
    }
}

/// Lets every read waiting at `gate` through.
fn open_gate(gate: &(std::sync::Mutex<bool>, std::sync::Condvar)) {
    let (open, cv) = gate;
    *open.lock().expect("gate") = true;
    cv.notify_all();
}

/// Whether a reply arrives within `wait` (it is left unread).
fn reply_within(c: &mut Raw, wait: Duration) -> bool {
    c.s.set_read_timeout(Some(wait)).expect("timeout");
    let mut b = [0u8; 1];
    let arrived = match c.s.peek(&mut b) {
        Ok(n) => n > 0,
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => false,
        Err(e) => panic!("peek: {e}"),
    };
    c.s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    arrived
}

/// Proves a write the backend calls quick runs on the connection's task: with the only
/// worker thread stuck in a read, such a write is still answered, first; a FUA write, a write
/// the backend does not call quick, and every write with inline writes switched off wait for
/// the worker.
#[test]
fn quick_writes_run_on_the_connection_not_behind_the_workers() {
    for inline in [true, false] {
        let gate = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let export = std::sync::Arc::new(GatedExport { gate: gate.clone() });
        let config = ServerConfig {
            workers: 1,
            quick_writes_inline: inline,
            ..ServerConfig::default()
        };
        let srv = TestServer::start(std::sync::Arc::new(GatedExports(export)), config);
        let mut c = Raw::connect(srv.port);
        c.go("any", false, false);
        c.request(CMD_READ, 0, 1, 0, 512);
        c.request(CMD_WRITE, 0, 2, 4096, 512);
        c.send(&[1u8; 512]);
        if inline {
            assert_eq!(c.simple(), (0, 2), "the quick write is answered first");
            for (cookie, flags, len) in [(3u64, CMD_FLAG_FUA, 512u64), (4, 0, 8192)] {
                c.request(CMD_WRITE, flags, cookie, 8192, len);
                c.send(&vec![2u8; len as usize]);
            }
        }
        assert!(
            !reply_within(&mut c, Duration::from_millis(300)),
            "a write that is not run inline was answered while the only worker is busy"
        );
        open_gate(&gate);
        assert_eq!(c.simple(), (0, 1));
        assert_eq!(c.read_n(512), vec![7u8; 512]);
        let rest: Vec<u64> = if inline { vec![3, 4] } else { vec![2] };
        for cookie in rest {
            assert_eq!(c.simple(), (0, cookie));
        }
    }
}

/// Proves a read the backend answers from memory runs on the connection's task: with the only
/// worker thread stuck in a read that would wait, a cached read is still answered, first, with
/// its data; with inline reads switched off, or for a read larger than the inline limit, it
/// waits for the worker like any other.
#[test]
fn cached_reads_run_on_the_connection_not_behind_the_workers() {
    let big = ibid_nbd::INLINE_READ_BYTES_MAX + 4096;
    for (inline, len) in [(true, 4096u64), (false, 4096), (true, big)] {
        let gate = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let export = std::sync::Arc::new(GatedExport { gate: gate.clone() });
        let config = ServerConfig {
            workers: 1,
            cached_reads_inline: inline,
            ..ServerConfig::default()
        };
        let srv = TestServer::start(std::sync::Arc::new(GatedExports(export)), config);
        let mut c = Raw::connect(srv.port);
        c.go("any", false, false);
        c.request(CMD_READ, 0, 1, 0, 512);
        c.request(CMD_READ, 0, 2, 512 << 10, len);
        let first = inline && len == 4096;
        if first {
            assert_eq!(c.simple(), (0, 2), "the cached read is answered first");
            assert_eq!(c.read_n(len as usize), vec![9u8; len as usize]);
        } else {
            assert!(
                !reply_within(&mut c, Duration::from_millis(300)),
                "a read not run inline was answered while the only worker is busy"
            );
        }
        open_gate(&gate);
        assert_eq!(c.simple(), (0, 1));
        assert_eq!(c.read_n(512), vec![7u8; 512]);
        if !first {
            // The worker's `read` (7s), not the cached path.
            assert_eq!(c.simple(), (0, 2));
            assert_eq!(c.read_n(len as usize), vec![7u8; len as usize]);
        }
    }
}

/// Proves a read or write over `INLINE_SHARED_BYTES_MAX` runs on its connection's task only
/// while no other connection has a request in flight: with another connection's read holding
/// the only worker, a 32 KiB cached read waits for that worker, while a 4 KiB one is answered
/// at once; alone, the 32 KiB read is answered at once from memory.
#[test]
fn large_requests_run_inline_only_while_no_other_connection_is_busy() {
    let len = 32u64 << 10;
    assert!(len > ibid_nbd::INLINE_SHARED_BYTES_MAX && len <= ibid_nbd::INLINE_READ_BYTES_MAX);
    let gate = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let export = std::sync::Arc::new(GatedExport { gate: gate.clone() });
    let config = ServerConfig {
        workers: 1,
        ..ServerConfig::default()
    };
    let srv = TestServer::start(std::sync::Arc::new(GatedExports(export)), config);
    let mut alone = Raw::connect(srv.port);
    alone.go("any", false, false);
    alone.request(CMD_READ, 0, 1, 512 << 10, len);
    assert_eq!(alone.simple(), (0, 1));
    assert_eq!(
        alone.read_n(len as usize),
        vec![9u8; len as usize],
        "from memory"
    );

    let mut busy = Raw::connect(srv.port);
    busy.go("any", false, false);
    busy.request(CMD_READ, 0, 1, 0, 512);
    // Until `busy`'s read reaches the worker and stays there, it may not be counted yet.
    std::thread::sleep(Duration::from_millis(100));
    alone.request(CMD_READ, 0, 2, 512 << 10, len);
    alone.request(CMD_READ, 0, 3, 512 << 10, 4096);
    assert_eq!(
        alone.simple(),
        (0, 3),
        "the small cached read is answered first"
    );
    assert_eq!(alone.read_n(4096), vec![9u8; 4096]);
    assert!(
        !reply_within(&mut alone, Duration::from_millis(300)),
        "the large read ran inline while another connection was busy"
    );
    open_gate(&gate);
    assert_eq!(busy.simple(), (0, 1));
    assert_eq!(busy.read_n(512), vec![7u8; 512]);
    // The worker's `read` (7s), not the cached path.
    assert_eq!(alone.simple(), (0, 2));
    assert_eq!(alone.read_n(len as usize), vec![7u8; len as usize]);
}
