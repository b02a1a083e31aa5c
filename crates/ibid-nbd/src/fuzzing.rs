//! Entry points for the fuzz targets (`crates/ibid-nbd/fuzz/`) and the property tests: they
//! feed arbitrary bytes through the parsers and the state machines, without sockets.
//!
//! The property is the same everywhere: no input panics, allocates without bound or loops
//! forever; every outcome is a reply or a clean refusal.

use crate::export::Export;
use crate::handshake::Context;
use crate::handshake::{self, Next, State};
use crate::memory::{MemoryExport, MemoryExports};
use crate::transmission;
use crate::wire::{self, ReplyMode};
use std::sync::Arc;

/// Size of the export the fuzz entry points use (small, so any offset is cheap).
const FUZZ_EXPORT_LEN: u64 = 1 << 20;

/// Treats `data` as the client's side of a handshake after the client flags: a sequence of
/// option headers and data, fed one by one to the option state machine. The first byte picks
/// TLS-required mode.
pub fn handshake_bytes(data: &[u8]) {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let exports = Arc::new(MemoryExports::new());
    exports.insert("disk", MemoryExport::new(FUZZ_EXPORT_LEN));
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    let ctx = Context {
        exports,
        tls: None,
        tls_required: mode & 1 != 0,
        stop,
    };
    let mut state = State::new(mode & 2 != 0);
    let mut out = Vec::new();
    for _ in 0..handshake::OPTIONS_PER_HANDSHAKE_MAX {
        if rest.len() < wire::OPTION_HEADER_LEN {
            return;
        }
        let Ok(header) = wire::parse_option_header(&rest[..wire::OPTION_HEADER_LEN]) else {
            return;
        };
        rest = &rest[wire::OPTION_HEADER_LEN..];
        if header.len > handshake::OPTION_DATA_LEN_MAX || header.len as usize > rest.len() {
            return;
        }
        let (body, tail) = rest.split_at(header.len as usize);
        rest = tail;
        out.clear();
        match handshake::option(&ctx, &mut state, header.code, body, &mut out) {
            Next::Continue | Next::StartTls => {}
            Next::Close | Next::Enter(_) => return,
        }
    }
}

/// Treats `data` as transmission-phase traffic: the first byte picks the reply mode, then
/// request headers (with write payloads) are parsed, validated, executed against an
/// in-memory export and encoded, until the bytes run out or the framing breaks.
pub fn transmission_bytes(data: &[u8]) {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let mode = match mode % 3 {
        0 => ReplyMode::Simple,
        1 => ReplyMode::Structured,
        _ => ReplyMode::Extended,
    };
    let extended = mode == ReplyMode::Extended;
    let header_len = if extended {
        wire::EXTENDED_REQUEST_HEADER_LEN
    } else {
        wire::REQUEST_HEADER_LEN
    };
    let export = MemoryExport::new(FUZZ_EXPORT_LEN);
    let buffers = crate::buffers::Buffers::default();
    let meta = mode != ReplyMode::Simple;
    while rest.len() >= header_len {
        let Ok(req) = wire::parse_request(&rest[..header_len], extended) else {
            return;
        };
        rest = &rest[header_len..];
        let payload_len = if req.kind == wire::CMD_WRITE {
            req.len
        } else {
            0
        };
        if payload_len > rest.len() as u64 {
            return;
        }
        let (payload, tail) = rest.split_at(payload_len as usize);
        rest = tail;
        let verdict = transmission::validate_request(&req, export.size(), false, meta);
        let outcome = match verdict {
            Ok(()) => transmission::execute(&export, &req, payload, &buffers),
            Err(e) => transmission::Outcome::Error(e, String::new()),
        };
        let (_, data) = transmission::encode(mode, &req, 1, outcome);
        buffers.give(data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn option_bytes(code: u32, data: &[u8]) -> Vec<u8> {
        let mut b = wire::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&code.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Random bytes never panic the option parsers.
        #[test]
        fn option_parsers_total(code in 0u32..16, data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = wire::parse_option_header(&data);
            let _ = wire::parse_option(code, &data);
        }

        /// Random bytes never panic the request parser, in either layout.
        #[test]
        fn request_parser_total(data in proptest::collection::vec(any::<u8>(), 0..40), ext: bool) {
            let _ = wire::parse_request(&data, ext);
        }

        /// Well-framed options with random codes and bodies never panic the handshake.
        #[test]
        fn handshake_state_machine_total(
            mode: u8,
            opts in proptest::collection::vec((0u32..13, proptest::collection::vec(any::<u8>(), 0..64)), 0..16),
        ) {
            let mut bytes = vec![mode];
            for (code, body) in &opts {
                bytes.extend_from_slice(&option_bytes(*code, body));
            }
            handshake_bytes(&bytes);
        }

        /// Requests with real magic and random fields never panic validation, execution or
        /// encoding.
        #[test]
        fn transmission_total(
            mode: u8,
            reqs in proptest::collection::vec((0u16..10, any::<u16>(), 0u64..(2 << 20), 0u64..70_000), 0..8),
        ) {
            let extended = mode % 3 == 2;
            let mut bytes = vec![mode];
            for (kind, flags, offset, len) in reqs {
                let offset = offset & !511;
                let len = if kind == wire::CMD_WRITE { len.min(8192) } else { len };
                if extended {
                    bytes.extend_from_slice(&wire::EXTENDED_REQUEST_MAGIC.to_be_bytes());
                } else {
                    bytes.extend_from_slice(&wire::REQUEST_MAGIC.to_be_bytes());
                }
                bytes.extend_from_slice(&flags.to_be_bytes());
                bytes.extend_from_slice(&kind.to_be_bytes());
                bytes.extend_from_slice(&7u64.to_be_bytes());
                bytes.extend_from_slice(&offset.to_be_bytes());
                if extended {
                    bytes.extend_from_slice(&len.to_be_bytes());
                } else {
                    bytes.extend_from_slice(&(len as u32).to_be_bytes());
                }
                if kind == wire::CMD_WRITE {
                    bytes.resize(bytes.len() + len as usize, 0xa5);
                }
            }
            transmission_bytes(&bytes);
        }

        /// Encoded INFO/GO requests parse back to what was encoded.
        #[test]
        fn info_request_roundtrip(name in "[a-z@0-9]{0,40}", items in proptest::collection::vec(0u16..5, 0..6)) {
            let mut d = (name.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(&(items.len() as u16).to_be_bytes());
            for i in &items {
                d.extend_from_slice(&i.to_be_bytes());
            }
            let parsed = wire::parse_option(wire::OPT_GO, &d);
            prop_assert_eq!(parsed, Ok(wire::ClientOption::Go(wire::InfoRequest { name, items })));
        }
    }
}
