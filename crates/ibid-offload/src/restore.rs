//! Restore: a remote snapshot into a new volume of a pool, every chunk checked by its BLAKE3.

use crate::format::{self, Hash, CHUNK_BYTES, RECORD_HEADER_BYTES};
use crate::{pack_path, Error, Progress, Remote, Result, DOWNLOADS_INFLIGHT_MAX};
use futures::{StreamExt, TryStreamExt};
use ibid_engine::{Pool, Volume};
use serde::Serialize;
use std::collections::BTreeMap;
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

impl Remote {
    /// Restores `volume@snapshot` from the remote as a new thin volume `new_name` of `pool`.
    pub async fn restore(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        new_name: &str,
        progress: Arc<Progress>,
    ) -> Result<RestoreReport> {
        let started = Instant::now();
        ibid_engine::validate_volume_name(new_name).map_err(|e| Error::Invalid(e.to_string()))?;
        let manifest = self.manifest(volume, snapshot).await?;
        let size = manifest.header.size_bytes;
        if manifest.header.chunk_bytes != CHUNK_BYTES {
            return Err(Error::Corrupt(format!(
                "{volume}@{snapshot}: chunk size {} (this ibid uses {CHUNK_BYTES})",
                manifest.header.chunk_bytes
            )));
        }
        let mut by_pack: Vec<Wanted> = vec![BTreeMap::new(); manifest.packs.len()];
        for e in &manifest.entries {
            if e.chunk.saturating_mul(CHUNK_BYTES) >= size {
                return Err(Error::Corrupt(format!(
                    "chunk {} beyond the volume",
                    e.chunk
                )));
            }
            by_pack[e.at.pack as usize]
                .entry(e.at.offset)
                .or_insert_with(|| (e.hash, e.at.stored_len, Vec::new()))
                .2
                .push(e.chunk);
        }
        progress
            .bytes_total
            .store(manifest.header.data_bytes, Relaxed);
        let target = {
            let pool = pool.clone();
            let name = new_name.to_string();
            tokio::task::spawn_blocking(move || pool.create_volume(&name, size))
                .await
                .map_err(|e| Error::Invalid(format!("create task failed: {e}")))??
        };
        let result = self
            .fill(&target, &manifest.packs, by_pack, &progress)
            .await;
        let (bytes_received, data_bytes, chunks) = match result {
            Ok(r) => r,
            Err(e) => {
                let pool = pool.clone();
                let name = new_name.to_string();
                let _ = tokio::task::spawn_blocking(move || pool.delete_volume(&name)).await;
                return Err(e);
            }
        };
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
        progress: &Arc<Progress>,
    ) -> Result<(u64, u64, u64)> {
        let jobs: Vec<(Hash, Wanted)> = packs
            .iter()
            .copied()
            .zip(by_pack)
            .filter(|(_, w)| !w.is_empty())
            .collect();
        let totals = futures::stream::iter(jobs)
            .map(|(name, wanted)| {
                let (this, progress) = (self.clone(), progress.clone());
                tokio::spawn(async move { this.fetch_pack(name, wanted, progress).await })
            })
            .buffered(DOWNLOADS_INFLIGHT_MAX)
            .map(|fetched| {
                let (target, progress) = (target.clone(), progress.clone());
                async move {
                    let (parts, wanted) = fetched
                        .map_err(|e| Error::Invalid(format!("download task failed: {e}")))??;
                    let received: u64 = parts.iter().map(|p| p.len() as u64).sum();
                    tokio::task::spawn_blocking(move || {
                        write_records(&target, &parts, &wanted, &progress)
                    })
                    .await
                    .map_err(|e| Error::Invalid(format!("restore task failed: {e}")))?
                    .map(|(written, chunks)| (received, written, chunks))
                }
            })
            .buffer_unordered(WRITERS)
            .try_fold((0, 0, 0), |a, b| async move {
                Ok((a.0 + b.0, a.1 + b.1, a.2 + b.2))
            })
            .await?;
        let target = target.clone();
        tokio::task::spawn_blocking(move || target.flush())
            .await
            .map_err(|e| Error::Invalid(format!("flush task failed: {e}")))??;
        Ok(totals)
    }

    /// The wanted records of pack `name`, one part each.
    async fn fetch_pack(
        &self,
        name: Hash,
        wanted: Wanted,
        progress: Arc<Progress>,
    ) -> Result<(Vec<bytes::Bytes>, Wanted)> {
        progress.check()?;
        let path = pack_path(&name);
        let ranges: Vec<Range<u64>> = wanted
            .iter()
            .map(|(&off, &(_, stored, _))| {
                off as u64..off as u64 + (RECORD_HEADER_BYTES as u64 + stored as u64)
            })
            .collect();
        let parts = self
            .store
            .get_ranges(&path, &ranges)
            .await
            .map_err(|e| match e {
                object_store::Error::NotFound { .. } => {
                    Error::Corrupt(format!("pack {} is missing", format::hex(&name)))
                }
                e => e.into(),
            })?;
        let received: u64 = parts.iter().map(|p| p.len() as u64).sum();
        progress.bytes_transferred.fetch_add(received, Relaxed);
        Ok((parts, wanted))
    }
}

/// Pool writers of a restore (each writes one pack's records at a time).
const WRITERS: usize = 2;

/// Checks and writes one pack's records; (bytes written, chunks written).
fn write_records(
    target: &Volume,
    parts: &[bytes::Bytes],
    wanted: &Wanted,
    progress: &Progress,
) -> Result<(u64, u64)> {
    let (mut written, mut chunks) = (0u64, 0u64);
    for (part, (_, (hash, _, at))) in parts.iter().zip(wanted.iter()) {
        progress.check()?;
        let plain = format::decode_record(part, hash)?;
        for &c in at {
            target.write(c * CHUNK_BYTES, &plain, false)?;
            written += plain.len() as u64;
            chunks += 1;
        }
        progress
            .bytes_done
            .fetch_add(plain.len() as u64 * at.len() as u64, Relaxed);
    }
    Ok((written, chunks))
}
