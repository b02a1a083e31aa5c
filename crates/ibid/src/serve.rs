//! `ibid serve`: open (or create) a pool and serve its volumes until SIGINT or SIGTERM.

use crate::iscsi_luns::PoolLuns;
use crate::metrics::Metrics;
use crate::nbd_exports::PoolExports;
use crate::units::format_size;
use anyhow::Context;
use ibid_engine::{Pool, PoolConfig};
use std::collections::HashSet;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// What `ibid serve` needs to start.
pub struct ServeOptions {
    /// Pool directory.
    pub data: PathBuf,
    /// Capacity of a new pool (default: the filesystem's free space less a reserve for metadata).
    pub capacity: Option<u64>,
    /// Accept a `capacity` larger than the filesystem has available.
    pub capacity_force: bool,
    /// NBD listen address.
    pub nbd: SocketAddr,
    /// iSCSI listen address (`None`: no iSCSI target).
    pub iscsi: Option<SocketAddr>,
    /// iSCSI target name.
    pub iqn: String,
    /// HTTP API listen address (`None`: no API).
    pub http: Option<SocketAddr>,
    /// Bearer token the API requires (mandatory off loopback).
    pub api_token: Option<String>,
    /// Host names the HTTP listener answers besides its own address (`--http-allowed-host`).
    pub http_allowed_hosts: Vec<String>,
    /// Volumes to create if missing: (name, size).
    pub volumes: Vec<(String, u64)>,
    /// Create `disk0` (16 GiB, thin) in a new, empty pool.
    pub default_volume: bool,
    /// TLS for NBD, if configured.
    pub nbd_tls: Option<ibid_nbd::TlsConfig>,
    /// Threads that run NBD requests.
    pub nbd_workers: usize,
    /// Run small NBD writes that will not wait on their connection's task.
    pub nbd_inline_writes: bool,
    /// Answer small NBD reads from memory on their connection's task when they can.
    pub nbd_inline_reads: bool,
    /// Threads of the async runtime (sockets of every protocol; see [`io_threads_default`]).
    pub io_threads: usize,
    /// How long the API waits for a request's headers, and then for its body.
    pub http_timeout: Duration,
    /// Most bytes per second the background scrub reads.
    pub scrub_rate: u64,
    /// Time between the starts of scrub passes (`None`: only when asked).
    pub scrub_every: Option<Duration>,
    /// Memory for the engine's read cache (0: none).
    pub read_cache_bytes: u64,
}

/// The async runtime's default size: a quarter of the cores, at least one. Its threads move
/// bytes between sockets and buffers, hand requests on and run the small NBD writes that
/// will not wait (the blocking backend calls run on the NBD workers and, for iSCSI and the
/// API, on tokio's blocking pool), so a few keep up with many connections; each extra one
/// costs wake-ups, as the scheduler wakes idle threads to steal every task it queues (on 2
/// cores, one thread serves 4 KiB random reads and QD1 writes better than two:
/// docs/benchmarks/nbd-fio.md).
pub fn io_threads_default() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
}

/// Name and size of the volume a fresh pool gets so that the first run is usable at once.
pub const DEFAULT_VOLUME: (&str, u64) = ("disk0", 16 << 30);

/// How long the start waits for instant restores to resume before it serves without them.
const RESUME_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Runs the server until a shutdown signal, then closes the pool cleanly. Everything that can
/// be checked before the pool is touched is: the listen addresses are bound first, so a port in
/// use fails the start before the pool is opened or created, and a start that fails after
/// creating a new pool removes it again.
pub fn run(opts: ServeOptions) -> anyhow::Result<()> {
    if let Some(addr) = opts.http {
        if !addr.ip().is_loopback() && opts.api_token.is_none() {
            anyhow::bail!(
                "the API on {addr} would be reachable from other hosts: give it a bearer \
                 token (--api-token or IBID_API_TOKEN), or listen on a loopback address"
            );
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.io_threads.max(1))
        .enable_all()
        .thread_name("ibid-io")
        .build()?;
    let listeners = runtime.block_on(Listeners::bind(&opts))?;
    let new_dir = NewPoolDir::note(&opts.data);
    let pool = match open_pool(&opts, new_dir.is_some()) {
        Ok(pool) => pool,
        Err(e) => {
            if let Some(new_dir) = new_dir {
                new_dir.remove();
            }
            return Err(e);
        }
    };
    let scrubber = crate::scrub::Scrubber::start(pool.clone(), opts.scrub_rate, opts.scrub_every);
    let space = crate::space::SpaceCache::start(pool.clone());
    let result = runtime.block_on(serve(
        pool.clone(),
        &opts,
        listeners,
        scrubber.clone(),
        space.clone(),
    ));
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    scrubber.stop();
    space.stop();
    pool.close().context("close pool")?;
    result
}

/// Opens (or creates) the pool and creates the volumes asked for; on failure a pool created
/// here is closed again.
fn open_pool(opts: &ServeOptions, fresh: bool) -> anyhow::Result<Pool> {
    let config = PoolConfig {
        capacity_bytes: opts.capacity,
        capacity_force: opts.capacity_force,
        read_cache_bytes: opts.read_cache_bytes,
        ..PoolConfig::default()
    };
    let pool = Pool::open_or_create(&opts.data, config)
        .with_context(|| format!("open pool in {}", opts.data.display()))?;
    let mut volumes = opts.volumes.clone();
    if fresh && opts.default_volume && volumes.is_empty() {
        volumes.push((DEFAULT_VOLUME.0.to_string(), DEFAULT_VOLUME.1));
    }
    for (name, size) in &volumes {
        if pool.volume(name).is_err() {
            if let Err(e) = pool.create_volume(name, *size) {
                let _ = pool.close();
                return Err(anyhow::Error::new(e).context(format!("create volume {name}")));
            }
        }
    }
    Ok(pool)
}

/// A pool directory holding no pool yet, as it was before `serve` created one in it: removed
/// again if the start fails.
struct NewPoolDir {
    dir: PathBuf,
    /// What the directory held before (`None`: it did not exist).
    entries: Option<HashSet<OsString>>,
}

impl NewPoolDir {
    /// `Some` if `dir` holds no pool, noting what it holds (`None` too if `dir` is something
    /// other than a directory: opening the pool fails on it, and it is not ours to remove).
    fn note(dir: &Path) -> Option<NewPoolDir> {
        if ibid_engine::store::exists(dir) || (dir.exists() && !dir.is_dir()) {
            return None;
        }
        let entries = std::fs::read_dir(dir).ok().map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.file_name()))
                .collect()
        });
        Some(NewPoolDir {
            dir: dir.to_path_buf(),
            entries,
        })
    }

    /// Removes what the failed start created: the directory, or the files added to it.
    fn remove(self) {
        let removed = match &self.entries {
            None => std::fs::remove_dir_all(&self.dir),
            Some(before) => std::fs::read_dir(&self.dir).and_then(|entries| {
                for e in entries.flatten() {
                    if !before.contains(&e.file_name()) {
                        let path = e.path();
                        if path.is_dir() {
                            std::fs::remove_dir_all(&path)?;
                        } else {
                            std::fs::remove_file(&path)?;
                        }
                    }
                }
                Ok(())
            }),
        };
        if let Err(e) = removed {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!(
                    "ibid: could not remove the new pool in {}: {e}",
                    self.dir.display()
                );
            }
        }
    }
}

/// The sockets `serve` listens on, bound before the pool is opened.
struct Listeners {
    nbd: TcpListener,
    iscsi: Option<TcpListener>,
    http: Option<TcpListener>,
}

impl Listeners {
    async fn bind(opts: &ServeOptions) -> anyhow::Result<Listeners> {
        let nbd = TcpListener::bind(opts.nbd)
            .await
            .with_context(|| format!("listen for NBD on {}", opts.nbd))?;
        let iscsi = match opts.iscsi {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listen for iSCSI on {addr}"))?,
            ),
            None => None,
        };
        let http = match opts.http {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listen for HTTP on {addr}"))?,
            ),
            None => None,
        };
        Ok(Listeners { nbd, iscsi, http })
    }
}

async fn serve(
    pool: Pool,
    opts: &ServeOptions,
    listeners: Listeners,
    scrubber: Arc<crate::scrub::Scrubber>,
    space: Arc<crate::space::SpaceCache>,
) -> anyhow::Result<()> {
    let Listeners {
        nbd: nbd_listener,
        iscsi: iscsi_listener,
        http: http_listener,
    } = listeners;
    let nbd_addr = nbd_listener.local_addr()?;
    let iscsi_addr = iscsi_listener
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?;
    let http_addr = http_listener.as_ref().map(|l| l.local_addr()).transpose()?;
    let signalled = shutdown_signal();
    let lun_map = Arc::new(crate::lun_map::LunMap::open(&pool)?);
    let metrics = Arc::new(Metrics::default());
    let qos = Arc::new(crate::qos::Qos::open(&pool)?);
    let remotes = Arc::new(crate::remotes::Remotes::open(&pool)?);
    let schedules = Arc::new(crate::schedules::Schedules::open(&pool)?);
    let offload_stats = Arc::new(crate::metrics::OffloadStats::default());
    let jobs = Arc::new(crate::jobs::Jobs::open(&pool)?);
    let instants = Arc::new(crate::instant_restores::InstantRestores::open(&pool)?);
    // Volumes restored instantly are served once their restores run again (a remote that
    // does not answer keeps them unreachable, retried in the background).
    instants.resume(&pool, &remotes, &jobs, &offload_stats);
    instants.wait_resumed(RESUME_WAIT).await;
    crate::remotes::Offload {
        pool: pool.clone(),
        remotes: remotes.clone(),
        stats: offload_stats.clone(),
        jobs: jobs.clone(),
    }
    .resume_interrupted()
    .await;
    print_banner(&pool, &lun_map, opts, nbd_addr, iscsi_addr, http_addr);
    let clients = Arc::new(crate::clients::Clients::default());
    let gates = Arc::new(crate::copy_gates::CopyGates::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    {
        let jobs = jobs.clone();
        tokio::spawn(async move {
            signalled.await;
            jobs.stop();
            let _ = stop_tx.send(true);
        });
    }
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&stop| stop).await;
    };
    let iscsi = async {
        match iscsi_listener {
            Some(listener) => {
                let luns = Arc::new(PoolLuns::new(
                    pool.clone(),
                    metrics.clone(),
                    clients.clone(),
                    qos.clone(),
                    lun_map.clone(),
                    gates.clone(),
                    instants.clone(),
                ));
                let config = ibid_iscsi::TargetConfig {
                    state_dir: Some(pool.dir().to_path_buf()),
                    ..ibid_iscsi::TargetConfig::new(opts.iqn.clone())
                };
                ibid_iscsi::serve_until(listener, luns, config, stopped(stop_rx.clone()))
                    .await
                    .context("iSCSI target")
            }
            None => Ok(()),
        }
    };
    let exports = Arc::new(PoolExports::new(
        pool.clone(),
        metrics.clone(),
        clients.clone(),
        qos.clone(),
        gates.clone(),
        instants.clone(),
    ));
    let nbd_config = ibid_nbd::ServerConfig {
        tls: opts.nbd_tls.clone(),
        workers: opts.nbd_workers,
        quick_writes_inline: opts.nbd_inline_writes,
        cached_reads_inline: opts.nbd_inline_reads,
        ..ibid_nbd::ServerConfig::default()
    };
    let nbd = async {
        ibid_nbd::serve_until(nbd_listener, exports, nbd_config, stopped(stop_rx.clone()))
            .await
            .context("NBD server")
    };
    let access = match &opts.api_token {
        Some(t) => crate::api::Access::token(t),
        None => crate::api::Access::default(),
    };
    tokio::spawn(
        crate::schedules::Runner {
            pool: pool.clone(),
            schedules: schedules.clone(),
            remotes: remotes.clone(),
            clients: clients.clone(),
            luns: lun_map.clone(),
            stats: offload_stats.clone(),
            instants: instants.clone(),
        }
        .run(stop_rx.clone()),
    );
    // The charts' history, sampled only when there is an API to serve it.
    let history = Arc::new(crate::history::History::default());
    if http_addr.is_some() {
        tokio::spawn(history.clone().run(metrics.clone(), stop_rx.clone()));
    }
    let server_info = Arc::new(crate::api::ServerInfo {
        version: env!("CARGO_PKG_VERSION"),
        nbd: nbd_addr.to_string(),
        iscsi: iscsi_addr.map(|a| a.to_string()),
        iqn: opts.iqn.clone(),
    });
    let http = async {
        match (http_listener, http_addr) {
            (Some(listener), Some(addr)) => {
                let hosts = Arc::new(crate::web::security::Hosts::new(
                    addr,
                    &opts.http_allowed_hosts,
                ));
                let app = crate::web::router()
                    .merge(crate::api::router(
                        pool.clone(),
                        clients.clone(),
                        qos.clone(),
                        lun_map.clone(),
                        instants.clone(),
                        access,
                        opts.http_timeout,
                    ))
                    .layer(axum::Extension(metrics.clone()))
                    .layer(axum::Extension(qos.clone()))
                    .layer(axum::Extension(remotes.clone()))
                    .layer(axum::Extension(schedules.clone()))
                    .layer(axum::Extension(offload_stats.clone()))
                    .layer(axum::Extension(jobs.clone()))
                    .layer(axum::Extension(instants.clone()))
                    .layer(axum::Extension(scrubber.clone()))
                    .layer(axum::Extension(space.clone()))
                    .layer(axum::Extension(history.clone()))
                    .layer(axum::Extension(server_info.clone()))
                    .layer(axum::middleware::from_fn_with_state(
                        hosts,
                        crate::web::security::guard,
                    ));
                serve_http(listener, app, opts.http_timeout, stop_rx.clone()).await;
                Ok(())
            }
            _ => Ok(()),
        }
    };
    // If any server fails, stop the others too: a half-serving array is worse than none.
    tokio::try_join!(nbd, iscsi, http)?;
    tracing::info!("shutting down");
    // What restores fetched and hosts wrote stays, with the marks that say so.
    let flushing = instants.clone();
    let _ = tokio::task::spawn_blocking(move || flushing.stop_all()).await;
    Ok(())
}

/// Serves the API over HTTP/1.1 until `stop`: a client gets `timeout` to send a request's
/// headers (hyper closes the connection after that) and again for its body
/// ([`crate::api`] answers 408), so stalled clients cannot pile up. At stop, requests in flight
/// get a few seconds to finish.
async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            () = stopped(&mut stop) => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (sock, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!("accept HTTP connection: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let service = hyper_util::service::TowerToHyperService::new(app.clone());
                let mut stop = stop.clone();
                connections.spawn(async move {
                    let mut builder = hyper::server::conn::http1::Builder::new();
                    builder
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(timeout);
                    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(sock), service);
                    tokio::pin!(conn);
                    tokio::select! {
                        r = conn.as_mut() => {
                            if let Err(e) = r {
                                tracing::debug!(%peer, "HTTP connection: {e}");
                            }
                        }
                        () = stopped(&mut stop) => {
                            conn.as_mut().graceful_shutdown();
                            let _ = conn.await;
                        }
                    }
                });
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

/// Completes once `stop` is set (holding no borrow of it).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|&s| s).await;
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM. The handlers are installed when this is called, not
/// when the future first runs: call it before announcing the server, so that a signal sent as
/// soon as the banner appears stops it cleanly instead of killing it.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let install = |kind: SignalKind, name: &str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!("install {name} handler: {e}");
            None
        }
    };
    let term = install(SignalKind::terminate(), "SIGTERM");
    let int = install(SignalKind::interrupt(), "SIGINT");
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = wait(int) => {}
            () = wait(term) => {}
        }
    }
}

fn print_banner(
    pool: &Pool,
    luns: &crate::lun_map::LunMap,
    opts: &ServeOptions,
    nbd: SocketAddr,
    iscsi: Option<SocketAddr>,
    http: Option<SocketAddr>,
) {
    let stats = pool.stats();
    println!(
        "ibid serving pool {} ({} capacity, {} used)",
        opts.data.display(),
        format_size(stats.capacity_bytes),
        format_size(stats.used_bytes)
    );
    println!("  NBD   nbd://{nbd}/VOLUME");
    if let Some(http) = http {
        println!("  web   http://{http}/   (dashboard)");
        println!("  API   http://{http}/api/v1/   e.g.  curl http://{http}/api/v1/pool");
        println!("  metrics http://{http}/metrics   (Prometheus)");
    }
    if let Some(iscsi) = iscsi {
        println!(
            "  iSCSI iscsi://{iscsi}/{}/LUN   (target {}; LUNs: ibid volume list)",
            opts.iqn, opts.iqn
        );
    }
    let volumes = pool.list_volumes_now();
    if volumes.is_empty() {
        println!("  no volumes yet: create one with  ibid volume create vm1 --size 50G");
    }
    for v in &volumes {
        let lun = luns
            .lun_of_volume(v.id)
            .map_or_else(|| "-".to_string(), |l| l.to_string());
        println!(
            "  volume {:<20} {:>10}  iSCSI LUN {:<4}  e.g.  nbdinfo nbd://{nbd}/{}",
            v.name,
            format_size(v.size_bytes),
            lun,
            v.name
        );
    }
    for m in luns.list().iter().filter(|m| m.snapshot.is_some()) {
        println!(
            "  snapshot {:<18} read-only   iSCSI LUN {}",
            m.name(),
            m.lun
        );
    }
    if let Some(v) = volumes.first() {
        println!("  try:  qemu-img info nbd://{nbd}/{}", v.name);
    }
    println!("Ctrl-C stops the server; the pool is closed cleanly.");
}
