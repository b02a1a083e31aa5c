//! Repacking, a step of GC: the live records of packs that are mostly garbage (chunks only
//! deleted snapshots held) are copied into new packs, and the manifests that name them are
//! rewritten to point there, so the old packs become unreferenced and GC deletes them.
//!
//! Order, and what a crash leaves: the new packs are uploaded first (unreferenced until a
//! manifest names them: the next GC deletes them if the rewrite never happens); then each
//! manifest is rewritten in place (a manifest not yet rewritten still names the old packs,
//! which stay); GC then writes the index from the manifests, and only then deletes the old
//! packs. It runs under the GC lock, so no push reuses a moved chunk's old place and no
//! deletion is undone by a rewrite. A restore that read a manifest before its rewrite finds
//! an old pack gone and reads the manifest again (`restore.rs`, `instant.rs`): a chunk moves,
//! its bytes and hash never change.

use crate::format::{self, Entry, Hash, Location, ManifestHeader, Table, RECORD_HEADER_BYTES};
use crate::{pack_path, Error, Remote, Result, DOWNLOADS_INFLIGHT_MAX};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::PutPayload;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

/// A pack whose live records take less than this share of its bytes (percent) is repacked.
pub const REPACK_LIVE_BELOW_PCT: u64 = 50;

/// What repacking did.
#[derive(Debug, Default)]
pub(crate) struct Repacked {
    /// Packs whose live records were moved (GC deletes them).
    pub packs: u64,
    /// Records moved.
    pub chunks: u64,
    /// Bytes of the new packs written.
    pub bytes_written: u64,
    /// Manifests rewritten.
    pub manifests: u64,
    /// The new packs, with their sizes.
    pub new_packs: HashMap<Hash, u64>,
}

/// A pack's live records: by offset, (hash, stored length).
type LiveRecords = BTreeMap<u32, (Hash, u32)>;

/// Where moved records went: (old pack, old offset) → (new pack, new offset).
type Moves = HashMap<(Hash, u32), (Hash, u32)>;

impl Remote {
    /// Repacks the packs (of `packs`, name → size) that `manifests` use less than
    /// [`REPACK_LIVE_BELOW_PCT`] of, rewriting those manifests (in the store and in
    /// `manifests`). A pack with a damaged record is left whole (with a warning: `remote
    /// verify` names it).
    pub(crate) async fn repack(
        &self,
        manifests: &mut [(Path, Table<ManifestHeader>)],
        packs: &HashMap<Hash, u64>,
    ) -> Result<Repacked> {
        let mut live: HashMap<Hash, LiveRecords> = HashMap::new();
        for (_, t) in manifests.iter() {
            for e in &t.entries {
                live.entry(t.packs[e.at.pack as usize])
                    .or_default()
                    .insert(e.at.offset, (e.hash, e.at.stored_len));
            }
        }
        let mut candidates: Vec<(Hash, LiveRecords)> = live
            .into_iter()
            .filter(|(pack, records)| {
                let Some(&size) = packs.get(pack) else {
                    return false; // missing: for `remote verify` to report
                };
                let live_bytes: u64 = records
                    .values()
                    .map(|&(_, stored)| (RECORD_HEADER_BYTES as u64) + stored as u64)
                    .sum();
                live_bytes * 100 < size * REPACK_LIVE_BELOW_PCT
            })
            .collect();
        if candidates.is_empty() {
            return Ok(Repacked::default());
        }
        candidates.sort_by_key(|(p, _)| *p);
        let mut out = Repacked::default();
        let mut moves = Moves::new();
        // The packs whose records all moved: a manifest naming one is rewritten.
        let mut moved_from: HashSet<Hash> = HashSet::new();
        let mut builder = PackBuilder {
            bytes: Vec::with_capacity(format::PACK_BYTES_MAX),
            records: Vec::new(),
        };
        let mut fetched = futures::stream::iter(candidates)
            .map(|(pack, records)| async move {
                let parts = self.live_records(&pack, &records).await?;
                Ok::<_, crate::Error>((pack, records, parts))
            })
            .buffered(DOWNLOADS_INFLIGHT_MAX);
        while let Some((pack, records, parts)) = fetched.try_next().await? {
            let Some(parts) = parts else { continue };
            let damaged = records
                .iter()
                .zip(&parts)
                .find_map(|((_, (hash, _)), part)| format::decode_record(part, hash).err());
            if let Some(e) = damaged {
                tracing::warn!(
                    "remote GC: pack {} not repacked: {e} (see `ibid remote verify`)",
                    format::hex(&pack)
                );
                continue;
            }
            for ((&offset, _), part) in records.iter().zip(&parts) {
                builder.add(pack, offset, part);
                if builder.bytes.len() >= format::PACK_BYTES_TARGET {
                    self.seal(&mut builder, &mut moves, &mut out).await?;
                }
            }
            moved_from.insert(pack);
            out.packs += 1;
            out.chunks += records.len() as u64;
        }
        drop(fetched);
        self.seal(&mut builder, &mut moves, &mut out).await?;
        for (path, table) in manifests.iter_mut() {
            if !table.packs.iter().any(|p| moved_from.contains(p)) {
                continue;
            }
            let moved = relocated(table, &moves);
            let bytes = format::encode_table(format::MANIFEST_MAGIC, &moved);
            self.store.put(path, PutPayload::from(bytes)).await?;
            *table = moved;
            out.manifests += 1;
        }
        Ok(out)
    }

    /// The records of `pack` at `records`, one part each; `None` if the pack is gone.
    async fn live_records(
        &self,
        pack: &Hash,
        records: &LiveRecords,
    ) -> Result<Option<Vec<bytes::Bytes>>> {
        let ranges: Vec<Range<u64>> = records
            .iter()
            .map(|(&off, &(_, stored))| {
                off as u64..off as u64 + RECORD_HEADER_BYTES as u64 + stored as u64
            })
            .collect();
        match self.store.get_ranges(&pack_path(pack), &ranges).await {
            Ok(parts) => Ok(Some(parts)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Uploads the pack being built (if any) and records where its records went.
    async fn seal(
        &self,
        builder: &mut PackBuilder,
        moves: &mut Moves,
        out: &mut Repacked,
    ) -> Result<()> {
        if builder.bytes.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::replace(
            &mut builder.bytes,
            Vec::with_capacity(format::PACK_BYTES_MAX),
        );
        let name = format::pack_name(&bytes);
        let len = bytes.len() as u64;
        self.store
            .put(&pack_path(&name), PutPayload::from(bytes))
            .await?;
        for (old, offset) in builder.records.drain(..) {
            moves.insert(old, (name, offset));
        }
        out.bytes_written += len;
        out.new_packs.insert(name, len);
        Ok(())
    }
}

/// A new pack being filled with moved records.
struct PackBuilder {
    bytes: Vec<u8>,
    /// (old pack, old offset) → offset here.
    records: Vec<((Hash, u32), u32)>,
}

impl PackBuilder {
    /// Appends a record (header and stored bytes, unchanged).
    fn add(&mut self, pack: Hash, offset: u32, record: &[u8]) {
        let at = self.bytes.len() as u32;
        self.bytes.extend_from_slice(record);
        self.records.push(((pack, offset), at));
    }
}

/// `t` with its moved records' new places and its pack table rebuilt.
fn relocated(t: &Table<ManifestHeader>, moves: &Moves) -> Table<ManifestHeader> {
    let place = |e: &Entry| {
        let pack = t.packs[e.at.pack as usize];
        moves
            .get(&(pack, e.at.offset))
            .copied()
            .unwrap_or((pack, e.at.offset))
    };
    let mut numbers: HashMap<Hash, u32> = HashMap::new();
    let mut out = Table {
        header: t.header.clone(),
        packs: Vec::new(),
        entries: Vec::with_capacity(t.entries.len()),
    };
    for e in &t.entries {
        let (pack, offset) = place(e);
        let n = *numbers.entry(pack).or_insert_with(|| {
            out.packs.push(pack);
            (out.packs.len() - 1) as u32
        });
        out.entries.push(Entry {
            at: Location {
                pack: n,
                offset,
                ..e.at
            },
            ..*e
        });
    }
    out
}

/// Times a restore reads its manifest again, at most, because packs it named were gone.
const REREADS_MAX: u32 = 8;

/// Where a restore's chunks are: the manifest it started from, or a newer version of it that
/// GC rewrote (repacking). A restore that finds a pack gone asks [`Places::newer`].
pub(crate) struct Places {
    volume: String,
    snapshot: String,
    /// The newest version read, and how many reads came before it (0: the first).
    latest: tokio::sync::Mutex<(u32, Arc<Table<ManifestHeader>>)>,
}

impl Places {
    pub(crate) fn new(volume: &str, snapshot: &str, manifest: Arc<Table<ManifestHeader>>) -> Self {
        Places {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
            latest: tokio::sync::Mutex::new((0, manifest)),
        }
    }

    /// The newest version read, and its number.
    pub(crate) async fn current(&self) -> (u32, Arc<Table<ManifestHeader>>) {
        self.latest.lock().await.clone()
    }

    /// A manifest newer than version `seen` (in which a pack was found gone): the one already
    /// read by another fetch, or else read again from `remote`.
    pub(crate) async fn newer(
        &self,
        remote: &Remote,
        seen: u32,
        gone: &Hash,
    ) -> Result<(u32, Arc<Table<ManifestHeader>>)> {
        let mut latest = self.latest.lock().await;
        if latest.0 == seen {
            if seen >= REREADS_MAX {
                return Err(Error::Corrupt(format!(
                    "pack {} is missing",
                    format::hex(gone)
                )));
            }
            let again = remote.manifest(&self.volume, &self.snapshot).await?;
            *latest = (seen + 1, Arc::new(again));
        }
        Ok(latest.clone())
    }
}

/// Where chunk `chunk` holding `hash` is in `t` (whose entries are in chunk order): its pack
/// and location. A chunk missing or holding other bytes means the snapshot was replaced.
pub(crate) fn place_of(
    t: &Table<ManifestHeader>,
    chunk: u64,
    hash: &Hash,
) -> Result<(Hash, Location)> {
    match t.entries.binary_search_by_key(&chunk, |e| e.chunk) {
        Ok(i) if t.entries[i].hash == *hash => {
            let at = t.entries[i].at;
            Ok((t.packs[at.pack as usize], at))
        }
        _ => Err(Error::Corrupt(format!(
            "{}@{}: chunk {chunk} changed in the remote during the restore",
            t.header.volume, t.header.snapshot
        ))),
    }
}
