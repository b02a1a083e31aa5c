//! On-disk formats: segment files and the values stored in the metadata tables.
//!
//! All integers are little-endian unless a key needs big-endian order for range scans.
//!
//! # Segment files (`segments/SEGMENT_ID.seg`, 16 hex digits)
//!
//! ```text
//! +--------------------+----------+----------+-----+
//! | file header 64 B   | record 0 | record 1 | ... |
//! +--------------------+----------+----------+-----+
//! file header: magic "IBIDSEG1" (8) | format version u32 | reserved u32 | segment id u64 |
//!              reserved (36) | crc32c of bytes 0..60 (4)
//! record:      magic u32 "IBDC" | flags u16 (bit 0: LZ4) | reserved u16 | stored_len u32 |
//!              chunk id u64 | crc32c u32 of bytes 0..20 and the payload | payload (stored_len)
//! ```
//!
//! A file may end in zero bytes (up to a 4 KiB page): segments are written in whole pages (see
//! `segment.rs`), and a page past the last record is padded with zeros, which end a scan
//! (no record magic). The page holding the last records may be written again with the same
//! bytes and more records after them; bytes already written never change.
//!
//! Segments are append-only. A record is never rewritten in place: the cleaner copies live
//! records to a new segment and deletes the old file once the metadata that points at the new
//! copy is durable. A record's header names its chunk, so a read that lands on the wrong record
//! (a misdirected write, a stale location) is detected, and so is any flipped bit (crc32c).
//!
//! # Crash analysis
//! Data is appended and fsynced *before* the metadata transaction that references it commits
//! (see `pool::commit`). After a crash, segments may hold records no metadata references (the
//! tail written after the last commit): they are dead space, reclaimed by the cleaner. Metadata
//! never references bytes that were not durable when it committed.

use crate::error::{Error, Result};

/// Magic at the start of every segment file.
pub const SEGMENT_MAGIC: &[u8; 8] = b"IBIDSEG1";
/// Version of the segment format. Version log: 1 — initial format.
pub const SEGMENT_FORMAT_VERSION: u32 = 1;
/// Size of the segment file header in bytes.
pub const SEGMENT_HEADER_BYTES: u64 = 64;
/// Magic at the start of every record ("IBDC").
pub const RECORD_MAGIC: u32 = 0x4344_4249;
/// Size of a record header in bytes.
pub const RECORD_HEADER_BYTES: usize = 24;
/// Record flag: the payload is LZ4-compressed (block format, no size prefix).
pub const RECORD_FLAG_LZ4: u16 = 1;
/// The engine's block size: every map entry and chunk covers this many bytes.
pub const BLOCK_BYTES: usize = 4096;
/// Sector size: offsets and lengths must be multiples of this.
pub const SECTOR_BYTES: u64 = 512;
/// Largest volume the engine accepts: 1 PiB.
pub const VOLUME_BYTES_MAX: u64 = 1 << 50;

/// Encodes a segment file header.
pub fn encode_segment_header(segment_id: u64) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES as usize];
    h[0..8].copy_from_slice(SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&segment_id.to_le_bytes());
    let crc = crate::checksum::crc32c(&h[0..60]);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a segment file header and returns its segment id.
pub fn decode_segment_header(h: &[u8]) -> Result<u64> {
    if h.len() < SEGMENT_HEADER_BYTES as usize || &h[0..8] != SEGMENT_MAGIC {
        return Err(Error::Corrupt("segment header: bad magic".into()));
    }
    let crc = u32::from_le_bytes(h[60..64].try_into().expect("4 bytes"));
    if crc != crate::checksum::crc32c(&h[0..60]) {
        return Err(Error::Corrupt("segment header: checksum mismatch".into()));
    }
    let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    if version != SEGMENT_FORMAT_VERSION {
        return Err(Error::Corrupt(format!(
            "segment header: unknown version {version}"
        )));
    }
    Ok(u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")))
}

/// A record header as decoded from a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// Flags (`RECORD_FLAG_*`).
    pub flags: u16,
    /// Payload length in bytes.
    pub stored_len: u32,
    /// The chunk this record holds.
    pub chunk_id: u64,
    /// crc32c of the header's first 20 bytes and the payload.
    pub crc: u32,
}

/// Encodes a record (header and payload) into `out`, returning its crc.
pub fn encode_record(out: &mut Vec<u8>, chunk_id: u64, flags: u16, payload: &[u8]) -> u32 {
    let (header, crc) = encode_record_header(chunk_id, flags, payload);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    crc
}

/// The header of a record of `payload`, and the record's crc (which the header ends with).
pub fn encode_record_header(
    chunk_id: u64,
    flags: u16,
    payload: &[u8],
) -> ([u8; RECORD_HEADER_BYTES], u32) {
    let mut h = [0u8; RECORD_HEADER_BYTES];
    h[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&flags.to_le_bytes());
    h[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[12..20].copy_from_slice(&chunk_id.to_le_bytes());
    let crc = crate::checksum::crc32c_parts(&h[..20], payload);
    h[20..24].copy_from_slice(&crc.to_le_bytes());
    (h, crc)
}

/// Decodes a record header; checks only its magic (the crc needs the payload).
pub fn decode_record_header(h: &[u8]) -> Result<RecordHeader> {
    if h.len() < RECORD_HEADER_BYTES {
        return Err(Error::Corrupt("record header truncated".into()));
    }
    let magic = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    if magic != RECORD_MAGIC {
        return Err(Error::Corrupt(format!(
            "record header: bad magic {magic:#x}"
        )));
    }
    Ok(RecordHeader {
        flags: u16::from_le_bytes(h[4..6].try_into().expect("2 bytes")),
        stored_len: u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")),
        chunk_id: u64::from_le_bytes(h[12..20].try_into().expect("8 bytes")),
        crc: u32::from_le_bytes(h[20..24].try_into().expect("4 bytes")),
    })
}

/// Verifies a whole record (header followed by payload) against its crc.
pub fn record_crc_ok(record: &[u8], crc: u32) -> bool {
    record_parts_crc_ok(
        &record[..RECORD_HEADER_BYTES],
        &record[RECORD_HEADER_BYTES..],
        crc,
    )
}

/// Verifies a record read as its header and its payload apart against its crc.
pub fn record_parts_crc_ok(header: &[u8], payload: &[u8], crc: u32) -> bool {
    crate::checksum::crc32c_parts(&header[0..20], payload) == crc
}

/// A chunk's BLAKE3 fingerprint (of its uncompressed 4 KiB block).
pub type Fingerprint = [u8; 32];

/// Where a chunk lives, how it is stored and how many map entries reference it: one entry of
/// a `chunk.pages` row (see `chunk_table.rs`). The chunk's fingerprint is stored apart, in
/// `chunk.fps` (see `chunk_fps.rs`): it is written once, while this record is rewritten by
/// every fold of reference changes and every move by the cleaner.
///
/// Layout ([`CHUNK_RECORD_BYTES`] = 24): segment u48 | offset u32 | stored_len u16 | crc u32 |
/// flags u16 | refs u48, little-endian. Pool format 14 and older stored 64 bytes with the
/// fingerprint ([`ChunkRecord::decode_v14`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRecord {
    /// Segment holding the record.
    pub segment: u64,
    /// Byte offset of the record header in the segment file.
    pub offset: u32,
    /// Payload length (compressed or not).
    pub stored_len: u32,
    /// crc32c of the record, as in its header.
    pub crc: u32,
    /// Record flags.
    pub flags: u16,
    /// Number of map entries (in any volume) that reference this chunk.
    pub refs: u64,
}

/// Encoded size of a [`ChunkRecord`].
pub const CHUNK_RECORD_BYTES: usize = 24;
/// Encoded size of a chunk record of pool format 14 and older (with its fingerprint).
pub const CHUNK_RECORD_V14_BYTES: usize = 64;
/// Bound (exclusive) of a record's `segment` and `refs` (48 bits each).
const U48_END: u64 = 1 << 48;

fn u48_at(v: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(&v[at..at + 6]);
    u64::from_le_bytes(b)
}

impl ChunkRecord {
    /// Physical bytes this chunk occupies in its segment (header and payload).
    pub fn physical_bytes(&self) -> u64 {
        RECORD_HEADER_BYTES as u64 + self.stored_len as u64
    }

    /// Checks that the record's fields fit its encoding (a segment id or a reference count of
    /// 2^48 or more, a payload of 64 KiB or more, do not).
    pub fn check_encodable(&self) -> Result<()> {
        if self.segment >= U48_END || self.refs >= U48_END || self.stored_len > u16::MAX as u32 {
            return Err(Error::Corrupt(format!(
                "chunk record beyond its encoding's range: {self:?}"
            )));
        }
        Ok(())
    }

    /// Encodes the record for a chunk page (the fields are taken as
    /// [`ChunkRecord::check_encodable`] accepts them).
    pub fn encode(&self) -> [u8; CHUNK_RECORD_BYTES] {
        debug_assert!(self.check_encodable().is_ok(), "{self:?}");
        let mut v = [0u8; CHUNK_RECORD_BYTES];
        v[0..6].copy_from_slice(&self.segment.to_le_bytes()[..6]);
        v[6..10].copy_from_slice(&self.offset.to_le_bytes());
        v[10..12].copy_from_slice(&(self.stored_len as u16).to_le_bytes());
        v[12..16].copy_from_slice(&self.crc.to_le_bytes());
        v[16..18].copy_from_slice(&self.flags.to_le_bytes());
        v[18..24].copy_from_slice(&self.refs.to_le_bytes()[..6]);
        v
    }

    /// Decodes a record of a chunk page.
    pub fn decode(v: &[u8]) -> Result<Self> {
        if v.len() != CHUNK_RECORD_BYTES {
            return Err(Error::Corrupt(format!("chunk record of {} bytes", v.len())));
        }
        Ok(ChunkRecord {
            segment: u48_at(v, 0),
            offset: u32::from_le_bytes(v[6..10].try_into().expect("4 bytes")),
            stored_len: u16::from_le_bytes(v[10..12].try_into().expect("2 bytes")) as u32,
            crc: u32::from_le_bytes(v[12..16].try_into().expect("4 bytes")),
            flags: u16::from_le_bytes(v[16..18].try_into().expect("2 bytes")),
            refs: u48_at(v, 18),
        })
    }

    /// Decodes a record of pool format 14 or older and its fingerprint. Layout (64 bytes):
    /// segment u64 | offset u32 | stored_len u32 | crc u32 | flags u16 | reserved u16 | refs u64
    /// | fingerprint [u8; 32].
    pub fn decode_v14(v: &[u8]) -> Result<(Self, Fingerprint)> {
        if v.len() != CHUNK_RECORD_V14_BYTES {
            return Err(Error::Corrupt(format!(
                "format-14 chunk record of {} bytes",
                v.len()
            )));
        }
        let rec = ChunkRecord {
            segment: u64::from_le_bytes(v[0..8].try_into().expect("8 bytes")),
            offset: u32::from_le_bytes(v[8..12].try_into().expect("4 bytes")),
            stored_len: u32::from_le_bytes(v[12..16].try_into().expect("4 bytes")),
            crc: u32::from_le_bytes(v[16..20].try_into().expect("4 bytes")),
            flags: u16::from_le_bytes(v[20..22].try_into().expect("2 bytes")),
            refs: u64::from_le_bytes(v[24..32].try_into().expect("8 bytes")),
        };
        rec.check_encodable()
            .map_err(|_| Error::Corrupt(format!("format-14 chunk record {rec:?}")))?;
        Ok((rec, v[32..64].try_into().expect("32 bytes")))
    }

    /// Encodes the record and `fp` as pool format 14 did (for tests of the upgrade).
    pub fn encode_v14(&self, fp: &Fingerprint) -> [u8; CHUNK_RECORD_V14_BYTES] {
        let mut v = [0u8; CHUNK_RECORD_V14_BYTES];
        v[0..8].copy_from_slice(&self.segment.to_le_bytes());
        v[8..12].copy_from_slice(&self.offset.to_le_bytes());
        v[12..16].copy_from_slice(&self.stored_len.to_le_bytes());
        v[16..20].copy_from_slice(&self.crc.to_le_bytes());
        v[20..22].copy_from_slice(&self.flags.to_le_bytes());
        v[24..32].copy_from_slice(&self.refs.to_le_bytes());
        v[32..64].copy_from_slice(fp);
        v
    }
}

/// A new chunk until its commit: its record and its fingerprint, which the commit stores apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewChunkRecord {
    /// Where it is and how it is stored (`refs` 0 until the commit counts them).
    pub rec: ChunkRecord,
    /// BLAKE3 of the uncompressed block.
    pub fingerprint: Fingerprint,
}

/// A volume's or snapshot's persistent description: the value of the `volumes` table (key:
/// volume name) and of the `snapshots` table (key: `VOLUME@SNAPSHOT`).
///
/// Layout: id u64 | size u64 | mapped_blocks u64 | created_unix_s u64 | frame count u32 |
/// layer of each frame (u64 each, bottom first; 0 for a floor) | provisioning format u8 |
/// reserved (7) | optionally, the windows: count u32, then per windowed frame: index u32 | lo
/// u64 | hi u64 | src_lo u64. Frames not listed there are plain. The last frame of a volume is
/// its writable top layer (always plain); a snapshot's frames are all frozen. Records written
/// before the format byte existed end after the layers and decode as thin; records written
/// before windows existed end after the reserved bytes. The first engine's records (pool
/// format 1, before snapshots) are [`VOLUME_RECORD_FIRST_BYTES`] long: id | size | layer |
/// mapped_blocks | created_unix_s, u64 each — a length no later record has (36 + 8 per frame,
/// + 8 with the trailer) — and decode as a thin volume of that one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// Volume id, unique in the pool, never reused (snapshots get ids from the same counter).
    pub id: u64,
    /// Size in bytes (a multiple of 512).
    pub size: u64,
    /// Number of blocks mapped to data (non-zero), as of this commit.
    pub mapped_blocks: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// The stack of frames (map layers seen through windows), bottom first.
    pub layers: Vec<Frame>,
    /// Space reservation policy (snapshots are always thin).
    pub format: VolumeFormat,
}

/// How a volume provisions space: a policy, not a data layout. All three read, write and
/// share data the same way; thick formats reserve pool space for their blocks that hold no
/// data yet, so their writes never fail for lack of space.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum VolumeFormat {
    /// Space is taken as data is written (the default).
    #[default]
    Thin,
    /// Space for the whole volume is reserved at creation; blocks never written are reported
    /// as "to be zeroed" (tbz), though they read as zeros at no cost.
    LazyZeroedThick,
    /// Space for the whole volume is reserved and every block counts as zeroed from creation
    /// (tbz = 0), in O(1): unwritten blocks already read as zeros.
    EagerZeroedThick,
}

impl VolumeFormat {
    /// Every format, in the order users know them.
    pub const ALL: [VolumeFormat; 3] = [
        VolumeFormat::Thin,
        VolumeFormat::LazyZeroedThick,
        VolumeFormat::EagerZeroedThick,
    ];

    /// The name used in the API and CLI (`thin`, `lazyzeroedthick`, `eagerzeroedthick`).
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeFormat::Thin => "thin",
            VolumeFormat::LazyZeroedThick => "lazyzeroedthick",
            VolumeFormat::EagerZeroedThick => "eagerzeroedthick",
        }
    }

    /// Whether the format reserves space for the whole volume.
    pub fn is_thick(self) -> bool {
        self != VolumeFormat::Thin
    }

    /// The format's code in a [`VolumeRecord`].
    pub fn code(self) -> u8 {
        match self {
            VolumeFormat::Thin => 0,
            VolumeFormat::LazyZeroedThick => 1,
            VolumeFormat::EagerZeroedThick => 2,
        }
    }

    /// The format stored as `code`, if it names one.
    pub fn from_code(code: u8) -> Option<VolumeFormat> {
        VolumeFormat::ALL.into_iter().find(|f| f.code() == code)
    }
}

impl std::fmt::Display for VolumeFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for VolumeFormat {
    type Err = Error;

    /// Parses a format name; `zeroedthick` (VMware's name for lazy) is accepted too.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "thin" => Ok(VolumeFormat::Thin),
            "lazyzeroedthick" | "zeroedthick" => Ok(VolumeFormat::LazyZeroedThick),
            "eagerzeroedthick" => Ok(VolumeFormat::EagerZeroedThick),
            _ => Err(Error::InvalidArgument(format!(
                "unknown volume format {s:?}: use thin, lazyzeroedthick or eagerzeroedthick"
            ))),
        }
    }
}

/// The layer id of a floor frame (layer ids start at 1).
pub const FLOOR_LAYER: u64 = 0;

/// One element of a volume's stack: a map layer seen through a window.
///
/// A plain frame shows every block of its layer at the same block number. A range copy puts
/// the source's frozen frames into the destination's stack as windowed frames: block `b` of
/// the volume, for `lo <= b < hi`, is block `b - lo + src_lo` of the layer; outside the window
/// the frame holds nothing. A floor ([`FLOOR_LAYER`]) holds no entries and is opaque: inside
/// its window, a block no frame above it maps reads as zeros, whatever the frames below hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The map layer, or [`FLOOR_LAYER`].
    pub layer: u64,
    /// First block of the window (volume block numbers).
    pub lo: u64,
    /// End of the window (exclusive).
    pub hi: u64,
    /// The layer's block shown at `lo`.
    pub src_lo: u64,
}

impl Frame {
    /// A frame showing all of `layer`, unshifted.
    pub const fn plain(layer: u64) -> Frame {
        Frame {
            layer,
            lo: 0,
            hi: u64::MAX,
            src_lo: 0,
        }
    }

    /// Whether the frame shows all of its layer, unshifted.
    pub fn is_plain(&self) -> bool {
        self.lo == 0 && self.hi == u64::MAX && self.src_lo == 0 && !self.is_floor()
    }

    /// Whether the frame is a floor (no layer; opaque zeros in its window).
    pub fn is_floor(&self) -> bool {
        self.layer == FLOOR_LAYER
    }

    /// The layer's block shown at volume block `b` (which must lie in the window).
    pub fn source_block(&self, b: u64) -> u64 {
        b - self.lo + self.src_lo
    }

    /// The volume block showing the layer's block `s` (which must map into the window).
    pub fn volume_block(&self, s: u64) -> u64 {
        s - self.src_lo + self.lo
    }
}

/// `7` for a plain frame of layer 7, `7[10..20@0]` for one showing its blocks from 0 at
/// volume blocks 10..20, `floor[10..20]` (logs and diagnostics).
impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_floor() {
            write!(f, "floor[{}..{}]", self.lo, self.hi)
        } else if self.is_plain() {
            write!(f, "{}", self.layer)
        } else {
            write!(
                f,
                "{}[{}..{}@{}]",
                self.layer, self.lo, self.hi, self.src_lo
            )
        }
    }
}

/// A stack of frames, bottom first, as `[3 7[10..20@0] 9]` (logs and diagnostics).
pub fn describe_stack(stack: &[Frame]) -> String {
    let frames: Vec<String> = stack.iter().map(Frame::to_string).collect();
    format!("[{}]", frames.join(" "))
}

/// The layers a stack references, once per frame that shows them (floors reference none):
/// what the `layers` table counts.
pub fn referenced_layers(stack: &[Frame]) -> impl Iterator<Item = u64> + '_ {
    stack.iter().filter(|f| !f.is_floor()).map(|f| f.layer)
}

/// Encoded size of a [`VolumeRecord`] written by the first engine (one layer, no frame count).
pub const VOLUME_RECORD_FIRST_BYTES: usize = 40;
/// Encoded size of a [`VolumeRecord`] without its layers and trailer.
pub const VOLUME_RECORD_FIXED_BYTES: usize = 36;
/// Encoded size of the trailer after the layers (format byte and reserved bytes).
pub const VOLUME_RECORD_TRAILER_BYTES: usize = 8;
/// Most frames a stack may hold (clone and snapshot generations, range copies).
pub const LAYERS_MAX: usize = 4096;
/// Encoded size of one window in a [`VolumeRecord`].
const WINDOW_BYTES: usize = 4 + 3 * 8;

impl VolumeRecord {
    /// The writable (top) layer.
    pub fn top(&self) -> u64 {
        self.layers
            .last()
            .expect("a stack has at least one layer")
            .layer
    }

    /// Encodes the record.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(
            VOLUME_RECORD_FIXED_BYTES + 8 * self.layers.len() + VOLUME_RECORD_TRAILER_BYTES,
        );
        for x in [self.id, self.size, self.mapped_blocks, self.created_unix_s] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        for f in &self.layers {
            v.extend_from_slice(&f.layer.to_le_bytes());
        }
        let mut trailer = [0u8; VOLUME_RECORD_TRAILER_BYTES];
        trailer[0] = self.format.code();
        v.extend_from_slice(&trailer);
        let windowed: Vec<(usize, &Frame)> = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, f)| !f.is_plain())
            .collect();
        if !windowed.is_empty() {
            v.extend_from_slice(&(windowed.len() as u32).to_le_bytes());
            for (i, f) in windowed {
                v.extend_from_slice(&(i as u32).to_le_bytes());
                for x in [f.lo, f.hi, f.src_lo] {
                    v.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        v
    }

    /// Decodes a `volumes` or `snapshots` table value.
    pub fn decode(v: &[u8]) -> Result<Self> {
        if v.len() < VOLUME_RECORD_FIXED_BYTES {
            return Err(Error::Corrupt(format!(
                "volume record of {} bytes",
                v.len()
            )));
        }
        let f = |i: usize| u64::from_le_bytes(v[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        if v.len() == VOLUME_RECORD_FIRST_BYTES {
            return Ok(VolumeRecord {
                id: f(0),
                size: f(1),
                mapped_blocks: f(3),
                created_unix_s: f(4),
                layers: vec![Frame::plain(f(2))],
                format: VolumeFormat::Thin,
            });
        }
        let n = u32::from_le_bytes(v[32..36].try_into().expect("4 bytes")) as usize;
        let bad = || {
            Error::Corrupt(format!(
                "volume record with {n} frames in {} bytes",
                v.len()
            ))
        };
        let layers_end = VOLUME_RECORD_FIXED_BYTES + 8 * n;
        let with_trailer = layers_end + VOLUME_RECORD_TRAILER_BYTES;
        if n == 0 || n > LAYERS_MAX || (v.len() != layers_end && v.len() < with_trailer) {
            return Err(bad());
        }
        let format = match v.get(layers_end) {
            None => VolumeFormat::Thin,
            Some(&code) => VolumeFormat::from_code(code)
                .ok_or_else(|| Error::Corrupt(format!("volume record with format code {code}")))?,
        };
        let mut layers: Vec<Frame> = v[VOLUME_RECORD_FIXED_BYTES..layers_end]
            .chunks(8)
            .map(|c| Frame::plain(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
            .collect();
        if v.len() > with_trailer {
            let windows = &v[with_trailer..];
            let count = windows
                .get(..4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize)
                .ok_or_else(bad)?;
            if count == 0 || windows.len() != 4 + count * WINDOW_BYTES {
                return Err(bad());
            }
            let g = |c: &[u8], i: usize| {
                u64::from_le_bytes(c[4 + i * 8..12 + i * 8].try_into().expect("8 bytes"))
            };
            for c in windows[4..].chunks(WINDOW_BYTES) {
                let i = u32::from_le_bytes(c[..4].try_into().expect("4 bytes")) as usize;
                let (lo, hi, src_lo) = (g(c, 0), g(c, 1), g(c, 2));
                let frame = layers.get_mut(i).ok_or_else(bad)?;
                if lo >= hi || src_lo.checked_add(hi - lo).is_none() {
                    return Err(Error::Corrupt(format!(
                        "volume record: frame {i} has window [{lo}, {hi}) from {src_lo}"
                    )));
                }
                frame.lo = lo;
                frame.hi = hi;
                frame.src_lo = src_lo;
            }
        }
        match layers.last() {
            Some(top) if top.is_plain() => {}
            _ => {
                return Err(Error::Corrupt(
                    "volume record: the top frame is not a plain layer".into(),
                ))
            }
        }
        Ok(VolumeRecord {
            id: f(0),
            size: f(1),
            mapped_blocks: f(2),
            created_unix_s: f(3),
            layers,
            format,
        })
    }
}

/// Map value meaning "this block reads as zeros" in an upper layer, hiding lower layers.
/// Chunk ids are never 0 (sequences start at 1).
pub const ZERO_TOMBSTONE: u64 = 0;

/// Per-segment usage: the value of the `segments` table (key: segment id).
///
/// Layout (16 bytes): total_bytes u64 (committed records ever appended, header included) |
/// live_bytes u64 (records still referenced).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentUsage {
    /// Bytes of committed records in the segment.
    pub total_bytes: u64,
    /// Bytes of those records whose chunk is still alive.
    pub live_bytes: u64,
}

impl SegmentUsage {
    /// Encodes the usage record.
    pub fn encode(&self) -> [u8; 16] {
        let mut v = [0u8; 16];
        v[0..8].copy_from_slice(&self.total_bytes.to_le_bytes());
        v[8..16].copy_from_slice(&self.live_bytes.to_le_bytes());
        v
    }

    /// Decodes a `segments` table value.
    pub fn decode(v: &[u8]) -> Result<Self> {
        if v.len() != 16 {
            return Err(Error::Corrupt(format!(
                "segment usage of {} bytes",
                v.len()
            )));
        }
        Ok(SegmentUsage {
            total_bytes: u64::from_le_bytes(v[0..8].try_into().expect("8 bytes")),
            live_bytes: u64::from_le_bytes(v[8..16].try_into().expect("8 bytes")),
        })
    }
}

/// Key of the `map` table: (layer, block), big-endian so a range scan walks blocks in order.
pub fn map_key(layer: u64, block: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[0..8].copy_from_slice(&layer.to_be_bytes());
    k[8..16].copy_from_slice(&block.to_be_bytes());
    k
}

/// Splits a `map` key into (layer, block).
pub fn decode_map_key(k: &[u8; 16]) -> (u64, u64) {
    (
        u64::from_be_bytes(k[0..8].try_into().expect("8 bytes")),
        u64::from_be_bytes(k[8..16].try_into().expect("8 bytes")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_record_round_trips_with_largest_values() {
        let r = ChunkRecord {
            segment: U48_END - 1,
            offset: u32::MAX,
            stored_len: u16::MAX as u32,
            crc: u32::MAX,
            flags: u16::MAX,
            refs: U48_END - 1,
        };
        assert!(r.check_encodable().is_ok());
        assert_eq!(ChunkRecord::decode(&r.encode()).expect("decode"), r);
        let fp = [0xab; 32];
        assert_eq!(
            ChunkRecord::decode_v14(&r.encode_v14(&fp)).expect("decode"),
            (r, fp)
        );
        // One past each field's range is refused, not wrapped.
        for bad in [
            ChunkRecord {
                segment: U48_END,
                ..r
            },
            ChunkRecord { refs: U48_END, ..r },
            ChunkRecord {
                stored_len: u16::MAX as u32 + 1,
                ..r
            },
        ] {
            assert!(bad.check_encodable().is_err(), "{bad:?}");
            assert!(ChunkRecord::decode_v14(&bad.encode_v14(&fp)).is_err());
        }
        assert!(ChunkRecord::decode(&r.encode()[..23]).is_err());
    }

    #[test]
    fn record_crc_detects_a_flipped_bit() {
        let mut rec = Vec::new();
        let crc = encode_record(&mut rec, 7, 0, &[1u8; 100]);
        assert!(record_crc_ok(&rec, crc));
        rec[50] ^= 1;
        assert!(!record_crc_ok(&rec, crc));
    }

    #[test]
    fn volume_record_round_trips_every_format_and_reads_old_records_as_thin() {
        for format in VolumeFormat::ALL {
            let r = VolumeRecord {
                id: 3,
                size: 1 << 40,
                mapped_blocks: 17,
                created_unix_s: 99,
                layers: vec![Frame::plain(4), Frame::plain(9)],
                format,
            };
            let bytes = r.encode();
            assert_eq!(VolumeRecord::decode(&bytes).expect("decode"), r);
            let old = &bytes[..bytes.len() - VOLUME_RECORD_TRAILER_BYTES];
            let decoded = VolumeRecord::decode(old).expect("decode without trailer");
            assert_eq!(decoded.format, VolumeFormat::Thin);
        }
        let mut bad = VolumeRecord {
            id: 1,
            size: 4096,
            mapped_blocks: 0,
            created_unix_s: 0,
            layers: vec![Frame::plain(1)],
            format: VolumeFormat::Thin,
        }
        .encode();
        let at = bad.len() - VOLUME_RECORD_TRAILER_BYTES;
        bad[at] = 9;
        assert!(matches!(VolumeRecord::decode(&bad), Err(Error::Corrupt(_))));
        assert!(VolumeRecord::decode(&bad[..bad.len() - 1]).is_err());
    }

    #[test]
    fn volume_record_round_trips_windowed_frames_and_rejects_bad_windows() {
        let r = VolumeRecord {
            id: 5,
            size: 1 << 30,
            mapped_blocks: 3,
            created_unix_s: 1,
            layers: vec![
                Frame::plain(2),
                Frame {
                    layer: FLOOR_LAYER,
                    lo: 10,
                    hi: 20,
                    src_lo: 0,
                },
                Frame {
                    layer: 7,
                    lo: 10,
                    hi: 20,
                    src_lo: 500,
                },
                Frame::plain(8),
            ],
            format: VolumeFormat::LazyZeroedThick,
        };
        let bytes = r.encode();
        assert_eq!(VolumeRecord::decode(&bytes).expect("decode"), r);
        // An empty window, a window past u64 in the layer, a truncated list, a windowed top.
        let windows_at = VOLUME_RECORD_FIXED_BYTES + 8 * 4 + VOLUME_RECORD_TRAILER_BYTES;
        let mut empty = bytes.clone();
        let hi_at = windows_at + 4 + 4 + 8;
        empty[hi_at..hi_at + 8].copy_from_slice(&10u64.to_le_bytes());
        assert!(matches!(
            VolumeRecord::decode(&empty),
            Err(Error::Corrupt(_))
        ));
        let mut overflow = bytes.clone();
        let src_at = windows_at + 4 + WINDOW_BYTES + 4 + 16;
        overflow[src_at..src_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            VolumeRecord::decode(&overflow),
            Err(Error::Corrupt(_))
        ));
        assert!(VolumeRecord::decode(&bytes[..bytes.len() - 3]).is_err());
        let mut top = r.clone();
        top.layers[3].lo = 1;
        assert!(VolumeRecord::decode(&top.encode()).is_err());
    }

    #[test]
    fn volume_format_names_parse_back() {
        for f in VolumeFormat::ALL {
            assert_eq!(f.as_str().parse::<VolumeFormat>().expect("parse"), f);
        }
        assert_eq!(
            "zeroedthick".parse::<VolumeFormat>().expect("parse"),
            VolumeFormat::LazyZeroedThick
        );
        assert!("thick".parse::<VolumeFormat>().is_err());
    }

    #[test]
    fn segment_header_round_trips_and_rejects_corruption() {
        let mut h = encode_segment_header(42);
        assert_eq!(decode_segment_header(&h).expect("decode"), 42);
        h[17] ^= 1;
        assert!(decode_segment_header(&h).is_err());
    }
}
