//! The HTTP/JSON management API, versioned under `/api/v1` (a first slice of issue 5):
//! pool statistics, volumes (create, list, describe, resize, delete, clone), snapshots
//! (create, list, delete). Errors are JSON `{"code": ..., "message": ...}` with a 4xx status
//! for bad requests and a stable `code` scripts can match on.
//!
//! Engine calls block (they may fsync), so every handler runs them on the blocking pool.

use crate::units::parse_size;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ibid_engine::{Error, Pool, PoolStats, SnapshotInfo, VolumeInfo};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// An API error: HTTP status, stable code, message.
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            code: "bad_request",
            message: message.into(),
        }
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let (status, code) = match &e {
            Error::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Error::AlreadyExists(_) => (StatusCode::CONFLICT, "already_exists"),
            Error::InvalidArgument(_) => (StatusCode::BAD_REQUEST, "invalid_argument"),
            Error::OutOfRange { .. } => (StatusCode::BAD_REQUEST, "out_of_range"),
            Error::NoSpace => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            Error::ReadOnly(_) => (StatusCode::CONFLICT, "read_only"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError {
            status,
            code,
            message: e.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({ "code": self.code, "message": self.message })),
        )
            .into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A JSON body, or the precise reason it could not be read, as a JSON error.
type Body<T> = Result<Json<T>, JsonRejection>;

fn body<T>(b: Body<T>) -> ApiResult<T> {
    b.map(|Json(t)| t).map_err(|e| ApiError {
        status: e.status(),
        code: "bad_request",
        message: e.body_text(),
    })
}

/// Runs a blocking engine call off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        code: "internal",
        message: format!("engine task failed: {e}"),
    })?
}

/// A size given as bytes (number) or with a unit (`"10G"`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Human(String),
}

impl Size {
    fn bytes(&self) -> ApiResult<u64> {
        match self {
            Size::Bytes(b) => Ok(*b),
            Size::Human(s) => parse_size(s).map_err(ApiError::bad_request),
        }
    }
}

#[derive(Deserialize)]
struct CreateVolume {
    name: String,
    size: Size,
}

#[derive(Deserialize)]
struct Resize {
    size: Size,
}

#[derive(Deserialize)]
struct CreateSnapshot {
    name: String,
}

#[derive(Deserialize)]
struct CloneRequest {
    /// Name of the new volume.
    name: String,
    /// A full clone (its map refers to no other volume) instead of a fast one.
    #[serde(default)]
    full: bool,
    /// Clone this snapshot of the volume instead of the live volume.
    #[serde(default)]
    snapshot: Option<String>,
}

#[derive(Serialize)]
struct VolumeView {
    name: String,
    id: u64,
    size_bytes: u64,
    mapped_blocks: u64,
    created_unix_s: u64,
}

impl From<VolumeInfo> for VolumeView {
    fn from(v: VolumeInfo) -> Self {
        VolumeView {
            name: v.name,
            id: v.id,
            size_bytes: v.size_bytes,
            mapped_blocks: v.mapped_blocks,
            created_unix_s: v.created_unix_s,
        }
    }
}

fn stats_json(s: &PoolStats) -> Value {
    json!({
        "capacity_bytes": s.capacity_bytes,
        "soft_threshold_pct": s.soft_threshold_pct,
        "soft_threshold_exceeded": s.soft_threshold_exceeded,
        "volumes": s.volumes,
        "provisioned_bytes": s.provisioned_bytes,
        "logical_written_bytes": s.logical_written_bytes,
        "unique_bytes": s.unique_bytes,
        "unique_chunks": s.unique_chunks,
        "physical_bytes": s.physical_bytes,
        "metadata_bytes": s.metadata_bytes,
        "used_bytes": s.used_bytes,
        "free_bytes": s.free_bytes,
        "segment_file_bytes": s.segment_file_bytes,
        "garbage_bytes": s.garbage_bytes,
        "data_reduction_ratio": s.data_reduction_ratio,
        "dedup_filter_ram_bytes": s.dedup_filter_ram_bytes,
    })
}

fn snapshot_json(s: &SnapshotInfo) -> Value {
    json!({
        "volume": s.volume,
        "name": s.name,
        "id": s.id,
        "size_bytes": s.size_bytes,
        "mapped_blocks": s.mapped_blocks,
        "created_unix_s": s.created_unix_s,
    })
}

/// The API's routes over `pool`.
pub fn router(pool: Pool) -> Router {
    Router::new()
        .route("/metrics", get(crate::metrics::scrape))
        .route("/api/v1/pool", get(pool_stats))
        .route("/api/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/api/v1/volumes/{name}",
            get(describe_volume).delete(delete_volume),
        )
        .route("/api/v1/volumes/{name}/resize", post(resize_volume))
        .route("/api/v1/volumes/{name}/clone", post(clone_volume))
        .route(
            "/api/v1/volumes/{name}/snapshots",
            get(list_snapshots).post(create_snapshot),
        )
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}",
            axum::routing::delete(delete_snapshot),
        )
        .with_state(pool)
}

async fn pool_stats(State(pool): State<Pool>) -> ApiResult<Json<Value>> {
    blocking(move || {
        pool.sync()?;
        Ok(Json(stats_json(&pool.stats())))
    })
    .await
}

async fn list_volumes(State(pool): State<Pool>) -> Json<Vec<VolumeView>> {
    Json(
        pool.list_volumes()
            .into_iter()
            .map(VolumeView::from)
            .collect(),
    )
}

/// The `201 Created` answer describing a volume just made.
fn created(pool: &Pool, name: &str) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let info = pool
        .list_volumes()
        .into_iter()
        .find(|v| v.name == name)
        .ok_or_else(|| Error::NotFound(name.to_string()))?;
    Ok((StatusCode::CREATED, Json(VolumeView::from(info))))
}

async fn create_volume(
    State(pool): State<Pool>,
    req: Body<CreateVolume>,
) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let req = body(req)?;
    let size = req.size.bytes()?;
    blocking(move || {
        pool.create_volume(&req.name, size)?;
        created(&pool, &req.name)
    })
    .await
}

async fn describe_volume(
    State(pool): State<Pool>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    blocking(move || {
        let volume = pool.volume(&name)?;
        let space = volume.space()?;
        Ok(Json(json!({
            "name": name,
            "id": volume.id(),
            "size_bytes": space.size_bytes,
            "blocks": space.size_bytes.div_ceil(4096),
            "mapped_blocks": space.mapped_blocks,
            "exclusive_blocks": space.exclusive_blocks,
            "shared_blocks": space.shared_blocks,
            "exclusive_physical_bytes": space.exclusive_physical_bytes,
            "shared_physical_bytes": space.shared_physical_bytes,
            "snapshots": pool.list_snapshots(Some(&name)).iter().map(snapshot_json).collect::<Vec<_>>(),
        })))
    })
    .await
}

async fn delete_volume(
    State(pool): State<Pool>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(move || {
        pool.delete_volume(&name)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

async fn resize_volume(
    State(pool): State<Pool>,
    Path(name): Path<String>,
    req: Body<Resize>,
) -> ApiResult<StatusCode> {
    let req = body(req)?;
    let size = req.size.bytes()?;
    blocking(move || {
        pool.resize_volume(&name, size)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

async fn clone_volume(
    State(pool): State<Pool>,
    Path(name): Path<String>,
    req: Body<CloneRequest>,
) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let req = body(req)?;
    blocking(move || {
        let source = match &req.snapshot {
            Some(s) => format!("{name}@{s}"),
            None => name.clone(),
        };
        if req.full {
            pool.full_clone(&source, &req.name)?;
        } else {
            pool.clone_volume(&source, &req.name)?;
        }
        created(&pool, &req.name)
    })
    .await
}

async fn list_snapshots(
    State(pool): State<Pool>,
    Path(name): Path<String>,
) -> ApiResult<Json<Vec<Value>>> {
    pool.volume(&name)?;
    Ok(Json(
        pool.list_snapshots(Some(&name))
            .iter()
            .map(snapshot_json)
            .collect(),
    ))
}

async fn create_snapshot(
    State(pool): State<Pool>,
    Path(name): Path<String>,
    req: Body<CreateSnapshot>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let req = body(req)?;
    blocking(move || {
        let info = pool.create_snapshot(&name, &req.name)?;
        Ok((StatusCode::CREATED, Json(snapshot_json(&info))))
    })
    .await
}

async fn delete_snapshot(
    State(pool): State<Pool>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    blocking(move || {
        pool.delete_snapshot(&name, &snapshot)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}
