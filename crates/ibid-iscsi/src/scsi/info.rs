//! Informational commands: INQUIRY and VPD pages, READ CAPACITY, MODE
//! SENSE/SELECT, REPORT LUNS, REQUEST SENSE, REPORT SUPPORTED OPERATION
//! CODES, REPORT TARGET PORT GROUPS.

use super::cdb::{self, Op};
use super::{
    alloc_trunc, naa_designator, Ctx, Nexus, Response, Target, BLOCK_SIZE, GRANULARITY_BLOCKS,
    LBPPB_EXPONENT, MAX_CAW_BLOCKS, MAX_TRANSFER_BLOCKS, MAX_UNMAP_BLOCKS, MAX_UNMAP_DESCRIPTORS,
    MAX_WRITE_SAME_BLOCKS,
};
use crate::pdu::lun_to_wire;
use crate::sense::{Sense, KEY_ILLEGAL_REQUEST};

/// Standard INQUIRY data length we return.
const STD_INQUIRY_LEN: usize = 96;
/// VPD pages we support, in ascending order (page 00h lists them).
pub const VPD_PAGES: [u8; 8] = [0x00, 0x80, 0x83, 0x86, 0x8f, 0xb0, 0xb1, 0xb2];
/// Version descriptors: SAM-5, iSCSI, SPC-4, SBC-3.
const VERSION_DESCRIPTORS: [u16; 4] = [0x00a0, 0x0960, 0x0460, 0x04c0];
/// Relative target port identifier of our one port.
const REL_TGT_PORT: u16 = 1;
/// Target port group of our one port.
const TPG_ID: u16 = 1;

/// INQUIRY for a LUN that does not exist: peripheral qualifier 3.
pub fn inquiry_no_lun(op: &Op) -> Response {
    let Op::Inquiry { evpd, alloc, .. } = *op else {
        return Sense::invalid_opcode().into();
    };
    if evpd {
        return Sense::lun_not_supported().into();
    }
    let mut d = vec![0u8; 36];
    d[0] = 0x7f;
    d[2] = 0x06;
    d[3] = 0x12;
    d[4] = 31;
    Response::good(alloc_trunc(d, alloc))
}

/// INQUIRY.
pub fn inquiry(ctx: &Ctx, evpd: bool, page: u8, alloc: u32) -> Response {
    if !evpd {
        if page != 0 {
            return Sense::invalid_cdb(2).into();
        }
        return Response::good(alloc_trunc(standard_inquiry(ctx), alloc));
    }
    let body = match page {
        0x00 => VPD_PAGES.to_vec(),
        0x80 => serial(ctx).into_bytes(),
        0x83 => device_id(ctx),
        0x86 => extended_inquiry(),
        0x8f => super::xcopy::third_party_copy_vpd(),
        0xb0 => block_limits(),
        0xb1 => block_characteristics(),
        0xb2 => provisioning(),
        _ => return Sense::invalid_cdb(2).into(),
    };
    let mut d = vec![0u8, page];
    d.extend_from_slice(&(body.len() as u16).to_be_bytes());
    d.extend_from_slice(&body);
    Response::good(alloc_trunc(d, alloc))
}

fn padded(s: &str, n: usize) -> Vec<u8> {
    let mut v: Vec<u8> = s
        .bytes()
        .filter(|b| b.is_ascii_graphic() || *b == b' ')
        .take(n)
        .collect();
    v.resize(n, b' ');
    v
}

fn standard_inquiry(ctx: &Ctx) -> Vec<u8> {
    let mut d = vec![0u8; STD_INQUIRY_LEN];
    d[2] = 0x06; // SPC-4
    d[3] = 0x12; // HISUP, response data format 2
    d[4] = (STD_INQUIRY_LEN - 5) as u8;
    d[5] = 0x10 | 0x08; // TPGS = implicit ALUA, 3PC
    d[7] = 0x02; // CMDQUE
    d[8..16].copy_from_slice(&padded(&ctx.target.cfg.vendor, 8));
    d[16..32].copy_from_slice(&padded(&ctx.target.cfg.product, 16));
    d[32..36].copy_from_slice(&padded(env!("CARGO_PKG_VERSION"), 4));
    for (i, v) in VERSION_DESCRIPTORS.iter().enumerate() {
        d[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
    }
    d
}

/// Unit serial number: hex of the LUN's stable id.
fn serial(ctx: &Ctx) -> String {
    crate::login::hex(&ctx.dev.id())
}

fn designator(out: &mut Vec<u8>, proto_codeset: u8, piv_assoc_type: u8, value: &[u8]) {
    out.extend_from_slice(&[proto_codeset, piv_assoc_type, 0, value.len() as u8]);
    out.extend_from_slice(value);
}

fn device_id(ctx: &Ctx) -> Vec<u8> {
    let mut d = Vec::new();
    designator(&mut d, 0x01, 0x03, &naa_designator(&ctx.dev.id()));
    let mut t10 = padded(&ctx.target.cfg.vendor, 8);
    t10.extend_from_slice(serial(ctx).as_bytes());
    designator(&mut d, 0x02, 0x01, &t10);
    designator(&mut d, 0x51, 0x94, &[0, 0, 0, REL_TGT_PORT as u8]);
    designator(&mut d, 0x51, 0x95, &[0, 0, 0, TPG_ID as u8]);
    let mut name = ctx.target.cfg.target_name.clone().into_bytes();
    name.push(0);
    name.resize(crate::pdu::pad4(name.len()), 0);
    designator(&mut d, 0x53, 0xa8, &name);
    d
}

fn extended_inquiry() -> Vec<u8> {
    let mut d = vec![0u8; 0x3c];
    d[1] = 0x01; // SIMPSUP
    d[2] = 0x01; // V_SUP: a volatile write cache exists (SYNCHRONIZE CACHE flushes it)
    d
}

/// Block Limits VPD body (B0h). Every field matches what the handlers enforce.
fn block_limits() -> Vec<u8> {
    let mut d = vec![0u8; 0x3c];
    d[1] = MAX_CAW_BLOCKS;
    d[2..4].copy_from_slice(&(GRANULARITY_BLOCKS as u16).to_be_bytes());
    d[4..8].copy_from_slice(&MAX_TRANSFER_BLOCKS.to_be_bytes());
    d[8..12].copy_from_slice(&2048u32.to_be_bytes());
    d[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
    d[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
    d[24..28].copy_from_slice(&GRANULARITY_BLOCKS.to_be_bytes());
    d[28..32].copy_from_slice(&0x8000_0000u32.to_be_bytes()); // UGAVALID, alignment 0
    d[32..40].copy_from_slice(&MAX_WRITE_SAME_BLOCKS.to_be_bytes());
    d
}

fn block_characteristics() -> Vec<u8> {
    let mut d = vec![0u8; 0x3c];
    d[1] = 0x01; // non-rotating medium
    d
}

/// Logical Block Provisioning VPD body (B2h): thin, UNMAP and WRITE SAME
/// (10 and 16) with UNMAP, deallocated blocks read zero.
fn provisioning() -> Vec<u8> {
    vec![0x00, 0x80 | 0x40 | 0x20 | 0x04, 0x02, 0x00]
}

/// READ CAPACITY(10).
pub fn read_capacity10(ctx: &Ctx, lba: u32, pmi: bool) -> Response {
    if !pmi && lba != 0 {
        return Sense::invalid_cdb(2).into();
    }
    let last = (ctx.blocks().saturating_sub(1)).min(u32::MAX as u64) as u32;
    let mut d = last.to_be_bytes().to_vec();
    d.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
    Response::good(d)
}

/// READ CAPACITY(16): 512e, LBPME and LBPRZ set.
pub fn read_capacity16(ctx: &Ctx, alloc: u32) -> Response {
    let mut d = vec![0u8; 32];
    d[0..8].copy_from_slice(&ctx.blocks().saturating_sub(1).to_be_bytes());
    d[8..12].copy_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
    d[13] = LBPPB_EXPONENT;
    d[14] = 0x80 | 0x40;
    Response::good(alloc_trunc(d, alloc))
}

/// Mode page codes we implement, with their bodies (current values).
fn mode_page(page: u8, pc: u8) -> Option<Vec<u8>> {
    let changeable = pc == 1;
    let mut p = match page {
        0x01 => vec![0x01, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        0x08 => {
            let mut v = vec![0u8; 0x14];
            v[0] = 0x08;
            v[1] = 0x12;
            v[2] = 0x04; // WCE: a volatile write cache, flushed by SYNCHRONIZE CACHE
            v
        }
        0x0a => {
            let mut v = vec![0x0a, 0x0a, 0x02, 0x10, 0, 0, 0, 0, 0xff, 0xff, 0, 0];
            v[5] = 0x40; // TAS: aborted tasks of other nexuses get TASK ABORTED
            v
        }
        0x1c => vec![0x1c, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        _ => return None,
    };
    if changeable {
        p[2..].fill(0);
    }
    Some(p)
}

/// MODE SENSE(6) and (10).
pub fn mode_sense(ctx: &Ctx, op: &Op) -> Response {
    let Op::ModeSense {
        ten,
        dbd,
        llbaa,
        pc,
        page,
        subpage,
        alloc,
    } = *op
    else {
        return Sense::invalid_opcode().into();
    };
    if pc == 3 {
        return Sense::new(KEY_ILLEGAL_REQUEST, 0x39, 0x00).into();
    }
    if subpage != 0 && subpage != 0xff {
        return Sense::invalid_cdb(3).into();
    }
    let pages: Vec<u8> = if page == 0x3f {
        [0x01u8, 0x08, 0x0a, 0x1c]
            .iter()
            .filter_map(|&p| mode_page(p, pc))
            .flatten()
            .collect()
    } else {
        match mode_page(page, pc) {
            Some(p) => p,
            None => return Sense::invalid_cdb(2).into(),
        }
    };
    let dev_specific = 0x10 | if ctx.dev.read_only() { 0x80 } else { 0 };
    let bd = if dbd {
        Vec::new()
    } else {
        block_descriptor(ctx.blocks(), llbaa)
    };
    let mut d = if ten {
        let mut h = vec![0u8; 8];
        h[3] = dev_specific;
        h[4] = if llbaa && !dbd { 1 } else { 0 };
        h[6..8].copy_from_slice(&(bd.len() as u16).to_be_bytes());
        h
    } else {
        vec![0, 0, dev_specific, bd.len() as u8]
    };
    d.extend_from_slice(&bd);
    d.extend_from_slice(&pages);
    if ten {
        let n = (d.len() - 2) as u16;
        d[0..2].copy_from_slice(&n.to_be_bytes());
    } else {
        d[0] = (d.len() - 1).min(255) as u8;
    }
    Response::good(alloc_trunc(d, alloc))
}

fn block_descriptor(blocks: u64, long: bool) -> Vec<u8> {
    if long {
        let mut v = blocks.to_be_bytes().to_vec();
        v.extend_from_slice(&[0, 0, 0, 0]);
        v.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
        return v;
    }
    let n = blocks.min(0xff_ffff) as u32;
    let mut v = n.to_be_bytes().to_vec();
    v[0] = 0; // density code
    v.extend_from_slice(&(BLOCK_SIZE as u32).to_be_bytes());
    v[4] = 0;
    v
}

/// MODE SELECT: nothing is changeable (the changeable-values masks are all
/// zero), so a parameter list is accepted only if it restates the current
/// values; any change is INVALID FIELD IN PARAMETER LIST.
pub fn mode_select(ctx: &Ctx, ten: bool, pf: bool, sp: bool, len: u32) -> Response {
    if sp {
        return Sense::invalid_cdb(1).into();
    }
    if len > 0 && !pf {
        return Sense::invalid_cdb(1).into();
    }
    match check_mode_select(super::param_list(ctx, len), ten) {
        Ok(()) => Response::good(Vec::new()),
        Err(s) => s.into(),
    }
}

/// Validate a MODE SELECT parameter list against the current values. Pure.
pub fn check_mode_select(p: &[u8], ten: bool) -> Result<(), Sense> {
    if p.is_empty() {
        return Ok(());
    }
    let (hdr, bd_len) = match (ten, p.len()) {
        (false, n) if n >= 4 => (4, p[3] as usize),
        (true, n) if n >= 8 => (8, u16::from_be_bytes([p[6], p[7]]) as usize),
        _ => return Err(Sense::param_list_length()),
    };
    let pages_at = hdr + bd_len;
    if pages_at > p.len() {
        return Err(Sense::param_list_length());
    }
    for d in p[hdr..pages_at].chunks(if bd_len == 16 { 16 } else { 8 }) {
        // Only the current block length (or none) may be given.
        let bl = &d[d.len().saturating_sub(3)..];
        if d.len() < 8 || (bl != [0, 0, 0] && bl != [0, 2, 0]) {
            return Err(Sense::invalid_param(hdr as u16));
        }
    }
    check_pages(&p[pages_at..], pages_at)
}

fn check_pages(mut p: &[u8], mut at: usize) -> Result<(), Sense> {
    while !p.is_empty() {
        let spf = p[0] & 0x40 != 0;
        let (head, body_len) = match (spf, p.len()) {
            (false, n) if n >= 2 => (2, p[1] as usize),
            (true, n) if n >= 4 => (4, u16::from_be_bytes([p[2], p[3]]) as usize),
            _ => return Err(Sense::param_list_length()),
        };
        let Some(page) = p.get(..head + body_len) else {
            return Err(Sense::param_list_length());
        };
        let current = if spf { None } else { mode_page(p[0] & 0x3f, 0) };
        match current {
            Some(cur) if cur.len() == page.len() && cur[2..] == page[2..] => {}
            _ => return Err(Sense::invalid_param(at as u16)),
        }
        at += page.len();
        p = &p[page.len()..];
    }
    Ok(())
}

/// REPORT LUNS.
pub fn report_luns(target: &Target, select: u8, alloc: u32) -> Response {
    if select > 2 && !(0x10..=0x12).contains(&select) {
        return Sense::invalid_cdb(2).into();
    }
    if alloc < 16 {
        return Sense::invalid_cdb(6).into();
    }
    // 01h: well-known LUs; 10h/12h: administrative/subsidiary LUs: none here.
    let mut luns = if matches!(select, 0x01 | 0x10 | 0x12) {
        Vec::new()
    } else {
        target.luns.list()
    };
    luns.sort_by_key(|l| l.lun);
    let mut d = vec![0u8; 8];
    d[0..4].copy_from_slice(&((luns.len() * 8) as u32).to_be_bytes());
    for l in luns {
        d.extend_from_slice(&lun_to_wire(l.lun).to_be_bytes());
    }
    Response::good(alloc_trunc(d, alloc))
}

/// REQUEST SENSE: report (and clear) a pending unit attention, else NO SENSE.
pub fn request_sense(target: &Target, nexus: &Nexus, lun: u64, desc: bool, alloc: u32) -> Response {
    let pending = target.with_state(lun, |st| {
        st.ua.get_mut(&nexus.port).and_then(|q| q.pop_front())
    });
    let s = pending.unwrap_or(Sense::new(0, 0, 0));
    let d = if desc {
        vec![0x72, s.key, s.asc, s.ascq, 0, 0, 0, 0]
    } else {
        s.fixed().to_vec()
    };
    Response::good(alloc_trunc(d, alloc))
}

/// One supported command for REPORT SUPPORTED OPERATION CODES.
struct Supported {
    opcode: u8,
    sa: Option<u16>,
}

const fn op(opcode: u8) -> Supported {
    Supported { opcode, sa: None }
}
const fn sa(opcode: u8, sa: u16) -> Supported {
    Supported {
        opcode,
        sa: Some(sa),
    }
}

/// Every command we execute.
const SUPPORTED: &[Supported] = &[
    op(cdb::TEST_UNIT_READY),
    op(cdb::REQUEST_SENSE),
    op(cdb::READ6),
    op(cdb::WRITE6),
    op(cdb::INQUIRY),
    op(cdb::MODE_SELECT6),
    op(cdb::RESERVE6),
    op(cdb::RELEASE6),
    op(cdb::MODE_SENSE6),
    op(cdb::START_STOP_UNIT),
    op(cdb::PREVENT_ALLOW),
    op(cdb::READ_CAPACITY10),
    op(cdb::READ10),
    op(cdb::WRITE10),
    op(cdb::WRITE_VERIFY10),
    op(cdb::VERIFY10),
    op(cdb::PREFETCH10),
    op(cdb::SYNC_CACHE10),
    op(cdb::WRITE_SAME10),
    op(cdb::UNMAP),
    op(cdb::MODE_SELECT10),
    op(cdb::RESERVE10),
    op(cdb::RELEASE10),
    op(cdb::MODE_SENSE10),
    sa(cdb::PR_IN, 0),
    sa(cdb::PR_IN, 1),
    sa(cdb::PR_IN, 2),
    sa(cdb::PR_IN, 3),
    sa(cdb::PR_OUT, 0),
    sa(cdb::PR_OUT, 1),
    sa(cdb::PR_OUT, 2),
    sa(cdb::PR_OUT, 3),
    sa(cdb::PR_OUT, 4),
    sa(cdb::PR_OUT, 5),
    sa(cdb::PR_OUT, 6),
    sa(cdb::EXTENDED_COPY, 0),
    sa(cdb::RECEIVE_COPY_RESULTS, 0),
    sa(cdb::RECEIVE_COPY_RESULTS, 3),
    op(cdb::READ16),
    op(cdb::COMPARE_AND_WRITE),
    op(cdb::WRITE16),
    op(cdb::WRITE_VERIFY16),
    op(cdb::VERIFY16),
    op(cdb::PREFETCH16),
    op(cdb::SYNC_CACHE16),
    op(cdb::WRITE_SAME16),
    sa(cdb::SERVICE_ACTION_IN16, cdb::SA_READ_CAPACITY16 as u16),
    sa(cdb::SERVICE_ACTION_IN16, cdb::SA_GET_LBA_STATUS as u16),
    op(cdb::REPORT_LUNS),
    sa(cdb::MAINTENANCE_IN, cdb::SA_REPORT_TPG as u16),
    sa(cdb::MAINTENANCE_IN, cdb::SA_REPORT_OPCODES as u16),
    op(cdb::READ12),
    op(cdb::WRITE12),
    op(cdb::WRITE_VERIFY12),
    op(cdb::VERIFY12),
];

/// Command timeouts descriptor (SPC-4 6.35.4): none reported.
fn timeouts() -> [u8; 12] {
    [0, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
}

/// CDB usage map: opcode, then every bit of every other byte "may be used".
fn usage(s: &Supported) -> Vec<u8> {
    let n = cdb::cdb_len(s.opcode);
    let mut u = vec![0xffu8; n];
    u[0] = s.opcode;
    if let Some(sa) = s.sa {
        u[1] = 0xe0 | sa as u8;
    }
    u[n - 1] = 0x00;
    u
}

/// REPORT SUPPORTED OPERATION CODES.
pub fn report_opcodes(options: u8, rctd: bool, opcode: u8, sa_req: u16, alloc: u32) -> Response {
    let d = match options {
        0 => all_opcodes(rctd),
        1 | 2 => {
            let has_sa = SUPPORTED
                .iter()
                .any(|s| s.opcode == opcode && s.sa.is_some());
            if (options == 1 && has_sa)
                || (options == 2 && !has_sa && SUPPORTED.iter().any(|s| s.opcode == opcode))
            {
                return Sense::invalid_cdb(2).into();
            }
            let found = SUPPORTED
                .iter()
                .find(|s| s.opcode == opcode && (options == 1 || s.sa == Some(sa_req)));
            one_opcode(found, rctd)
        }
        _ => return Sense::invalid_cdb(2).into(),
    };
    Response::good(alloc_trunc(d, alloc))
}

fn all_opcodes(rctd: bool) -> Vec<u8> {
    let mut d = vec![0u8; 4];
    for s in SUPPORTED {
        d.push(s.opcode);
        d.push(0);
        d.extend_from_slice(&s.sa.unwrap_or(0).to_be_bytes());
        d.push(0);
        d.push(if s.sa.is_some() { 0x01 } else { 0 } | if rctd { 0x02 } else { 0 });
        d.extend_from_slice(&(cdb::cdb_len(s.opcode) as u16).to_be_bytes());
        if rctd {
            d.extend_from_slice(&timeouts());
        }
    }
    let n = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&n.to_be_bytes());
    d
}

fn one_opcode(found: Option<&Supported>, rctd: bool) -> Vec<u8> {
    let Some(s) = found else {
        return vec![0, 0x01, 0, 0];
    };
    let u = usage(s);
    let mut d = vec![0, 0x03 | if rctd { 0x80 } else { 0 }];
    d.extend_from_slice(&(u.len() as u16).to_be_bytes());
    d.extend_from_slice(&u);
    if rctd {
        d.extend_from_slice(&timeouts());
    }
    d
}

/// REPORT TARGET PORT GROUPS: one group, active/optimized, one port.
pub fn report_tpg(alloc: u32) -> Response {
    let mut d = vec![0u8; 4];
    d.extend_from_slice(&[0x80, 0x01]);
    d.extend_from_slice(&TPG_ID.to_be_bytes());
    d.extend_from_slice(&[0, 0, 0, 1]);
    d.extend_from_slice(&[0, 0]);
    d.extend_from_slice(&REL_TGT_PORT.to_be_bytes());
    let n = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&n.to_be_bytes());
    Response::good(alloc_trunc(d, alloc))
}
