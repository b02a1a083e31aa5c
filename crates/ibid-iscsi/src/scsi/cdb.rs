//! CDB parsing (SPC-4 / SBC-3): bytes in, a typed [`Op`] or precise sense out.
//! Pure and total: every input yields a value, never a panic (fuzzed).

use crate::sense::Sense;

/// TEST UNIT READY.
pub const TEST_UNIT_READY: u8 = 0x00;
/// REQUEST SENSE.
pub const REQUEST_SENSE: u8 = 0x03;
/// READ(6).
pub const READ6: u8 = 0x08;
/// WRITE(6).
pub const WRITE6: u8 = 0x0a;
/// INQUIRY.
pub const INQUIRY: u8 = 0x12;
/// MODE SELECT(6).
pub const MODE_SELECT6: u8 = 0x15;
/// RESERVE(6).
pub const RESERVE6: u8 = 0x16;
/// RELEASE(6).
pub const RELEASE6: u8 = 0x17;
/// MODE SENSE(6).
pub const MODE_SENSE6: u8 = 0x1a;
/// START STOP UNIT.
pub const START_STOP_UNIT: u8 = 0x1b;
/// PREVENT ALLOW MEDIUM REMOVAL.
pub const PREVENT_ALLOW: u8 = 0x1e;
/// READ CAPACITY(10).
pub const READ_CAPACITY10: u8 = 0x25;
/// READ(10).
pub const READ10: u8 = 0x28;
/// WRITE(10).
pub const WRITE10: u8 = 0x2a;
/// WRITE AND VERIFY(10).
pub const WRITE_VERIFY10: u8 = 0x2e;
/// VERIFY(10).
pub const VERIFY10: u8 = 0x2f;
/// PRE-FETCH(10).
pub const PREFETCH10: u8 = 0x34;
/// SYNCHRONIZE CACHE(10).
pub const SYNC_CACHE10: u8 = 0x35;
/// WRITE SAME(10).
pub const WRITE_SAME10: u8 = 0x41;
/// UNMAP.
pub const UNMAP: u8 = 0x42;
/// MODE SELECT(10).
pub const MODE_SELECT10: u8 = 0x55;
/// RESERVE(10).
pub const RESERVE10: u8 = 0x56;
/// RELEASE(10).
pub const RELEASE10: u8 = 0x57;
/// MODE SENSE(10).
pub const MODE_SENSE10: u8 = 0x5a;
/// PERSISTENT RESERVE IN.
pub const PR_IN: u8 = 0x5e;
/// PERSISTENT RESERVE OUT.
pub const PR_OUT: u8 = 0x5f;
/// EXTENDED COPY (LID1 with service action 00h).
pub const EXTENDED_COPY: u8 = 0x83;
/// RECEIVE COPY RESULTS.
pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
/// READ(16).
pub const READ16: u8 = 0x88;
/// COMPARE AND WRITE.
pub const COMPARE_AND_WRITE: u8 = 0x89;
/// WRITE(16).
pub const WRITE16: u8 = 0x8a;
/// WRITE AND VERIFY(16).
pub const WRITE_VERIFY16: u8 = 0x8e;
/// VERIFY(16).
pub const VERIFY16: u8 = 0x8f;
/// PRE-FETCH(16).
pub const PREFETCH16: u8 = 0x90;
/// SYNCHRONIZE CACHE(16).
pub const SYNC_CACHE16: u8 = 0x91;
/// WRITE SAME(16).
pub const WRITE_SAME16: u8 = 0x93;
/// SERVICE ACTION IN(16): READ CAPACITY(16), GET LBA STATUS.
pub const SERVICE_ACTION_IN16: u8 = 0x9e;
/// REPORT LUNS.
pub const REPORT_LUNS: u8 = 0xa0;
/// MAINTENANCE IN: REPORT TARGET PORT GROUPS, REPORT SUPPORTED OPERATION CODES.
pub const MAINTENANCE_IN: u8 = 0xa3;
/// READ(12).
pub const READ12: u8 = 0xa8;
/// WRITE(12).
pub const WRITE12: u8 = 0xaa;
/// WRITE AND VERIFY(12).
pub const WRITE_VERIFY12: u8 = 0xae;
/// VERIFY(12).
pub const VERIFY12: u8 = 0xaf;

/// SERVICE ACTION IN(16) action: READ CAPACITY(16).
pub const SA_READ_CAPACITY16: u8 = 0x10;
/// SERVICE ACTION IN(16) action: GET LBA STATUS.
pub const SA_GET_LBA_STATUS: u8 = 0x12;
/// MAINTENANCE IN action: REPORT TARGET PORT GROUPS.
pub const SA_REPORT_TPG: u8 = 0x0a;
/// MAINTENANCE IN action: REPORT SUPPORTED OPERATION CODES.
pub const SA_REPORT_OPCODES: u8 = 0x0c;

/// The common fields of a block read/write/verify CDB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rw {
    /// First logical block.
    pub lba: u64,
    /// Number of blocks.
    pub blocks: u32,
    /// Force unit access.
    pub fua: bool,
    /// RDPROTECT/WRPROTECT/VRPROTECT (must be 0: no protection information).
    pub protect: u8,
    /// BYTCHK for VERIFY / WRITE AND VERIFY (0 none, 1 compare).
    pub bytchk: u8,
}

/// A parsed command.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Op {
    TestUnitReady,
    RequestSense {
        desc: bool,
        alloc: u32,
    },
    Inquiry {
        evpd: bool,
        page: u8,
        alloc: u32,
    },
    ModeSense {
        ten: bool,
        dbd: bool,
        llbaa: bool,
        pc: u8,
        page: u8,
        subpage: u8,
        alloc: u32,
    },
    ModeSelect {
        ten: bool,
        pf: bool,
        sp: bool,
        len: u32,
    },
    Reserve,
    Release,
    StartStopUnit {
        immed: bool,
        start: bool,
        loej: bool,
    },
    PreventAllow {
        prevent: u8,
    },
    ReadCapacity10 {
        lba: u32,
        pmi: bool,
    },
    ReadCapacity16 {
        alloc: u32,
    },
    Read(Rw),
    Write(Rw),
    WriteVerify(Rw),
    Verify(Rw),
    Prefetch {
        lba: u64,
        blocks: u32,
    },
    SyncCache {
        lba: u64,
        blocks: u32,
    },
    WriteSame {
        lba: u64,
        blocks: u32,
        unmap: bool,
        anchor: bool,
        ndob: bool,
        sixteen: bool,
        protect: u8,
    },
    Unmap {
        anchor: bool,
        len: u32,
    },
    PrIn {
        sa: u8,
        alloc: u32,
    },
    PrOut {
        sa: u8,
        scope: u8,
        ty: u8,
        len: u32,
    },
    ExtendedCopy {
        len: u32,
    },
    ReceiveCopyResults {
        sa: u8,
        list_id: u8,
        alloc: u32,
    },
    CompareAndWrite {
        lba: u64,
        blocks: u8,
        fua: bool,
        protect: u8,
    },
    GetLbaStatus {
        lba: u64,
        alloc: u32,
    },
    ReportLuns {
        select: u8,
        alloc: u32,
    },
    ReportTargetPortGroups {
        alloc: u32,
    },
    ReportOpcodes {
        options: u8,
        rctd: bool,
        opcode: u8,
        sa: u16,
        alloc: u32,
    },
}

fn b16(c: &[u8], i: usize) -> u32 {
    u16::from_be_bytes([c[i], c[i + 1]]) as u32
}
fn b32(c: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]])
}
fn b64(c: &[u8], i: usize) -> u64 {
    (b32(c, i) as u64) << 32 | b32(c, i + 4) as u64
}

/// Bytes in the CDB of a given opcode (SPC-4 4.2.5.1 group code).
pub fn cdb_len(opcode: u8) -> usize {
    match opcode >> 5 {
        0 => 6,
        1 | 2 => 10,
        4 => 16,
        5 => 12,
        _ => 16,
    }
}

/// Parse `cdb` (any length; missing bytes read as zero).
pub fn parse(cdb: &[u8]) -> Result<Op, Sense> {
    let mut c = [0u8; 16];
    let n = cdb.len().min(16);
    c[..n].copy_from_slice(&cdb[..n]);
    let control = c[cdb_len(c[0]) - 1];
    if control & 0x04 != 0 {
        // NACA is not supported (SAM-5 5.9.1.2).
        return Err(Sense::invalid_cdb(cdb_len(c[0]) as u16 - 1));
    }
    parse_group(&c)
}

fn parse_group(c: &[u8; 16]) -> Result<Op, Sense> {
    match c[0] {
        TEST_UNIT_READY => Ok(Op::TestUnitReady),
        REQUEST_SENSE => Ok(Op::RequestSense {
            desc: c[1] & 1 != 0,
            alloc: c[4] as u32,
        }),
        INQUIRY => Ok(Op::Inquiry {
            evpd: c[1] & 1 != 0,
            page: c[2],
            alloc: b16(c, 3),
        }),
        MODE_SENSE6 => Ok(mode_sense(c, false)),
        MODE_SENSE10 => Ok(mode_sense(c, true)),
        MODE_SELECT6 => Ok(Op::ModeSelect {
            ten: false,
            pf: c[1] & 0x10 != 0,
            sp: c[1] & 1 != 0,
            len: c[4] as u32,
        }),
        MODE_SELECT10 => Ok(Op::ModeSelect {
            ten: true,
            pf: c[1] & 0x10 != 0,
            sp: c[1] & 1 != 0,
            len: b16(c, 7),
        }),
        RESERVE6 | RESERVE10 => Ok(Op::Reserve),
        RELEASE6 | RELEASE10 => Ok(Op::Release),
        START_STOP_UNIT => Ok(Op::StartStopUnit {
            immed: c[1] & 1 != 0,
            start: c[4] & 1 != 0,
            loej: c[4] & 2 != 0,
        }),
        PREVENT_ALLOW => Ok(Op::PreventAllow { prevent: c[4] & 3 }),
        READ_CAPACITY10 => Ok(Op::ReadCapacity10 {
            lba: b32(c, 2),
            pmi: c[8] & 1 != 0,
        }),
        READ6 => Ok(Op::Read(rw6(c))),
        WRITE6 => Ok(Op::Write(rw6(c))),
        READ10 | WRITE10 | WRITE_VERIFY10 | VERIFY10 => {
            Ok(rw_op(c[0], rw(c, b32(c, 2) as u64, b16(c, 7))))
        }
        READ12 | WRITE12 | WRITE_VERIFY12 | VERIFY12 => {
            Ok(rw_op(c[0], rw(c, b32(c, 2) as u64, b32(c, 6))))
        }
        READ16 | WRITE16 | WRITE_VERIFY16 | VERIFY16 => {
            Ok(rw_op(c[0], rw(c, b64(c, 2), b32(c, 10))))
        }
        PREFETCH10 => Ok(Op::Prefetch {
            lba: b32(c, 2) as u64,
            blocks: b16(c, 7),
        }),
        PREFETCH16 => Ok(Op::Prefetch {
            lba: b64(c, 2),
            blocks: b32(c, 10),
        }),
        SYNC_CACHE10 => Ok(Op::SyncCache {
            lba: b32(c, 2) as u64,
            blocks: b16(c, 7),
        }),
        SYNC_CACHE16 => Ok(Op::SyncCache {
            lba: b64(c, 2),
            blocks: b32(c, 10),
        }),
        WRITE_SAME10 => Ok(write_same(c, b32(c, 2) as u64, b16(c, 7), false)),
        WRITE_SAME16 => Ok(write_same(c, b64(c, 2), b32(c, 10), true)),
        UNMAP => Ok(Op::Unmap {
            anchor: c[1] & 1 != 0,
            len: b16(c, 7),
        }),
        PR_IN => Ok(Op::PrIn {
            sa: c[1] & 0x1f,
            alloc: b16(c, 7),
        }),
        PR_OUT => Ok(Op::PrOut {
            sa: c[1] & 0x1f,
            scope: c[2] >> 4,
            ty: c[2] & 0x0f,
            len: b32(c, 5),
        }),
        EXTENDED_COPY if c[1] & 0x1f == 0 => Ok(Op::ExtendedCopy { len: b32(c, 10) }),
        RECEIVE_COPY_RESULTS => Ok(Op::ReceiveCopyResults {
            sa: c[1] & 0x1f,
            list_id: c[2],
            alloc: b32(c, 10),
        }),
        COMPARE_AND_WRITE => Ok(Op::CompareAndWrite {
            lba: b64(c, 2),
            blocks: c[13],
            fua: c[1] & 0x08 != 0,
            protect: c[1] >> 5,
        }),
        SERVICE_ACTION_IN16 => service_action_in(c),
        REPORT_LUNS => Ok(Op::ReportLuns {
            select: c[2],
            alloc: b32(c, 6),
        }),
        MAINTENANCE_IN => maintenance_in(c),
        EXTENDED_COPY => Err(Sense::invalid_cdb(1)),
        _ => Err(Sense::invalid_opcode()),
    }
}

fn mode_sense(c: &[u8; 16], ten: bool) -> Op {
    Op::ModeSense {
        ten,
        dbd: c[1] & 0x08 != 0,
        llbaa: ten && c[1] & 0x10 != 0,
        pc: c[2] >> 6,
        page: c[2] & 0x3f,
        subpage: c[3],
        alloc: if ten { b16(c, 7) } else { c[4] as u32 },
    }
}

fn rw6(c: &[u8; 16]) -> Rw {
    let lba = ((c[1] as u64 & 0x1f) << 16) | (c[2] as u64) << 8 | c[3] as u64;
    let blocks = if c[4] == 0 { 256 } else { c[4] as u32 };
    Rw {
        lba,
        blocks,
        fua: false,
        protect: 0,
        bytchk: 0,
    }
}

fn rw(c: &[u8; 16], lba: u64, blocks: u32) -> Rw {
    Rw {
        lba,
        blocks,
        fua: c[1] & 0x08 != 0,
        protect: c[1] >> 5,
        bytchk: (c[1] >> 1) & 3,
    }
}

fn rw_op(opcode: u8, r: Rw) -> Op {
    match opcode {
        READ10 | READ12 | READ16 => Op::Read(Rw { bytchk: 0, ..r }),
        WRITE10 | WRITE12 | WRITE16 => Op::Write(Rw { bytchk: 0, ..r }),
        WRITE_VERIFY10 | WRITE_VERIFY12 | WRITE_VERIFY16 => Op::WriteVerify(r),
        _ => Op::Verify(r),
    }
}

fn write_same(c: &[u8; 16], lba: u64, blocks: u32, sixteen: bool) -> Op {
    Op::WriteSame {
        lba,
        blocks,
        unmap: c[1] & 0x08 != 0,
        anchor: c[1] & 0x10 != 0,
        ndob: sixteen && c[1] & 0x01 != 0,
        sixteen,
        protect: c[1] >> 5,
    }
}

fn service_action_in(c: &[u8; 16]) -> Result<Op, Sense> {
    match c[1] & 0x1f {
        SA_READ_CAPACITY16 => Ok(Op::ReadCapacity16 { alloc: b32(c, 10) }),
        SA_GET_LBA_STATUS => Ok(Op::GetLbaStatus {
            lba: b64(c, 2),
            alloc: b32(c, 10),
        }),
        _ => Err(Sense::invalid_cdb(1)),
    }
}

fn maintenance_in(c: &[u8; 16]) -> Result<Op, Sense> {
    match c[1] & 0x1f {
        SA_REPORT_TPG => Ok(Op::ReportTargetPortGroups { alloc: b32(c, 6) }),
        SA_REPORT_OPCODES => Ok(Op::ReportOpcodes {
            options: c[2] & 0x07,
            rctd: c[2] & 0x80 != 0,
            opcode: c[3],
            sa: b16(c, 4) as u16,
            alloc: b32(c, 6),
        }),
        _ => Err(Sense::invalid_cdb(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read10_fields() {
        let c = [READ10, 0x08, 0, 0, 1, 0, 0, 0, 8, 0];
        assert_eq!(
            parse(&c),
            Ok(Op::Read(Rw {
                lba: 256,
                blocks: 8,
                fua: true,
                protect: 0,
                bytchk: 0
            }))
        );
    }

    #[test]
    fn unknown_opcode() {
        assert_eq!(parse(&[0xc0]), Err(Sense::invalid_opcode()));
        assert!(parse(&[]).is_ok());
    }
}
