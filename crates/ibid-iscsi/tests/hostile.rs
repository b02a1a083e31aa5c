//! Hostile input over raw TCP: garbage, oversize and truncated PDUs, unknown
//! opcodes, bad CDBs and stray Data-Out end (only) the offending connection
//! or get a precise answer, while an established session keeps working.

mod common;

use ibid_iscsi::pdu::{self, Pdu};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// How long to wait for the target to answer or close.
const WAIT: Duration = Duration::from_secs(5);

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

fn send(s: &mut TcpStream, mut p: Pdu) {
    s.write_all(&p.encode(false, false)).expect("send");
}

fn recv(s: &mut TcpStream) -> Option<Pdu> {
    let mut bhs = [0u8; pdu::BHS_LEN];
    s.read_exact(&mut bhs).ok()?;
    let f = pdu::framing(&bhs, 1 << 24).ok()?;
    let mut rest = vec![0u8; f.ahs_len + f.padded_data_len()];
    s.read_exact(&mut rest).ok()?;
    Some(Pdu {
        bhs,
        ahs: Vec::new(),
        data: rest[f.ahs_len..f.ahs_len + f.data_len].to_vec(),
    })
}

/// Whether the target closes the connection (EOF or reset) within WAIT.
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut
            }
        }
    }
}

fn login_pdu(target: &str) -> Pdu {
    let mut p = Pdu::new(pdu::OP_LOGIN_REQ);
    p.bhs[0] |= pdu::FLAG_IMMEDIATE;
    p.bhs[1] = pdu::FLAG_TRANSIT | (1 << 2) | 3;
    p.bhs[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 7]);
    p.set32(16, 1);
    p.data = format!(
        "InitiatorName=iqn.2026-11.org.ibid:hostile\0TargetName={target}\0SessionType=Normal\0\
         HeaderDigest=None\0DataDigest=None\0MaxRecvDataSegmentLength=65536\0"
    )
    .into_bytes();
    p
}

/// Log in a normal session; returns the stream and the next CmdSN.
fn login(port: u16) -> (TcpStream, u32) {
    let mut s = connect(port);
    send(&mut s, login_pdu(common::IQN));
    let r = recv(&mut s).expect("login response");
    assert_eq!(r.opcode(), pdu::OP_LOGIN_RESP);
    assert_eq!(&r.bhs[36..38], &[0, 0], "login failed");
    (s, r.field32(28))
}

fn scsi_cmd(s: &mut TcpStream, itt: u32, cmdsn: u32, cdb: &[u8], read_len: u32) -> Pdu {
    let mut p = Pdu::new(pdu::OP_SCSI_CMD);
    p.bhs[1] = pdu::FLAG_FINAL | if read_len > 0 { pdu::FLAG_READ } else { 0 };
    p.set32(16, itt);
    p.set32(20, read_len);
    p.set32(24, cmdsn);
    p.bhs[32..32 + cdb.len()].copy_from_slice(cdb);
    send(s, p);
    loop {
        let r = recv(s).expect("response");
        if r.opcode() == pdu::OP_SCSI_RESP
            || (r.opcode() == pdu::OP_DATA_IN && r.flags() & pdu::FLAG_STATUS != 0)
        {
            return r;
        }
    }
}

fn tur_ok(s: &mut TcpStream, cmdsn: &mut u32) {
    let r = scsi_cmd(s, *cmdsn, *cmdsn, &[0u8; 6], 0);
    *cmdsn += 1;
    assert_eq!(r.bhs[3], 0, "TEST UNIT READY failed on the good session");
}

#[test]
fn malformed_input_kills_only_its_connection() {
    let t = common::start();
    let (mut good, mut sn) = login(t.port);
    tur_ok(&mut good, &mut sn);

    // Garbage before login.
    let mut s = connect(t.port);
    s.write_all(&[0x5au8; 4096]).unwrap();
    assert!(closed(&mut s), "garbage did not close the connection");
    tur_ok(&mut good, &mut sn);

    // A data segment far beyond MaxRecvDataSegmentLength.
    let mut s = connect(t.port);
    let mut bhs = [0u8; 48];
    bhs[0] = pdu::OP_LOGIN_REQ;
    bhs[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
    s.write_all(&bhs).unwrap();
    assert!(closed(&mut s), "oversize PDU did not close the connection");
    tur_ok(&mut good, &mut sn);

    // A truncated PDU, then the client goes away.
    let mut s = connect(t.port);
    s.write_all(&bhs[..20]).unwrap();
    drop(s);
    tur_ok(&mut good, &mut sn);

    // A login to a target that does not exist: status class 2 (initiator error).
    let mut s = connect(t.port);
    send(&mut s, login_pdu("iqn.2026-11.org.ibid:nope"));
    let r = recv(&mut s).expect("login response");
    assert_eq!(r.bhs[36], 2);
    assert!(closed(&mut s));
    tur_ok(&mut good, &mut sn);
}

/// An idle initiator is pinged with NOP-In (ITT reserved, TTT set) and a
/// silent one is disconnected after three intervals.
#[test]
fn nop_in_keepalive_pings_then_drops_silent_initiator() {
    let t = common::start_cfg(1 << 30, |c| {
        c.nop_in_interval = Some(Duration::from_millis(200))
    });
    let (mut s, _) = login(t.port);
    let r = recv(&mut s).expect("nop-in ping");
    assert_eq!((r.opcode(), r.itt()), (pdu::OP_NOP_IN, pdu::RESERVED_TAG));
    assert_ne!(r.field32(20), pdu::RESERVED_TAG);
    assert!(closed(&mut s), "silent connection was not closed");
}

#[test]
fn bad_requests_in_full_feature_phase_get_precise_answers() {
    let t = common::start();
    let (mut s, mut sn) = login(t.port);

    // Unknown opcode: Reject (command not supported) carrying the header.
    let mut p = Pdu::new(0x1c);
    p.set32(16, 99);
    send(&mut s, p);
    let r = recv(&mut s).expect("reject");
    assert_eq!(r.opcode(), pdu::OP_REJECT);
    assert_eq!(r.bhs[2], pdu::REJECT_NOT_SUPPORTED);
    assert_eq!(r.data.len(), 48);
    tur_ok(&mut s, &mut sn);

    // Unknown SCSI opcode: CHECK CONDITION, ILLEGAL REQUEST / 20h.
    let r = scsi_cmd(&mut s, 500, sn, &[0xc7, 0, 0, 0, 0, 0], 0);
    sn += 1;
    assert_eq!(r.bhs[3], 2);
    assert_eq!((r.data[4] & 0x0f, r.data[14]), (5, 0x20));

    // READ beyond the end: LBA OUT OF RANGE (21h).
    let r = scsi_cmd(
        &mut s,
        501,
        sn,
        &[0x28, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 1, 0],
        512,
    );
    sn += 1;
    assert_eq!((r.bhs[3], r.data[14]), (2, 0x21));

    // Data-Out for a task that does not exist is ignored.
    let mut d = Pdu::new(pdu::OP_DATA_OUT);
    d.bhs[1] = pdu::FLAG_FINAL;
    d.set32(16, 0xdead);
    d.data = vec![1; 512];
    send(&mut s, d);
    tur_ok(&mut s, &mut sn);

    // A write announcing 1 GiB: refused with INVALID FIELD IN CDB, session intact.
    let mut p = Pdu::new(pdu::OP_SCSI_CMD);
    p.bhs[1] = pdu::FLAG_FINAL | pdu::FLAG_WRITE;
    p.set32(16, 502);
    p.set32(20, 1 << 30);
    p.set32(24, sn);
    sn += 1;
    p.bhs[32..42].copy_from_slice(&[0x2a, 0, 0, 0, 0, 0, 0x80, 0, 0, 0]);
    send(&mut s, p);
    let r = recv(&mut s).expect("response");
    assert_eq!(
        (r.opcode(), r.bhs[3], r.data[14]),
        (pdu::OP_SCSI_RESP, 2, 0x24)
    );
    tur_ok(&mut s, &mut sn);

    // NOP-Out ping is echoed.
    let mut p = Pdu::new(pdu::OP_NOP_OUT);
    p.bhs[0] |= pdu::FLAG_IMMEDIATE;
    p.bhs[1] = pdu::FLAG_FINAL;
    p.set32(16, 777);
    p.set32(20, pdu::RESERVED_TAG);
    p.set32(24, sn);
    p.data = b"ping".to_vec();
    send(&mut s, p);
    let r = recv(&mut s).expect("nop-in");
    assert_eq!(
        (r.opcode(), r.itt(), r.data.as_slice()),
        (pdu::OP_NOP_IN, 777, &b"ping"[..])
    );
}

/// Writes that announce data but never send it cannot make the target buffer
/// more than its per-connection bound: the excess gets TASK SET FULL.
#[test]
fn unsent_write_data_is_bounded() {
    let t = common::start();
    let (mut s, mut sn) = login(t.port);
    let edtl: u32 = 32 << 20;
    for i in 0..5u32 {
        let mut p = Pdu::new(pdu::OP_SCSI_CMD);
        p.bhs[1] = pdu::FLAG_FINAL | pdu::FLAG_WRITE;
        p.set32(16, 1000 + i);
        p.set32(20, edtl);
        p.set32(24, sn);
        sn += 1;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x8a;
        cdb[10..14].copy_from_slice(&(edtl / 512).to_be_bytes());
        p.bhs[32..48].copy_from_slice(&cdb);
        send(&mut s, p);
    }
    loop {
        let r = recv(&mut s).expect("pdu");
        if r.opcode() == pdu::OP_R2T {
            assert!(r.itt() < 1004, "R2T for a command past the bound");
            continue;
        }
        assert_eq!(
            (r.opcode(), r.itt(), r.bhs[3]),
            (pdu::OP_SCSI_RESP, 1004, 0x28)
        );
        break;
    }
    tur_ok(&mut s, &mut sn);
}

/// Session reinstatement (same InitiatorName and ISID, TSIH 0) closes the old
/// session's connection; a login naming an unknown TSIH is refused.
#[test]
fn session_reinstatement_and_unknown_tsih() {
    let t = common::start();
    let (mut old, _) = login(t.port);
    let (mut new, mut sn) = login(t.port);
    assert!(
        closed(&mut old),
        "reinstated session's old connection stays open"
    );
    tur_ok(&mut new, &mut sn);
    let mut s = connect(t.port);
    let mut p = login_pdu(common::IQN);
    p.bhs[14..16].copy_from_slice(&0x7777u16.to_be_bytes());
    send(&mut s, p);
    let r = recv(&mut s).expect("login response");
    assert_eq!(r.bhs[36], 2, "login into a nonexistent session accepted");
}

/// `serve_until`: when the shutdown future completes the listener stops and
/// logged-in sessions are closed.
#[test]
fn serve_until_shutdown_closes_sessions() {
    use ibid_iscsi::memory::MemLuns;
    let mut luns = MemLuns::new(1 << 30, 80);
    luns.add(0, 1 << 20, false);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            let cfg = ibid_iscsi::TargetConfig::new(common::IQN);
            ibid_iscsi::serve_until(l, std::sync::Arc::new(luns), cfg, async {
                let _ = stop_rx.await;
            })
            .await
            .unwrap();
            // Give the killed connections a moment to close before the runtime drops.
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
    });
    let (mut s, mut sn) = login(port);
    tur_ok(&mut s, &mut sn);
    stop_tx.send(()).unwrap();
    assert!(closed(&mut s), "session survived shutdown");
    server.join().unwrap();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "still listening after shutdown"
    );
}
