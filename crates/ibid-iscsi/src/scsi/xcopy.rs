//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 6.4, 6.18), plus the
//! Third-party Copy VPD page (8Fh).
//!
//! Parameter list (LID1):
//!
//! ```text
//! 0      LIST IDENTIFIER
//! 1      STR(5) LIST ID USAGE(4:3) PRIORITY(2:0)
//! 2..4   TARGET DESCRIPTOR LIST LENGTH
//! 8..12  SEGMENT DESCRIPTOR LIST LENGTH
//! 12..16 INLINE DATA LENGTH
//! 16..   target descriptors (32 bytes each), then segment descriptors
//! ```
//!
//! Only identification descriptors (E4h) naming one of our LUNs by its NAA
//! designator and block→block segments (02h) are supported; each segment
//! becomes one [`crate::backend::Luns::copy_range`] call (metadata only in
//! the engine).

use super::{alloc_trunc, lun_error_sense, naa_designator, param_list, Ctx, Response, BLOCK_SIZE};
use crate::sense::{Sense, KEY_COPY_ABORTED, KEY_ILLEGAL_REQUEST};

/// Parameter list header length.
pub const HEADER_LEN: usize = 16;
/// Target descriptor length.
pub const TARGET_DESC_LEN: usize = 32;
/// Block→block segment descriptor length.
pub const SEGMENT_B2B_LEN: usize = 28;
/// Target descriptor type: identification descriptor.
pub const TD_IDENT: u8 = 0xe4;
/// Segment descriptor type: block device to block device.
pub const SD_B2B: u8 = 0x02;
/// Most target descriptors in one list.
pub const MAX_TARGET_DESCS: u16 = 32;
/// Most segment descriptors in one list.
pub const MAX_SEGMENT_DESCS: u16 = 128;
/// Longest target + segment descriptor lists, in bytes.
pub const MAX_DESC_LIST_LEN: u32 = 8192;
/// Longest segment, in bytes (the 16-bit block count of a 02h descriptor).
pub const MAX_SEGMENT_BYTES: u32 = 0xffff * BLOCK_SIZE as u32;
/// RECEIVE COPY RESULTS service action: COPY STATUS.
pub const RCR_COPY_STATUS: u8 = 0x00;
/// RECEIVE COPY RESULTS service action: OPERATING PARAMETERS.
pub const RCR_OPERATING_PARAMETERS: u8 = 0x03;

/// Result of a completed copy, kept for RECEIVE COPY RESULTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyResult {
    /// Completed without error.
    pub ok: bool,
    /// Segments processed.
    pub segments: u16,
    /// Bytes copied.
    pub bytes: u64,
}

/// One parsed block→block segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Source target descriptor index.
    pub src: u16,
    /// Destination target descriptor index.
    pub dst: u16,
    /// Blocks to copy.
    pub blocks: u16,
    /// Source LBA.
    pub src_lba: u64,
    /// Destination LBA.
    pub dst_lba: u64,
}

/// A parsed EXTENDED COPY parameter list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyList {
    /// LIST IDENTIFIER.
    pub list_id: u8,
    /// LIST ID USAGE.
    pub usage: u8,
    /// NAA designators (16 bytes) of the target descriptors.
    pub targets: Vec<Vec<u8>>,
    /// The segments.
    pub segments: Vec<Segment>,
}

fn illegal(asc: u8, ascq: u8) -> Sense {
    Sense::new(KEY_ILLEGAL_REQUEST, asc, ascq)
}

/// Parse and validate a LID1 parameter list. Pure.
pub fn parse(p: &[u8]) -> Result<CopyList, Sense> {
    if p.len() < HEADER_LEN {
        return Err(Sense::param_list_length());
    }
    let tlen = u16::from_be_bytes([p[2], p[3]]) as usize;
    let slen = u32::from_be_bytes([p[8], p[9], p[10], p[11]]) as usize;
    let inline = u32::from_be_bytes([p[12], p[13], p[14], p[15]]) as usize;
    if tlen as u64 + slen as u64 > MAX_DESC_LIST_LEN as u64 {
        return Err(Sense::param_list_length());
    }
    if HEADER_LEN + tlen + slen + inline > p.len() {
        return Err(Sense::param_list_length());
    }
    if inline != 0 {
        return Err(Sense::invalid_param(12));
    }
    if tlen % TARGET_DESC_LEN != 0 {
        return Err(Sense::param_list_length());
    }
    let usage = (p[1] >> 3) & 3;
    if usage == 3 && p[0] != 0 {
        return Err(Sense::invalid_param(0));
    }
    let targets = parse_targets(&p[HEADER_LEN..HEADER_LEN + tlen])?;
    let segments = parse_segments(&p[HEADER_LEN + tlen..HEADER_LEN + tlen + slen])?;
    Ok(CopyList {
        list_id: p[0],
        usage,
        targets,
        segments,
    })
}

fn parse_targets(t: &[u8]) -> Result<Vec<Vec<u8>>, Sense> {
    let n = t.len() / TARGET_DESC_LEN;
    if n > MAX_TARGET_DESCS as usize {
        return Err(illegal(0x26, 0x06));
    }
    let mut out = Vec::with_capacity(n);
    for (i, d) in t.chunks_exact(TARGET_DESC_LEN).enumerate() {
        let at = (HEADER_LEN + i * TARGET_DESC_LEN) as u16;
        if d[0] != TD_IDENT {
            return Err(illegal(0x26, 0x07));
        }
        if d[1] & 0x1f != 0 {
            // Only peripheral device type 0 (block) is supported.
            return Err(Sense::invalid_param(at + 1));
        }
        // Designator header at 4..8, value at 8..: NAA (type 3), length 16.
        let (ty, len) = (d[5] & 0x0f, d[7] as usize);
        if ty != 3 || len != 16 {
            return Err(Sense::new(KEY_COPY_ABORTED, 0x08, 0x04));
        }
        out.push(d[8..24].to_vec());
    }
    Ok(out)
}

fn parse_segments(s: &[u8]) -> Result<Vec<Segment>, Sense> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < s.len() {
        if out.len() >= MAX_SEGMENT_DESCS as usize {
            return Err(illegal(0x26, 0x08));
        }
        let Some(h) = s.get(pos..pos + 4) else {
            return Err(Sense::param_list_length());
        };
        if h[0] != SD_B2B {
            return Err(illegal(0x26, 0x09));
        }
        let len = u16::from_be_bytes([h[2], h[3]]) as usize + 4;
        if len != SEGMENT_B2B_LEN {
            return Err(Sense::invalid_param(0));
        }
        let Some(d) = s.get(pos..pos + len) else {
            return Err(Sense::param_list_length());
        };
        let be16 = |i: usize| u16::from_be_bytes([d[i], d[i + 1]]);
        let be64 = |i: usize| {
            u64::from_be_bytes([
                d[i],
                d[i + 1],
                d[i + 2],
                d[i + 3],
                d[i + 4],
                d[i + 5],
                d[i + 6],
                d[i + 7],
            ])
        };
        out.push(Segment {
            src: be16(4),
            dst: be16(6),
            blocks: be16(10),
            src_lba: be64(12),
            dst_lba: be64(20),
        });
        pos += len;
    }
    Ok(out)
}

/// COPY ABORTED / UNREACHABLE COPY TARGET (08h/04h).
fn unreachable() -> Sense {
    Sense::new(KEY_COPY_ABORTED, 0x08, 0x04)
}

/// COPY ABORTED / COPY TARGET DEVICE DATA UNDERRUN (0Dh/02h), for ranges past the end.
fn out_of_range() -> Sense {
    Sense::new(KEY_COPY_ABORTED, 0x0d, 0x02)
}

/// Map each target descriptor to a LUN number by its NAA designator.
fn resolve_targets(ctx: &Ctx, targets: &[Vec<u8>]) -> Result<Vec<u64>, Sense> {
    let luns = ctx.target.luns.list();
    targets
        .iter()
        .map(|naa| {
            luns.iter()
                .filter_map(|l| ctx.target.luns.open(l.lun).map(|d| (l.lun, d)))
                .find(|(_, d)| naa_designator(&d.id()).as_slice() == naa.as_slice())
                .map(|(lun, _)| lun)
                .ok_or_else(unreachable)
        })
        .collect()
}

/// EXTENDED COPY (LID1).
pub fn extended_copy(ctx: &Ctx, len: u32) -> Response {
    let p = param_list(ctx, len);
    if p.is_empty() {
        return Response::good(Vec::new());
    }
    let list = match parse(p) {
        Ok(l) => l,
        Err(s) => return s.into(),
    };
    let result = run(ctx, &list);
    if list.usage == 0 || list.usage == 1 {
        let rec = match &result {
            Ok(bytes) => CopyResult {
                ok: true,
                segments: list.segments.len() as u16,
                bytes: *bytes,
            },
            Err(_) => CopyResult {
                ok: false,
                segments: 0,
                bytes: 0,
            },
        };
        ctx.with_state(|st| {
            st.copies
                .insert((ctx.nexus.port.clone(), list.list_id), rec)
        });
    }
    match result {
        Ok(_) => Response::good(Vec::new()),
        Err(s) => s.into(),
    }
}

fn run(ctx: &Ctx, list: &CopyList) -> Result<u64, Sense> {
    let luns = resolve_targets(ctx, &list.targets)?;
    let mut plan = Vec::with_capacity(list.segments.len());
    for s in &list.segments {
        let (Some(&src), Some(&dst)) = (luns.get(s.src as usize), luns.get(s.dst as usize)) else {
            return Err(unreachable());
        };
        for (lun, lba) in [(src, s.src_lba), (dst, s.dst_lba)] {
            let dev = ctx.target.luns.open(lun).ok_or_else(unreachable)?;
            let end = lba.checked_add(s.blocks as u64).ok_or_else(out_of_range)?;
            if end > dev.size() / BLOCK_SIZE {
                return Err(out_of_range());
            }
            if lun == dst && dev.read_only() {
                return Err(Sense::write_protected());
            }
        }
        plan.push((src, dst, s));
    }
    let mut bytes = 0u64;
    for (src, dst, s) in plan.into_iter().filter(|(_, _, s)| s.blocks > 0) {
        let len = s.blocks as u64 * BLOCK_SIZE;
        ctx.target
            .luns
            .copy_range(
                src,
                s.src_lba * BLOCK_SIZE,
                dst,
                s.dst_lba * BLOCK_SIZE,
                len,
            )
            .map_err(|e| copy_error(&e))?;
        bytes += len;
    }
    Ok(bytes)
}

fn copy_error(e: &crate::backend::LunError) -> Sense {
    let s = lun_error_sense(e);
    if s == Sense::no_space() {
        return s;
    }
    Sense {
        key: KEY_COPY_ABORTED,
        ..s
    }
}

/// RECEIVE COPY RESULTS.
pub fn receive_copy_results(ctx: &Ctx, sa: u8, list_id: u8, alloc: u32) -> Response {
    match sa {
        RCR_COPY_STATUS => copy_status(ctx, list_id, alloc),
        RCR_OPERATING_PARAMETERS => Response::good(alloc_trunc(operating_parameters(), alloc)),
        _ => Sense::invalid_cdb(1).into(),
    }
}

fn copy_status(ctx: &Ctx, list_id: u8, alloc: u32) -> Response {
    let Some(r) = ctx.with_state(|st| st.copies.get(&(ctx.nexus.port.clone(), list_id)).copied())
    else {
        return Sense::invalid_cdb(2).into();
    };
    let mut d = vec![0u8; 12];
    d[0..4].copy_from_slice(&8u32.to_be_bytes());
    d[4] = if r.ok { 0x01 } else { 0x02 };
    d[5..7].copy_from_slice(&r.segments.to_be_bytes());
    let (units, count) = if r.bytes <= u32::MAX as u64 {
        (0x00, r.bytes)
    } else {
        (0xf2, r.bytes >> 20)
    };
    d[7] = units;
    d[8..12].copy_from_slice(&(count.min(u32::MAX as u64) as u32).to_be_bytes());
    Response::good(alloc_trunc(d, alloc))
}

/// Operating parameters (SPC-4 6.18.4); agrees with [`parse`]'s limits.
pub fn operating_parameters() -> Vec<u8> {
    let mut d = vec![0u8; 44];
    d[4] = 0x01; // SNLID: list identifiers are optional
    d[8..10].copy_from_slice(&MAX_TARGET_DESCS.to_be_bytes());
    d[10..12].copy_from_slice(&MAX_SEGMENT_DESCS.to_be_bytes());
    d[12..16].copy_from_slice(&MAX_DESC_LIST_LEN.to_be_bytes());
    d[16..20].copy_from_slice(&MAX_SEGMENT_BYTES.to_be_bytes());
    d[34..36].copy_from_slice(&1u16.to_be_bytes());
    d[36] = 1;
    d[37] = 9; // data segment granularity 2^9 = one block
    d.push(SD_B2B);
    d.push(TD_IDENT);
    d[43] = 2;
    let n = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&n.to_be_bytes());
    d
}

/// Third-party Copy VPD page body (8Fh): the Supported Commands descriptor.
pub fn third_party_copy_vpd() -> Vec<u8> {
    let cmds: [(u8, &[u8]); 2] = [
        (0x83, &[0x00]),
        (0x84, &[RCR_COPY_STATUS, RCR_OPERATING_PARAMETERS]),
    ];
    let mut list = Vec::new();
    for (op, sas) in cmds {
        list.push(op);
        list.push(sas.len() as u8);
        list.extend_from_slice(sas);
    }
    let mut body = vec![list.len() as u8];
    body.extend_from_slice(&list);
    body.resize(crate::pdu::pad4(body.len()), 0);
    let mut d = 0x0001u16.to_be_bytes().to_vec();
    d.extend_from_slice(&(body.len() as u16).to_be_bytes());
    d.extend_from_slice(&body);
    d
}
