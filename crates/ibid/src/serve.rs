//! `ibid serve`: open (or create) a pool and serve its volumes until SIGINT or SIGTERM.

use crate::iscsi_luns::PoolLuns;
use crate::metrics::Metrics;
use crate::nbd_exports::PoolExports;
use crate::units::format_size;
use anyhow::Context;
use ibid_engine::{Pool, PoolConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// What `ibid serve` needs to start.
pub struct ServeOptions {
    /// Pool directory.
    pub data: PathBuf,
    /// Capacity of a new pool (default: the filesystem's free space).
    pub capacity: Option<u64>,
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
    /// Threads of the async runtime (sockets of every protocol; see [`io_threads_default`]).
    pub io_threads: usize,
}

/// The async runtime's default size: a quarter of the cores, at least one. Its threads move
/// bytes between sockets and buffers, hand requests on and run the small NBD writes that
/// will not wait (the blocking backend calls run on the NBD workers and, for iSCSI and the
/// API, on tokio's blocking pool), so a few keep up with many connections; each extra one costs wake-ups, as the scheduler wakes idle
/// threads to steal every task it queues. On 2 cores one thread instead of two: NBD 4 KiB
/// random reads at QD32 +7–18 % (4 alternating pairs) with less CPU per read, QD1 write
/// latency p50 50 → 25 µs, random and 1 MiB sequential writes unchanged
/// (docs/benchmarks/nbd-fio.md, session 15).
pub fn io_threads_default() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
}

/// Name and size of the volume a fresh pool gets so that the first run is usable at once.
pub const DEFAULT_VOLUME: (&str, u64) = ("disk0", 16 << 30);

/// Runs the server until a shutdown signal, then closes the pool cleanly.
pub fn run(opts: ServeOptions) -> anyhow::Result<()> {
    let fresh = !ibid_engine::store::exists(&opts.data);
    let config = PoolConfig {
        capacity_bytes: opts.capacity,
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
            pool.create_volume(name, *size)
                .with_context(|| format!("create volume {name}"))?;
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.io_threads.max(1))
        .enable_all()
        .thread_name("ibid-io")
        .build()?;
    let result = runtime.block_on(serve(pool.clone(), &opts));
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    pool.close().context("close pool")?;
    result
}

async fn serve(pool: Pool, opts: &ServeOptions) -> anyhow::Result<()> {
    let nbd_listener = tokio::net::TcpListener::bind(opts.nbd)
        .await
        .with_context(|| format!("listen for NBD on {}", opts.nbd))?;
    let nbd_addr = nbd_listener.local_addr()?;
    let iscsi_listener = match opts.iscsi {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listen for iSCSI on {addr}"))?,
        ),
        None => None,
    };
    let iscsi_addr = iscsi_listener
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?;
    let http_listener = match opts.http {
        Some(addr) => {
            if !addr.ip().is_loopback() && opts.api_token.is_none() {
                anyhow::bail!(
                    "the API on {addr} would be reachable from other hosts: give it a bearer \
                     token (--api-token or IBID_API_TOKEN), or listen on a loopback address"
                );
            }
            Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listen for HTTP on {addr}"))?,
            )
        }
        None => None,
    };
    let http_addr = http_listener.as_ref().map(|l| l.local_addr()).transpose()?;
    print_banner(&pool, opts, nbd_addr, iscsi_addr, http_addr);
    let metrics = Arc::new(Metrics::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&stop| stop).await;
    };
    let iscsi = async {
        match iscsi_listener {
            Some(listener) => {
                let luns = Arc::new(PoolLuns::new(pool.clone(), metrics.clone()));
                let config = ibid_iscsi::TargetConfig::new(opts.iqn.clone());
                ibid_iscsi::serve_until(listener, luns, config, stopped(stop_rx.clone()))
                    .await
                    .context("iSCSI target")
            }
            None => Ok(()),
        }
    };
    let exports = Arc::new(PoolExports::new(pool.clone(), metrics.clone()));
    let nbd_config = ibid_nbd::ServerConfig {
        tls: opts.nbd_tls.clone(),
        workers: opts.nbd_workers,
        quick_writes_inline: opts.nbd_inline_writes,
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
    let http = async {
        match http_listener {
            Some(listener) => {
                let app = crate::api::router(pool.clone(), access)
                    .layer(axum::Extension(metrics.clone()));
                axum::serve(listener, app)
                    .with_graceful_shutdown(stopped(stop_rx.clone()))
                    .await
                    .context("HTTP API")
            }
            None => Ok(()),
        }
    };
    // If any server fails, stop the others too: a half-serving array is worse than none.
    tokio::try_join!(nbd, iscsi, http)?;
    tracing::info!("shutting down");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("install SIGTERM handler: {e}");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn print_banner(
    pool: &Pool,
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
        println!("  API   http://{http}/api/v1/   e.g.  curl http://{http}/api/v1/pool");
        println!("  metrics http://{http}/metrics   (Prometheus)");
    }
    if let Some(iscsi) = iscsi {
        println!(
            "  iSCSI iscsi://{iscsi}/{}/LUN   (target {}; LUN = volume id - 1)",
            opts.iqn, opts.iqn
        );
    }
    let volumes = pool.list_volumes_now();
    if volumes.is_empty() {
        println!("  no volumes yet: create one with  ibid volume create vm1 --size 50G");
    }
    for v in &volumes {
        println!(
            "  volume {:<20} {:>10}  iSCSI LUN {:<4}  e.g.  nbdinfo nbd://{nbd}/{}",
            v.name,
            format_size(v.size_bytes),
            v.id - 1,
            v.name
        );
    }
    if let Some(v) = volumes.first() {
        println!("  try:  qemu-img info nbd://{nbd}/{}", v.name);
    }
    println!("Ctrl-C stops the server; the pool is closed cleanly.");
}
