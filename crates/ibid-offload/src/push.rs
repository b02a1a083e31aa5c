//! Push: a snapshot's chunks the remote lacks, packed and uploaded, then its manifest.
//!
//! A reader thread walks the snapshot's mapped extents, hashes each chunk, looks it up in what
//! the remote holds, and packs the new ones; sealed packs go through a bounded channel to the
//! uploader, which keeps [`UPLOADS_INFLIGHT_MAX`] PUTs in flight and flushes the index every
//! [`INDEX_FLUSH_PACKS`] packs. The manifest is written once every pack it names is uploaded.

use crate::format::{self, Entry, Hash, Location, ManifestHeader, Table, CHUNK_BYTES};
use crate::lock::Kind;
use crate::{
    index_dir, manifest_path, pack_path, Error, Known, Progress, Remote, Result, INDEX_FLUSH_PACKS,
    INDEX_SEGMENTS_MAX, UPLOADS_INFLIGHT_MAX,
};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use ibid_engine::{ExtentKind, Pool, Volume};
use object_store::path::Path;
use object_store::{PutMode, PutOptions, PutPayload};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Chunks read from the snapshot in one call (bounds the reader's buffer: 4 MiB).
const READ_CHUNKS_MAX: u64 = 64;
/// Sealed packs waiting for an upload slot (bounds memory with [`UPLOADS_INFLIGHT_MAX`]).
const SEALED_QUEUE_MAX: usize = 2;
/// Extents asked of block status at once.
const EXTENTS_MAX: usize = 4096;

/// What a push did.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PushReport {
    /// `VOLUME@SNAPSHOT`.
    pub snapshot: String,
    /// Bytes sent to the object store (packs, index, manifest).
    pub bytes_sent: u64,
    /// Bytes of pack data sent (compressed chunks and their headers).
    pub pack_bytes_sent: u64,
    /// Bytes of the manifest and index objects written.
    pub metadata_bytes_sent: u64,
    /// Chunks uploaded.
    pub chunks_sent: u64,
    /// Chunks the remote already had (from earlier pushes, other volumes, this one, or an
    /// interrupted push of this snapshot).
    pub chunks_skipped: u64,
    /// Chunks that read as zeros (not stored).
    pub chunks_zero: u64,
    /// Bytes of snapshot data the chunks hold (non-zero chunks).
    pub data_bytes: u64,
    /// Bytes of snapshot data read from the pool: the chunks the remote lacked (and any not
    /// whole blocks). Chunks are named from the pool's block fingerprints without reading
    /// them, so an incremental push reads only what changed.
    pub bytes_read: u64,
    /// Packs made (a pack the remote already had, from a push that was interrupted, is not
    /// sent again and not counted in `bytes_sent`).
    pub packs_sent: u64,
    /// Seconds the push took.
    pub duration_s: f64,
}

/// Uploads in flight; each answers the pack's name, its chunks and the bytes it sent.
type Uploads = tokio::task::JoinSet<Result<(Hash, Vec<(Hash, Location)>, u64)>>;

/// A pack the reader sealed: its name, bytes and the chunks in it.
struct Sealed {
    name: Hash,
    bytes: Bytes,
    chunks: Vec<(Hash, Location)>,
}

/// What the reader hands back: the manifest's entries (by pack name) and counts.
struct ReadResult {
    entries: Vec<(u64, Hash, Hash, Location)>,
    chunks_sent: u64,
    chunks_skipped: u64,
    chunks_zero: u64,
    data_bytes: u64,
    bytes_read: u64,
    packs: u64,
}

impl Remote {
    /// Pushes snapshot `volume@snapshot` of `pool`. Fails with [`Error::AlreadyExists`] if the
    /// remote has it, [`Error::Busy`] during a GC of the remote.
    pub async fn push(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        progress: Arc<Progress>,
    ) -> Result<PushReport> {
        let (this, pool) = (self.clone(), pool.clone());
        let (volume, snapshot) = (volume.to_string(), snapshot.to_string());
        crate::on_transfers(
            async move { this.push_here(&pool, &volume, &snapshot, progress).await },
        )
        .await
    }

    /// [`Remote::push`], on the caller's runtime.
    async fn push_here(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        progress: Arc<Progress>,
    ) -> Result<PushReport> {
        let started = Instant::now();
        let manifest = manifest_path(volume, snapshot)?;
        let info = pool
            .list_snapshots(Some(volume))
            .into_iter()
            .find(|s| s.name == snapshot)
            .ok_or_else(|| Error::NotFound(format!("no snapshot {volume}@{snapshot}")))?;
        let handle = pool.snapshot(volume, snapshot)?;
        match self.store.head(&manifest).await {
            Ok(_) => {
                return Err(Error::AlreadyExists(format!(
                    "the remote already has {volume}@{snapshot}"
                )))
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        // A first estimate; the reader sets the exact figure once it has walked the extents.
        progress.bytes_total.store(
            info.mapped_blocks * 4096,
            std::sync::atomic::Ordering::Relaxed,
        );
        let lock = self.lock(Kind::Push).await?;
        let result = self.push_locked(handle, &info, progress, started).await;
        lock.release().await;
        result
    }

    async fn push_locked(
        &self,
        handle: Volume,
        info: &ibid_engine::SnapshotInfo,
        progress: Arc<Progress>,
        started: Instant,
    ) -> Result<PushReport> {
        let (mut known, segments) = self.load_known().await?;
        // The volume's latest pushed snapshot, in case the index lags behind it (another
        // push's index write may have replaced ours).
        if let Some(prev) = self.latest_manifest_of(&info.volume).await? {
            add_table(&mut known, &prev);
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Sealed>(SEALED_QUEUE_MAX);
        let reader_known = known.clone();
        let reader_progress = progress.clone();
        let reader = tokio::task::spawn_blocking(move || {
            read_snapshot(&handle, reader_known, &tx, &reader_progress)
        });
        let mut uploads = tokio::task::JoinSet::new();
        let mut pack_bytes_sent = 0u64;
        let mut metadata_bytes_sent = 0u64;
        let mut fresh = Known::new();
        // Chunks of packs the bucket already had (left by an interrupted push): not sent.
        let mut chunks_reused = 0u64;
        let mut since_flush = 0usize;
        let mut upload_error: Option<Error> = None;
        loop {
            while uploads.len() >= UPLOADS_INFLIGHT_MAX {
                let (sent, reused) = self
                    .finish_upload(&mut uploads, &mut fresh, &mut upload_error)
                    .await;
                pack_bytes_sent += sent;
                chunks_reused += reused;
                since_flush += 1;
            }
            if upload_error.is_some() {
                break;
            }
            let Some(sealed) = rx.recv().await else { break };
            let store = self.store.clone();
            let progress = progress.clone();
            uploads.spawn(async move {
                let path = pack_path(&sealed.name);
                // A pack of the same name is the same bytes (a resumed push): keep it.
                let sent = if store.head(&path).await.is_ok() {
                    0
                } else {
                    store
                        .put(&path, PutPayload::from(sealed.bytes.clone()))
                        .await?;
                    sealed.bytes.len() as u64
                };
                progress
                    .bytes_transferred
                    .fetch_add(sent, std::sync::atomic::Ordering::Relaxed);
                Ok::<_, Error>((sealed.name, sealed.chunks, sent))
            });
            if since_flush >= INDEX_FLUSH_PACKS {
                metadata_bytes_sent += self.write_index_segment(&fresh).await?;
                known.extend(fresh.drain());
                since_flush = 0;
            }
        }
        while !uploads.is_empty() {
            let (sent, reused) = self
                .finish_upload(&mut uploads, &mut fresh, &mut upload_error)
                .await;
            pack_bytes_sent += sent;
            chunks_reused += reused;
        }
        drop(rx); // The reader stops at its next send if it is still running.
        let read = reader
            .await
            .map_err(|e| Error::Invalid(format!("push reader failed: {e}")))?;
        if let Some(e) = upload_error {
            return Err(e);
        }
        let read = read?;
        progress.check()?;
        if !fresh.is_empty() {
            metadata_bytes_sent += self.write_index_segment(&fresh).await?;
            known.extend(fresh.drain());
        }
        if segments.len() > INDEX_SEGMENTS_MAX {
            self.compact_index(&known, &segments).await?;
        }
        let manifest = build_manifest(info, read.entries, read.data_bytes);
        let bytes = format::encode_table(format::MANIFEST_MAGIC, &manifest);
        metadata_bytes_sent += bytes.len() as u64;
        let path = manifest_path(&info.volume, &info.name)?;
        let put = self
            .store
            .put_opts(
                &path,
                PutPayload::from(bytes),
                PutOptions::from(PutMode::Create),
            )
            .await;
        match put {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {
                return Err(Error::AlreadyExists(format!(
                    "the remote already has {}@{} (pushed meanwhile)",
                    info.volume, info.name
                )))
            }
            Err(e) => return Err(e.into()),
        }
        Ok(PushReport {
            snapshot: format!("{}@{}", info.volume, info.name),
            bytes_sent: pack_bytes_sent + metadata_bytes_sent,
            pack_bytes_sent,
            metadata_bytes_sent,
            chunks_sent: read.chunks_sent - chunks_reused,
            chunks_skipped: read.chunks_skipped + chunks_reused,
            chunks_zero: read.chunks_zero,
            data_bytes: read.data_bytes,
            bytes_read: read.bytes_read,
            packs_sent: read.packs,
            duration_s: started.elapsed().as_secs_f64(),
        })
    }

    /// Waits for one upload; its chunks go to `fresh` (for the next index segment). Returns
    /// the bytes it sent and, if the bucket had the pack already, its chunk count.
    async fn finish_upload(
        &self,
        uploads: &mut Uploads,
        fresh: &mut Known,
        error: &mut Option<Error>,
    ) -> (u64, u64) {
        match uploads.join_next().await {
            Some(Ok(Ok((name, chunks, sent)))) => {
                let reused = if sent == 0 { chunks.len() as u64 } else { 0 };
                for (hash, at) in chunks {
                    fresh.insert(hash, (name, at));
                }
                return (sent, reused);
            }
            Some(Ok(Err(e))) => {
                error.get_or_insert(e);
            }
            Some(Err(e)) => {
                error.get_or_insert(Error::Invalid(format!("upload task failed: {e}")));
            }
            None => {}
        }
        (0, 0)
    }

    /// The index (the union of its segments) and the segments' paths; with no segment at
    /// all, the chunks every manifest names.
    pub(crate) async fn load_known(&self) -> Result<(Known, Vec<Path>)> {
        let segments: Vec<Path> = self
            .store
            .list(Some(&index_dir()))
            .map_ok(|m| m.location)
            .try_collect()
            .await?;
        if segments.is_empty() {
            return Ok((self.known_from_manifests().await?, segments));
        }
        let store = self.store.clone();
        let tables: Vec<Option<Table<serde_json::Value>>> = futures::stream::iter(segments.clone())
            .map(|path| {
                let store = store.clone();
                async move {
                    let bytes = match store.get(&path).await {
                        Ok(r) => r.bytes().await?,
                        // Compacted by another push meanwhile: its chunks are in the new one,
                        // or else only sent again.
                        Err(object_store::Error::NotFound { .. }) => return Ok(None),
                        Err(e) => return Err(Error::from(e)),
                    };
                    match format::decode_table(format::INDEX_MAGIC, &bytes) {
                        Ok(t) => Ok(Some(t)),
                        Err(e) => {
                            tracing::warn!(
                                "remote: index segment {path} unreadable ({e}); ignored"
                            );
                            Ok(None)
                        }
                    }
                }
            })
            .buffer_unordered(crate::DOWNLOADS_INFLIGHT_MAX)
            .try_collect()
            .await?;
        let mut known = Known::new();
        for t in tables.iter().flatten() {
            add_table(&mut known, t);
        }
        Ok((known, segments))
    }

    /// The chunks every manifest names.
    pub(crate) async fn known_from_manifests(&self) -> Result<Known> {
        let mut known = Known::new();
        for path in self.manifest_paths().await? {
            let bytes = self.store.get(&path).await?.bytes().await?;
            let t = format::decode_table::<ManifestHeader>(format::MANIFEST_MAGIC, &bytes)
                .map_err(|e| Error::Corrupt(format!("{path}: {e}")))?;
            add_table(&mut known, &t);
        }
        Ok(known)
    }

    /// The manifest of `volume`'s most recently pushed snapshot, if any.
    async fn latest_manifest_of(&self, volume: &str) -> Result<Option<Table<ManifestHeader>>> {
        let prefix = object_store::path::Path::from(format!("snapshots/{volume}"));
        let metas: Vec<_> = self.store.list(Some(&prefix)).try_collect().await?;
        let Some(latest) = metas.into_iter().max_by_key(|m| m.last_modified) else {
            return Ok(None);
        };
        let bytes = self.store.get(&latest.location).await?.bytes().await?;
        match format::decode_table(format::MANIFEST_MAGIC, &bytes) {
            Ok(t) => Ok(Some(t)),
            Err(e) => {
                tracing::warn!("remote: {} unreadable ({e}); not used", latest.location);
                Ok(None)
            }
        }
    }

    /// Writes an index segment naming `chunks`; returns its size.
    pub(crate) async fn write_index_segment(&self, chunks: &Known) -> Result<u64> {
        Ok(self.put_index_segment(chunks).await?.1)
    }

    async fn put_index_segment(&self, chunks: &Known) -> Result<(Path, u64)> {
        let bytes = format::encode_table(format::INDEX_MAGIC, &index_table(chunks));
        let len = bytes.len() as u64;
        let path = index_dir().child(format::hex(blake3::hash(&bytes).as_bytes()));
        self.store.put(&path, PutPayload::from(bytes)).await?;
        Ok((path, len))
    }

    /// Replaces `old` segments by one naming `known`: written first, then the old deleted, so
    /// a reader at any moment sees every chunk (or, racing a deletion, fewer: sent again).
    pub(crate) async fn compact_index(&self, known: &Known, old: &[Path]) -> Result<()> {
        let (new, _) = self.put_index_segment(known).await?;
        for p in old.iter().filter(|p| **p != new) {
            match self.store.delete(p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Adds a manifest's or index's chunks to `known`.
pub(crate) fn add_table<H>(known: &mut Known, t: &Table<H>) {
    for e in &t.entries {
        known.insert(e.hash, (t.packs[e.at.pack as usize], e.at));
    }
}

/// An index table of `known`, entries in hash order.
pub(crate) fn index_table(known: &Known) -> Table<serde_json::Value> {
    let mut packs: HashMap<Hash, u32> = HashMap::new();
    let mut table = Table {
        header: serde_json::json!({}),
        packs: Vec::new(),
        entries: Vec::with_capacity(known.len()),
    };
    let mut sorted: Vec<_> = known.iter().collect();
    sorted.sort_by_key(|(h, _)| **h);
    for (hash, (pack, at)) in sorted {
        let n = *packs.entry(*pack).or_insert_with(|| {
            table.packs.push(*pack);
            (table.packs.len() - 1) as u32
        });
        table.entries.push(Entry {
            chunk: 0,
            hash: *hash,
            at: Location { pack: n, ..*at },
        });
    }
    table
}

fn build_manifest(
    info: &ibid_engine::SnapshotInfo,
    entries: Vec<(u64, Hash, Hash, Location)>,
    data_bytes: u64,
) -> Table<ManifestHeader> {
    let mut packs: HashMap<Hash, u32> = HashMap::new();
    let mut table = Table {
        header: ManifestHeader {
            volume: info.volume.clone(),
            snapshot: info.name.clone(),
            size_bytes: info.size_bytes,
            chunk_bytes: CHUNK_BYTES,
            created_unix_s: info.created_unix_s,
            pushed_unix_s: crate::now_unix_s(),
            data_bytes,
        },
        packs: Vec::new(),
        entries: Vec::with_capacity(entries.len()),
    };
    for (chunk, hash, pack, at) in entries {
        let n = *packs.entry(pack).or_insert_with(|| {
            table.packs.push(pack);
            (table.packs.len() - 1) as u32
        });
        table.entries.push(Entry {
            chunk,
            hash,
            at: Location { pack: n, ..at },
        });
    }
    table
}

/// What the reader knows of a chunk before reading it.
enum Named {
    /// Every block reads as zeros (nothing stored).
    Zero,
    /// Named by its blocks' fingerprints, from the pool's metadata.
    Blocks(Hash),
    /// Not whole blocks: named by its bytes once read.
    Unread,
}

/// The reader: walks the snapshot, names each chunk from the pool's block fingerprints, reads
/// and packs the chunks `known` lacks, sends sealed packs.
fn read_snapshot(
    handle: &Volume,
    mut known: Known,
    tx: &tokio::sync::mpsc::Sender<Sealed>,
    progress: &Progress,
) -> Result<ReadResult> {
    let size = handle.size();
    let mut out = ReadResult {
        entries: Vec::new(),
        chunks_sent: 0,
        chunks_skipped: 0,
        chunks_zero: 0,
        data_bytes: 0,
        bytes_read: 0,
        packs: 0,
    };
    // The open pack: its bytes, its chunks, and the manifest entries waiting for its name.
    // Allocated whole for each pack, so no record's append moves the pack's bytes.
    let mut pack: Vec<u8> = Vec::with_capacity(format::PACK_BYTES_MAX);
    let mut pack_chunks: Vec<(Hash, Location)> = Vec::new();
    let mut in_pack: HashMap<Hash, Location> = HashMap::new();
    let mut waiting: Vec<usize> = Vec::new();
    let mut buf = vec![0u8; (READ_CHUNKS_MAX * CHUNK_BYTES) as usize];
    let seal = |pack: &mut Vec<u8>,
                pack_chunks: &mut Vec<(Hash, Location)>,
                in_pack: &mut HashMap<Hash, Location>,
                waiting: &mut Vec<usize>,
                known: &mut Known,
                out: &mut ReadResult|
     -> Result<()> {
        if pack.is_empty() {
            return Ok(());
        }
        let name = format::pack_name(pack);
        for &i in waiting.iter() {
            out.entries[i].2 = name;
        }
        for (h, at) in pack_chunks.iter() {
            known.insert(*h, (name, *at));
        }
        let sealed = Sealed {
            name,
            bytes: Bytes::from(std::mem::replace(
                pack,
                Vec::with_capacity(format::PACK_BYTES_MAX),
            )),
            chunks: std::mem::take(pack_chunks),
        };
        waiting.clear();
        in_pack.clear();
        out.packs += 1;
        tx.blocking_send(sealed)
            .map_err(|_| Error::Invalid("push uploader stopped".into()))
    };
    let runs = data_chunk_runs(handle, size)?;
    // What the reader will go through: the chunks holding any mapped block, whole.
    let total: u64 = runs
        .iter()
        .map(|&(first, count)| ((first + count) * CHUNK_BYTES).min(size) - first * CHUNK_BYTES)
        .sum();
    progress
        .bytes_total
        .store(total, std::sync::atomic::Ordering::Relaxed);
    let block = format::BLOCK_BYTES as u64;
    let chunk_len = |chunk: u64| CHUNK_BYTES.min(size - chunk * CHUNK_BYTES) as usize;
    for (first, count) in runs {
        let mut c = first;
        while c < first + count {
            progress.check()?;
            let n = (first + count - c).min(READ_CHUNKS_MAX);
            let start = c * CHUNK_BYTES;
            let len = (n * CHUNK_BYTES).min(size - start);
            // Name the chunks from the pool's fingerprints (all but a tail not whole blocks).
            let whole_len = len / block * block;
            let fps = handle.block_fingerprints(start, whole_len)?;
            let per_chunk = (CHUNK_BYTES / block) as usize;
            let named: Vec<Named> = (0..n as usize)
                .map(|i| {
                    let fps = &fps[(i * per_chunk).min(fps.len())..];
                    let fps = &fps[..per_chunk.min(fps.len())];
                    match chunk_len(c + i as u64) {
                        l if l.is_multiple_of(format::BLOCK_BYTES)
                            && fps.iter().all(Option::is_none) =>
                        {
                            Named::Zero
                        }
                        l if l.is_multiple_of(format::BLOCK_BYTES) => {
                            Named::Blocks(format::blocks_name(fps))
                        }
                        _ => Named::Unread,
                    }
                })
                .collect();
            // Read what the remote may lack, in runs of consecutive chunks.
            let lacks = |n: &Named| match n {
                Named::Zero => false,
                Named::Blocks(h) => !known.contains_key(h) && !in_pack.contains_key(h),
                Named::Unread => true,
            };
            let mut was_read = vec![false; named.len()];
            let mut i = 0;
            while i < named.len() {
                if !lacks(&named[i]) {
                    i += 1;
                    continue;
                }
                let j = (i..named.len())
                    .find(|&j| !lacks(&named[j]))
                    .unwrap_or(named.len());
                let (from, to) = (
                    i * CHUNK_BYTES as usize,
                    ((j as u64 * CHUNK_BYTES).min(len)) as usize,
                );
                handle.read(start + from as u64, &mut buf[from..to])?;
                out.bytes_read += (to - from) as u64;
                was_read[i..j].fill(true);
                i = j;
            }
            for (i, name) in named.into_iter().enumerate() {
                let chunk = c + i as u64;
                let from = i * CHUNK_BYTES as usize;
                let range = from..from + chunk_len(chunk);
                if !was_read[i]
                    && matches!(&name, Named::Blocks(h) if !known.contains_key(h) && !in_pack.contains_key(h))
                {
                    // Not found now though it was then (cannot happen: what the remote has
                    // only grows); read rather than pack stale bytes.
                    handle.read(start + from as u64, &mut buf[range.clone()])?;
                    out.bytes_read += range.len() as u64;
                }
                let plain = &buf[range];
                progress
                    .bytes_done
                    .fetch_add(plain.len() as u64, std::sync::atomic::Ordering::Relaxed);
                let (hash, naming) = match name {
                    Named::Zero => {
                        out.chunks_zero += 1;
                        continue;
                    }
                    Named::Blocks(h) => (h, format::Naming::Blocks),
                    Named::Unread if plain.iter().all(|&b| b == 0) => {
                        out.chunks_zero += 1;
                        continue;
                    }
                    Named::Unread => (*blake3::hash(plain).as_bytes(), format::Naming::Bytes),
                };
                out.data_bytes += plain.len() as u64;
                if let Some(&(pack_name, at)) = known.get(&hash) {
                    out.chunks_skipped += 1;
                    out.entries.push((chunk, hash, pack_name, at));
                    continue;
                }
                if let Some(&at) = in_pack.get(&hash) {
                    out.chunks_skipped += 1;
                    waiting.push(out.entries.len());
                    out.entries.push((chunk, hash, [0; 32], at));
                    continue;
                }
                let offset = pack.len();
                format::encode_record(&hash, naming, plain, &mut pack);
                let at = Location {
                    pack: 0,
                    offset: offset as u32,
                    stored_len: (pack.len() - offset - format::RECORD_HEADER_BYTES) as u32,
                    plain_len: plain.len() as u32,
                };
                in_pack.insert(hash, at);
                pack_chunks.push((hash, at));
                waiting.push(out.entries.len());
                out.entries.push((chunk, hash, [0; 32], at));
                out.chunks_sent += 1;
                if pack.len() >= format::PACK_BYTES_TARGET {
                    seal(
                        &mut pack,
                        &mut pack_chunks,
                        &mut in_pack,
                        &mut waiting,
                        &mut known,
                        &mut out,
                    )?;
                }
            }
            c += n;
        }
    }
    seal(
        &mut pack,
        &mut pack_chunks,
        &mut in_pack,
        &mut waiting,
        &mut known,
        &mut out,
    )?;
    Ok(out)
}

/// Runs of chunks (first, count) that hold any mapped data, in order.
fn data_chunk_runs(handle: &Volume, size: u64) -> Result<Vec<(u64, u64)>> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let extents = handle.block_status_max(pos, size - pos, EXTENTS_MAX)?;
        let Some(last) = extents.last() else { break };
        let end = last.offset + last.length;
        for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
            let first = e.offset / CHUNK_BYTES;
            let stop = (e.offset + e.length).div_ceil(CHUNK_BYTES);
            match runs.last_mut() {
                Some((f, n)) if *f + *n >= first => *n = (*n).max(stop - *f),
                _ => runs.push((first, stop - first)),
            }
        }
        assert!(end > pos, "block status made no progress");
        pos = end;
    }
    Ok(runs)
}
