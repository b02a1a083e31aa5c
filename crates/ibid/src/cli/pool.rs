//! `ibid pool ...`: where every byte went (`stats`) and the pool's settings (`set`).

use super::error::CliError;
use super::output::{print_fields, print_json, size, u64_field};
use super::Ctx;
use crate::units::parse_size;
use clap::Subcommand;
use serde_json::{json, Value};

/// Pool commands.
#[derive(Subcommand)]
pub enum PoolCmd {
    /// Show the pool's capacity, use, reservations and data reduction.
    Stats,
    /// Change the pool's capacity or soft threshold, e.g. `--capacity 1T --soft-threshold 85`.
    Set {
        /// New capacity with a unit, e.g. 1T.
        #[arg(long, value_parser = parse_size)]
        capacity: Option<u64>,
        /// Use (percent of capacity) above which the pool warns.
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100))]
        soft_threshold: Option<u8>,
    },
}

/// Runs a pool command.
pub fn run(ctx: &Ctx, cmd: PoolCmd) -> Result<(), CliError> {
    let stats = match cmd {
        PoolCmd::Stats => ctx.client.get("/pool", "reading pool statistics")?,
        PoolCmd::Set {
            capacity,
            soft_threshold,
        } => {
            if capacity.is_none() && soft_threshold.is_none() {
                return Err(CliError::usage(
                    "nothing to set: give --capacity and/or --soft-threshold",
                ));
            }
            let mut body = json!({});
            if let Some(c) = capacity {
                body["capacity"] = c.into();
            }
            if let Some(p) = soft_threshold {
                body["soft_threshold_pct"] = p.into();
            }
            ctx.client.patch("/pool", body, "changing pool settings")?
        }
    };
    if ctx.json {
        print_json(&stats);
        return Ok(());
    }
    print_stats(&stats)
}

fn print_stats(s: &Value) -> Result<(), CliError> {
    let bytes = |key: &str| u64_field(s, key).map(size);
    let capacity = u64_field(s, "capacity_bytes")?;
    let used = u64_field(s, "used_bytes")?;
    let pct = |n: u64| {
        if capacity == 0 {
            0.0
        } else {
            n as f64 * 100.0 / capacity as f64
        }
    };
    let threshold = format!(
        "{}%{}",
        u64_field(s, "soft_threshold_pct")?,
        if s["soft_threshold_exceeded"].as_bool() == Some(true) {
            " (EXCEEDED)"
        } else {
            ""
        }
    );
    print_fields(&[
        ("capacity", size(capacity)),
        ("used", format!("{} ({:.1}%)", size(used), pct(used))),
        ("free", bytes("free_bytes")?),
        ("soft threshold", threshold),
        ("volumes", u64_field(s, "volumes")?.to_string()),
        ("provisioned", bytes("provisioned_bytes")?),
        ("thick provisioned", bytes("thick_provisioned_bytes")?),
        (
            "reserved",
            format!(
                "{} ({} of it overwrite headroom)",
                bytes("reserved_bytes")?,
                bytes("overwrite_headroom_bytes")?
            ),
        ),
        ("logical written", bytes("logical_written_bytes")?),
        (
            "unique",
            format!(
                "{} ({} chunks)",
                bytes("unique_bytes")?,
                u64_field(s, "unique_chunks")?
            ),
        ),
        ("physical", bytes("physical_bytes")?),
        ("metadata", bytes("metadata_bytes")?),
        ("segment files", bytes("segment_file_bytes")?),
        ("garbage", bytes("garbage_bytes")?),
        (
            "data reduction",
            format!("{:.2}:1", s["data_reduction_ratio"].as_f64().unwrap_or(1.0)),
        ),
        ("dedup filter RAM", bytes("dedup_filter_ram_bytes")?),
        ("layer filter RAM", bytes("layer_filter_ram_bytes")?),
    ]);
    Ok(())
}
