//! The pool's catalog in memory: its live volumes by name, its snapshots by
//! `VOLUME@SNAPSHOT`, the volumes and snapshots removed but not yet committed away, and a
//! generation that moves with every change (front ends rescan their LUNs and exports on it).
//!
//! Names stay unique, whichever way a volume or snapshot is created:
//! - a name is added only through [`Adding`], which holds the lock that serializes additions
//!   from the name's check until its insertion, while the creation writes its records in
//!   between;
//! - the check is made with the commit lock held (it takes the [`CommitState`] as proof), and
//!   refuses a name that is live **or retired**: a removed volume's record is deleted by name
//!   by the next commit, which would otherwise delete a new record of the same name;
//! - a removal takes the name out of the live set and retires it in one critical section, so a
//!   check never sees the name in neither.
//!
//! Lock order: `adding`, then the commit lock and the gate (held by callers), then `volumes`,
//! `snapshots`, `retired`, and last a volume's map.

use crate::commit_state::CommitState;
use crate::error::{Error, Result};
use crate::volume_state::{VolumeMap, VolumeState};
use parking_lot::{Mutex, MutexGuard, RwLock};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The catalog (see the module's doc).
pub(crate) struct Catalog {
    volumes: RwLock<BTreeMap<String, Arc<VolumeState>>>,
    /// By `VOLUME@SNAPSHOT` (their states' names).
    snapshots: RwLock<BTreeMap<String, Arc<VolumeState>>>,
    /// Removed, their records not yet deleted: the next commit's cut takes them.
    retired: Mutex<Vec<Arc<VolumeState>>>,
    /// Serializes additions ([`Catalog::adding`]).
    adding: Mutex<()>,
    generation: AtomicU64,
}

impl Catalog {
    /// A catalog of the live `volumes` and `snapshots` (read-only states), by name.
    pub(crate) fn new(volumes: Vec<Arc<VolumeState>>, snapshots: Vec<Arc<VolumeState>>) -> Self {
        let by_name = |states: Vec<Arc<VolumeState>>| {
            states
                .into_iter()
                .map(|s| (s.name.clone(), s))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(volumes.iter().all(|v| !v.read_only));
        assert!(snapshots
            .iter()
            .all(|s| s.read_only && s.name.contains('@')));
        Catalog {
            volumes: RwLock::new(by_name(volumes)),
            snapshots: RwLock::new(by_name(snapshots)),
            retired: Mutex::new(Vec::new()),
            adding: Mutex::new(()),
            generation: AtomicU64::new(0),
        }
    }

    /// Bumped by every addition and removal.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// The live volume `name`.
    pub(crate) fn volume(&self, name: &str) -> Result<Arc<VolumeState>> {
        self.volumes
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    /// The live volume with id `id`.
    pub(crate) fn volume_by_id(&self, id: u64) -> Option<Arc<VolumeState>> {
        self.volumes.read().values().find(|v| v.id == id).cloned()
    }

    /// The live volumes, by name.
    pub(crate) fn volumes(&self) -> Vec<Arc<VolumeState>> {
        self.volumes.read().values().cloned().collect()
    }

    /// Whether any live volume satisfies `f` (called with the catalog read-locked).
    pub(crate) fn any_volume(&self, f: impl Fn(&VolumeState) -> bool) -> bool {
        self.volumes.read().values().any(|v| f(v))
    }

    /// The snapshot `key` (`VOLUME@SNAPSHOT`).
    pub(crate) fn snapshot(&self, key: &str) -> Result<Arc<VolumeState>> {
        self.snapshots
            .read()
            .get(key)
            .cloned()
            .ok_or_else(|| Error::NotFound(key.to_string()))
    }

    /// The snapshots, by key.
    pub(crate) fn snapshots(&self) -> Vec<Arc<VolumeState>> {
        self.snapshots.read().values().cloned().collect()
    }

    /// Takes the lock that serializes additions: a name checked through the guard stays free
    /// until the guard inserts it.
    pub(crate) fn adding(&self) -> Adding<'_> {
        Adding {
            catalog: self,
            _lock: self.adding.lock(),
        }
    }

    /// Removes the live volume `name` and its snapshots, and retires them: each is marked
    /// deleted (the volume's map passed to `retiring` as it is marked, for what the caller
    /// releases with it), and the next commit deletes their records and layers.
    pub(crate) fn remove_volume(
        &self,
        name: &str,
        retiring: impl FnOnce(&VolumeState, &VolumeMap),
    ) -> Result<()> {
        let mut volumes = self.volumes.write();
        let mut snapshots = self.snapshots.write();
        let mut retired = self.retired.lock();
        let state = volumes
            .remove(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        {
            let mut map = state.map.lock();
            map.deleted = true;
            retiring(&state, &map);
        }
        retired.push(state);
        let prefix = format!("{name}@");
        let keys: Vec<String> = snapshots
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let snap = snapshots.remove(&key).expect("listed under the lock");
            snap.map.lock().deleted = true;
            retired.push(snap);
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Removes the snapshot `key` and retires it, as [`Self::remove_volume`] does.
    pub(crate) fn remove_snapshot(&self, key: &str) -> Result<()> {
        let mut snapshots = self.snapshots.write();
        let mut retired = self.retired.lock();
        let snap = snapshots
            .remove(key)
            .ok_or_else(|| Error::NotFound(key.to_string()))?;
        snap.map.lock().deleted = true;
        retired.push(snap);
        self.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The volumes and snapshots retired since the last call, for the commit that deletes
    /// their records (call with the commit lock held).
    pub(crate) fn take_retired(&self, _cs: &CommitState) -> Vec<Arc<VolumeState>> {
        std::mem::take(&mut *self.retired.lock())
    }
}

/// The addition lock held ([`Catalog::adding`]).
pub(crate) struct Adding<'a> {
    catalog: &'a Catalog,
    _lock: MutexGuard<'a, ()>,
}

impl Adding<'_> {
    /// Fails with `AlreadyExists` if `name` — a volume name, or a snapshot's
    /// `VOLUME@SNAPSHOT` — is live, or retired and not yet committed away. Call with the commit
    /// lock held (`_cs`), so that no commit runs between this check and the creation's records.
    pub(crate) fn check_free(&self, _cs: &CommitState, name: &str) -> Result<()> {
        let live = match name.contains('@') {
            true => self.catalog.snapshots.read().contains_key(name),
            false => self.catalog.volumes.read().contains_key(name),
        };
        if live || self.catalog.retired.lock().iter().any(|r| r.name == name) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
        Ok(())
    }

    /// Inserts `state` — a volume, or a snapshot if read-only — whose name was checked free
    /// through this guard and whose records are written.
    pub(crate) fn insert(&self, state: Arc<VolumeState>) {
        let previous = match state.read_only {
            true => self
                .catalog
                .snapshots
                .write()
                .insert(state.name.clone(), state),
            false => self
                .catalog
                .volumes
                .write()
                .insert(state.name.clone(), state),
        };
        assert!(previous.is_none(), "a name was added twice");
        self.catalog.generation.fetch_add(1, Ordering::Relaxed);
    }
}
