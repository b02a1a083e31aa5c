//! ibid's NBD server.
//!
//! Serves [`Export`]s over the Network Block Device protocol (fixed newstyle handshake,
//! structured replies, extended headers, `base:allocation` block status, STARTTLS) to real
//! clients such as qemu, libnbd (nbdinfo, nbdcopy, nbdsh, nbdfuse) and fio.
//!
//! Modules, one responsibility each:
//! - [`wire`]: byte layouts, constants, pure parsers and encoders (fuzzed);
//! - [`export`]: the backend traits the `ibid` binary implements on engine volumes;
//! - [`memory`]: an in-memory backend for tests and fuzzing;
//! - `handshake`: the option-haggling state machine;
//! - `transmission`: request validation and the concurrent request loop of one connection;
//! - [`tls`]: STARTTLS: X.509 with rustls, pre-shared keys with OpenSSL;
//! - `server`: the accept loop, connection limits and shutdown;
//! - `workers`: the threads that run backend calls for all connections.
#![deny(missing_docs, clippy::unwrap_used)]

mod buffers;
pub mod export;
#[doc(hidden)]
pub mod fuzzing;
mod handshake;
pub mod memory;
mod server;
pub mod tls;
mod transmission;
pub mod wire;
mod workers;

pub use export::{
    Client, Direction, Export, ExportError, ExportInfo, Exports, Extent, BLOCK_SIZE_MIN,
    BLOCK_SIZE_PREFERRED, PAYLOAD_LEN_MAX,
};
pub use handshake::{OPTIONS_PER_HANDSHAKE_MAX, OPTION_DATA_LEN_MAX};
pub use server::{
    serve, serve_until, ServeError, ServerConfig, CONNECTIONS_MAX, HANDSHAKE_TIMEOUT,
    SHUTDOWN_GRACE,
};
pub use tls::{TlsConfig, TlsConfigError, TlsCredentials};
pub use transmission::{
    validate_request, INFLIGHT_BYTES_MAX, INFLIGHT_REQUESTS_MAX, INLINE_READ_BYTES_MAX,
};
pub use workers::{INLINE_SHARED_BYTES_MAX, WORKERS_DEFAULT};

use tokio::io::{AsyncRead, AsyncWrite};

/// A connection's byte stream: plain TCP, or TLS after `NBD_OPT_STARTTLS`.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// The boxed stream the state machines pass around (the type changes at STARTTLS).
pub(crate) type BoxStream = Box<dyn Stream>;
