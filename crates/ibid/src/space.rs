//! The pool's space by sharing (unique, shared, snapshot-only; `Pool::space_breakdown`),
//! kept up to date in the background: the computation walks every live volume's map, too
//! dear for every `GET /api/v1/pool`, so a thread recomputes it and the API shows the last
//! result with its age (`breakdown` in `GET /api/v1/pool`, per-volume `exclusive_blocks` and
//! `shared_blocks` in `GET /api/v1/volumes`). `POST /api/v1/pool/breakdown` recomputes now.
//!
//! The walk takes a core for seconds on a large pool (~1 s per 4 Mi mapped blocks here), so
//! the thread recomputes when the pool's I/O pauses ([`QUIET`]), at most every
//! [`INTERVAL_MIN`], and under I/O that never pauses only once the last result is
//! [`STALE_MAX`] old: an array busy serving its hosts does not spend a core on accounting
//! (it took a fifth of the server's CPU during a benchmark's random writes,
//! docs/BENCHMARKS.md, "The space breakdown off the I/O's time").

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
/// After that, the next computation waits until the pool has served no I/O for this long...
pub const QUIET: Duration = Duration::from_secs(2);
/// ...unless the last result is this old (I/O that never pauses).
pub const STALE_MAX: Duration = Duration::from_secs(15 * 60);

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
            let started = Instant::now();
            let took = match self.compute(pool) {
                Ok(c) => c.took,
                Err(e) => {
                    tracing::warn!("space breakdown: {e}");
                    Duration::ZERO
                }
            };
            let spaced = INTERVAL_MIN.max(took * SPACING);
            while let Some(wait) = next_wait(started.elapsed(), spaced, pool.idle_for()) {
                let mut s = self.shared.lock();
                if !s.stop {
                    self.wake.wait_for(&mut s, wait);
                }
                if s.stop {
                    return;
                }
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

/// How long the thread waits before it computes again (`None`: compute now), `since` the last
/// computation started, which asked for `spaced` between computations, when the pool's I/O
/// has been `idle` that long: the spacing, then a pause of [`QUIET`] in the I/O, or a result
/// [`STALE_MAX`] old.
fn next_wait(since: Duration, spaced: Duration, idle: Duration) -> Option<Duration> {
    if since < spaced {
        Some(spaced - since)
    } else if since >= STALE_MAX || idle >= QUIET {
        None
    } else {
        Some((QUIET - idle).min(STALE_MAX - since))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breakdown_waits_for_its_spacing_then_a_pause_in_the_io_or_staleness() {
        let s = Duration::from_secs;
        let spaced = INTERVAL_MIN;
        // Within the spacing: the rest of it, busy or not.
        assert_eq!(next_wait(s(10), spaced, s(100)), Some(spaced - s(10)));
        // Past it: at once when the I/O has paused...
        assert_eq!(next_wait(spaced, spaced, QUIET), None);
        // ...else until it could have, polling.
        assert_eq!(
            next_wait(spaced + s(1), spaced, Duration::from_millis(500)),
            Some(QUIET - Duration::from_millis(500))
        );
        assert_eq!(next_wait(s(300), spaced, Duration::ZERO), Some(QUIET));
        // Busy without a pause for STALE_MAX: at once anyway.
        assert_eq!(next_wait(STALE_MAX, spaced, Duration::ZERO), None);
        assert_eq!(
            next_wait(STALE_MAX - s(1), spaced, Duration::ZERO),
            Some(s(1))
        );
        // A slow computation's spacing (20 × its time) outlasts the staleness bound.
        assert_eq!(next_wait(STALE_MAX, s(1200), Duration::ZERO), Some(s(300)));
    }
}
