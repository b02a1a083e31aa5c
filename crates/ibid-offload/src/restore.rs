//! Restore: a remote snapshot into a new volume of a pool, every chunk checked by its BLAKE3
//! (a chunk named by its blocks in the same pass that computes the fingerprints the pool's
//! dedup needs, which the writes hand on).

use crate::fetch::{get_pieces, Pieces};
use crate::format::{
    self, Hash, Location, ManifestHeader, Table, CHUNK_BYTES, RECORD_HEADER_BYTES,
};
use crate::instant::check_manifest;
use crate::repack::{place_of, Places};
use crate::{pack_path, Error, Progress, Remote, Result, DOWNLOADS_INFLIGHT_MAX};
use futures::{StreamExt, TryStreamExt};
use ibid_engine::{Pool, Volume};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// What a restore did.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RestoreReport {
    /// The new volume.
    pub volume: String,
    /// `VOLUME@SNAPSHOT` restored.
    pub snapshot: String,
    /// Volume size in bytes.
    pub size_bytes: u64,
    /// Bytes received from the object store.
    pub bytes_received: u64,
    /// Bytes written to the volume (non-zero chunks).
    pub data_bytes: u64,
    /// Chunks written.
    pub chunks: u64,
    /// Seconds the restore took.
    pub duration_s: f64,
}

/// The records wanted from one pack: by record offset, the chunk indices that hold it.
type Wanted = BTreeMap<u32, (Hash, u32, Vec<u64>)>;

/// The packs (by name) whose records a restore has written into its volume and flushed: a
/// restore cut off after a checkpoint goes on from there ([`Remote::restore_resumable`]).
pub type RestoreDone = BTreeSet<Hash>;

/// Told the packs done so far after each flush of a resumable restore; an error stops it.
pub type Checkpoint = Arc<dyn Fn(&RestoreDone) -> Result<()> + Send + Sync>;

/// Packs a resumable restore writes between its checkpoints (a flush each: ~64 MiB of
/// records at the pack target).
pub const CHECKPOINT_PACKS: usize = 8;

/// Where a restore starts: a new volume, or one an earlier run filled in part.
struct Start {
    done: RestoreDone,
    checkpoint: Option<Checkpoint>,
    /// The volume exists (a run that goes on).
    resumed: bool,
}

impl Remote {
    /// Restores `volume@snapshot` from the remote as a new thin volume `new_name` of `pool`;
    /// a failed restore deletes the volume.
    pub async fn restore(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        new_name: &str,
        progress: Arc<Progress>,
    ) -> Result<RestoreReport> {
        self.restore_named(pool, volume, snapshot, new_name, progress, None)
            .await
    }

    /// A restore that can go on after a stop or a crash: into `new_name`, created — or, with
    /// `done` (what the last checkpoint of an earlier run into the same volume said), the
    /// volume that run left, whose packs in `done` are not fetched again. `checkpoint` is told
    /// the packs done after every [`CHECKPOINT_PACKS`] packs, once they are flushed. A failed
    /// restore leaves the volume as it is: the caller deletes it, or keeps it (and the last
    /// checkpoint) to go on — unless the failure was to create it ([`Error::before_target`]:
    /// a volume of that name that is not this restore's exists).
    #[allow(clippy::too_many_arguments)]
    pub async fn restore_resumable(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        new_name: &str,
        progress: Arc<Progress>,
        done: Option<RestoreDone>,
        checkpoint: Checkpoint,
    ) -> Result<RestoreReport> {
        let start = Start {
            resumed: done.is_some(),
            done: done.unwrap_or_default(),
            checkpoint: Some(checkpoint),
        };
        self.restore_named(pool, volume, snapshot, new_name, progress, Some(start))
            .await
    }

    /// Reads the manifest of `volume@snapshot` and restores it into `new_name`: as
    /// [`Remote::restore_resumable`] with `start`, as [`Remote::restore`] without.
    async fn restore_named(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        new_name: &str,
        progress: Arc<Progress>,
        start: Option<Start>,
    ) -> Result<RestoreReport> {
        let started = Instant::now();
        ibid_engine::validate_volume_name(new_name).map_err(|e| Error::Invalid(e.to_string()))?;
        let manifest = Arc::new(self.manifest(volume, snapshot).await?);
        let (this, pool, new_name) = (self.clone(), pool.clone(), new_name.to_string());
        crate::on_transfers(async move {
            match start {
                Some(start) => {
                    this.restore_with(&pool, manifest, &new_name, progress, started, start)
                        .await
                }
                None => {
                    this.restore_from(&pool, manifest, &new_name, progress, started)
                        .await
                }
            }
        })
        .await
    }

    /// [`Remote::restore`] from `manifest`, read at `started`.
    pub(crate) async fn restore_from(
        &self,
        pool: &Pool,
        manifest: Arc<Table<ManifestHeader>>,
        new_name: &str,
        progress: Arc<Progress>,
        started: Instant,
    ) -> Result<RestoreReport> {
        let start = Start {
            done: RestoreDone::new(),
            checkpoint: None,
            resumed: false,
        };
        let result = self
            .restore_with(pool, manifest, new_name, progress, started, start)
            .await;
        if result.as_ref().is_err_and(|e| !e.before_target()) {
            let pool = pool.clone();
            let name = new_name.to_string();
            let _ = tokio::task::spawn_blocking(move || pool.delete_volume(&name)).await;
        }
        result
    }

    /// A restore from `manifest` as `start` says; a failure leaves the volume (a failure to
    /// create it, [`Error::before_target`], made none).
    async fn restore_with(
        &self,
        pool: &Pool,
        manifest: Arc<Table<ManifestHeader>>,
        new_name: &str,
        progress: Arc<Progress>,
        started: Instant,
        start: Start,
    ) -> Result<RestoreReport> {
        let (volume, snapshot) = (&manifest.header.volume, &manifest.header.snapshot);
        check_manifest(&manifest, volume, snapshot)?;
        let size = manifest.header.size_bytes;
        let mut by_pack: Vec<Wanted> = vec![BTreeMap::new(); manifest.packs.len()];
        for e in &manifest.entries {
            want(&mut by_pack[e.at.pack as usize], e.at, e.hash, e.chunk);
        }
        progress
            .bytes_total
            .store(manifest.header.data_bytes, Relaxed);
        let target = {
            let pool = pool.clone();
            let name = new_name.to_string();
            let resumed = start.resumed;
            tokio::task::spawn_blocking(move || match resumed {
                false => pool.create_volume(&name, size),
                true => pool.volume(&name),
            })
            .await
            .map_err(|e| Error::Invalid(format!("create task failed: {e}")))??
        };
        if target.size() != size {
            return Err(Error::Invalid(format!(
                "volume {new_name} holds {} bytes, the snapshot {}",
                target.size(),
                size
            )));
        }
        let places = Arc::new(Places::new(volume, snapshot, manifest.clone()));
        let (bytes_received, data_bytes, chunks) = self
            .fill(&target, &manifest.packs, by_pack, places, &progress, start)
            .await?;
        Ok(RestoreReport {
            volume: new_name.to_string(),
            snapshot: format!("{volume}@{snapshot}"),
            size_bytes: size,
            bytes_received,
            data_bytes,
            chunks,
            duration_s: started.elapsed().as_secs_f64(),
        })
    }

    /// Fetches every pack's wanted records and writes them; (bytes received, bytes written,
    /// chunks written). Downloads run as tasks of their own, [`DOWNLOADS_INFLIGHT_MAX`] at
    /// once, while [`WRITERS`] threads write what has arrived: a slot never waits for the
    /// pool's writes before it fetches the next pack.
    async fn fill(
        &self,
        target: &Volume,
        packs: &[Hash],
        by_pack: Vec<Wanted>,
        places: Arc<Places>,
        progress: &Arc<Progress>,
        start: Start,
    ) -> Result<(u64, u64, u64)> {
        let Start {
            mut done,
            checkpoint,
            ..
        } = start;
        // What an earlier run wrote counts as done.
        let done_bytes: u64 = packs
            .iter()
            .zip(&by_pack)
            .filter(|(name, _)| done.contains(*name))
            .flat_map(|(_, w)| w.values())
            .map(|(_, _, at)| at.len() as u64 * CHUNK_BYTES)
            .sum();
        progress.bytes_done.fetch_add(done_bytes, Relaxed);
        let jobs: Vec<(Hash, Wanted)> = packs
            .iter()
            .copied()
            .zip(by_pack)
            .filter(|(name, w)| !w.is_empty() && !done.contains(name))
            .collect();
        let mut written = futures::stream::iter(jobs)
            .map(|(name, wanted)| {
                let (this, places, progress) = (self.clone(), places.clone(), progress.clone());
                tokio::spawn(async move { this.fetch_pack(name, wanted, places, progress).await })
            })
            .buffer_unordered(DOWNLOADS_INFLIGHT_MAX)
            .map(|fetched| {
                let (target, progress) = (target.clone(), progress.clone());
                async move {
                    let (name, fetched) = fetched
                        .map_err(|e| Error::Invalid(format!("download task failed: {e}")))??;
                    tokio::task::spawn_blocking(move || {
                        let (mut received, mut written, mut chunks) = (0, 0, 0);
                        for (parts, wanted) in &fetched {
                            received += parts.iter().flatten().map(|p| p.len() as u64).sum::<u64>();
                            let (w, c) = write_records(&target, parts, wanted, &progress)?;
                            written += w;
                            chunks += c;
                        }
                        Ok::<_, Error>((name, received, written, chunks))
                    })
                    .await
                    .map_err(|e| Error::Invalid(format!("restore task failed: {e}")))?
                }
            })
            .buffer_unordered(WRITERS);
        let mut totals = (0, 0, 0);
        let mut written_since: Vec<Hash> = Vec::new();
        while let Some((name, received, bytes, chunks)) = written.try_next().await? {
            totals = (totals.0 + received, totals.1 + bytes, totals.2 + chunks);
            written_since.push(name);
            let Some(checkpoint) = &checkpoint else {
                continue;
            };
            if written_since.len() >= CHECKPOINT_PACKS {
                // Every pack named was written before this flush began: durable after it.
                let target = target.clone();
                tokio::task::spawn_blocking(move || target.flush())
                    .await
                    .map_err(|e| Error::Invalid(format!("flush task failed: {e}")))??;
                done.extend(written_since.drain(..));
                checkpoint(&done)?;
            }
        }
        let target = target.clone();
        tokio::task::spawn_blocking(move || target.flush())
            .await
            .map_err(|e| Error::Invalid(format!("flush task failed: {e}")))??;
        Ok(totals)
    }

    /// The wanted records of pack `name`, one part each. A pack found gone (GC repacked it
    /// since the manifest was read) is looked up in a newer manifest: its chunks then come
    /// from the packs they were moved to, one (parts, wanted) per pack.
    async fn fetch_pack(
        &self,
        name: Hash,
        wanted: Wanted,
        places: Arc<Places>,
        progress: Arc<Progress>,
    ) -> Result<(Hash, Vec<(Vec<Pieces>, Wanted)>)> {
        let pack = name;
        let mut todo = vec![(name, wanted, 0)];
        let mut out = Vec::new();
        while let Some((name, wanted, seen)) = todo.pop() {
            progress.check()?;
            let ranges: Vec<Range<u64>> = wanted
                .iter()
                .map(|(&off, &(_, stored, _))| {
                    off as u64..off as u64 + (RECORD_HEADER_BYTES as u64 + stored as u64)
                })
                .collect();
            match get_pieces(self.store.as_ref(), &pack_path(&name), &ranges).await {
                Ok(parts) => {
                    let received: u64 = parts.iter().flatten().map(|p| p.len() as u64).sum();
                    progress.bytes_transferred.fetch_add(received, Relaxed);
                    out.push((parts, wanted));
                }
                Err(Error::Store(object_store::Error::NotFound { .. })) => {
                    let (version, manifest) = places.newer(self, seen, &name).await?;
                    let mut moved: BTreeMap<Hash, Wanted> = BTreeMap::new();
                    for (hash, _, chunks) in wanted.into_values() {
                        for c in chunks {
                            let (pack, at) = place_of(&manifest, c, &hash)?;
                            want(moved.entry(pack).or_default(), at, hash, c);
                        }
                    }
                    todo.extend(moved.into_iter().map(|(p, w)| (p, w, version)));
                }
                Err(e) => return Err(e),
            }
        }
        Ok((pack, out))
    }
}

/// Adds chunk `chunk`, record `hash` at `at` in a pack, to what is wanted from that pack.
fn want(wanted: &mut Wanted, at: Location, hash: Hash, chunk: u64) {
    wanted
        .entry(at.offset)
        .or_insert_with(|| (hash, at.stored_len, Vec::new()))
        .2
        .push(chunk);
}

/// Pool writers of a restore (each writes one pack's records at a time).
const WRITERS: usize = 2;

/// Most bytes a restore writes in one call: runs of consecutive chunks go together, so the
/// engine's per-write work (its LZ4 skip streak, its dedup neighbourhood) spans a run, not a
/// chunk.
const WRITE_RUN_BYTES: u64 = 1 << 20;
/// Blocks in a run of [`WRITE_RUN_BYTES`] (and one chunk more, the one that passes it).
const WRITE_RUN_BLOCKS: usize = (WRITE_RUN_BYTES + CHUNK_BYTES) as usize / format::BLOCK_BYTES;

/// Checks and writes one pack's records, runs of consecutive chunks at a time; (bytes
/// written, chunks written).
fn write_records(
    target: &Volume,
    parts: &[Pieces],
    wanted: &Wanted,
    progress: &Progress,
) -> Result<(u64, u64)> {
    // (chunk index, record) in volume order; a record several chunks hold appears once each.
    let mut order: Vec<(u64, usize)> = wanted
        .values()
        .enumerate()
        .flat_map(|(r, (_, _, at))| at.iter().map(move |&c| (c, r)))
        .collect();
    order.sort_unstable();
    let records: Vec<(&Pieces, &Hash)> = parts
        .iter()
        .zip(wanted.values())
        .map(|(part, (hash, _, _))| (part, hash))
        .collect();
    let mut buf = Vec::with_capacity(WRITE_RUN_BYTES as usize);
    // The fingerprints of `buf`'s blocks, from the pass that checked its chunks (every chunk
    // of a run but its last is whole blocks; a last one that is not leaves `fps` short, and
    // the run is written without them).
    let mut fps: Vec<format::BlockFingerprint> = Vec::with_capacity(WRITE_RUN_BLOCKS);
    // The chunk index `buf` starts at, and how many chunks it holds.
    let (mut first, mut held) = (0u64, 0u64);
    let (mut written, mut chunks) = (0u64, 0u64);
    let mut write_out = |buf: &mut Vec<u8>,
                         fps: &mut Vec<format::BlockFingerprint>,
                         first: u64,
                         held: &mut u64|
     -> Result<()> {
        if *held > 0 {
            let offset = first * CHUNK_BYTES;
            match fps.len() * format::BLOCK_BYTES == buf.len() {
                true => target.write_fingerprinted(offset, buf, fps, false)?,
                false => target.write(offset, buf, false)?,
            }
            written += buf.len() as u64;
            chunks += *held;
            progress.bytes_done.fetch_add(buf.len() as u64, Relaxed);
        }
        buf.clear();
        fps.clear();
        *held = 0;
        Ok(())
    };
    for &(c, r) in &order {
        progress.check()?;
        // A run goes on only with the next chunk, after whole chunks, up to its size.
        let whole = buf.len() as u64 == held * CHUNK_BYTES;
        if held > 0 && (c != first + held || !whole || buf.len() as u64 >= WRITE_RUN_BYTES) {
            write_out(&mut buf, &mut fps, first, &mut held)?;
        }
        if held == 0 {
            first = c;
        }
        let (part, hash) = records[r];
        format::decode_pieces_fps_into(part, hash, &mut buf, Some(&mut fps))?;
        held += 1;
    }
    write_out(&mut buf, &mut fps, first, &mut held)?;
    Ok((written, chunks))
}
