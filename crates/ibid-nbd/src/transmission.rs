//! The transmission phase of one connection.
//!
//! A reader loop parses request headers (and write payloads) and hands each request to the
//! server's worker threads ([`crate::workers`]); a worker runs the backend call and queues the
//! encoded reply for the connection's single writer task, so replies go out as requests finish
//! (out of order). Requests in flight are bounded by count ([`INFLIGHT_REQUESTS_MAX`]) and by
//! buffered bytes ([`INFLIGHT_BYTES_MAX`]): the reader stops reading the socket when either is
//! reached.
//!
//! A request the server can answer (bad range, alignment, flags, unknown command) gets an
//! error reply; framing it cannot trust (bad magic, a payload beyond [`PAYLOAD_LEN_MAX`], a
//! truncated header) ends the connection.

use crate::buffers::Buffers;
use crate::export::{Direction, Export, ExportError, Extent, BLOCK_SIZE_MIN, PAYLOAD_LEN_MAX};
use crate::wire::{self, Errno, ReplyMode, RequestHeader, StatusDescriptor, WireError};
use crate::workers::{Activity, InFlight, Workers};
use crate::BoxStream;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter, WriteHalf};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

/// Most requests of one connection being processed or waiting for their reply to be sent.
pub const INFLIGHT_REQUESTS_MAX: usize = 64;
/// Most payload bytes (write data and read buffers) one connection holds in flight.
pub const INFLIGHT_BYTES_MAX: u32 = 128 * 1024 * 1024;
/// Longest range one block status request examines; the client asks again for the rest.
pub const BLOCK_STATUS_SPAN_MAX: u64 = 4 * 1024 * 1024 * 1024;
/// Most extents in one block status reply.
pub const EXTENTS_PER_REPLY_MAX: usize = 64 * 1024;
/// Longest time one reply may take to reach the client's socket before the connection ends.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a closing connection waits for queued replies to reach the client.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Read buffer for request headers and write payloads.
const READ_BUFFER_LEN: usize = 256 * 1024;
/// Write buffer for replies (large read payloads bypass it).
const WRITE_BUFFER_LEN: usize = 256 * 1024;

/// Why a connection ended abnormally.
#[derive(Debug, Error)]
pub(crate) enum ConnError {
    /// The socket failed or the peer vanished mid-message.
    #[error("socket I/O: {0}")]
    Io(#[from] io::Error),
    /// The TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(io::Error),
    /// Bytes that cannot be parsed.
    #[error("malformed input: {0}")]
    Wire(#[from] WireError),
    /// A rule of the protocol or a bound of this server was broken.
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// What the handshake agreed on for the transmission phase.
pub(crate) struct Session {
    /// Export name, for logs.
    pub name: String,
    /// The backend.
    pub export: Arc<dyn Export>,
    /// Reply framing.
    pub mode: ReplyMode,
    /// Context id of `base:allocation` if it was selected for this export.
    pub meta_context: Option<u32>,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// Reads tried on the connection's task in a row that the backend declined (see
    /// [`try_inline`]).
    pub read_misses: AtomicU32,
}

/// Reads declined in a row after which a connection tries only one read in
/// [`READ_PROBE_EVERY`] inline, until one succeeds: a client reading data that is not in
/// memory (a cold or large working set) then costs a wasted attempt only rarely.
const READ_MISSES_MAX: u32 = 8;
/// See [`READ_MISSES_MAX`].
const READ_PROBE_EVERY: u32 = 16;

/// Whether to try a connection's next read inline, given its streak of declined ones.
fn try_inline(read_misses: &AtomicU32) -> bool {
    let misses = read_misses.load(Ordering::Relaxed);
    misses < READ_MISSES_MAX || {
        read_misses.store(
            misses.wrapping_add(1).max(READ_MISSES_MAX),
            Ordering::Relaxed,
        );
        misses.is_multiple_of(READ_PROBE_EVERY)
    }
}

/// Counts a read tried inline: a success ends the streak of declined ones.
fn note_inline(read_misses: &AtomicU32, read: bool) {
    let misses = read_misses.load(Ordering::Relaxed);
    if read {
        read_misses.store(0, Ordering::Relaxed);
    } else if misses < READ_MISSES_MAX {
        read_misses.store(misses + 1, Ordering::Relaxed);
    }
}

/// Checks a request against the export before any backend call: flags valid for the
/// command, not a write to a read-only export (`EPERM`), aligned to [`BLOCK_SIZE_MIN`]
/// (`EINVAL`), inside the export (`EINVAL`; `ENOSPC` for writes and zeroing, as the spec
/// asks), and read/write/cache lengths at most [`PAYLOAD_LEN_MAX`] (`EINVAL`).
/// `block_status_ok` says whether `base:allocation` was negotiated.
pub fn validate_request(
    req: &RequestHeader,
    export_size: u64,
    read_only: bool,
    block_status_ok: bool,
) -> Result<(), Errno> {
    let fua = wire::CMD_FLAG_FUA;
    let allowed = match req.kind {
        wire::CMD_READ | wire::CMD_FLUSH | wire::CMD_TRIM | wire::CMD_CACHE => fua,
        wire::CMD_WRITE => fua | wire::CMD_FLAG_PAYLOAD_LEN,
        wire::CMD_WRITE_ZEROES => fua | wire::CMD_FLAG_NO_HOLE | wire::CMD_FLAG_FAST_ZERO,
        wire::CMD_BLOCK_STATUS => fua | wire::CMD_FLAG_REQ_ONE,
        _ => return Err(Errno::Inval),
    };
    if req.flags & !allowed != 0 {
        return Err(Errno::Inval);
    }
    let writes = matches!(
        req.kind,
        wire::CMD_WRITE | wire::CMD_TRIM | wire::CMD_WRITE_ZEROES
    );
    if writes && read_only {
        return Err(Errno::Perm);
    }
    if req.kind == wire::CMD_FLUSH {
        return Ok(());
    }
    if req.kind == wire::CMD_BLOCK_STATUS && (!block_status_ok || req.len == 0) {
        return Err(Errno::Inval);
    }
    let align = u64::from(BLOCK_SIZE_MIN);
    if (req.offset | req.len) & (align - 1) != 0 {
        return Err(Errno::Inval);
    }
    let inside = req
        .offset
        .checked_add(req.len)
        .is_some_and(|end| end <= export_size);
    if !inside {
        return Err(match req.kind {
            wire::CMD_WRITE | wire::CMD_WRITE_ZEROES => Errno::NoSpc,
            _ => Errno::Inval,
        });
    }
    let payload_like = matches!(req.kind, wire::CMD_READ | wire::CMD_WRITE | wire::CMD_CACHE);
    if payload_like && req.len > u64::from(PAYLOAD_LEN_MAX) {
        return Err(Errno::Inval);
    }
    Ok(())
}

/// The result of one request, before encoding.
pub(crate) enum Outcome {
    Done,
    Data(Vec<u8>),
    Status(Vec<StatusDescriptor>),
    Error(Errno, String),
}

/// One encoded reply, with the in-flight permits and count it releases once written.
struct Outgoing {
    header: Vec<u8>,
    data: Vec<u8>,
    /// `data` goes back to the connection's buffers once written (a read's data, not the
    /// small payloads of status and error replies).
    give_back: bool,
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    _in_flight: InFlight,
}

fn errno_of(e: &ExportError) -> Errno {
    match e {
        ExportError::NoSpace => Errno::NoSpc,
        ExportError::OutOfRange => Errno::Inval,
        ExportError::ReadOnly => Errno::Perm,
        ExportError::Io(_) => Errno::Io,
    }
}

fn backend_error(e: ExportError) -> Outcome {
    match &e {
        ExportError::Io(_) => warn!("NBD request failed in the backend: {e}"),
        _ => debug!("NBD request refused by the backend: {e}"),
    }
    Outcome::Error(errno_of(&e), e.to_string())
}

/// Runs a validated request against the backend (on a worker thread); a read's reply buffer
/// comes from `buffers`.
pub(crate) fn execute(
    export: &dyn Export,
    req: &RequestHeader,
    payload: &[u8],
    buffers: &Buffers,
) -> Outcome {
    let fua = req.flags & wire::CMD_FLAG_FUA != 0;
    let done = |r: Result<(), ExportError>| r.map_or_else(backend_error, |()| Outcome::Done);
    match req.kind {
        wire::CMD_READ => {
            // Validated: len <= PAYLOAD_LEN_MAX. The backend overwrites every byte.
            let mut buf = buffers.take_filled(req.len as usize);
            match export.read(req.offset, &mut buf) {
                Ok(()) => Outcome::Data(buf),
                Err(e) => backend_error(e),
            }
        }
        wire::CMD_WRITE => done(export.write(req.offset, payload, fua)),
        wire::CMD_FLUSH => done(export.flush()),
        wire::CMD_TRIM => done(export.trim(req.offset, req.len)),
        wire::CMD_CACHE => done(export.cache(req.offset, req.len)),
        // FAST_ZERO never fails: zeroing is metadata-only. NO_HOLE cannot change what a
        // thin pool does (zeroes are never stored); thick volumes keep their reservation.
        wire::CMD_WRITE_ZEROES => done(export.write_zeroes(req.offset, req.len, fua)),
        wire::CMD_BLOCK_STATUS => block_status(export, req),
        _ => Outcome::Error(Errno::Inval, "unknown command".into()),
    }
}

fn block_status(export: &dyn Export, req: &RequestHeader) -> Outcome {
    let span = req.len.min(BLOCK_STATUS_SPAN_MAX);
    let extents = match export.block_status(req.offset, span) {
        Ok(e) => e,
        Err(e) => return backend_error(e),
    };
    let req_one = req.flags & wire::CMD_FLAG_REQ_ONE != 0;
    let descriptors = descriptors(&extents, span, req_one);
    if descriptors.is_empty() {
        warn!("backend returned no extents for block status");
        return Outcome::Error(Errno::Io, "backend returned no extents".into());
    }
    Outcome::Status(descriptors)
}

/// Converts backend extents into `base:allocation` descriptors covering at most `span`
/// bytes, merging neighbours with equal status and dropping empty extents.
fn descriptors(extents: &[Extent], span: u64, req_one: bool) -> Vec<StatusDescriptor> {
    let mut out: Vec<StatusDescriptor> = Vec::new();
    let mut covered = 0u64;
    for e in extents {
        if covered >= span {
            break;
        }
        let len = e.len.min(span - covered);
        if len == 0 {
            continue;
        }
        covered += len;
        let status =
            if e.hole { wire::STATE_HOLE } else { 0 } | if e.zero { wire::STATE_ZERO } else { 0 };
        if let Some(last) = out.last_mut().filter(|l| l.status == status) {
            last.len += len;
        } else if out.len() == EXTENTS_PER_REPLY_MAX {
            break;
        } else {
            out.push(StatusDescriptor { len, status });
        }
    }
    if req_one {
        out.truncate(1);
    }
    out
}

/// Encodes an outcome in the connection's framing: (header bytes, data bytes).
pub(crate) fn encode(
    mode: ReplyMode,
    req: &RequestHeader,
    ctx_id: u32,
    outcome: Outcome,
) -> (Vec<u8>, Vec<u8>) {
    let done = wire::REPLY_FLAG_DONE;
    let chunk = |kind: u16, len: u64| {
        wire::encode_chunk_header(mode, done, kind, req.cookie, req.offset, len)
    };
    match (mode, outcome) {
        (ReplyMode::Simple, Outcome::Done) => {
            (wire::encode_simple_reply(0, req.cookie), Vec::new())
        }
        (ReplyMode::Simple, Outcome::Data(d)) => (wire::encode_simple_reply(0, req.cookie), d),
        (ReplyMode::Simple, Outcome::Error(e, _)) => {
            (wire::encode_simple_reply(e as u32, req.cookie), Vec::new())
        }
        (ReplyMode::Simple, Outcome::Status(_)) => {
            // Unreachable by validation (block status needs a meta context, which needs
            // structured replies); answer EINVAL rather than send an illegal chunk.
            (
                wire::encode_simple_reply(Errno::Inval as u32, req.cookie),
                Vec::new(),
            )
        }
        (_, Outcome::Done) => (chunk(wire::REPLY_TYPE_NONE, 0), Vec::new()),
        (_, Outcome::Data(d)) if d.is_empty() => (chunk(wire::REPLY_TYPE_NONE, 0), Vec::new()),
        (_, Outcome::Data(d)) => {
            let mut header = chunk(wire::REPLY_TYPE_OFFSET_DATA, 8 + d.len() as u64);
            header.extend_from_slice(&req.offset.to_be_bytes());
            (header, d)
        }
        (_, Outcome::Status(descs)) => {
            let extended = mode == ReplyMode::Extended;
            let kind = if extended {
                wire::REPLY_TYPE_BLOCK_STATUS_EXT
            } else {
                wire::REPLY_TYPE_BLOCK_STATUS
            };
            let payload = wire::encode_block_status_payload(ctx_id, &descs, extended);
            (chunk(kind, payload.len() as u64), payload)
        }
        (_, Outcome::Error(e, msg)) => {
            let payload = wire::encode_error_payload(e, &msg);
            (chunk(wire::REPLY_TYPE_ERROR, payload.len() as u64), payload)
        }
    }
}

/// Serves requests until the client disconnects, breaks the protocol, or the server stops.
pub(crate) async fn run(
    stream: BoxStream,
    session: Session,
    workers: &Workers,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ConnError> {
    let (rd, wr) = tokio::io::split(stream);
    let mut rd = BufReader::with_capacity(READ_BUFFER_LEN, rd);
    // Unbounded: the permits each reply holds bound it.
    let (tx, rx) = mpsc::unbounded_channel::<Outgoing>();
    let buffers = Arc::new(Buffers::default());
    let mut writer = tokio::spawn(write_loop(wr, rx, buffers.clone()));
    let requests = Arc::new(Semaphore::new(INFLIGHT_REQUESTS_MAX));
    let bytes = Arc::new(Semaphore::new(INFLIGHT_BYTES_MAX as usize));
    let session = Arc::new(session);
    let activity = workers.connection();
    let result = loop {
        let step = tokio::select! {
            r = next_request(&mut rd, &session, &requests, &bytes, &buffers) => r,
            _ = stop.wait_for(|stopped| *stopped) => {
                debug!("server stopping: closing NBD connection");
                break Ok(());
            }
            () = tx.closed() => break Err(ConnError::Protocol("replies could not be sent (socket failed or client stopped reading)".into())),
        };
        match step {
            Ok(Some(request)) => {
                let delay = throttle(&session.export, &request);
                if !delay.is_zero() {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.wait_for(|stopped| *stopped) => break Ok(()),
                    }
                }
                dispatch(request, &session, workers, &activity, &tx, &buffers)
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    // Let requests in flight finish and their replies drain, then close (TLS close_notify).
    drop(tx);
    match tokio::time::timeout(DRAIN_TIMEOUT, &mut writer).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => debug!("write NBD replies: {e}"),
        Ok(Err(e)) => warn!("NBD reply writer failed: {e}"),
        Err(_) => {
            warn!("NBD client did not take its replies within {DRAIN_TIMEOUT:?}");
            writer.abort();
        }
    }
    result
}

/// A parsed request with its payload and in-flight permits.
struct Request {
    header: RequestHeader,
    payload: Vec<u8>,
    verdict: Result<(), Errno>,
    permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
}

/// Reads the next request. `Ok(None)`: clean end (EOF between requests, or `NBD_CMD_DISC`).
async fn next_request<R: AsyncRead + Unpin>(
    rd: &mut R,
    session: &Session,
    requests: &Arc<Semaphore>,
    bytes: &Arc<Semaphore>,
    buffers: &Buffers,
) -> Result<Option<Request>, ConnError> {
    let extended = session.mode == ReplyMode::Extended;
    let header_len = if extended {
        wire::EXTENDED_REQUEST_HEADER_LEN
    } else {
        wire::REQUEST_HEADER_LEN
    };
    let mut buf = [0u8; wire::EXTENDED_REQUEST_HEADER_LEN];
    let first = rd.read(&mut buf[..header_len]).await?;
    if first == 0 {
        return Ok(None);
    }
    rd.read_exact(&mut buf[first..header_len]).await?;
    let header = wire::parse_request(&buf[..header_len], extended)?;
    if header.kind == wire::CMD_DISC {
        debug!("NBD client disconnected (DISC)");
        return Ok(None);
    }
    let carries_payload = header.kind == wire::CMD_WRITE
        || (extended && header.flags & wire::CMD_FLAG_PAYLOAD_LEN != 0);
    let payload_len = if carries_payload { header.len } else { 0 };
    if payload_len > u64::from(PAYLOAD_LEN_MAX) {
        return Err(ConnError::Protocol(format!(
            "request payload of {payload_len} bytes (limit {PAYLOAD_LEN_MAX})"
        )));
    }
    let buffer_len = if header.kind == wire::CMD_READ && header.len <= u64::from(PAYLOAD_LEN_MAX) {
        header.len
    } else {
        payload_len
    };
    // Both bounded by PAYLOAD_LEN_MAX, so they fit u32.
    let request_permit = requests
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ConnError::Protocol("semaphore closed".into()))?;
    let byte_permit = bytes
        .clone()
        .acquire_many_owned(buffer_len as u32)
        .await
        .map_err(|_| ConnError::Protocol("semaphore closed".into()))?;
    // Read into the allocation's spare capacity: no zeroing of bytes the payload overwrites
    // (a 1 MiB write's memset showed in the server's profile), kept warm by `buffers`.
    let mut payload = buffers.take(payload_len as usize);
    if payload_len > 0 {
        (&mut *rd)
            .take(payload_len)
            .read_to_end(&mut payload)
            .await?;
    }
    if payload.len() as u64 != payload_len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "payload ended after {} of {payload_len} bytes",
                payload.len()
            ),
        )
        .into());
    }
    let mut verdict = validate_request(
        &header,
        session.export.size(),
        session.export.read_only(),
        session.meta_context.is_some(),
    );
    if carries_payload && header.kind != wire::CMD_WRITE {
        verdict = Err(Errno::Inval);
    }
    Ok(Some(Request {
        header,
        payload,
        verdict,
        permits: (request_permit, byte_permit),
    }))
}

/// How long `request` waits for its export's rate limit ([`Export::throttle`]): reads,
/// writes, write-zeroes and trims the validation let through are charged; nothing else is.
fn throttle(export: &Arc<dyn Export>, request: &Request) -> Duration {
    if request.verdict.is_err() {
        return Duration::ZERO;
    }
    let h = &request.header;
    match h.kind {
        wire::CMD_READ => export.throttle(Direction::Read, h.len),
        wire::CMD_WRITE => export.throttle(Direction::Write, h.len),
        wire::CMD_WRITE_ZEROES | wire::CMD_TRIM => export.throttle(Direction::Write, 0),
        _ => Duration::ZERO,
    }
}

/// Largest read tried on the connection's task first ([`Export::read_if_cached`]): a larger
/// one would hold up the connection's next requests for longer than a hand-off costs.
pub const INLINE_READ_BYTES_MAX: u64 = 64 << 10;

/// Hands one request to the worker pool, which runs it and queues its reply. A request the
/// validation refused is answered from here, with no backend call, and so is a write the
/// backend calls quick ([`Export::write_is_quick`]) and a read of up to
/// [`INLINE_READ_BYTES_MAX`] the backend can answer from memory ([`Export::read_if_cached`]):
/// running it here costs no thread hand-off (two per request otherwise: to a worker, and the
/// reply back to the writer task), at the price of the connection reading its next request a
/// few microseconds later. A request over [`crate::workers::INLINE_SHARED_BYTES_MAX`] runs
/// here only while no other connection has a request in flight, so that it never holds up
/// their requests ([`Workers::inline_is_fair`]).
fn dispatch(
    request: Request,
    session: &Arc<Session>,
    workers: &Workers,
    activity: &Arc<Activity>,
    tx: &mpsc::UnboundedSender<Outgoing>,
    buffers: &Arc<Buffers>,
) {
    let Request {
        header,
        payload,
        verdict,
        permits,
    } = request;
    let export = session.export.clone();
    let in_flight = activity.start();
    let fair = workers.inline_is_fair(header.len);
    let quick = workers.quick_writes_inline && fair && is_quick_write(&export, &header);
    let connection = session;
    let session = session.clone();
    let tx = tx.clone();
    let buffers = buffers.clone();
    let reply = move |outcome: Outcome| {
        let ctx_id = session.meta_context.unwrap_or(0);
        let give_back = matches!(outcome, Outcome::Data(_));
        let (header_bytes, data) = encode(session.mode, &header, ctx_id, outcome);
        // A closed channel means the connection is going away; the reply has no reader.
        let _ = tx.send(Outgoing {
            header: header_bytes,
            data,
            give_back,
            _permits: permits,
            _in_flight: in_flight,
        });
    };
    if verdict.is_ok()
        && workers.cached_reads_inline
        && fair
        && header.kind == wire::CMD_READ
        && header.len <= INLINE_READ_BYTES_MAX
        && try_inline(&connection.read_misses)
    {
        let cached = cached_read(export.as_ref(), &header, &buffers);
        note_inline(&connection.read_misses, cached.is_some());
        if let Some(outcome) = cached {
            buffers.give(payload);
            reply(outcome);
            return;
        }
    }
    match verdict {
        Err(errno) => reply(Outcome::Error(errno, format!("request refused: {errno:?}"))),
        Ok(()) => {
            let run = move || {
                let outcome = catch_unwind(AssertUnwindSafe(|| {
                    execute(export.as_ref(), &header, &payload, &buffers)
                }))
                .unwrap_or_else(|_| {
                    warn!("NBD backend call panicked");
                    Outcome::Error(Errno::Io, "internal error".into())
                });
                buffers.give(payload);
                reply(outcome);
            };
            if quick {
                run();
            } else {
                workers.submit(Box::new(run));
            }
        }
    }
}

/// The outcome of a read the backend answered from memory, `None` if it would have waited.
fn cached_read(export: &dyn Export, header: &RequestHeader, buffers: &Buffers) -> Option<Outcome> {
    let mut buf = buffers.take_filled(header.len as usize);
    match catch_unwind(AssertUnwindSafe(|| {
        export.read_if_cached(header.offset, &mut buf)
    })) {
        Ok(Some(Ok(()))) => Some(Outcome::Data(buf)),
        Ok(Some(Err(e))) => Some(backend_error(e)),
        Ok(None) => {
            buffers.give(buf);
            None
        }
        Err(_) => {
            warn!("NBD backend call panicked");
            Some(Outcome::Error(Errno::Io, "internal error".into()))
        }
    }
}

/// A write without FUA that the backend calls quick.
fn is_quick_write(export: &Arc<dyn Export>, header: &RequestHeader) -> bool {
    header.kind == wire::CMD_WRITE
        && header.flags & wire::CMD_FLAG_FUA == 0
        && export.write_is_quick(header.offset, header.len)
}

/// Writes queued replies, flushing whenever the queue runs dry, and gives read data back to
/// `buffers` once written; shuts the stream at the end.
async fn write_loop(
    wr: WriteHalf<BoxStream>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    buffers: Arc<Buffers>,
) -> Result<(), io::Error> {
    let mut wr = BufWriter::with_capacity(WRITE_BUFFER_LEN, wr);
    while let Some(mut out) = rx.recv().await {
        let flush = rx.is_empty();
        let sent = async {
            wr.write_all(&out.header).await?;
            wr.write_all(&out.data).await?;
            if flush {
                wr.flush().await?;
            }
            Ok::<(), io::Error>(())
        };
        // A client that stops taking replies would otherwise pin its in-flight buffers and
        // its connection slot forever.
        tokio::time::timeout(REPLY_WRITE_TIMEOUT, sent)
            .await
            .map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, "client stopped reading replies")
            })??;
        if out.give_back {
            buffers.give(std::mem::take(&mut out.data));
        }
        drop(out);
    }
    wr.flush().await?;
    wr.shutdown().await
}

#[cfg(test)]
mod tests {
    /// After `READ_MISSES_MAX` declined reads in a row a connection tries one read in
    /// `READ_PROBE_EVERY` inline; one that succeeds brings back trying every read.
    #[test]
    fn declined_reads_make_a_connection_try_inline_rarely_until_one_succeeds() {
        use super::{note_inline, try_inline, READ_MISSES_MAX, READ_PROBE_EVERY};
        let misses = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..READ_MISSES_MAX {
            assert!(try_inline(&misses));
            note_inline(&misses, false);
        }
        let tried: Vec<bool> = (0..3 * READ_PROBE_EVERY)
            .map(|_| {
                let t = try_inline(&misses);
                if t {
                    note_inline(&misses, false);
                }
                t
            })
            .collect();
        assert_eq!(tried.iter().filter(|&&t| t).count(), 3, "{tried:?}");
        while !try_inline(&misses) {}
        note_inline(&misses, true);
        assert!(
            (0..5).all(|_| try_inline(&misses)),
            "a success resets the streak"
        );
    }

    use super::*;

    fn req(kind: u16, flags: u16, offset: u64, len: u64) -> RequestHeader {
        RequestHeader {
            flags,
            kind,
            cookie: 1,
            offset,
            len,
        }
    }

    #[test]
    fn validation_errors() {
        let size = 1 << 20;
        assert_eq!(
            validate_request(&req(wire::CMD_READ, 0, 0, 4096), size, false, false),
            Ok(())
        );
        assert_eq!(
            validate_request(&req(wire::CMD_READ, 0, 1, 4096), size, false, false),
            Err(Errno::Inval)
        );
        assert_eq!(
            validate_request(&req(wire::CMD_READ, 0, size, 512), size, false, false),
            Err(Errno::Inval)
        );
        assert_eq!(
            validate_request(&req(wire::CMD_WRITE, 0, size, 512), size, false, false),
            Err(Errno::NoSpc)
        );
        assert_eq!(
            validate_request(&req(wire::CMD_WRITE, 0, 0, 512), size, true, false),
            Err(Errno::Perm)
        );
        assert_eq!(
            validate_request(&req(wire::CMD_TRIM, 0, 0, 512), size, true, false),
            Err(Errno::Perm)
        );
        assert_eq!(
            validate_request(
                &req(wire::CMD_READ, wire::CMD_FLAG_DF, 0, 512),
                size,
                false,
                false
            ),
            Err(Errno::Inval)
        );
        assert_eq!(
            validate_request(&req(99, 0, 0, 0), size, false, false),
            Err(Errno::Inval)
        );
        assert_eq!(
            validate_request(&req(wire::CMD_BLOCK_STATUS, 0, 0, 512), size, false, false),
            Err(Errno::Inval)
        );
        assert_eq!(
            validate_request(&req(wire::CMD_BLOCK_STATUS, 0, 0, 512), size, false, true),
            Ok(())
        );
        assert_eq!(
            validate_request(
                &req(wire::CMD_READ, 0, u64::MAX - 511, 1024),
                size,
                false,
                false
            ),
            Err(Errno::Inval)
        );
    }

    #[test]
    fn descriptors_merge_clip_and_req_one() {
        let ext = |len, data: bool| Extent {
            len,
            zero: !data,
            hole: !data,
        };
        let e = [
            ext(4096, true),
            ext(4096, true),
            ext(0, false),
            ext(8192, false),
        ];
        let d = descriptors(&e, 10240, false);
        assert_eq!(
            d,
            vec![
                StatusDescriptor {
                    len: 8192,
                    status: 0
                },
                StatusDescriptor {
                    len: 2048,
                    status: wire::STATE_HOLE | wire::STATE_ZERO
                },
            ]
        );
        assert_eq!(descriptors(&e, 10240, true).len(), 1);
    }
}
