//! The HTTP/JSON management API, versioned under `/api/v1` and described by the OpenAPI
//! document it serves at `/api/v1/openapi.json` (`openapi.json` next to this file): the pool
//! (statistics, capacity, soft threshold), volumes (create in a format, list, describe, resize,
//! delete, format conversions, clone, range copy, QoS limits) and snapshots (create, list,
//! delete). Errors are JSON `{"code": ..., "message": ...}` with a 4xx status for bad requests
//! and a stable `code` scripts can match on; an unknown route is a JSON 404 (`not_found`), a
//! known route with another method a JSON 405 (`method_not_allowed`). With a token configured,
//! every route requires `Authorization: Bearer TOKEN`. Request bodies are read whole before a
//! handler runs, at most [`BODY_BYTES_MAX`] of them (else 413, `too_large`) and within the
//! server's request timeout (else 408, `timeout`), so a client that stops sending cannot hold a
//! request open.
//!
//! Engine calls block (they may fsync), so every handler runs them on the blocking pool.

use crate::clients::{ClientView, Clients};
use crate::instant_restores::{InstantRestores, RestoreHooks};
use crate::lun_map::LunMap;
use crate::qos::{Limits, Qos};
use crate::units::{format_exact, parse_size};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use ibid_engine::{Error, Pool, PoolStats, SnapshotInfo, Volume, VolumeFormat, VolumeInfo};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// Largest request body the API reads: its requests are small JSON documents.
pub const BODY_BYTES_MAX: usize = 64 << 10;
/// How much of an oversized body is read (and dropped) before the 413 answer: a client still
/// sending gets to read the answer instead of a reset connection.
const DRAIN_BYTES_MAX: u64 = 4 << 20;

/// An API error: HTTP status, stable code, message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    /// A 400 `bad_request` with `message`.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            code: "bad_request",
            message: message.into(),
        }
    }

    /// An error answer with `status`, a stable `code` and `message`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// A 500 `internal` for a failure of the server's own (`{e:#}`).
    pub fn internal(e: anyhow::Error) -> Self {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("{e:#}"),
        )
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable error code.
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// A 409 with `code` and `message`.
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::CONFLICT,
            code,
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
            Error::CannotReserve { .. } => (StatusCode::CONFLICT, "cannot_reserve"),
            Error::ReadOnly(_) => (StatusCode::CONFLICT, "read_only"),
            Error::Failed(_) => (StatusCode::SERVICE_UNAVAILABLE, "pool_failed"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        let mut message = e.to_string();
        if let Error::CannotReserve { .. } = e {
            message.push_str(&format!(
                " (a thick volume reserves {}; the pool keeps up to {} more as overwrite \
                 headroom for its thick volumes)",
                crate::units::reservation_rule(),
                crate::units::format_size(crate::units::overwrite_headroom_max())
            ));
        }
        ApiError {
            status,
            code,
            message,
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

/// A volume format by name, or the precise reason it is not one.
fn parse_format(s: &str) -> ApiResult<VolumeFormat> {
    s.parse()
        .map_err(|e: Error| ApiError::bad_request(e.to_string()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateVolume {
    name: String,
    size: Size,
    /// `thin` (default), `lazyzeroedthick` or `eagerzeroedthick`.
    #[serde(default)]
    format: Option<String>,
    /// QoS limits, as `PATCH .../qos` takes them (null or absent: no limit).
    #[serde(default)]
    qos: Option<Value>,
    /// iSCSI LUN number (absent: the lowest free one).
    #[serde(default)]
    lun: Option<u64>,
}

/// `PATCH /api/v1/volumes/{name}`: the settings of a volume that change by assignment.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchVolume {
    /// The iSCSI LUN number to move the volume to.
    lun: u64,
}

/// `POST .../snapshots/{snapshot}/export`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportSnapshot {
    /// iSCSI LUN number (absent: the lowest free one).
    #[serde(default)]
    lun: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetFormat {
    format: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolSettings {
    #[serde(default)]
    capacity: Option<Size>,
    #[serde(default)]
    soft_threshold_pct: Option<u8>,
    /// Accept a capacity larger than the filesystem under the pool can hold.
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CopyRequest {
    /// Source volume, or `VOLUME@SNAPSHOT`.
    source: String,
    #[serde(default)]
    source_offset: Option<Size>,
    /// Destination offset in this volume.
    #[serde(default)]
    offset: Option<Size>,
    /// Bytes to copy (default: the whole source from `source_offset`).
    #[serde(default)]
    length: Option<Size>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Resize {
    size: Size,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateSnapshot {
    name: String,
    /// Export the new snapshot read-only over iSCSI at once (at `lun`, or the lowest free LUN).
    #[serde(default)]
    export: bool,
    /// The iSCSI LUN to export it as (implies `export`).
    #[serde(default)]
    lun: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloneRequest {
    /// Name of the new volume.
    name: String,
    /// A full clone (its map refers to no other volume) instead of a fast one.
    #[serde(default)]
    full: bool,
    /// Clone this snapshot of the volume instead of the live volume.
    #[serde(default)]
    snapshot: Option<String>,
    /// Format of the clone (default thin).
    #[serde(default)]
    format: Option<String>,
    /// A full clone only (it runs as a job): answer at once (202, the job) instead of when it
    /// ends.
    #[serde(default)]
    background: bool,
}

/// The router's state: the pool and who is connected to its volumes.
#[derive(Clone)]
struct Api {
    pool: Pool,
    clients: Arc<Clients>,
    qos: Arc<Qos>,
    luns: Arc<LunMap>,
    instants: Arc<InstantRestores>,
}

impl axum::extract::FromRef<Api> for Pool {
    fn from_ref(api: &Api) -> Pool {
        api.pool.clone()
    }
}

#[derive(Serialize)]
struct VolumeView {
    name: String,
    id: u64,
    format: &'static str,
    size_bytes: u64,
    blocks: u64,
    mapped_blocks: u64,
    tbz_blocks: u64,
    reserved_bytes: u64,
    created_unix_s: u64,
    /// Number of snapshots of the volume.
    snapshots: usize,
    /// iSCSI LUN number (null only if all LUNs are taken).
    lun: Option<u64>,
    /// Blocks whose data only this volume holds, and blocks it shares (with other volumes,
    /// its snapshots or clones), from the background space breakdown (`breakdown` in
    /// `GET /api/v1/pool` says how old): null in answers other than the listing, and until
    /// the volume is in a breakdown.
    exclusive_blocks: Option<u64>,
    shared_blocks: Option<u64>,
    /// Physical bytes of the chunks only this volume holds (same source).
    exclusive_physical_bytes: Option<u64>,
    /// QoS limits (null: none), shared by all the volume's connections.
    qos: Limits,
    /// Open connections using the volume or its snapshots (NBD, iSCSI): what deleting it would
    /// cut off.
    clients: Vec<ClientView>,
    /// Its instant restore from a remote while one runs (snapshot, remote, bytes of data and
    /// bytes the volume holds so far); null otherwise.
    restoring: Option<Value>,
}

impl VolumeView {
    fn new(v: VolumeInfo, api: &Api) -> Self {
        let snapshots = api.pool.list_snapshots(Some(&v.name)).len();
        Self::with_snapshots(v, api, snapshots)
    }

    fn with_snapshots(v: VolumeInfo, api: &Api, snapshots: usize) -> Self {
        VolumeView {
            snapshots,
            restoring: api.instants.view(v.id),
            clients: api.clients.of_volume_and_snapshots(&v.name),
            qos: api.qos.limits(v.id),
            lun: api.luns.lun_of_volume(v.id),
            exclusive_blocks: None,
            shared_blocks: None,
            exclusive_physical_bytes: None,
            name: v.name,
            id: v.id,
            format: v.format.as_str(),
            size_bytes: v.size_bytes,
            blocks: v.size_bytes.div_ceil(4096),
            mapped_blocks: v.mapped_blocks,
            tbz_blocks: v.tbz_blocks,
            reserved_bytes: v.reserved_bytes,
            created_unix_s: v.created_unix_s,
        }
    }
}

fn volume_info(pool: &Pool, name: &str) -> ApiResult<VolumeInfo> {
    Ok(pool
        .list_volumes()
        .into_iter()
        .find(|v| v.name == name)
        .ok_or_else(|| Error::NotFound(name.to_string()))?)
}

fn stats_json(s: &PoolStats) -> Value {
    json!({
        "capacity_bytes": s.capacity_bytes,
        "soft_threshold_pct": s.soft_threshold_pct,
        "soft_threshold_exceeded": s.soft_threshold_exceeded,
        "volumes": s.volumes,
        "provisioned_bytes": s.provisioned_bytes,
        "thick_provisioned_bytes": s.thick_provisioned_bytes,
        "logical_written_bytes": s.logical_written_bytes,
        "unique_bytes": s.unique_bytes,
        "unique_chunks": s.unique_chunks,
        "physical_bytes": s.physical_bytes,
        "metadata_bytes": s.metadata_bytes,
        "used_bytes": s.used_bytes,
        "reserved_bytes": s.reserved_bytes,
        "overwrite_headroom_bytes": s.overwrite_headroom_bytes,
        "free_bytes": s.free_bytes,
        "filesystem_bytes": s.filesystem_bytes,
        "filesystem_free_bytes": s.filesystem_free_bytes,
        "filesystem_reserve_bytes": s.filesystem_reserve_bytes,
        "segment_file_bytes": s.segment_file_bytes,
        "garbage_bytes": s.garbage_bytes,
        "data_reduction_ratio": s.data_reduction_ratio,
        "dedup_filter_ram_bytes": s.dedup_filter_ram_bytes,
        "dedup_filter_capacity": s.dedup_filter_capacity,
        "dedup_filter_fingerprints": s.dedup_filter_fingerprints,
        "layer_filter_ram_bytes": s.layer_filter_ram_bytes,
    })
}

/// A snapshot as the API shows it; `lun` is its iSCSI LUN while exported, else null.
fn snapshot_json(s: &SnapshotInfo, luns: &LunMap) -> Value {
    json!({
        "volume": s.volume,
        "name": s.name,
        "id": s.id,
        "lun": luns.lun_of_snapshot(s.id),
        "size_bytes": s.size_bytes,
        "mapped_blocks": s.mapped_blocks,
        "created_unix_s": s.created_unix_s,
    })
}

/// The OpenAPI 3 document describing every route.
pub const OPENAPI: &str = include_str!("openapi.json");

/// Who may call the API: anyone who reaches it, or holders of a bearer token.
#[derive(Clone, Default)]
pub struct Access {
    token: Option<Arc<str>>,
}

impl Access {
    /// Requires `Authorization: Bearer TOKEN` on every request.
    pub fn token(token: &str) -> Self {
        Access {
            token: Some(token.into()),
        }
    }
}

/// Refuses requests without the configured bearer token (401, JSON error).
async fn authorize(State(access): State<Access>, req: Request, next: Next) -> Response {
    if let Some(token) = &access.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Compare in constant time: the token is a password.
        let ok = given.is_some_and(|g| {
            g.len() == token.len()
                && g.bytes()
                    .zip(token.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        });
        if !ok {
            let mut r = ApiError {
                status: StatusCode::UNAUTHORIZED,
                code: "unauthorized",
                message: "this API requires the header Authorization: Bearer TOKEN".into(),
            }
            .into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    next.run(req).await
}

/// Reads the request's body whole, at most [`BODY_BYTES_MAX`] bytes within `timeout`, before
/// the handler runs: 413 (`too_large`) above the limit, 408 (`timeout`) if the client stops
/// sending, both as JSON errors. An oversized body is read on (and dropped) up to
/// [`DRAIN_BYTES_MAX`] before the answer, so that the client, still sending, gets to read it.
async fn read_body(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    use http_body_util::BodyExt;
    let (parts, mut body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut bytes = Vec::new();
    let mut seen = declared.unwrap_or(0);
    if declared.is_none_or(|n| n <= DRAIN_BYTES_MAX) {
        seen = 0;
        let read = async {
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame?.into_data() {
                    seen += data.len() as u64;
                    if seen <= BODY_BYTES_MAX as u64 {
                        bytes.extend_from_slice(&data);
                    } else if seen > DRAIN_BYTES_MAX {
                        break;
                    }
                }
            }
            Ok::<(), axum::Error>(())
        };
        match tokio::time::timeout(timeout, read).await {
            Err(_) => {
                return closing(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "timeout",
                    format!(
                        "the request body did not arrive within {} s",
                        timeout.as_secs_f64()
                    ),
                ))
            }
            Ok(Err(e)) => {
                return closing(ApiError::bad_request(format!(
                    "cannot read the request body: {e}"
                )))
            }
            Ok(Ok(())) => {}
        }
    }
    if seen > BODY_BYTES_MAX as u64 {
        return closing(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the request body is larger than {BODY_BYTES_MAX} bytes, the API's limit"),
        ));
    }
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// An error answer after which the server closes the connection (the rest of the request was
/// not read).
fn closing(e: ApiError) -> Response {
    let mut r = e.into_response();
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

/// Refuses a `VOLUME@SNAPSHOT` where a volume route expects a volume name (volume names
/// cannot hold `@`): without this, `DELETE /api/v1/volumes/vm1@s` would answer that no snapshot
/// `s` exists when it does.
async fn volume_not_snapshot(req: Request, next: Next) -> Response {
    let segment = req
        .uri()
        .path()
        .strip_prefix("/api/v1/volumes/")
        .and_then(|rest| rest.split('/').next())
        .map(|s| s.replace("%40", "@"));
    if let Some((volume, snapshot)) = segment.as_deref().and_then(|s| s.split_once('@')) {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            format!(
                "{volume}@{snapshot} is a snapshot, not a volume: snapshots are under \
                 /api/v1/volumes/{volume}/snapshots/{snapshot} (CLI: ibid snapshot ...)"
            ),
        )
        .into_response();
    }
    next.run(req).await
}

/// Any path the API does not have: a JSON 404, like every other error.
async fn no_route(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no API route {} {} (the routes are in /api/v1/openapi.json)",
            req.method(),
            req.uri().path()
        ),
    )
}

/// A known path with a method it does not take: a JSON 405.
async fn wrong_method(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} does not take {} (see /api/v1/openapi.json)",
            req.uri().path(),
            req.method()
        ),
    )
}

/// The API's routes over `pool`, guarded by `access`, listing (and protecting) the volumes'
/// `clients`; a request's body must arrive within `request_timeout`.
pub fn router(
    pool: Pool,
    clients: Arc<Clients>,
    qos: Arc<Qos>,
    luns: Arc<LunMap>,
    instants: Arc<InstantRestores>,
    access: Access,
    request_timeout: Duration,
) -> Router {
    Router::new()
        .route("/metrics", get(crate::metrics::scrape))
        .route("/api/v1/openapi.json", get(openapi))
        .route("/api/v1/pool", get(pool_stats).patch(update_pool))
        .route("/api/v1/pool/verify", post(verify_pool))
        .route("/api/v1/pool/breakdown", post(compute_breakdown))
        .route("/api/v1/server", get(server_info))
        .route("/api/v1/stats/history", get(crate::history::get_history))
        .route(
            "/api/v1/stats/volumes",
            get(crate::history::get_volume_iops),
        )
        .route("/api/v1/pool/scrub", get(scrub_status).post(start_scrub))
        .route("/api/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/api/v1/volumes/{name}",
            get(describe_volume)
                .delete(delete_volume)
                .patch(patch_volume),
        )
        .route("/api/v1/volumes/{name}/resize", post(resize_volume))
        .route("/api/v1/volumes/{name}/format", post(set_format))
        .route("/api/v1/volumes/{name}/inflate", post(inflate))
        .route("/api/v1/volumes/{name}/eagerzero", post(eagerzero))
        .route("/api/v1/volumes/{name}/reserve", post(reserve))
        .route("/api/v1/volumes/{name}/clone", post(clone_volume))
        .route("/api/v1/volumes/{name}/copy", post(copy_range))
        .route("/api/v1/volumes/{name}/qos", axum::routing::patch(set_qos))
        .route(
            "/api/v1/volumes/{name}/snapshots",
            get(list_snapshots).post(create_snapshot),
        )
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}",
            axum::routing::delete(delete_snapshot),
        )
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}/export",
            post(export_snapshot).delete(unexport_snapshot),
        )
        .merge(crate::remotes::routes())
        .merge(crate::jobs::routes())
        .merge(crate::schedules::routes())
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(Api {
            pool,
            clients,
            qos,
            luns,
            instants,
        })
        .layer(middleware::from_fn(volume_not_snapshot))
        .layer(middleware::from_fn_with_state(request_timeout, read_body))
        .layer(middleware::from_fn_with_state(access, authorize))
}

/// Where the server listens, for the connection hints clients show (`GET /api/v1/server`).
#[derive(Clone, Debug, Serialize)]
pub struct ServerInfo {
    /// The `ibid` version.
    pub version: &'static str,
    /// NBD listen address (`host:port`).
    pub nbd: String,
    /// iSCSI portal (`host:port`), if the target runs.
    pub iscsi: Option<String>,
    /// iSCSI target name.
    pub iqn: String,
}

async fn server_info(Extension(info): Extension<Arc<ServerInfo>>) -> Json<ServerInfo> {
    Json((*info).clone())
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

/// `?sync=false` on `GET /api/v1/pool`: the space figures as of the last commit, without
/// making one.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatsQuery {
    #[serde(default = "default_true")]
    sync: bool,
}

/// Serde's default for a flag that is on unless the query turns it off.
fn default_true() -> bool {
    true
}

/// The pool's figures. By default exact: every acknowledged write counted, every freed chunk
/// freed, which takes a commit and a fold of the whole reference log (seconds under a heavy
/// overwrite load). `?sync=false` answers at once, with physical, metadata, used and free as
/// of the last commit (freed space once its slice of the reference log is folded; volumes,
/// provisioned and logical figures are live): what a poller (the dashboard, every 5 s) asks
/// for, so that watching the pool does not make it commit and fold.
async fn pool_stats(
    State(pool): State<Pool>,
    Extension(space): Extension<Arc<crate::space::SpaceCache>>,
    query: Result<Query<StatsQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let sync = query_of(query)?.sync;
    blocking(move || {
        if sync {
            pool.sync()?;
        } else {
            // A failed pool answers 503 `pool_failed` either way (the dashboard's banner).
            pool.check_failed()?;
        }
        let mut v = stats_json(&pool.stats());
        v["breakdown"] = space.json();
        Ok(Json(v))
    })
    .await
}

/// Computes the space breakdown now (a walk of every live volume's map) and answers it as
/// `breakdown` in `GET /api/v1/pool` shows it.
async fn compute_breakdown(
    State(pool): State<Pool>,
    Extension(space): Extension<Arc<crate::space::SpaceCache>>,
) -> ApiResult<Json<Value>> {
    blocking(move || {
        pool.sync()?;
        let c = space.compute(&pool)?;
        Ok(Json(crate::space::computed_json(&c, None)))
    })
    .await
}

/// The answer of a pool check that ran: `{"ok": true, volumes, map_entries, chunks,
/// physical_bytes, orphans, seconds}`, or `{"ok": false, "problem", "seconds"}` when it found
/// damage (a chunk whose content fails its checksum or fingerprint, a count that does not add
/// up). Other failures (I/O, a failed pool) are errors, not findings.
pub fn verify_answer(
    result: ibid_engine::Result<ibid_engine::VerifyReport>,
    took: Duration,
) -> Result<Value, Error> {
    match result {
        Ok(r) => Ok(json!({
            "ok": true,
            "volumes": r.volumes,
            "map_entries": r.map_entries,
            "chunks": r.chunks,
            "physical_bytes": r.physical_bytes,
            "orphans": r.orphans,
            "seconds": took.as_secs_f64(),
        })),
        Err(Error::Corrupt(problem)) => Ok(json!({
            "ok": false,
            "problem": problem.strip_prefix("verify: ").unwrap_or(&problem),
            "seconds": took.as_secs_f64(),
        })),
        Err(e) => Err(e),
    }
}

/// Checks the whole pool (`Pool::verify`): every count recomputed, every live chunk read back
/// against its fingerprint. Commits wait while it runs.
async fn verify_pool(State(pool): State<Pool>) -> ApiResult<Json<Value>> {
    blocking(move || {
        let started = std::time::Instant::now();
        let result = pool.verify();
        Ok(Json(verify_answer(result, started.elapsed())?))
    })
    .await
}

async fn scrub_status(
    Extension(scrubber): Extension<Arc<crate::scrub::Scrubber>>,
) -> Json<crate::scrub::ScrubStatus> {
    Json(scrubber.status())
}

/// Starts a scrub pass now: 202 with the status, or 409 `busy` while a pass runs.
async fn start_scrub(
    Extension(scrubber): Extension<Arc<crate::scrub::Scrubber>>,
) -> ApiResult<(StatusCode, Json<crate::scrub::ScrubStatus>)> {
    if !scrubber.request() {
        return Err(ApiError::conflict(
            "busy",
            "a scrub pass is already running",
        ));
    }
    Ok((StatusCode::ACCEPTED, Json(scrubber.status())))
}

async fn update_pool(State(pool): State<Pool>, req: Body<PoolSettings>) -> ApiResult<Json<Value>> {
    let req = body(req)?;
    let capacity = req.capacity.as_ref().map(Size::bytes).transpose()?;
    blocking(move || {
        // Checked before anything changes: a refused capacity must not leave a new threshold.
        if let Some(pct) = req.soft_threshold_pct.filter(|p| !(1..=100).contains(p)) {
            return Err(Error::InvalidArgument(format!(
                "soft threshold {pct}: must be 1 to 100 percent"
            ))
            .into());
        }
        if let Some(c) = capacity {
            let set = if req.force {
                pool.set_capacity_forced(c)
            } else {
                pool.set_capacity(c)
            };
            set.map_err(|e| match e {
                Error::CannotReserve { needed, .. } => ApiError::conflict(
                    "cannot_reserve",
                    format!(
                        "capacity {} is below the {} the pool already uses and reserves",
                        format_exact(c),
                        format_exact(needed)
                    ),
                ),
                e => e.into(),
            })?;
        }
        if let Some(pct) = req.soft_threshold_pct {
            pool.set_soft_threshold(pct)?;
        }
        pool.sync()?;
        Ok(Json(stats_json(&pool.stats())))
    })
    .await
}

async fn list_volumes(
    State(api): State<Api>,
    Extension(space): Extension<Arc<crate::space::SpaceCache>>,
) -> Json<Vec<VolumeView>> {
    // One listing of the snapshots for all volumes, not one per volume.
    let mut snapshots: std::collections::HashMap<String, usize> = Default::default();
    for s in api.pool.list_snapshots(None) {
        *snapshots.entry(s.volume).or_default() += 1;
    }
    let breakdown = space.last();
    Json(
        api.pool
            .list_volumes()
            .into_iter()
            .map(|v| {
                let n = snapshots.get(&v.name).copied().unwrap_or(0);
                let mut view = VolumeView::with_snapshots(v, &api, n);
                // (By id too: a volume deleted and made again under its name is another.)
                if let Some(&(_, excl, shared, excl_phys)) = breakdown
                    .as_ref()
                    .and_then(|b| b.volumes.get(&view.name))
                    .filter(|f| f.0 == view.id)
                {
                    view.exclusive_blocks = Some(excl);
                    view.shared_blocks = Some(shared);
                    view.exclusive_physical_bytes = Some(excl_phys);
                }
                view
            })
            .collect(),
    )
}

/// The `201 Created` answer describing a volume just made.
fn created(api: &Api, name: &str) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    Ok((
        StatusCode::CREATED,
        Json(VolumeView::new(volume_info(&api.pool, name)?, api)),
    ))
}

async fn create_volume(
    State(api): State<Api>,
    req: Body<CreateVolume>,
) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let req = body(req)?;
    let size = req.size.bytes()?;
    let format = req.format.as_deref().map(parse_format).transpose()?;
    let limits = match &req.qos {
        None | Some(Value::Null) => Limits::default(),
        Some(v) => Limits::default().patched(qos_patch(v)?).map_err(invalid)?,
    };
    blocking(move || {
        if let Some(lun) = req.lun {
            api.luns.check_available(lun)?;
        }
        let id = api
            .pool
            .create_volume_with_format(&req.name, size, format.unwrap_or_default())?
            .id();
        let settings = api.luns.assign(&api.pool, id, req.lun).and_then(|_| {
            if limits.is_unlimited() {
                return Ok(());
            }
            api.qos.update(id, &req.name, |_| Ok(limits)).map(|_| ())
        });
        if let Err(e) = settings {
            // The volume cannot get the LUN or limits asked for: it must not stay behind.
            api.pool.delete_volume(&req.name)?;
            refresh_luns(&api);
            return Err(e);
        }
        created(&api, &req.name)
    })
    .await
}

/// A 400 `invalid_argument` with `message`.
fn invalid(message: String) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
}

/// A QoS body's object of limits, or the precise reason it is not one.
fn qos_patch(v: &Value) -> ApiResult<&serde_json::Map<String, Value>> {
    v.as_object().ok_or_else(|| {
        invalid(format!(
            "QoS limits are a JSON object with any of {} (numbers, or null for no limit), not {v}",
            crate::qos::FIELDS.join(", ")
        ))
    })
}

/// `PATCH /api/v1/volumes/{name}/qos`: changes the volume's limits, merge-patch style (a
/// number sets a limit, null removes it, an absent field keeps it); in force at once on every
/// connection, kept across restarts. Answers with the volume.
async fn set_qos(
    State(api): State<Api>,
    Path(name): Path<String>,
    req: Body<Value>,
) -> ApiResult<Json<VolumeView>> {
    let req = body(req)?;
    let patch = qos_patch(&req)?.clone();
    blocking(move || {
        let id = api.pool.volume(&name)?.id();
        api.qos
            .update(id, &name, |limits| limits.patched(&patch).map_err(invalid))?;
        Ok(Json(VolumeView::new(volume_info(&api.pool, &name)?, &api)))
    })
    .await
}

/// `PATCH /api/v1/volumes/{name}` with `{"lun": N}`: moves the volume to iSCSI LUN `N`
/// (409 `lun_in_use` if another volume or snapshot has it). Initiators get REPORTED LUNS DATA
/// HAS CHANGED at their next command. Answers with the volume.
async fn patch_volume(
    State(api): State<Api>,
    Path(name): Path<String>,
    req: Body<PatchVolume>,
) -> ApiResult<Json<VolumeView>> {
    let req = body(req)?;
    blocking(move || {
        let id = api.pool.volume(&name)?.id();
        api.luns.assign(&api.pool, id, Some(req.lun))?;
        Ok(Json(VolumeView::new(volume_info(&api.pool, &name)?, &api)))
    })
    .await
}

/// Reconciles the LUN table after the pool's catalog changed (a volume or snapshot gone, a
/// clone made); a failure to write the table is logged, the next change retries.
fn refresh_luns(api: &Api) {
    if let Err(e) = api.luns.refresh(&api.pool) {
        tracing::error!("LUN table: {e:#}");
    }
}

async fn describe_volume(
    State(api): State<Api>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    blocking(move || {
        let Api {
            pool,
            clients,
            qos,
            luns,
            instants,
        } = api;
        let volume = pool.volume(&name)?;
        let space = volume.space()?;
        let info = volume_info(&pool, &name)?;
        Ok(Json(json!({
            "name": name,
            "id": volume.id(),
            "format": info.format.as_str(),
            "created_unix_s": info.created_unix_s,
            "lun": luns.lun_of_volume(volume.id()),
            "size_bytes": space.size_bytes,
            "blocks": space.size_bytes.div_ceil(4096),
            "mapped_blocks": space.mapped_blocks,
            "tbz_blocks": info.tbz_blocks,
            "reserved_bytes": info.reserved_bytes,
            "unique_blocks": space.exclusive_blocks,
            "distinct_chunks": space.distinct_chunks,
            "physical_bytes": space.exclusive_physical_bytes + space.shared_physical_bytes,
            "exclusive_blocks": space.exclusive_blocks,
            "shared_blocks": space.shared_blocks,
            "exclusive_physical_bytes": space.exclusive_physical_bytes,
            "shared_physical_bytes": space.shared_physical_bytes,
            "snapshots": pool.list_snapshots(Some(&name)).iter().map(|s| snapshot_json(s, &luns)).collect::<Vec<_>>(),
            "clients": clients.of_volume_and_snapshots(&name),
            "qos": qos.limits(volume.id()),
            "qos_throttled_requests": qos.get(volume.id()).map_or(0, |q| q.throttled_requests()),
            "qos_throttled_seconds": qos.get(volume.id()).map_or(0.0, |q| q.throttled_seconds()),
            "restoring": instants.view(volume.id()),
        })))
    })
    .await
}

/// `?force=true` on a delete: go ahead even with clients connected.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeleteQuery {
    #[serde(default)]
    force: bool,
}

/// The query of a delete, or the precise reason it is not one.
fn delete_query(q: Result<Query<DeleteQuery>, QueryRejection>) -> ApiResult<bool> {
    query_of(q).map(|q| q.force)
}

/// A request's query, or the precise reason it is not one (400 `bad_request`).
fn query_of<T>(q: Result<Query<T>, QueryRejection>) -> ApiResult<T> {
    q.map(|Query(q)| q).map_err(|e| ApiError {
        status: e.status(),
        code: "bad_request",
        message: e.body_text(),
    })
}

/// Refuses (409 `in_use`) to cut `clients` off `what`, unless forced.
fn check_unused(what: &str, clients: &[ClientView], force: bool) -> ApiResult<()> {
    if force || clients.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = clients
        .iter()
        .map(|c| match &c.initiator {
            Some(i) => format!("{} {} ({i})", c.protocol, c.remote),
            None => format!("{} {}", c.protocol, c.remote),
        })
        .collect();
    Err(ApiError::conflict(
        "in_use",
        format!(
            "{what} has {} connected client{}: {}; disconnect {} first, or force the delete \
             (CLI --force, API ?force=true) and {} I/O will fail",
            clients.len(),
            if clients.len() == 1 { "" } else { "s" },
            list.join(", "),
            if clients.len() == 1 { "it" } else { "them" },
            if clients.len() == 1 { "its" } else { "their" },
        ),
    ))
}

async fn delete_volume(
    State(api): State<Api>,
    Path(name): Path<String>,
    query: Result<Query<DeleteQuery>, QueryRejection>,
) -> ApiResult<StatusCode> {
    let force = delete_query(query)?;
    blocking(move || {
        let id = api.pool.volume(&name)?.id();
        check_unused(
            &format!("volume {name:?} (with its snapshots)"),
            &api.clients.of_volume_and_snapshots(&name),
            force,
        )?;
        api.pool.delete_volume(&name)?;
        // A restore into it stops (its fill's next write would fail) and is forgotten.
        api.instants.forget(&name)?;
        refresh_luns(&api);
        api.clients.forget_volume(&name);
        if let Err(e) = api.qos.forget(id) {
            // The volume is gone; its row is dropped at the next start.
            tracing::warn!("volume {name:?} deleted, but its QoS limits stay in the file: {e:#}");
        }
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

async fn resize_volume(
    State(api): State<Api>,
    Path(name): Path<String>,
    req: Body<Resize>,
) -> ApiResult<StatusCode> {
    let req = body(req)?;
    let size = req.size.bytes()?;
    blocking(move || {
        api.instants.refuse(&api.pool, &name, "a resize")?;
        api.pool.resize_volume(&name, size)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

async fn clone_volume(
    State(api): State<Api>,
    Extension(jobs): Extension<Arc<crate::jobs::Jobs>>,
    Path(name): Path<String>,
    req: Body<CloneRequest>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let req = body(req)?;
    if req.background && !req.full {
        return Err(ApiError::bad_request(
            "background applies to a full clone only (a fast clone is immediate)",
        ));
    }
    let format = req.format.as_deref().map(parse_format).transpose()?;
    let source = match &req.snapshot {
        Some(s) => format!("{name}@{s}"),
        None => name.clone(),
    };
    {
        let api = api.clone();
        let name = name.clone();
        blocking(move || {
            api.pool.volume(&name)?;
            api.instants.refuse(&api.pool, &name, "a clone")
        })
        .await?;
    }
    if !req.full {
        return blocking(move || {
            api.pool.clone_volume(&source, &req.name)?;
            finish_clone(&api, &req.name, format)
        })
        .await;
    }
    // A full clone walks the source's map (time proportional to its mapped blocks): a job,
    // with the bytes walked as its progress, cancellable between walk windows.
    let progress = Arc::new(ibid_offload::Progress::default());
    let size = match source.split_once('@') {
        Some((v, s)) => api.pool.snapshot(v, s)?.size(),
        None => api.pool.volume(&source)?.size(),
    };
    progress
        .bytes_total
        .store(size, std::sync::atomic::Ordering::Relaxed);
    let target = format!("{source} -> {} (full clone)", req.name);
    let work = {
        let progress = progress.clone();
        let jobs = jobs.clone();
        async move {
            blocking(move || {
                let pool = &api.pool;
                pool.full_clone_with(
                    &source,
                    &req.name,
                    progress.cancel_flag(),
                    &progress.bytes_done,
                )?;
                // Stopped by the server's stop rather than cancelled: the clone reads right
                // already (through its source's layers), and the background makes it
                // permanent after the restart.
                if progress.is_cancelled() && !jobs.stopping() {
                    pool.delete_volume(&req.name)?;
                    refresh_luns(&api);
                    return Err(ApiError::conflict("cancelled", "cancelled"));
                }
                finish_clone(&api, &req.name, format).map(|(_, Json(v))| v)
            })
            .await
        }
    };
    let (status, answer) = jobs
        .run("clone", target, req.background, progress, None, work)
        .await?;
    Ok((crate::jobs::created(status), answer))
}

/// A clone made: its format (if thick) and its LUN; answers the new volume.
fn finish_clone(
    api: &Api,
    name: &str,
    format: Option<VolumeFormat>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let pool = &api.pool;
    if let Some(f) = format.filter(|f| f.is_thick()) {
        if let Err(e) = pool.set_volume_format(name, f) {
            // The clone cannot get the format asked for: it must not stay behind.
            pool.delete_volume(name)?;
            return Err(e.into());
        }
    }
    let id = pool.volume(name)?.id();
    api.luns.assign(pool, id, None)?;
    let (status, Json(view)) = created(api, name)?;
    Ok((status, Json(json!(view))))
}

/// Converts a volume to `to` if its current format is one of `from`, answering with the
/// volume; `verb` names the conversion in the error.
async fn convert(
    api: Api,
    name: String,
    from: &'static [VolumeFormat],
    to: VolumeFormat,
    verb: &'static str,
) -> ApiResult<Json<VolumeView>> {
    blocking(move || {
        let pool = &api.pool;
        let current = volume_info(pool, &name)?.format;
        if current != to && !from.contains(&current) {
            return Err(ApiError::conflict(
                "wrong_format",
                format!("{verb} applies to {from:?} volumes; {name:?} is {current}"),
            ));
        }
        pool.set_volume_format(&name, to)?;
        Ok(Json(VolumeView::new(volume_info(pool, &name)?, &api)))
    })
    .await
}

async fn set_format(
    State(api): State<Api>,
    Path(name): Path<String>,
    req: Body<SetFormat>,
) -> ApiResult<Json<VolumeView>> {
    let to = parse_format(&body(req)?.format)?;
    convert(api, name, &VolumeFormat::ALL, to, "format").await
}

/// `vmkfstools --inflatedisk`: thin to eager-zeroed thick.
async fn inflate(State(api): State<Api>, Path(name): Path<String>) -> ApiResult<Json<VolumeView>> {
    let from = &[VolumeFormat::Thin];
    convert(api, name, from, VolumeFormat::EagerZeroedThick, "inflate").await
}

/// `vmkfstools -k`: lazy- to eager-zeroed thick.
async fn eagerzero(
    State(api): State<Api>,
    Path(name): Path<String>,
) -> ApiResult<Json<VolumeView>> {
    let from = &[VolumeFormat::LazyZeroedThick];
    convert(api, name, from, VolumeFormat::EagerZeroedThick, "eagerzero").await
}

/// Reserves space for a thin volume: thin to lazy-zeroed thick.
async fn reserve(State(api): State<Api>, Path(name): Path<String>) -> ApiResult<Json<VolumeView>> {
    let from = &[VolumeFormat::Thin];
    convert(api, name, from, VolumeFormat::LazyZeroedThick, "reserve").await
}

/// Opens a volume or a `VOLUME@SNAPSHOT` for reading.
fn open_source(pool: &Pool, source: &str) -> ApiResult<Volume> {
    Ok(match source.split_once('@') {
        Some((v, s)) => {
            pool.volume(v)?;
            pool.snapshot(v, s)?
        }
        None => pool.volume(source)?,
    })
}

async fn copy_range(
    State(api): State<Api>,
    Path(name): Path<String>,
    req: Body<CopyRequest>,
) -> ApiResult<Json<Value>> {
    let req = body(req)?;
    let src_offset = req.source_offset.as_ref().map_or(Ok(0), Size::bytes)?;
    let dst_offset = req.offset.as_ref().map_or(Ok(0), Size::bytes)?;
    let length = req.length.as_ref().map(Size::bytes).transpose()?;
    blocking(move || {
        let pool = &api.pool;
        let src = open_source(pool, &req.source)?;
        let dst = pool.volume(&name)?;
        let length = match length {
            Some(l) => l,
            None => src
                .size()
                .checked_sub(src_offset)
                .ok_or(Error::OutOfRange {
                    offset: src_offset,
                    len: 0,
                    size: src.size(),
                })?,
        };
        let started = std::time::Instant::now();
        // A volume being restored: the source's chunks are fetched first, the destination's
        // whole chunks claimed (the restore must not write over the copy).
        let src_restore = match req.source.contains('@') {
            true => RestoreHooks::default(),
            false => RestoreHooks::of(&api.instants, src.id()),
        };
        let dst_restore = RestoreHooks::of(&api.instants, dst.id());
        src_restore.fetch(src_offset, length)?;
        let report = dst_restore.write(dst_offset, length, false, || {
            dst.copy_from(&src, src_offset, dst_offset, length)
        })?;
        dst_restore.flush(&dst)?;
        Ok(Json(json!({
            "source": req.source,
            "destination": name,
            "source_offset": src_offset,
            "offset": dst_offset,
            "length": length,
            "shared_bytes": report.shared_bytes,
            "data_bytes": report.data_bytes,
            "seconds": started.elapsed().as_secs_f64(),
        })))
    })
    .await
}

async fn list_snapshots(
    State(api): State<Api>,
    Path(name): Path<String>,
) -> ApiResult<Json<Vec<Value>>> {
    api.pool.volume(&name)?;
    Ok(Json(
        api.pool
            .list_snapshots(Some(&name))
            .iter()
            .map(|s| snapshot_json(s, &api.luns))
            .collect(),
    ))
}

async fn create_snapshot(
    State(api): State<Api>,
    Path(name): Path<String>,
    req: Body<CreateSnapshot>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let req = body(req)?;
    blocking(move || {
        if let Some(lun) = req.lun {
            api.luns.check_available(lun)?;
        }
        api.instants.refuse(&api.pool, &name, "a snapshot")?;
        let info = api.pool.create_snapshot(&name, &req.name)?;
        if req.export || req.lun.is_some() {
            if let Err(e) = api
                .luns
                .export_snapshot(&api.pool, &name, &req.name, req.lun)
            {
                // The snapshot cannot get the LUN asked for: it must not stay behind.
                api.pool.delete_snapshot(&name, &req.name)?;
                return Err(e);
            }
        }
        Ok((StatusCode::CREATED, Json(snapshot_json(&info, &api.luns))))
    })
    .await
}

/// The snapshot `name@snapshot`'s description (404 if the volume or the snapshot is missing).
fn snapshot_info(pool: &Pool, name: &str, snapshot: &str) -> ApiResult<SnapshotInfo> {
    pool.volume(name)?;
    Ok(pool
        .list_snapshots(Some(name))
        .into_iter()
        .find(|s| s.name == snapshot)
        .ok_or_else(|| Error::NotFound(format!("{name}@{snapshot}")))?)
}

/// `POST /api/v1/volumes/{name}/snapshots/{snapshot}/export`, body `{"lun": N}` or `{}`:
/// exports the snapshot read-only over iSCSI as LUN `N` (or the lowest free one); kept in the
/// pool until unexported or deleted. Answers with the snapshot, `lun` set.
async fn export_snapshot(
    State(api): State<Api>,
    Path((name, snapshot)): Path<(String, String)>,
    req: Body<ExportSnapshot>,
) -> ApiResult<Json<Value>> {
    let req = body(req)?;
    blocking(move || {
        api.luns
            .export_snapshot(&api.pool, &name, &snapshot, req.lun)?;
        let info = snapshot_info(&api.pool, &name, &snapshot)?;
        Ok(Json(snapshot_json(&info, &api.luns)))
    })
    .await
}

/// `DELETE /api/v1/volumes/{name}/snapshots/{snapshot}/export`: the snapshot's LUN goes away
/// (initiators get REPORTED LUNS DATA HAS CHANGED); 404 if it was not exported, 409 `in_use`
/// while iSCSI sessions use it, unless `?force=true`.
async fn unexport_snapshot(
    State(api): State<Api>,
    Path((name, snapshot)): Path<(String, String)>,
    query: Result<Query<DeleteQuery>, QueryRejection>,
) -> ApiResult<StatusCode> {
    let force = delete_query(query)?;
    blocking(move || {
        let info = snapshot_info(&api.pool, &name, &snapshot)?;
        let export = format!("{name}@{snapshot}");
        let sessions: Vec<ClientView> = api
            .clients
            .of_export(&export)
            .into_iter()
            .filter(|c| c.protocol == "iscsi")
            .collect();
        if api.luns.lun_of_snapshot(info.id).is_some() {
            check_unused(&format!("the iSCSI LUN of {export:?}"), &sessions, force)?;
        }
        api.luns.unexport_snapshot(info.id, &export)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

async fn delete_snapshot(
    State(api): State<Api>,
    Path((name, snapshot)): Path<(String, String)>,
    query: Result<Query<DeleteQuery>, QueryRejection>,
) -> ApiResult<StatusCode> {
    let force = delete_query(query)?;
    blocking(move || {
        let Api {
            pool,
            clients,
            luns,
            ..
        } = api;
        // A missing volume is named as such, not as a missing snapshot of it.
        pool.volume(&name)?;
        pool.snapshot(&name, &snapshot)?;
        let export = format!("{name}@{snapshot}");
        check_unused(
            &format!("snapshot {export:?}"),
            &clients.of_export(&export),
            force,
        )?;
        pool.delete_snapshot(&name, &snapshot)?;
        if let Err(e) = luns.refresh(&pool) {
            tracing::error!("LUN table: {e:#}");
        }
        clients.forget_export(&export);
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}
