//! ibid's iSCSI target: RFC 7143 transport with the SPC-4/SBC-3 command set
//! a VMware ESXi, Windows or Linux initiator expects from an all-flash array,
//! including the VAAI primitives (WRITE SAME, UNMAP, COMPARE AND WRITE,
//! EXTENDED COPY).
//!
//! The crate knows nothing of the engine: the `ibid` binary implements
//! [`Luns`] and [`Lun`] over engine volumes and calls [`serve`].
//!
//! Layout: [`pdu`] (framing, pure), [`text`] and [`login`] (negotiation and
//! CHAP), [`session`] (CmdSN windows, session registry), `connection`
//! (the per-connection state machine), [`scsi`] (CDB parsing and one module
//! per command family), [`sense`], and [`memory`] (an in-memory backend).

pub mod backend;
mod buffers;
pub mod config;
mod connection;
pub mod login;
pub mod memory;
pub mod pdu;
pub mod scsi;
pub mod sense;
pub mod session;
pub mod text;
mod workers;

pub use backend::{Direction, Extent, HeldData, Initiator, Lun, LunError, LunInfo, Luns};
pub use config::{ChapConfig, ConfigError, TargetConfig};
pub use scsi::BLOCK_SIZE;

use std::sync::Arc;
use tokio::net::TcpListener;
use tracing::{info, warn};

/// Serve the target on `listener` until the listener fails (or at once with
/// `InvalidInput` if [`TargetConfig::validate`] rejects `config`). Each accepted
/// connection runs in its own task; sessions share `luns` and the per-LUN
/// reservation state.
pub async fn serve(
    listener: TcpListener,
    luns: Arc<dyn Luns>,
    config: TargetConfig,
) -> std::io::Result<()> {
    serve_until(listener, luns, config, std::future::pending()).await
}

/// Like [`serve`], but returns once `shutdown` completes, after telling
/// every logged-in session's connection to close.
pub async fn serve_until(
    listener: TcpListener,
    luns: Arc<dyn Luns>,
    config: TargetConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    config
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let target = scsi::Target::open(luns, config.clone())?;
    let workers = workers::Workers::start(config.workers)?;
    let shared = Arc::new(connection::Shared {
        target,
        workers,
        cfg: config,
        registry: session::Registry::default(),
        conns: parking_lot::Mutex::new(Vec::new()),
    });
    info!(addr = ?listener.local_addr().ok(), target = %shared.cfg.target_name, "iSCSI target listening");
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => {
                info!("iSCSI target shutting down");
                shared.registry.kill_all();
                return Ok(());
            }
            a = listener.accept() => a,
        };
        let (sock, peer) = match accepted {
            Ok(x) => x,
            Err(e) if is_transient(&e) => {
                warn!(error = %e, "accept failed; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        tracing::debug!(?peer, "connection accepted");
        tokio::spawn(connection::run(sock, shared.clone()));
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || e.raw_os_error() == Some(24)
        || e.raw_os_error() == Some(23)
}
