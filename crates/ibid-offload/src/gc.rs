//! Remote garbage collection (packs no manifest names) and verification (every manifest
//! readable, every chunk it names present and matching its BLAKE3).

use crate::format::{self, Hash, ManifestHeader, Table, RECORD_HEADER_BYTES};
use crate::lock::Kind;
use crate::push::add_table;
use crate::{pack_path, Error, Known, Remote, Result, DOWNLOADS_INFLIGHT_MAX};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

/// Pack deletions in flight at once.
const DELETES_INFLIGHT_MAX: usize = 8;
/// Problems a verification lists in full (the count is always exact).
const PROBLEMS_LISTED_MAX: usize = 100;

/// What a GC did.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct GcReport {
    /// Manifests (snapshots) found.
    pub snapshots: u64,
    /// Packs kept (named by a manifest).
    pub packs_kept: u64,
    /// Packs deleted (unreferenced, or repacked).
    pub packs_deleted: u64,
    /// Bytes of the packs deleted.
    pub bytes_freed: u64,
    /// Packs whose live chunks were moved into new packs (they were mostly garbage; see
    /// [`crate::REPACK_LIVE_BELOW_PCT`]).
    pub packs_repacked: u64,
    /// Chunks moved by repacking.
    pub chunks_moved: u64,
    /// Bytes of the new packs repacking wrote (the net space freed is `bytes_freed` less this).
    pub bytes_written: u64,
    /// Manifests rewritten to name the new packs.
    pub manifests_rewritten: u64,
    /// Stale locks removed (of killed pushes or collections).
    pub stale_locks_removed: u64,
}

/// What a verification found.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct VerifyReport {
    /// Whether nothing is wrong.
    pub ok: bool,
    /// Manifests read.
    pub snapshots: u64,
    /// Packs in the remote.
    pub packs: u64,
    /// Chunk records read and checked.
    pub chunks_checked: u64,
    /// Bytes downloaded.
    pub bytes_read: u64,
    /// Packs no manifest names (what GC would delete).
    pub unreferenced_packs: u64,
    /// Problems found, in full up to 100.
    pub problems: Vec<String>,
    /// Problems found.
    pub problem_count: u64,
}

impl Remote {
    /// Repacks the packs mostly garbage, then deletes the packs no manifest names. Refused
    /// ([`Error::Busy`]) while a push, a snapshot deletion or another GC runs.
    pub async fn gc(&self) -> Result<GcReport> {
        let this = self.clone();
        crate::on_transfers(async move {
            let lock = this.lock(Kind::Gc).await?;
            let result = this.gc_locked().await;
            lock.release().await;
            result
        })
        .await
    }

    async fn gc_locked(&self) -> Result<GcReport> {
        let mut manifests = self.all_manifests().await?;
        let mut packs = self.all_packs().await?;
        let repacked = self.repack(&mut manifests, &packs).await?;
        packs.extend(repacked.new_packs.iter().map(|(h, s)| (*h, *s)));
        let mut referenced: HashSet<Hash> = HashSet::new();
        let mut known = Known::new();
        for (_, t) in &manifests {
            referenced.extend(t.packs.iter().copied());
            add_table(&mut known, t);
        }
        let garbage: Vec<(Hash, u64)> = packs
            .iter()
            .filter(|(h, _)| !referenced.contains(*h))
            .map(|(h, s)| (*h, *s))
            .collect();
        // The index first: it must never name a deleted pack.
        let (_, segments) = self.load_known().await?;
        self.compact_index(&known, &segments).await?;
        let store = self.store.clone();
        let names: Vec<Hash> = garbage.iter().map(|(h, _)| *h).collect();
        futures::stream::iter(names)
            .map(|h| {
                let store = store.clone();
                async move {
                    match store.delete(&pack_path(&h)).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                        Err(e) => Err(Error::from(e)),
                    }
                }
            })
            .buffer_unordered(DELETES_INFLIGHT_MAX)
            .try_collect::<Vec<()>>()
            .await?;
        let stale_locks_removed = self.remove_stale_locks().await? as u64;
        Ok(GcReport {
            snapshots: manifests.len() as u64,
            packs_kept: (packs.len() - garbage.len()) as u64,
            packs_deleted: garbage.len() as u64,
            bytes_freed: garbage.iter().map(|(_, s)| s).sum(),
            packs_repacked: repacked.packs,
            chunks_moved: repacked.chunks,
            bytes_written: repacked.bytes_written,
            manifests_rewritten: repacked.manifests,
            stale_locks_removed,
        })
    }

    /// Every manifest, read and checked; a damaged one fails the call (GC must not guess).
    async fn all_manifests(&self) -> Result<Vec<(Path, Table<ManifestHeader>)>> {
        let mut out = Vec::new();
        for path in self.manifest_paths().await? {
            let bytes = match self.store.get(&path).await {
                Ok(r) => r.bytes().await?,
                Err(object_store::Error::NotFound { .. }) => continue, // deleted meanwhile
                Err(e) => return Err(e.into()),
            };
            let t = format::decode_table(format::MANIFEST_MAGIC, &bytes)
                .map_err(|e| Error::Corrupt(format!("{path}: {e}")))?;
            out.push((path, t));
        }
        Ok(out)
    }

    /// Every pack: name and size. Objects under `packs/` with other names are left alone.
    async fn all_packs(&self) -> Result<HashMap<Hash, u64>> {
        let metas: Vec<_> = self
            .store
            .list(Some(&Path::from("packs")))
            .try_collect()
            .await?;
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                let name = m.location.filename().and_then(format::unhex)?;
                Some((name, m.size))
            })
            .collect())
    }

    /// Reads every manifest and every chunk record they name, checking each against its
    /// BLAKE3; lists what is wrong.
    pub async fn verify(&self) -> Result<VerifyReport> {
        let this = self.clone();
        crate::on_transfers(async move { this.verify_here().await }).await
    }

    async fn verify_here(&self) -> Result<VerifyReport> {
        let mut problems: Vec<String> = Vec::new();
        let mut manifests = Vec::new();
        for path in self.manifest_paths().await? {
            let bytes = self.store.get(&path).await?.bytes().await?;
            match format::decode_table::<ManifestHeader>(format::MANIFEST_MAGIC, &bytes) {
                Ok(t) => manifests.push(t),
                Err(e) => problems.push(format!("{path}: {e}")),
            }
        }
        let packs = self.all_packs().await?;
        // Per pack: record offset -> (hash, stored length), deduplicated over manifests.
        let mut wanted: HashMap<Hash, BTreeMap<u32, (Hash, u32)>> = HashMap::new();
        for t in &manifests {
            for e in &t.entries {
                let pack = t.packs[e.at.pack as usize];
                wanted
                    .entry(pack)
                    .or_default()
                    .insert(e.at.offset, (e.hash, e.at.stored_len));
            }
        }
        let unreferenced_packs = packs.keys().filter(|p| !wanted.contains_key(*p)).count() as u64;
        for (pack, records) in &wanted {
            if !packs.contains_key(pack) {
                problems.push(format!(
                    "pack {} is missing ({} chunks)",
                    format::hex(pack),
                    records.len()
                ));
            }
        }
        let present: Vec<_> = wanted
            .into_iter()
            .filter(|(p, _)| packs.contains_key(p))
            .collect();
        let results: Vec<(u64, u64, Vec<String>)> = futures::stream::iter(present)
            .map(|(pack, records)| self.verify_pack(pack, records))
            .buffer_unordered(DOWNLOADS_INFLIGHT_MAX)
            .try_collect()
            .await?;
        let (mut chunks_checked, mut bytes_read) = (0, 0);
        for (c, b, p) in results {
            chunks_checked += c;
            bytes_read += b;
            problems.extend(p);
        }
        let problem_count = problems.len() as u64;
        problems.truncate(PROBLEMS_LISTED_MAX);
        Ok(VerifyReport {
            ok: problem_count == 0,
            snapshots: manifests.len() as u64,
            packs: packs.len() as u64,
            chunks_checked,
            bytes_read,
            unreferenced_packs,
            problems,
            problem_count,
        })
    }

    async fn verify_pack(
        &self,
        pack: Hash,
        records: BTreeMap<u32, (Hash, u32)>,
    ) -> Result<(u64, u64, Vec<String>)> {
        let ranges: Vec<Range<u64>> = records
            .iter()
            .map(|(&off, &(_, stored))| {
                off as u64..off as u64 + RECORD_HEADER_BYTES as u64 + stored as u64
            })
            .collect();
        let parts = match self.store.get_ranges(&pack_path(&pack), &ranges).await {
            Ok(p) => p,
            Err(e) => {
                return Ok((0, 0, vec![format!("pack {}: {e}", format::hex(&pack))]));
            }
        };
        let bytes: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let problems = tokio::task::spawn_blocking(move || {
            let mut problems = Vec::new();
            for (part, (_, (hash, _))) in parts.iter().zip(records.iter()) {
                if let Err(e) = format::decode_record(part, hash) {
                    problems.push(format!("pack {}: {e}", format::hex(&pack)));
                }
            }
            (records.len() as u64, problems)
        })
        .await
        .map_err(|e| Error::Invalid(format!("verify task failed: {e}")))?;
        Ok((problems.0, bytes, problems.1))
    }
}
