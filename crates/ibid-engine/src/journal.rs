//! The journal: a flush costs one write and one fdatasync of a small log, not a metadata
//! commit.
//!
//! Every change a write makes to the dirty state is also appended, in memory, to the pending
//! journal, in the order the changes happen: a new chunk (where its record lies in a segment),
//! map entries installed in a volume's top layer, a range of blocks zeroed. [`Journal::flush`]
//! writes the pending records to a journal file and fdatasyncs it. The commit (`commit.rs`)
//! remains what makes metadata durable in the store; the journal covers only the changes since
//! the last commit and is replayed on top of it at open.
//!
//! # Files
//! `POOL/journal.0` and `POOL/journal.1`, pre-written with zeros so that a flush overwrites
//! (an fdatasync then has no file size or extent to persist). Every record carries the *stamp*
//! of the commit batch its change belongs to (`cut + 1` while the writer holds the gate). Batch
//! `s` is journaled in file `s % 2`, starting at offset 0. Commits are serialized, so when a
//! file restarts for batch `s` (batch `s - 1` has been cut, so commit `s - 2` has finished), its
//! old content is an older batch that is committed, or was empty (then its records change
//! nothing). Flushes write the files with `O_DIRECT` where the filesystem allows it, in whole
//! pages: the batch's partial last page is rewritten with the same bytes, and the new last page
//! is padded with zeros, which no record header matches.
//!
//! # Record format (little-endian)
//! ```text
//! header 24 B: magic u32 "IBJL" | kind u8 | reserved [u8; 3] | body length u32 | stamp u64 |
//!              crc32c u32 of header bytes 0..20 and the body
//! kind 1, chunk:   chunk id u64 | segment u64 | offset u32 | stored length u32 | record crc u32 |
//!                  flags u16 | inline u8 | reserved u8 | fingerprint [u8; 32] |
//!                  payload (stored length bytes, only if inline)
//! kind 2, install: volume id u64 | count u32 | reserved u32 | count × (block u64, chunk id u64),
//!                  chunk id 0 meaning "reads as zeros"
//! kind 3, zero:    volume id u64 | first block u64 | end block u64 (exclusive)
//! ```
//!
//! # Data before metadata
//! A chunk record points at a record appended to a segment. A flush either syncs the segments
//! first (the chunk records then point at durable data), or, when the new data is small, carries
//! each payload inline so that the whole flush is one fdatasync; replay appends inline payloads
//! to a fresh segment.
//!
//! # Recovery
//! Open reads the last committed batch `C` and replays each file whose batch is newer, lower
//! stamp first, each up to the first record that is torn, fails its checksum or carries another
//! stamp. Flushes are serialized and each ends with an fdatasync, and a flush that carries two
//! batches (the rest of the one being committed, the first changes of the next) writes and
//! fdatasyncs the older one's file before it writes the newer one's: so the records replayed
//! are a prefix of what was journaled — never a newer batch's changes without all of the older
//! one's, on which they may depend (a chunk it wrote) — and a completed flush's records are
//! all in it. Replay runs the
//! changes through the normal write path (reference counts are recomputed, not journaled) and
//! one commit makes them durable. The commit counter then resumes past every stamp a record can
//! carry (the highest replayed, and at least [`BATCHES_IN_FLIGHT`] + [`EMPTY_BATCHES_MAX`]
//! past the recorded commit number, which empty commits may leave behind): a
//! record that outlived a power cut further into a file, behind one that did not (the pages of
//! an interrupted write may reach the disk in any order), can then never be taken for part of
//! a later batch.

use crate::commit_state::Batches;
use crate::direct_io::{AlignedBuf, PAGE_BYTES};
use crate::disk::{Disk, DiskFile, OpenMode};
use crate::error::{Error, Result};
use crate::format::{ChunkRecord, Fingerprint, NewChunkRecord, RECORD_HEADER_BYTES};
use crate::overlay::Entry;
use crate::segment::Segments;
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;

/// Magic at the start of every journal record ("IBJL").
pub const JOURNAL_MAGIC: u32 = 0x4c4a_4249;
/// Size of a journal record header.
pub const JOURNAL_HEADER_BYTES: usize = 24;
/// Bytes of zeros each journal file is created with.
pub const JOURNAL_PREWRITTEN_BYTES: u64 = 4 << 20;
/// A journal file never grows past this: a flush that would need more commits instead.
pub const JOURNAL_FILE_BYTES_MAX: u64 = 128 << 20;
/// A flush that leaves its batch's journal file longer than this asks for a commit (once per
/// batch), so that the background thread starts one while there is room left, instead of a
/// later flush finding the file full and committing on its caller's time.
pub const JOURNAL_FILE_BYTES_COMMIT: u64 = JOURNAL_FILE_BYTES_MAX / 4 * 3;
/// New data a flush carries inline at most; above it, the flush syncs the segments instead.
pub const INLINE_BYTES_MAX: u64 = 1 << 20;
/// Batches whose changes may be journaled and not committed at any time: the one a commit is
/// applying and the next (writers stamp `cut + 1`; commits are serialized).
pub const BATCHES_IN_FLIGHT: u64 = 2;

/// Batch numbers an empty commit may use without recording them: an empty batch changes
/// nothing in the store, so its number is made durable only when the pool record lags this
/// far behind (`commit.rs`). Records in the journal files therefore never carry a stamp past
/// the recorded commit number plus `BATCHES_IN_FLIGHT + EMPTY_BATCHES_MAX` (less one).
pub const EMPTY_BATCHES_MAX: u64 = 64;

/// The batch number to resume from at open, given the last committed batch and the highest
/// stamp of a file's first record: past every stamp a record in the files can carry, not only
/// past the highest one read (see the module doc).
pub(crate) fn resume_after(committed: u64, highest_stamp: u64) -> u64 {
    highest_stamp.max(stamps_bound(committed))
}

/// The highest stamp a journal record can carry when the pool record says `committed`.
pub(crate) fn stamps_bound(committed: u64) -> u64 {
    committed + BATCHES_IN_FLIGHT + EMPTY_BATCHES_MAX
}

const KIND_CHUNK: u8 = 1;
const KIND_INSTALL: u8 = 2;
const KIND_ZERO: u8 = 3;
const CHUNK_BODY_BYTES: usize = 64;

/// One journaled change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// A new chunk; `inline` holds its stored payload when the journal carries it.
    Chunk {
        id: u64,
        rec: ChunkRecord,
        fingerprint: Fingerprint,
        inline: Option<Vec<u8>>,
    },
    /// Map entries installed in a volume's top layer, each data entry with a new reference.
    Install {
        volume: u64,
        entries: Vec<(u64, Entry)>,
    },
    /// Blocks `[b0, b1)` of a volume zeroed.
    Zero { volume: u64, b0: u64, b1: u64 },
}

fn file_name(i: usize) -> String {
    format!("journal.{i}")
}

/// Encodes one record (header and body) onto `out`.
pub(crate) fn encode(out: &mut Vec<u8>, stamp: u64, change: &Change) {
    match change {
        Change::Chunk {
            id,
            rec,
            fingerprint,
            inline,
        } => encode_chunk(out, stamp, *id, (rec, fingerprint), inline.as_deref()),
        other => encode_record(out, stamp, other, None),
    }
}

/// Encodes a chunk record carrying `payload` inline, or none.
fn encode_chunk(
    out: &mut Vec<u8>,
    stamp: u64,
    id: u64,
    (rec, fingerprint): (&ChunkRecord, &Fingerprint),
    payload: Option<&[u8]>,
) {
    encode_record(
        out,
        stamp,
        &Change::Chunk {
            id,
            rec: *rec,
            fingerprint: *fingerprint,
            inline: None,
        },
        payload,
    );
}

/// Encodes `change` (for a chunk: with `payload` inline, ignoring its own `inline`).
fn encode_record(out: &mut Vec<u8>, stamp: u64, change: &Change, payload: Option<&[u8]>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; JOURNAL_HEADER_BYTES]);
    let kind = match change {
        Change::Chunk {
            id,
            rec,
            fingerprint,
            ..
        } => {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&rec.segment.to_le_bytes());
            out.extend_from_slice(&rec.offset.to_le_bytes());
            out.extend_from_slice(&rec.stored_len.to_le_bytes());
            out.extend_from_slice(&rec.crc.to_le_bytes());
            out.extend_from_slice(&rec.flags.to_le_bytes());
            out.push(u8::from(payload.is_some()));
            out.push(0);
            out.extend_from_slice(fingerprint);
            if let Some(p) = payload {
                out.extend_from_slice(p);
            }
            KIND_CHUNK
        }
        Change::Install { volume, entries } => {
            out.extend_from_slice(&volume.to_le_bytes());
            out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            for &(block, entry) in entries {
                let id = match entry {
                    Entry::Data(id) => id,
                    Entry::Zero => 0,
                };
                out.extend_from_slice(&block.to_le_bytes());
                out.extend_from_slice(&id.to_le_bytes());
            }
            KIND_INSTALL
        }
        Change::Zero { volume, b0, b1 } => {
            out.extend_from_slice(&volume.to_le_bytes());
            out.extend_from_slice(&b0.to_le_bytes());
            out.extend_from_slice(&b1.to_le_bytes());
            KIND_ZERO
        }
    };
    let body_len = (out.len() - start - JOURNAL_HEADER_BYTES) as u32;
    let h = &mut out[start..start + JOURNAL_HEADER_BYTES];
    h[0..4].copy_from_slice(&JOURNAL_MAGIC.to_le_bytes());
    h[4] = kind;
    h[8..12].copy_from_slice(&body_len.to_le_bytes());
    h[12..20].copy_from_slice(&stamp.to_le_bytes());
    let crc = crate::checksum::crc32c_parts(
        &out[start..start + 20],
        &out[start + JOURNAL_HEADER_BYTES..],
    );
    out[start + 20..start + 24].copy_from_slice(&crc.to_le_bytes());
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Decodes a record body; `None` if it is malformed.
fn decode_body(kind: u8, b: &[u8]) -> Option<Change> {
    match kind {
        KIND_CHUNK if b.len() >= CHUNK_BODY_BYTES => {
            let rec = ChunkRecord {
                segment: u64_at(b, 8),
                offset: u32_at(b, 16),
                stored_len: u32_at(b, 20),
                crc: u32_at(b, 24),
                flags: u16::from_le_bytes([b[28], b[29]]),
                refs: 0,
            };
            let inline = match b[30] {
                0 if b.len() == CHUNK_BODY_BYTES => None,
                1 if b.len() == CHUNK_BODY_BYTES + rec.stored_len as usize => {
                    Some(b[CHUNK_BODY_BYTES..].to_vec())
                }
                _ => return None,
            };
            Some(Change::Chunk {
                id: u64_at(b, 0),
                rec,
                fingerprint: b[32..64].try_into().expect("32 bytes"),
                inline,
            })
        }
        KIND_INSTALL if b.len() >= 16 => {
            let count = u32_at(b, 8) as usize;
            if b.len() != 16 + count.checked_mul(16)? {
                return None;
            }
            let entries = b[16..]
                .chunks_exact(16)
                .map(|e| {
                    let id = u64_at(e, 8);
                    let entry = if id == 0 {
                        Entry::Zero
                    } else {
                        Entry::Data(id)
                    };
                    (u64_at(e, 0), entry)
                })
                .collect();
            Some(Change::Install {
                volume: u64_at(b, 0),
                entries,
            })
        }
        KIND_ZERO if b.len() == 24 => {
            let (b0, b1) = (u64_at(b, 8), u64_at(b, 16));
            (b0 < b1).then_some(Change::Zero {
                volume: u64_at(b, 0),
                b0,
                b1,
            })
        }
        _ => None,
    }
}

/// The records stamped `stamp` at the start of `bytes`, up to the first record that is torn,
/// fails its checksum, is malformed or carries another stamp. Never panics, whatever the bytes.
pub(crate) fn parse(bytes: &[u8], stamp: u64) -> Vec<Change> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while bytes.len() - pos >= JOURNAL_HEADER_BYTES {
        let h = &bytes[pos..pos + JOURNAL_HEADER_BYTES];
        if u32_at(h, 0) != JOURNAL_MAGIC || u64_at(h, 12) != stamp {
            break;
        }
        let body_len = u32_at(h, 8) as usize;
        let Some(end) = (pos + JOURNAL_HEADER_BYTES)
            .checked_add(body_len)
            .filter(|&e| e <= bytes.len())
        else {
            break;
        };
        let body = &bytes[pos + JOURNAL_HEADER_BYTES..end];
        let crc = crate::checksum::crc32c_parts(&h[0..20], body);
        if crc != u32_at(h, 20) {
            break;
        }
        let Some(change) = decode_body(h[4], body) else {
            break;
        };
        out.push(change);
        pos = end;
    }
    out
}

/// The changes journaled after batch `committed`, in order, with their stamps, and the highest
/// stamp either file holds (batches must resume after it, so that no stamp is used twice).
///
/// Each file holds one batch: its records share the stamp of its first one. A file whose batch
/// is `committed` or older is stale. Two files can both be newer: then the lower stamp comes
/// first. (Batches that were empty when cut are never written to the store, so stamps newer
/// than `committed` may skip numbers; their records change nothing.)
pub(crate) fn read(
    disk: &dyn Disk,
    dir: &Path,
    committed: u64,
) -> Result<(Vec<(u64, Change)>, u64)> {
    let mut batches: Vec<(u64, Vec<Change>)> = Vec::new();
    let mut highest = committed;
    for i in 0..2 {
        let bytes = match disk.read(&dir.join(file_name(i))) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io("read journal", e)),
        };
        if bytes.len() < JOURNAL_HEADER_BYTES {
            continue;
        }
        let stamp = u64_at(&bytes, 12);
        let changes = parse(&bytes, stamp);
        if changes.is_empty() {
            continue;
        }
        highest = highest.max(stamp);
        if stamp > committed {
            batches.push((stamp, changes));
        }
    }
    batches.sort_by_key(|(stamp, _)| *stamp);
    let changes = batches
        .into_iter()
        .flat_map(|(stamp, changes)| changes.into_iter().map(move |c| (stamp, c)))
        .collect();
    Ok((changes, highest))
}

struct JournalFile {
    /// The file, buffered: fdatasync, and writes where direct I/O is refused.
    file: Arc<dyn DiskFile>,
    /// The file opened with `O_DIRECT`, where the filesystem allows it.
    direct: Option<Arc<dyn DiskFile>>,
    /// The batch this file currently holds (0: none yet).
    stamp: u64,
    /// Bytes of that batch written.
    len: u64,
    /// The bytes of the batch past its last whole page (`len % PAGE_BYTES` of them): a direct
    /// write starts on the page that holds them and writes them again, unchanged.
    tail: Vec<u8>,
    /// Size of the file on disk.
    size: u64,
}

impl JournalFile {
    /// Writes `bytes` after the batch's `len` bytes. A direct write rewrites the partial last
    /// page with the same bytes and pads the new last page with zeros (replay stops at them):
    /// a torn write can then only damage the new records, which their checksums catch.
    fn append(&mut self, bytes: &[u8], staging: &mut AlignedBuf) -> Result<()> {
        let write = |f: &dyn DiskFile, b: &[u8], at: u64| {
            f.write_all_at(b, at)
                .map_err(|e| Error::io("write journal", e))
        };
        let end = self.len + bytes.len() as u64;
        match &self.direct {
            Some(direct) => {
                let start = self.len - self.tail.len() as u64;
                let need = self.tail.len() + bytes.len() + PAGE_BYTES;
                if staging.capacity() < need {
                    *staging = AlignedBuf::with_capacity(need.next_power_of_two());
                }
                staging.truncate(0);
                staging.push(&self.tail);
                staging.push(bytes);
                let whole = staging.len() / PAGE_BYTES * PAGE_BYTES;
                self.tail.clear();
                self.tail.extend_from_slice(&staging.bytes()[whole..]);
                write(&**direct, staging.padded(), start)?;
                self.size = self.size.max(end.next_multiple_of(PAGE_BYTES as u64));
            }
            None => {
                write(&*self.file, bytes, self.len)?;
                self.size = self.size.max(end);
            }
        }
        self.len = end;
        Ok(())
    }

    /// Starts the file over for batch `stamp`.
    fn restart(&mut self, stamp: u64) {
        self.stamp = stamp;
        self.len = 0;
        self.tail.clear();
    }
}

/// Largest encoded batch buffer a flush keeps for the next ([`Files::encoded`]): room for
/// the inline data a flush carries at most, and its records.
const ENCODED_KEPT_BYTES_MAX: usize = 2 * INLINE_BYTES_MAX as usize;

struct Files {
    files: [JournalFile; 2],
    /// Changes appended (counted from open) that are durable: journaled or committed.
    durable: u64,
    /// Page-aligned staging for direct writes, grown as needed.
    staging: AlignedBuf,
    /// The newest batch whose file's filling a flush has reported ([`FlushOutcome::Filling`]).
    filling_told: u64,
    /// The last flush's encoded batches, refilled by the next: a flush's records (the new
    /// data inline, ~230 KB in a database mix) are encoded into warm memory that has room,
    /// not into vectors grown by copying and faulted in page by page each time.
    encoded: Vec<(u64, Vec<u8>)>,
}

impl Files {
    /// Keeps a flush's encoded batches for the next: room for a flush with inline data, not
    /// what a rare huge one grew.
    fn keep_encoded(&mut self, mut batches: Vec<(u64, Vec<u8>)>) {
        batches.retain(|(_, b)| b.capacity() <= ENCODED_KEPT_BYTES_MAX);
        self.encoded = batches;
    }
}

#[derive(Default)]
struct Pending {
    changes: Vec<(u64, Change)>,
    /// Changes appended since open.
    appended: u64,
    /// Stored bytes of the pending changes' new chunks, with or without their payload.
    new_bytes: u64,
}

impl Pending {
    fn recount(&mut self) {
        self.new_bytes = chunk_bytes(self.changes.iter());
    }
}

/// Stored bytes of the new chunks among `changes`.
fn chunk_bytes<'a>(changes: impl Iterator<Item = &'a (u64, Change)>) -> u64 {
    changes
        .map(|(_, c)| match c {
            Change::Chunk { rec, .. } => rec.stored_len as u64,
            _ => 0,
        })
        .sum()
}

/// The journal of a pool: pending changes in memory, and the two files they are flushed to.
pub(crate) struct Journal {
    pending: Mutex<Pending>,
    files: Mutex<Files>,
}

/// What a flush found to do.
pub(crate) enum FlushOutcome {
    /// Everything asked for is durable.
    Done,
    /// Everything asked for is durable, and the batch's journal file has passed
    /// [`JOURNAL_FILE_BYTES_COMMIT`]: the caller should have a commit started soon (said once
    /// per batch).
    Filling,
    /// The journal file would grow too large: the caller must commit instead.
    NeedsCommit,
}

impl Journal {
    /// Opens (creating if needed) the journal files of the pool in `dir`; with `direct_io`,
    /// flushes write them with `O_DIRECT` where the filesystem allows it, so that their
    /// fdatasync has no dirty pages to write back (only the device's cache to flush).
    pub(crate) fn open(disk: &dyn Disk, dir: &Path, direct_io: bool) -> Result<Journal> {
        let mut created = false;
        let mut open = |i: usize| -> Result<JournalFile> {
            let path = dir.join(file_name(i));
            let file = disk
                .open(&path, OpenMode::Create)
                .map_err(|e| Error::io("open journal", e))?;
            let mut size = file.len().map_err(|e| Error::io("stat journal", e))?;
            if size < JOURNAL_PREWRITTEN_BYTES {
                let zeros = vec![0u8; (JOURNAL_PREWRITTEN_BYTES - size) as usize];
                file.write_all_at(&zeros, size)
                    .and_then(|()| file.sync_data())
                    .map_err(|e| Error::io("prepare journal", e))?;
                size = JOURNAL_PREWRITTEN_BYTES;
                created = true;
            }
            let direct = if direct_io {
                (disk.open_direct(&path)).map_err(|e| Error::io("open journal", e))?
            } else {
                None
            };
            Ok(JournalFile {
                file,
                direct,
                stamp: 0,
                len: 0,
                tail: Vec::with_capacity(PAGE_BYTES),
                size,
            })
        };
        let files = [open(0)?, open(1)?];
        if created {
            (disk.sync_dir(dir)).map_err(|e| Error::io("sync pool directory", e))?;
        }
        Ok(Journal {
            pending: Mutex::new(Pending::default()),
            files: Mutex::new(Files {
                files,
                durable: 0,
                staging: AlignedBuf::with_capacity(1 << 20),
                filling_told: 0,
                encoded: Vec::new(),
            }),
        })
    }

    /// Bytes the journal files take on disk.
    pub(crate) fn disk_bytes(&self) -> u64 {
        self.files.lock().files.iter().map(|f| f.size).sum()
    }

    /// Appends a change of batch `stamp`. Call it where the change becomes visible (with the
    /// map or shard lock that orders it held), so the journal's order is the order of changes.
    pub(crate) fn append(&self, stamp: u64, change: Change) {
        let mut p = self.pending.lock();
        // A batch's changes follow the earlier batches' (a file holds one batch, in order).
        debug_assert!(p.changes.last().is_none_or(|(s, _)| *s <= stamp));
        if let Change::Chunk { rec, .. } = &change {
            p.new_bytes += rec.stored_len as u64;
        }
        p.changes.push((stamp, change));
        p.appended += 1;
    }

    /// Appends new chunks of batch `stamp` (id, record, stored payload), in order. Each keeps
    /// a copy of its payload while the pending new data stays within what a flush carries
    /// inline ([`INLINE_BYTES_MAX`]), so that the flush need not read it back from its segment
    /// (from the device, once a direct write has put it there).
    pub(crate) fn append_chunks<'a>(
        &self,
        stamp: u64,
        chunks: impl IntoIterator<Item = (u64, NewChunkRecord, &'a [u8])>,
    ) {
        let mut p = self.pending.lock();
        debug_assert!(p.changes.last().is_none_or(|(s, _)| *s <= stamp));
        for (id, new, payload) in chunks {
            p.new_bytes += new.rec.stored_len as u64;
            let inline = (p.new_bytes <= INLINE_BYTES_MAX).then(|| payload.to_vec());
            p.changes.push((
                stamp,
                Change::Chunk {
                    id,
                    rec: new.rec,
                    fingerprint: new.fingerprint,
                    inline,
                },
            ));
            p.appended += 1;
        }
    }

    /// Forgets pending changes of batches up to `committed`: the store now holds them.
    pub(crate) fn forget_through(&self, committed: u64) {
        let mut p = self.pending.lock();
        if p.changes.first().is_some_and(|(s, _)| *s <= committed) {
            p.changes.retain(|(s, _)| *s > committed);
            p.recount();
        }
        if p.changes.is_empty() {
            let appended = p.appended;
            drop(p);
            let mut f = self.files.lock();
            f.durable = f.durable.max(appended);
        }
    }

    /// Makes every change appended before the call durable: writes the pending changes to the
    /// journal files and fdatasyncs them. Concurrent callers queue, and a caller whose changes
    /// an earlier flush already covered returns at once (group commit).
    pub(crate) fn flush(&self, segments: &Segments, batches: &Batches) -> Result<FlushOutcome> {
        let target = self.pending.lock().appended;
        let mut files = self.files.lock();
        if files.durable >= target {
            return Ok(FlushOutcome::Done);
        }
        let (changes, upto) = {
            let mut p = self.pending.lock();
            p.new_bytes = 0;
            (std::mem::take(&mut p.changes), p.appended)
        };
        let committed = batches.committed();
        let live: Vec<&(u64, Change)> = changes.iter().filter(|(s, _)| *s > committed).collect();
        let new_bytes = chunk_bytes(live.iter().copied());
        // Small flushes carry the new chunks' data inline (one fdatasync); a flush whose
        // inline data would overfill the journal file syncs the segments and journals only
        // the metadata instead; only when even that does not fit must the caller commit (which
        // may mean waiting for a long commit already running).
        let mut batches = std::mem::take(&mut files.encoded);
        let mut fits = false;
        for inline in [new_bytes <= INLINE_BYTES_MAX, false] {
            if !inline {
                segments.sync()?;
            }
            encode_batches(segments, committed, &live, inline, &mut batches)?;
            fits = batches.iter().all(|(stamp, bytes)| {
                let f = &files.files[(*stamp % 2) as usize];
                let start = if f.stamp == *stamp { f.len } else { 0 };
                start + bytes.len() as u64 <= JOURNAL_FILE_BYTES_MAX
            });
            if fits || !inline {
                break;
            }
        }
        if !fits {
            files.keep_encoded(batches);
            // Put the changes back; the caller's commit will cover them.
            let mut p = self.pending.lock();
            let newer = std::mem::take(&mut p.changes);
            p.changes = changes;
            p.changes.extend(newer);
            p.recount();
            return Ok(FlushOutcome::NeedsCommit);
        }
        let Files {
            files: journal_files,
            staging,
            filling_told,
            ..
        } = &mut *files;
        let mut filling = false;
        // Oldest batch first, each file synced before the next is written: the newer batch's
        // changes may depend on the older one's (an entry referencing a chunk it wrote), and
        // recovery replays each file up to its first damaged record — so a newer batch's
        // records must never reach the disk while the older one's are still in flight.
        for (stamp, bytes) in &batches {
            let f = &mut journal_files[(*stamp % 2) as usize];
            if f.stamp != *stamp {
                f.restart(*stamp);
            }
            f.append(bytes, staging)?;
            f.file
                .sync_data()
                .map_err(|e| Error::io("sync journal", e))?;
            if f.len > JOURNAL_FILE_BYTES_COMMIT && *filling_told < *stamp {
                *filling_told = *stamp;
                filling = true;
            }
        }
        assert!(
            upto >= files.durable,
            "the journal's durable count went back"
        );
        files.durable = upto;
        files.keep_encoded(batches);
        Ok(if filling {
            FlushOutcome::Filling
        } else {
            FlushOutcome::Done
        })
    }
}

/// Encodes `live` changes per batch (a batch goes to file `stamp % 2`) into `out`, reusing its
/// vectors, with the new chunks' data inline when `inline` (the copy kept since the append,
/// else read back from the segment).
fn encode_batches(
    segments: &Segments,
    committed: u64,
    live: &[&(u64, Change)],
    inline: bool,
    out: &mut Vec<(u64, Vec<u8>)>,
) -> Result<()> {
    let mut used = 0;
    for (stamp, change) in live.iter().copied() {
        if used == 0 || out[used - 1].0 != *stamp {
            if used == out.len() {
                out.push((*stamp, Vec::new()));
            }
            out[used].0 = *stamp;
            out[used].1.clear();
            used += 1;
        }
        let buf = &mut out[used - 1].1;
        match change {
            Change::Chunk {
                id,
                rec,
                fingerprint,
                inline: Some(payload),
            } if inline => encode_chunk(buf, *stamp, *id, (rec, fingerprint), Some(payload)),
            Change::Chunk {
                id,
                rec,
                fingerprint,
                ..
            } if inline => {
                let Some(record) = segments.read_record(rec.segment, rec.offset, rec.stored_len)?
                else {
                    // Its segment is gone: only a commit of its batch can have freed it.
                    if committed >= *stamp {
                        continue;
                    }
                    return Err(Error::Corrupt(format!(
                        "journal: chunk {id:#x} of an uncommitted batch has no segment"
                    )));
                };
                encode_chunk(
                    buf,
                    *stamp,
                    *id,
                    (rec, fingerprint),
                    Some(&record[RECORD_HEADER_BYTES..]),
                );
            }
            other => encode_record(buf, *stamp, other, None),
        }
    }
    out.truncate(used);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::{Disk, SimDisk};
    use proptest::prelude::*;

    fn chunk(id: u64, inline: Option<Vec<u8>>) -> Change {
        Change::Chunk {
            id,
            rec: ChunkRecord {
                segment: 7,
                offset: 64,
                stored_len: inline.as_ref().map_or(100, |p| p.len() as u32),
                crc: 0xdead_beef,
                flags: 1,
                refs: 0,
            },
            fingerprint: [id as u8; 32],
            inline,
        }
    }

    fn sample() -> Vec<Change> {
        vec![
            chunk(0x40, None),
            chunk(0x81, Some(vec![9u8; 33])),
            Change::Install {
                volume: 3,
                entries: vec![(5, Entry::Data(0x40)), (6, Entry::Zero)],
            },
            Change::Zero {
                volume: 3,
                b0: 10,
                b1: 1 << 40,
            },
        ]
    }

    fn encode_all(stamp: u64, changes: &[Change]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in changes {
            encode(&mut out, stamp, c);
        }
        out
    }

    /// A scratch directory on the checkout's filesystem (direct I/O works there; `/tmp` may be
    /// a tmpfs, which refuses it).
    fn scratch() -> tempfile::TempDir {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
        std::fs::create_dir_all(&base).expect("target directory");
        tempfile::tempdir_in(base).expect("tempdir")
    }

    #[test]
    fn appends_in_pieces_keep_every_record_with_and_without_direct_io() {
        for direct_io in [false, true] {
            let dir = scratch();
            let journal = Journal::open(&crate::disk::FsDisk, dir.path(), direct_io).expect("open");
            let mut files = journal.files.lock();
            assert_eq!(files.files[0].direct.is_some(), direct_io);
            let Files {
                files: f, staging, ..
            } = &mut *files;
            let content = || std::fs::read(dir.path().join("journal.0")).expect("read");
            // Batch 4 in appends of odd sizes: within a page, across pages, and one larger
            // than the staging buffer (1 MiB), which must grow.
            f[0].restart(4);
            let mut expected = Vec::new();
            for (n, len) in [(1, 100), (3, 333), (70, 90), (2, 4000), (300, 4096), (5, 7)] {
                let changes: Vec<Change> = (0..n)
                    .map(|i| chunk(expected.len() as u64 + i, Some(vec![i as u8; len])))
                    .collect();
                f[0].append(&encode_all(4, &changes), staging)
                    .expect("append");
                expected.extend(changes);
                assert_eq!(parse(&content(), 4), expected);
            }
            // The file restarts for batch 6: batch 4's records after it are not replayed.
            f[0].restart(6);
            f[0].append(&encode_all(6, &sample()), staging)
                .expect("append");
            assert_eq!(parse(&content(), 6), sample());
            assert!(f[0].size >= f[0].len);
        }
    }

    #[test]
    fn batches_resume_past_every_stamp_the_files_can_hold() {
        // Nothing replayed, or only the batch the crash interrupted the commit of: a record of
        // the next batch, numbered past unrecorded empty ones, may still lie further into its
        // file.
        let bound = 5 + BATCHES_IN_FLIGHT + EMPTY_BATCHES_MAX;
        assert_eq!(resume_after(5, 5), bound);
        assert_eq!(resume_after(5, 7), bound);
        assert_eq!(resume_after(5, bound), bound);
    }

    #[test]
    fn round_trip() {
        let bytes = encode_all(5, &sample());
        assert_eq!(parse(&bytes, 5), sample());
    }

    #[test]
    fn other_stamps_and_stale_tails_are_not_replayed() {
        let mut bytes = encode_all(5, &sample());
        assert!(parse(&bytes, 4).is_empty());
        assert!(parse(&bytes, 7).is_empty());
        // A stale tail from batch 3 after batch 5's records.
        bytes.extend(encode_all(3, &sample()));
        assert_eq!(parse(&bytes, 5), sample());
    }

    #[test]
    fn torn_or_flipped_records_end_the_journal() {
        let bytes = encode_all(5, &sample());
        let first_two = {
            let mut b = Vec::new();
            encode(&mut b, 5, &sample()[0]);
            encode(&mut b, 5, &sample()[1]);
            b.len()
        };
        // Torn inside the third record: the first two survive.
        assert_eq!(parse(&bytes[..first_two + 30], 5), sample()[..2].to_vec());
        // A bit flipped in the third record's body: the same.
        let mut flipped = bytes.clone();
        flipped[first_two + JOURNAL_HEADER_BYTES + 3] ^= 0x10;
        assert_eq!(parse(&flipped, 5), sample()[..2].to_vec());
        // Zeros (a pre-written file) are no record.
        assert!(parse(&vec![0u8; 4096], 0).is_empty());
    }

    #[test]
    fn the_fuzz_corpus_holds_valid_journals() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/journal");
        let bytes = std::fs::read(format!("{dir}/chunks_and_installs")).expect("corpus file");
        assert_eq!(parse(&bytes, 3), sample());
        for entry in std::fs::read_dir(dir).expect("corpus") {
            let bytes = std::fs::read(entry.expect("entry").path()).expect("corpus file");
            crate::fuzzing::journal_bytes(&bytes);
            assert!(!parse(&bytes, 3).is_empty());
        }
    }

    /// A flush that carries the rest of the batch being committed (5) and the first changes of
    /// the next (6), cut at every point and with every way the disk may keep its unsynced
    /// writes: batch 6's changes are replayed only when all of batch 5's are, since they may
    /// depend on them (an entry of 6 referencing a chunk 5 wrote: replayed without it, the
    /// pool would not open).
    #[test]
    fn a_batch_is_replayed_only_behind_the_whole_batch_before_it() {
        let dir = Path::new("/p");
        let earlier: Vec<Change> = (0..40)
            .map(|i| chunk(0x100 + i, Some(vec![i as u8; 600])))
            .collect();
        let later = vec![
            Change::Install {
                volume: 3,
                entries: vec![(5, Entry::Data(0x100)), (6, Entry::Zero)],
            },
            Change::Zero {
                volume: 3,
                b0: 10,
                b1: 20,
            },
        ];
        let mut broke = 0;
        for seed in 0..64 {
            for cut in 1..=6 {
                let disk = SimDisk::new(seed, 1 << 30);
                disk.create_dir_all(dir).expect("dir");
                let (segments, _) = Segments::open_on(
                    Arc::new(disk.clone()),
                    &dir.join("segments"),
                    crate::segment::SegmentOptions {
                        writers: 1,
                        segment_bytes_max: 1 << 20,
                        next_id: 1,
                        direct_io: false,
                        threads: false,
                        open_files_max: 0,
                    },
                )
                .expect("segments");
                let journal = Journal::open(&disk, dir, false).expect("open");
                // Batch 5 is being committed (cut; batch 4 committed); batch 6 is dirty.
                let batches = Batches::resume(4);
                batches.cut();
                for c in &earlier {
                    journal.append(5, c.clone());
                }
                for c in &later {
                    journal.append(6, c.clone());
                }
                disk.cut_after(cut);
                let flushed = journal.flush(&segments, &batches).is_ok();
                disk.power_cut();
                let (replayed, _) = read(&disk, dir, 4).expect("read");
                let of = |stamp| replayed.iter().filter(|(s, _)| *s == stamp).count();
                if flushed {
                    assert_eq!((of(5), of(6)), (earlier.len(), later.len()), "seed {seed}");
                }
                if of(6) > 0 && of(5) < earlier.len() {
                    broke += 1;
                }
            }
        }
        assert_eq!(broke, 0, "runs replaying batch 6 without all of batch 5");
    }

    proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), stamp in 0u64..4) {
            let _ = parse(&bytes, stamp);
        }

        #[test]
        fn any_corruption_yields_a_prefix(at in 0usize..400, bit in 0u8..8) {
            let mut bytes = encode_all(2, &sample());
            let at = at % bytes.len();
            bytes[at] ^= 1 << bit;
            let got = parse(&bytes, 2);
            prop_assert!(got.len() < sample().len());
            prop_assert_eq!(&got[..], &sample()[..got.len()]);
        }
    }
}
