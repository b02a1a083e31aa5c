//! The accept loop: one task per connection, a bound on connections, graceful shutdown.

use crate::export::Exports;
use crate::handshake::{self, Context};
use crate::tls::{TlsConfig, TlsConfigError};
use crate::transmission;
use crate::workers::{Workers, WORKERS_DEFAULT};
use crate::BoxStream;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info, warn, Instrument};

/// Default bound on concurrent connections; more are accepted and closed at once.
pub const CONNECTIONS_MAX: usize = 1024;
/// Default time a client has to finish option haggling.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for connections to finish their in-flight requests.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(100);

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// TLS material and mode; `None` serves plain NBD only (STARTTLS answered `ERR_UNSUP`).
    pub tls: Option<TlsConfig>,
    /// Time allowed for the handshake phase.
    pub handshake_timeout: Duration,
    /// Bound on concurrent connections.
    pub connections_max: usize,
    /// Threads that run backend calls, shared by all connections.
    pub workers: usize,
    /// Run the writes the backend calls quick ([`crate::Export::write_is_quick`]) on the
    /// connection's task instead of a worker thread.
    pub quick_writes_inline: bool,
    /// Try reads of up to [`crate::INLINE_READ_BYTES_MAX`] on the connection's task first
    /// ([`crate::Export::read_if_cached`]); only those that would wait go to a worker thread.
    pub cached_reads_inline: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            tls: None,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            connections_max: CONNECTIONS_MAX,
            workers: WORKERS_DEFAULT,
            quick_writes_inline: true,
            cached_reads_inline: true,
        }
    }
}

/// Why the server could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The TLS configuration is unusable.
    #[error(transparent)]
    Tls(#[from] TlsConfigError),
    /// The worker threads could not be started.
    #[error("start NBD worker threads: {0}")]
    Workers(std::io::Error),
}

/// Serves `exports` on `listener` forever (see [`serve_until`]).
pub async fn serve(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    config: ServerConfig,
) -> Result<(), ServeError> {
    serve_until(listener, exports, config, std::future::pending()).await
}

/// Serves `exports` on `listener` until `shutdown` completes; then stops accepting, lets each
/// connection finish its in-flight requests (up to [`SHUTDOWN_GRACE`]) and returns.
pub async fn serve_until(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let tls = config.tls.as_ref().map(TlsConfig::acceptor).transpose()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let ctx = Arc::new(Context {
        exports,
        tls_required: config.tls.as_ref().is_some_and(|t| t.required),
        tls,
        stop: stop_rx,
    });
    let workers = Arc::new(
        Workers::start(
            config.workers,
            config.quick_writes_inline,
            config.cached_reads_inline,
        )
        .map_err(ServeError::Workers)?,
    );
    let slots = Arc::new(Semaphore::new(config.connections_max));
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            accepted = listener.accept() => {
                let (sock, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        warn!("accept NBD connection: {e}");
                        tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    warn!(%peer, "refusing NBD connection: {} connections open", config.connections_max);
                    continue;
                };
                if let Err(e) = sock.set_nodelay(true) {
                    debug!(%peer, "set TCP_NODELAY: {e}");
                }
                let ctx = ctx.clone();
                let workers = workers.clone();
                let timeout = config.handshake_timeout;
                let span = tracing::info_span!("nbd", %peer);
                tasks.spawn(async move {
                    connection(Box::new(sock), peer, ctx, &workers, timeout).await;
                    drop(slot);
                }.instrument(span));
            }
        }
    }
    info!("NBD server shutting down: {} connections open", tasks.len());
    // The receivers live in `ctx`, which outlives this send.
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(
            "NBD shutdown: aborting {} connections after the grace period",
            tasks.len()
        );
        tasks.abort_all();
    }
    Ok(())
}

/// One client connection from accept to close. Every error ends only this connection.
async fn connection(
    stream: BoxStream,
    peer: std::net::SocketAddr,
    ctx: Arc<Context>,
    workers: &Workers,
    handshake_timeout: Duration,
) {
    let negotiated = tokio::time::timeout(handshake_timeout, handshake::negotiate(stream, &ctx));
    let mut stop = ctx.stop.clone();
    let negotiated = tokio::select! {
        n = negotiated => n,
        _ = stop.wait_for(|stopped| *stopped) => {
            debug!("server stopping: closing NBD connection in handshake");
            return;
        }
    };
    let (stream, session) = match negotiated {
        Err(_) => {
            warn!("closing NBD connection: handshake took longer than {handshake_timeout:?}");
            return;
        }
        Ok(Err(e)) => {
            warn!("closing NBD connection during handshake: {e}");
            return;
        }
        Ok(Ok(None)) => {
            debug!("NBD client ended the handshake");
            return;
        }
        Ok(Ok(Some(entered))) => entered,
    };
    info!(export = %session.name, mode = ?session.mode, flags = format_args!("{:#x}", session.flags), "NBD transmission started");
    // Held until the connection ends: the backend sees it as connected while it lives.
    let client = Arc::new(crate::export::Client { peer });
    ctx.exports.connected(&session.name, &client);
    match transmission::run(stream, session, workers, ctx.stop.clone()).await {
        Ok(()) => debug!("NBD connection closed"),
        Err(e) => warn!("closing NBD connection: {e}"),
    }
}
