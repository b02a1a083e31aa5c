//! Block commands (SBC-3): READ, WRITE, VERIFY, WRITE AND VERIFY, PRE-FETCH,
//! SYNCHRONIZE CACHE, WRITE SAME, UNMAP, COMPARE AND WRITE, GET LBA STATUS.

use super::cdb::{Op, Rw};
use super::{
    expect_out, lun_error_sense, param_list, Ctx, Response, BLOCK_SIZE, MAX_CAW_BLOCKS,
    MAX_TRANSFER_BLOCKS, MAX_UNMAP_BLOCKS, MAX_UNMAP_DESCRIPTORS, MAX_WRITE_SAME_BLOCKS,
};
use crate::sense::Sense;
use std::sync::Arc;

/// UNMAP parameter list header length.
const UNMAP_HEADER_LEN: usize = 8;
/// UNMAP block descriptor length.
const UNMAP_DESCRIPTOR_LEN: usize = 16;
/// GET LBA STATUS header length.
const LBA_STATUS_HEADER_LEN: usize = 8;
/// GET LBA STATUS descriptor length.
const LBA_STATUS_DESCRIPTOR_LEN: usize = 16;
/// Largest range one GET LBA STATUS looks at, in blocks.
const LBA_STATUS_SPAN_BLOCKS: u64 = 1 << 21;
/// Buffer size for writing a WRITE SAME pattern, in bytes.
const WRITE_SAME_CHUNK: usize = 1 << 20;

/// Execute a block command.
pub fn dispatch(ctx: &Ctx, op: Op) -> Response {
    let r = match op {
        Op::Read(rw) => read(ctx, rw),
        Op::Write(rw) | Op::WriteVerify(rw) => write(ctx, rw),
        Op::Verify(rw) => verify(ctx, rw),
        Op::Prefetch { lba, blocks } => {
            range(ctx, lba, blocks as u64).map(|_| Response::good(Vec::new()))
        }
        Op::SyncCache { lba, blocks } => sync_cache(ctx, lba, blocks),
        Op::WriteSame { .. } => write_same(ctx, &op),
        Op::Unmap { anchor, len } => unmap(ctx, anchor, len),
        Op::CompareAndWrite {
            lba,
            blocks,
            fua,
            protect,
        } => compare_and_write(ctx, lba, blocks, protect, fua),
        Op::GetLbaStatus { lba, alloc } => get_lba_status(ctx, lba, alloc),
        _ => Err(Sense::invalid_opcode()),
    };
    r.unwrap_or_else(Response::check)
}

/// Check that `[lba, lba+blocks)` lies inside the LUN.
fn range(ctx: &Ctx, lba: u64, blocks: u64) -> Result<(), Sense> {
    match lba.checked_add(blocks) {
        Some(end) if end <= ctx.blocks() && lba <= ctx.blocks() => Ok(()),
        _ => Err(Sense::lba_out_of_range()),
    }
}

fn writable(ctx: &Ctx) -> Result<(), Sense> {
    if ctx.dev.read_only() {
        return Err(Sense::write_protected());
    }
    Ok(())
}

fn read(ctx: &Ctx, rw: Rw) -> Result<Response, Sense> {
    if rw.protect != 0 {
        return Err(Sense::invalid_cdb(1));
    }
    if rw.blocks > MAX_TRANSFER_BLOCKS {
        return Err(Sense::invalid_cdb(0));
    }
    range(ctx, rw.lba, rw.blocks as u64)?;
    let mut buf = ctx
        .target
        .buffers
        .take(rw.blocks as usize * BLOCK_SIZE as usize);
    match ctx.dev.read_held(rw.lba * BLOCK_SIZE, &mut buf) {
        Ok(held) => Ok(Response::good_held(buf, held.map(Arc::from))),
        // Partly overwritten: never reused (its old content must not reach another reader).
        Err(e) => Err(lun_error_sense(&e)),
    }
}

fn write(ctx: &Ctx, rw: Rw) -> Result<Response, Sense> {
    let need = rw.blocks as u64 * BLOCK_SIZE;
    let r = write_checked(ctx, rw, need);
    Ok(expect_out(r.unwrap_or_else(Response::check), need))
}

fn write_checked(ctx: &Ctx, rw: Rw, need: u64) -> Result<Response, Sense> {
    if rw.protect != 0 || rw.bytchk > 1 {
        return Err(Sense::invalid_cdb(1));
    }
    if rw.blocks > MAX_TRANSFER_BLOCKS {
        return Err(Sense::invalid_cdb(0));
    }
    range(ctx, rw.lba, rw.blocks as u64)?;
    writable(ctx)?;
    // An iSCSI EDTL that differs from the CDB's length is processed for the
    // shorter of the two (RFC 7143 11.4.5.2 residuals; SAM-5 overflow rule).
    let n = (ctx.data.len() as u64).min(need) as usize;
    write_bytes(ctx, rw.lba * BLOCK_SIZE, &ctx.data[..n], rw.fua)?;
    Ok(Response::good(Vec::new()))
}

/// Write `data` at `off`; a trailing partial block is read, merged and written.
fn write_bytes(ctx: &Ctx, off: u64, data: &[u8], fua: bool) -> Result<(), Sense> {
    let bs = BLOCK_SIZE as usize;
    let full = data.len() / bs * bs;
    if full > 0 {
        ctx.dev
            .write(off, &data[..full], fua)
            .map_err(|e| lun_error_sense(&e))?;
    }
    if full < data.len() {
        let mut block = vec![0u8; bs];
        let at = off + full as u64;
        ctx.dev
            .read(at, &mut block)
            .map_err(|e| lun_error_sense(&e))?;
        block[..data.len() - full].copy_from_slice(&data[full..]);
        ctx.dev
            .write(at, &block, fua)
            .map_err(|e| lun_error_sense(&e))?;
    }
    Ok(())
}

fn verify(ctx: &Ctx, rw: Rw) -> Result<Response, Sense> {
    let need = match rw.bytchk {
        0 => 0,
        1 => rw.blocks as u64 * BLOCK_SIZE,
        3 => BLOCK_SIZE.min(rw.blocks as u64 * BLOCK_SIZE),
        _ => return Err(Sense::invalid_cdb(1)),
    };
    let r = verify_checked(ctx, rw, need);
    Ok(expect_out(r.unwrap_or_else(Response::check), need))
}

fn verify_checked(ctx: &Ctx, rw: Rw, need: u64) -> Result<Response, Sense> {
    if rw.protect != 0 {
        return Err(Sense::invalid_cdb(1));
    }
    if rw.blocks > MAX_TRANSFER_BLOCKS {
        return Err(Sense::invalid_cdb(0));
    }
    range(ctx, rw.lba, rw.blocks as u64)?;
    if rw.bytchk == 0 || rw.blocks == 0 {
        return Ok(Response::good(Vec::new()));
    }
    if ctx.data.len() as u64 != need {
        return Err(Sense::invalid_field_in_iu());
    }
    let mut cur = vec![0u8; rw.blocks as usize * BLOCK_SIZE as usize];
    ctx.dev
        .read(rw.lba * BLOCK_SIZE, &mut cur)
        .map_err(|e| lun_error_sense(&e))?;
    let want = ctx.data.iter().cycle();
    match cur.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => Err(Sense::miscompare(i as u32)),
        None => Ok(Response::good(Vec::new())),
    }
}

fn sync_cache(ctx: &Ctx, lba: u64, blocks: u32) -> Result<Response, Sense> {
    range(ctx, lba, blocks as u64)?;
    ctx.dev.flush().map_err(|e| lun_error_sense(&e))?;
    Ok(Response::good(Vec::new()))
}

fn write_same(ctx: &Ctx, op: &Op) -> Result<Response, Sense> {
    let Op::WriteSame { ndob, .. } = *op else {
        return Err(Sense::invalid_opcode());
    };
    let need = if ndob { 0 } else { BLOCK_SIZE };
    let r = write_same_checked(ctx, op, need);
    Ok(expect_out(r.unwrap_or_else(Response::check), need))
}

fn write_same_checked(ctx: &Ctx, op: &Op, need: u64) -> Result<Response, Sense> {
    let Op::WriteSame {
        lba,
        blocks,
        unmap,
        anchor,
        ndob,
        protect,
        ..
    } = *op
    else {
        return Err(Sense::invalid_opcode());
    };
    if protect != 0 || anchor || (ndob && !unmap) {
        return Err(Sense::invalid_cdb(1));
    }
    let blocks = if blocks == 0 {
        ctx.blocks().saturating_sub(lba)
    } else {
        blocks as u64
    };
    if blocks > MAX_WRITE_SAME_BLOCKS {
        return Err(Sense::invalid_cdb(0));
    }
    range(ctx, lba, blocks)?;
    writable(ctx)?;
    if ctx.data.len() as u64 != need {
        return Err(Sense::invalid_field_in_iu());
    }
    let (off, len) = (lba * BLOCK_SIZE, blocks * BLOCK_SIZE);
    // With UNMAP set the blocks are deallocated whatever the pattern: LBPRZ
    // then makes them read as zeros (SBC-3 4.7.3.4).
    if ndob || unmap || ctx.data.iter().all(|&b| b == 0) {
        ctx.dev
            .write_zeroes(off, len)
            .map_err(|e| lun_error_sense(&e))?;
    } else {
        write_pattern(ctx, off, len)?;
    }
    Ok(Response::good(Vec::new()))
}

/// Write the one-block pattern in `ctx.data` over `[off, off+len)`.
fn write_pattern(ctx: &Ctx, off: u64, len: u64) -> Result<(), Sense> {
    let chunk_len = (len as usize).min(WRITE_SAME_CHUNK);
    let buf: Vec<u8> = ctx.data.iter().cycle().take(chunk_len).copied().collect();
    let mut pos = 0u64;
    while pos < len {
        let n = (len - pos).min(buf.len() as u64) as usize;
        ctx.dev
            .write(off + pos, &buf[..n], false)
            .map_err(|e| lun_error_sense(&e))?;
        pos += n as u64;
    }
    Ok(())
}

/// One UNMAP block descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnmapDescriptor {
    /// First block.
    pub lba: u64,
    /// Number of blocks.
    pub blocks: u32,
}

/// Parse an UNMAP parameter list (SBC-3 5.28.2). Pure.
pub fn parse_unmap(p: &[u8]) -> Result<Vec<UnmapDescriptor>, Sense> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    if p.len() < UNMAP_HEADER_LEN {
        return Err(Sense::param_list_length());
    }
    let desc_len = u16::from_be_bytes([p[2], p[3]]) as usize;
    let avail = (p.len() - UNMAP_HEADER_LEN).min(desc_len);
    let n = avail / UNMAP_DESCRIPTOR_LEN;
    if n as u32 > MAX_UNMAP_DESCRIPTORS {
        return Err(Sense::invalid_param(2));
    }
    let descs = (0..n)
        .map(|i| {
            let d = &p[UNMAP_HEADER_LEN + i * UNMAP_DESCRIPTOR_LEN..][..UNMAP_DESCRIPTOR_LEN];
            UnmapDescriptor {
                lba: u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]),
                blocks: u32::from_be_bytes([d[8], d[9], d[10], d[11]]),
            }
        })
        .collect();
    Ok(descs)
}

fn unmap(ctx: &Ctx, anchor: bool, len: u32) -> Result<Response, Sense> {
    if anchor {
        return Err(Sense::invalid_cdb(1));
    }
    writable(ctx)?;
    let descs = parse_unmap(param_list(ctx, len))?;
    for d in &descs {
        if d.blocks > MAX_UNMAP_BLOCKS {
            return Err(Sense::invalid_param(UNMAP_HEADER_LEN as u16 + 8));
        }
        range(ctx, d.lba, d.blocks as u64)?;
    }
    for d in descs.iter().filter(|d| d.blocks > 0) {
        ctx.dev
            .write_zeroes(d.lba * BLOCK_SIZE, d.blocks as u64 * BLOCK_SIZE)
            .map_err(|e| lun_error_sense(&e))?;
    }
    Ok(Response::good(Vec::new()))
}

fn compare_and_write(
    ctx: &Ctx,
    lba: u64,
    blocks: u8,
    protect: u8,
    fua: bool,
) -> Result<Response, Sense> {
    let need = 2 * blocks as u64 * BLOCK_SIZE;
    let r = caw_checked(ctx, lba, blocks, protect, need).and_then(|r| {
        // The backend call has no FUA: make the written blocks durable here.
        if fua && r.status == 0 {
            ctx.dev.flush().map_err(|e| lun_error_sense(&e))?;
        }
        Ok(r)
    });
    Ok(expect_out(r.unwrap_or_else(Response::check), need))
}

fn caw_checked(ctx: &Ctx, lba: u64, blocks: u8, protect: u8, need: u64) -> Result<Response, Sense> {
    if protect != 0 {
        return Err(Sense::invalid_cdb(1));
    }
    if blocks > MAX_CAW_BLOCKS {
        return Err(Sense::invalid_cdb(13));
    }
    range(ctx, lba, blocks as u64)?;
    writable(ctx)?;
    if ctx.data.len() as u64 != need {
        // Also catches 256+ blocks sent with a wrapped 8-bit count.
        return Err(Sense::invalid_cdb(13));
    }
    if blocks == 0 {
        return Ok(Response::good(Vec::new()));
    }
    let (expected, new) = ctx.data.split_at(ctx.data.len() / 2);
    match ctx.dev.compare_and_write(lba * BLOCK_SIZE, expected, new) {
        Ok(None) => Ok(Response::good(Vec::new())),
        Ok(Some(off)) => Err(Sense::miscompare(off as u32)),
        Err(e) => Err(lun_error_sense(&e)),
    }
}

fn get_lba_status(ctx: &Ctx, lba: u64, alloc: u32) -> Result<Response, Sense> {
    if lba >= ctx.blocks() {
        return Err(Sense::lba_out_of_range());
    }
    let max_desc =
        (alloc as usize).saturating_sub(LBA_STATUS_HEADER_LEN) / LBA_STATUS_DESCRIPTOR_LEN;
    let span = (ctx.blocks() - lba).min(LBA_STATUS_SPAN_BLOCKS);
    let extents = ctx
        .dev
        .block_status(lba * BLOCK_SIZE, span * BLOCK_SIZE)
        .map_err(|e| lun_error_sense(&e))?;
    let mut out = vec![0u8; LBA_STATUS_HEADER_LEN];
    for e in extents.iter().take(max_desc.max(1)) {
        let start = e.off / BLOCK_SIZE;
        let n = (e.len / BLOCK_SIZE).min(u32::MAX as u64) as u32;
        out.extend_from_slice(&start.to_be_bytes());
        out.extend_from_slice(&n.to_be_bytes());
        out.push(if e.mapped { 0 } else { 1 });
        out.extend_from_slice(&[0, 0, 0]);
    }
    let len = (out.len() - 4) as u32;
    out[0..4].copy_from_slice(&len.to_be_bytes());
    Ok(Response::good(super::alloc_trunc(out, alloc)))
}
