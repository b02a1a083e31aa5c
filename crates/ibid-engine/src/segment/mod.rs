//! The chunk store: append-only segment files (format in [`crate::format`]).
//!
//! Several writers append in parallel, each to its own open segment, so appends never serialize
//! on one lock. Each writer buffers up to [`WRITE_BUFFER_BYTES`]; a full buffer's whole pages
//! are handed to the pool's segment I/O threads (`ibid-segment-io`, one per writer, taking
//! writes from one queue), which write them to the file while the writer goes on appending to a
//! fresh buffer (the write no longer stalls the thread that filled the buffer, and the disk
//! works while the cores hash and compress). A writer has at most one such write in flight:
//! the next full buffer waits for it; the writers' flights go to the device side by side (a
//! flash device, or a virtual disk, writes several 4 MiB writes at once faster than one after
//! another). Readers of a record not yet in the file read it from the buffer in flight or the
//! open one.
//! A sealed segment (full, or sealed by the cleaner) is fsynced at once by the segment sync
//! thread (`ibid-segment-sync`), so that the commit has little left to wait for.
//! [`Segments::sync`] waits for the writes in flight, writes every buffer and fsyncs every file
//! touched since the last sync and not yet synced by that thread: the commit calls it before the
//! metadata that points at the new records becomes durable. A failed background write or sync
//! fails every later sync and append (a failed fsync is never retried: the kernel may have
//! dropped the pages it could not write).
//!
//! Open segments are written with `O_DIRECT` where the filesystem allows it (not tmpfs): the
//! data goes from the writer's page-aligned buffer to the device, with no copy into the page
//! cache (a quarter of the CPU of a unique-data write stream went to that copy) and no dirty
//! page cache for a later fsync to write back. A buffer is written in whole 4 KiB pages: the
//! part past the last full page stays in the buffer, and a sync writes it padded with zeros,
//! to be rewritten (same bytes, more records after them) by the next write. So a segment file
//! may end in zeros, which no record header matches. Reads use the ordinary buffered file: the
//! kernel drops cached pages a direct write overwrites.

use crate::direct_io::{AlignedBuf, PAGE_BYTES};
use crate::disk::{Disk, DiskFile, OpenMode};
use crate::error::{Error, Result};
use crate::format::{self, RECORD_HEADER_BYTES};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

/// Parallel segment append streams for new data (the cleaner has one more of its own).
pub const DATA_WRITERS: usize = 4;
/// Bytes a writer buffers before it writes them to its segment file. 4 MiB rather than 1: a
/// slow disk takes larger writes faster (measurements: docs/benchmarks/nbd-fio.md), at up to
/// 12 MiB of memory per writer (the buffer, its spare and the write in flight).
pub const WRITE_BUFFER_BYTES: usize = 4 << 20;
/// Marker for a writer slot with no open segment.
const NO_SEGMENT: u64 = u64::MAX;
/// A record to append: the chunk it stores, its flags and its bytes as stored.
#[derive(Debug, Clone, Copy)]
pub struct NewRecord<'a> {
    /// Id of the chunk.
    pub chunk_id: u64,
    /// Record flags (`format::RECORD_FLAG_*`).
    pub flags: u16,
    /// The chunk's bytes as stored (LZ4-compressed if the flags say so).
    pub payload: &'a [u8],
}

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

/// A segment file and its descriptor, which [`Segments`] may close while the file is idle
/// and reopens on its next read ([`SegmentOptions::open_files_max`]).
struct SegmentFile {
    path: PathBuf,
    /// The descriptor; `None` once closed as idle, or once the file was removed. Set and
    /// taken only through [`SegmentFile::set_handle`] and [`SegmentFile::close`], which
    /// count it in `open_files`.
    handle: Mutex<Option<Arc<dyn DiskFile>>>,
    /// The pool's count of files with a descriptor ([`Segments::open_files`]).
    open_files: Arc<AtomicUsize>,
    /// Read since the last sweep of idle descriptors passed it (a second chance).
    used: AtomicBool,
    /// The file's size: as found at open, then as this process's writes and truncation
    /// left it (updated when a write has landed).
    size: AtomicU64,
}

impl SegmentFile {
    fn new(
        path: PathBuf,
        file: Arc<dyn DiskFile>,
        size: u64,
        open_files: &Arc<AtomicUsize>,
    ) -> SegmentFile {
        open_files.fetch_add(1, Ordering::Relaxed);
        SegmentFile {
            path,
            handle: Mutex::new(Some(file)),
            open_files: open_files.clone(),
            used: AtomicBool::new(true),
            size: AtomicU64::new(size),
        }
    }

    /// Gives a closed file (its locked `handle`) its descriptor again.
    fn set_handle(
        handle: &mut Option<Arc<dyn DiskFile>>,
        file: Arc<dyn DiskFile>,
        open_files: &AtomicUsize,
    ) {
        debug_assert!(handle.is_none());
        *handle = Some(file);
        open_files.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops the descriptor (readers holding it keep it until they are done).
    fn close(&self) {
        if self.handle.lock().take().is_some() {
            self.open_files.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The descriptor of a file that is never closed while it is an open segment or not
    /// yet synced (a descriptor opened again would not report an earlier writeback error).
    fn kept(&self) -> std::io::Result<Arc<dyn DiskFile>> {
        self.handle.lock().clone().ok_or_else(|| {
            std::io::Error::other("segment descriptor closed before the file was synced")
        })
    }
}

/// Whole pages of a buffer on their way to a segment file: written by an I/O thread, read
/// from here until the writer sees the write done.
struct Flight {
    /// File offset of the first byte.
    at: u64,
    /// The pages; never changed once launched.
    buf: AlignedBuf,
    /// `None` while the write is in flight, then its outcome.
    outcome: Mutex<Option<std::result::Result<(), (std::io::ErrorKind, String)>>>,
    /// Signalled when `outcome` is set.
    landed: Condvar,
}

impl Flight {
    /// File offset just past the last byte.
    fn end(&self) -> u64 {
        self.at + self.buf.len() as u64
    }

    /// Writes the pages to `target` and records the outcome.
    fn write_to(&self, target: &dyn DiskFile) {
        let outcome = target
            .write_all_at(self.buf.bytes(), self.at)
            .map_err(|e| (e.kind(), e.to_string()));
        *self.outcome.lock() = Some(outcome);
        self.landed.notify_all();
    }

    /// Waits for the write to finish; its error, if it failed.
    fn wait(&self) -> std::result::Result<(), std::io::Error> {
        let mut outcome = self.outcome.lock();
        loop {
            match &*outcome {
                Some(Ok(())) => return Ok(()),
                Some(Err((kind, msg))) => return Err(std::io::Error::new(*kind, msg.clone())),
                None => self.landed.wait(&mut outcome),
            }
        }
    }
}

/// A write for a segment I/O thread.
struct Job {
    flight: Arc<Flight>,
    target: Arc<dyn DiskFile>,
}

struct OpenSegment {
    id: u64,
    file: Arc<SegmentFile>,
    /// Where writes go: the file opened with `O_DIRECT` if the filesystem allows it, else the
    /// ordinary file.
    target: Arc<dyn DiskFile>,
    /// Bytes of the file that are final and written (a multiple of the page size). A padded
    /// tail written by a sync lies past it.
    file_len: u64,
    /// The pages from `file_len` on, while an I/O thread writes them.
    flight: Option<Arc<Flight>>,
    /// Bytes not yet final in the file (the segment header, then records); they start where
    /// the flight ends, or at `file_len`.
    buf: AlignedBuf,
    /// A landed flight's buffer, for the next one.
    spare: Option<AlignedBuf>,
}

impl OpenSegment {
    /// File offset of the buffer's first byte.
    fn buf_start(&self) -> u64 {
        self.flight.as_ref().map_or(self.file_len, |f| f.end())
    }

    /// File offset just past the last byte appended.
    fn end(&self) -> u64 {
        self.buf_start() + self.buf.len() as u64
    }
}

/// An open segment's buffers, handed from a sealed segment to the next.
struct Buffers {
    buf: AlignedBuf,
    spare: Option<AlignedBuf>,
}

struct Writer {
    open: Mutex<Option<OpenSegment>>,
    /// Id of the open segment (or `NO_SEGMENT`), readable without the lock.
    segment: AtomicU64,
    /// Bytes of the open segment that are in the file, readable without the lock.
    file_len: AtomicU64,
}

/// How [`Segments::open_on`] sets the chunk store up.
#[derive(Debug, Clone, Copy)]
pub struct SegmentOptions {
    /// Parallel append streams (the last one is reserved for the cleaner).
    pub writers: usize,
    /// Largest segment file in bytes.
    pub segment_bytes_max: u64,
    /// Lowest id a new segment may take (higher ids found in the directory raise it).
    pub next_id: u64,
    /// Write open segments with `O_DIRECT` where the filesystem allows it.
    pub direct_io: bool,
    /// Background I/O and sync threads (see [`Segments`]); without, all I/O is on the
    /// caller's thread.
    pub threads: bool,
    /// Most segment files kept open at once (0: [`open_files_max_default`]). A pool holds a
    /// file per 32 MiB of data and garbage, more than a process's usual limit of 1,024
    /// descriptors past ~30 GiB: past the bound, reads reopen idle sealed files, and the
    /// files least recently read are closed. Open segments and files not yet synced stay
    /// open whatever the bound.
    pub open_files_max: usize,
}

/// Half the process's soft limit on open files, between 16 and 65,536: the rest is for the
/// journal, the metadata store and the clients' connections.
pub fn open_files_max_default() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: fills a plain struct owned here.
    let soft = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } {
        0 => limit.rlim_cur,
        _ => 1024,
    };
    usize::try_from(soft / 2)
        .unwrap_or(usize::MAX)
        .clamp(16, 65_536)
}

/// All segment files of a pool.
pub struct Segments {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    files: RwLock<BTreeMap<u64, Arc<SegmentFile>>>,
    writers: Vec<Writer>,
    next_id: AtomicU64,
    /// The sum of every file's [`SegmentFile::size`].
    total_bytes: AtomicU64,
    segment_bytes_max: u64,
    /// Files with a descriptor open ([`SegmentFile::handle`]).
    open_files: Arc<AtomicUsize>,
    /// Past this many, idle sealed files are closed ([`SegmentOptions::open_files_max`]).
    open_files_max: usize,
    /// The id the next sweep of idle descriptors starts from (a clock hand); held by the
    /// one sweep at a time.
    sweep_from: Mutex<u64>,
    /// What the segment threads change too.
    shared: Arc<Shared>,
    /// A file was created or removed since the directory was last synced.
    dir_dirty: Mutex<bool>,
    /// Sealed segments and the commit number after which all their records are committed.
    sealed: Mutex<HashMap<u64, u64>>,
    /// Serializes [`Segments::sync`]: a caller must not return while another still fsyncs
    /// the files it drained.
    sync_lock: Mutex<()>,
    /// Write open segments with `O_DIRECT` where the filesystem supports it.
    direct_io: bool,
    /// Write full buffers and sync sealed segments on threads of their own; without, every
    /// write and sync happens on the caller's thread, in a fixed order (for the simulator).
    threads: bool,
    /// Hands full buffers to the I/O threads (`None` only while dropping).
    io: Option<mpsc::Sender<Job>>,
    /// The I/O threads (one per writer), joined on drop.
    io_threads: Vec<JoinHandle<()>>,
    /// Hands sealed segments to the sync thread (`None` only while dropping).
    sealed_sync: Option<mpsc::Sender<(u64, Kept)>>,
    /// The sync thread, joined on drop.
    sync_thread: Option<JoinHandle<()>>,
}

/// The state [`Segments`] shares with its sync thread.
struct Shared {
    /// Files written since they were last synced.
    unsynced: Mutex<HashMap<u64, Arc<SegmentFile>>>,
    /// The first background write or sync that failed: every later sync and append fails
    /// with it.
    failed: Mutex<Option<String>>,
    /// Whether `failed` is set: read by every append without taking the lock.
    failed_any: AtomicBool,
    /// Held by the sync thread from an fsync's start until its outcome is recorded: a sync
    /// that fsynced the same file meanwhile may have been told of no error (the kernel reports
    /// a failed writeback once), so it takes this before it checks `failed`.
    syncing: Mutex<()>,
}

impl Shared {
    /// Records a failed write or sync (`context`: what failed); the first one is kept.
    fn fail(&self, context: &str, e: &std::io::Error) {
        self.failed
            .lock()
            .get_or_insert_with(|| format!("{context}: {e}"));
        self.failed_any.store(true, Ordering::Release);
    }
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        if self.handle.get_mut().is_some() {
            self.open_files.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Segments {
    fn drop(&mut self) {
        // Closing a channel ends its thread once it has done what was queued.
        self.io = None;
        self.sealed_sync = None;
        for t in (self.io_threads.drain(..)).chain(self.sync_thread.take()) {
            let _ = t.join();
        }
    }
}

/// A descriptor taken from [`SegmentFile::kept`].
type Kept = std::io::Result<Arc<dyn DiskFile>>;

/// Syncs a file through the descriptor taken for it.
fn sync_kept(file: &Kept) -> std::io::Result<()> {
    match file {
        Ok(f) => f.sync_data(),
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    }
}

/// The segment sync thread: fsyncs each sealed segment handed to it (its writes have all
/// landed: sealing waits for them), then takes it off the files the next sync must fsync.
fn sync_thread(sealed: mpsc::Receiver<(u64, Kept)>, shared: Arc<Shared>) {
    for (id, file) in sealed {
        let _syncing = shared.syncing.lock();
        match sync_kept(&file) {
            // Nothing writes to a sealed segment any more: it stays durable.
            Ok(()) => drop(shared.unsynced.lock().remove(&id)),
            Err(e) => shared.fail(&format!("sync segment {id:016x}"), &e),
        }
    }
}

/// A segment I/O thread: takes jobs from the queue it shares with the others and writes
/// their pages until the channel closes. (The lock is held only while waiting for a job.)
fn io_thread(jobs: Arc<Mutex<mpsc::Receiver<Job>>>) {
    loop {
        let Ok(job) = jobs.lock().recv() else { return };
        job.flight.write_to(&*job.target);
    }
}

/// The outcomes of scoped threads' work (a panicked thread's as an error).
fn joined(handles: Vec<std::thread::ScopedJoinHandle<'_, Result<()>>>) -> Vec<Result<()>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(Error::Failed("a segment sync thread panicked".into())))
        })
        .collect()
}

/// The first error of `results`, if any.
fn all_ok(results: Vec<Result<()>>) -> Result<()> {
    results.into_iter().collect()
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.seg"))
}

thread_local! {
    /// Set while this thread reads only what needs no wait for the device ([`NoWaitReads`]).
    static NO_WAIT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, segment reads on this thread come from memory only: a read that would wait
/// for the device fails with an I/O error of kind `WouldBlock` instead (see
/// [`crate::Volume::read_if_cached`]).
pub(crate) struct NoWaitReads(bool);

impl NoWaitReads {
    /// Starts reading from memory only on this thread.
    pub(crate) fn start() -> NoWaitReads {
        NoWaitReads(NO_WAIT.with(|f| f.replace(true)))
    }
}

impl Drop for NoWaitReads {
    fn drop(&mut self) {
        NO_WAIT.with(|f| f.set(self.0));
    }
}

/// Fills `out` from `file` at `offset` (of segment `segment`, for errors).
fn read_at(file: &dyn DiskFile, out: &mut [u8], offset: u64, segment: u64) -> Result<()> {
    let read = if NO_WAIT.with(|f| f.get()) {
        file.read_exact_at_nowait(out, offset)
    } else {
        file.read_exact_at(out, offset)
    };
    read.map_err(|e| read_error(e, offset, out.len(), segment))
}

/// The error for a failed read of `len` bytes at `offset` in segment `segment`.
fn read_error(e: std::io::Error, offset: u64, len: usize, segment: u64) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::Corrupt(format!(
            "record at {offset}+{len} beyond the end of segment {segment:016x}"
        ))
    } else {
        Error::io(format!("read segment {segment:016x}"), e)
    }
}

/// Copies into `out` (the bytes from file offset `out_at` on) the part of `src` (the bytes
/// from file offset `src_at` on) that overlaps it.
fn copy_overlap(out: &mut [u8], out_at: u64, src_at: u64, src: &[u8]) {
    let lo = out_at.max(src_at);
    let hi = (out_at + out.len() as u64).min(src_at + src.len() as u64);
    if lo < hi {
        let n = (hi - lo) as usize;
        let (o, s) = ((lo - out_at) as usize, (lo - src_at) as usize);
        out[o..o + n].copy_from_slice(&src[s..s + n]);
    }
}

impl Segments {
    /// Opens the segment directory `dir` on `disk`. Returns the ids of the segment files
    /// found.
    pub fn open_on(
        disk: Arc<dyn Disk>,
        dir: &Path,
        options: SegmentOptions,
    ) -> Result<(Self, Vec<u64>)> {
        let SegmentOptions {
            writers,
            segment_bytes_max,
            next_id,
            direct_io,
            threads,
            open_files_max,
        } = options;
        let open_files_max = match open_files_max {
            0 => open_files_max_default(),
            n => n,
        };
        disk.create_dir_all(dir)
            .map_err(|e| Error::io("create segment directory", e))?;
        let mut found: Vec<(u64, String)> = Vec::new();
        for name in disk
            .list(dir)
            .map_err(|e| Error::io("list segment directory", e))?
        {
            if let Some(id) = name
                .strip_suffix(".seg")
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            {
                found.push((id, name));
            }
        }
        // Newest first: they stay open (up to half the bound), being the likeliest read
        // soon; the others are closed once their size is known.
        found.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        let mut files = BTreeMap::new();
        let mut total_bytes = 0;
        let mut max_id = next_id;
        let open_files = Arc::new(AtomicUsize::new(0));
        for (id, name) in found {
            let path = dir.join(&name);
            let file = disk
                .open(&path, OpenMode::Existing)
                .map_err(|e| Error::io(format!("open segment {id:016x}"), e))?;
            let len = file
                .len()
                .map_err(|e| Error::io(format!("stat segment {id:016x}"), e))?;
            total_bytes += len;
            let f = SegmentFile::new(path, file, len, &open_files);
            if open_files.load(Ordering::Relaxed) > open_files_max / 2 {
                f.close();
                f.used.store(false, Ordering::Relaxed);
            }
            files.insert(id, Arc::new(f));
            max_id = max_id.max(id + 1);
        }
        let ids = files.keys().copied().collect();
        let writers: Vec<Writer> = (0..writers)
            .map(|_| Writer {
                open: Mutex::new(None),
                segment: AtomicU64::new(NO_SEGMENT),
                file_len: AtomicU64::new(0),
            })
            .collect();
        let (io, jobs) = mpsc::channel();
        let jobs = Arc::new(Mutex::new(jobs));
        // One thread per writer: each writer has at most one write in flight. Without
        // threads, the writer writes its full buffer itself.
        let io_threads = (0..if threads { writers.len() } else { 0 })
            .map(|_| {
                let jobs = jobs.clone();
                std::thread::Builder::new()
                    .name("ibid-segment-io".into())
                    .spawn(move || io_thread(jobs))
                    .map_err(|e| Error::io("start a segment I/O thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            unsynced: Mutex::new(HashMap::new()),
            failed: Mutex::new(None),
            failed_any: AtomicBool::new(false),
            syncing: Mutex::new(()),
        });
        let (sealed_sync, sealed) = mpsc::channel();
        let for_thread = shared.clone();
        let sync_thread = match threads {
            true => Some(
                std::thread::Builder::new()
                    .name("ibid-segment-sync".into())
                    .spawn(move || sync_thread(sealed, for_thread))
                    .map_err(|e| Error::io("start the segment sync thread", e))?,
            ),
            // The next sync fsyncs sealed segments too (they stay unsynced).
            false => None,
        };
        let segs = Segments {
            io: threads.then_some(io),
            io_threads,
            shared,
            sealed_sync: threads.then_some(sealed_sync),
            sync_thread,
            threads,
            disk,
            dir: dir.to_path_buf(),
            files: RwLock::new(files),
            writers,
            next_id: AtomicU64::new(max_id),
            total_bytes: AtomicU64::new(total_bytes),
            segment_bytes_max,
            open_files,
            open_files_max,
            sweep_from: Mutex::new(0),
            dir_dirty: Mutex::new(false),
            sealed: Mutex::new(HashMap::new()),
            sync_lock: Mutex::new(()),
            direct_io,
        };
        Ok((segs, ids))
    }

    /// The next segment id that will be allocated (persisted by the commit).
    pub fn next_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Size of a segment file (as [`Segments::total_bytes`] counts it: no `stat`), or 0 if it
    /// does not exist.
    pub fn file_bytes(&self, id: u64) -> u64 {
        self.files
            .read()
            .get(&id)
            .map_or(0, |f| f.size.load(Ordering::Relaxed))
    }

    /// Bytes of all segment files (their sizes, kept as a running count: no `stat`). A
    /// write still in flight is counted once it has landed.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes.load(Ordering::Relaxed)
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
        let record = NewRecord {
            chunk_id,
            flags,
            payload,
        };
        let placed = self.append_all(w..w + 1, w, &[record], commit_no)?;
        Ok(placed[0])
    }

    /// Appends `records`, in order and back to back, through one writer of `writers`: the
    /// first, from `first` on, that no other thread is appending through (`first` itself,
    /// waiting, if all are busy). One lock for the lot, and concurrent callers spread over
    /// the writers instead of queueing on one. On an error, records already appended stay in
    /// the segment, referenced by nothing. `commit_no` as for [`Self::append`].
    pub fn append_all(
        &self,
        writers: std::ops::Range<usize>,
        first: usize,
        records: &[NewRecord<'_>],
        commit_no: u64,
    ) -> Result<Vec<Placement>> {
        self.check_io()?;
        // The headers' CRCs cover the payloads: computed before the lock, which other
        // appenders through this writer wait for.
        let headers: Vec<([u8; RECORD_HEADER_BYTES], u32)> = records
            .iter()
            .map(|r| format::encode_record_header(r.chunk_id, r.flags, r.payload))
            .collect();
        let (w, mut guard) = self.lock_writer(writers, first);
        let writer = &self.writers[w];
        let mut placed = Vec::with_capacity(records.len());
        for (record, (header, crc)) in records.iter().zip(&headers) {
            let rec_bytes = (RECORD_HEADER_BYTES + record.payload.len()) as u64;
            let need_new = match guard.as_ref() {
                None => true,
                Some(o) => o.end() + rec_bytes > self.segment_bytes_max,
            };
            if need_new {
                let recycled = self.seal(writer, &mut guard, commit_no)?;
                *guard = Some(self.create_segment(writer, recycled)?);
            }
            let o = guard.as_mut().expect("open segment");
            let offset = o.end();
            o.buf.push(header);
            o.buf.push(record.payload);
            placed.push(Placement {
                segment: o.id,
                offset: offset as u32,
                crc: *crc,
            });
            if o.buf.len() >= WRITE_BUFFER_BYTES {
                self.launch(writer, o)?;
            }
        }
        Ok(placed)
    }

    /// Locks the first writer of `writers`, from `first` on (wrapping), that is free, else
    /// waits for `first`.
    fn lock_writer(
        &self,
        writers: std::ops::Range<usize>,
        first: usize,
    ) -> (usize, MutexGuard<'_, Option<OpenSegment>>) {
        debug_assert!(writers.contains(&first));
        let n = writers.len();
        for i in 0..n {
            let w = writers.start + (first - writers.start + i) % n;
            if let Some(guard) = self.writers[w].open.try_lock() {
                return (w, guard);
            }
        }
        (first, self.writers[first].open.lock())
    }

    /// Fails if a background write or sync has failed.
    fn check_io(&self) -> Result<()> {
        if !self.shared.failed_any.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*self.shared.failed.lock() {
            Some(why) => Err(Error::Failed(why.clone())),
            None => Ok(()),
        }
    }

    /// Hands the buffer's whole pages to the I/O threads (after the writer's previous flight
    /// has landed) and keeps appending to a fresh buffer holding the rest.
    fn launch(&self, writer: &Writer, o: &mut OpenSegment) -> Result<()> {
        self.land(writer, o)?;
        let whole = o.buf.len() / PAGE_BYTES * PAGE_BYTES;
        if whole == 0 {
            return Ok(());
        }
        let mut next = match o.spare.take() {
            Some(mut b) => {
                b.truncate(0);
                b
            }
            None => AlignedBuf::with_capacity(o.buf.capacity()),
        };
        next.push(&o.buf.bytes()[whole..]);
        let mut pages = std::mem::replace(&mut o.buf, next);
        pages.truncate(whole);
        let flight = Arc::new(Flight {
            at: o.file_len,
            buf: pages,
            outcome: Mutex::new(None),
            landed: Condvar::new(),
        });
        o.flight = Some(flight.clone());
        self.shared.unsynced.lock().insert(o.id, o.file.clone());
        let job = Job {
            flight,
            target: o.target.clone(),
        };
        // No I/O threads (or they are gone, which takes a bug): write here instead.
        let unsent = match &self.io {
            Some(io) => io.send(job).err().map(|mpsc::SendError(job)| job),
            None => Some(job),
        };
        if let Some(job) = unsent {
            job.flight.write_to(&*job.target);
        }
        Ok(())
    }

    /// Records that `file` was written up to `end` (so it is at least that long).
    fn grew_to(&self, file: &SegmentFile, end: u64) {
        let old = file.size.fetch_max(end, Ordering::Relaxed);
        if end > old {
            self.total_bytes.fetch_add(end - old, Ordering::Relaxed);
        }
    }

    /// Records that `file` was cut to `end` bytes.
    fn truncated_to(&self, file: &SegmentFile, end: u64) {
        let old = file.size.swap(end, Ordering::Relaxed);
        if end > old {
            self.total_bytes.fetch_add(end - old, Ordering::Relaxed);
        } else {
            let total = self.total_bytes.fetch_sub(old - end, Ordering::Relaxed);
            assert!(total >= old - end, "segment byte count below zero");
        }
    }

    /// Waits for the writer's flight, if any; once it is written, its pages are the file's.
    /// A failed write stays in place (its records remain readable) and fails the segments.
    fn land(&self, writer: &Writer, o: &mut OpenSegment) -> Result<()> {
        let Some(flight) = o.flight.take() else {
            return Ok(());
        };
        if let Err(e) = flight.wait() {
            let context = format!("write segment {:016x}", o.id);
            self.shared.fail(&context, &e);
            o.flight = Some(flight);
            return Err(Error::io(context, e));
        }
        o.file_len = flight.end();
        self.grew_to(&o.file, o.file_len);
        writer.file_len.store(o.file_len, Ordering::Release);
        if let Ok(landed) = Arc::try_unwrap(flight) {
            o.spare = Some(landed.buf);
        }
        Ok(())
    }

    /// Creates a segment file and makes it `writer`'s open segment (published to readers and
    /// the cleaner before the file is listed, so the cleaner never sees it as sealed), with the
    /// buffers of the segment it sealed just before, if any (allocating them costs 8 MiB of
    /// zeroing per 32 MiB segment). The segment header is the buffer's first bytes.
    fn create_segment(&self, writer: &Writer, recycled: Option<Buffers>) -> Result<OpenSegment> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Ids are handed out once (concurrent writers may create their files in either
        // order): no file has this one yet.
        assert!(
            !self.files.read().contains_key(&id),
            "segment id {id} handed out twice"
        );
        writer.file_len.store(0, Ordering::Release);
        writer.segment.store(id, Ordering::Release);
        let path = segment_path(&self.dir, id);
        let file = (self.disk)
            .open(&path, OpenMode::CreateNew)
            .map_err(|e| Error::io(format!("create segment {id:016x}"), e))?;
        let direct = if self.direct_io {
            (self.disk)
                .open_direct(&path)
                .map_err(|e| Error::io(format!("open segment {id:016x}"), e))?
        } else {
            None
        };
        let target = direct.unwrap_or_else(|| file.clone());
        let file = Arc::new(SegmentFile::new(path, file, 0, &self.open_files));
        self.files.write().insert(id, file.clone());
        self.close_idle_past_bound();
        self.shared.unsynced.lock().insert(id, file.clone());
        *self.dir_dirty.lock() = true;
        let Buffers { mut buf, spare } = recycled.unwrap_or_else(|| Buffers {
            // Room for a full buffer plus the largest record, and the page of padding.
            buf: AlignedBuf::with_capacity(
                WRITE_BUFFER_BYTES + RECORD_HEADER_BYTES + format::BLOCK_BYTES + PAGE_BYTES,
            ),
            spare: None,
        });
        buf.truncate(0);
        buf.push(&format::encode_segment_header(id));
        Ok(OpenSegment {
            id,
            file,
            target,
            file_len: 0,
            flight: None,
            buf,
            spare,
        })
    }

    /// Lands the writer's flight, then writes the whole buffer, its last page padded, so that
    /// every byte appended so far is in the file; the part past the last whole page stays in
    /// the buffer (the padding is overwritten by the next write).
    fn write_buffer(&self, writer: &Writer, o: &mut OpenSegment) -> Result<()> {
        self.land(writer, o)?;
        if o.buf.is_empty() {
            return Ok(());
        }
        let whole = o.buf.len() / PAGE_BYTES * PAGE_BYTES;
        let bytes = o.buf.padded();
        o.target
            .write_all_at(bytes, o.file_len)
            .map_err(|e| Error::io(format!("write segment {:016x}", o.id), e))?;
        self.grew_to(&o.file, o.file_len + bytes.len() as u64);
        o.buf.consume(whole);
        o.file_len += whole as u64;
        writer.file_len.store(o.file_len, Ordering::Release);
        self.shared.unsynced.lock().insert(o.id, o.file.clone());
        Ok(())
    }

    /// Writes the last records of the writer's `open` segment, if any, and closes it for
    /// appends. The padding past them is cut off, so a sealed segment's file size is its header
    /// and records exactly (the cleaner counts every other byte as dead). Returns the segment's
    /// buffers. On an error the segment stays open with its records buffered, for a later seal
    /// or sync to write: records appended before (which the next commit may reference) are
    /// never dropped with a buffer whose write failed.
    fn seal(
        &self,
        writer: &Writer,
        open: &mut Option<OpenSegment>,
        commit_no: u64,
    ) -> Result<Option<Buffers>> {
        let Some(o) = open.as_mut() else {
            return Ok(None);
        };
        self.write_buffer(writer, o)?;
        let end = o.file_len + o.buf.len() as u64;
        if !o.buf.is_empty() {
            (o.file.kept())
                .and_then(|f| f.set_len(end))
                .map_err(|e| Error::io(format!("truncate segment {:016x}", o.id), e))?;
            self.truncated_to(&o.file, end);
        }
        let o = open.take().expect("the open segment");
        // Listed as sealed before it stops being the writer's open segment: the cleaner and
        // the commit look at the open segments first, then the sealed ones, and a segment
        // that is in neither counts as one of the pool's older files (committed, cleanable):
        // in between, a segment whose records no commit has made live yet would have been
        // cleaned away (its file deleted) under the batch about to reference them.
        self.sealed.lock().insert(o.id, commit_no);
        // Taken while the file is still the writer's, so not closed as idle: once it is not,
        // one already synced (not in `unsynced`) may be.
        let kept = o.file.kept();
        writer.segment.store(NO_SEGMENT, Ordering::Release);
        if let Some(sync) = &self.sealed_sync {
            // If the thread is gone, the next sync fsyncs the file: it is still unsynced.
            let _ = sync.send((o.id, kept));
        }
        Ok(Some(Buffers {
            buf: o.buf,
            spare: o.spare,
        }))
    }

    /// Seals the open segments of the first `writers` writers; their records belong to batch
    /// `batch_no` or earlier. (The cleaner's own writer is left alone: its records are committed
    /// by the cleaner's transaction, not by a batch.)
    pub fn seal_writers(&self, writers: usize, batch_no: u64) -> Result<()> {
        for writer in &self.writers[..writers] {
            self.seal(writer, &mut writer.open.lock(), batch_no)?;
        }
        Ok(())
    }

    /// Writes every buffer and fsyncs every file written since the last sync that the sync
    /// thread has not, and the directory if files were created or removed. After it returns,
    /// every record appended before the call is durable.
    pub fn sync(&self) -> Result<()> {
        let _syncing = self.sync_lock.lock();
        self.check_io()?;
        // Each step on threads of its own, all at once: the writers' buffers are written in
        // parallel, then the files and the directory fsynced in parallel, so that the
        // filesystem commits its journal and flushes the device once for them all (one fsync
        // after another cost 30-150 ms each on a virtual disk, most of a commit).
        let write = |writer: &Writer| match writer.open.lock().as_mut() {
            Some(o) => self.write_buffer(writer, o),
            None => Ok(()),
        };
        if self.threads {
            all_ok(std::thread::scope(|s| {
                let handles: Vec<_> = (self.writers.iter())
                    .map(|writer| s.spawn(move || write(writer)))
                    .collect();
                joined(handles)
            }))?;
        } else {
            self.writers.iter().try_for_each(write)?;
        }
        // The descriptors are taken under the lock: once off `unsynced`, a file may be closed
        // as idle.
        let mut files: Vec<(u64, Kept)> = (self.shared.unsynced.lock().drain())
            .map(|(id, f)| (id, f.kept()))
            .collect();
        files.sort_by_key(|(id, _)| *id);
        let dir_dirty = std::mem::take(&mut *self.dir_dirty.lock());
        let sync_file = |(id, f): &(u64, Kept)| {
            sync_kept(f).map_err(|e| Error::io(format!("sync segment {id:016x}"), e))
        };
        let sync_dir =
            || (self.disk.sync_dir(&self.dir)).map_err(|e| Error::io("sync segment directory", e));
        if self.threads {
            all_ok(std::thread::scope(|s| {
                let mut handles: Vec<_> = (files.iter())
                    .map(|f| s.spawn(move || sync_file(f)))
                    .collect();
                if dir_dirty {
                    handles.push(s.spawn(sync_dir));
                }
                joined(handles)
            }))?;
        } else {
            files.iter().try_for_each(sync_file)?;
            if dir_dirty {
                sync_dir()?;
            }
        }
        // The sync thread's fsync of one of these files may have failed while ours succeeded.
        drop(self.shared.syncing.lock());
        // Files kept open until synced may now be closed.
        self.close_idle_past_bound();
        self.check_io()
    }

    /// Makes every record appended through writer `w` durable without touching the other
    /// writers' buffers: writes `w`'s buffer and fsyncs its open segment, the sealed segments
    /// not fsynced yet (`w`'s among them) and the directory if files were created or removed.
    /// For the cleaner, whose copies must be durable before its transaction: a whole
    /// [`Segments::sync`] would hold each host writer's buffer while it writes it out.
    pub fn sync_writer(&self, w: usize) -> Result<()> {
        let _syncing = self.sync_lock.lock();
        self.check_io()?;
        let writer = &self.writers[w];
        let mut guard = writer.open.lock();
        let open = match guard.as_mut() {
            Some(o) => {
                self.write_buffer(writer, o)?;
                Some(o.id)
            }
            None => None,
        };
        let files: Vec<(u64, Kept)> = {
            let sealed = self.sealed.lock();
            let mut unsynced = self.shared.unsynced.lock();
            let mut ids: Vec<u64> = (unsynced.keys())
                .copied()
                .filter(|id| Some(*id) == open || sealed.contains_key(id))
                .collect();
            // In id order, as `sync` does: a seed of the simulator replays the same I/O.
            ids.sort_unstable();
            // The descriptors are taken under the lock, as in `sync`.
            ids.into_iter()
                .filter_map(|id| unsynced.remove(&id).map(|f| (id, f.kept())))
                .collect()
        };
        let dir_dirty = std::mem::take(&mut *self.dir_dirty.lock());
        for (id, f) in &files {
            if let Err(e) = sync_kept(f) {
                let context = format!("sync segment {id:016x}");
                self.shared.fail(&context, &e);
                return Err(Error::io(context, e));
            }
        }
        if dir_dirty {
            if let Err(e) = self.disk.sync_dir(&self.dir) {
                self.shared.fail("sync segment directory", &e);
                return Err(Error::io("sync segment directory", e));
            }
        }
        drop(guard);
        // As in `sync`: the sync thread's fsync of one of these files may have failed.
        drop(self.shared.syncing.lock());
        self.close_idle_past_bound();
        self.check_io()
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
        self.read_span(segment, offset, RECORD_HEADER_BYTES + stored_len as usize)
    }

    /// Reads `len` bytes at `offset` in segment `segment` (one record, or several adjacent
    /// ones), from the file, the open segment's buffer, or both. `Ok(None)` as for
    /// [`Segments::read_record`].
    pub fn read_span(&self, segment: u64, offset: u32, len: usize) -> Result<Option<Vec<u8>>> {
        let mut out = vec![0u8; len];
        Ok(self
            .read_span_into(segment, offset, &mut out)?
            .then_some(out))
    }

    /// Fills `out` with the bytes at `offset` in segment `segment`, as [`Segments::read_span`]
    /// does, into the caller's buffer (which need not be zeroed: every byte is overwritten).
    /// `Ok(false)` if the segment no longer exists.
    pub fn read_span_into(&self, segment: u64, offset: u32, out: &mut [u8]) -> Result<bool> {
        let offset = offset as u64;
        let len = out.len();
        for writer in &self.writers {
            if writer.segment.load(Ordering::Acquire) == segment
                && offset + len as u64 > writer.file_len.load(Ordering::Acquire)
            {
                let guard = writer.open.lock();
                if let Some(o) = guard
                    .as_ref()
                    .filter(|o| o.id == segment && offset + len as u64 > o.file_len)
                {
                    // The span ends past the file's written pages: it lies in the flight, the
                    // buffer, or both, and may start in the file (writes are whole pages, so
                    // a record can straddle each boundary).
                    if offset + len as u64 > o.end() {
                        return Err(Error::Corrupt(format!(
                            "record at {offset}+{len} beyond the end of open segment \
                             {segment:016x} ({} bytes appended)",
                            o.end()
                        )));
                    }
                    let in_file = o.file_len.saturating_sub(offset) as usize;
                    let file = o
                        .file
                        .kept()
                        .map_err(|e| read_error(e, offset, len, segment))?;
                    read_at(&*file, &mut out[..in_file], offset, segment)?;
                    if let Some(f) = &o.flight {
                        copy_overlap(out, offset, f.at, f.buf.bytes());
                    }
                    copy_overlap(out, offset, o.buf_start(), o.buf.bytes());
                    return Ok(true);
                }
            }
        }
        let Some(file) = self.reader(segment)? else {
            return Ok(false);
        };
        read_at(&*file, out, offset, segment)?;
        Ok(true)
    }

    /// Fills `bufs`, one after the other, with the bytes at `offset` in segment `segment` on,
    /// as [`Segments::read_span_into`] does: a span of records scattered straight into where
    /// their parts belong (one `preadv` for a sealed segment; the open segments' spans are
    /// read whole and copied). `Ok(false)` if the segment no longer exists.
    pub fn read_span_scattered(
        &self,
        segment: u64,
        offset: u32,
        bufs: &mut [&mut [u8]],
    ) -> Result<bool> {
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        let end = offset as u64 + len as u64;
        let in_open = self.writers.iter().any(|w| {
            w.segment.load(Ordering::Acquire) == segment && end > w.file_len.load(Ordering::Acquire)
        });
        if in_open {
            let mut all = vec![0u8; len];
            if !self.read_span_into(segment, offset, &mut all)? {
                return Ok(false);
            }
            crate::disk::scatter(&all, bufs);
            return Ok(true);
        }
        let Some(file) = self.reader(segment)? else {
            return Ok(false);
        };
        let read = if NO_WAIT.with(|f| f.get()) {
            file.read_scattered_at_nowait(bufs, offset as u64)
        } else {
            file.read_scattered_at(bufs, offset as u64)
        };
        read.map_err(|e| read_error(e, offset as u64, len, segment))?;
        Ok(true)
    }

    /// Reads a whole sealed segment file (for the cleaner and the verifier).
    pub fn read_all(&self, segment: u64) -> Result<Option<Vec<u8>>> {
        let Some(file) = self.reader(segment)? else {
            return Ok(None);
        };
        let len = file.len().map_err(|e| Error::io("stat segment", e))?;
        let mut out = vec![0u8; len as usize];
        file.read_exact_at(&mut out, 0)
            .map_err(|e| Error::io(format!("read segment {segment:016x}"), e))?;
        Ok(Some(out))
    }

    /// Segments that are sealed and whose every record was committed by commit `committed_no`:
    /// only these may be cleaned.
    pub fn cleanable(&self, committed_no: u64) -> Vec<u64> {
        // Files first, then the open segments, then the sealed ones: a segment is published
        // as open before its file is listed and listed as sealed before it stops being open,
        // so each file listed here is seen open, or sealed, or is an older file.
        let files: Vec<u64> = self.files.read().keys().copied().collect();
        let open: Vec<u64> = self
            .writers
            .iter()
            .map(|w| w.segment.load(Ordering::Acquire))
            .collect();
        let sealed = self.sealed.lock();
        files
            .into_iter()
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
        if let Some(f) = self.files.write().remove(&segment) {
            // Sealed: nothing appends to it any more.
            let size = f.size.load(Ordering::Relaxed);
            let total = self.total_bytes.fetch_sub(size, Ordering::Relaxed);
            assert!(total >= size, "segment byte count below zero");
            f.close();
        }
        self.shared.unsynced.lock().remove(&segment);
        self.sealed.lock().remove(&segment);
        match self.disk.remove_file(&segment_path(&self.dir, segment)) {
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

    /// Segment files with a descriptor open now.
    #[cfg(test)]
    pub fn open_files(&self) -> usize {
        self.open_files.load(Ordering::Relaxed)
    }

    /// The bound on [`Segments::open_files`] past which idle sealed files are closed.
    #[cfg(test)]
    pub fn open_files_max(&self) -> usize {
        self.open_files_max
    }

    /// A descriptor to read `segment` with: its open one, or the file opened again if it
    /// was closed as idle. `None` if the segment is gone (removed, before or meanwhile).
    fn reader(&self, segment: u64) -> Result<Option<Arc<dyn DiskFile>>> {
        let Some(f) = self.files.read().get(&segment).cloned() else {
            return Ok(None);
        };
        f.used.store(true, Ordering::Relaxed);
        let mut handle = f.handle.lock();
        if let Some(file) = &*handle {
            return Ok(Some(file.clone()));
        }
        // Closed as idle, or removed since (then the open finds no file, or a file about to
        // be unlinked whose descriptor goes with the last holder of `f`).
        let file = match self.disk.open(&f.path, OpenMode::Existing) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("open segment {segment:016x}"), e)),
        };
        SegmentFile::set_handle(&mut handle, file.clone(), &self.open_files);
        drop(handle);
        self.close_idle_past_bound();
        Ok(Some(file))
    }

    /// Closes idle descriptors if more than the bound are open.
    fn close_idle_past_bound(&self) {
        if self.open_files.load(Ordering::Relaxed) > self.open_files_max {
            self.close_idle();
        }
    }

    /// Closes descriptors of sealed, synced files not read since the sweep last passed them
    /// (a clock: a file read meanwhile is spared once), from where the last sweep stopped,
    /// until three quarters of the bound are open or every file was seen twice. One sweep at
    /// a time; a caller that finds one running leaves it the work.
    fn close_idle(&self) {
        let Some(mut hand) = self.sweep_from.try_lock() else {
            return;
        };
        let target = self.open_files_max * 3 / 4;
        let files = self.files.read();
        // Taken under the files' lock: a file created since is not in `files`, and one
        // sealed and synced since may only be spared.
        let mut kept: HashSet<u64> = self.shared.unsynced.lock().keys().copied().collect();
        kept.extend(
            self.writers
                .iter()
                .map(|w| w.segment.load(Ordering::Acquire)),
        );
        let order = files.range(*hand..).chain(files.range(..*hand));
        for (&id, f) in order.clone().chain(order) {
            if self.open_files.load(Ordering::Relaxed) <= target {
                *hand = id;
                return;
            }
            if kept.contains(&id) || f.used.swap(false, Ordering::Relaxed) {
                continue;
            }
            f.close();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
