//! One iSCSI connection: login, then the full feature phase.
//!
//! A reader loop owns all per-connection state (pending writes, R2T
//! bookkeeping) and never blocks on storage; each ready SCSI command runs on
//! the target's worker threads (after an asynchronous wait if its LUN is
//! throttled), which also build its Data-In/Response and hands them to a single writer
//! task; the writer assigns StatSN, stamps ExpCmdSN/MaxCmdSN in send order and
//! writes through a buffer it flushes whenever its queue runs empty, so
//! responses that complete together leave in one system call. Data-In PDUs
//! carry slices of the command's read buffer: the data is not copied between
//! the backend's buffer and the socket.

use crate::backend::Direction;
use crate::config::TargetConfig;
use crate::login::{Login, LoginOutcome, LoginStep, Params, SessionType, STATUS_NO_SESSION};
use crate::pdu::{
    self, framing, lun_from_wire, Pdu, PduError, BHS_LEN, DIGEST_LEN, FLAG_FINAL, FLAG_OVERFLOW,
    FLAG_STATUS, FLAG_UNDERFLOW, FLAG_WRITE, OP_DATA_IN, OP_DATA_OUT, OP_LOGIN_REQ, OP_LOGIN_RESP,
    OP_LOGOUT_REQ, OP_LOGOUT_RESP, OP_NOP_IN, OP_NOP_OUT, OP_R2T, OP_REJECT, OP_SCSI_CMD,
    OP_SCSI_RESP, OP_SNACK, OP_TASK_MGMT_REQ, OP_TASK_MGMT_RESP, OP_TEXT_REQ, OP_TEXT_RESP,
    RESERVED_TAG,
};
use crate::scsi::{Held, Nexus, Response, Target};
use crate::sense::{Sense, STATUS_GOOD, STATUS_TASK_ABORTED, STATUS_TASK_SET_FULL};
use crate::session::{Registry, SnCheck, Window};
use crate::text;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};
use tracing::{debug, info};

/// Largest Expected Data Transfer Length accepted for a write, in bytes.
pub const MAX_WRITE_EDTL: u32 = 33 << 20;
/// Write data one connection may have buffered while collecting Data-Out.
pub const MAX_PENDING_WRITE_BYTES: u64 = 128 << 20;
/// Buffer reserved up front for a write; it grows as data arrives.
const WRITE_RESERVE_MAX: usize = 1 << 20;
/// Outgoing PDUs queued per connection before senders wait.
const OUT_QUEUE_LEN: usize = 256;
/// The writer's buffer: small PDUs completing together are sent in one write; larger data
/// goes to the socket straight from the command's buffer.
const WRITE_BUFFER: usize = 64 << 10;
/// How long a TMF or logout waits for running commands to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Poll interval while draining.
const DRAIN_POLL: Duration = Duration::from_millis(2);

/// State shared by all connections of one target.
pub struct Shared {
    /// SCSI layer.
    pub target: Target,
    /// Configuration.
    pub cfg: TargetConfig,
    /// Logged-in sessions.
    pub registry: Registry,
    /// The threads that run commands.
    pub(crate) workers: crate::workers::Workers,
    /// Running-task tables of all connections (for resets across sessions).
    pub conns: Mutex<Vec<Weak<RunningMap>>>,
}

impl Shared {
    /// Abort the running tasks on `lun` (all LUNs if `None`) of every
    /// connection except `own`; they complete with TASK ABORTED (TAS = 1).
    fn abort_others(&self, lun: Option<u64>, own: &Arc<RunningMap>) {
        let mut conns = self.conns.lock();
        conns.retain(|w| w.strong_count() > 0);
        for other in conns.iter().filter_map(Weak::upgrade) {
            if Arc::ptr_eq(&other, own) {
                continue;
            }
            for r in other
                .lock()
                .values()
                .filter(|r| lun.is_none_or(|l| l == r.lun))
            {
                let _ = r.abort.compare_exchange(
                    ABORT_NONE,
                    ABORT_REPORT,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
            }
        }
    }
}

/// Task abort state: not aborted.
const ABORT_NONE: u8 = 0;
/// Aborted by its own I_T nexus: no response is sent.
const ABORT_SILENT: u8 = 1;
/// Aborted by another nexus's reset: answered with TASK ABORTED status.
const ABORT_REPORT: u8 = 2;

/// Why a connection ends.
#[derive(Debug, Error)]
pub enum ConnError {
    /// Socket error or EOF.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Malformed framing.
    #[error("pdu: {0}")]
    Pdu(#[from] PduError),
    /// A protocol violation that ERL 0 answers by dropping the connection.
    #[error("protocol error: {0}")]
    Protocol(&'static str),
}

/// Read one PDU.
async fn read_pdu(
    rd: &mut OwnedReadHalf,
    hd: bool,
    dd: bool,
    max_data: usize,
) -> Result<Pdu, ConnError> {
    let mut bhs = [0u8; BHS_LEN];
    rd.read_exact(&mut bhs).await?;
    let f = framing(&bhs, max_data)?;
    let mut ahs = vec![0u8; f.ahs_len];
    rd.read_exact(&mut ahs).await?;
    if hd {
        let mut d = [0u8; DIGEST_LEN];
        rd.read_exact(&mut d).await?;
        let crc = pdu::header_crc(&bhs, &ahs);
        if u32::from_le_bytes(d) != crc {
            return Err(PduError::HeaderDigest.into());
        }
    }
    let mut data = vec![0u8; f.padded_data_len()];
    rd.read_exact(&mut data).await?;
    if dd && f.data_len > 0 {
        let mut d = [0u8; DIGEST_LEN];
        rd.read_exact(&mut d).await?;
        if u32::from_le_bytes(d) != pdu::crc32c(&data) {
            return Err(PduError::DataDigest.into());
        }
    }
    data.truncate(f.data_len);
    Ok(Pdu { bhs, ahs, data })
}

/// REPORT LUNS: addressed to LUN 0 by every initiator, it does not use that LUN.
const REPORT_LUNS: u8 = 0xA0;

/// Serve one TCP connection until it closes.
pub async fn run(sock: TcpStream, shared: Arc<Shared>) {
    let _ = sock.set_nodelay(true);
    let local = sock.local_addr().ok();
    let peer = sock.peer_addr().ok();
    let (mut rd, mut wr) = sock.into_split();
    let kill = Arc::new(Notify::new());
    let Some((outcome, tsih, statsn)) = login(&mut rd, &mut wr, &shared, kill.clone()).await else {
        return;
    };
    info!(?peer, initiator = %outcome.initiator_name, tsih, "session logged in");
    let nexus = Nexus {
        port: format!(
            "{},i,0x{}",
            outcome.initiator_name,
            crate::login::hex(&outcome.isid)
        ),
        initiator: outcome.initiator_name.clone(),
    };
    let window = Arc::new(Window::new(outcome.cmdsn, shared.cfg.queue_depth));
    let (tx, rx) = mpsc::channel(OUT_QUEUE_LEN);
    let params = outcome.params.clone();
    let writer = tokio::spawn(writer(
        wr,
        rx,
        params.clone(),
        window.clone(),
        statsn,
        shared.clone(),
    ));
    let mut conn = Conn {
        shared: shared.clone(),
        params,
        nexus: Arc::new(nexus),
        luns: Arc::default(),
        discovery: outcome.session_type == SessionType::Discovery,
        window,
        tx,
        pending: HashMap::new(),
        running: Arc::new(Mutex::new(HashMap::new())),
        next_ttt: 1,
        local,
        initiator: Arc::new(crate::backend::Initiator {
            peer,
            name: outcome.initiator_name.clone(),
        }),
        used_luns: Mutex::new(std::collections::HashSet::new()),
    };
    let last_rx = Arc::new(Mutex::new(tokio::time::Instant::now()));
    if let Some(every) = shared.cfg.nop_in_interval {
        tokio::spawn(keepalive(
            conn.tx.clone(),
            last_rx.clone(),
            kill.clone(),
            every,
        ));
    }
    shared.conns.lock().push(Arc::downgrade(&conn.running));
    let result = conn.serve(&mut rd, &kill, &last_rx).await;
    debug!(?peer, ?result, "connection ends");
    conn.close().await;
    let isid = outcome.isid;
    if !conn.discovery {
        shared.registry.remove(&outcome.initiator_name, isid, tsih);
    }
    shared.target.nexus_lost(&conn.nexus.port);
    drop(conn);
    let _ = writer.await;
}

/// Run the login phase; returns the outcome, TSIH and the next StatSN.
async fn login(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    shared: &Shared,
    kill: Arc<Notify>,
) -> Option<(LoginOutcome, u16, u32)> {
    let mut sm = Login::new(shared.cfg.clone());
    let mut statsn: Option<u32> = None;
    let max = shared.cfg.max_recv_data_segment_length as usize;
    loop {
        let req = read_pdu(rd, false, false, max).await.ok()?;
        if req.opcode() != OP_LOGIN_REQ {
            return None;
        }
        let sn = *statsn.get_or_insert(req.field32(28));
        let cmdsn = req.field32(24);
        let fill = |mut p: Pdu| {
            p.set32(24, sn);
            p.set32(28, cmdsn);
            p.set32(32, cmdsn.wrapping_add(shared.cfg.queue_depth.max(1) - 1));
            p
        };
        match sm.step(&req) {
            LoginStep::Continue(p) => write(wr, fill(p)).await?,
            LoginStep::Fail(p) => {
                let _ = write(wr, fill(p)).await;
                return None;
            }
            LoginStep::Done(mut p, out) => {
                if out.tsih != 0 {
                    p.bhs[1] = 0;
                    p.bhs[36..38].copy_from_slice(&STATUS_NO_SESSION.to_be_bytes());
                    let _ = write(wr, fill(p)).await;
                    return None;
                }
                let key = match out.session_type {
                    SessionType::Normal => out.initiator_name.clone(),
                    SessionType::Discovery => format!("discovery:{}", out.initiator_name),
                };
                let tsih = shared.registry.add(&key, out.isid, kill);
                p.bhs[14..16].copy_from_slice(&tsih.to_be_bytes());
                write(wr, fill(p)).await?;
                return Some((out, tsih, sn.wrapping_add(1)));
            }
        }
        statsn = Some(sn.wrapping_add(1));
    }
}

async fn write(wr: &mut OwnedWriteHalf, mut p: Pdu) -> Option<()> {
    debug_assert_eq!(p.opcode(), OP_LOGIN_RESP);
    wr.write_all(&p.encode(false, false)).await.ok()
}

/// A message to the writer task.
enum Out {
    /// Send a PDU; `status` advances StatSN.
    Pdu(Pdu, bool),
    /// Send a Data-In PDU (without data of its own) carrying `range` of a command's read
    /// data; `status` advances StatSN.
    Data(Pdu, Arc<ReadData>, std::ops::Range<usize>, bool),
    /// Flush and close the connection.
    Close,
}

async fn writer(
    wr: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Out>,
    params: Params,
    window: Arc<Window>,
    mut statsn: u32,
    shared: Arc<Shared>,
) {
    let mut wr = PduWriter::new(wr);
    let mut stamp = |p: &mut Pdu, status: bool| {
        p.set32(24, statsn);
        if status {
            statsn = statsn.wrapping_add(1);
        }
        p.set32(28, window.exp_cmdsn());
        p.set32(32, window.max_cmdsn());
    };
    loop {
        let m = match rx.try_recv() {
            Ok(m) => m,
            Err(mpsc::error::TryRecvError::Empty) => {
                if wr.flush().await.is_err() {
                    break;
                }
                match rx.recv().await {
                    Some(m) => m,
                    None => break,
                }
            }
            Err(mpsc::error::TryRecvError::Disconnected) => break,
        };
        let sent = match m {
            Out::Pdu(mut p, status) => {
                stamp(&mut p, status);
                wr.write(&p.encode(params.header_digest, params.data_digest))
                    .await
            }
            Out::Data(mut p, data, range, status) => {
                stamp(&mut p, status);
                let sent = write_data_in(&mut wr, &mut p, &data, range, &params).await;
                // The last Data-In of a command holds the last reference: the buffer is free
                // (and the held parts are let go).
                if let Ok(data) = Arc::try_unwrap(data) {
                    shared.target.buffers.give(data.buf);
                }
                sent
            }
            Out::Close => break,
        };
        if sent.is_err() {
            break;
        }
    }
    let _ = wr.flush().await;
    let _ = wr.sock.shutdown().await;
}

/// A read command's Data-In: its buffer and the parts held elsewhere (see
/// [`crate::Lun::read_held`]), shared by its Data-In PDUs.
struct ReadData {
    buf: Vec<u8>,
    held: Held,
}

impl ReadData {
    /// The slices that make up `range` of the data, in order: pieces of the buffer between
    /// the held parts.
    fn slices(&self, range: std::ops::Range<usize>) -> Vec<&[u8]> {
        let Some(held) = self.held.0.as_deref() else {
            return vec![&self.buf[range]];
        };
        let n = held.parts();
        // The first part that ends past the range's start.
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let (at, bytes) = held.part(mid);
            if at + bytes.len() <= range.start {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let mut out = Vec::new();
        let mut at = range.start;
        for i in lo..n {
            let (start, bytes) = held.part(i);
            if start >= range.end {
                break;
            }
            if start > at {
                out.push(&self.buf[at..start]);
                at = start;
            }
            let end = (start + bytes.len()).min(range.end);
            out.push(&bytes[at - start..end - start]);
            at = end;
        }
        if at < range.end {
            out.push(&self.buf[at..range.end]);
        }
        out
    }
}

/// Writes Data-In PDU `p` with `range` of `data` as its data segment, without copying the
/// data into a PDU of its own.
async fn write_data_in(
    wr: &mut PduWriter,
    p: &mut Pdu,
    data: &ReadData,
    range: std::ops::Range<usize>,
    params: &Params,
) -> std::io::Result<()> {
    let len = range.len();
    let body = data.slices(range);
    let head = p.encode_head(len, params.header_digest, 0);
    let mut tail = [0u8; 3 + 4];
    let pad = pdu::pad4(len) - len;
    let mut tail_len = pad;
    if params.data_digest && len > 0 {
        let crc = body
            .iter()
            .fold(pdu::crc32c(&[]), |crc, s| pdu::crc32c_append(crc, s));
        let crc = pdu::crc32c_append(crc, &tail[..pad]);
        tail[pad..pad + 4].copy_from_slice(&crc.to_le_bytes());
        tail_len += 4;
    }
    wr.write_parts(&head, &body, &tail[..tail_len]).await
}

/// The connection's outgoing byte stream: small PDUs gather in a buffer, sent when it fills
/// or when nothing else is waiting; a large data segment goes out from where it is, with
/// what is buffered and its header, in one `writev`.
struct PduWriter {
    sock: OwnedWriteHalf,
    buf: Vec<u8>,
}

impl PduWriter {
    fn new(sock: OwnedWriteHalf) -> PduWriter {
        PduWriter {
            sock,
            buf: Vec::with_capacity(WRITE_BUFFER),
        }
    }

    /// Queues `bytes` (sent now if the buffer is full).
    async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.write_parts(bytes, &[], &[]).await
    }

    /// Queues `head`, the slices of `body` and `tail` in order: copied into the buffer if they
    /// fit, else sent at once with what is buffered before them.
    async fn write_parts(
        &mut self,
        head: &[u8],
        body: &[&[u8]],
        tail: &[u8],
    ) -> std::io::Result<()> {
        let body_len: usize = body.iter().map(|s| s.len()).sum();
        let len = head.len() + body_len + tail.len();
        if self.buf.len() + len <= WRITE_BUFFER {
            self.buf.extend_from_slice(head);
            for s in body {
                self.buf.extend_from_slice(s);
            }
            self.buf.extend_from_slice(tail);
            return Ok(());
        }
        let buffered = std::mem::take(&mut self.buf);
        let mut parts = Vec::with_capacity(body.len() + 3);
        parts.push(&buffered[..]);
        parts.push(head);
        parts.extend_from_slice(body);
        parts.push(tail);
        let sent = write_all_vectored(&mut self.sock, &parts).await;
        self.buf = buffered;
        self.buf.clear();
        sent
    }

    /// Sends what is buffered.
    async fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            self.sock.write_all(&self.buf).await?;
            self.buf.clear();
        }
        Ok(())
    }
}

/// Writes all of `parts`, in order, with as few `writev` calls as the socket allows.
async fn write_all_vectored(sock: &mut OwnedWriteHalf, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| std::io::IoSlice::new(p))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = sock.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// A write command collecting its Data-Out.
struct PendingWrite {
    lun_raw: u64,
    cdb: [u8; 16],
    edtl: u32,
    buf: Vec<u8>,
    /// End of the unsolicited part (immediate + unsolicited Data-Out).
    unsolicited_end: u32,
    /// Next expected DataSN within the current sequence.
    datasn: u32,
    /// Outstanding R2Ts: (TTT, offset, length).
    bursts: VecDeque<(u32, u32, u32)>,
    /// Next offset to request with an R2T.
    next_r2t: u32,
    r2tsn: u32,
}

/// The running tasks of one connection, by Initiator Task Tag.
pub type RunningMap = Mutex<HashMap<u32, Running>>;

/// A command being executed.
pub struct Running {
    lun: u64,
    abort: Arc<AtomicU8>,
}

/// Whether to keep serving after a PDU.
enum Flow {
    Continue,
    Close,
}

struct Conn {
    shared: Arc<Shared>,
    params: Params,
    nexus: Arc<Nexus>,
    /// The LUN handles this connection's commands use.
    luns: Arc<crate::scsi::LunCache>,
    discovery: bool,
    window: Arc<Window>,
    tx: mpsc::Sender<Out>,
    pending: HashMap<u32, PendingWrite>,
    running: Arc<Mutex<HashMap<u32, Running>>>,
    next_ttt: u32,
    local: Option<SocketAddr>,
    /// This connection's initiator, as the backend sees it ([`crate::Luns::connected`]).
    initiator: Arc<crate::backend::Initiator>,
    /// LUNs this connection has sent commands to (the backend was told of each once).
    used_luns: Mutex<std::collections::HashSet<u64>>,
}

impl Conn {
    async fn serve(
        &mut self,
        rd: &mut OwnedReadHalf,
        kill: &Notify,
        last_rx: &Mutex<tokio::time::Instant>,
    ) -> Result<(), ConnError> {
        let (hd, dd) = (self.params.header_digest, self.params.data_digest);
        let max = self.params.target_max_recv_dsl as usize;
        loop {
            let pdu = tokio::select! {
                r = read_pdu(rd, hd, dd, max) => r?,
                _ = kill.notified() => return Ok(()),
            };
            *last_rx.lock() = tokio::time::Instant::now();
            if let Flow::Close = self.handle(pdu).await? {
                return Ok(());
            }
        }
    }

    async fn close(&mut self) {
        for (_, r) in self.running.lock().iter() {
            r.abort.store(ABORT_SILENT, Ordering::SeqCst);
        }
        let _ = self.tx.send(Out::Close).await;
    }

    async fn send(&self, p: Pdu, status: bool) {
        let _ = self.tx.send(Out::Pdu(p, status)).await;
    }

    async fn handle(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        match p.opcode() {
            OP_NOP_OUT => self.nop_out(p).await,
            OP_SCSI_CMD => self.scsi_cmd(p).await,
            OP_DATA_OUT => self.data_out(p).await,
            OP_TASK_MGMT_REQ => self.task_mgmt(p).await,
            OP_TEXT_REQ => self.text(p).await,
            OP_LOGOUT_REQ => self.logout(p).await,
            OP_LOGIN_REQ => Err(ConnError::Protocol("login request in full feature phase")),
            OP_SNACK => self.reject(&p, pdu::REJECT_PROTOCOL).await,
            _ => self.reject(&p, pdu::REJECT_NOT_SUPPORTED).await,
        }
    }

    async fn reject(&self, p: &Pdu, reason: u8) -> Result<Flow, ConnError> {
        let mut r = Pdu::new(OP_REJECT);
        r.bhs[1] = FLAG_FINAL;
        r.bhs[2] = reason;
        r.set32(16, RESERVED_TAG);
        r.data = p.bhs.to_vec();
        self.send(r, true).await;
        Ok(Flow::Continue)
    }

    async fn nop_out(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        if p.itt() == RESERVED_TAG {
            return Ok(Flow::Continue);
        }
        if self.window.check(p.field32(24), p.immediate()) == SnCheck::Drop {
            return Ok(Flow::Continue);
        }
        let mut r = Pdu::new(OP_NOP_IN);
        r.bhs[1] = FLAG_FINAL;
        r.bhs[8..16].copy_from_slice(&p.bhs[8..16]);
        r.set32(16, p.itt());
        r.set32(20, RESERVED_TAG);
        r.data = p.data;
        r.data.truncate(self.params.initiator_max_recv_dsl as usize);
        self.send(r, true).await;
        Ok(Flow::Continue)
    }

    async fn scsi_cmd(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        if self.window.check(p.field32(24), p.immediate()) == SnCheck::Drop {
            debug!(
                cmdsn = p.field32(24),
                "command outside CmdSN window dropped"
            );
            return Ok(Flow::Continue);
        }
        if self.discovery {
            return self.reject(&p, pdu::REJECT_PROTOCOL).await;
        }
        let itt = p.itt();
        if self.pending.contains_key(&itt) || self.running.lock().contains_key(&itt) {
            return Err(ConnError::Protocol("task tag in use"));
        }
        self.window.begin();
        let edtl = p.field32(20);
        let mut cdb = [0u8; 16];
        cdb.copy_from_slice(&p.bhs[32..48]);
        if p.flags() & FLAG_WRITE == 0 {
            self.execute(TaskInfo::of(&p), cdb, Vec::new());
            return Ok(Flow::Continue);
        }
        if edtl > MAX_WRITE_EDTL {
            self.spawn_response(TaskInfo::of(&p), Response::check(Sense::invalid_cdb(0)));
            return Ok(Flow::Continue);
        }
        let buffered: u64 = self.pending.values().map(|w| w.edtl as u64).sum();
        if buffered + edtl as u64 > MAX_PENDING_WRITE_BYTES {
            // Bound the memory one connection can make us hold; the
            // initiator retries TASK SET FULL later (SAM-5 5.3.1).
            let full = Response {
                status: STATUS_TASK_SET_FULL,
                sense: None,
                data_in: Vec::new(),
                data_out_len: None,
                held: Default::default(),
            };
            self.spawn_response(TaskInfo::of(&p), full);
            return Ok(Flow::Continue);
        }
        let (is_final, flags, lun_raw) = (p.is_final(), p.flags(), p.lun_raw());
        let mut data = p.data;
        if !self.params.immediate_data && !data.is_empty() {
            return Err(ConnError::Protocol("immediate data not negotiated"));
        }
        if data.len() as u32 > edtl.min(self.params.first_burst) {
            return Err(ConnError::Protocol("immediate data exceeds burst"));
        }
        data.reserve((edtl as usize - data.len()).min(WRITE_RESERVE_MAX));
        let unsolicited_end = if self.params.initial_r2t || is_final {
            data.len() as u32
        } else {
            edtl.min(self.params.first_burst)
        };
        let pw = PendingWrite {
            lun_raw,
            cdb,
            edtl,
            next_r2t: unsolicited_end,
            buf: data,
            unsolicited_end,
            datasn: 0,
            bursts: VecDeque::new(),
            r2tsn: 0,
        };
        self.pending.insert(itt, pw);
        self.advance_write(itt, flags).await;
        Ok(Flow::Continue)
    }

    /// Issue R2Ts as allowed, or execute when all data is in.
    async fn advance_write(&mut self, itt: u32, flags: u8) {
        let Some(pw) = self.pending.get_mut(&itt) else {
            return;
        };
        if pw.buf.len() as u32 == pw.edtl {
            if let Some(pw) = self.pending.remove(&itt) {
                let task = TaskInfo {
                    itt,
                    lun_raw: pw.lun_raw,
                    edtl: pw.edtl,
                    flags: flags | FLAG_WRITE,
                    r2ts: pw.r2tsn,
                };
                self.execute(task, pw.cdb, pw.buf);
            }
            return;
        }
        if (pw.buf.len() as u32) < pw.unsolicited_end {
            return;
        }
        let mut r2ts = Vec::new();
        while pw.bursts.len() < self.params.max_outstanding_r2t as usize && pw.next_r2t < pw.edtl {
            let len = (pw.edtl - pw.next_r2t).min(self.params.max_burst);
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1).max(1);
            if self.next_ttt == RESERVED_TAG {
                self.next_ttt = 1;
            }
            pw.bursts.push_back((ttt, pw.next_r2t, len));
            let mut r = Pdu::new(OP_R2T);
            r.bhs[1] = FLAG_FINAL;
            r.set_lun_raw(pw.lun_raw);
            r.set32(16, itt);
            r.set32(20, ttt);
            r.set32(36, pw.r2tsn);
            r.set32(40, pw.next_r2t);
            r.set32(44, len);
            pw.r2tsn += 1;
            pw.next_r2t += len;
            r2ts.push(r);
        }
        for r in r2ts {
            self.send(r, false).await;
        }
    }

    async fn data_out(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        let itt = p.itt();
        let Some(pw) = self.pending.get_mut(&itt) else {
            // Data for an aborted or already failed task: ignore.
            return Ok(Flow::Continue);
        };
        let (ttt, datasn, off) = (p.field32(20), p.field32(36), p.field32(40));
        let have = pw.buf.len() as u32;
        if datasn != pw.datasn || off != have {
            // ERL 0 cannot recover the sequence: fail the task, keep the connection.
            debug!(itt, datasn, off, "Data-Out out of order; task failed");
            if let Some(pw) = self.pending.remove(&itt) {
                let s = Sense::new(crate::sense::KEY_ABORTED_COMMAND, 0x4b, 0x00);
                let task = TaskInfo {
                    itt,
                    lun_raw: pw.lun_raw,
                    edtl: pw.edtl,
                    flags: FLAG_WRITE,
                    r2ts: pw.r2tsn,
                };
                self.spawn_response(task, Response::check(s));
            }
            return Ok(Flow::Continue);
        }
        let end = have
            .checked_add(p.data.len() as u32)
            .ok_or(ConnError::Protocol("overflow"))?;
        let seq_end = if ttt == RESERVED_TAG {
            pw.unsolicited_end
        } else {
            match pw.bursts.front() {
                Some(&(t, o, l)) if t == ttt => o + l,
                _ => return Err(ConnError::Protocol("Data-Out for unknown TTT")),
            }
        };
        if end > seq_end {
            return Err(ConnError::Protocol("Data-Out beyond sequence"));
        }
        pw.buf.extend_from_slice(&p.data);
        pw.datasn += 1;
        if p.is_final() || end == seq_end {
            if end != seq_end {
                return Err(ConnError::Protocol("sequence ended early"));
            }
            pw.datasn = 0;
            if ttt != RESERVED_TAG {
                pw.bursts.pop_front();
            }
            self.advance_write(itt, 0).await;
        }
        Ok(Flow::Continue)
    }

    fn execute(&self, task: TaskInfo, cdb: [u8; 16], data: Vec<u8>) {
        let abort = Arc::new(AtomicU8::new(ABORT_NONE));
        let (itt, lun) = (task.itt, lun_from_wire(task.lun_raw));
        if !self.discovery && cdb[0] != REPORT_LUNS && self.used_luns.lock().insert(lun) {
            self.shared.target.luns.connected(lun, &self.initiator);
        }
        self.running.lock().insert(
            itt,
            Running {
                lun,
                abort: abort.clone(),
            },
        );
        let shared = self.shared.clone();
        let nexus = self.nexus.clone();
        let luns = self.luns.clone();
        let running = self.running.clone();
        let window = self.window.clone();
        let tx = self.tx.clone();
        let limits = Limits {
            mrdsl: self.params.initiator_max_recv_dsl,
            max_burst: self.params.max_burst,
        };
        let delay = match throttle_charge(&cdb, task.edtl) {
            Some((direction, bytes)) if !self.discovery => {
                self.shared.target.luns.throttle(lun, direction, bytes)
            }
            _ => Duration::ZERO,
        };
        // The command runs and answers on a worker: one hand-off per command.
        let job = move || {
            let run = std::panic::AssertUnwindSafe(|| {
                shared
                    .target
                    .execute_cached(&nexus, lun, &cdb, &data, &luns)
            });
            let resp = std::panic::catch_unwind(run)
                .unwrap_or_else(|_| Response::check(Sense::new(0x4, 0x44, 0x00)));
            running.lock().remove(&itt);
            window.end();
            let resp = match abort.load(Ordering::SeqCst) {
                ABORT_NONE => resp,
                ABORT_REPORT => Response {
                    status: STATUS_TASK_ABORTED,
                    sense: None,
                    data_in: Vec::new(),
                    data_out_len: None,
                    held: Default::default(),
                },
                _ => return,
            };
            for out in response_pdus(&task, resp, limits) {
                if tx.blocking_send(out).is_err() {
                    return;
                }
            }
        };
        if delay.is_zero() {
            self.shared.workers.submit(Box::new(job));
        } else {
            let shared = self.shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                shared.workers.submit(Box::new(job));
            });
        }
    }

    fn spawn_response(&self, task: TaskInfo, resp: Response) {
        let tx = self.tx.clone();
        let window = self.window.clone();
        let limits = Limits {
            mrdsl: self.params.initiator_max_recv_dsl,
            max_burst: self.params.max_burst,
        };
        tokio::spawn(async move {
            window.end();
            for out in response_pdus(&task, resp, limits) {
                let _ = tx.send(out).await;
            }
        });
    }

    /// Wait (bounded) until none of `itts` is running.
    async fn drain(running: &Mutex<HashMap<u32, Running>>, pred: impl Fn(u32, &Running) -> bool) {
        let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
        while running.lock().iter().any(|(i, r)| pred(*i, r))
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    async fn task_mgmt(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        if self.window.check(p.field32(24), p.immediate()) == SnCheck::Drop {
            return Ok(Flow::Continue);
        }
        let function = p.flags() & 0x7f;
        let lun = lun_from_wire(p.lun_raw());
        let rtt = p.field32(20);
        let (response, close) = match function {
            1 => (self.abort_task(rtt), false),
            2 | 4 | 5 if self.shared.target.luns.open(lun).is_none() => (2, false),
            2 | 4 => (self.abort_lun(Some(lun)), false),
            5 => {
                self.abort_lun(Some(lun));
                self.shared.abort_others(Some(lun), &self.running);
                self.shared.target.lun_reset(lun);
                (0, false)
            }
            6 | 7 => {
                self.abort_lun(None);
                self.shared.abort_others(None, &self.running);
                self.shared.target.target_reset();
                (0, function == 7)
            }
            3 => (5, false),
            8 => (4, false),
            _ => (255, false),
        };
        let running = self.running.clone();
        let tx = self.tx.clone();
        let itt = p.itt();
        let lun_raw = p.lun_raw();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            Conn::drain(&running, |_, r| {
                r.abort.load(Ordering::SeqCst) != ABORT_NONE
            })
            .await;
            let mut r = Pdu::new(OP_TASK_MGMT_RESP);
            r.bhs[1] = FLAG_FINAL;
            r.bhs[2] = response;
            r.set_lun_raw(if response == 2 { lun_raw } else { 0 });
            r.set32(16, itt);
            let _ = tx.send(Out::Pdu(r, true)).await;
            if close {
                shared.registry.kill_all();
            }
        });
        Ok(Flow::Continue)
    }

    fn abort_task(&mut self, rtt: u32) -> u8 {
        if self.pending.remove(&rtt).is_some() {
            self.window.end();
            return 0;
        }
        match self.running.lock().get(&rtt) {
            Some(r) => {
                r.abort.store(ABORT_SILENT, Ordering::SeqCst);
                0
            }
            None => 1,
        }
    }

    /// Abort every task of this session on `lun` (all LUNs when `None`):
    /// tasks waiting for data are dropped, running ones lose their response.
    fn abort_lun(&mut self, lun: Option<u64>) -> u8 {
        let hit = |l: u64| lun.is_none_or(|x| x == l);
        let before = self.pending.len();
        self.pending.retain(|_, pw| !hit(lun_from_wire(pw.lun_raw)));
        for _ in self.pending.len()..before {
            self.window.end();
        }
        for r in self.running.lock().values() {
            if hit(r.lun) {
                r.abort.store(ABORT_SILENT, Ordering::SeqCst);
            }
        }
        0
    }

    async fn text(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        if self.window.check(p.field32(24), p.immediate()) == SnCheck::Drop {
            return Ok(Flow::Continue);
        }
        let mut answers = Vec::new();
        for (k, v) in text::parse(&p.data) {
            match k.as_str() {
                "SendTargets" => self.send_targets(&v, &mut answers),
                _ => answers.push((k, "NotUnderstood".to_string())),
            }
        }
        let mut r = Pdu::new(OP_TEXT_RESP);
        r.bhs[1] = FLAG_FINAL;
        r.set32(16, p.itt());
        r.set32(20, RESERVED_TAG);
        r.data = text::encode(&answers);
        r.data.truncate(self.params.initiator_max_recv_dsl as usize);
        self.send(r, true).await;
        Ok(Flow::Continue)
    }

    fn send_targets(&self, v: &str, out: &mut Vec<(String, String)>) {
        let name = &self.shared.cfg.target_name;
        let wanted = v == "All" || v == name.as_str() || (v.is_empty() && !self.discovery);
        if !wanted {
            return;
        }
        out.push(("TargetName".into(), name.clone()));
        if let Some(a) = self.local {
            let host = match a {
                SocketAddr::V4(v4) => v4.ip().to_string(),
                SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
            };
            out.push((
                "TargetAddress".into(),
                format!("{host}:{},{}", a.port(), self.shared.cfg.portal_group_tag),
            ));
        }
    }

    async fn logout(&mut self, p: Pdu) -> Result<Flow, ConnError> {
        let reason = p.flags() & 0x7f;
        let _ = self.window.check(p.field32(24), p.immediate());
        Conn::drain(&self.running, |_, _| true).await;
        let mut r = Pdu::new(OP_LOGOUT_RESP);
        r.bhs[1] = FLAG_FINAL;
        r.bhs[2] = if reason == 2 { 2 } else { 0 };
        r.set32(16, p.itt());
        self.send(r, true).await;
        if reason == 2 {
            return Ok(Flow::Continue);
        }
        info!(port = %self.nexus.port, "logout");
        Ok(Flow::Close)
    }
}

/// Ping an idle initiator with NOP-In (RFC 7143 11.19); close the connection
/// when it stays silent for three intervals. Ends when the writer is gone.
async fn keepalive(
    tx: mpsc::Sender<Out>,
    last_rx: Arc<Mutex<tokio::time::Instant>>,
    kill: Arc<Notify>,
    every: Duration,
) {
    let mut ttt: u32 = 0x4e4f_5000;
    loop {
        tokio::time::sleep(every).await;
        let idle = last_rx.lock().elapsed();
        if idle >= every * 3 {
            info!(?idle, "initiator silent; closing connection");
            kill.notify_one();
            return;
        }
        if idle < every {
            continue;
        }
        ttt = ttt.wrapping_add(1);
        let mut p = Pdu::new(OP_NOP_IN);
        p.bhs[1] = FLAG_FINAL;
        p.set32(16, RESERVED_TAG);
        p.set32(20, ttt);
        if tx.send(Out::Pdu(p, false)).await.is_err() {
            return;
        }
    }
}

/// Build the Data-In PDUs and final status for a finished command.
/// The PDUs answering `task`: Data-In (slices of the response's data, the last one carrying
/// the status when it is GOOD) and, unless the status went with the data, a SCSI Response.
fn response_pdus(task: &TaskInfo, resp: Response, limits: Limits) -> Vec<Out> {
    let TaskInfo {
        itt,
        lun_raw,
        edtl,
        flags,
        r2ts,
    } = *task;
    let write = flags & FLAG_WRITE != 0;
    let mut out = Vec::new();
    let spdtl = match resp.data_out_len {
        Some(n) if write => n,
        _ => resp.data_in.len() as u64,
    };
    let (rflag, residual) = residual(spdtl, edtl as u64);
    let mut data = resp.data_in;
    let mut held = resp.held;
    data.truncate(edtl as usize);
    if write {
        data.clear();
        held = Held::default();
    }
    let good = resp.status == STATUS_GOOD && resp.sense.is_none();
    let chunks = data_in_chunks(data.len(), limits);
    let n_chunks = chunks.len();
    let data = Arc::new(ReadData { buf: data, held });
    for (i, (off, len, end_of_burst)) in chunks.into_iter().enumerate() {
        let last = i + 1 == n_chunks;
        let mut p = Pdu::new(OP_DATA_IN);
        p.set_lun_raw(lun_raw);
        p.set32(16, itt);
        p.set32(20, RESERVED_TAG);
        p.set32(36, i as u32);
        p.set32(40, off as u32);
        let collapse = last && good;
        if end_of_burst {
            p.bhs[1] = FLAG_FINAL;
        }
        if collapse {
            p.bhs[1] |= FLAG_STATUS | rflag;
            p.bhs[3] = resp.status;
            p.set32(44, residual);
        }
        out.push(Out::Data(p, data.clone(), off..off + len, collapse));
    }
    if good && n_chunks > 0 {
        return out;
    }
    let mut p = Pdu::new(OP_SCSI_RESP);
    p.bhs[1] = FLAG_FINAL | rflag;
    p.bhs[3] = resp.status;
    p.set32(16, itt);
    p.set32(36, if write { r2ts } else { n_chunks as u32 });
    p.set32(44, residual);
    if let Some(s) = resp.sense {
        let sd = s.fixed();
        p.data.extend_from_slice(&(sd.len() as u16).to_be_bytes());
        p.data.extend_from_slice(&sd);
    }
    out.push(Out::Pdu(p, true));
    out
}

/// What the response to one command needs to know about it.
#[derive(Debug, Clone, Copy)]
struct TaskInfo {
    itt: u32,
    lun_raw: u64,
    edtl: u32,
    flags: u8,
    /// R2Ts sent for it (reported as ExpDataSN for writes).
    r2ts: u32,
}

impl TaskInfo {
    fn of(p: &Pdu) -> Self {
        TaskInfo {
            itt: p.itt(),
            lun_raw: p.lun_raw(),
            edtl: p.field32(20),
            flags: p.flags(),
            r2ts: 0,
        }
    }
}

/// Negotiated sizes that shape Data-In.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// The initiator's MaxRecvDataSegmentLength.
    mrdsl: u32,
    /// MaxBurstLength: a Data-In sequence (ended by the F bit) is no longer.
    max_burst: u32,
}

/// Split `len` bytes of Data-In into (offset, length, ends a sequence).
fn data_in_chunks(len: usize, l: Limits) -> Vec<(usize, usize, bool)> {
    let seg = l.mrdsl.max(512) as usize;
    let burst = (l.max_burst as usize).max(seg);
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let burst_end = (off / burst + 1) * burst;
        let n = seg.min(burst_end - off).min(len - off);
        out.push((off, n, off + n == burst_end || off + n == len));
        off += n;
    }
    out
}

/// Residual flag and count for SCSI-wanted `spdtl` against iSCSI `edtl`.
fn residual(spdtl: u64, edtl: u64) -> (u8, u32) {
    if spdtl > edtl {
        (FLAG_OVERFLOW, (spdtl - edtl).min(u32::MAX as u64) as u32)
    } else if spdtl < edtl {
        (FLAG_UNDERFLOW, (edtl - spdtl) as u32)
    } else {
        (0, 0)
    }
}

/// What a command costs against its LUN's rate limit ([`crate::Luns::throttle`]): reads and
/// writes their transfer length (`edtl`; COMPARE AND WRITE half of it, the half written),
/// WRITE SAME and UNMAP no bytes; other commands nothing.
fn throttle_charge(cdb: &[u8; 16], edtl: u32) -> Option<(Direction, u64)> {
    use crate::scsi::cdb::*;
    let edtl = u64::from(edtl);
    match cdb[0] {
        READ6 | READ10 | READ12 | READ16 => Some((Direction::Read, edtl)),
        WRITE6 | WRITE10 | WRITE12 | WRITE16 | WRITE_VERIFY10 | WRITE_VERIFY12 | WRITE_VERIFY16 => {
            Some((Direction::Write, edtl))
        }
        COMPARE_AND_WRITE => Some((Direction::Write, edtl / 2)),
        WRITE_SAME10 | WRITE_SAME16 | UNMAP => Some((Direction::Write, 0)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every range of a read's data, cut at any byte, is the buffer with the held parts in
    /// their places: parts at the start, at the end, side by side and apart.
    #[test]
    fn data_in_slices_put_held_parts_in_place() {
        let len = 64;
        let whole: Vec<u8> = (0..len as u8).collect();
        let held = vec![(0, 8), (8, 16), (24, 32), (56, 64)];
        let mut buf = whole.clone();
        for &(a, b) in &held {
            buf[a..b].fill(0xee);
        }
        let parts = held
            .iter()
            .map(|&(a, b)| (a, whole[a..b].to_vec()))
            .collect();
        let data = ReadData {
            buf,
            held: Held(Some(Arc::new(crate::memory::HeldCopies(parts)))),
        };
        for start in 0..len {
            for end in start..=len {
                let got: Vec<u8> = data.slices(start..end).concat();
                assert_eq!(got, whole[start..end], "{start}..{end}");
            }
        }
        let plain = ReadData {
            buf: whole.clone(),
            held: Held::default(),
        };
        assert_eq!(plain.slices(3..40), vec![&whole[3..40]]);
    }

    #[test]
    fn data_in_respects_segment_and_burst() {
        let c = data_in_chunks(
            10_000,
            Limits {
                mrdsl: 3000,
                max_burst: 4096,
            },
        );
        assert_eq!(
            c,
            vec![
                (0, 3000, false),
                (3000, 1096, true),
                (4096, 3000, false),
                (7096, 1096, true),
                (8192, 1808, true)
            ]
        );
        assert!(data_in_chunks(
            0,
            Limits {
                mrdsl: 512,
                max_burst: 512
            }
        )
        .is_empty());
    }

    #[test]
    fn residuals() {
        assert_eq!(residual(512, 0), (FLAG_OVERFLOW, 512));
        assert_eq!(residual(512, 10_000), (FLAG_UNDERFLOW, 9488));
        assert_eq!(residual(512, 512), (0, 0));
    }
}
