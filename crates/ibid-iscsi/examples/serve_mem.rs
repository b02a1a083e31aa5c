//! Serve in-memory LUNs 0 and 1 (and 2, read-only) for manual testing:
//! `cargo run -p ibid-iscsi --example serve_mem -- 127.0.0.1:3260 64`
//! (address, LUN size in MiB). Target IQN `iqn.2026-11.org.ibid:mem`.

use ibid_iscsi::memory::MemLuns;
use ibid_iscsi::{serve, TargetConfig};
use std::sync::Arc;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:3260".into());
    let mib: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let mut luns = MemLuns::new(8 << 30, 80);
    luns.add(0, mib << 20, false);
    luns.add(1, mib << 20, false);
    luns.add(2, mib << 20, true);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    eprintln!(
        "serving iqn.2026-11.org.ibid:mem on {}",
        listener.local_addr()?
    );
    serve(
        listener,
        Arc::new(luns),
        TargetConfig::new("iqn.2026-11.org.ibid:mem"),
    )
    .await
}
