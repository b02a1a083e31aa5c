//! Serves one in-memory export over NBD, for manual tests and protocol-overhead benchmarks:
//! `cargo run --release -p ibid-nbd --example memserve -- 127.0.0.1:10809 disk 1073741824`.

use ibid_nbd::memory::{MemoryExport, MemoryExports};
use ibid_nbd::ServerConfig;
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:10809".into());
    let name = args.next().unwrap_or_else(|| "disk".into());
    let size: u64 = args.next().map_or(Ok(1 << 30), |s| s.parse())?;
    let exports = Arc::new(MemoryExports::new());
    exports.insert(&name, MemoryExport::new(size));
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        eprintln!("serving {name} ({size} bytes) on nbd://{addr}/{name}");
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        ibid_nbd::serve_until(listener, exports, ServerConfig::default(), stop).await?;
        Ok(())
    })
}
