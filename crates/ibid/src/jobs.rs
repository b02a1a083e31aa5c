//! Long operations (pushes to and restores from remotes) as jobs: listed with their progress at
//! `GET /api/v1/jobs`, cancellable with `POST /api/v1/jobs/{id}/cancel`. A request that starts
//! one waits for it by default, or answers `202` with the job at once when its body asks for
//! `"background": true` (what the CLI does, to draw a progress bar).
//!
//! Jobs are kept in `jobs.json` in the pool directory (written when one starts and when it
//! ends, crash-safely): the last [`FINISHED_KEPT_MAX`] finished ones are listed after a
//! restart, and one that was running when the server stopped is listed as `interrupted`. A job
//! started with what it takes to run it again (its `resume` request: pushes and full restores)
//! is run again at the next start as a new job ([`Jobs::take_interrupted`]); a push or restore
//! run again completes what the stop cut off (see `ibid_offload`).

use crate::api::ApiError;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use ibid_offload::Progress;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Finished jobs kept for listing (the oldest are forgotten first).
const FINISHED_KEPT_MAX: usize = 100;
/// The file in the pool directory.
pub const FILE_NAME: &str = "jobs.json";
const FILE_VERSION: u64 = 1;
/// The error code of a job a stop cut off.
const INTERRUPTED: &str = "interrupted";

/// `jobs.json`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    version: u64,
    jobs: Vec<Record>,
}

/// A job as the file keeps it: what the API shows, and how to run it again.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    id: u64,
    kind: String,
    target: String,
    started_unix_s: u64,
    finished_unix_s: Option<u64>,
    bytes_total: u64,
    bytes_done: u64,
    bytes_transferred: u64,
    /// `running`, `succeeded` (with `result`), or an error (`status`, `code`, `message`).
    state: String,
    #[serde(default)]
    result: Option<Value>,
    #[serde(default)]
    error: Option<StoredError>,
    #[serde(default)]
    resume: Option<Value>,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredError {
    status: u16,
    code: String,
    message: String,
}

/// Where a job is.
#[derive(Clone)]
enum State {
    Running,
    Succeeded(Value),
    Failed {
        status: u16,
        code: String,
        message: String,
    },
}

/// One job.
pub struct Job {
    id: u64,
    kind: String,
    /// What it works on, e.g. `vm1@nightly -> offsite`.
    target: String,
    started_unix_s: u64,
    progress: Arc<Progress>,
    state: Mutex<(State, Option<u64>)>,
    /// Wakes the waiters when the job ends.
    done: tokio::sync::Notify,
    /// The request that runs it again if a stop cuts it off.
    resume: Option<Value>,
}

impl Job {
    fn record(&self) -> Record {
        let (state, finished) = self.state.lock().clone();
        let (state, result, error) = match state {
            State::Running => ("running".to_string(), None, None),
            State::Succeeded(v) => ("succeeded".to_string(), Some(v), None),
            State::Failed {
                status,
                code,
                message,
            } => (
                "failed".to_string(),
                None,
                Some(StoredError {
                    status,
                    code,
                    message,
                }),
            ),
        };
        Record {
            id: self.id,
            kind: self.kind.clone(),
            target: self.target.clone(),
            started_unix_s: self.started_unix_s,
            finished_unix_s: finished,
            bytes_total: self.progress.bytes_total.load(Relaxed),
            bytes_done: self.progress.bytes_done.load(Relaxed),
            bytes_transferred: self.progress.bytes_transferred.load(Relaxed),
            state,
            result,
            error,
            resume: self.resume.clone(),
        }
    }

    fn view(&self) -> Value {
        let (state, finished) = self.state.lock().clone();
        let mut v = json!({
            "id": self.id,
            "kind": self.kind,
            "target": self.target,
            "started_unix_s": self.started_unix_s,
            "finished_unix_s": finished,
            "bytes_total": self.progress.bytes_total.load(Relaxed),
            "bytes_done": self.progress.bytes_done.load(Relaxed),
            "bytes_transferred": self.progress.bytes_transferred.load(Relaxed),
            "cancel_requested": self.progress.is_cancelled(),
        });
        match state {
            State::Running => v["state"] = "running".into(),
            State::Succeeded(result) => {
                v["state"] = "succeeded".into();
                v["result"] = result;
            }
            State::Failed {
                status,
                code,
                message,
            } => {
                v["state"] = match code.as_str() {
                    "cancelled" => "cancelled",
                    INTERRUPTED => INTERRUPTED,
                    _ => "failed",
                }
                .into();
                v["error"] = json!({ "status": status, "code": code, "message": message });
            }
        }
        v
    }
}

/// The server's jobs.
#[derive(Default)]
pub struct Jobs {
    jobs: Mutex<BTreeMap<u64, Arc<Job>>>,
    next_id: Mutex<u64>,
    /// `jobs.json`; `None` keeps nothing.
    path: Option<PathBuf>,
    /// Jobs a stop cut off that can run again: (id, resume request), until taken.
    interrupted: Mutex<Vec<(u64, Value)>>,
    /// The server is stopping ([`Jobs::stop`]).
    stopping: AtomicBool,
}

impl Jobs {
    /// The jobs kept in `pool`'s directory; those that were running are now `interrupted`.
    pub fn open(pool: &ibid_engine::Pool) -> anyhow::Result<Jobs> {
        let path = pool.dir().join(FILE_NAME);
        let records = crate::durable::read_table::<Table>(&path, "jobs", FILE_VERSION)?
            .map(|t| t.jobs)
            .unwrap_or_default();
        let jobs = Jobs {
            path: Some(path),
            ..Jobs::default()
        };
        let now = now_unix_s();
        let mut interrupted = Vec::new();
        for r in records {
            let progress = Progress::default();
            progress.bytes_total.store(r.bytes_total, Relaxed);
            progress.bytes_done.store(r.bytes_done, Relaxed);
            progress
                .bytes_transferred
                .store(r.bytes_transferred, Relaxed);
            let (state, finished) = match (r.state.as_str(), r.result, r.error) {
                ("running", _, _) => {
                    if let Some(resume) = &r.resume {
                        interrupted.push((r.id, resume.clone()));
                    }
                    (
                        State::Failed {
                            status: 503,
                            code: INTERRUPTED.into(),
                            message: "the server stopped while the job ran".into(),
                        },
                        Some(now),
                    )
                }
                ("succeeded", result, _) => (
                    State::Succeeded(result.unwrap_or(Value::Null)),
                    r.finished_unix_s,
                ),
                (_, _, e) => {
                    let e = e.unwrap_or(StoredError {
                        status: 500,
                        code: "failed".into(),
                        message: String::new(),
                    });
                    (
                        State::Failed {
                            status: e.status,
                            code: e.code,
                            message: e.message,
                        },
                        r.finished_unix_s,
                    )
                }
            };
            {
                let mut next = jobs.next_id.lock();
                *next = (*next).max(r.id);
            }
            jobs.jobs.lock().insert(
                r.id,
                Arc::new(Job {
                    id: r.id,
                    kind: r.kind,
                    target: r.target,
                    started_unix_s: r.started_unix_s,
                    progress: Arc::new(progress),
                    state: Mutex::new((state, finished)),
                    done: tokio::sync::Notify::new(),
                    resume: None,
                }),
            );
        }
        *jobs.interrupted.lock() = interrupted;
        jobs.write();
        Ok(jobs)
    }

    /// Tells the running jobs that the server is stopping: each is asked to stop at its next
    /// step (as a cancel does), and one that then ends in an error is left `running` in the
    /// table, so that the next start lists it as `interrupted` and runs it again if it can. A
    /// job may also finish what it can do at once instead (a full clone is made usable and
    /// left for the background to make permanent).
    pub fn stop(&self) {
        self.stopping.store(true, Relaxed);
        for job in self.jobs.lock().values() {
            if matches!(job.state.lock().0, State::Running) {
                job.progress.cancel();
            }
        }
    }

    /// Whether [`Jobs::stop`] was called.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Relaxed)
    }

    /// The jobs a stop cut off that can run again, with the request that does (each once).
    pub fn take_interrupted(&self) -> Vec<(u64, Value)> {
        std::mem::take(&mut *self.interrupted.lock())
    }

    /// Writes the table; a failure is logged (the jobs in memory stay right).
    fn write(&self) {
        let Some(path) = &self.path else {
            return;
        };
        let records: Vec<Record> = self.jobs.lock().values().map(|j| j.record()).collect();
        let text = serde_json::to_vec_pretty(&Table {
            version: FILE_VERSION,
            jobs: records,
        })
        .expect("jobs serialize");
        if let Err(e) = crate::durable::write_file(path, &text) {
            tracing::warn!("write {}: {e}", path.display());
        }
    }

    /// Runs `work` as a job of `kind` on `target`; with `background`, answers at once (202 and
    /// the job), else when it ends (its result, or its error).
    pub async fn run<F>(
        self: &Arc<Self>,
        kind: &'static str,
        target: String,
        background: bool,
        progress: Arc<Progress>,
        resume: Option<Value>,
        work: F,
    ) -> Result<(StatusCode, Json<Value>), ApiError>
    where
        F: Future<Output = Result<Value, ApiError>> + Send + 'static,
    {
        if self.stopping() {
            // Early answer; `insert` checks again under the lock `stop` takes.
            return Err(stopping_error());
        }
        let id = {
            let mut n = self.next_id.lock();
            *n += 1;
            *n
        };
        let job = Arc::new(Job {
            id,
            kind: kind.to_string(),
            target,
            started_unix_s: now_unix_s(),
            progress,
            state: Mutex::new((State::Running, None)),
            done: tokio::sync::Notify::new(),
            resume,
        });
        if !self.insert(job.clone()) {
            return Err(stopping_error());
        }
        self.write();
        let runner = job.clone();
        let jobs = self.clone();
        let handle = tokio::spawn(async move {
            let outcome = work.await;
            if outcome.is_err() && jobs.stopping() {
                // Cut off by the stop: kept `running` in the table (see `Jobs::stop`).
                runner.done.notify_waiters();
                return outcome;
            }
            let state = match &outcome {
                Ok(v) => State::Succeeded(v.clone()),
                Err(e) => State::Failed {
                    status: e.status().as_u16(),
                    code: e.code().to_string(),
                    message: e.message().to_string(),
                },
            };
            *runner.state.lock() = (state, Some(now_unix_s()));
            jobs.write();
            runner.done.notify_waiters();
            outcome
        });
        if background {
            return Ok((StatusCode::ACCEPTED, Json(job.view())));
        }
        match handle.await {
            Ok(Ok(v)) => Ok((StatusCode::OK, Json(v))),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(ApiError::internal(anyhow::anyhow!("job {id} failed: {e}"))),
        }
    }

    /// Adds a job, unless the server is stopping (checked under the lock [`Jobs::stop`] takes
    /// to cancel the running jobs, so that a job is either refused or cancelled by it).
    fn insert(&self, job: Arc<Job>) -> bool {
        let mut jobs = self.jobs.lock();
        if self.stopping() {
            return false;
        }
        jobs.insert(job.id, job);
        let finished: Vec<u64> = jobs
            .values()
            .filter(|j| !matches!(j.state.lock().0, State::Running))
            .map(|j| j.id)
            .collect();
        for id in finished
            .iter()
            .take(finished.len().saturating_sub(FINISHED_KEPT_MAX))
        {
            jobs.remove(id);
        }
        true
    }

    fn get(&self, id: u64) -> Result<Arc<Job>, ApiError> {
        self.jobs.lock().get(&id).cloned().ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}"))
        })
    }
}

/// The answer to a request for a job once the server is stopping (a job started then would
/// not be told of the stop, and the pool closes under it).
fn stopping_error() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "stopping",
        "the server is stopping: no new job is started; send the request again once it has \
         restarted",
    )
}

/// The status of a job's answer for a request that makes something (a volume): 201 when the
/// request waited for it, else the job's own (202, running in the background).
pub fn created(status: StatusCode) -> StatusCode {
    if status == StatusCode::OK {
        StatusCode::CREATED
    } else {
        status
    }
}

fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The jobs' routes.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/api/v1/jobs", get(list))
        .route("/api/v1/jobs/{id}", get(describe))
        .route("/api/v1/jobs/{id}/cancel", post(cancel))
}

type Shared = Extension<Arc<Jobs>>;

fn parse_id(id: &str) -> Result<u64, ApiError> {
    id.parse()
        .map_err(|_| ApiError::bad_request(format!("job id {id:?}: expected a number")))
}

async fn list(Extension(jobs): Shared) -> Json<Value> {
    let all: Vec<Arc<Job>> = jobs.jobs.lock().values().cloned().collect();
    Json(Value::Array(all.iter().map(|j| j.view()).collect()))
}

async fn describe(
    Extension(jobs): Shared,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(jobs.get(parse_id(&id)?)?.view()))
}

/// Asks a running job to stop; answers the job (its state turns `cancelled` when it has).
async fn cancel(Extension(jobs): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let job = jobs.get(parse_id(&id)?)?;
    if !matches!(job.state.lock().0, State::Running) {
        return Err(ApiError::conflict(
            "finished",
            format!("job {id} has finished"),
        ));
    }
    job.progress.cancel();
    Ok(Json(job.view()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A job that runs until it is asked to stop, then fails as a cancelled one does, and
    /// signals that its work has returned.
    async fn until_stopped(
        progress: Arc<Progress>,
        ended: tokio::sync::oneshot::Sender<()>,
    ) -> Result<Value, ApiError> {
        while !progress.is_cancelled() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = ended.send(());
        Err(ApiError::conflict("cancelled", "cancelled"))
    }

    /// The server's stop asks running jobs to stop; one that then fails stays `running` in
    /// the table, so the next start lists it as `interrupted` and offers its resume request.
    /// A job cancelled before the stop is listed `cancelled` and is not run again.
    #[tokio::test]
    async fn a_job_cut_off_by_the_stop_is_listed_interrupted_and_runs_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = ibid_engine::PoolConfig {
            capacity_bytes: Some(1 << 30),
            capacity_force: true,
            ..ibid_engine::PoolConfig::default()
        };
        let pool =
            ibid_engine::Pool::create(dir.path().join("pool"), config.clone()).expect("create");
        let jobs = Arc::new(Jobs::open(&pool).expect("jobs"));
        let mut ids = Vec::new();
        for (kind, resume) in [("cancelled", json!({"c": 1})), ("stopped", json!({"s": 2}))] {
            let progress = Arc::new(Progress::default());
            let (tx, rx) = tokio::sync::oneshot::channel();
            let work = until_stopped(progress.clone(), tx);
            let (status, Json(view)) = jobs
                .run(
                    kind,
                    kind.into(),
                    true,
                    progress.clone(),
                    Some(resume),
                    work,
                )
                .await
                .expect("started");
            assert_eq!(status, StatusCode::ACCEPTED);
            let id = view["id"].as_u64().expect("id");
            ids.push(id);
            if kind == "cancelled" {
                progress.cancel();
            } else {
                jobs.stop();
                assert!(progress.is_cancelled(), "the stop reaches the running job");
            }
            rx.await.expect("the job's work returned");
            // The runner records the outcome right after the work returns.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(jobs.get(ids[0]).expect("job").view()["state"], "cancelled");
        assert_eq!(jobs.get(ids[1]).expect("job").view()["state"], "running");
        drop(jobs);
        let again = Jobs::open(&pool).expect("jobs after the restart");
        assert_eq!(again.get(ids[0]).expect("job").view()["state"], "cancelled");
        assert_eq!(again.get(ids[1]).expect("job").view()["state"], INTERRUPTED);
        assert_eq!(again.take_interrupted(), vec![(ids[1], json!({"s": 2}))]);
        drop(again);
        pool.close().expect("close");
    }

    /// Once the server is stopping, a request for a job is refused (503 `stopping`) and no job
    /// is recorded: the stop has already told the running jobs, and would not tell this one.
    #[tokio::test]
    async fn a_job_asked_for_after_the_stop_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = ibid_engine::PoolConfig {
            capacity_bytes: Some(1 << 30),
            capacity_force: true,
            ..ibid_engine::PoolConfig::default()
        };
        let pool = ibid_engine::Pool::create(dir.path().join("pool"), config).expect("create");
        let jobs = Arc::new(Jobs::open(&pool).expect("jobs"));
        jobs.stop();
        let progress = Arc::new(Progress::default());
        let refused = jobs
            .run("late", "late".into(), true, progress, None, async {
                Ok(json!({}))
            })
            .await
            .expect_err("refused");
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.code(), "stopping");
        assert!(jobs.jobs.lock().is_empty(), "no job recorded");
        drop(jobs);
        assert!(Jobs::open(&pool).expect("jobs").jobs.lock().is_empty());
        pool.close().expect("close");
    }
}
