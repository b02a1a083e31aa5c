//! Instant restores in progress ([`ibid_offload::InstantRestore`]): volumes restored from a
//! remote that hosts use while their chunks arrive. The NBD and iSCSI front ends ask
//! [`InstantRestores::active`] for a volume's restore and call its hooks around every request;
//! operations that would see the volume's missing chunks as holes (snapshots, clones, range
//! copies, resizes, EXTENDED COPY) are refused until it is complete
//! ([`InstantRestores::refuse`]).
//!
//! Kept across restarts in `instant-restores.json` (written crash-safely), with each restore's
//! mark log in `instant-restores/<volume id>.marks`. An entry is written *before* its volume
//! is created, without a volume id; the id is added once the volume and its mark log exist. At
//! start, an entry without an id names a volume no host has used yet: it is deleted. An entry
//! with one is resumed: its volume stays unreachable (`opening`) until its manifest is read
//! again, then the fill goes on where it stopped.

use crate::api::ApiError;
use ibid_engine::Pool;
use ibid_offload::{InstantRestore, Progress};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// The file in the pool directory.
pub const FILE_NAME: &str = "instant-restores.json";
/// The directory of the mark logs, in the pool directory.
pub const MARKS_DIR: &str = "instant-restores";
const FILE_VERSION: u64 = 1;

/// One restore as the file keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Kept {
    /// The new volume.
    pub volume: String,
    /// Its id, once it exists.
    pub volume_id: Option<u64>,
    /// The remote it comes from.
    pub remote: String,
    /// `VOLUME@SNAPSHOT` in the remote.
    pub snapshot: String,
    /// Fill rate limit (bytes received per second), if any.
    pub fill_bytes_per_s: Option<u64>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    version: u64,
    restores: Vec<Kept>,
}

#[derive(Default)]
struct State {
    kept: Vec<Kept>,
    /// By volume id, once resumed or started.
    running: HashMap<u64, Arc<InstantRestore>>,
    /// Volumes that exist (or are being made) but whose restore is not running yet: no host
    /// may reach them.
    opening: HashSet<String>,
    /// Volume ids whose background fill is running (as a job).
    filling: HashSet<u64>,
}

/// The pool's instant restores.
pub struct InstantRestores {
    /// `instant-restores.json`; `None` keeps nothing (tests).
    path: Option<PathBuf>,
    marks_dir: PathBuf,
    state: Mutex<State>,
    /// Restores not complete (the front ends' fast path: nothing to look up when 0).
    active: AtomicUsize,
}

impl InstantRestores {
    /// The restores kept in `pool`'s directory. Entries whose volume was never handed to a
    /// host are dropped (their volume deleted); the others wait, unreachable, for
    /// [`InstantRestores::resume`].
    pub fn open(pool: &Pool) -> anyhow::Result<InstantRestores> {
        let path = pool.dir().join(FILE_NAME);
        let kept = crate::durable::read_table::<Table>(&path, "instant restores", FILE_VERSION)?
            .map(|t| t.restores)
            .unwrap_or_default();
        let this = InstantRestores {
            path: Some(path),
            marks_dir: pool.dir().join(MARKS_DIR),
            state: Mutex::new(State::default()),
            active: AtomicUsize::new(0),
        };
        let mut resumed = Vec::new();
        let listed = kept.len();
        for k in kept {
            match k.volume_id {
                Some(id) if pool.volume_by_id(id).is_ok() => resumed.push(k),
                _ => {
                    match pool.delete_volume(&k.volume) {
                        Ok(()) => tracing::warn!(
                            "deleted volume {}: its instant restore of {} had not started when \
                             the server stopped; restore it again",
                            k.volume,
                            k.snapshot
                        ),
                        Err(ibid_engine::Error::NotFound(_)) => {}
                        Err(e) => anyhow::bail!("delete the unstarted restore {}: {e}", k.volume),
                    }
                    if let Some(id) = k.volume_id {
                        let _ = std::fs::remove_file(this.marks_path(id));
                    }
                }
            }
        }
        {
            let mut s = this.state.lock();
            s.opening = resumed.iter().map(|k| k.volume.clone()).collect();
            s.kept = resumed;
        }
        if this.state.lock().kept.len() != listed {
            this.write().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        }
        Ok(this)
    }

    /// None kept, nothing written (tests of the front ends).
    #[cfg(test)]
    pub fn in_memory() -> InstantRestores {
        InstantRestores {
            path: None,
            marks_dir: PathBuf::new(),
            state: Mutex::new(State::default()),
            active: AtomicUsize::new(0),
        }
    }

    fn marks_path(&self, volume_id: u64) -> PathBuf {
        ibid_offload::marks_file(&self.marks_dir, volume_id)
    }

    fn write(&self) -> Result<(), ApiError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let restores = self.state.lock().kept.clone();
        let text = serde_json::to_vec_pretty(&Table {
            version: FILE_VERSION,
            restores,
        })
        .map_err(|e| ApiError::internal(e.into()))?;
        crate::durable::write_file(path, &text)
            .map_err(|e| ApiError::internal(anyhow::anyhow!("write {}: {e}", path.display())))
    }

    /// The restore of volume `volume_id` while it is not complete.
    pub fn active(&self, volume_id: u64) -> Option<Arc<InstantRestore>> {
        if self.active.load(Relaxed) == 0 {
            return None;
        }
        let s = self.state.lock();
        s.running
            .get(&volume_id)
            .filter(|r| !r.is_complete())
            .cloned()
    }

    /// Whether hosts must not reach volume `name` yet (its restore is being started or
    /// resumed).
    pub fn is_opening(&self, name: &str) -> bool {
        self.active.load(Relaxed) != 0 && self.state.lock().opening.contains(name)
    }

    /// An error if volume `name` is being restored: what it does not hold yet would be copied
    /// as holes.
    pub fn refuse(&self, pool: &Pool, name: &str, what: &str) -> Result<(), ApiError> {
        if self.active.load(Relaxed) == 0 {
            return Ok(());
        }
        let restoring = self.is_opening(name)
            || pool
                .volume(name)
                .is_ok_and(|v| self.active(v.id()).is_some());
        if restoring {
            return Err(ApiError::conflict(
                "restoring",
                format!(
                    "volume {name} is being restored from a remote (instant restore): {what} \
                     waits until it holds all its data (ibid job list)"
                ),
            ));
        }
        Ok(())
    }

    /// Waits (at most `timeout`) until no kept restore is still being resumed.
    pub async fn wait_resumed(&self, timeout: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.state.lock().opening.is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// What the API shows of volume `volume_id`'s restore, if one runs (or waits to resume).
    pub fn view(&self, volume_id: u64) -> Option<serde_json::Value> {
        if self.active.load(Relaxed) == 0 {
            return None;
        }
        let Some(r) = self.active(volume_id) else {
            let s = self.state.lock();
            let k = s.kept.iter().find(|k| k.volume_id == Some(volume_id))?;
            return s.opening.contains(&k.volume).then(|| {
                serde_json::json!({
                    "snapshot": k.snapshot,
                    "remote": k.remote,
                    "resuming": true,
                })
            });
        };
        let (total, present) = r.bytes();
        let kept = self
            .state
            .lock()
            .kept
            .iter()
            .find(|k| k.volume_id == Some(volume_id))
            .cloned();
        Some(serde_json::json!({
            "snapshot": r.snapshot(),
            "remote": kept.map(|k| k.remote),
            "bytes_total": total,
            "bytes_present": present,
            "resuming": false,
        }))
    }

    /// Starts an instant restore of `snapshot` (`VOLUME@SNAPSHOT`) from `remote` (named
    /// `remote_name`) into the new volume `new_name`. The volume is unreachable until this
    /// returns, and listed in the file before it exists.
    pub async fn start(
        &self,
        pool: &Pool,
        remote: &ibid_offload::Remote,
        remote_name: &str,
        snapshot: &str,
        new_name: &str,
        fill_bytes_per_s: Option<u64>,
    ) -> Result<Arc<InstantRestore>, ApiError> {
        let (volume, snap) = snapshot.split_once('@').ok_or_else(|| {
            ApiError::bad_request(format!("{snapshot:?}: expected VOLUME@SNAPSHOT"))
        })?;
        let kept = Kept {
            volume: new_name.to_string(),
            volume_id: None,
            remote: remote_name.to_string(),
            snapshot: snapshot.to_string(),
            fill_bytes_per_s,
        };
        {
            let mut s = self.state.lock();
            if s.opening.contains(new_name) || s.kept.iter().any(|k| k.volume == new_name) {
                return Err(ApiError::conflict(
                    "already_exists",
                    format!("volume {new_name:?} is being restored"),
                ));
            }
            s.opening.insert(new_name.to_string());
            s.kept.push(kept.clone());
        }
        self.active.fetch_add(1, Relaxed);
        let undo = |this: &Self| {
            let mut s = this.state.lock();
            s.opening.remove(new_name);
            s.kept.retain(|k| k.volume != new_name);
            drop(s);
            this.active.fetch_sub(1, Relaxed);
            let _ = this.write();
        };
        if let Err(e) = self.write() {
            undo(self);
            return Err(e);
        }
        let started = remote
            .instant_restore(pool, volume, snap, new_name, &self.marks_dir)
            .await;
        let ir = match started {
            Ok(ir) => ir,
            Err(e) => {
                undo(self);
                return Err(crate::remotes::offload_error(e));
            }
        };
        let id = ir.volume().id();
        {
            let mut s = self.state.lock();
            if let Some(k) = s.kept.iter_mut().find(|k| k.volume == new_name) {
                k.volume_id = Some(id);
            }
        }
        if let Err(e) = self.write() {
            let _ = pool.delete_volume(new_name);
            let _ = std::fs::remove_file(self.marks_path(id));
            undo(self);
            return Err(e);
        }
        let mut s = self.state.lock();
        s.running.insert(id, ir.clone());
        s.opening.remove(new_name);
        Ok(ir)
    }

    /// Resumes the kept restores: each waits (retrying every few seconds) until its remote
    /// answers, then runs its fill as a job. Call once, inside the runtime.
    pub fn resume(
        self: &Arc<Self>,
        pool: &Pool,
        remotes: &Arc<crate::remotes::Remotes>,
        jobs: &Arc<crate::jobs::Jobs>,
        stats: &Arc<crate::metrics::OffloadStats>,
    ) {
        let kept = self.state.lock().kept.clone();
        self.active.fetch_add(kept.len(), Relaxed);
        for k in kept {
            let (this, pool, remotes, jobs, stats) = (
                self.clone(),
                pool.clone(),
                remotes.clone(),
                jobs.clone(),
                stats.clone(),
            );
            tokio::spawn(async move {
                let id = k.volume_id.expect("kept restores have ids");
                let ir = loop {
                    match this.resume_one(&pool, &remotes, &k, id).await {
                        Ok(ir) => break ir,
                        Err(e) => {
                            tracing::warn!(
                                "instant restore of {} into {}: {e}; trying again in 5 s",
                                k.snapshot,
                                k.volume
                            );
                            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                        }
                    }
                };
                {
                    let mut s = this.state.lock();
                    s.running.insert(id, ir.clone());
                    s.opening.remove(&k.volume);
                }
                tracing::info!(
                    "instant restore of {} into {} resumed ({} of {} bytes present)",
                    k.snapshot,
                    k.volume,
                    ir.bytes().1,
                    ir.bytes().0
                );
                let _ = this.run_fill(ir, &k, &jobs, &stats).await;
            });
        }
    }

    async fn resume_one(
        &self,
        pool: &Pool,
        remotes: &crate::remotes::Remotes,
        k: &Kept,
        id: u64,
    ) -> anyhow::Result<Arc<InstantRestore>> {
        let remote = remotes
            .remote(&k.remote)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        let (volume, snap) = k
            .snapshot
            .split_once('@')
            .ok_or_else(|| anyhow::anyhow!("bad snapshot {:?}", k.snapshot))?;
        Ok(remote
            .resume_instant_restore(pool, id, volume, snap, &self.marks_dir)
            .await?)
    }

    /// Runs `ir`'s fill as a job (in the background); once complete, its entry and mark log
    /// go. Answers the job as the API shows it.
    pub async fn run_fill(
        self: &Arc<Self>,
        ir: Arc<InstantRestore>,
        k: &Kept,
        jobs: &Arc<crate::jobs::Jobs>,
        stats: &Arc<crate::metrics::OffloadStats>,
    ) -> Result<serde_json::Value, ApiError> {
        let progress = Arc::new(Progress::default());
        let label = format!("{}:{} -> {} (instant)", k.remote, k.snapshot, k.volume);
        let id = ir.volume().id();
        if !self.state.lock().filling.insert(id) {
            return Err(fill_running(&k.volume));
        }
        let work = {
            let (this, progress, stats) = (self.clone(), progress.clone(), stats.clone());
            let rate = k.fill_bytes_per_s;
            let started = std::time::Instant::now();
            async move {
                let filled = ir.fill(progress.clone(), rate).await;
                this.state.lock().filling.remove(&id);
                stats.restored_bytes.fetch_add(ir.received_bytes(), Relaxed);
                filled.map_err(crate::remotes::offload_error)?;
                this.finish(&ir)?;
                stats.restores.fetch_add(1, Relaxed);
                let (total, _) = ir.bytes();
                tracing::info!(
                    "instant restore of {} into {} complete: {} bytes received",
                    ir.snapshot(),
                    ir.volume().name(),
                    ir.received_bytes()
                );
                Ok(serde_json::json!({
                    "volume": ir.volume().name(),
                    "snapshot": ir.snapshot(),
                    "instant": true,
                    "size_bytes": ir.volume().size(),
                    "data_bytes": total,
                    "bytes_received": ir.received_bytes(),
                    "duration_s": started.elapsed().as_secs_f64(),
                }))
            }
        };
        // Not run again by the jobs: the restore resumes by itself at the next start.
        let ran = jobs.run("restore", label, true, progress, None, work).await;
        if ran.is_err() {
            self.state.lock().filling.remove(&id);
        }
        Ok(ran?.1 .0)
    }

    /// Starts volume `name`'s background fill again (after its job was cancelled), at
    /// `bytes_per_s` if given (kept for later starts; 0: no limit), else at the rate it had.
    /// Answers the job.
    pub async fn fill_again(
        self: &Arc<Self>,
        name: &str,
        bytes_per_s: Option<u64>,
        jobs: &Arc<crate::jobs::Jobs>,
        stats: &Arc<crate::metrics::OffloadStats>,
    ) -> Result<serde_json::Value, ApiError> {
        let (ir, kept) = {
            let mut s = self.state.lock();
            let Some(volume_id) = s
                .kept
                .iter()
                .find(|k| k.volume == name)
                .map(|k| k.volume_id)
            else {
                return Err(ApiError::new(
                    axum::http::StatusCode::NOT_FOUND,
                    "not_found",
                    format!("volume {name:?} is not being restored"),
                ));
            };
            let Some(ir) = volume_id.and_then(|id| s.running.get(&id).cloned()) else {
                return Err(ApiError::conflict(
                    "restoring",
                    format!("the restore of {name:?} has not resumed yet"),
                ));
            };
            let id = ir.volume().id();
            if s.filling.contains(&id) {
                // Refused before the rate changes (`run_fill` checks again, atomically).
                return Err(fill_running(name));
            }
            let k = s
                .kept
                .iter_mut()
                .find(|k| k.volume == name)
                .expect("found above");
            if let Some(rate) = bytes_per_s {
                k.fill_bytes_per_s = (rate > 0).then_some(rate);
            }
            (ir, k.clone())
        };
        self.write()?;
        self.run_fill(ir, &kept, jobs, stats).await
    }

    /// A complete restore: its entry and mark log go (the volume holds the snapshot durably:
    /// the fill flushed it).
    fn finish(&self, ir: &InstantRestore) -> Result<(), ApiError> {
        let id = ir.volume().id();
        let removed = {
            let mut s = self.state.lock();
            let was = s.running.remove(&id).is_some();
            s.kept.retain(|k| k.volume_id != Some(id));
            was
        };
        if removed {
            self.active.fetch_sub(1, Relaxed);
        }
        self.write()?;
        let _ = std::fs::remove_file(self.marks_path(id));
        Ok(())
    }

    /// Volume `name` is being deleted: its restore stops and is forgotten.
    pub fn forget(&self, name: &str) -> Result<(), ApiError> {
        let gone = {
            let mut s = self.state.lock();
            let Some(k) = s.kept.iter().find(|k| k.volume == name).cloned() else {
                return Ok(());
            };
            s.kept.retain(|x| x.volume != name);
            s.opening.remove(name);
            k.volume_id.and_then(|id| s.running.remove(&id))
        };
        self.active.fetch_sub(1, Relaxed);
        if let Some(ir) = &gone {
            ir.stop();
            let _ = std::fs::remove_file(self.marks_path(ir.volume().id()));
        }
        self.write()
    }

    /// At a clean stop: every running restore's fill stops (at its next pack) and its volume
    /// and marks are flushed; the next start resumes it.
    pub fn stop_all(&self) {
        let running: Vec<Arc<InstantRestore>> =
            self.state.lock().running.values().cloned().collect();
        for ir in running {
            ir.stop();
            if let Err(e) = ir.flush() {
                tracing::warn!("flush the instant restore of {}: {e}", ir.volume().name());
            }
        }
    }
}

/// The answer to starting a fill that runs already.
fn fill_running(volume: &str) -> ApiError {
    ApiError::conflict(
        "busy",
        format!(
            "the background fill of {volume}'s restore is running (`ibid job list`; cancel its \
             job first to start it again at another rate)"
        ),
    )
}

/// A volume's instant restore as the front ends use it around each request; does nothing for
/// a volume not being restored (or once its restore is complete).
#[derive(Clone, Default)]
pub struct RestoreHooks(Option<Arc<InstantRestore>>);

impl RestoreHooks {
    /// The hooks of volume `volume_id` (none if it is not being restored).
    pub fn of(instants: &InstantRestores, volume_id: u64) -> RestoreHooks {
        RestoreHooks(instants.active(volume_id))
    }

    fn live(&self) -> Option<&InstantRestore> {
        self.0.as_deref().filter(|r| !r.is_complete())
    }

    /// Whether requests must leave the connection's task for a worker (a fetch blocks).
    pub fn is_live(&self) -> bool {
        self.live().is_some()
    }

    /// Fetches the chunks of `off..off + len` the volume lacks (a copy's source).
    pub fn fetch(&self, off: u64, len: u64) -> EngineResult<()> {
        match self.live() {
            Some(r) => r.before_read(off, len).map_err(engine_error),
            None => Ok(()),
        }
    }

    /// Reads `buf.len()` bytes at `off`, fetching what the volume lacks first.
    pub fn read(&self, volume: &ibid_engine::Volume, off: u64, buf: &mut [u8]) -> EngineResult<()> {
        if let Some(r) = self.live() {
            r.before_read(off, buf.len() as u64).map_err(engine_error)?;
        }
        volume.read(off, buf)
    }

    /// Reads as [`RestoreHooks::read`] does, leaving the blocks found in the pool's read
    /// cache there ([`ibid_engine::Volume::read_held`]).
    pub fn read_held(
        &self,
        volume: &ibid_engine::Volume,
        off: u64,
        buf: &mut [u8],
    ) -> EngineResult<ibid_engine::HeldBlocks> {
        if let Some(r) = self.live() {
            r.before_read(off, buf.len() as u64).map_err(engine_error)?;
        }
        volume.read_held(off, buf)
    }

    /// Runs `write`, a write of `len` bytes at `off` (or a zeroing), around the restore's
    /// hooks; with `fua`, the restore's marks are made durable with it.
    pub fn write<T>(
        &self,
        off: u64,
        len: u64,
        fua: bool,
        write: impl FnOnce() -> EngineResult<T>,
    ) -> EngineResult<T> {
        let Some(r) = self.live() else {
            return write();
        };
        let claim = r.before_write(off, len).map_err(engine_error)?;
        let result = write();
        r.after_write(claim, result.is_ok());
        if fua && result.is_ok() {
            r.flush().map_err(engine_error)?;
        }
        result
    }

    /// A compare-and-write of `len` bytes at `off`: the bytes compared are fetched first.
    pub fn compare_and_write<T>(
        &self,
        off: u64,
        len: u64,
        op: impl FnOnce() -> EngineResult<T>,
    ) -> EngineResult<T> {
        if let Some(r) = self.live() {
            r.before_read(off, len).map_err(engine_error)?;
        }
        self.write(off, len, false, op)
    }

    /// Flushes the volume (and the restore's marks).
    pub fn flush(&self, volume: &ibid_engine::Volume) -> EngineResult<()> {
        match &self.0 {
            // Even once complete: marks queued before completion are harmless to write.
            Some(r) => r.flush().map_err(engine_error),
            None => volume.flush(),
        }
    }

    /// `extents` (block status of the volume) with the snapshot data not fetched yet shown as
    /// data: the volume holds zeros there, a host must not take them for holes.
    pub fn block_status(&self, extents: Vec<ibid_engine::Extent>) -> Vec<ibid_engine::Extent> {
        use ibid_engine::{Extent, ExtentKind};
        let Some(r) = self.live() else {
            return extents;
        };
        let mut out: Vec<Extent> = Vec::with_capacity(extents.len());
        let mut push = |offset: u64, length: u64, kind: ExtentKind| {
            if length == 0 {
                return;
            }
            match out.last_mut() {
                Some(last) if last.kind == kind && last.offset + last.length == offset => {
                    last.length += length;
                }
                _ => out.push(Extent {
                    offset,
                    length,
                    kind,
                }),
            }
        };
        for e in extents {
            if e.kind == ExtentKind::Data {
                push(e.offset, e.length, e.kind);
                continue;
            }
            let mut at = e.offset;
            for u in r.unfetched(e.offset, e.length) {
                push(at, u.start - at, ExtentKind::Zero);
                push(u.start, u.end - u.start, ExtentKind::Data);
                at = u.end;
            }
            push(at, e.offset + e.length - at, ExtentKind::Zero);
        }
        out
    }
}

type EngineResult<T> = Result<T, ibid_engine::Error>;

/// An offload error as the front ends report it: the engine's own, or an I/O error.
fn engine_error(e: ibid_offload::Error) -> ibid_engine::Error {
    match e {
        ibid_offload::Error::Engine(e) => e,
        ibid_offload::Error::Corrupt(m) => ibid_engine::Error::Corrupt(m),
        other => ibid_engine::Error::Io {
            context: "fetch a chunk from the remote".into(),
            source: std::io::Error::other(other.to_string()),
        },
    }
}
