//! Long operations (pushes to and restores from remotes) as jobs: listed with their progress at
//! `GET /api/v1/jobs`, cancellable with `POST /api/v1/jobs/{id}/cancel`. A request that starts
//! one waits for it by default, or answers `202` with the job at once when its body asks for
//! `"background": true` (what the CLI does, to draw a progress bar).
//!
//! Jobs live in memory: a server restart forgets them (a push or restore cut off by it is
//! completed by running it again; see `ibid_offload`).

use crate::api::ApiError;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use ibid_offload::Progress;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Finished jobs kept for listing (the oldest are forgotten first).
const FINISHED_KEPT_MAX: usize = 100;

/// Where a job is.
#[derive(Clone)]
enum State {
    Running,
    Succeeded(Value),
    Failed {
        status: u16,
        code: &'static str,
        message: String,
    },
}

/// One job.
pub struct Job {
    id: u64,
    kind: &'static str,
    /// What it works on, e.g. `vm1@nightly -> offsite`.
    target: String,
    started_unix_s: u64,
    progress: Arc<Progress>,
    state: Mutex<(State, Option<u64>)>,
    /// Wakes the waiters when the job ends.
    done: tokio::sync::Notify,
}

impl Job {
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
                v["state"] = if code == "cancelled" {
                    "cancelled"
                } else {
                    "failed"
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
}

impl Jobs {
    /// Runs `work` as a job of `kind` on `target`; with `background`, answers at once (202 and
    /// the job), else when it ends (its result, or its error).
    pub async fn run<F>(
        self: &Arc<Self>,
        kind: &'static str,
        target: String,
        background: bool,
        progress: Arc<Progress>,
        work: F,
    ) -> Result<(StatusCode, Json<Value>), ApiError>
    where
        F: Future<Output = Result<Value, ApiError>> + Send + 'static,
    {
        let id = {
            let mut n = self.next_id.lock();
            *n += 1;
            *n
        };
        let job = Arc::new(Job {
            id,
            kind,
            target,
            started_unix_s: now_unix_s(),
            progress,
            state: Mutex::new((State::Running, None)),
            done: tokio::sync::Notify::new(),
        });
        self.insert(job.clone());
        let runner = job.clone();
        let handle = tokio::spawn(async move {
            let outcome = work.await;
            let state = match &outcome {
                Ok(v) => State::Succeeded(v.clone()),
                Err(e) => State::Failed {
                    status: e.status().as_u16(),
                    code: e.code(),
                    message: e.message().to_string(),
                },
            };
            *runner.state.lock() = (state, Some(now_unix_s()));
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

    fn insert(&self, job: Arc<Job>) {
        let mut jobs = self.jobs.lock();
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
    }

    fn get(&self, id: u64) -> Result<Arc<Job>, ApiError> {
        self.jobs.lock().get(&id).cloned().ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}"))
        })
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
