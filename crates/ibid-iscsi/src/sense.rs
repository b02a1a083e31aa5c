//! SCSI status codes and sense data (SPC-4 4.5, fixed format).

/// SCSI status GOOD.
pub const STATUS_GOOD: u8 = 0x00;
/// SCSI status CHECK CONDITION.
pub const STATUS_CHECK_CONDITION: u8 = 0x02;
/// SCSI status CONDITION MET.
pub const STATUS_CONDITION_MET: u8 = 0x04;
/// SCSI status BUSY.
pub const STATUS_BUSY: u8 = 0x08;
/// SCSI status TASK SET FULL.
pub const STATUS_TASK_SET_FULL: u8 = 0x28;
/// SCSI status RESERVATION CONFLICT.
pub const STATUS_RESERVATION_CONFLICT: u8 = 0x18;
/// SCSI status TASK ABORTED.
pub const STATUS_TASK_ABORTED: u8 = 0x40;

/// Sense key NO SENSE.
pub const KEY_NO_SENSE: u8 = 0x0;
/// Sense key NOT READY.
pub const KEY_NOT_READY: u8 = 0x2;
/// Sense key MEDIUM ERROR.
pub const KEY_MEDIUM_ERROR: u8 = 0x3;
/// Sense key HARDWARE ERROR.
pub const KEY_HARDWARE_ERROR: u8 = 0x4;
/// Sense key ILLEGAL REQUEST.
pub const KEY_ILLEGAL_REQUEST: u8 = 0x5;
/// Sense key UNIT ATTENTION.
pub const KEY_UNIT_ATTENTION: u8 = 0x6;
/// Sense key DATA PROTECT.
pub const KEY_DATA_PROTECT: u8 = 0x7;
/// Sense key COPY ABORTED.
pub const KEY_COPY_ABORTED: u8 = 0xa;
/// Sense key ABORTED COMMAND.
pub const KEY_ABORTED_COMMAND: u8 = 0xb;
/// Sense key MISCOMPARE.
pub const KEY_MISCOMPARE: u8 = 0xe;

/// Fixed-format sense data length we send.
pub const FIXED_SENSE_LEN: usize = 18;

/// One sense condition: key, additional sense code and qualifier, plus the
/// optional INFORMATION and SENSE KEY SPECIFIC fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    /// Sense key.
    pub key: u8,
    /// Additional sense code.
    pub asc: u8,
    /// Additional sense code qualifier.
    pub ascq: u8,
    /// INFORMATION field (VALID bit set when present).
    pub info: Option<u32>,
    /// Field pointer: (in CDB?, byte, bit) for INVALID FIELD senses.
    pub field: Option<(bool, u16, Option<u8>)>,
}

impl Sense {
    /// A sense with no INFORMATION and no field pointer.
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Self {
        Sense {
            key,
            asc,
            ascq,
            info: None,
            field: None,
        }
    }
    /// ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE (20h/00h).
    pub const fn invalid_opcode() -> Self {
        Self::new(KEY_ILLEGAL_REQUEST, 0x20, 0x00)
    }
    /// ILLEGAL REQUEST / INVALID FIELD IN CDB (24h/00h) pointing at `byte`.
    pub const fn invalid_cdb(byte: u16) -> Self {
        Sense {
            key: KEY_ILLEGAL_REQUEST,
            asc: 0x24,
            ascq: 0,
            info: None,
            field: Some((true, byte, None)),
        }
    }
    /// ILLEGAL REQUEST / INVALID FIELD IN PARAMETER LIST (26h/00h).
    pub const fn invalid_param(byte: u16) -> Self {
        Sense {
            key: KEY_ILLEGAL_REQUEST,
            asc: 0x26,
            ascq: 0,
            info: None,
            field: Some((false, byte, None)),
        }
    }
    /// ILLEGAL REQUEST / PARAMETER LIST LENGTH ERROR (1Ah/00h).
    pub const fn param_list_length() -> Self {
        Self::new(KEY_ILLEGAL_REQUEST, 0x1a, 0x00)
    }
    /// ILLEGAL REQUEST / LOGICAL BLOCK ADDRESS OUT OF RANGE (21h/00h).
    pub const fn lba_out_of_range() -> Self {
        Self::new(KEY_ILLEGAL_REQUEST, 0x21, 0x00)
    }
    /// ILLEGAL REQUEST / LOGICAL UNIT NOT SUPPORTED (25h/00h).
    pub const fn lun_not_supported() -> Self {
        Self::new(KEY_ILLEGAL_REQUEST, 0x25, 0x00)
    }
    /// ILLEGAL REQUEST / INVALID FIELD IN COMMAND INFORMATION UNIT (0Eh/03h).
    pub const fn invalid_field_in_iu() -> Self {
        Self::new(KEY_ILLEGAL_REQUEST, 0x0e, 0x03)
    }
    /// DATA PROTECT / SPACE ALLOCATION FAILED WRITE PROTECT (27h/07h).
    pub const fn no_space() -> Self {
        Self::new(KEY_DATA_PROTECT, 0x27, 0x07)
    }
    /// DATA PROTECT / WRITE PROTECTED (27h/00h).
    pub const fn write_protected() -> Self {
        Self::new(KEY_DATA_PROTECT, 0x27, 0x00)
    }
    /// MEDIUM ERROR / UNRECOVERED READ ERROR (11h/00h), used for backend I/O errors.
    pub const fn medium_error() -> Self {
        Self::new(KEY_MEDIUM_ERROR, 0x11, 0x00)
    }
    /// MISCOMPARE / MISCOMPARE DURING VERIFY OPERATION (1Dh/00h) at byte `offset`.
    pub const fn miscompare(offset: u32) -> Self {
        Sense {
            key: KEY_MISCOMPARE,
            asc: 0x1d,
            ascq: 0,
            info: Some(offset),
            field: None,
        }
    }
    /// UNIT ATTENTION / THIN PROVISIONING SOFT THRESHOLD REACHED (38h/07h).
    pub const fn soft_threshold() -> Self {
        Self::new(KEY_UNIT_ATTENTION, 0x38, 0x07)
    }
    /// UNIT ATTENTION / POWER ON, RESET, OR BUS DEVICE RESET OCCURRED (29h/00h).
    pub const fn reset_occurred() -> Self {
        Self::new(KEY_UNIT_ATTENTION, 0x29, 0x00)
    }
    /// UNIT ATTENTION / RESERVATIONS PREEMPTED (2Ah/03h).
    pub const fn reservations_preempted() -> Self {
        Self::new(KEY_UNIT_ATTENTION, 0x2a, 0x03)
    }
    /// UNIT ATTENTION / RESERVATIONS RELEASED (2Ah/04h).
    pub const fn reservations_released() -> Self {
        Self::new(KEY_UNIT_ATTENTION, 0x2a, 0x04)
    }
    /// UNIT ATTENTION / REGISTRATIONS PREEMPTED (2Ah/05h).
    pub const fn registrations_preempted() -> Self {
        Self::new(KEY_UNIT_ATTENTION, 0x2a, 0x05)
    }

    /// Encode as fixed-format sense data (response code 70h).
    pub fn fixed(&self) -> [u8; FIXED_SENSE_LEN] {
        let mut b = [0u8; FIXED_SENSE_LEN];
        b[0] = 0x70;
        b[2] = self.key & 0x0f;
        if let Some(info) = self.info {
            b[0] |= 0x80;
            b[3..7].copy_from_slice(&info.to_be_bytes());
        }
        b[7] = (FIXED_SENSE_LEN - 8) as u8;
        b[12] = self.asc;
        b[13] = self.ascq;
        if let Some((cdb, byte, bit)) = self.field {
            b[15] = 0x80 | if cdb { 0x40 } else { 0 };
            if let Some(bit) = bit {
                b[15] |= 0x08 | (bit & 7);
            }
            b[16..18].copy_from_slice(&byte.to_be_bytes());
        }
        b
    }
}
