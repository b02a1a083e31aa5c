//! Lock objects that keep a GC from running beside a push, a snapshot deletion or another GC on
//! one remote (see the crate's doc, "GC and concurrent pushes").
//!
//! A lock is `locks/<kind>-<host>-<pid>-<nanos>` holding JSON [`LockBody`]. Taking one: write it,
//! then list `locks/`; if a live lock of a conflicting kind ([`Kind::conflicts`]) is there,
//! delete ours and report busy.
//! Any two takers see each other or at least one of them does, since each writes before it
//! lists. A push's lock is rewritten every [`LOCK_REFRESH`] so a long push stays live.

use crate::{Error, Remote, Result, LOCK_STALE_S};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// How often a held lock is rewritten (well under [`LOCK_STALE_S`]).
const LOCK_REFRESH: Duration = Duration::from_secs(60);

/// What holds a lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Kind {
    Push,
    Gc,
    /// A remote snapshot's deletion (its manifest).
    Delete,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Push => "push",
            Kind::Gc => "gc",
            Kind::Delete => "delete",
        }
    }

    /// Whether locks of `self` and `other` may not be held at once. A GC excludes everything:
    /// a push may reuse chunks it would delete, and a deletion or another GC could undo or
    /// race its manifest rewrites (repacking). Pushes and deletions run beside each other.
    pub(crate) fn conflicts(self, other: Kind) -> bool {
        self == Kind::Gc || other == Kind::Gc
    }
}

#[derive(Serialize, Deserialize)]
struct LockBody {
    kind: Kind,
    host: String,
    pid: u32,
    started_unix_s: u64,
}

/// A held lock; [`Held::release`] deletes it (a lock dropped unreleased goes stale).
pub(crate) struct Held {
    store: Arc<dyn ObjectStore>,
    path: Path,
    refresher: tokio::task::JoinHandle<()>,
}

impl Held {
    pub(crate) async fn release(self) {
        self.refresher.abort();
        if let Err(e) = self.store.delete(&self.path).await {
            tracing::warn!("remote: could not delete lock {}: {e}", self.path);
        }
    }
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

impl Remote {
    /// Takes a lock of `kind`, or fails with [`Error::Busy`] if a conflicting one is live.
    pub(crate) async fn lock(&self, kind: Kind) -> Result<Held> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let host = host();
        let pid = std::process::id();
        let name: String = format!("{}-{host}-{pid}-{nanos}", kind.name())
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = Path::from(format!("locks/{name}"));
        let body = serde_json::to_vec(&LockBody {
            kind,
            host,
            pid,
            started_unix_s: crate::now_unix_s(),
        })
        .expect("locks serialize");
        self.store
            .put(&path, PutPayload::from(body.clone()))
            .await?;
        let other = self.live_locks().await;
        let other = match other {
            Ok(locks) => locks
                .into_iter()
                .find(|(k, p)| kind.conflicts(*k) && *p != path),
            Err(e) => {
                let _ = self.store.delete(&path).await;
                return Err(e);
            }
        };
        if let Some((k, p)) = other {
            let _ = self.store.delete(&path).await;
            let what = match k {
                Kind::Push => "a push to this remote is running",
                Kind::Gc => "a garbage collection of this remote is running",
                Kind::Delete => "a snapshot of this remote is being deleted",
            };
            return Err(Error::Busy(format!("{what} ({p}); try again later")));
        }
        let store = self.store.clone();
        let refresh_path = path.clone();
        let refresher = tokio::spawn(async move {
            loop {
                tokio::time::sleep(LOCK_REFRESH).await;
                if let Err(e) = store
                    .put(&refresh_path, PutPayload::from(body.clone()))
                    .await
                {
                    tracing::warn!("remote: could not refresh lock {refresh_path}: {e}");
                }
            }
        });
        Ok(Held {
            store: self.store.clone(),
            path,
            refresher,
        })
    }

    /// Locks whose holder may still run: not stale by age, and not of a dead process here.
    pub(crate) async fn live_locks(&self) -> Result<Vec<(Kind, Path)>> {
        Ok(self.scan_locks().await?.0)
    }

    /// The locks, live and stale, from one listing.
    async fn scan_locks(&self) -> Result<(Vec<(Kind, Path)>, Vec<Path>)> {
        let metas: Vec<_> = self
            .store
            .list(Some(&Path::from("locks")))
            .try_collect()
            .await?;
        let here = host();
        let now = std::time::SystemTime::now();
        let mut out = Vec::new();
        let mut stale = Vec::new();
        for meta in metas {
            let age_s = now
                .duration_since(meta.last_modified.into())
                .map_or(0, |d| d.as_secs());
            if age_s > LOCK_STALE_S {
                stale.push(meta.location);
                continue;
            }
            let body = match self.store.get(&meta.location).await {
                Ok(r) => r.bytes().await?,
                Err(object_store::Error::NotFound { .. }) => continue, // released meanwhile
                Err(e) => return Err(e.into()),
            };
            let Ok(body) = serde_json::from_slice::<LockBody>(&body) else {
                tracing::warn!("remote: ignoring unreadable lock {}", meta.location);
                continue;
            };
            if body.host == here && !std::path::Path::new(&format!("/proc/{}", body.pid)).exists() {
                stale.push(meta.location); // Its process is gone (killed or crashed).
                continue;
            }
            out.push((body.kind, meta.location));
        }
        Ok((out, stale))
    }

    /// Deletes locks that are stale (for GC: they would otherwise accumulate).
    pub(crate) async fn remove_stale_locks(&self) -> Result<usize> {
        let (_, stale) = self.scan_locks().await?;
        for p in &stale {
            self.store.delete(p).await?;
        }
        Ok(stale.len())
    }
}
