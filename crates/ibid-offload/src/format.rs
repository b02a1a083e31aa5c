//! The bytes of the objects in a remote: chunk records (inside packs), manifests and the index.
//!
//! All integers are little-endian. Every object ends with the BLAKE3 of everything before it
//! (manifests, index) or carries the BLAKE3 of each chunk's plain bytes (packs), so nothing read
//! back from a remote is trusted before it is checked.
//!
//! ## Chunk record (inside a pack)
//! ```text
//! offset  size  field
//! 0       4     magic: "ICHB" (named by its blocks) or "ICHK" (named by its bytes)
//! 4       32    the chunk's name (below)
//! 36      1     codec: 0 stored as is, 1 LZ4 block
//! 37      4     plain length (bytes, at most CHUNK_BYTES)
//! 41      4     stored length (bytes that follow)
//! 45      ...   stored bytes
//! ```
//! A chunk's name is, for an "ICHB" record, the BLAKE3 (in `derive_key` mode, context
//! [`BLOCKS_NAME_CONTEXT`]) of the fingerprints of its 4 KiB blocks in order, each the BLAKE3 of
//! one block as the pool's dedup keeps it (zero blocks included) — so a push names a chunk
//! from the pool's metadata without reading it, and a restore checks a chunk and gets the
//! fingerprints the pool needs in one pass over its bytes. A chunk whose plain length is not
//! whole blocks (the tail of a volume of 512-byte sectors), and every chunk pushed by format
//! 1, has an "ICHK" record: its name is the BLAKE3 of its plain bytes.
//!
//! A pack is records back to back, nothing else: it can be read without any other object.
//! Its name is the BLAKE3 of its records' headers (magic to stored length, in order): they
//! name every chunk it holds, where and how long, so two packs with one name hold the same
//! chunks at the same places (format 1 named packs by all their bytes; names are only
//! compared, never checked against content).
//!
//! ## Manifest and index
//! ```text
//! 0       8     magic "IBIDMAN1" / "IBIDIDX1"
//! 8       4     format version (FORMAT_VERSION)
//! 12      4     header length H
//! 16      H     header: JSON (manifest: ManifestHeader; index: {})
//! 16+H    4     pack count P
//! ...     32×P  pack names (BLAKE3 of the pack's bytes)
//! ...     8     entry count E
//! ...     E×ENTRY_BYTES entries (below)
//! end-32  32    BLAKE3 of every byte before it
//! ```
//! Entry: chunk index u64 (manifest: the chunk's offset in the volume / CHUNK_BYTES; index: 0),
//! chunk BLAKE3 (32), pack number u32 (into the pack table), record offset u32, stored length
//! u32, plain length u32 — 56 bytes. Manifest entries are in chunk order, index entries in hash
//! order. Chunks that read as zeros have no entry.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Bytes of volume one chunk covers (the unit of dedup and of incremental push). Small random
/// writes cost up to this much each in the next incremental push.
pub const CHUNK_BYTES: u64 = 64 << 10;
/// A pack is sealed (uploaded) once it holds this many stored bytes.
pub const PACK_BYTES_TARGET: usize = 8 << 20;
/// The most bytes a pack can hold: it is sealed by the record that takes it to
/// [`PACK_BYTES_TARGET`], which may be a whole chunk stored as is.
pub const PACK_BYTES_MAX: usize = PACK_BYTES_TARGET + RECORD_HEADER_BYTES + CHUNK_BYTES as usize;
/// Bytes of a chunk record's header.
pub const RECORD_HEADER_BYTES: usize = 45;
/// Version of the manifest and index formats; the changelog:
/// - 1: first version.
/// - 2: chunks named by their blocks' fingerprints ("ICHB" records), packs by their records'
///   headers. Format-1 manifests and indexes are read as they are (their "ICHK" records are
///   checked as before); a format-2 bucket is refused by a format-1 ibid.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest manifest and index format this ibid reads.
pub const FORMAT_VERSION_MIN: u32 = 1;
/// The `derive_key` context of the name of a chunk named by its blocks.
pub const BLOCKS_NAME_CONTEXT: &str = "ibid 2026-12 remote chunk named by its 4 KiB blocks";
/// Bytes of the blocks a chunk's name is made of (the pool's dedup unit).
pub const BLOCK_BYTES: usize = 4096;
/// Bytes of one manifest or index entry.
pub const ENTRY_BYTES: usize = 56;
/// Magic of a record whose chunk is named by its plain bytes.
const RECORD_MAGIC_BYTES: &[u8; 4] = b"ICHK";
/// Magic of a record whose chunk is named by its blocks' fingerprints.
const RECORD_MAGIC_BLOCKS: &[u8; 4] = b"ICHB";
/// Magic of a manifest.
pub const MANIFEST_MAGIC: &[u8; 8] = b"IBIDMAN1";
/// Magic of the index.
pub const INDEX_MAGIC: &[u8; 8] = b"IBIDIDX1";
const CODEC_RAW: u8 = 0;
const CODEC_LZ4: u8 = 1;
/// Largest header a manifest may have (a sanity bound on a length read from a remote).
const HEADER_BYTES_MAX: usize = 64 << 10;

/// A chunk's name (see the module doc), a pack's, or an index segment's: a BLAKE3 hash.
pub type Hash = [u8; 32];

/// A block's fingerprint as the pool keeps it (`None`: a zero block).
pub type BlockFingerprint = Option<[u8; 32]>;

/// The name of a chunk whose 4 KiB blocks have fingerprints `fps` (zero blocks `None`).
pub fn blocks_name(fps: &[BlockFingerprint]) -> Hash {
    static ZERO: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    let zero = ZERO.get_or_init(|| *blake3::hash(&[0u8; BLOCK_BYTES]).as_bytes());
    let mut h = blake3::Hasher::new_derive_key(BLOCKS_NAME_CONTEXT);
    for fp in fps {
        h.update(fp.as_ref().unwrap_or(zero));
    }
    *h.finalize().as_bytes()
}

/// How a record names its chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// By its blocks' fingerprints ([`blocks_name`]); whole blocks only.
    Blocks,
    /// By the BLAKE3 of its plain bytes (format 1; a chunk that is not whole blocks).
    Bytes,
}

/// Where a chunk's record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// Index into the pack table of the object that holds it.
    pub pack: u32,
    /// Offset of the record's header in the pack.
    pub offset: u32,
    /// Stored bytes after the header.
    pub stored_len: u32,
    /// Plain bytes.
    pub plain_len: u32,
}

/// One chunk of a snapshot (manifest) or of the bucket (index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Offset in the volume / [`CHUNK_BYTES`] (0 in the index).
    pub chunk: u64,
    /// BLAKE3 of the plain bytes.
    pub hash: Hash,
    /// Where its record is.
    pub at: Location,
}

/// What a manifest says about its snapshot, besides its chunks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ManifestHeader {
    /// The volume the snapshot was taken of.
    pub volume: String,
    /// The snapshot's name.
    pub snapshot: String,
    /// Size of the volume in bytes.
    pub size_bytes: u64,
    /// [`CHUNK_BYTES`] when pushed.
    pub chunk_bytes: u64,
    /// When the snapshot was taken (Unix seconds).
    pub created_unix_s: u64,
    /// When the push completed (Unix seconds).
    pub pushed_unix_s: u64,
    /// Bytes of volume data the snapshot holds (non-zero chunks × their plain length).
    pub data_bytes: u64,
}

/// A decoded manifest or index: header, pack table, entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table<H> {
    /// The header.
    pub header: H,
    /// Pack names, by pack number.
    pub packs: Vec<Hash>,
    /// Entries.
    pub entries: Vec<Entry>,
}

/// Encodes a chunk record named `hash` by `naming`: LZ4 when that saves bytes, else as is.
pub fn encode_record(hash: &Hash, naming: Naming, plain: &[u8], out: &mut Vec<u8>) {
    assert!(plain.len() as u64 <= CHUNK_BYTES && !plain.is_empty());
    assert!(naming == Naming::Bytes || plain.len().is_multiple_of(BLOCK_BYTES));
    let compressed = lz4_flex::block::compress(plain);
    let (codec, stored) = if compressed.len() < plain.len() {
        (CODEC_LZ4, &compressed[..])
    } else {
        (CODEC_RAW, plain)
    };
    out.extend_from_slice(match naming {
        Naming::Blocks => RECORD_MAGIC_BLOCKS,
        Naming::Bytes => RECORD_MAGIC_BYTES,
    });
    out.extend_from_slice(hash);
    out.push(codec);
    out.extend_from_slice(&(plain.len() as u32).to_le_bytes());
    out.extend_from_slice(&(stored.len() as u32).to_le_bytes());
    out.extend_from_slice(stored);
}

/// The name of a pack built of whole records (see the module doc): the BLAKE3 of its records'
/// headers, in order.
///
/// # Panics
/// If `pack` is not records back to back (a pack being uploaded is built here, not read).
pub fn pack_name(pack: &[u8]) -> Hash {
    let mut h = blake3::Hasher::new();
    let mut at = 0;
    while at < pack.len() {
        let header = &pack[at..at + RECORD_HEADER_BYTES];
        h.update(header);
        at += RECORD_HEADER_BYTES + u32_at(header, 41) as usize;
    }
    assert_eq!(at, pack.len(), "a pack ends with a whole record");
    *h.finalize().as_bytes()
}

/// Decodes the record at the start of `bytes` (header and stored bytes) expected to hold chunk
/// `hash`, and checks the plain bytes against it.
pub fn decode_record(bytes: &[u8], hash: &Hash) -> Result<Vec<u8>> {
    let mut plain = Vec::new();
    decode_record_into(bytes, hash, &mut plain)?;
    Ok(plain)
}

/// [`decode_record`], appending the plain bytes to `out` (a restore assembles runs of chunks in
/// one buffer); on an error `out` is left as it was.
pub fn decode_record_into(bytes: &[u8], hash: &Hash, out: &mut Vec<u8>) -> Result<()> {
    decode_record_fps_into(bytes, hash, out, None)
}

/// [`decode_record_into`], also appending to `fps` (when given) the fingerprints of the plain
/// bytes' 4 KiB blocks as `ibid_engine::fingerprint::of_data` computes them — from the same
/// pass that checks a chunk named by its blocks — or leaving it as it was (on an error too)
/// when the plain bytes are not whole blocks.
pub fn decode_record_fps_into(
    bytes: &[u8],
    hash: &Hash,
    out: &mut Vec<u8>,
    fps: Option<&mut Vec<BlockFingerprint>>,
) -> Result<()> {
    decode_pieces_fps_into(&[bytes], hash, out, fps)
}

/// [`decode_record_fps_into`] of a record that arrived in pieces (its bytes back to back, as a
/// response body's chunks are): the stored bytes are copied once, into `out` (a compressed
/// record split across pieces is gathered first).
pub fn decode_pieces_fps_into<P: AsRef<[u8]>>(
    pieces: &[P],
    hash: &Hash,
    out: &mut Vec<u8>,
    fps: Option<&mut Vec<BlockFingerprint>>,
) -> Result<()> {
    let bad = |why: &str| Error::Corrupt(format!("chunk {}: {why}", hex(hash)));
    let total: usize = pieces.iter().map(|p| p.as_ref().len()).sum();
    if total < RECORD_HEADER_BYTES {
        return Err(bad("no record header where the index says"));
    }
    let mut header = [0u8; RECORD_HEADER_BYTES];
    let mut filled = 0;
    for_each_part(pieces, 0..RECORD_HEADER_BYTES, |part| {
        header[filled..filled + part.len()].copy_from_slice(part);
        filled += part.len();
    });
    let naming = match &header[0..4] {
        m if m == RECORD_MAGIC_BLOCKS => Naming::Blocks,
        m if m == RECORD_MAGIC_BYTES => Naming::Bytes,
        _ => return Err(bad("no record header where the index says")),
    };
    if &header[4..36] != hash {
        return Err(bad("the record names another chunk"));
    }
    let codec = header[36];
    let plain_len = u32_at(&header, 37) as usize;
    let stored_len = u32_at(&header, 41) as usize;
    if plain_len as u64 > CHUNK_BYTES || total < RECORD_HEADER_BYTES + stored_len {
        return Err(bad("lengths out of bounds"));
    }
    let stored = RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + stored_len;
    let start = out.len();
    let decoded = match codec {
        CODEC_RAW if stored_len == plain_len => {
            out.reserve(stored_len);
            for_each_part(pieces, stored, |part| out.extend_from_slice(part));
            Ok(())
        }
        CODEC_RAW => Err(bad("plain length differs")),
        CODEC_LZ4 => {
            let mut parts: Vec<&[u8]> = Vec::new();
            for_each_part(pieces, stored, |part| parts.push(part));
            let gathered;
            let compressed = match parts[..] {
                [one] => one,
                _ => {
                    gathered = parts.concat();
                    &gathered[..]
                }
            };
            out.resize(start + plain_len, 0);
            match lz4_flex::block::decompress_into(compressed, &mut out[start..]) {
                Ok(n) if n == plain_len => Ok(()),
                Ok(_) => Err(bad("plain length differs")),
                Err(e) => Err(bad(&format!("LZ4: {e}"))),
            }
        }
        _ => Err(bad("unknown codec")),
    };
    let whole = plain_len.is_multiple_of(BLOCK_BYTES);
    let checked = decoded.and_then(|()| {
        let plain = &out[start..];
        let blocks = (whole && (naming == Naming::Blocks || fps.is_some()))
            .then(|| ibid_engine::fingerprint::of_data(plain));
        let name = match (naming, &blocks) {
            (Naming::Blocks, Some(b)) => blocks_name(b),
            (Naming::Blocks, None) => return Err(bad("named by blocks but not whole blocks")),
            (Naming::Bytes, _) => *blake3::hash(plain).as_bytes(),
        };
        match &name == hash {
            true => Ok(blocks),
            false => Err(bad("BLAKE3 mismatch")),
        }
    });
    match checked {
        Ok(blocks) => {
            if let (Some(fps), Some(b)) = (fps, blocks) {
                fps.extend(b);
            }
            Ok(())
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}

/// Calls `f` with the parts of `pieces` (taken as one run of bytes) that make up `range`, in
/// order; `range` is within their total length.
fn for_each_part<'a, P: AsRef<[u8]>>(
    pieces: &'a [P],
    range: std::ops::Range<usize>,
    mut f: impl FnMut(&'a [u8]),
) {
    let mut at = 0;
    for piece in pieces {
        let piece = piece.as_ref();
        let end = at + piece.len();
        if end > range.start && at < range.end {
            f(&piece[range.start.saturating_sub(at)..range.end.min(end) - at]);
        }
        if end >= range.end {
            break;
        }
        at = end;
    }
}

/// Encodes a manifest or index.
pub fn encode_table<H: Serialize>(magic: &[u8; 8], t: &Table<H>) -> Vec<u8> {
    let header = serde_json::to_vec(&t.header).expect("headers serialize");
    let mut out = Vec::with_capacity(64 + header.len() + t.entries.len() * ENTRY_BYTES);
    out.extend_from_slice(magic);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&(t.packs.len() as u32).to_le_bytes());
    for p in &t.packs {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(&(t.entries.len() as u64).to_le_bytes());
    for e in &t.entries {
        assert!((e.at.pack as usize) < t.packs.len());
        out.extend_from_slice(&e.chunk.to_le_bytes());
        out.extend_from_slice(&e.hash);
        out.extend_from_slice(&e.at.pack.to_le_bytes());
        out.extend_from_slice(&e.at.offset.to_le_bytes());
        out.extend_from_slice(&e.at.stored_len.to_le_bytes());
        out.extend_from_slice(&e.at.plain_len.to_le_bytes());
    }
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// Decodes a manifest or index, checking its checksum, version and bounds.
pub fn decode_table<H: for<'de> Deserialize<'de>>(
    magic: &[u8; 8],
    bytes: &[u8],
) -> Result<Table<H>> {
    let bad = |why: String| Error::Corrupt(why);
    if bytes.len() < 16 + 4 + 8 + 32 || &bytes[..8] != magic {
        return Err(bad("not a manifest or index (bad magic)".into()));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    if blake3::hash(body).as_bytes() != sum {
        return Err(bad("checksum mismatch".into()));
    }
    let version = u32_at(body, 8);
    if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&version) {
        return Err(bad(format!(
            "format version {version}; this ibid reads {FORMAT_VERSION_MIN} to {FORMAT_VERSION}"
        )));
    }
    let header_len = u32_at(body, 12) as usize;
    if header_len > HEADER_BYTES_MAX || body.len() < 16 + header_len + 4 {
        return Err(bad("header length out of bounds".into()));
    }
    let header: H = serde_json::from_slice(&body[16..16 + header_len])
        .map_err(|e| bad(format!("header: {e}")))?;
    let mut at = 16 + header_len;
    let pack_count = u32_at(body, at) as usize;
    at += 4;
    if body.len() < at + pack_count * 32 + 8 {
        return Err(bad("pack table out of bounds".into()));
    }
    let packs: Vec<Hash> = (0..pack_count)
        .map(|i| hash_at(body, at + i * 32))
        .collect();
    at += pack_count * 32;
    let entry_count = u64_at(body, at);
    at += 8;
    if (body.len() - at) as u64 != entry_count.saturating_mul(ENTRY_BYTES as u64) {
        return Err(bad("entry count does not match the length".into()));
    }
    let mut entries = Vec::with_capacity(entry_count as usize);
    for e in body[at..].chunks_exact(ENTRY_BYTES) {
        let entry = Entry {
            chunk: u64_at(e, 0),
            hash: hash_at(e, 8),
            at: Location {
                pack: u32_at(e, 40),
                offset: u32_at(e, 44),
                stored_len: u32_at(e, 48),
                plain_len: u32_at(e, 52),
            },
        };
        if entry.at.pack as usize >= packs.len() || entry.at.plain_len as u64 > CHUNK_BYTES {
            return Err(bad("entry out of bounds".into()));
        }
        entries.push(entry);
    }
    Ok(Table {
        header,
        packs,
        entries,
    })
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn hash_at(b: &[u8], at: usize) -> Hash {
    b[at..at + 32].try_into().expect("32 bytes")
}

/// Lower-case hex of a hash (object names).
pub fn hex(h: &Hash) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// A hash from its hex (an object name), if it is one.
pub fn unhex(s: &str) -> Option<Hash> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record round-trips, compressible or not, named either way, and any flipped byte is
    /// caught; a chunk named by its blocks gives the pool's fingerprints of its blocks, one
    /// named by its bytes too when it is whole blocks.
    /// A record cut in pieces anywhere (in its header, at its edge, inside its stored bytes,
    /// empty pieces too) decodes as the whole record does, raw or compressed; one cut short is
    /// refused and leaves `out` as it was.
    #[test]
    fn a_record_in_pieces_decodes_as_the_whole_record() {
        let noise: Vec<u8> = (0..16384u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for plain in [vec![7u8; 16384], noise] {
            let fps = ibid_engine::fingerprint::of_data(&plain);
            let hash = blocks_name(&fps);
            let mut rec = Vec::new();
            encode_record(&hash, Naming::Blocks, &plain, &mut rec);
            for cuts in [
                vec![],
                vec![0, 1, 44, 45, 46],
                vec![3, 45, 45, 4096, rec.len() - 1],
                (0..rec.len()).step_by(1000).collect(),
                vec![rec.len()],
            ] {
                let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(rec.len())).collect();
                bounds.extend([0, rec.len()]);
                bounds.sort_unstable();
                let pieces: Vec<&[u8]> = bounds.windows(2).map(|w| &rec[w[0]..w[1]]).collect();
                let (mut out, mut got) = (vec![1u8], Vec::new());
                decode_pieces_fps_into(&pieces, &hash, &mut out, Some(&mut got)).expect("decode");
                assert_eq!((&out[1..], &got), (&plain[..], &fps), "cuts {cuts:?}");
                let short = &pieces[..pieces.len() - 1];
                if short.iter().map(|p| p.len()).sum::<usize>() < rec.len() {
                    let mut out = vec![1u8];
                    assert!(decode_pieces_fps_into(short, &hash, &mut out, None).is_err());
                    assert_eq!(out, [1]);
                }
            }
        }
    }

    #[test]
    fn records_round_trip_and_catch_damage() {
        let mut zero_block_chunk: Vec<u8> = (0..16384u32).map(|i| (i * 31 % 253) as u8).collect();
        zero_block_chunk[4096..8192].fill(0);
        for plain in [
            vec![7u8; 65536],
            (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect(),
            zero_block_chunk,
            (0..1536u32).map(|i| (i % 7) as u8).collect(),
        ] {
            let whole = plain.len().is_multiple_of(BLOCK_BYTES);
            let expected_fps = whole.then(|| ibid_engine::fingerprint::of_data(&plain));
            for naming in [Naming::Blocks, Naming::Bytes] {
                let hash = match (naming, &expected_fps) {
                    (Naming::Blocks, Some(fps)) => blocks_name(fps),
                    (Naming::Blocks, None) => continue,
                    (Naming::Bytes, _) => *blake3::hash(&plain).as_bytes(),
                };
                let mut rec = Vec::new();
                encode_record(&hash, naming, &plain, &mut rec);
                assert_eq!(decode_record(&rec, &hash).expect("decode"), plain);
                let (mut out, mut fps) = (vec![9u8], Vec::new());
                decode_record_fps_into(&rec, &hash, &mut out, Some(&mut fps)).expect("decode");
                assert_eq!(out[1..], plain[..]);
                assert_eq!(fps, expected_fps.clone().unwrap_or_default(), "{naming:?}");
                for i in [0, 3, 5, 36, 40, RECORD_HEADER_BYTES, rec.len() - 1] {
                    let mut bad = rec.clone();
                    bad[i] ^= 1;
                    let mut fps = Vec::new();
                    assert!(
                        decode_record_fps_into(&bad, &hash, &mut out, Some(&mut fps)).is_err(),
                        "{naming:?}: flip at {i} went unnoticed"
                    );
                    assert!(out.len() == 1 + plain.len() && fps.is_empty());
                }
                // The other naming's magic on the same record does not pass.
                let mut other = rec.clone();
                other[..4].copy_from_slice(match naming {
                    Naming::Blocks => RECORD_MAGIC_BYTES,
                    Naming::Bytes => RECORD_MAGIC_BLOCKS,
                });
                assert!(decode_record(&other, &hash).is_err());
            }
        }
        // A block's name is not its bytes' name, and zero blocks count.
        let plain = vec![0u8; 8192];
        assert_ne!(blocks_name(&[None, None]), *blake3::hash(&plain).as_bytes());
        assert_ne!(blocks_name(&[None, None]), blocks_name(&[None]));
    }

    /// A table round-trips; a flipped byte or a truncation is refused.
    #[test]
    fn tables_round_trip_and_catch_damage() {
        let t = Table {
            header: serde_json::json!({"volume": "v"}),
            packs: vec![[1; 32], [2; 32]],
            entries: vec![Entry {
                chunk: 9,
                hash: [3; 32],
                at: Location {
                    pack: 1,
                    offset: 45,
                    stored_len: 10,
                    plain_len: 65536,
                },
            }],
        };
        let bytes = encode_table(MANIFEST_MAGIC, &t);
        let back: Table<serde_json::Value> = decode_table(MANIFEST_MAGIC, &bytes).expect("decode");
        assert_eq!(back, t);
        assert!(decode_table::<serde_json::Value>(INDEX_MAGIC, &bytes).is_err());
        assert!(
            decode_table::<serde_json::Value>(MANIFEST_MAGIC, &bytes[..bytes.len() - 1]).is_err()
        );
        let mut bad = bytes.clone();
        bad[30] ^= 1;
        assert!(decode_table::<serde_json::Value>(MANIFEST_MAGIC, &bad).is_err());
        // Format 1 is read; a later format is refused.
        let with_version = |version: u32| {
            let mut b = bytes[..bytes.len() - 32].to_vec();
            b[8..12].copy_from_slice(&version.to_le_bytes());
            let sum = blake3::hash(&b);
            b.extend_from_slice(sum.as_bytes());
            decode_table::<serde_json::Value>(MANIFEST_MAGIC, &b)
        };
        assert_eq!(with_version(1).expect("format 1"), t);
        assert!(with_version(FORMAT_VERSION + 1).is_err());
        assert!(with_version(0).is_err());
    }

    /// A pack's name covers every record header (which chunk, where, how long), and only
    /// them.
    #[test]
    fn a_pack_is_named_by_its_record_headers() {
        let mut pack = Vec::new();
        let (a, b) = (
            vec![1u8; 8192],
            (0..4096u32).map(|i| i as u8).collect::<Vec<_>>(),
        );
        let mut second = 0;
        for plain in [&a, &b] {
            second = pack.len();
            let hash = blocks_name(&ibid_engine::fingerprint::of_data(plain));
            encode_record(&hash, Naming::Blocks, plain, &mut pack);
        }
        let name = pack_name(&pack);
        for at in [0, 4, 36, 38, second + 10] {
            let mut other = pack.clone();
            other[at] ^= 1;
            assert_ne!(pack_name(&other), name, "header byte {at}");
        }
        let mut payload = pack.clone();
        payload[second + RECORD_HEADER_BYTES + 1] ^= 1;
        assert_eq!(pack_name(&payload), name);
        assert_ne!(pack_name(&pack[..second]), name);
    }

    #[test]
    fn hex_round_trips() {
        let h = *blake3::hash(b"x").as_bytes();
        assert_eq!(unhex(&hex(&h)), Some(h));
        assert_eq!(unhex("zz"), None);
    }
}
