//! The pool's space by sharing (unique, shared, snapshot-only; `Pool::space_breakdown`),
//! kept up to date in the background: the computation walks every live volume's map, too
//! dear for every `GET /api/v1/pool`, so a thread recomputes it and the API shows the last
//! result with its age (`breakdown` in `GET /api/v1/pool`, per-volume `exclusive_blocks` and
//! `shared_blocks` in `GET /api/v1/volumes`). `POST /api/v1/pool/breakdown` recomputes now.

use ibid_engine::{Pool, SpaceBreakdown};
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Least time between two background computations.
pub const INTERVAL_MIN: Duration = Duration::from_secs(60);
/// A computation that took `t` waits `t × SPACING` before the next (so it uses at most a
/// twentieth of a core however large the pool), and at least [`INTERVAL_MIN`].
const SPACING: u32 = 20;

/// One computation's result.
pub struct Computed {
    /// The figures.
    pub breakdown: SpaceBreakdown,
    /// Per volume name: (volume id, exclusive blocks, shared blocks, exclusive physical bytes).
    pub volumes: HashMap<String, (u64, u64, u64, u64)>,
    /// When it finished, Unix seconds.
    pub at_unix_s: u64,
    /// How long it took.
    pub took: Duration,
}

#[derive(Default)]
struct Shared {
    last: Option<Arc<Computed>>,
    error: Option<String>,
    stop: bool,
}

/// The cached breakdown and the thread that refreshes it.
#[derive(Default)]
pub struct SpaceCache {
    shared: Mutex<Shared>,
    wake: Condvar,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn now_unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl SpaceCache {
    /// Starts the refreshing thread (first computation at once).
    pub fn start(pool: Pool) -> Arc<SpaceCache> {
        let cache = Arc::new(SpaceCache::default());
        let me = cache.clone();
        let thread = std::thread::Builder::new()
            .name("ibid-space".into())
            .spawn(move || me.run(&pool))
            .expect("spawn the space thread");
        *cache.thread.lock() = Some(thread);
        cache
    }

    fn run(&self, pool: &Pool) {
        loop {
            let took = match self.compute(pool) {
                Ok(c) => c.took,
                Err(e) => {
                    tracing::warn!("space breakdown: {e}");
                    Duration::ZERO
                }
            };
            let wait = INTERVAL_MIN.max(took * SPACING);
            let deadline = Instant::now() + wait;
            let mut s = self.shared.lock();
            while !s.stop && Instant::now() < deadline {
                self.wake.wait_until(&mut s, deadline);
            }
            if s.stop {
                return;
            }
        }
    }

    /// Computes the figures now (the caller's thread) and keeps them.
    pub fn compute(&self, pool: &Pool) -> ibid_engine::Result<Arc<Computed>> {
        let started = Instant::now();
        match pool.space_breakdown() {
            Ok(b) => {
                let volumes = b
                    .volumes
                    .iter()
                    .map(|v| {
                        let figures = (
                            v.id,
                            v.exclusive_blocks,
                            v.shared_blocks,
                            v.exclusive_physical_bytes,
                        );
                        (v.name.clone(), figures)
                    })
                    .collect();
                let c = Arc::new(Computed {
                    breakdown: b,
                    volumes,
                    at_unix_s: now_unix_s(),
                    took: started.elapsed(),
                });
                let mut s = self.shared.lock();
                s.last = Some(c.clone());
                s.error = None;
                Ok(c)
            }
            Err(e) => {
                self.shared.lock().error = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// The last result, if any.
    pub fn last(&self) -> Option<Arc<Computed>> {
        self.shared.lock().last.clone()
    }

    /// Stops the thread and waits for it (a computation under way finishes first).
    pub fn stop(&self) {
        self.shared.lock().stop = true;
        self.wake.notify_all();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }

    /// The `breakdown` object of `GET /api/v1/pool`: null before the first computation.
    pub fn json(&self) -> Value {
        let s = self.shared.lock();
        match &s.last {
            None => Value::Null,
            Some(c) => computed_json(c, s.error.as_deref()),
        }
    }
}

/// A result as the API shows it.
pub fn computed_json(c: &Computed, error: Option<&str>) -> Value {
    let b = &c.breakdown;
    json!({
        "unique_physical_bytes": b.unique_physical_bytes,
        "unique_chunks": b.unique_chunks,
        "shared_physical_bytes": b.shared_physical_bytes,
        "shared_chunks": b.shared_chunks,
        "snapshot_only_physical_bytes": b.snapshot_only_physical_bytes,
        "snapshot_only_chunks": b.snapshot_only_chunks,
        "computed_unix_s": c.at_unix_s,
        "age_s": now_unix_s().saturating_sub(c.at_unix_s),
        "took_ms": c.took.as_secs_f64() * 1000.0,
        "error": error,
    })
}
