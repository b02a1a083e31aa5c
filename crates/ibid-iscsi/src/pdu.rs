//! iSCSI PDU framing and field access (RFC 7143 section 11). Pure: no I/O.
//!
//! Every PDU starts with a 48-byte Basic Header Segment (BHS):
//!
//! ```text
//! byte  0      : .I oooooo      I = immediate delivery, o = opcode (6 bits)
//! byte  1      : F + opcode-specific flags
//! bytes 2..4   : opcode-specific
//! byte  4      : TotalAHSLength (in 4-byte words)
//! bytes 5..8   : DataSegmentLength (bytes, big endian, 24 bits)
//! bytes 8..16  : LUN or opcode-specific
//! bytes 16..20 : Initiator Task Tag
//! bytes 20..48 : opcode-specific (CmdSN/StatSN/... at 24..36)
//! ```
//!
//! followed by the AHS (TotalAHSLength * 4 bytes), an optional 4-byte header
//! digest (CRC32C over BHS and AHS), the data segment padded to 4 bytes, and
//! an optional 4-byte data digest (CRC32C over the padded data). Digests are
//! sent least significant byte first, as every initiator (and the Linux
//! kernel's crc32c) does.

use thiserror::Error;

/// Length of the Basic Header Segment in bytes.
pub const BHS_LEN: usize = 48;
/// Length of a digest (CRC32C) in bytes.
pub const DIGEST_LEN: usize = 4;
/// Reserved tag value meaning "no task tag".
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Initiator opcode: NOP-Out.
pub const OP_NOP_OUT: u8 = 0x00;
/// Initiator opcode: SCSI Command.
pub const OP_SCSI_CMD: u8 = 0x01;
/// Initiator opcode: Task Management Function Request.
pub const OP_TASK_MGMT_REQ: u8 = 0x02;
/// Initiator opcode: Login Request.
pub const OP_LOGIN_REQ: u8 = 0x03;
/// Initiator opcode: Text Request.
pub const OP_TEXT_REQ: u8 = 0x04;
/// Initiator opcode: SCSI Data-Out.
pub const OP_DATA_OUT: u8 = 0x05;
/// Initiator opcode: Logout Request.
pub const OP_LOGOUT_REQ: u8 = 0x06;
/// Initiator opcode: SNACK Request.
pub const OP_SNACK: u8 = 0x10;
/// Target opcode: NOP-In.
pub const OP_NOP_IN: u8 = 0x20;
/// Target opcode: SCSI Response.
pub const OP_SCSI_RESP: u8 = 0x21;
/// Target opcode: Task Management Function Response.
pub const OP_TASK_MGMT_RESP: u8 = 0x22;
/// Target opcode: Login Response.
pub const OP_LOGIN_RESP: u8 = 0x23;
/// Target opcode: Text Response.
pub const OP_TEXT_RESP: u8 = 0x24;
/// Target opcode: SCSI Data-In.
pub const OP_DATA_IN: u8 = 0x25;
/// Target opcode: Logout Response.
pub const OP_LOGOUT_RESP: u8 = 0x26;
/// Target opcode: Ready To Transfer.
pub const OP_R2T: u8 = 0x31;
/// Target opcode: Reject.
pub const OP_REJECT: u8 = 0x3f;

/// Byte-0 bit: immediate delivery.
pub const FLAG_IMMEDIATE: u8 = 0x40;
/// Byte-1 bit: final PDU of a sequence.
pub const FLAG_FINAL: u8 = 0x80;
/// Byte-1 bit (login/text): continue (more text follows).
pub const FLAG_CONTINUE: u8 = 0x40;
/// Byte-1 bit (login): transit to the next stage.
pub const FLAG_TRANSIT: u8 = 0x80;
/// Byte-1 bit (SCSI command): read expected.
pub const FLAG_READ: u8 = 0x40;
/// Byte-1 bit (SCSI command): write expected.
pub const FLAG_WRITE: u8 = 0x20;
/// Byte-1 bit (Data-In / SCSI Response): residual overflow.
pub const FLAG_OVERFLOW: u8 = 0x04;
/// Byte-1 bit (Data-In / SCSI Response): residual underflow.
pub const FLAG_UNDERFLOW: u8 = 0x02;
/// Byte-1 bit (Data-In): status is carried in this PDU.
pub const FLAG_STATUS: u8 = 0x01;

/// Reject reason: data (payload) digest error.
pub const REJECT_DIGEST: u8 = 0x02;
/// Reject reason: command not supported.
pub const REJECT_NOT_SUPPORTED: u8 = 0x05;
/// Reject reason: protocol error.
pub const REJECT_PROTOCOL: u8 = 0x04;
/// Reject reason: invalid PDU field.
pub const REJECT_INVALID_FIELD: u8 = 0x09;

/// Errors found while framing a PDU.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PduError {
    /// Fewer bytes than the header announces.
    #[error("truncated PDU: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The data segment exceeds what this side declared it can receive.
    #[error("data segment of {len} bytes exceeds limit {max}")]
    DataTooLong {
        /// Announced length.
        len: usize,
        /// Negotiated limit.
        max: usize,
    },
    /// Header digest mismatch.
    #[error("header digest mismatch")]
    HeaderDigest,
    /// Data digest mismatch.
    #[error("data digest mismatch")]
    DataDigest,
}

/// Lengths of the parts that follow a BHS, derived from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    /// AHS length in bytes.
    pub ahs_len: usize,
    /// Data segment length in bytes (without padding).
    pub data_len: usize,
}

impl Framing {
    /// Data segment length rounded up to a multiple of 4.
    pub fn padded_data_len(&self) -> usize {
        pad4(self.data_len)
    }
}

/// Round `n` up to a multiple of 4.
pub fn pad4(n: usize) -> usize {
    (n + 3) & !3
}

/// Read the framing lengths out of a BHS and check them against `max_data_len`.
pub fn framing(bhs: &[u8; BHS_LEN], max_data_len: usize) -> Result<Framing, PduError> {
    let ahs_len = bhs[4] as usize * 4;
    let data_len = u24(&bhs[5..8]);
    if data_len > max_data_len {
        return Err(PduError::DataTooLong {
            len: data_len,
            max: max_data_len,
        });
    }
    Ok(Framing { ahs_len, data_len })
}

/// A whole PDU: header, additional header segments and data segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    /// The Basic Header Segment.
    pub bhs: [u8; BHS_LEN],
    /// Additional Header Segments, raw.
    pub ahs: Vec<u8>,
    /// The data segment, without padding.
    pub data: Vec<u8>,
}

impl Pdu {
    /// A new PDU with the given opcode, all other fields zero.
    pub fn new(opcode: u8) -> Self {
        let mut bhs = [0u8; BHS_LEN];
        bhs[0] = opcode & 0x3f;
        Pdu {
            bhs,
            ahs: Vec::new(),
            data: Vec::new(),
        }
    }

    /// Decode one whole PDU from `buf` (for tests and fuzzing; the connection
    /// reads the same layout incrementally). Returns the PDU and bytes used.
    pub fn decode(
        buf: &[u8],
        header_digest: bool,
        data_digest: bool,
        max_data_len: usize,
    ) -> Result<(Pdu, usize), PduError> {
        let bhs: [u8; BHS_LEN] =
            take(buf, 0, BHS_LEN)?
                .try_into()
                .map_err(|_| PduError::Truncated {
                    need: BHS_LEN,
                    have: buf.len(),
                })?;
        let f = framing(&bhs, max_data_len)?;
        let mut pos = BHS_LEN;
        let ahs = take(buf, pos, f.ahs_len)?.to_vec();
        pos += f.ahs_len;
        if header_digest {
            let want = le32(take(buf, pos, DIGEST_LEN)?);
            if want != header_crc(&bhs, &ahs) {
                return Err(PduError::HeaderDigest);
            }
            pos += DIGEST_LEN;
        }
        let padded = take(buf, pos, f.padded_data_len())?;
        pos += f.padded_data_len();
        if data_digest && f.data_len > 0 {
            let want = le32(take(buf, pos, DIGEST_LEN)?);
            if want != crc32c(padded) {
                return Err(PduError::DataDigest);
            }
            pos += DIGEST_LEN;
        }
        let data = padded[..f.data_len].to_vec();
        Ok((Pdu { bhs, ahs, data }, pos))
    }

    /// Encode the PDU with the given digests; sets the length fields.
    pub fn encode(&mut self, header_digest: bool, data_digest: bool) -> Vec<u8> {
        let padded = pad4(self.data.len());
        let mut out = self.encode_head(self.data.len(), header_digest, padded + 4);
        if !self.data.is_empty() {
            let start = out.len();
            out.extend_from_slice(&self.data);
            out.resize(start + padded, 0);
            if data_digest {
                let crc = crc32c(&out[start..]);
                out.extend_from_slice(&crc.to_le_bytes());
            }
        }
        out
    }

    /// The header of this PDU for a data segment of `data_len` bytes sent apart from it
    /// (BHS, AHS, header digest), with room for `extra` more bytes; the segment then follows,
    /// padded to 4 bytes, and its CRC32C digest if negotiated.
    pub fn encode_head(&mut self, data_len: usize, header_digest: bool, extra: usize) -> Vec<u8> {
        self.bhs[4] = (self.ahs.len() / 4) as u8;
        set_u24(&mut self.bhs[5..8], data_len);
        let mut out = Vec::with_capacity(BHS_LEN + self.ahs.len() + DIGEST_LEN + extra);
        out.extend_from_slice(&self.bhs);
        out.extend_from_slice(&self.ahs);
        if header_digest {
            out.extend_from_slice(&header_crc(&self.bhs, &self.ahs).to_le_bytes());
        }
        out
    }

    /// The 6-bit opcode.
    pub fn opcode(&self) -> u8 {
        self.bhs[0] & 0x3f
    }
    /// Whether the immediate-delivery bit is set.
    pub fn immediate(&self) -> bool {
        self.bhs[0] & FLAG_IMMEDIATE != 0
    }
    /// Byte 1 (flags).
    pub fn flags(&self) -> u8 {
        self.bhs[1]
    }
    /// Whether the F (final) bit is set.
    pub fn is_final(&self) -> bool {
        self.bhs[1] & FLAG_FINAL != 0
    }
    /// LUN field (bytes 8..16) as raw 64 bits.
    pub fn lun_raw(&self) -> u64 {
        be64(&self.bhs[8..16])
    }
    /// Initiator Task Tag.
    pub fn itt(&self) -> u32 {
        self.field32(16)
    }
    /// The 32-bit big-endian field at byte `off` of the BHS.
    pub fn field32(&self, off: usize) -> u32 {
        be32(&self.bhs[off..off + 4])
    }
    /// Set the 32-bit big-endian field at byte `off` of the BHS.
    pub fn set32(&mut self, off: usize, v: u32) {
        self.bhs[off..off + 4].copy_from_slice(&v.to_be_bytes());
    }
    /// Set the LUN field from a raw 64-bit value.
    pub fn set_lun_raw(&mut self, v: u64) {
        self.bhs[8..16].copy_from_slice(&v.to_be_bytes());
    }
}

/// CRC32C over the BHS and AHS.
pub(crate) fn header_crc(bhs: &[u8], ahs: &[u8]) -> u32 {
    crc32c_append(crc32c(bhs), ahs)
}

/// The CRC32C (iSCSI's digest, RFC 7143 13.1) of `data`, computed with `crc-fast` (carry-less
/// multiplication folding where the CPU has it: about twice the `crc32c` crate's speed).
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The CRC32C of the bytes whose CRC32C is `crc` followed by `data`.
pub(crate) fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    use crc_fast::{CrcAlgorithm, Digest};
    // The digest's state is the register before the final inversion.
    let mut digest = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

fn take(buf: &[u8], pos: usize, len: usize) -> Result<&[u8], PduError> {
    let end = pos.saturating_add(len);
    buf.get(pos..end).ok_or(PduError::Truncated {
        need: end,
        have: buf.len(),
    })
}

/// Big-endian u32 from the first 4 bytes of `b` (which must have them).
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
/// Little-endian u32 (digests are sent least significant byte first).
fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}
/// Big-endian u64 from the first 8 bytes of `b`.
pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}
/// Big-endian 24-bit value from the first 3 bytes of `b`.
pub fn u24(b: &[u8]) -> usize {
    ((b[0] as usize) << 16) | ((b[1] as usize) << 8) | b[2] as usize
}
fn set_u24(b: &mut [u8], v: usize) {
    b[0] = (v >> 16) as u8;
    b[1] = (v >> 8) as u8;
    b[2] = v as u8;
}

/// Encode a LUN number in the SAM flat/peripheral addressing used on the wire.
pub fn lun_to_wire(lun: u64) -> u64 {
    if lun < 256 {
        lun << 48
    } else {
        (0x4000 | (lun & 0x3fff)) << 48
    }
}

/// Decode a wire LUN (peripheral or flat addressing, first level only).
pub fn lun_from_wire(raw: u64) -> u64 {
    let first = (raw >> 48) as u16;
    match first >> 14 {
        0 => (first & 0xff) as u64,
        1 => (first & 0x3fff) as u64,
        _ => u64::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is CRC32C (the catalogue's check value), and appending equals digesting the
    /// whole (as the header digest over BHS then AHS needs).
    #[test]
    fn digests_are_crc32c_and_append() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for split in [0, 1, 48, 100, 2999, 3000] {
            assert_eq!(
                crc32c_append(crc32c(&data[..split]), &data[split..]),
                crc32c(&data)
            );
        }
    }

    #[test]
    fn roundtrip_with_digests() {
        let mut p = Pdu::new(OP_NOP_IN);
        p.bhs[1] = FLAG_FINAL;
        p.data = b"hello".to_vec();
        let wire = p.encode(true, true);
        let (q, used) = Pdu::decode(&wire, true, true, 8192).unwrap();
        assert_eq!(used, wire.len());
        assert_eq!(q, p);
    }

    #[test]
    fn digest_errors_detected() {
        let mut p = Pdu::new(OP_NOP_IN);
        p.data = b"abc".to_vec();
        let mut wire = p.encode(true, true);
        wire[50] ^= 1;
        assert_eq!(
            Pdu::decode(&wire, true, true, 8192),
            Err(PduError::HeaderDigest)
        );
    }

    #[test]
    fn lun_encoding() {
        for l in [0, 1, 255, 256, 16383] {
            assert_eq!(lun_from_wire(lun_to_wire(l)), l);
        }
    }
}
