//! NBD wire formats: constants, pure parsers and encoders (no I/O), per the NetworkBlockDevice
//! project's `doc/proto.md`.
//!
//! Every integer on the wire is big-endian. The parsers take byte slices that came from the
//! network and never panic on any input; the connection state machines in
//! [`crate::handshake`] and [`crate::transmission`] own the sockets and call these functions.
//! The fuzz targets (`crates/ibid-nbd/fuzz/`) and the property tests drive them directly.

use thiserror::Error;

// ---- Handshake ---------------------------------------------------------------------------------

/// First 8 bytes the server sends: ASCII `NBDMAGIC`.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// Second server magic, and the magic that starts every client option: ASCII `IHAVEOPT`.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic that starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Server greeting: `NBDMAGIC` (8) + `IHAVEOPT` (8) + handshake flags (2).
pub const GREETING_LEN: usize = 18;
/// Client flags: one big-endian u32.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Option header: magic `IHAVEOPT` (8) + option code (4) + data length (4).
pub const OPTION_HEADER_LEN: usize = 16;
/// Option reply header: magic (8) + option code (4) + reply type (4) + data length (4).
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Reply to `NBD_OPT_EXPORT_NAME`: size (8) + transmission flags (2) [+ 124 zero bytes].
pub const EXPORT_NAME_REPLY_LEN: usize = 10;
/// Reserved zero padding after the `NBD_OPT_EXPORT_NAME` reply unless `NO_ZEROES` was agreed.
pub const EXPORT_NAME_REPLY_ZEROES_LEN: usize = 124;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client wants no zero padding after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// All client flags this server understands; any other bit ends the connection.
pub const CLIENT_FLAGS_KNOWN: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

/// `NBD_OPT_EXPORT_NAME`: choose an export and enter transmission (no error path).
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`: the client ends the session.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`: list the exports.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_STARTTLS`: upgrade the connection to TLS.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`: describe one export.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`: describe one export and enter transmission.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`: use structured replies in transmission.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`: list metadata contexts.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`: select metadata contexts for `NBD_CMD_BLOCK_STATUS`.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// `NBD_OPT_EXTENDED_HEADERS`: 64-bit request and reply headers (implies structured replies).
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply: success, no more data.
pub const REP_ACK: u32 = 1;
/// Option reply: one export in a `NBD_OPT_LIST` answer.
pub const REP_SERVER: u32 = 2;
/// Option reply: one information item for `NBD_OPT_INFO`/`NBD_OPT_GO`.
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context.
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
/// Option error: unknown option.
pub const REP_ERR_UNSUP: u32 = REP_ERR + 1;
/// Option error: refused by policy.
pub const REP_ERR_POLICY: u32 = REP_ERR + 2;
/// Option error: syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = REP_ERR + 3;
/// Option error: TLS must be started first.
pub const REP_ERR_TLS_REQD: u32 = REP_ERR + 5;
/// Option error: no such export.
pub const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR + 7;
/// Option error: request or reply too large.
pub const REP_ERR_TOO_BIG: u32 = REP_ERR + 9;

/// `NBD_INFO_EXPORT`: size (u64) + transmission flags (u16).
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`: canonical export name.
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`: human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred, maximum block size (3 x u32).
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Longest string (export name, query, message) the protocol allows, in bytes.
pub const STRING_LEN_MAX: usize = 4096;
/// The one metadata context this server offers.
pub const META_BASE_ALLOCATION: &str = "base:allocation";

// ---- Transmission flags (sent with the export size) ---------------------------------------------

/// Always set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// The export is read-only: writes fail with `EPERM`.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_CMD_FLUSH` is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_CMD_FLAG_FUA` is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_CMD_TRIM` is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_CMD_WRITE_ZEROES` (and `NO_HOLE`) is supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_CMD_FLAG_DF` is supported (not advertised by this server).
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// Flush and FUA cover writes acknowledged on every connection to the export.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_CMD_CACHE` is supported.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
/// `NBD_CMD_FLAG_FAST_ZERO` is supported.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---- Transmission: requests -----------------------------------------------------------------------

/// Compact request magic.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Extended request magic (after `NBD_OPT_EXTENDED_HEADERS`).
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Compact request header: magic (4) + flags (2) + type (2) + cookie (8) + offset (8) + length (4).
pub const REQUEST_HEADER_LEN: usize = 28;
/// Extended request header: as compact but with a 64-bit length (32 bytes).
pub const EXTENDED_REQUEST_HEADER_LEN: usize = 32;

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE` (payload follows the header).
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`: soft disconnect, no reply.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE`.
pub const CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag (`WRITE_ZEROES`): do not deallocate.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag (`READ`): do not fragment the reply.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag (`BLOCK_STATUS`): one extent only.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag (`WRITE_ZEROES`): fail with `ENOTSUP` unless fast.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Command flag (extended headers): the length field is a payload length.
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---- Transmission: replies ------------------------------------------------------------------------

/// Simple reply magic: magic (4) + error (4) + cookie (8) [+ read data].
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Structured reply chunk magic: magic (4) + flags (2) + type (2) + cookie (8) + length (4).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Extended reply chunk magic: magic (4) + flags (2) + type (2) + cookie (8) + offset (8) +
/// length (8).
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;
/// Simple reply header length.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Structured reply chunk header length.
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;
/// Extended reply chunk header length.
pub const EXTENDED_REPLY_HEADER_LEN: usize = 32;

/// Chunk flag: last chunk of this reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Chunk type: no payload (final chunk of a successful reply).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type: offset (u64) + data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type: context id (u32) + descriptors of length (u32) + status (u32).
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk type: context id (u32) + count (u32) + descriptors of length (u64) + status (u64).
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// Chunk type: error (u32) + message length (u16) + message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// `base:allocation` status bit: the extent is not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status bit: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// NBD error numbers (fixed by the protocol, independent of the host's errno values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Errno {
    /// Operation not permitted (write to a read-only export).
    Perm = 1,
    /// Input/output error.
    Io = 5,
    /// Out of memory.
    NoMem = 12,
    /// Invalid argument (range, alignment, flags, unknown command).
    Inval = 22,
    /// No space left.
    NoSpc = 28,
    /// Value too large.
    Overflow = 75,
    /// Operation not supported (fast zero refused).
    NotSup = 95,
    /// The server is shutting down.
    Shutdown = 108,
}

// ---- Parsing ------------------------------------------------------------------------------------

/// Why bytes from the network could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// A magic number did not match.
    #[error("bad magic: expected {expected:#x}, found {found:#x}")]
    BadMagic {
        /// The magic the protocol requires here.
        expected: u64,
        /// What the peer sent.
        found: u64,
    },
    /// Fewer bytes than the structure needs.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// A length field exceeds what this server accepts.
    #[error("{what} too long: {len} bytes")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// The length the peer claimed.
        len: u64,
    },
    /// Well-formed framing, invalid content.
    #[error("invalid {0}")]
    Invalid(&'static str),
}

/// A small big-endian cursor over untrusted bytes; every read is bounds-checked.
struct Cursor<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Cursor { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated(self.what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
    /// A string of `len` bytes: UTF-8, no NUL, at most [`STRING_LEN_MAX`].
    fn string(&mut self, len: usize) -> Result<String, WireError> {
        if len > STRING_LEN_MAX {
            return Err(WireError::TooLong {
                what: "string",
                len: len as u64,
            });
        }
        let bytes = self.take(len)?;
        if bytes.contains(&0) {
            return Err(WireError::Invalid("string contains NUL"));
        }
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::Invalid("string is not UTF-8"))
    }
    fn finish(&self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::Invalid("trailing bytes"))
        }
    }
}

/// The fixed part of a client option: `IHAVEOPT`, option code, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// `NBD_OPT_*` code.
    pub code: u32,
    /// Length of the option data that follows.
    pub len: u32,
}

/// Parses the 16-byte option header.
pub fn parse_option_header(buf: &[u8]) -> Result<OptionHeader, WireError> {
    let mut c = Cursor::new(buf, "option header");
    let magic = c.u64()?;
    if magic != IHAVEOPT {
        return Err(WireError::BadMagic {
            expected: IHAVEOPT,
            found: magic,
        });
    }
    Ok(OptionHeader {
        code: c.u32()?,
        len: c.u32()?,
    })
}

/// Data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name (empty: the default export).
    pub name: String,
    /// `NBD_INFO_*` items the client asked for.
    pub items: Vec<u16>,
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    /// Export name.
    pub name: String,
    /// Query strings (`namespace:leaf`).
    pub queries: Vec<String>,
}

/// A decoded client option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    /// `NBD_OPT_EXPORT_NAME` with the export name.
    ExportName(String),
    /// `NBD_OPT_ABORT` (any data is ignored, as the spec asks).
    Abort,
    /// `NBD_OPT_LIST`.
    List,
    /// `NBD_OPT_STARTTLS`.
    StartTls,
    /// `NBD_OPT_INFO`.
    Info(InfoRequest),
    /// `NBD_OPT_GO`.
    Go(InfoRequest),
    /// `NBD_OPT_STRUCTURED_REPLY`.
    StructuredReply,
    /// `NBD_OPT_LIST_META_CONTEXT`.
    ListMetaContext(MetaRequest),
    /// `NBD_OPT_SET_META_CONTEXT`.
    SetMetaContext(MetaRequest),
    /// `NBD_OPT_EXTENDED_HEADERS`.
    ExtendedHeaders,
    /// Any other option code (answered `NBD_REP_ERR_UNSUP`).
    Unknown(u32),
}

/// Decodes an option's data. An error here is answered `NBD_REP_ERR_INVALID`; the connection
/// stays open.
pub fn parse_option(code: u32, data: &[u8]) -> Result<ClientOption, WireError> {
    let no_data = |opt: ClientOption| {
        if data.is_empty() {
            Ok(opt)
        } else {
            Err(WireError::Invalid("option takes no data"))
        }
    };
    match code {
        OPT_EXPORT_NAME => Cursor::new(data, "export name")
            .string(data.len())
            .map(ClientOption::ExportName),
        OPT_ABORT => Ok(ClientOption::Abort),
        OPT_LIST => no_data(ClientOption::List),
        OPT_STARTTLS => no_data(ClientOption::StartTls),
        OPT_INFO => parse_info(data).map(ClientOption::Info),
        OPT_GO => parse_info(data).map(ClientOption::Go),
        OPT_STRUCTURED_REPLY => no_data(ClientOption::StructuredReply),
        OPT_LIST_META_CONTEXT => parse_meta(data).map(ClientOption::ListMetaContext),
        OPT_SET_META_CONTEXT => parse_meta(data).map(ClientOption::SetMetaContext),
        OPT_EXTENDED_HEADERS => no_data(ClientOption::ExtendedHeaders),
        other => Ok(ClientOption::Unknown(other)),
    }
}

/// Layout: name length (u32), name, item count (u16), items (u16 each); nothing after.
fn parse_info(data: &[u8]) -> Result<InfoRequest, WireError> {
    let mut c = Cursor::new(data, "info request");
    let name_len = c.u32()? as usize;
    let name = c.string(name_len)?;
    let count = c.u16()?;
    let mut items = Vec::with_capacity(usize::from(count).min(c.buf.len() / 2));
    for _ in 0..count {
        items.push(c.u16()?);
    }
    c.finish()?;
    Ok(InfoRequest { name, items })
}

/// Layout: name length (u32), name, query count (u32), queries (u32 length + string each).
fn parse_meta(data: &[u8]) -> Result<MetaRequest, WireError> {
    let mut c = Cursor::new(data, "meta context request");
    let name_len = c.u32()? as usize;
    let name = c.string(name_len)?;
    let count = c.u32()?;
    // Each query needs at least its 4-byte length, which bounds the allocation by the input.
    let mut queries = Vec::with_capacity((count as usize).min(c.buf.len() / 4));
    for _ in 0..count {
        let len = c.u32()? as usize;
        queries.push(c.string(len)?);
    }
    c.finish()?;
    Ok(MetaRequest { name, queries })
}

/// A transmission request header (compact or extended).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// `NBD_CMD_FLAG_*` bits.
    pub flags: u16,
    /// `NBD_CMD_*` type.
    pub kind: u16,
    /// Opaque client cookie, echoed in every reply chunk.
    pub cookie: u64,
    /// Byte offset into the export.
    pub offset: u64,
    /// Byte length (32-bit on the wire unless extended headers are in use).
    pub len: u64,
}

/// Parses a request header; `extended` selects the 32-byte extended layout.
pub fn parse_request(buf: &[u8], extended: bool) -> Result<RequestHeader, WireError> {
    let mut c = Cursor::new(buf, "request header");
    let magic = c.u32()?;
    let expected = if extended {
        EXTENDED_REQUEST_MAGIC
    } else {
        REQUEST_MAGIC
    };
    if magic != expected {
        return Err(WireError::BadMagic {
            expected: u64::from(expected),
            found: u64::from(magic),
        });
    }
    let flags = c.u16()?;
    let kind = c.u16()?;
    let cookie = c.u64()?;
    let offset = c.u64()?;
    let len = if extended {
        c.u64()?
    } else {
        u64::from(c.u32()?)
    };
    Ok(RequestHeader {
        flags,
        kind,
        cookie,
        offset,
        len,
    })
}

// ---- Encoding -----------------------------------------------------------------------------------

/// The server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn encode_greeting() -> [u8; GREETING_LEN] {
    let mut out = [0u8; GREETING_LEN];
    out[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    out
}

/// One option reply: header then `data`.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    // Option replies are built by this server from bounded strings; they always fit.
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Payload of `NBD_REP_SERVER`: name length (u32), name, description.
pub fn encode_rep_server(name: &str, description: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len() + description.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
    out
}

/// Payload of `NBD_REP_INFO` / `NBD_INFO_EXPORT`: type, size, transmission flags.
pub fn encode_info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out
}

/// Payload of `NBD_REP_INFO` carrying a string (`NBD_INFO_NAME`, `NBD_INFO_DESCRIPTION`).
pub fn encode_info_string(kind: u16, value: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + value.len());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(value.as_bytes());
    out
}

/// Payload of `NBD_REP_INFO` / `NBD_INFO_BLOCK_SIZE`: minimum, preferred, maximum.
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(14);
    out.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&min.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&max.to_be_bytes());
    out
}

/// Payload of `NBD_REP_META_CONTEXT`: context id (u32), name.
pub fn encode_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, transmission flags, and the zero padding if wanted.
pub fn encode_export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(EXPORT_NAME_REPLY_LEN + EXPORT_NAME_REPLY_ZEROES_LEN);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        out.resize(EXPORT_NAME_REPLY_LEN + EXPORT_NAME_REPLY_ZEROES_LEN, 0);
    }
    out
}

/// Which reply framing the connection negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ReplyMode {
    /// Simple replies only (no option negotiated).
    Simple,
    /// Structured replies (`NBD_OPT_STRUCTURED_REPLY`).
    Structured,
    /// Extended headers (`NBD_OPT_EXTENDED_HEADERS`): 64-bit lengths everywhere.
    Extended,
}

/// A simple reply header (the read data, if any, follows separately).
pub fn encode_simple_reply(error: u32, cookie: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(SIMPLE_REPLY_LEN);
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out
}

/// A structured or extended chunk header for a payload of `payload_len` bytes. `offset` (the
/// request's offset) is only carried by the extended layout.
///
/// Callers keep structured payloads under 4 GiB (reads are capped at the 32 MiB payload
/// maximum and block status replies at a bounded number of extents).
pub fn encode_chunk_header(
    mode: ReplyMode,
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    payload_len: u64,
) -> Vec<u8> {
    debug_assert!(mode != ReplyMode::Simple);
    let mut out = Vec::with_capacity(EXTENDED_REPLY_HEADER_LEN);
    if mode == ReplyMode::Extended {
        out.extend_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
    } else {
        out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    }
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    if mode == ReplyMode::Extended {
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&payload_len.to_be_bytes());
    } else {
        assert!(
            payload_len <= u64::from(u32::MAX),
            "structured chunk too long"
        );
        out.extend_from_slice(&(payload_len as u32).to_be_bytes());
    }
    out
}

/// Payload of an `NBD_REPLY_TYPE_ERROR` chunk: error, message length, message.
pub fn encode_error_payload(errno: Errno, message: &str) -> Vec<u8> {
    let mut msg = message.as_bytes();
    if msg.len() > STRING_LEN_MAX {
        msg = &msg[..STRING_LEN_MAX];
    }
    let mut out = Vec::with_capacity(6 + msg.len());
    out.extend_from_slice(&(errno as u32).to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
    out
}

/// One `base:allocation` descriptor: a length and `NBD_STATE_*` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusDescriptor {
    /// Extent length in bytes (non-zero).
    pub len: u64,
    /// `NBD_STATE_HOLE` / `NBD_STATE_ZERO` bits.
    pub status: u32,
}

/// Payload of a block status chunk: `NBD_REPLY_TYPE_BLOCK_STATUS` (32-bit descriptors) unless
/// `extended`, then `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` (count + 64-bit descriptors).
///
/// In the compact form every descriptor length must fit 32 bits (asserted).
pub fn encode_block_status_payload(
    context_id: u32,
    descriptors: &[StatusDescriptor],
    extended: bool,
) -> Vec<u8> {
    let per = if extended { 16 } else { 8 };
    let mut out = Vec::with_capacity(8 + per * descriptors.len());
    out.extend_from_slice(&context_id.to_be_bytes());
    if extended {
        out.extend_from_slice(&(descriptors.len() as u32).to_be_bytes());
        for d in descriptors {
            out.extend_from_slice(&d.len.to_be_bytes());
            out.extend_from_slice(&u64::from(d.status).to_be_bytes());
        }
    } else {
        for d in descriptors {
            assert!(d.len <= u64::from(u32::MAX), "compact descriptor too long");
            out.extend_from_slice(&(d.len as u32).to_be_bytes());
            out.extend_from_slice(&d.status.to_be_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_header_roundtrip_and_bad_magic() {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&7u32.to_be_bytes());
        assert_eq!(
            parse_option_header(&b),
            Ok(OptionHeader {
                code: OPT_GO,
                len: 7
            })
        );
        b[0] ^= 1;
        assert!(matches!(
            parse_option_header(&b),
            Err(WireError::BadMagic { .. })
        ));
        assert!(matches!(
            parse_option_header(&b[..5]),
            Err(WireError::Truncated(_))
        ));
    }

    #[test]
    fn info_request_parses_exactly() {
        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"vol");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        let parsed = parse_option(OPT_GO, &d).expect("valid GO");
        assert_eq!(
            parsed,
            ClientOption::Go(InfoRequest {
                name: "vol".into(),
                items: vec![INFO_BLOCK_SIZE, INFO_NAME]
            })
        );
        d.push(0);
        assert!(parse_option(OPT_GO, &d).is_err(), "trailing byte rejected");
        // A name length pointing past the data.
        let bad = u32::MAX.to_be_bytes();
        assert!(parse_option(OPT_INFO, &bad).is_err());
    }

    #[test]
    fn meta_request_with_huge_count_is_truncated_not_allocated() {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            parse_option(OPT_SET_META_CONTEXT, &d),
            Err(WireError::Truncated(_))
        ));
    }

    #[test]
    fn request_headers_compact_and_extended() {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        b.extend_from_slice(&CMD_WRITE.to_be_bytes());
        b.extend_from_slice(&9u64.to_be_bytes());
        b.extend_from_slice(&4096u64.to_be_bytes());
        b.extend_from_slice(&512u32.to_be_bytes());
        let r = parse_request(&b, false).expect("compact");
        assert_eq!(
            (r.kind, r.cookie, r.offset, r.len),
            (CMD_WRITE, 9, 4096, 512)
        );
        assert!(
            parse_request(&b, true).is_err(),
            "compact magic in extended mode"
        );
        let mut e = EXTENDED_REQUEST_MAGIC.to_be_bytes().to_vec();
        e.extend_from_slice(&b[4..24]);
        e.extend_from_slice(&(1u64 << 40).to_be_bytes());
        assert_eq!(parse_request(&e, true).expect("extended").len, 1 << 40);
    }

    #[test]
    fn chunk_header_layouts() {
        let s = encode_chunk_header(ReplyMode::Structured, REPLY_FLAG_DONE, 1, 2, 3, 4);
        assert_eq!(s.len(), STRUCTURED_REPLY_HEADER_LEN);
        let e = encode_chunk_header(ReplyMode::Extended, REPLY_FLAG_DONE, 1, 2, 3, 4);
        assert_eq!(e.len(), EXTENDED_REPLY_HEADER_LEN);
        assert_eq!(&e[24..32], &4u64.to_be_bytes());
    }
}
