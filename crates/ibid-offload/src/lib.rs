//! Snapshots of an ibid pool pushed to, and restored from, an S3-compatible object store (AWS
//! S3, Ceph RGW, MinIO, Garage) through the `object_store` crate.
//!
//! ## Object layout in a remote (under its prefix)
//! ```text
//! packs/<blake3 hex>                 chunk records, ~8 MiB per object (format.rs)
//! snapshots/<volume>/<snapshot>      one manifest per pushed snapshot
//! index/<blake3 hex>                 index segments: together, every chunk the remote holds
//!                                    and where (a cache, rebuilt from manifests if absent)
//! locks/<kind>-<host>-<pid>-<nanos>  push and GC locks (JSON)
//! ```
//! A volume is cut in chunks of [`format::CHUNK_BYTES`] at fixed offsets; a chunk is named by
//! the BLAKE3 of its bytes, LZ4-compressed when that helps, and stored once per remote however
//! many snapshots (of however many volumes) hold it. Chunks that read as zeros are not stored.
//! Packs are named by the BLAKE3 of their own bytes, so uploading one twice is harmless.
//!
//! ## Push: order of writes and what a crash leaves
//! In order: a push lock; the packs; every [`INDEX_FLUSH_PACKS`] packs and at the end, an index
//! segment naming the chunks of the packs uploaded since the last one (so an incremental push
//! writes a small segment, not the whole index; a push that finds more than
//! [`INDEX_SEGMENTS_MAX`] merges them); last, the manifest, with a conditional put
//! (`If-None-Match: *`). A snapshot is listed, restorable and protected from GC only once its
//! manifest exists, and the manifest names only packs whose upload completed. A crash (kill -9,
//! power loss) at any step leaves packs no manifest names: a re-push of the same snapshot finds
//! their chunks through the index segments or a HEAD of the pack (same bytes, same name) and
//! sends only the rest; what no push claims is removed by the next GC.
//!
//! ## GC and concurrent pushes
//! GC repacks packs that are mostly garbage (`repack.rs`: their live chunks move to new packs,
//! the manifests naming them are rewritten) and deletes packs no manifest names. A pack a push
//! has uploaded but not yet named in a manifest is such a pack, and so is a pack whose chunks
//! a push is about to reuse; a remote snapshot deletion or another GC could race the manifest
//! rewrites. So a GC excludes the others through lock objects: each writes its own lock *then*
//! lists the locks, and backs off if it sees a conflicting kind (of both, at least one sees the
//! other). A lock whose process is gone (same host, pid not running) or not refreshed for
//! [`LOCK_STALE_S`] is ignored. GC rewrites the index from the manifests before it deletes a
//! pack (one segment, written before the others are deleted), so the index never names a
//! deleted pack. A restore that finds a pack gone reads its manifest again.
//!
//! ## Restore
//! The manifest is read (its checksum checked), a new thin volume created, and the records are
//! fetched with ranged GETs, pack by pack (downloads run apart from the pool's writes), each
//! chunk checked against its BLAKE3 before it is
//! written. Writes go through the engine's normal write path, so restored data is deduplicated
//! against the pool as it arrives. A restore that fails deletes the volume it created.
//!
//! ## Instant restore
//! [`InstantRestore`]: the new volume is usable at once; chunks are fetched when first read or
//! written in part, and the rest in the background, never over a host's writes; a mark log
//! synced after the volume at every flush keeps what is present across a crash (`instant.rs`).
#![deny(clippy::unwrap_used)]
#![deny(missing_docs)]

mod fetch;
pub mod format;
mod gc;
mod instant;
mod lock;
mod push;
mod repack;
mod restore;

use format::{Hash, ManifestHeader};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::ObjectStore;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

pub use gc::{GcReport, VerifyReport};
pub use instant::{marks_file, Claim, InstantRestore};
pub use push::PushReport;
pub use repack::REPACK_LIVE_BELOW_PCT;
pub use restore::{Checkpoint, RestoreDone, RestoreReport, CHECKPOINT_PACKS};

/// Packs uploaded between two writes of the index during a push (what a resumed push can skip
/// without HEADs: up to this many packs' chunks are found by HEAD instead).
pub const INDEX_FLUSH_PACKS: usize = 4;
/// Index segments a push reads before it merges them into one.
pub const INDEX_SEGMENTS_MAX: usize = 64;
/// A lock not refreshed for this long belongs to a process that is gone.
pub const LOCK_STALE_S: u64 = 15 * 60;
/// Uploads (pack PUTs) in flight at once during a push.
pub const UPLOADS_INFLIGHT_MAX: usize = 4;
/// Downloads (pack GETs) in flight at once during a restore or verify.
pub const DOWNLOADS_INFLIGHT_MAX: usize = 4;

/// An error of a remote operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The object store failed or refused (network, credentials, bucket).
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    /// The pool failed.
    #[error(transparent)]
    Engine(#[from] ibid_engine::Error),
    /// No such snapshot in the remote (or in the pool).
    #[error("{0}")]
    NotFound(String),
    /// The snapshot is already in the remote.
    #[error("{0}")]
    AlreadyExists(String),
    /// Another operation holds the remote (a GC while pushing, a push while collecting).
    #[error("{0}")]
    Busy(String),
    /// An object read back is damaged (checksum, BLAKE3, bounds).
    #[error("damaged object in the remote: {0}")]
    Corrupt(String),
    /// The operation was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// A bad argument (name, configuration).
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// Whether a restore failed making its volume because one of that name exists (not this
    /// restore's: it must not be deleted).
    pub fn before_target(&self) -> bool {
        matches!(self, Error::Engine(ibid_engine::Error::AlreadyExists(_)))
    }
}

/// The result of a remote operation.
pub type Result<T> = std::result::Result<T, Error>;

/// How to reach a remote. The secret is never printed ([`std::fmt::Debug`] hides it).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteConfig {
    /// S3 endpoint URL (`https://...`; `http://` is allowed, for a store on loopback).
    pub endpoint: String,
    /// Bucket name.
    pub bucket: String,
    /// Region (default `us-east-1`, what most S3-compatible stores accept).
    #[serde(default)]
    pub region: Option<String>,
    /// Key prefix inside the bucket (several pools or remotes may share a bucket).
    #[serde(default)]
    pub prefix: Option<String>,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("prefix", &self.prefix)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<hidden>")
            .finish()
    }
}

/// Progress of a push or restore, readable while it runs, and its cancellation switch.
#[derive(Default, Debug)]
pub struct Progress {
    /// Bytes of volume to go through (mapped data).
    pub bytes_total: AtomicU64,
    /// Bytes of volume gone through so far.
    pub bytes_done: AtomicU64,
    /// Bytes sent to (push) or received from (restore) the object store.
    pub bytes_transferred: AtomicU64,
    cancelled: AtomicBool,
}

impl Progress {
    /// Asks the operation to stop at its next chunk; it returns [`Error::Cancelled`].
    pub fn cancel(&self) {
        self.cancelled.store(true, Relaxed);
    }

    /// Whether [`Progress::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Relaxed)
    }

    /// The flag [`Progress::cancel`] sets, for work that polls one (a full clone's walk).
    pub fn cancel_flag(&self) -> &AtomicBool {
        &self.cancelled
    }

    fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::Cancelled);
        }
        Ok(())
    }
}

/// A snapshot held by a remote, as its manifest describes it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RemoteSnapshot {
    /// The volume it was taken of.
    pub volume: String,
    /// Its name.
    pub name: String,
    /// Volume size in bytes.
    pub size_bytes: u64,
    /// Bytes of data (non-zero chunks).
    pub data_bytes: u64,
    /// When it was taken (Unix seconds).
    pub created_unix_s: u64,
    /// When its push completed (Unix seconds).
    pub pushed_unix_s: u64,
    /// Bytes of its manifest.
    pub manifest_bytes: u64,
}

/// A remote: an object store, under a prefix.
#[derive(Clone)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
}

/// The chunks a remote holds, by hash: which pack (by name) and where in it.
pub(crate) type Known = std::collections::HashMap<Hash, (Hash, format::Location)>;

impl Remote {
    /// A remote over any object store (tests use `object_store::memory::InMemory`).
    pub fn new(store: Arc<dyn ObjectStore>) -> Remote {
        Remote { store }
    }

    /// A remote in an S3-compatible store. `https` endpoints have their certificates verified;
    /// plain `http` is accepted for a store on a trusted network (loopback).
    pub fn s3(config: &RemoteConfig) -> Result<Remote> {
        let endpoint = config.endpoint.trim_end_matches('/');
        let http = endpoint.starts_with("http://");
        if !http && !endpoint.starts_with("https://") {
            return Err(Error::Invalid(format!(
                "endpoint {endpoint:?}: expected an http:// or https:// URL"
            )));
        }
        let store = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_allow_http(http)
            .with_bucket_name(&config.bucket)
            .with_region(config.region.as_deref().unwrap_or("us-east-1"))
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .build()?;
        let store: Arc<dyn ObjectStore> =
            match config.prefix.as_deref().map(|p| p.trim_matches('/')) {
                Some(p) if !p.is_empty() => {
                    Arc::new(object_store::prefix::PrefixStore::new(store, p.to_string()))
                }
                _ => Arc::new(store),
            };
        Ok(Remote { store })
    }

    /// Checks that the remote answers and the credentials may list it.
    pub async fn check(&self) -> Result<()> {
        self.store
            .list_with_delimiter(Some(&Path::from("snapshots")))
            .await?;
        Ok(())
    }

    /// The snapshots the remote holds (manifests that exist: completed pushes only), in
    /// volume and push order.
    pub async fn list(&self) -> Result<Vec<RemoteSnapshot>> {
        let metas: Vec<_> = self
            .store
            .list(Some(&Path::from("snapshots")))
            .try_collect()
            .await?;
        let mut out = Vec::new();
        for meta in metas {
            let header = self.manifest_header(&meta.location).await?;
            out.push(RemoteSnapshot {
                volume: header.volume,
                name: header.snapshot,
                size_bytes: header.size_bytes,
                data_bytes: header.data_bytes,
                created_unix_s: header.created_unix_s,
                pushed_unix_s: header.pushed_unix_s,
                manifest_bytes: meta.size,
            });
        }
        out.sort_by(|a, b| {
            (&a.volume, a.pushed_unix_s, &a.name).cmp(&(&b.volume, b.pushed_unix_s, &b.name))
        });
        Ok(out)
    }

    /// Deletes a snapshot from the remote (its manifest); the chunks only it held stay until
    /// the next [`Remote::gc`]. Refused ([`Error::Busy`]) while a GC runs (its repacking
    /// rewrites manifests, and could put this one back).
    pub async fn delete(&self, volume: &str, snapshot: &str) -> Result<()> {
        let path = manifest_path(volume, snapshot)?;
        let lock = self.lock(lock::Kind::Delete).await?;
        let result = match self.store.head(&path).await {
            Err(object_store::Error::NotFound { .. }) => Err(not_in_remote(volume, snapshot)),
            Err(e) => Err(e.into()),
            Ok(_) => self.store.delete(&path).await.map_err(Error::from),
        };
        lock.release().await;
        result
    }

    /// Reads only the header of a manifest (listing does not need the chunks).
    async fn manifest_header(&self, path: &Path) -> Result<ManifestHeader> {
        const PREFIX_BYTES: u64 = 4096;
        let head = self.store.get_range(path, 0..PREFIX_BYTES).await;
        let head = match head {
            Ok(b) => b,
            // A manifest shorter than the range: read it whole.
            Err(_) => self.store.get(path).await?.bytes().await?,
        };
        if head.len() < 16 || &head[..8] != format::MANIFEST_MAGIC {
            return Err(Error::Corrupt(format!("{path}: not a manifest")));
        }
        let len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
        let header = if head.len() >= 16 + len {
            head.slice(16..16 + len)
        } else {
            self.store.get_range(path, 16..16 + len as u64).await?
        };
        serde_json::from_slice(&header).map_err(|e| Error::Corrupt(format!("{path}: {e}")))
    }

    /// Reads and checks a whole manifest.
    pub(crate) async fn manifest(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> Result<format::Table<ManifestHeader>> {
        let path = manifest_path(volume, snapshot)?;
        let bytes = match self.store.get(&path).await {
            Err(object_store::Error::NotFound { .. }) => {
                return Err(not_in_remote(volume, snapshot))
            }
            r => r?.bytes().await?,
        };
        format::decode_table(format::MANIFEST_MAGIC, &bytes)
            .map_err(|e| Error::Corrupt(format!("{path}: {e}")))
    }

    /// Every manifest's path.
    pub(crate) async fn manifest_paths(&self) -> Result<Vec<Path>> {
        Ok(self
            .store
            .list(Some(&Path::from("snapshots")))
            .map_ok(|m| m.location)
            .try_collect()
            .await?)
    }
}

/// Worker threads of the runtime remote transfers run on.
const TRANSFER_THREADS: usize = 2;

/// The runtime remote transfers run on (threads `ibid-remote`), made at first use: uploads
/// sign their payloads (SHA-256) and downloads copy their bodies, work that would otherwise
/// run on the caller's runtime — in the server, the thread that serves every host's
/// connection.
fn transfers() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(TRANSFER_THREADS)
            .thread_name("ibid-remote")
            .enable_all()
            .build()
            .expect("the remote transfer runtime starts")
    })
}

/// Runs `work` on the transfer runtime ([`transfers`]); the caller's runtime only waits.
async fn on_transfers<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    transfers()
        .spawn(work)
        .await
        .map_err(|e| Error::Invalid(format!("remote transfer task failed: {e}")))?
}

fn not_in_remote(volume: &str, snapshot: &str) -> Error {
    Error::NotFound(format!("the remote has no snapshot {volume}@{snapshot}"))
}

/// `snapshots/<volume>/<snapshot>`; names are checked as the pool checks them, so no name
/// can reach another key.
pub fn manifest_path(volume: &str, snapshot: &str) -> Result<Path> {
    for n in [volume, snapshot] {
        ibid_engine::validate_volume_name(n).map_err(|e| Error::Invalid(e.to_string()))?;
    }
    Ok(Path::from(format!("snapshots/{volume}/{snapshot}")))
}

/// `packs/<hex>`.
pub(crate) fn pack_path(name: &Hash) -> Path {
    Path::from(format!("packs/{}", format::hex(name)))
}

/// Where the index segments are.
pub(crate) fn index_dir() -> Path {
    Path::from("index")
}

pub(crate) fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests;
