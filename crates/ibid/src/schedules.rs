//! Snapshot schedules: per volume, a snapshot every `every_s` seconds named
//! `auto-YYYYMMDDTHHMMSSZ`, the newest `keep` of them kept; with a remote, each is pushed there
//! and the newest `keep_remote` kept in the remote. Run by the server; listed at
//! `GET /api/v1/schedules`, set with `PUT /api/v1/volumes/{name}/schedule`.
//!
//! Kept in `schedules.json` in the pool directory (written crash-safely, like `qos.json`).
//! Only snapshots named `auto-...` are ever deleted by a schedule, never one made by hand, and
//! never one with clients connected (it is retried at the next run).
//!
//! A push that fails (the remote unreachable, or busy with a GC) is tried again, for the same
//! snapshot, [`RETRY_FIRST_S`] later, then at doubling intervals up to [`RETRY_MAX_S`], until it
//! succeeds or the schedule's next run makes a newer snapshot to push (which sends what the
//! failed one would have: pushes are incremental). Without it a daily schedule that met a
//! network blip would leave the volume without an off-site copy for a day.

use crate::api::ApiError;
use crate::clients::Clients;
use crate::lun_map::LunMap;
use crate::remotes::Remotes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Extension, Json, Router};
use ibid_engine::Pool;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// The file in the pool directory.
pub const FILE_NAME: &str = "schedules.json";
const FILE_VERSION: u64 = 1;
/// Prefix of the snapshots schedules make (and the only ones they delete).
pub const AUTO_PREFIX: &str = "auto-";
/// How often the runner looks for schedules that are due.
const TICK: Duration = Duration::from_secs(1);
/// Shortest interval between two snapshots of a schedule.
const EVERY_S_MIN: u64 = 1;
/// Most snapshots a schedule keeps, locally or in a remote.
const KEEP_MAX: u64 = 1000;
/// A schedule whose remote retention deleted snapshots GCs that remote, at most this often
/// (a GC reads every manifest of the remote).
const GC_EVERY_S: u64 = 3600;
/// Seconds after a failed scheduled push before it is tried again.
pub const RETRY_FIRST_S: u64 = 10;
/// Longest wait between two tries of a failed scheduled push.
pub const RETRY_MAX_S: u64 = 900;

/// One volume's schedule.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Seconds between snapshots.
    pub every_s: u64,
    /// Snapshots kept in the pool.
    pub keep: u64,
    /// Remote each snapshot is pushed to.
    #[serde(default)]
    pub remote: Option<String>,
    /// Snapshots kept in the remote.
    #[serde(default)]
    pub keep_remote: Option<u64>,
}

/// What the runner knows of a schedule (not kept: it starts over at a restart).
#[derive(Clone, Default)]
struct Status {
    runs: u64,
    last_run_unix_s: Option<u64>,
    last_push_unix_s: Option<u64>,
    last_error: Option<String>,
    /// A push that failed, to be tried again.
    retry: Option<Retry>,
}

/// A failed scheduled push waiting to be tried again.
#[derive(Clone)]
struct Retry {
    /// The snapshot whose push failed.
    snapshot: String,
    /// When to try again (Unix seconds).
    at_unix_s: u64,
    /// The wait before this try (doubled after another failure).
    delay_s: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    version: u64,
    volumes: BTreeMap<String, Schedule>,
}

/// The pool's schedules.
pub struct Schedules {
    path: PathBuf,
    table: Mutex<BTreeMap<String, Schedule>>,
    status: Mutex<BTreeMap<String, Status>>,
    /// Per remote, when a schedule last started a GC of it (Unix seconds).
    last_gc: Mutex<BTreeMap<String, u64>>,
}

impl Schedules {
    /// The schedules kept in `pool`'s directory.
    pub fn open(pool: &Pool) -> anyhow::Result<Schedules> {
        let path = pool.dir().join(FILE_NAME);
        let table = crate::durable::read_table::<Table>(&path, "schedules", FILE_VERSION)?
            .map(|t| t.volumes)
            .unwrap_or_default();
        Ok(Schedules {
            path,
            table: Mutex::new(table),
            status: Mutex::default(),
            last_gc: Mutex::default(),
        })
    }

    fn update(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, Schedule>) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        let mut table = self.table.lock();
        let mut next = table.clone();
        change(&mut next)?;
        let text = serde_json::to_vec_pretty(&Table {
            version: FILE_VERSION,
            volumes: next.clone(),
        })
        .map_err(|e| ApiError::internal(e.into()))?;
        crate::durable::write_file(&self.path, &text).map_err(|e| {
            ApiError::internal(anyhow::anyhow!("write {}: {e}", self.path.display()))
        })?;
        *table = next;
        Ok(())
    }

    /// Each schedule's lag: (volume, seconds its next run is overdue).
    pub fn lags(&self) -> Vec<(String, u64)> {
        let now = now_unix_s();
        let table = self.table.lock().clone();
        let status = self.status.lock();
        table
            .iter()
            .map(|(v, s)| {
                let next = status
                    .get(v)
                    .and_then(|st| st.last_run_unix_s)
                    .map_or(now, |t| t + s.every_s);
                (v.clone(), now.saturating_sub(next))
            })
            .collect()
    }

    fn view(&self, volume: &str, s: &Schedule, now: u64) -> Value {
        let st = self.status.lock().get(volume).cloned().unwrap_or_default();
        let next = st.last_run_unix_s.map_or(now, |t| t + s.every_s);
        json!({
            "volume": volume,
            "every_s": s.every_s,
            "keep": s.keep,
            "remote": s.remote,
            "keep_remote": s.keep_remote,
            "runs": st.runs,
            "last_run_unix_s": st.last_run_unix_s,
            "last_push_unix_s": st.last_push_unix_s,
            "next_run_unix_s": next,
            "lag_s": now.saturating_sub(next),
            "last_error": st.last_error,
            "push_retry_snapshot": st.retry.as_ref().map(|r| &r.snapshot),
            "push_retry_unix_s": st.retry.as_ref().map(|r| r.at_unix_s),
        })
    }
}

/// Seconds since the Unix epoch.
pub fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `auto-YYYYMMDDTHHMMSSZ` for `unix_s` (UTC).
fn auto_name(unix_s: u64) -> String {
    let days = (unix_s / 86400) as i64;
    let secs = unix_s % 86400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{AUTO_PREFIX}{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// Everything a run needs.
#[derive(Clone)]
pub struct Runner {
    /// The pool.
    pub pool: Pool,
    /// The schedules.
    pub schedules: Arc<Schedules>,
    /// The remotes.
    pub remotes: Arc<Remotes>,
    /// Who is connected (snapshots in use are not deleted).
    pub clients: Arc<Clients>,
    /// The LUN table (reconciled after deletions).
    pub luns: Arc<LunMap>,
    /// Push figures for the metrics.
    pub stats: Arc<crate::metrics::OffloadStats>,
    /// Volumes being restored (not snapshotted until they hold all their data).
    pub instants: Arc<crate::instant_restores::InstantRestores>,
}

impl Runner {
    /// Runs due schedules until `stop` turns true.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = stop.wait_for(|&s| s) => return,
            }
            let now = now_unix_s();
            let due: Vec<(String, Schedule)> = {
                let table = self.schedules.table.lock();
                let status = self.schedules.status.lock();
                table
                    .iter()
                    .filter(|(v, s)| {
                        status
                            .get(*v)
                            .and_then(|st| st.last_run_unix_s)
                            .is_none_or(|t| now >= t + s.every_s)
                    })
                    .map(|(v, s)| (v.clone(), s.clone()))
                    .collect()
            };
            let retries: Vec<(String, Schedule, Retry)> = {
                let table = self.schedules.table.lock();
                let status = self.schedules.status.lock();
                table
                    .iter()
                    .filter(|(v, s)| s.remote.is_some() && !due.iter().any(|(d, _)| d == *v))
                    .filter_map(|(v, s)| {
                        let retry = status.get(v)?.retry.clone()?;
                        (retry.at_unix_s <= now).then(|| (v.clone(), s.clone(), retry))
                    })
                    .collect()
            };
            for (volume, schedule) in due {
                {
                    let mut status = self.schedules.status.lock();
                    let st = status.entry(volume.clone()).or_default();
                    st.last_run_unix_s = Some(now);
                    // The new snapshot's push sends what a pending retry would have.
                    st.retry = None;
                }
                let outcome = self.run_one(&volume, &schedule, now).await;
                let mut status = self.schedules.status.lock();
                let st = status.entry(volume.clone()).or_default();
                st.runs += 1;
                match outcome {
                    Ok(pushed) => {
                        st.last_error = None;
                        if pushed {
                            st.last_push_unix_s = Some(now_unix_s());
                        }
                    }
                    Err(e) => {
                        tracing::warn!("schedule of {volume}: {e}");
                        st.last_error = Some(e);
                    }
                }
            }
            for (volume, schedule, retry) in retries {
                self.retry_push(&volume, &schedule, retry).await;
            }
        }
    }

    /// Tries a failed push of `retry.snapshot` again (if the snapshot is still there), and
    /// records the outcome: done, or another try after twice the wait.
    async fn retry_push(&self, volume: &str, schedule: &Schedule, retry: Retry) {
        let exists = self
            .pool
            .list_snapshots(Some(volume))
            .iter()
            .any(|s| s.name == retry.snapshot);
        let outcome = match exists {
            true => Some(
                self.push_and_retain(volume, schedule, &retry.snapshot, true)
                    .await,
            ),
            false => None,
        };
        let mut status = self.schedules.status.lock();
        let st = status.entry(volume.to_string()).or_default();
        match outcome {
            None => st.retry = None,
            Some(Ok(_)) => {
                tracing::info!("schedule of {volume}: push of {} done", retry.snapshot);
                st.retry = None;
                st.last_error = None;
                st.last_push_unix_s = Some(now_unix_s());
            }
            Some(Err(e)) => {
                let delay_s = (retry.delay_s * 2).min(RETRY_MAX_S);
                tracing::warn!("schedule of {volume}: {e}; tried again in {delay_s} s");
                st.last_error = Some(e);
                st.retry = Some(Retry {
                    at_unix_s: now_unix_s() + delay_s,
                    delay_s,
                    ..retry
                });
            }
        }
    }

    /// One run: snapshot, local retention, push, remote retention. Whether it pushed.
    async fn run_one(&self, volume: &str, s: &Schedule, now: u64) -> Result<bool, String> {
        let name = auto_name(now);
        let this = self.clone();
        let (vol, snap, keep) = (volume.to_string(), name.clone(), s.keep);
        tokio::task::spawn_blocking(move || {
            this.instants
                .refuse(&this.pool, &vol, "a scheduled snapshot")
                .map_err(|e| e.message().to_string())?;
            this.pool
                .create_snapshot(&vol, &snap)
                .map_err(|e| format!("snapshot {vol}@{snap}: {e}"))?;
            this.prune_local(&vol, keep)
        })
        .await
        .map_err(|e| format!("snapshot task: {e}"))??;
        let pushed = self.push_and_retain(volume, s, &name, false).await;
        if pushed.is_err() {
            let mut status = self.schedules.status.lock();
            status.entry(volume.to_string()).or_default().retry = Some(Retry {
                snapshot: name,
                at_unix_s: now_unix_s() + RETRY_FIRST_S,
                delay_s: RETRY_FIRST_S,
            });
        }
        pushed
    }

    /// Pushes `volume@name` to the schedule's remote and applies its remote retention; whether
    /// it pushed (false without a remote). `retrying`: an earlier try failed (and may have
    /// pushed it all the same).
    async fn push_and_retain(
        &self,
        volume: &str,
        s: &Schedule,
        name: &str,
        retrying: bool,
    ) -> Result<bool, String> {
        let Some(remote_name) = &s.remote else {
            return Ok(false);
        };
        let remote = self
            .remotes
            .remote(remote_name)
            .map_err(|e| format!("remote {remote_name}: {e:?}"))?;
        match remote.push(&self.pool, volume, name, Arc::default()).await {
            Ok(report) => {
                self.stats.pushes.fetch_add(1, Relaxed);
                self.stats
                    .pushed_bytes
                    .fetch_add(report.bytes_sent, Relaxed);
                self.stats
                    .chunks_sent
                    .fetch_add(report.chunks_sent, Relaxed);
                self.stats
                    .chunks_skipped
                    .fetch_add(report.chunks_skipped, Relaxed);
            }
            // A try again after the push landed but its answer, or the retention after it,
            // failed: the remote has the snapshot; go on to the retention.
            Err(ibid_offload::Error::AlreadyExists(_)) if retrying => {}
            Err(e) => {
                self.stats.push_failures.fetch_add(1, Relaxed);
                return Err(format!("push {volume}@{name} to {remote_name}: {e}"));
            }
        }
        self.stats
            .last_push_unix_s
            .lock()
            .insert(volume.to_string(), now_unix_s());
        if let Some(keep) = s.keep_remote {
            let list = remote
                .list()
                .await
                .map_err(|e| format!("list {remote_name}: {e}"))?;
            let mut autos: Vec<_> = list
                .into_iter()
                .filter(|r| r.volume == volume && r.name.starts_with(AUTO_PREFIX))
                .map(|r| r.name)
                .collect();
            autos.sort();
            let excess = autos.len().saturating_sub(keep as usize);
            for old in &autos[..excess] {
                remote
                    .delete(volume, old)
                    .await
                    .map_err(|e| format!("delete {volume}@{old} from {remote_name}: {e}"))?;
            }
            if excess > 0 {
                self.collect(remote_name, &remote).await?;
            }
        }
        Ok(true)
    }

    /// Frees what deleted remote snapshots held: a GC of the remote, at most once per
    /// [`GC_EVERY_S`] per remote. A push holding the remote (busy) leaves it to a later run.
    async fn collect(
        &self,
        remote_name: &str,
        remote: &ibid_offload::Remote,
    ) -> Result<(), String> {
        let now = now_unix_s();
        {
            let mut last = self.schedules.last_gc.lock();
            if last.get(remote_name).is_some_and(|&t| now < t + GC_EVERY_S) {
                return Ok(());
            }
            last.insert(remote_name.to_string(), now);
        }
        match remote.gc().await {
            Ok(r) => {
                tracing::info!(
                    "scheduled GC of {remote_name}: {} packs deleted, {} bytes freed",
                    r.packs_deleted,
                    r.bytes_freed
                );
                self.stats.gc_runs.fetch_add(1, Relaxed);
                self.stats.gc_bytes_freed.fetch_add(r.bytes_freed, Relaxed);
                Ok(())
            }
            Err(ibid_offload::Error::Busy(m)) => {
                // Tried again at the next run that deletes a snapshot, or by hand.
                self.schedules.last_gc.lock().remove(remote_name);
                tracing::info!("scheduled GC of {remote_name} put off: {m}");
                Ok(())
            }
            Err(e) => Err(format!("GC of {remote_name}: {e}")),
        }
    }

    /// Deletes the oldest `auto-` snapshots of `volume` beyond `keep` (not those in use).
    fn prune_local(&self, volume: &str, keep: u64) -> Result<(), String> {
        let mut autos: Vec<String> = self
            .pool
            .list_snapshots(Some(volume))
            .into_iter()
            .filter(|s| s.name.starts_with(AUTO_PREFIX))
            .map(|s| s.name)
            .collect();
        autos.sort();
        let excess = autos.len().saturating_sub(keep as usize);
        let mut deleted = false;
        for old in &autos[..excess] {
            if !self
                .clients
                .of_export(&format!("{volume}@{old}"))
                .is_empty()
            {
                continue; // In use: kept until a later run.
            }
            self.pool
                .delete_snapshot(volume, old)
                .map_err(|e| format!("delete {volume}@{old}: {e}"))?;
            deleted = true;
        }
        if deleted {
            if let Err(e) = self.luns.refresh(&self.pool) {
                tracing::error!("LUN table: {e:#}");
            }
        }
        Ok(())
    }
}

/// `PUT /api/v1/volumes/{name}/schedule`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetSchedule {
    every_s: u64,
    keep: u64,
    #[serde(default)]
    remote: Option<String>,
    #[serde(default)]
    keep_remote: Option<u64>,
}

/// The schedules' routes.
pub fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    Pool: axum::extract::FromRef<S>,
{
    Router::new().route("/api/v1/schedules", get(list)).route(
        "/api/v1/volumes/{name}/schedule",
        get(describe).put(set).delete(remove),
    )
}

type Shared = Extension<Arc<Schedules>>;

async fn list(Extension(schedules): Shared) -> Json<Value> {
    let now = now_unix_s();
    let table = schedules.table.lock().clone();
    Json(Value::Array(
        table
            .iter()
            .map(|(v, s)| schedules.view(v, s, now))
            .collect(),
    ))
}

fn not_scheduled(volume: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("volume {volume:?} has no schedule"),
    )
}

async fn describe(
    Extension(schedules): Shared,
    Path(volume): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let s = schedules.table.lock().get(&volume).cloned();
    let s = s.ok_or_else(|| not_scheduled(&volume))?;
    Ok(Json(schedules.view(&volume, &s, now_unix_s())))
}

async fn set(
    State(pool): State<Pool>,
    Extension(schedules): Shared,
    Extension(remotes): Extension<Arc<Remotes>>,
    Path(volume): Path<String>,
    req: Result<Json<SetSchedule>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(r) = req.map_err(|e| ApiError::new(e.status(), "bad_request", e.body_text()))?;
    pool.volume(&volume)?;
    if r.every_s < EVERY_S_MIN || r.keep == 0 || r.keep > KEEP_MAX {
        return Err(ApiError::bad_request(format!(
            "every_s must be at least {EVERY_S_MIN}, keep 1 to {KEEP_MAX}"
        )));
    }
    if let Some(remote) = &r.remote {
        remotes.remote(remote)?;
    }
    if r.keep_remote.is_some() && r.remote.is_none() {
        return Err(ApiError::bad_request("keep_remote needs a remote"));
    }
    if r.keep_remote.is_some_and(|k| k == 0 || k > KEEP_MAX) {
        return Err(ApiError::bad_request(format!(
            "keep_remote: 1 to {KEEP_MAX}"
        )));
    }
    let s = Schedule {
        every_s: r.every_s,
        keep: r.keep,
        remote: r.remote,
        keep_remote: r.keep_remote,
    };
    let kept = s.clone();
    schedules.update(|t| {
        t.insert(volume.clone(), kept);
        Ok(())
    })?;
    Ok(Json(schedules.view(&volume, &s, now_unix_s())))
}

async fn remove(
    Extension(schedules): Shared,
    Path(volume): Path<String>,
) -> Result<StatusCode, ApiError> {
    schedules.update(|t| match t.remove(&volume) {
        Some(_) => Ok(()),
        None => Err(not_scheduled(&volume)),
    })?;
    schedules.status.lock().remove(&volume);
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    #[test]
    fn auto_names_sort_by_time() {
        assert_eq!(super::auto_name(0), "auto-19700101T000000Z");
        assert_eq!(super::auto_name(1_795_719_254), "auto-20261126T185414Z");
        assert!(super::auto_name(1_000_000_000) < super::auto_name(1_000_000_001));
    }
}
