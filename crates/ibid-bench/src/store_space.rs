//! `ibid-bench store-space FILE`: where the bytes of a pool's metadata store go, per table
//! (rows, pages, bytes per row on disk) and for the whole file (pages redb allocated against
//! the file's length). Run it on a copy of `meta.redb`, or on a pool no server has open.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct StoreSpaceArgs {
    /// The store file (a pool's `meta.redb`).
    file: PathBuf,
    /// Divide the figures by this many blocks too (e.g. a volume's written blocks).
    #[arg(long)]
    per: Option<u64>,
}

pub fn store_space(a: &StoreSpaceArgs) -> Result<()> {
    let s = ibid_engine::store::redb::file_space(&a.file)
        .with_context(|| format!("measure {}", a.file.display()))?;
    let page = s.page_bytes;
    let per = |bytes: u64| match a.per {
        Some(n) if n > 0 => format!("{:>8.1}", bytes as f64 / n as f64),
        _ => String::new(),
    };
    println!(
        "{:<14} {:>10} {:>9} {:>7} {:>12} {:>12} {:>9}{}",
        "table",
        "rows",
        "leaves",
        "branch",
        "stored B",
        "fragmented B",
        "B/row",
        if a.per.is_some() { "  B/block" } else { "" }
    );
    for t in &s.tables {
        let on_disk = (t.leaf_pages + t.branch_pages) * page;
        println!(
            "{:<14} {:>10} {:>9} {:>7} {:>12} {:>12} {:>9.1}{}",
            t.name,
            t.rows,
            t.leaf_pages,
            t.branch_pages,
            t.stored_bytes,
            t.fragmented_bytes,
            on_disk as f64 / t.rows.max(1) as f64,
            per(on_disk)
        );
    }
    let allocated = s.allocated_pages * page;
    println!(
        "allocated {} pages = {} bytes{}; file {} bytes{} ({:.0} % allocated)",
        s.allocated_pages,
        allocated,
        per(allocated),
        s.file_bytes,
        per(s.file_bytes),
        100.0 * allocated as f64 / s.file_bytes.max(1) as f64
    );
    Ok(())
}
