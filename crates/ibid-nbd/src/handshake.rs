//! The handshake phase: greeting, client flags, then option haggling until the client enters
//! transmission (`NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`) or leaves.
//!
//! Hostile input is bounded: at most [`OPTIONS_PER_HANDSHAKE_MAX`] options, each with at most
//! [`OPTION_DATA_LEN_MAX`] bytes of data, and the server's handshake timeout. Breaking a bound,
//! a bad magic or unknown client flags end the connection; a malformed option body is answered
//! `NBD_REP_ERR_INVALID` and haggling goes on, as the spec asks.

use crate::export::Exports;
use crate::export::{Export, BLOCK_SIZE_MIN, BLOCK_SIZE_PREFERRED, PAYLOAD_LEN_MAX};
use crate::transmission::{ConnError, Session};
use crate::wire::{self, ClientOption, InfoRequest, MetaRequest, ReplyMode};
use crate::BoxStream;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tracing::debug;

/// What every connection shares (the server makes it; the handshake and transmission read it).
pub(crate) struct Context {
    pub exports: Arc<dyn Exports>,
    pub tls: Option<crate::tls::Acceptor>,
    pub tls_required: bool,
    /// Becomes `true` when the server shuts down.
    pub stop: watch::Receiver<bool>,
}

/// Most options one handshake may send before the server hangs up.
pub const OPTIONS_PER_HANDSHAKE_MAX: u32 = 1024;
/// Longest option data accepted, in bytes (strings are at most 4 KiB; meta context requests
/// may carry several).
pub const OPTION_DATA_LEN_MAX: u32 = 64 * 1024;
/// The context id this server gives `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Negotiation state that options change (reset by STARTTLS).
pub(crate) struct State {
    tls_active: bool,
    no_zeroes: bool,
    mode: ReplyMode,
    /// Export name for which `base:allocation` was selected by the last SET_META_CONTEXT.
    meta_export: Option<String>,
}

impl State {
    /// The state after the client flags, before any option.
    pub(crate) fn new(no_zeroes: bool) -> Self {
        State {
            tls_active: false,
            no_zeroes,
            mode: ReplyMode::Simple,
            meta_export: None,
        }
    }
}

/// What one option asks the loop to do next.
pub(crate) enum Next {
    Continue,
    Close,
    StartTls,
    Enter(Session),
}

/// Runs the handshake. `Ok(None)`: the client aborted or left; `Ok(Some(..))`: transmission.
pub(crate) async fn negotiate(
    mut stream: BoxStream,
    ctx: &Context,
) -> Result<Option<(BoxStream, Session)>, ConnError> {
    stream.write_all(&wire::encode_greeting()).await?;
    stream.flush().await?;
    let mut flags = [0u8; wire::CLIENT_FLAGS_LEN];
    if read_or_eof(&mut stream, &mut flags).await?.is_none() {
        return Ok(None);
    }
    let client_flags = u32::from_be_bytes(flags);
    if client_flags & !wire::CLIENT_FLAGS_KNOWN != 0 {
        return Err(ConnError::Protocol(format!(
            "unknown client flags {client_flags:#x}"
        )));
    }
    let mut state = State::new(client_flags & wire::FLAG_C_NO_ZEROES != 0);
    for _ in 0..OPTIONS_PER_HANDSHAKE_MAX {
        let mut header = [0u8; wire::OPTION_HEADER_LEN];
        if read_or_eof(&mut stream, &mut header).await?.is_none() {
            return Ok(None);
        }
        let header = wire::parse_option_header(&header)?;
        if header.len > OPTION_DATA_LEN_MAX {
            return Err(ConnError::Protocol(format!(
                "option {} carries {} bytes (limit {OPTION_DATA_LEN_MAX})",
                header.code, header.len
            )));
        }
        let mut data = vec![0u8; header.len as usize];
        stream.read_exact(&mut data).await?;
        let mut out = Vec::new();
        let next = option(ctx, &mut state, header.code, &data, &mut out);
        stream.write_all(&out).await?;
        stream.flush().await?;
        match next {
            Next::Continue => {}
            Next::Close => return Ok(None),
            Next::Enter(session) => return Ok(Some((stream, session))),
            Next::StartTls => {
                let Some(acceptor) = ctx.tls.clone() else {
                    return Err(ConnError::Protocol("STARTTLS without TLS".into()));
                };
                stream = acceptor.accept(stream).await.map_err(ConnError::Tls)?;
                // The spec forbids keeping negotiation state from before STARTTLS.
                state.tls_active = true;
                state.mode = ReplyMode::Simple;
                state.meta_export = None;
                debug!("TLS established");
            }
        }
    }
    Err(ConnError::Protocol(format!(
        "more than {OPTIONS_PER_HANDSHAKE_MAX} options in one handshake"
    )))
}

/// `read_exact` that reports a clean EOF before the first byte as `None`.
async fn read_or_eof(stream: &mut BoxStream, buf: &mut [u8]) -> Result<Option<()>, ConnError> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = stream.read(&mut buf[filled..]).await?;
        if n == 0 {
            if filled == 0 {
                return Ok(None);
            }
            return Err(ConnError::Protocol("connection closed mid-message".into()));
        }
        filled += n;
    }
    Ok(Some(()))
}

/// Handles one option: appends the reply bytes to `out` and says what happens next. Pure
/// except for backend look-ups, so it can be unit-tested without sockets.
pub(crate) fn option(
    ctx: &Context,
    state: &mut State,
    code: u32,
    data: &[u8],
    out: &mut Vec<u8>,
) -> Next {
    let mut reply = |kind: u32, payload: &[u8]| {
        out.extend_from_slice(&wire::encode_option_reply(code, kind, payload));
    };
    if *ctx.stop.borrow() {
        reply(wire::REP_ERR_SHUTDOWN, b"server is shutting down");
        return Next::Close;
    }
    let parsed = match wire::parse_option(code, data) {
        Ok(p) => p,
        Err(e) => {
            if code == wire::OPT_EXPORT_NAME {
                // No error reply exists for EXPORT_NAME: hang up.
                return Next::Close;
            }
            reply(wire::REP_ERR_INVALID, e.to_string().as_bytes());
            return Next::Continue;
        }
    };
    if ctx.tls_required && !state.tls_active {
        match parsed {
            ClientOption::StartTls | ClientOption::Abort => {}
            ClientOption::ExportName(_) => return Next::Close,
            _ => {
                reply(wire::REP_ERR_TLS_REQD, b"TLS is required: use STARTTLS");
                return Next::Continue;
            }
        }
    }
    match parsed {
        ClientOption::Abort => {
            reply(wire::REP_ACK, &[]);
            Next::Close
        }
        ClientOption::List => {
            for e in ctx.exports.list() {
                reply(
                    wire::REP_SERVER,
                    &wire::encode_rep_server(&e.name, &e.description),
                );
            }
            reply(wire::REP_ACK, &[]);
            Next::Continue
        }
        ClientOption::StartTls => {
            if ctx.tls.is_none() {
                reply(wire::REP_ERR_UNSUP, b"TLS is not configured");
                Next::Continue
            } else if state.tls_active {
                reply(wire::REP_ERR_INVALID, b"TLS is already active");
                Next::Continue
            } else {
                reply(wire::REP_ACK, &[]);
                Next::StartTls
            }
        }
        ClientOption::StructuredReply => {
            if state.mode == ReplyMode::Simple {
                state.mode = ReplyMode::Structured;
                reply(wire::REP_ACK, &[]);
            } else {
                reply(
                    wire::REP_ERR_INVALID,
                    b"structured replies already negotiated",
                );
            }
            Next::Continue
        }
        ClientOption::ExtendedHeaders => {
            if state.mode == ReplyMode::Extended {
                reply(
                    wire::REP_ERR_INVALID,
                    b"extended headers already negotiated",
                );
            } else {
                state.mode = ReplyMode::Extended;
                reply(wire::REP_ACK, &[]);
            }
            Next::Continue
        }
        ClientOption::ListMetaContext(req) => {
            meta_context(ctx, state, &req, false, &mut reply);
            Next::Continue
        }
        ClientOption::SetMetaContext(req) => {
            meta_context(ctx, state, &req, true, &mut reply);
            Next::Continue
        }
        ClientOption::Info(req) => {
            info(ctx, &req, &mut reply);
            Next::Continue
        }
        ClientOption::Go(req) => match info(ctx, &req, &mut reply) {
            Some(export) => Next::Enter(session(state, req.name, export)),
            None => Next::Continue,
        },
        ClientOption::ExportName(name) => match ctx.exports.open(&name) {
            Some(export) => {
                out.extend_from_slice(&wire::encode_export_name_reply(
                    export.size(),
                    transmission_flags(export.as_ref()),
                    state.no_zeroes,
                ));
                Next::Enter(session(state, name, export))
            }
            None => Next::Close,
        },
        ClientOption::Unknown(_) => {
            reply(wire::REP_ERR_UNSUP, b"unsupported option");
            Next::Continue
        }
    }
}

fn session(state: &State, name: String, export: Arc<dyn Export>) -> Session {
    let meta_context = (state.meta_export.as_deref() == Some(name.as_str())
        && state.mode != ReplyMode::Simple)
        .then_some(BASE_ALLOCATION_ID);
    Session {
        flags: transmission_flags(export.as_ref()),
        name,
        export,
        mode: state.mode,
        meta_context,
        read_misses: Default::default(),
    }
}

/// The transmission flags advertised for `export`.
pub(crate) fn transmission_flags(export: &dyn Export) -> u16 {
    let mut flags = wire::TFLAG_HAS_FLAGS
        | wire::TFLAG_SEND_FLUSH
        | wire::TFLAG_SEND_FUA
        | wire::TFLAG_CAN_MULTI_CONN
        | wire::TFLAG_SEND_CACHE;
    if export.read_only() {
        flags |= wire::TFLAG_READ_ONLY;
    } else {
        flags |= wire::TFLAG_SEND_TRIM | wire::TFLAG_SEND_WRITE_ZEROES | wire::TFLAG_SEND_FAST_ZERO;
    }
    flags
}

/// Answers INFO/GO; returns the export on success (the ACK has been queued).
fn info(
    ctx: &Context,
    req: &InfoRequest,
    reply: &mut impl FnMut(u32, &[u8]),
) -> Option<Arc<dyn Export>> {
    let Some(export) = ctx.exports.open(&req.name) else {
        reply(wire::REP_ERR_UNKNOWN, b"no such export");
        return None;
    };
    reply(
        wire::REP_INFO,
        &wire::encode_info_export(export.size(), transmission_flags(export.as_ref())),
    );
    for &item in &req.items {
        match item {
            wire::INFO_NAME => reply(
                wire::REP_INFO,
                &wire::encode_info_string(wire::INFO_NAME, &req.name),
            ),
            wire::INFO_DESCRIPTION => {
                let mut text = export.description();
                text.truncate(wire::STRING_LEN_MAX);
                reply(
                    wire::REP_INFO,
                    &wire::encode_info_string(wire::INFO_DESCRIPTION, &text),
                );
            }
            _ => {}
        }
    }
    // Always sent: the server enforces these sizes whether or not the client asked.
    reply(
        wire::REP_INFO,
        &wire::encode_info_block_size(BLOCK_SIZE_MIN, BLOCK_SIZE_PREFERRED, PAYLOAD_LEN_MAX),
    );
    reply(wire::REP_ACK, &[]);
    Some(export)
}

/// Answers LIST_META_CONTEXT (`set == false`) and SET_META_CONTEXT.
fn meta_context(
    ctx: &Context,
    state: &mut State,
    req: &MetaRequest,
    set: bool,
    reply: &mut impl FnMut(u32, &[u8]),
) {
    if set {
        // Replaced by every SET, even a failed one.
        state.meta_export = None;
    }
    if state.mode == ReplyMode::Simple {
        reply(wire::REP_ERR_INVALID, b"negotiate structured replies first");
        return;
    }
    if ctx.exports.open(&req.name).is_none() {
        reply(wire::REP_ERR_UNKNOWN, b"no such export");
        return;
    }
    let matches = if set {
        req.queries.iter().any(|q| q == wire::META_BASE_ALLOCATION)
    } else {
        req.queries.is_empty()
            || req
                .queries
                .iter()
                .any(|q| q == "base:" || q == wire::META_BASE_ALLOCATION)
    };
    if matches {
        let id = if set { BASE_ALLOCATION_ID } else { 0 };
        reply(
            wire::REP_META_CONTEXT,
            &wire::encode_meta_context(id, wire::META_BASE_ALLOCATION),
        );
        if set {
            state.meta_export = Some(req.name.clone());
        }
    }
    reply(wire::REP_ACK, &[]);
}
