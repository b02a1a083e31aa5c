//! iSCSI LUN numbers as configuration: which volume, or which snapshot exported read-only, each
//! LUN of the target is.
//!
//! Every volume has a LUN from its creation (asked for, or the lowest free one) until it is
//! deleted or moved; a snapshot has one only while exported. The table is kept in `luns.json`
//! in the pool directory, owned by this binary: keyed by volume and snapshot ids (never reused),
//! rewritten whole to a temporary file, synced, renamed over the old one and the directory
//! synced, so a crash leaves the old or the new table.
//!
//! Volumes that have no LUN — every volume of a pool from before this table, volumes made by a
//! path that does not ask for one (a clone, `serve --volume`) — get one when the table is
//! reconciled with the pool ([`LunMap::refresh`]): on the first start of a pool without
//! `luns.json`, each volume keeps the number it had before LUNs were configurable (its id − 1,
//! what its hosts already see) where that fits (≤ [`LUN_MAX`]); later, a new volume gets the
//! lowest free LUN. Mappings of volumes and snapshots that no longer exist are dropped then too.
//!
//! Every change bumps [`LunMap::generation`], which the target turns into the unit attention
//! REPORTED LUNS DATA HAS CHANGED.

use crate::api::ApiError;
use ibid_engine::Pool;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Name of the table in the pool directory.
pub const FILE_NAME: &str = "luns.json";
/// Version of `luns.json`'s format.
const FILE_VERSION: u64 = 1;
/// Highest LUN number (SAM flat addressing).
pub const LUN_MAX: u64 = 16383;

/// What one LUN exports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mapping {
    /// The LUN number.
    pub lun: u64,
    /// The volume's id (its own, or the one the snapshot was taken of).
    pub volume_id: u64,
    /// The volume's name, for people reading the file and for opening a snapshot.
    pub volume: String,
    /// For a snapshot export: the snapshot's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// For a snapshot export: the snapshot's id (which the engine never reuses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<u64>,
}

impl Mapping {
    /// The export's name: `VOLUME` or `VOLUME@SNAPSHOT`.
    pub fn name(&self) -> String {
        match &self.snapshot {
            Some(s) => format!("{}@{s}", self.volume),
            None => self.volume.clone(),
        }
    }
}

/// `luns.json`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    version: u64,
    luns: Vec<Mapping>,
}

/// The target's LUN table, and the file that keeps it.
pub struct LunMap {
    /// `luns.json`.
    path: PathBuf,
    luns: RwLock<BTreeMap<u64, Mapping>>,
    /// Bumped at every change of the table.
    generation: AtomicU64,
    /// The pool's catalog generation the table was last reconciled with.
    seen_catalog: AtomicU64,
    /// Held while the table is changed and written, so writes land in order.
    saving: Mutex<()>,
}

impl LunMap {
    /// The table kept in `pool`'s directory, reconciled with the pool: volumes without a LUN
    /// get one (their old id − 1 when the pool has no table yet), mappings of what no longer
    /// exists are dropped.
    pub fn open(pool: &Pool) -> anyhow::Result<LunMap> {
        let path = pool.dir().join(FILE_NAME);
        let (rows, fresh) =
            match crate::durable::read_table::<Table>(&path, "LUN table", FILE_VERSION)? {
                Some(table) => (checked(&path, table)?, false),
                None => (Vec::new(), true),
            };
        let map = LunMap {
            path,
            luns: RwLock::new(rows.into_iter().map(|m| (m.lun, m)).collect()),
            generation: AtomicU64::new(0),
            seen_catalog: AtomicU64::new(u64::MAX),
            saving: Mutex::new(()),
        };
        {
            let _guard = map.saving.lock();
            map.reconcile(pool, fresh)?;
        }
        Ok(map)
    }

    /// A counter bumped at every change of the table.
    pub fn generation(&self) -> u64 {
        self.generation.load(Relaxed)
    }

    /// What LUN `lun` exports.
    pub fn get(&self, lun: u64) -> Option<Mapping> {
        self.luns.read().get(&lun).cloned()
    }

    /// The volume id LUN `lun` exports, if it exports a volume (not a snapshot): a lookup that
    /// copies no names, for per-command use.
    pub fn volume_id(&self, lun: u64) -> Option<u64> {
        self.luns
            .read()
            .get(&lun)
            .filter(|m| m.snapshot.is_none())
            .map(|m| m.volume_id)
    }

    /// Every mapping, in LUN order.
    pub fn list(&self) -> Vec<Mapping> {
        self.luns.read().values().cloned().collect()
    }

    /// Volume `id`'s LUN.
    pub fn lun_of_volume(&self, id: u64) -> Option<u64> {
        self.luns
            .read()
            .values()
            .find(|m| m.volume_id == id && m.snapshot.is_none())
            .map(|m| m.lun)
    }

    /// The LUN snapshot `snapshot_id` is exported as, if it is.
    pub fn lun_of_snapshot(&self, snapshot_id: u64) -> Option<u64> {
        self.luns
            .read()
            .values()
            .find(|m| m.snapshot_id == Some(snapshot_id))
            .map(|m| m.lun)
    }

    /// Reconciles the table with the pool if the pool's catalog changed since the last time:
    /// volumes created without a LUN get the lowest free one, mappings of deleted volumes and
    /// snapshots go.
    pub fn refresh(&self, pool: &Pool) -> anyhow::Result<()> {
        if self.seen_catalog.load(Relaxed) == pool.catalog_generation() {
            return Ok(());
        }
        let _guard = self.saving.lock();
        self.reconcile(pool, false)
    }

    /// Gives volume `id` LUN `lun` (or, with `None`, keeps its LUN or gives it the lowest free
    /// one); for a volume just created. Refused (409 `lun_in_use`) if another export has it.
    pub fn assign(&self, pool: &Pool, id: u64, lun: Option<u64>) -> Result<u64, ApiError> {
        let _guard = self.saving.lock();
        self.reconcile(pool, false).map_err(ApiError::internal)?;
        let volume = pool.volume_by_id(id)?;
        let mut rows = self.luns.read().clone();
        let current = rows
            .values()
            .find(|m| m.volume_id == id && m.snapshot.is_none())
            .map(|m| m.lun);
        let lun = match (lun, current) {
            (None, Some(c)) => return Ok(c),
            (None, None) => lowest_free(&rows).ok_or_else(full)?,
            (Some(l), _) => l,
        };
        if current == Some(lun) {
            return Ok(lun);
        }
        check_free(&rows, lun)?;
        if let Some(c) = current {
            rows.remove(&c);
        }
        rows.insert(
            lun,
            Mapping {
                lun,
                volume_id: id,
                volume: volume.name().to_string(),
                snapshot: None,
                snapshot_id: None,
            },
        );
        self.commit(rows).map_err(ApiError::internal)?;
        Ok(lun)
    }

    /// Checks that `lun` could be given to a new export (in range and free), before creating
    /// what it is for.
    pub fn check_available(&self, lun: u64) -> Result<(), ApiError> {
        check_free(&self.luns.read(), lun)
    }

    /// Exports snapshot `volume@snapshot` read-only as LUN `lun` (or the lowest free one). An
    /// export already there at that LUN (or any, with `None`) is kept; at another LUN it is
    /// refused (409 `already_exported`).
    pub fn export_snapshot(
        &self,
        pool: &Pool,
        volume: &str,
        snapshot: &str,
        lun: Option<u64>,
    ) -> Result<u64, ApiError> {
        let _guard = self.saving.lock();
        self.reconcile(pool, false).map_err(ApiError::internal)?;
        let volume_id = pool.volume(volume)?.id();
        let snapshot_id = pool
            .list_snapshots(Some(volume))
            .into_iter()
            .find(|s| s.name == snapshot)
            .ok_or_else(|| ibid_engine::Error::NotFound(format!("{volume}@{snapshot}")))?
            .id;
        let mut rows = self.luns.read().clone();
        if let Some(m) = rows.values().find(|m| m.snapshot_id == Some(snapshot_id)) {
            return match lun {
                Some(l) if l != m.lun => Err(ApiError::conflict(
                    "already_exported",
                    format!(
                        "{volume}@{snapshot} is already exported as LUN {}; unexport it first",
                        m.lun
                    ),
                )),
                _ => Ok(m.lun),
            };
        }
        let lun = match lun {
            Some(l) => l,
            None => lowest_free(&rows).ok_or_else(full)?,
        };
        check_free(&rows, lun)?;
        rows.insert(
            lun,
            Mapping {
                lun,
                volume_id,
                volume: volume.to_string(),
                snapshot: Some(snapshot.to_string()),
                snapshot_id: Some(snapshot_id),
            },
        );
        self.commit(rows).map_err(ApiError::internal)?;
        Ok(lun)
    }

    /// Stops exporting snapshot `snapshot_id`; its LUN was returned (404 if it was not
    /// exported).
    pub fn unexport_snapshot(&self, snapshot_id: u64, name: &str) -> Result<u64, ApiError> {
        let _guard = self.saving.lock();
        let mut rows = self.luns.read().clone();
        let lun = rows
            .values()
            .find(|m| m.snapshot_id == Some(snapshot_id))
            .map(|m| m.lun)
            .ok_or_else(|| {
                ApiError::new(
                    axum::http::StatusCode::NOT_FOUND,
                    "not_found",
                    format!("{name} is not exported over iSCSI"),
                )
            })?;
        rows.remove(&lun);
        self.commit(rows).map_err(ApiError::internal)?;
        Ok(lun)
    }

    /// Reconciles the table with the pool (the caller holds `saving`). `fresh`: the pool had
    /// no table, so volumes keep their old LUN, id − 1, where it fits.
    fn reconcile(&self, pool: &Pool, fresh: bool) -> anyhow::Result<()> {
        let catalog = pool.catalog_generation();
        let volumes: HashMap<u64, String> = pool
            .list_volumes_now()
            .into_iter()
            .map(|v| (v.id, v.name))
            .collect();
        let snapshots: HashMap<u64, (String, String)> = pool
            .list_snapshots(None)
            .into_iter()
            .map(|s| (s.id, (s.volume, s.name)))
            .collect();
        let mut rows = self.luns.read().clone();
        let before = rows.clone();
        rows.retain(|_, m| match m.snapshot_id {
            None => volumes.get(&m.volume_id) == Some(&m.volume),
            Some(sid) => {
                volumes.get(&m.volume_id) == Some(&m.volume)
                    && snapshots
                        .get(&sid)
                        .is_some_and(|(v, s)| *v == m.volume && Some(s) == m.snapshot.as_ref())
            }
        });
        let mut unmapped: Vec<(u64, &String)> = volumes
            .iter()
            .filter(|(id, _)| {
                !rows
                    .values()
                    .any(|m| m.volume_id == **id && m.snapshot.is_none())
            })
            .map(|(id, name)| (*id, name))
            .collect();
        unmapped.sort();
        for (id, name) in unmapped {
            let old = id.checked_sub(1).filter(|l| *l <= LUN_MAX);
            let lun = match old {
                Some(l) if fresh && !rows.contains_key(&l) => Some(l),
                _ => lowest_free(&rows),
            };
            let Some(lun) = lun else {
                tracing::warn!("volume {name:?} gets no iSCSI LUN: all {LUN_MAX} are in use");
                continue;
            };
            rows.insert(
                lun,
                Mapping {
                    lun,
                    volume_id: id,
                    volume: name.clone(),
                    snapshot: None,
                    snapshot_id: None,
                },
            );
        }
        if rows != before || (fresh && !rows.is_empty()) {
            self.commit(rows)?;
        }
        self.seen_catalog.store(catalog, Relaxed);
        Ok(())
    }

    /// Writes `rows` to the file, then puts them in force (the caller holds `saving`).
    fn commit(&self, rows: BTreeMap<u64, Mapping>) -> anyhow::Result<()> {
        save(&self.path, &rows)?;
        *self.luns.write() = rows;
        self.generation.fetch_add(1, Relaxed);
        Ok(())
    }
}

/// The table's mappings, if they are consistent (LUNs in range and once each).
fn checked(path: &Path, table: Table) -> anyhow::Result<Vec<Mapping>> {
    let mut seen = std::collections::HashSet::new();
    for m in &table.luns {
        if m.lun > LUN_MAX || !seen.insert(m.lun) || m.snapshot.is_some() != m.snapshot_id.is_some()
        {
            anyhow::bail!(
                "the LUN table in {} is inconsistent at LUN {}",
                path.display(),
                m.lun
            );
        }
    }
    Ok(table.luns)
}

/// The lowest LUN no mapping uses.
fn lowest_free(rows: &BTreeMap<u64, Mapping>) -> Option<u64> {
    (0..=LUN_MAX).find(|l| !rows.contains_key(l))
}

fn full() -> ApiError {
    ApiError::conflict("lun_in_use", format!("all {} LUNs are in use", LUN_MAX + 1))
}

fn check_free(rows: &BTreeMap<u64, Mapping>, lun: u64) -> Result<(), ApiError> {
    if lun > LUN_MAX {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "invalid_argument",
            format!("LUN {lun}: LUNs are 0 to {LUN_MAX}"),
        ));
    }
    match rows.get(&lun) {
        Some(m) => Err(ApiError::conflict(
            "lun_in_use",
            format!("LUN {lun} is {}", m.name()),
        )),
        None => Ok(()),
    }
}

/// Writes the table crash-safely: a temporary file, synced, renamed over `path`, directory
/// synced.
fn save(path: &Path, rows: &BTreeMap<u64, Mapping>) -> anyhow::Result<()> {
    let table = Table {
        version: FILE_VERSION,
        luns: rows.values().cloned().collect(),
    };
    let text = serde_json::to_string_pretty(&table)? + "\n";
    crate::durable::write_file(path, text.as_bytes())
        .map_err(|e| anyhow::anyhow!("write the LUN table to {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> (tempfile::TempDir, Pool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = Pool::create(
            dir.path().join("pool"),
            ibid_engine::PoolConfig {
                capacity_bytes: Some(1 << 30),
                background: false,
                ..ibid_engine::PoolConfig::default()
            },
        )
        .expect("pool");
        (dir, pool)
    }

    /// A pool without a table keeps the old numbers (id − 1); new volumes get the lowest free
    /// LUN; a deleted volume's LUN is free again; the table survives a reopen.
    #[test]
    fn old_numbers_kept_then_lowest_free() {
        let (_dir, pool) = pool();
        for n in ["a", "b", "c"] {
            pool.create_volume(n, 1 << 20).expect("create");
        }
        pool.create_snapshot("a", "s").expect("snapshot");
        pool.delete_volume("b").expect("delete");
        let ids: Vec<u64> = ["a", "c"]
            .iter()
            .map(|n| pool.volume(n).expect("volume").id())
            .collect();
        let map = LunMap::open(&pool).expect("open");
        assert_eq!(map.lun_of_volume(ids[0]), Some(ids[0] - 1));
        assert_eq!(map.lun_of_volume(ids[1]), Some(ids[1] - 1));
        let d = pool.create_volume("d", 1 << 20).expect("create").id();
        map.refresh(&pool).expect("refresh");
        let lowest = (0..)
            .find(|l| !ids.iter().any(|id| id - 1 == *l))
            .expect("free");
        assert_eq!(map.lun_of_volume(d), Some(lowest));
        let gen = map.generation();
        assert!(map.assign(&pool, d, Some(ids[0] - 1)).is_err(), "taken");
        assert_eq!(map.assign(&pool, d, Some(40)).expect("move"), 40);
        assert!(map.generation() > gen);
        assert!(map.assign(&pool, d, Some(LUN_MAX + 1)).is_err());
        let snap = map.export_snapshot(&pool, "a", "s", None).expect("export");
        assert_eq!(map.get(snap).and_then(|m| m.snapshot), Some("s".into()));
        drop(map);
        let map = LunMap::open(&pool).expect("reopen");
        assert_eq!(map.lun_of_volume(d), Some(40));
        assert_eq!(map.get(snap).map(|m| m.name()), Some("a@s".into()));
        pool.delete_volume("a").expect("delete a");
        map.refresh(&pool).expect("refresh");
        assert_eq!(map.get(snap), None, "the snapshot went with its volume");
        assert_eq!(map.lun_of_volume(ids[0]), None);
        let luns: Vec<u64> = map.list().iter().map(|m| m.lun).collect();
        assert_eq!(luns, [ids[1] - 1, 40]);
        pool.close().expect("close");
    }
}
