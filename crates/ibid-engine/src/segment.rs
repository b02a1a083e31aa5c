//! The chunk store: append-only segment files (format in [`crate::format`]).
//!
//! Several writers append in parallel, each to its own open segment, so appends never serialize
//! on one lock. Each writer buffers up to [`WRITE_BUFFER_BYTES`] before writing to its file;
//! readers of a record still in a buffer read it from there. [`Segments::sync`] writes every
//! buffer and fsyncs every file touched since the last sync: the commit calls it before the
//! metadata that points at the new records becomes durable.

use crate::error::{Error, Result};
use crate::format::{self, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes a writer buffers before it writes them to its segment file.
pub const WRITE_BUFFER_BYTES: usize = 1 << 20;
/// Marker for a writer slot with no open segment.
const NO_SEGMENT: u64 = u64::MAX;

/// Where a record landed.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    /// Segment id.
    pub segment: u64,
    /// Offset of the record header in the segment file.
    pub offset: u32,
    /// crc32c of the record.
    pub crc: u32,
}

struct SegmentFile {
    file: File,
}

struct OpenSegment {
    id: u64,
    file: Arc<SegmentFile>,
    /// Bytes already written to the file (header included).
    file_len: u64,
    /// Records not yet written to the file; they start at `file_len`.
    buf: Vec<u8>,
}

struct Writer {
    open: Mutex<Option<OpenSegment>>,
    /// Id of the open segment (or `NO_SEGMENT`), readable without the lock.
    segment: AtomicU64,
    /// Bytes of the open segment that are in the file, readable without the lock.
    file_len: AtomicU64,
}

/// All segment files of a pool.
pub struct Segments {
    dir: PathBuf,
    files: RwLock<HashMap<u64, Arc<SegmentFile>>>,
    writers: Vec<Writer>,
    next_id: AtomicU64,
    segment_bytes_max: u64,
    /// Files written since the last sync.
    unsynced: Mutex<HashMap<u64, Arc<SegmentFile>>>,
    /// A file was created or removed since the directory was last synced.
    dir_dirty: Mutex<bool>,
    /// Sealed segments and the commit number after which all their records are committed.
    sealed: Mutex<HashMap<u64, u64>>,
    /// Serializes [`Segments::sync`]: a caller must not return while another still fsyncs
    /// the files it drained.
    sync_lock: Mutex<()>,
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.seg"))
}

impl Segments {
    /// Opens the segment directory; `writers` is the number of parallel append streams (the
    /// last one is reserved for the cleaner). Returns the ids of the segment files found.
    pub fn open(
        dir: &Path,
        writers: usize,
        segment_bytes_max: u64,
        next_id: u64,
    ) -> Result<(Self, Vec<u64>)> {
        fs::create_dir_all(dir).map_err(|e| Error::io("create segment directory", e))?;
        let mut files = HashMap::new();
        let mut max_id = next_id;
        for entry in fs::read_dir(dir).map_err(|e| Error::io("list segment directory", e))? {
            let entry = entry.map_err(|e| Error::io("list segment directory", e))?;
            let name = entry.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".seg"))
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(entry.path())
                .map_err(|e| Error::io(format!("open segment {id:016x}"), e))?;
            files.insert(id, Arc::new(SegmentFile { file }));
            max_id = max_id.max(id + 1);
        }
        let ids = files.keys().copied().collect();
        let writers = (0..writers)
            .map(|_| Writer {
                open: Mutex::new(None),
                segment: AtomicU64::new(NO_SEGMENT),
                file_len: AtomicU64::new(0),
            })
            .collect();
        let segs = Segments {
            dir: dir.to_path_buf(),
            files: RwLock::new(files),
            writers,
            next_id: AtomicU64::new(max_id),
            segment_bytes_max,
            unsynced: Mutex::new(HashMap::new()),
            dir_dirty: Mutex::new(false),
            sealed: Mutex::new(HashMap::new()),
            sync_lock: Mutex::new(()),
        };
        Ok((segs, ids))
    }

    /// The next segment id that will be allocated (persisted by the commit).
    pub fn next_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Size of a segment file on disk, or 0 if it does not exist.
    pub fn file_bytes(&self, id: u64) -> u64 {
        self.files
            .read()
            .get(&id)
            .and_then(|f| f.file.metadata().ok())
            .map_or(0, |m| m.len())
    }

    /// Ids of all segment files.
    pub fn ids(&self) -> Vec<u64> {
        self.files.read().keys().copied().collect()
    }

    /// Appends one record through writer `w`. `commit_no` is the number of the commit whose
    /// batch will contain this record (used to know when a sealed segment is fully committed).
    pub fn append(
        &self,
        w: usize,
        chunk_id: u64,
        flags: u16,
        payload: &[u8],
        commit_no: u64,
    ) -> Result<Placement> {
        let writer = &self.writers[w];
        let mut guard = writer.open.lock();
        let rec_bytes = (RECORD_HEADER_BYTES + payload.len()) as u64;
        let need_new = match guard.as_ref() {
            None => true,
            Some(o) => o.file_len + o.buf.len() as u64 + rec_bytes > self.segment_bytes_max,
        };
        if need_new {
            if let Some(old) = guard.take() {
                self.seal(writer, old, commit_no)?;
            }
            *guard = Some(self.create_segment(writer)?);
        }
        let o = guard.as_mut().expect("open segment");
        let offset = o.file_len + o.buf.len() as u64;
        let crc = format::encode_record(&mut o.buf, chunk_id, flags, payload);
        let placement = Placement {
            segment: o.id,
            offset: offset as u32,
            crc,
        };
        if o.buf.len() >= WRITE_BUFFER_BYTES {
            self.write_buffer(writer, o)?;
        }
        Ok(placement)
    }

    /// Creates a segment file and makes it `writer`'s open segment (published to readers and
    /// the cleaner before the file is listed, so the cleaner never sees it as sealed).
    fn create_segment(&self, writer: &Writer) -> Result<OpenSegment> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        writer
            .file_len
            .store(SEGMENT_HEADER_BYTES, Ordering::Release);
        writer.segment.store(id, Ordering::Release);
        let path = segment_path(&self.dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io(format!("create segment {id:016x}"), e))?;
        file.write_all_at(&format::encode_segment_header(id), 0)
            .map_err(|e| Error::io(format!("write segment header {id:016x}"), e))?;
        let file = Arc::new(SegmentFile { file });
        self.files.write().insert(id, file.clone());
        self.unsynced.lock().insert(id, file.clone());
        *self.dir_dirty.lock() = true;
        Ok(OpenSegment {
            id,
            file,
            file_len: SEGMENT_HEADER_BYTES,
            buf: Vec::with_capacity(WRITE_BUFFER_BYTES + 8192),
        })
    }

    fn write_buffer(&self, writer: &Writer, o: &mut OpenSegment) -> Result<()> {
        if o.buf.is_empty() {
            return Ok(());
        }
        o.file
            .file
            .write_all_at(&o.buf, o.file_len)
            .map_err(|e| Error::io(format!("write segment {:016x}", o.id), e))?;
        o.file_len += o.buf.len() as u64;
        o.buf.clear();
        writer.file_len.store(o.file_len, Ordering::Release);
        self.unsynced.lock().insert(o.id, o.file.clone());
        Ok(())
    }

    fn seal(&self, writer: &Writer, mut o: OpenSegment, commit_no: u64) -> Result<()> {
        self.write_buffer(writer, &mut o)?;
        writer.segment.store(NO_SEGMENT, Ordering::Release);
        self.sealed.lock().insert(o.id, commit_no);
        Ok(())
    }

    /// Seals the open segments of the first `writers` writers; their records belong to batch
    /// `batch_no` or earlier. (The cleaner's own writer is left alone: its records are committed
    /// by the cleaner's transaction, not by a batch.)
    pub fn seal_writers(&self, writers: usize, batch_no: u64) -> Result<()> {
        for writer in &self.writers[..writers] {
            let mut guard = writer.open.lock();
            if let Some(o) = guard.take() {
                self.seal(writer, o, batch_no)?;
            }
        }
        Ok(())
    }

    /// Writes every buffer and fsyncs every file written since the last sync, and the directory
    /// if files were created or removed. After it returns, every record appended before the call
    /// is durable.
    pub fn sync(&self) -> Result<()> {
        let _syncing = self.sync_lock.lock();
        for writer in &self.writers {
            let mut guard = writer.open.lock();
            if let Some(o) = guard.as_mut() {
                self.write_buffer(writer, o)?;
            }
        }
        let files: Vec<(u64, Arc<SegmentFile>)> = self.unsynced.lock().drain().collect();
        for (id, f) in &files {
            if let Err(e) = f.file.sync_data() {
                return Err(Error::io(format!("sync segment {id:016x}"), e));
            }
        }
        let dir_dirty = std::mem::take(&mut *self.dir_dirty.lock());
        if dir_dirty {
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io("sync segment directory", e))?;
        }
        Ok(())
    }

    /// Reads a whole record (header and payload) at `offset` in segment `segment`.
    /// Returns `Ok(None)` if the segment no longer exists (it was cleaned: the caller retries
    /// with fresh metadata).
    pub fn read_record(
        &self,
        segment: u64,
        offset: u32,
        stored_len: u32,
    ) -> Result<Option<Vec<u8>>> {
        let len = RECORD_HEADER_BYTES + stored_len as usize;
        let offset = offset as u64;
        for writer in &self.writers {
            if writer.segment.load(Ordering::Acquire) == segment
                && offset + len as u64 > writer.file_len.load(Ordering::Acquire)
            {
                let guard = writer.open.lock();
                if let Some(o) = guard
                    .as_ref()
                    .filter(|o| o.id == segment && offset >= o.file_len)
                {
                    let start = (offset - o.file_len) as usize;
                    if start + len > o.buf.len() {
                        return Err(Error::Corrupt(format!(
                            "record beyond the end of segment {segment:016x}"
                        )));
                    }
                    return Ok(Some(o.buf[start..start + len].to_vec()));
                }
            }
        }
        let Some(file) = self.files.read().get(&segment).cloned() else {
            return Ok(None);
        };
        let mut out = vec![0u8; len];
        file.file.read_exact_at(&mut out, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::Corrupt(format!("record beyond the end of segment {segment:016x}"))
            } else {
                Error::io(format!("read segment {segment:016x}"), e)
            }
        })?;
        Ok(Some(out))
    }

    /// Reads a whole sealed segment file (for the cleaner and the verifier).
    pub fn read_all(&self, segment: u64) -> Result<Option<Vec<u8>>> {
        let Some(file) = self.files.read().get(&segment).cloned() else {
            return Ok(None);
        };
        let len = file
            .file
            .metadata()
            .map_err(|e| Error::io("stat segment", e))?
            .len();
        let mut out = vec![0u8; len as usize];
        file.file
            .read_exact_at(&mut out, 0)
            .map_err(|e| Error::io(format!("read segment {segment:016x}"), e))?;
        Ok(Some(out))
    }

    /// Segments that are sealed and whose every record was committed by commit `committed_no`:
    /// only these may be cleaned.
    pub fn cleanable(&self, committed_no: u64) -> Vec<u64> {
        let open: Vec<u64> = self
            .writers
            .iter()
            .map(|w| w.segment.load(Ordering::Acquire))
            .collect();
        let sealed = self.sealed.lock();
        self.files
            .read()
            .keys()
            .copied()
            .filter(|id| !open.contains(id))
            .filter(|id| sealed.get(id).is_none_or(|&c| c <= committed_no))
            .collect()
    }

    /// Whether a segment is sealed and every record in it belongs to batch `batch_no` or earlier.
    pub fn fully_committed(&self, segment: u64, batch_no: u64) -> bool {
        if self
            .writers
            .iter()
            .any(|w| w.segment.load(Ordering::Acquire) == segment)
        {
            return false;
        }
        self.sealed
            .lock()
            .get(&segment)
            .is_none_or(|&c| c <= batch_no)
    }

    /// Deletes a segment file. Readers that already hold it keep reading it (the file is only
    /// unlinked); later readers see it gone and retry with fresh metadata.
    pub fn remove(&self, segment: u64) -> Result<()> {
        self.files.write().remove(&segment);
        self.unsynced.lock().remove(&segment);
        self.sealed.lock().remove(&segment);
        match fs::remove_file(segment_path(&self.dir, segment)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("remove segment {segment:016x}"), e)),
        }
        *self.dir_dirty.lock() = true;
        Ok(())
    }

    /// Path of a segment file (for tests that corrupt it).
    pub fn path(&self, segment: u64) -> PathBuf {
        segment_path(&self.dir, segment)
    }
}
