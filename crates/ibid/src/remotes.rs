//! Remotes (S3-compatible object stores that snapshots are pushed to) and their API routes:
//! `/api/v1/remotes` (add, list, remove, verify, gc, snapshots, restore) and
//! `/api/v1/volumes/{name}/snapshots/{snapshot}/push`.
//!
//! The remotes are kept in `remotes.json` in the pool directory, owned by this binary, written
//! crash-safely ([`crate::durable::write_private_file`]: readable by the owner only, since it
//! holds the secret keys). The API never returns a credential and nothing here logs one.

use crate::api::ApiError;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use ibid_engine::Pool;
use ibid_offload::{Checkpoint, Progress, Remote, RemoteConfig, RestoreDone};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The file in the pool directory.
pub const FILE_NAME: &str = "remotes.json";
/// Version of `remotes.json`'s format.
const FILE_VERSION: u64 = 1;
/// Most remotes a pool keeps (a bound on the file and on what a listing returns).
const REMOTES_MAX: usize = 64;

/// `remotes.json`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    version: u64,
    remotes: BTreeMap<String, RemoteConfig>,
    /// Volumes being restored: a volume still listed at start was cut off by a stop, a crash
    /// or a kill and holds part of its snapshot; it is deleted unless `restore_progress` says
    /// where its restore goes on from.
    #[serde(default)]
    restoring: Vec<String>,
    /// The last checkpoint of each full restore in `restoring` that made one.
    #[serde(default)]
    restore_progress: BTreeMap<String, RestoreProgress>,
}

/// A full restore's last checkpoint: what its volume holds, so a restore of the same snapshot
/// from the same remote into it goes on from there after a stop, a crash or a kill.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct RestoreProgress {
    remote: String,
    /// `VOLUME@SNAPSHOT`.
    snapshot: String,
    /// The id of the volume being filled (a volume of the same name made since is not it).
    volume_id: u64,
    /// The packs (hex names) whose records are written and flushed.
    done_packs: Vec<String>,
}

/// What the file keeps.
#[derive(Clone, Default)]
struct Kept {
    remotes: BTreeMap<String, RemoteConfig>,
    restoring: Vec<String>,
    restore_progress: BTreeMap<String, RestoreProgress>,
}

/// The pool's remotes.
pub struct Remotes {
    /// `remotes.json`; `None` keeps nothing (tests).
    path: Option<PathBuf>,
    /// Held while a change is written, so the file and the table change together.
    state: Mutex<Kept>,
    /// The volumes full restores are filling now (one restore per volume at a time).
    restores_running: Mutex<std::collections::BTreeSet<String>>,
}

/// A volume's place in [`Remotes::restores_running`], given back when dropped.
struct RunningRestore {
    remotes: Arc<Remotes>,
    volume: String,
}

impl Drop for RunningRestore {
    fn drop(&mut self) {
        self.remotes.restores_running.lock().remove(&self.volume);
    }
}

impl Remotes {
    /// The remotes kept in `pool`'s directory (none if it has no `remotes.json`).
    pub fn open(pool: &Pool) -> anyhow::Result<Remotes> {
        let path = pool.dir().join(FILE_NAME);
        let state = match crate::durable::read_table::<Table>(&path, "remotes", FILE_VERSION)? {
            Some(t) => Kept {
                remotes: t.remotes,
                restoring: t.restoring,
                restore_progress: t.restore_progress,
            },
            None => Kept::default(),
        };
        let remotes = Remotes {
            path: Some(path),
            state: Mutex::new(state),
            restores_running: Mutex::default(),
        };
        remotes.drop_partial_restores(pool)?;
        Ok(remotes)
    }

    /// Deletes the volumes whose restore a stop, crash or kill cut off before its first
    /// checkpoint (listed as restoring, with no progress); keeps those with one, for a
    /// restore of the same snapshot into them to go on.
    fn drop_partial_restores(&self, pool: &Pool) -> anyhow::Result<()> {
        let (listed, progress) = {
            let s = self.state.lock();
            (s.restoring.clone(), s.restore_progress.clone())
        };
        // With a checkpoint: kept if the volume is still the one it names; else (deleted, or
        // replaced by another of the same name since) only forgotten. Without: cut off
        // before its first checkpoint in the run that just ended, so deleted.
        let listed_count = listed.len();
        let ours = |v: &String| {
            let id = pool.volume(v).ok().map(|v| v.id());
            progress.get(v).map(|p| id == Some(p.volume_id))
        };
        let kept: Vec<String> = listed
            .iter()
            .filter(|v| ours(v) == Some(true))
            .cloned()
            .collect();
        let partial: Vec<String> = listed.into_iter().filter(|v| ours(v).is_none()).collect();
        for name in &kept {
            let p = &progress[name];
            tracing::warn!(
                "volume {name} holds part of {} from {} ({} packs): restoring it again goes on \
                 from there",
                p.snapshot,
                p.remote,
                p.done_packs.len()
            );
        }
        for name in &partial {
            match pool.delete_volume(name) {
                Ok(()) => tracing::warn!(
                    "deleted volume {name}: its restore from a remote did not finish (the \
                     server stopped); restore it again"
                ),
                Err(ibid_engine::Error::NotFound(_)) => {}
                Err(e) => anyhow::bail!("delete the partly restored volume {name}: {e}"),
            }
        }
        if listed_count != kept.len() || progress.len() != kept.len() {
            self.update(|s| {
                s.restoring.retain(|v| kept.contains(v));
                s.restore_progress.retain(|v, _| kept.contains(v));
                Ok(())
            })
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        }
        Ok(())
    }

    /// A remote's configuration.
    fn config(&self, name: &str) -> Result<RemoteConfig, ApiError> {
        self.state.lock().remotes.get(name).cloned().ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no remote {name:?} (ibid remote list)"),
            )
        })
    }

    /// A client of remote `name`.
    pub fn remote(&self, name: &str) -> Result<Remote, ApiError> {
        Remote::s3(&self.config(name)?).map_err(offload_error)
    }

    /// Applies `change` to the table and writes it; nothing changes if either fails.
    fn update(
        &self,
        change: impl FnOnce(&mut Kept) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        let mut table = self.state.lock();
        let mut next = table.clone();
        change(&mut next)?;
        if let Some(path) = &self.path {
            let text = serde_json::to_vec_pretty(&Table {
                version: FILE_VERSION,
                remotes: next.remotes.clone(),
                restoring: next.restoring.clone(),
                restore_progress: next.restore_progress.clone(),
            })
            .map_err(|e| ApiError::internal(e.into()))?;
            crate::durable::write_private_file(path, &text).map_err(|e| {
                ApiError::internal(anyhow::anyhow!("write {}: {e}", path.display()))
            })?;
        }
        *table = next;
        Ok(())
    }
}

/// A remote as the API shows it: no credentials.
fn view(name: &str, c: &RemoteConfig) -> Value {
    json!({
        "name": name,
        "endpoint": c.endpoint,
        "bucket": c.bucket,
        "region": c.region,
        "prefix": c.prefix,
        "credentials": "stored",
    })
}

/// The API error for a remote operation's error.
pub fn offload_error(e: ibid_offload::Error) -> ApiError {
    use ibid_offload::Error as E;
    match e {
        E::Engine(e) => e.into(),
        E::NotFound(m) => ApiError::new(StatusCode::NOT_FOUND, "not_found", m),
        E::AlreadyExists(m) => ApiError::conflict("already_exists", m),
        E::Busy(m) => ApiError::conflict("busy", m),
        E::Invalid(m) => ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", m),
        E::Cancelled => ApiError::conflict("cancelled", "cancelled"),
        E::Corrupt(m) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "remote_damaged",
            format!("damaged object in the remote: {m}"),
        ),
        e => ApiError::new(StatusCode::BAD_GATEWAY, "remote_failed", e.to_string()),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddRemote {
    name: String,
    endpoint: String,
    bucket: String,
    #[serde(default)]
    region: Option<String>,
    #[serde(default)]
    prefix: Option<String>,
    access_key_id: String,
    secret_access_key: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushRequest {
    remote: String,
    /// Answer at once (202, the job) instead of when the push ends.
    #[serde(default)]
    background: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreRequest {
    /// `VOLUME@SNAPSHOT` in the remote.
    snapshot: String,
    /// Name of the new volume.
    volume: String,
    /// Answer at once (202, the job) instead of when the restore ends.
    #[serde(default)]
    background: bool,
    /// Instant restore: the volume is usable as soon as the answer comes (201, with the job
    /// that fetches the rest in the background); chunks not fetched yet are fetched on first
    /// access.
    #[serde(default)]
    instant: bool,
    /// With `instant`: at most this many bytes a second received by the background fill
    /// (fetches on first access are not limited).
    #[serde(default)]
    fill_bytes_per_s: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FillRequest {
    /// At most this many bytes a second (0: no limit); absent: the rate the restore had.
    #[serde(default)]
    fill_bytes_per_s: Option<u64>,
}

type Body<T> = Result<Json<T>, axum::extract::rejection::JsonRejection>;

fn body<T>(b: Body<T>) -> Result<T, ApiError> {
    b.map(|Json(t)| t)
        .map_err(|e| ApiError::new(e.status(), "bad_request", e.body_text()))
}

/// The remotes' routes (merged into the API's router, behind its guards).
pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    Pool: axum::extract::FromRef<S>,
{
    Router::new()
        .route("/api/v1/remotes", get(list_remotes).post(add_remote))
        .route(
            "/api/v1/remotes/{name}",
            axum::routing::delete(remove_remote),
        )
        .route("/api/v1/remotes/{name}/verify", post(verify_remote))
        .route("/api/v1/remotes/{name}/gc", post(gc_remote))
        .route(
            "/api/v1/remotes/{name}/snapshots",
            get(list_remote_snapshots),
        )
        .route(
            "/api/v1/remotes/{name}/snapshots/{snapshot}",
            axum::routing::delete(delete_remote_snapshot),
        )
        .route("/api/v1/remotes/{name}/restore", post(restore))
        .route("/api/v1/volumes/{name}/fill", post(fill_again))
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}/push",
            post(push),
        )
}

type Shared = Extension<Arc<Remotes>>;

async fn list_remotes(Extension(remotes): Shared) -> Json<Value> {
    let state = remotes.state.lock();
    Json(Value::Array(
        state.remotes.iter().map(|(n, c)| view(n, c)).collect(),
    ))
}

async fn add_remote(
    Extension(remotes): Shared,
    req: Body<AddRemote>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let r = body(req)?;
    ibid_engine::validate_volume_name(&r.name).map_err(|_| {
        ApiError::bad_request(format!(
            "remote name {:?}: use letters, digits, '.', '_' and '-'",
            r.name
        ))
    })?;
    if r.bucket.is_empty() || r.access_key_id.is_empty() || r.secret_access_key.is_empty() {
        return Err(ApiError::bad_request(
            "a remote needs a bucket, an access key id and a secret access key",
        ));
    }
    let config = RemoteConfig {
        endpoint: r.endpoint,
        bucket: r.bucket,
        region: r.region.filter(|s| !s.is_empty()),
        prefix: r.prefix.filter(|s| !s.is_empty()),
        access_key_id: r.access_key_id,
        secret_access_key: r.secret_access_key,
    };
    // Refuse a remote that does not answer or refuses these credentials now, not at the
    // first push.
    let remote = Remote::s3(&config).map_err(offload_error)?;
    remote.check().await.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "remote_failed",
            format!("the remote does not answer as expected: {e}"),
        )
    })?;
    let name = r.name;
    let shown = view(&name, &config);
    remotes.update(|s| {
        let t = &mut s.remotes;
        if t.contains_key(&name) {
            return Err(ApiError::conflict(
                "already_exists",
                format!("a remote {name:?} exists"),
            ));
        }
        if t.len() >= REMOTES_MAX {
            return Err(ApiError::conflict(
                "too_many",
                format!("a pool keeps at most {REMOTES_MAX} remotes"),
            ));
        }
        t.insert(name.clone(), config);
        Ok(())
    })?;
    tracing::info!("remote {name} added ({})", shown["endpoint"]);
    Ok((StatusCode::CREATED, Json(shown)))
}

async fn remove_remote(
    Extension(remotes): Shared,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    remotes.update(|s| match s.remotes.remove(&name) {
        Some(_) => Ok(()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no remote {name:?}"),
        )),
    })?;
    Ok(StatusCode::NO_CONTENT)
}

async fn verify_remote(
    Extension(remotes): Shared,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let report = remotes
        .remote(&name)?
        .verify()
        .await
        .map_err(offload_error)?;
    Ok(Json(json!(report)))
}

async fn gc_remote(
    Extension(remotes): Shared,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let report = remotes.remote(&name)?.gc().await.map_err(offload_error)?;
    tracing::info!(
        "remote {name}: GC deleted {} packs ({} bytes), repacked {} ({} chunks, {} bytes written)",
        report.packs_deleted,
        report.bytes_freed,
        report.packs_repacked,
        report.chunks_moved,
        report.bytes_written
    );
    Ok(Json(json!(report)))
}

async fn list_remote_snapshots(
    Extension(remotes): Shared,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let list = remotes.remote(&name)?.list().await.map_err(offload_error)?;
    Ok(Json(json!(list)))
}

fn split(snapshot: &str) -> Result<(&str, &str), ApiError> {
    snapshot
        .split_once('@')
        .filter(|(v, s)| !v.is_empty() && !s.is_empty())
        .ok_or_else(|| ApiError::bad_request(format!("{snapshot:?}: expected VOLUME@SNAPSHOT")))
}

async fn delete_remote_snapshot(
    Extension(remotes): Shared,
    Path((name, snapshot)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let (volume, snap) = split(&snapshot)?;
    remotes
        .remote(&name)?
        .delete(volume, snap)
        .await
        .map_err(offload_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// What the jobs of pushes and restores need from the server.
#[derive(Clone)]
pub struct Offload {
    /// The pool.
    pub pool: Pool,
    /// The remotes.
    pub remotes: Arc<Remotes>,
    /// The offload figures.
    pub stats: Arc<crate::metrics::OffloadStats>,
    /// The jobs.
    pub jobs: Arc<crate::jobs::Jobs>,
}

async fn push(
    State(pool): State<Pool>,
    Extension(remotes): Shared,
    Extension(stats): Extension<Arc<crate::metrics::OffloadStats>>,
    Extension(jobs): Extension<Arc<crate::jobs::Jobs>>,
    Path((volume, snapshot)): Path<(String, String)>,
    req: Body<PushRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let r = body(req)?;
    let o = Offload {
        pool,
        remotes,
        stats,
        jobs,
    };
    o.push(&volume, &snapshot, &r.remote, r.background, false)
        .await
}

impl Offload {
    /// Runs a push of `volume@snapshot` to `remote_name` as a job. `again`: it runs a push a
    /// stop cut off, so a snapshot the remote already has is a success (the push had
    /// completed before the stop).
    pub async fn push(
        &self,
        volume: &str,
        snapshot: &str,
        remote_name: &str,
        background: bool,
        again: bool,
    ) -> Result<(StatusCode, Json<Value>), ApiError> {
        let remote = self.remotes.remote(remote_name)?;
        // Refuse at once what would fail at once, rather than as a failed job.
        if !self
            .pool
            .list_snapshots(Some(volume))
            .iter()
            .any(|s| s.name == snapshot)
        {
            return Err(ibid_engine::Error::NotFound(format!("{volume}@{snapshot}")).into());
        }
        let progress = Arc::new(Progress::default());
        let target = format!("{volume}@{snapshot} -> {remote_name}");
        let resume =
            json!({"push": {"volume": volume, "snapshot": snapshot, "remote": remote_name}});
        let work = {
            let (progress, pool, stats) = (progress.clone(), self.pool.clone(), self.stats.clone());
            let (volume, snapshot, remote_name) = (
                volume.to_string(),
                snapshot.to_string(),
                remote_name.to_string(),
            );
            async move {
                let report = remote.push(&pool, &volume, &snapshot, progress).await;
                let report = match report {
                    Ok(r) => r,
                    Err(ibid_offload::Error::AlreadyExists(_)) if again => {
                        return Ok(json!({
                            "snapshot": format!("{volume}@{snapshot}"),
                            "already_in_remote": true,
                        }));
                    }
                    Err(e) => {
                        stats.push_failures.fetch_add(1, Relaxed);
                        return Err(offload_error(e));
                    }
                };
                stats.pushes.fetch_add(1, Relaxed);
                stats.pushed_bytes.fetch_add(report.bytes_sent, Relaxed);
                stats.chunks_sent.fetch_add(report.chunks_sent, Relaxed);
                stats
                    .chunks_skipped
                    .fetch_add(report.chunks_skipped, Relaxed);
                stats
                    .last_push_unix_s
                    .lock()
                    .insert(volume.clone(), crate::schedules::now_unix_s());
                tracing::info!(
                    "pushed {volume}@{snapshot} to {remote_name}: {} bytes sent, {} chunks sent, {} skipped, {:.1} s",
                    report.bytes_sent,
                    report.chunks_sent,
                    report.chunks_skipped,
                    report.duration_s
                );
                Ok(json!(report))
            }
        };
        self.jobs
            .run("push", target, background, progress, Some(resume), work)
            .await
    }

    /// Runs the pushes and full restores a stop cut off again, as new jobs (in the
    /// background). Call once at start, after the partly restored volumes are deleted.
    pub async fn resume_interrupted(&self) {
        for (id, req) in self.jobs.take_interrupted() {
            let names = |p: &Value| {
                Some((
                    p["volume"].as_str()?.to_string(),
                    p["snapshot"].as_str()?.to_string(),
                    p["remote"].as_str()?.to_string(),
                ))
            };
            let started = match (
                req.get("push").and_then(names),
                req.get("restore").and_then(names),
            ) {
                (Some((v, s, r)), _) => self.push(&v, &s, &r, true, true).await,
                (_, Some((v, s, r))) => self.restore(&r, &s, &v, true).await,
                _ => continue,
            };
            match started {
                Ok((_, job)) => tracing::info!(
                    "job {id} was cut off by the stop: running it again as job {}",
                    job.0["id"]
                ),
                Err(e) => tracing::warn!(
                    "job {id} was cut off by the stop and cannot run again: {}",
                    e.message()
                ),
            }
        }
    }

    /// Runs a full restore of `snapshot` (`VOLUME@SNAPSHOT`) from `remote_name` into the new
    /// volume `new_name` as a job — or, when `new_name` holds part of that snapshot from an
    /// earlier restore that a stop, a crash or a kill cut off after a checkpoint, goes on from
    /// there. A restore that fails deletes its volume, except one cut off by a stop (it goes
    /// on at the next start).
    pub async fn restore(
        &self,
        remote_name: &str,
        snapshot: &str,
        new_name: &str,
        background: bool,
    ) -> Result<(StatusCode, Json<Value>), ApiError> {
        let remote = self.remotes.remote(remote_name)?;
        let (pool, remotes, stats) = (self.pool.clone(), self.remotes.clone(), self.stats.clone());
        if !remotes.restores_running.lock().insert(new_name.to_string()) {
            return Err(ApiError::conflict(
                "already_exists",
                format!("a restore into {new_name:?} is running"),
            ));
        }
        let running = RunningRestore {
            remotes: remotes.clone(),
            volume: new_name.to_string(),
        };
        let partial = remotes.state.lock().restore_progress.get(new_name).cloned();
        let existing = pool.volume(new_name).ok().map(|v| v.id());
        let resume: Option<RestoreDone> = match (existing, partial) {
            (None, _) => None,
            (Some(id), Some(p))
                if p.volume_id == id && p.remote == remote_name && p.snapshot == snapshot =>
            {
                Some(
                    p.done_packs
                        .iter()
                        .filter_map(|h| ibid_offload::format::unhex(h))
                        .collect(),
                )
            }
            (Some(id), Some(p)) if p.volume_id == id => {
                return Err(ApiError::conflict(
                    "already_exists",
                    format!(
                        "volume {new_name:?} holds part of {} from {}: restore that again to \
                         go on, or delete the volume",
                        p.snapshot, p.remote
                    ),
                ))
            }
            (Some(_), _) => {
                return Err(ApiError::conflict(
                    "already_exists",
                    format!("a volume {new_name:?} exists"),
                ))
            }
        };
        if resume.is_none() {
            // Listed while it runs: a volume left half-restored by a crash is deleted at the
            // next start, unless a checkpoint says where it goes on from.
            let target = new_name.to_string();
            remotes.update(|s| {
                s.restoring.retain(|v| *v != target);
                s.restoring.push(target.clone());
                s.restore_progress.remove(&target);
                Ok(())
            })?;
        }
        let progress = Arc::new(Progress::default());
        let label = format!("{remote_name}:{snapshot} -> {new_name}");
        let resume_request =
            json!({"restore": {"volume": new_name, "snapshot": snapshot, "remote": remote_name}});
        let jobs = self.jobs.clone();
        let work = {
            let progress = progress.clone();
            let (snapshot, new_name, remote_name) = (
                snapshot.to_string(),
                new_name.to_string(),
                remote_name.to_string(),
            );
            async move {
                let _running = running;
                let (volume, snap) = split(&snapshot)?;
                let checkpoint: Checkpoint = {
                    let (remotes, new_name) = (remotes.clone(), new_name.clone());
                    let (remote_name, snapshot) = (remote_name.clone(), snapshot.clone());
                    let pool = pool.clone();
                    Arc::new(move |done: &RestoreDone| {
                        // The volume is this restore's while it runs (deleting it fails the
                        // restore before its next checkpoint).
                        let volume_id = pool.volume(&new_name)?.id();
                        let p = RestoreProgress {
                            remote: remote_name.clone(),
                            snapshot: snapshot.clone(),
                            volume_id,
                            done_packs: done.iter().map(ibid_offload::format::hex).collect(),
                        };
                        remotes
                            .update(|s| {
                                s.restore_progress.insert(new_name.clone(), p);
                                Ok(())
                            })
                            .map_err(|e| {
                                ibid_offload::Error::Invalid(format!(
                                    "keep the restore's checkpoint: {}",
                                    e.message()
                                ))
                            })
                    })
                };
                let result = remote
                    .restore_resumable(&pool, volume, snap, &new_name, progress, resume, checkpoint)
                    .await;
                let forget = |remotes: &Remotes| {
                    remotes.update(|s| {
                        s.restoring.retain(|v| *v != new_name);
                        s.restore_progress.remove(&new_name);
                        Ok(())
                    })
                };
                let report = match result {
                    Ok(report) => report,
                    // Cut off by the stop: the volume and its checkpoint stay, and the restore
                    // goes on at the next start.
                    Err(e) if jobs.stopping() => return Err(offload_error(e)),
                    // A volume of that name appeared meanwhile: not this restore's.
                    Err(e) if e.before_target() => {
                        forget(&remotes)?;
                        return Err(offload_error(e));
                    }
                    Err(e) => {
                        let (pool, name) = (pool.clone(), new_name.clone());
                        match tokio::task::spawn_blocking(move || pool.delete_volume(&name)).await {
                            Ok(Ok(())) | Ok(Err(ibid_engine::Error::NotFound(_))) => {}
                            Ok(Err(e)) => {
                                tracing::warn!("delete the failed restore's {new_name}: {e}")
                            }
                            Err(e) => tracing::warn!("delete the failed restore's {new_name}: {e}"),
                        }
                        forget(&remotes)?;
                        return Err(offload_error(e));
                    }
                };
                forget(&remotes)?;
                stats.restores.fetch_add(1, Relaxed);
                stats
                    .restored_bytes
                    .fetch_add(report.bytes_received, Relaxed);
                tracing::info!(
                    "restored {snapshot} from {remote_name} as {new_name}: {} bytes received, {:.1} s",
                    report.bytes_received,
                    report.duration_s
                );
                Ok(json!(report))
            }
        };
        self.jobs
            .run(
                "restore",
                label,
                background,
                progress,
                Some(resume_request),
                work,
            )
            .await
    }
}

/// `POST /api/v1/volumes/{name}/fill`: an instant restore's background fill, again (after
/// its job was cancelled) or at another rate; 202 with the job.
async fn fill_again(
    Extension(stats): Extension<Arc<crate::metrics::OffloadStats>>,
    Extension(jobs): Extension<Arc<crate::jobs::Jobs>>,
    Extension(instants): Extension<Arc<crate::instant_restores::InstantRestores>>,
    Path(name): Path<String>,
    req: Body<FillRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let r = body(req)?;
    let job = instants
        .fill_again(&name, r.fill_bytes_per_s, &jobs, &stats)
        .await?;
    Ok((StatusCode::ACCEPTED, Json(job)))
}

async fn restore(
    State(pool): State<Pool>,
    Extension(remotes): Shared,
    Extension(stats): Extension<Arc<crate::metrics::OffloadStats>>,
    Extension(jobs): Extension<Arc<crate::jobs::Jobs>>,
    Extension(instants): Extension<Arc<crate::instant_restores::InstantRestores>>,
    Path(name): Path<String>,
    req: Body<RestoreRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let r = body(req)?;
    split(&r.snapshot)?;
    let remote = remotes.remote(&name)?;
    ibid_engine::validate_volume_name(&r.volume)?;
    // A full restore into an existing volume may go on from a cut-off one (it checks).
    if r.instant && pool.volume(&r.volume).is_ok() {
        return Err(ApiError::conflict(
            "already_exists",
            format!("a volume {:?} exists", r.volume),
        ));
    }
    if r.fill_bytes_per_s.is_some() && !r.instant {
        return Err(ApiError::bad_request(
            "fill_bytes_per_s applies to an instant restore only",
        ));
    }
    if r.instant {
        let ir = instants
            .start(
                &pool,
                &remote,
                &name,
                &r.snapshot,
                &r.volume,
                r.fill_bytes_per_s,
            )
            .await?;
        let kept = crate::instant_restores::Kept {
            volume: r.volume.clone(),
            volume_id: Some(ir.volume().id()),
            remote: name.clone(),
            snapshot: r.snapshot.clone(),
            fill_bytes_per_s: r.fill_bytes_per_s,
        };
        tracing::info!(
            "instant restore of {} from {name} as {}: usable now, filling in the background",
            r.snapshot,
            r.volume
        );
        let job = instants.run_fill(ir.clone(), &kept, &jobs, &stats).await?;
        return Ok((
            StatusCode::CREATED,
            Json(json!({
                "volume": r.volume,
                "snapshot": r.snapshot,
                "instant": true,
                "size_bytes": ir.volume().size(),
                "data_bytes": ir.bytes().0,
                "job": job,
            })),
        ));
    }
    let o = Offload {
        pool,
        remotes,
        stats,
        jobs,
    };
    let (status, answer) = o
        .restore(&name, &r.snapshot, &r.volume, r.background)
        .await?;
    Ok((crate::jobs::created(status), answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At start, a cut-off restore's volume is kept when its checkpoint names it (by id),
    /// deleted when it had no checkpoint yet, and left alone — only forgotten — when a volume
    /// of the same name is not the one the checkpoint names or none is left.
    #[test]
    fn a_start_keeps_checkpointed_restores_and_deletes_only_their_own_volumes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = Pool::create(dir.path().join("pool"), ibid_engine::PoolConfig::default())
            .expect("pool");
        let id = |name: &str| pool.create_volume(name, 1 << 20).expect("volume").id();
        let (kept, replaced, cut) = (id("kept"), id("replaced"), id("cut"));
        assert_ne!(kept, replaced);
        let progress = |volume_id: u64| RestoreProgress {
            remote: "r".into(),
            snapshot: "v@s".into(),
            volume_id,
            done_packs: vec![ibid_offload::format::hex(&[7; 32])],
        };
        let table = Table {
            version: FILE_VERSION,
            remotes: BTreeMap::new(),
            restoring: ["kept", "replaced", "cut", "gone"]
                .map(String::from)
                .to_vec(),
            restore_progress: [
                ("kept".to_string(), progress(kept)),
                ("replaced".to_string(), progress(replaced + 1000)),
                ("gone".to_string(), progress(cut + 1000)),
            ]
            .into(),
        };
        let path = pool.dir().join(FILE_NAME);
        std::fs::write(&path, serde_json::to_vec(&table).expect("json")).expect("write");
        let remotes = Remotes::open(&pool).expect("open");
        assert!(pool.volume("kept").is_ok() && pool.volume("replaced").is_ok());
        assert!(
            pool.volume("cut").is_err(),
            "a restore without a checkpoint is not kept"
        );
        let s = remotes.state.lock();
        assert_eq!(s.restoring, vec!["kept".to_string()]);
        assert_eq!(
            s.restore_progress.keys().collect::<Vec<_>>(),
            vec!["kept"],
            "the others are forgotten"
        );
        drop(s);
        let again: Table = serde_json::from_slice(&std::fs::read(&path).expect("read"))
            .expect("the file is written");
        assert_eq!(again.restore_progress["kept"], progress(kept));
        assert_eq!(again.restoring, vec!["kept".to_string()]);
    }
}
