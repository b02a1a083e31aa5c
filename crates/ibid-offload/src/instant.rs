//! Instant restore: a remote snapshot as a new volume that is usable at once. A chunk is
//! fetched from the remote when it is first read (or partly written), and every chunk is
//! fetched in the background ([`InstantRestore::fill`]) until the volume holds the whole
//! snapshot.
//!
//! ## What keeps a host's data safe
//! Each of the manifest's chunks is *present* once the volume holds it: fetched and written,
//! or wholly overwritten by the host. The fill and the fetches write a chunk only while it is
//! absent, under the chunk's stripe lock, and mark it present in the same critical section; a
//! host write first fetches the absent chunks it covers in part and claims (marks present)
//! those it covers whole. So the fill never writes over a host's data.
//!
//! Which chunks are present must survive a crash, or a restarted fill would write over data
//! a host had flushed. It is kept in the **mark log** (a file the caller names): a chunk's
//! mark is queued once its data is written, and [`InstantRestore::flush`] — which the front
//! ends call for every host flush — takes the queued marks, flushes the volume, and only then
//! appends the marks and syncs the log. A mark is therefore never durable before its data; a
//! chunk whose mark was lost is fetched again, which gives back the snapshot's content: the
//! old content of a write the host had not flushed.
//!
//! ## Mark log (`<volume id>.marks` in a directory the caller names)
//! ```text
//! 0   8  magic "IBIDIRM1"
//! 8   8  volume id (u64 LE)
//! 16  8  number of chunks in the manifest (u64 LE)
//! 24  …  records of 16 bytes: chunk index (u64 LE), its bitwise NOT (u64 LE)
//! ```
//! Reading stops at the first record that does not check (a torn append); the file is cut
//! there before anything is appended.

use crate::fetch::get_pieces;
use crate::format::{self, Hash, Location, CHUNK_BYTES, RECORD_HEADER_BYTES};
use crate::repack::{place_of, Places};
use crate::{pack_path, Error, Progress, Remote, Result, DOWNLOADS_INFLIGHT_MAX};
use futures::{StreamExt, TryStreamExt};
use ibid_engine::{Pool, Volume};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MARKS_MAGIC: &[u8; 8] = b"IBIDIRM1";
const MARKS_HEADER_BYTES: usize = 24;
const MARK_BYTES: usize = 16;
/// Stripe locks serializing installs and claims of chunks (a chunk uses `index % STRIPES`).
const STRIPES: usize = 64;
/// Pause before the fill tries again after the object store failed.
const FILL_RETRY: Duration = Duration::from_secs(2);

/// A volume being restored from a remote while it is in use.
pub struct InstantRestore {
    remote: Remote,
    volume: Volume,
    /// `VOLUME@SNAPSHOT` in the remote.
    snapshot: String,
    /// Where the chunks are (the manifest, read again if GC moves them).
    places: Places,
    /// The manifest as first read: its entries (in chunk order) are what is restored; where
    /// they are now, [`Places`] says.
    first: Arc<format::Table<format::ManifestHeader>>,
    /// A bit per entry: the volume holds the chunk (fetched, or overwritten whole by a host).
    present: Vec<AtomicU64>,
    /// Entries not present.
    missing: AtomicU64,
    /// Host writes between their claim and [`InstantRestore::after_write`].
    claims_in_flight: AtomicU64,
    /// Every entry is present *and its mark durable*: a restore resumed after a crash would
    /// find nothing to fetch, so the hooks may stop (set by [`InstantRestore::flush`]).
    complete: AtomicBool,
    /// Bytes of snapshot data (the entries' plain lengths).
    data_bytes: u64,
    /// Plain bytes of the present entries.
    present_bytes: AtomicU64,
    /// Bytes received from the object store.
    received_bytes: AtomicU64,
    stripes: Vec<Mutex<()>>,
    /// Chunks whose marks wait for the next flush.
    pending: Mutex<Vec<u64>>,
    /// The mark log, held through a whole [`InstantRestore::flush`].
    log: Mutex<MarkLog>,
    /// Set by [`InstantRestore::stop`]: on-demand fetches go on, the fill ends.
    stopped: AtomicBool,
    /// Where the hooks' fetches run (the transfer runtime; a hook blocks on it).
    runtime: tokio::runtime::Handle,
}

/// Entries to fetch from one pack, with their locations there.
type Group = Vec<(usize, Location)>;

/// The mark log file.
struct MarkLog {
    file: std::fs::File,
    path: PathBuf,
}

/// Chunks a host write claimed (marked present before writing them whole); handed back to
/// [`InstantRestore::after_write`].
#[derive(Debug, Default)]
#[must_use]
pub struct Claim {
    entries: Vec<usize>,
}

impl Remote {
    /// Starts an instant restore of `volume@snapshot` into a new thin volume `new_name` of
    /// `pool`, keeping its mark log in directory `marks_dir` ([`marks_file`]). The volume can be read
    /// and written at once through the returned handle's hooks; [`InstantRestore::fill`]
    /// fetches the rest.
    pub async fn instant_restore(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        new_name: &str,
        marks_dir: &Path,
    ) -> Result<Arc<InstantRestore>> {
        ibid_engine::validate_volume_name(new_name).map_err(|e| Error::Invalid(e.to_string()))?;
        let manifest = self.manifest(volume, snapshot).await?;
        check_manifest(&manifest, volume, snapshot)?;
        let target = {
            let pool = pool.clone();
            let name = new_name.to_string();
            let size = manifest.header.size_bytes;
            tokio::task::spawn_blocking(move || pool.create_volume(&name, size))
                .await
                .map_err(|e| Error::Invalid(format!("create task failed: {e}")))??
        };
        let marks = marks_file(marks_dir, target.id());
        let file = create_marks(&marks, target.id(), manifest.entries.len() as u64);
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                let _ = pool.delete_volume(new_name);
                return Err(e);
            }
        };
        Ok(Arc::new(InstantRestore::new(
            self.clone(),
            target,
            (volume, snapshot),
            manifest,
            MarkLog { file, path: marks },
            &[],
        )))
    }

    /// Takes up an instant restore that a stop cut off: volume `volume_id` of `pool`, restoring
    /// `volume@snapshot`, whose mark log is in `marks_dir`. The chunks marked there are present; the
    /// rest is fetched again.
    pub async fn resume_instant_restore(
        &self,
        pool: &Pool,
        volume_id: u64,
        volume: &str,
        snapshot: &str,
        marks_dir: &Path,
    ) -> Result<Arc<InstantRestore>> {
        let manifest = self.manifest(volume, snapshot).await?;
        check_manifest(&manifest, volume, snapshot)?;
        let target = pool.volume_by_id(volume_id)?;
        let marks = marks_file(marks_dir, volume_id);
        if target.size() != manifest.header.size_bytes {
            return Err(Error::Invalid(format!(
                "volume {} is {} bytes, {volume}@{snapshot} {}",
                target.name(),
                target.size(),
                manifest.header.size_bytes
            )));
        }
        let (file, marked) = open_marks(&marks, volume_id, manifest.entries.len() as u64)?;
        Ok(Arc::new(InstantRestore::new(
            self.clone(),
            target,
            (volume, snapshot),
            manifest,
            MarkLog { file, path: marks },
            &marked,
        )))
    }
}

/// The mark log of volume `volume_id`'s restore in `dir`.
pub fn marks_file(dir: &Path, volume_id: u64) -> PathBuf {
    dir.join(format!("{volume_id}.marks"))
}

/// The manifest's entries must be in chunk order, once each, inside the volume.
pub(crate) fn check_manifest(
    manifest: &format::Table<format::ManifestHeader>,
    volume: &str,
    snapshot: &str,
) -> Result<()> {
    if manifest.header.chunk_bytes != CHUNK_BYTES {
        return Err(Error::Corrupt(format!(
            "{volume}@{snapshot}: chunk size {} (this ibid uses {CHUNK_BYTES})",
            manifest.header.chunk_bytes
        )));
    }
    let size = manifest.header.size_bytes;
    let mut last = None;
    for e in &manifest.entries {
        let start = e.chunk.saturating_mul(CHUNK_BYTES);
        if start >= size || start + e.at.plain_len as u64 > size || e.at.plain_len == 0 {
            return Err(Error::Corrupt(format!(
                "chunk {} beyond the volume",
                e.chunk
            )));
        }
        if last.is_some_and(|l| l >= e.chunk) {
            return Err(Error::Corrupt(format!("chunk {} out of order", e.chunk)));
        }
        last = Some(e.chunk);
    }
    Ok(())
}

impl InstantRestore {
    fn new(
        remote: Remote,
        volume: Volume,
        (source, snapshot): (&str, &str),
        manifest: format::Table<format::ManifestHeader>,
        log: MarkLog,
        marked: &[u64],
    ) -> InstantRestore {
        let first = Arc::new(manifest);
        let entries = &first.entries;
        let data_bytes = entries.iter().map(|e| e.at.plain_len as u64).sum();
        let this = InstantRestore {
            remote,
            volume,
            snapshot: format!("{source}@{snapshot}"),
            places: Places::new(source, snapshot, first.clone()),
            present: (0..entries.len().div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            missing: AtomicU64::new(entries.len() as u64),
            claims_in_flight: AtomicU64::new(0),
            complete: AtomicBool::new(false),
            data_bytes,
            present_bytes: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            first: first.clone(),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            pending: Mutex::new(Vec::new()),
            log: Mutex::new(log),
            stopped: AtomicBool::new(false),
            runtime: crate::transfers().handle().clone(),
        };
        for &chunk in marked {
            if let Ok(i) = this.first.entries.binary_search_by_key(&chunk, |e| e.chunk) {
                if !this.is_present(i) {
                    this.set_present(i);
                }
            }
        }
        this
    }

    /// The volume being restored.
    pub fn volume(&self) -> &Volume {
        &self.volume
    }

    /// `VOLUME@SNAPSHOT` being restored.
    pub fn snapshot(&self) -> &str {
        &self.snapshot
    }

    /// Whether the volume holds the whole snapshot durably, as the mark log says (the hooks
    /// then do nothing).
    pub fn is_complete(&self) -> bool {
        self.complete.load(Relaxed)
    }

    /// Bytes of snapshot data, and how many of them the volume holds.
    pub fn bytes(&self) -> (u64, u64) {
        (self.data_bytes, self.present_bytes.load(Relaxed))
    }

    /// Bytes received from the object store so far.
    pub fn received_bytes(&self) -> u64 {
        self.received_bytes.load(Relaxed)
    }

    /// Ends [`InstantRestore::fill`] at its next pack (fetches on demand go on).
    pub fn stop(&self) {
        self.stopped.store(true, Relaxed);
    }

    fn is_present(&self, i: usize) -> bool {
        self.present[i / 64].load(Relaxed) & (1 << (i % 64)) != 0
    }

    /// Marks entry `i` present; the caller holds its stripe and saw it absent.
    fn set_present(&self, i: usize) {
        let was = self.present[i / 64].fetch_or(1 << (i % 64), Relaxed);
        assert_eq!(was & (1 << (i % 64)), 0, "entry {i} was present already");
        self.missing.fetch_sub(1, Release);
        self.present_bytes
            .fetch_add(self.first.entries[i].at.plain_len as u64, Relaxed);
    }

    /// Takes back a claim; the caller holds the stripe.
    fn clear_present(&self, i: usize) {
        let was = self.present[i / 64].fetch_and(!(1 << (i % 64)), Relaxed);
        assert_ne!(was & (1 << (i % 64)), 0, "entry {i} was absent");
        self.missing.fetch_add(1, Relaxed);
        self.present_bytes
            .fetch_sub(self.first.entries[i].at.plain_len as u64, Relaxed);
    }

    fn stripe(&self, i: usize) -> &Mutex<()> {
        &self.stripes[i % STRIPES]
    }

    /// Volume bytes entry `i` covers.
    fn span(&self, i: usize) -> Range<u64> {
        let e = &self.first.entries[i];
        let start = e.chunk * CHUNK_BYTES;
        start..start + e.at.plain_len as u64
    }

    /// Entries that overlap `off..off + len`.
    fn overlapping(&self, off: u64, len: u64) -> Range<usize> {
        if len == 0 {
            return 0..0;
        }
        let (first, last) = (off / CHUNK_BYTES, (off + len - 1) / CHUNK_BYTES);
        let lo = self.first.entries.partition_point(|e| e.chunk < first);
        let hi = self.first.entries.partition_point(|e| e.chunk <= last);
        lo..hi
    }

    /// Absent entries that overlap `off..off + len`.
    pub(crate) fn absent_in(&self, off: u64, len: u64) -> Vec<usize> {
        self.overlapping(off, len)
            .filter(|&i| !self.is_present(i))
            .collect()
    }

    /// Before a read of `off..off + len`: fetches the chunks in it the volume lacks. Blocks;
    /// call it from a thread outside the Tokio runtime.
    pub fn before_read(&self, off: u64, len: u64) -> Result<()> {
        if self.is_complete() {
            return Ok(());
        }
        let absent = self.absent_in(off, len);
        self.fetch_and_install(&absent)
    }

    /// Volume ranges in `off..off + len` that hold snapshot data not fetched yet (block status
    /// must report them as data, not as the holes the volume shows there).
    pub fn unfetched(&self, off: u64, len: u64) -> Vec<Range<u64>> {
        if self.is_complete() {
            return Vec::new();
        }
        let end = off.saturating_add(len);
        let mut out: Vec<Range<u64>> = Vec::new();
        for i in self.absent_in(off, len) {
            let s = self.span(i);
            let r = s.start.max(off)..s.end.min(end);
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }

    /// Before a write (or zeroing) of `off..off + len`: fetches the absent chunks it covers in
    /// part, and claims those it covers whole. Hand the claim to
    /// [`InstantRestore::after_write`] once the write has ended. Blocks, like
    /// [`InstantRestore::before_read`].
    pub fn before_write(&self, off: u64, len: u64) -> Result<Claim> {
        let mut claim = Claim::default();
        if self.is_complete() {
            return Ok(claim);
        }
        let mut partial = Vec::new();
        // Counted before any entry is claimed: a flush that sees nothing missing and no claim
        // in flight has every mark queued (see `flush`).
        self.claims_in_flight.fetch_add(1, AcqRel);
        for i in self.absent_in(off, len) {
            let s = self.span(i);
            if off <= s.start && off + len >= s.end {
                let _g = self.stripe(i).lock();
                if !self.is_present(i) {
                    self.set_present(i);
                    claim.entries.push(i);
                }
            } else {
                partial.push(i);
            }
        }
        if claim.entries.is_empty() {
            self.claims_in_flight.fetch_sub(1, Release);
        }
        if let Err(e) = self.fetch_and_install(&partial) {
            self.after_write(claim, false);
            return Err(e);
        }
        Ok(claim)
    }

    /// After the write `claim` was made for: if it succeeded the claimed chunks' marks are
    /// queued; if it failed they are absent again (fetched later, as if never written).
    pub fn after_write(&self, claim: Claim, succeeded: bool) {
        if claim.entries.is_empty() {
            return;
        }
        if succeeded {
            self.pending
                .lock()
                .extend(claim.entries.iter().map(|&i| self.first.entries[i].chunk));
        } else {
            for &i in &claim.entries {
                let _g = self.stripe(i).lock();
                self.clear_present(i);
            }
        }
        self.claims_in_flight.fetch_sub(1, Release);
    }

    /// A host's flush: the volume's, then the marks queued before it (see the module's
    /// comment for the order). Blocks.
    pub fn flush(&self) -> Result<()> {
        let log = self.log.lock();
        // Read before the marks are taken: if nothing was missing or claimed then, every
        // entry's mark is among those taken or already in the log.
        let all_present =
            self.missing.load(Acquire) == 0 && self.claims_in_flight.load(Acquire) == 0;
        let taken = std::mem::take(&mut *self.pending.lock());
        let result = self
            .volume
            .flush()
            .map_err(Error::from)
            .and_then(|()| append_marks(&log, &taken));
        match &result {
            Ok(()) if all_present => self.complete.store(true, Relaxed),
            Ok(()) => {}
            // Kept for the next flush.
            Err(_) => self.pending.lock().extend(taken),
        }
        result
    }

    /// Fetches `wanted` (absent entries) and installs each that is still absent. Blocks.
    pub(crate) fn fetch_and_install(&self, wanted: &[usize]) -> Result<()> {
        if wanted.is_empty() {
            return Ok(());
        }
        let fetched = self.runtime.block_on(async {
            let mut fetched = Vec::new();
            let mut todo = wanted.to_vec();
            // A pack found gone (GC repacked it): its chunks again, from a newer manifest.
            while !todo.is_empty() {
                let (version, manifest) = self.places.current().await;
                let mut by_pack: BTreeMap<Hash, Group> = BTreeMap::new();
                for &i in &todo {
                    let e = &self.first.entries[i];
                    let (pack, at) = place_of(&manifest, e.chunk, &e.hash)?;
                    by_pack.entry(pack).or_default().push((i, at));
                }
                let results: Vec<(Hash, Group, Option<_>)> = futures::stream::iter(by_pack)
                    .map(|(pack, entries)| async move {
                        let got = self.fetch_pack(&pack, &entries).await?;
                        Ok::<_, Error>((pack, entries, got))
                    })
                    .buffer_unordered(DOWNLOADS_INFLIGHT_MAX)
                    .try_collect()
                    .await?;
                todo.clear();
                let mut gone = None;
                for (pack, entries, got) in results {
                    match got {
                        Some(chunks) => fetched.extend(chunks),
                        None => {
                            todo.extend(entries.iter().map(|(i, _)| *i));
                            gone = Some(pack);
                        }
                    }
                }
                if let Some(pack) = gone {
                    self.places.newer(&self.remote, version, &pack).await?;
                }
            }
            Ok::<_, Error>(fetched)
        })?;
        for (i, plain, fps) in fetched {
            self.install(i, &plain, &fps)?;
        }
        Ok(())
    }

    /// Reads the records of `entries` (all in pack `pack`, at their locations) and checks each
    /// against its name, with its blocks' fingerprints (none for a chunk that is not whole
    /// blocks); `None` if the pack is gone.
    async fn fetch_pack(
        &self,
        pack: &Hash,
        entries: &[(usize, Location)],
    ) -> Result<Option<Vec<(usize, Vec<u8>, Vec<format::BlockFingerprint>)>>> {
        let ranges: Vec<Range<u64>> = entries
            .iter()
            .map(|(_, at)| {
                at.offset as u64
                    ..at.offset as u64 + (RECORD_HEADER_BYTES + at.stored_len as usize) as u64
            })
            .collect();
        let store = self.remote.store.as_ref();
        let parts = match get_pieces(store, &pack_path(pack), &ranges).await {
            Ok(parts) => parts,
            Err(Error::Store(object_store::Error::NotFound { .. })) => return Ok(None),
            Err(e) => return Err(e),
        };
        let received: u64 = parts.iter().flatten().map(|p| p.len() as u64).sum();
        self.received_bytes.fetch_add(received, Relaxed);
        entries
            .iter()
            .zip(parts.iter())
            .map(|(&(i, _), part)| {
                let (mut plain, mut fps) = (Vec::new(), Vec::new());
                let hash = &self.first.entries[i].hash;
                format::decode_pieces_fps_into(part, hash, &mut plain, Some(&mut fps))?;
                Ok((i, plain, fps))
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    /// Writes entry `i`'s chunk into the volume unless it is present (a host claimed it, or
    /// another fetch installed it), then marks it present and queues its mark.
    fn install(&self, i: usize, plain: &[u8], fps: &[format::BlockFingerprint]) -> Result<()> {
        let _g = self.stripe(i).lock();
        if self.is_present(i) {
            return Ok(());
        }
        let offset = self.first.entries[i].chunk * CHUNK_BYTES;
        match fps.len() * format::BLOCK_BYTES == plain.len() {
            true => self.volume.write_fingerprinted(offset, plain, fps, false)?,
            false => self.volume.write(offset, plain, false)?,
        }
        // The mark is queued before the entry counts as present: a flush that sees nothing
        // missing takes it (see `flush`).
        self.pending.lock().push(self.first.entries[i].chunk);
        self.set_present(i);
        Ok(())
    }

    /// Fetches every absent chunk, pack by pack, at most `bytes_per_s` a second from the object
    /// store if given, then flushes, so the volume holds the whole snapshot durably. Object
    /// store errors are retried; it ends early only on [`InstantRestore::stop`], a cancel of
    /// `progress` ([`Error::Cancelled`]), damaged data or a failed pool.
    pub async fn fill(
        self: &Arc<Self>,
        progress: Arc<Progress>,
        bytes_per_s: Option<u64>,
    ) -> Result<()> {
        progress.bytes_total.store(self.data_bytes, Relaxed);
        let started = Instant::now();
        let received_at_start = self.received_bytes();
        // Pack by pack as the manifest first said (a fetch follows chunks GC moved since).
        let mut by_pack: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, e) in self.first.entries.iter().enumerate() {
            by_pack.entry(e.at.pack).or_default().push(i);
        }
        let mut packs = by_pack.into_values().peekable();
        while let Some(entries) = packs.peek() {
            progress
                .bytes_done
                .store(self.present_bytes.load(Relaxed), Relaxed);
            if self.missing.load(Relaxed) == 0 {
                break;
            }
            if self.stopped.load(Relaxed) || progress.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let wanted: Vec<usize> = entries
                .iter()
                .copied()
                .filter(|&i| !self.is_present(i))
                .collect();
            let this = self.clone();
            let done = tokio::task::spawn_blocking(move || this.fetch_and_install(&wanted))
                .await
                .map_err(|e| Error::Invalid(format!("fill task failed: {e}")))?;
            match done {
                Ok(()) => {
                    packs.next();
                }
                Err(Error::Store(e)) => {
                    tracing::warn!(
                        "instant restore of {} into {}: {e}; trying again",
                        self.snapshot,
                        self.volume.name()
                    );
                    tokio::time::sleep(FILL_RETRY).await;
                }
                Err(e) => return Err(e),
            }
            let received = self.received_bytes() - received_at_start;
            progress.bytes_transferred.store(received, Relaxed);
            if let Some(rate) = bytes_per_s.filter(|&r| r > 0) {
                // Paced in short sleeps, so a cancel or a stop ends the fill at once.
                let due = Duration::from_secs_f64(received as f64 / rate as f64);
                while let Some(wait) = due.checked_sub(started.elapsed()) {
                    if self.stopped.load(Relaxed) || progress.is_cancelled() {
                        return Err(Error::Cancelled);
                    }
                    tokio::time::sleep(wait.min(Duration::from_millis(100))).await;
                }
            }
        }
        // Every entry is present (claims still being written end soon): flushed until the
        // marks of all are durable.
        while !self.is_complete() {
            if self.stopped.load(Relaxed) || progress.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let this = self.clone();
            tokio::task::spawn_blocking(move || this.flush())
                .await
                .map_err(|e| Error::Invalid(format!("flush task failed: {e}")))??;
            if !self.is_complete() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        progress.bytes_done.store(self.data_bytes, Relaxed);
        Ok(())
    }
}

/// Appends marks of `chunks` to the log and syncs it.
fn append_marks(log: &MarkLog, chunks: &[u64]) -> Result<()> {
    if chunks.is_empty() {
        return Ok(());
    }
    let mut bytes = Vec::with_capacity(chunks.len() * MARK_BYTES);
    for &c in chunks {
        bytes.extend_from_slice(&c.to_le_bytes());
        bytes.extend_from_slice(&(!c).to_le_bytes());
    }
    let io = |e: std::io::Error| {
        Error::Invalid(format!("write the mark log {}: {e}", log.path.display()))
    };
    (&log.file).write_all(&bytes).map_err(io)?;
    log.file.sync_data().map_err(io)
}

fn create_marks(path: &Path, volume_id: u64, entries: u64) -> Result<std::fs::File> {
    let io = |e: std::io::Error| Error::Invalid(format!("create {}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    let mut header = Vec::with_capacity(MARKS_HEADER_BYTES);
    header.extend_from_slice(MARKS_MAGIC);
    header.extend_from_slice(&volume_id.to_le_bytes());
    header.extend_from_slice(&entries.to_le_bytes());
    file.write_all(&header).map_err(io)?;
    file.sync_all().map_err(io)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
    }
    Ok(file)
}

/// Opens a mark log, checks its header, and answers the chunks it marks; a torn tail is cut.
fn open_marks(path: &Path, volume_id: u64, entries: u64) -> Result<(std::fs::File, Vec<u64>)> {
    let io = |e: std::io::Error| Error::Invalid(format!("read {}: {e}", path.display()));
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io)?;
    let bad = |why: &str| Error::Corrupt(format!("mark log {}: {why}", path.display()));
    if bytes.len() < MARKS_HEADER_BYTES || &bytes[..8] != MARKS_MAGIC {
        return Err(bad("not a mark log"));
    }
    let field = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if field(8) != volume_id || field(16) != entries {
        return Err(bad("it belongs to another restore"));
    }
    let mut marked = Vec::new();
    let mut end = MARKS_HEADER_BYTES;
    for r in bytes[MARKS_HEADER_BYTES..].chunks_exact(MARK_BYTES) {
        let (c, check) = (field(end), field(end + 8));
        debug_assert_eq!(r.len(), MARK_BYTES);
        if check != !c {
            break;
        }
        marked.push(c);
        end += MARK_BYTES;
    }
    if end < bytes.len() {
        tracing::warn!(
            "mark log {}: {} bytes after the last whole mark cut",
            path.display(),
            bytes.len() - end
        );
        file.set_len(end as u64).map_err(io)?;
        file.sync_all().map_err(io)?;
    }
    file.seek(SeekFrom::End(0)).map_err(io)?;
    Ok((file, marked))
}
