//! `ibid pool ...`: where every byte went (`stats`), the pool's settings (`set`) and its
//! consistency check (`verify`, online through the API or offline on a stopped pool's
//! directory).

use super::error::{CliError, Exit};
use super::output::{print_fields, print_json, size, u64_field};
use super::Ctx;
use crate::units::parse_size;
use clap::Subcommand;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

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
        /// Accept a capacity larger than the filesystem under the pool can hold (the pool then
        /// promises space the filesystem may not have).
        #[arg(long, requires = "capacity")]
        force: bool,
    },
    /// Check the whole pool: every count recomputed, every live chunk read back against its
    /// fingerprint. Online through the server (its commits wait meanwhile), or with --data on
    /// a stopped pool's directory. Exit 8 if it finds damage.
    Verify {
        /// Verify the pool in this directory directly (the server must be stopped).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
    },
    /// Start a background scrub pass now (every stored chunk read back and checked against
    /// its checksum and fingerprint, at the server's --scrub-rate), or with --status show the
    /// current or last pass. Exit 8 if the pass found damage.
    Scrub {
        /// Only show the status.
        #[arg(long)]
        status: bool,
    },
}

/// Runs a pool command.
pub fn run(ctx: &Ctx, cmd: PoolCmd) -> Result<(), CliError> {
    let stats = match cmd {
        PoolCmd::Verify { data } => {
            let (answer, how) = match &data {
                Some(dir) => (verify_offline(dir)?, format!("offline, {}", dir.display())),
                None => (
                    ctx.client
                        .post("/pool/verify", json!({}), "verifying the pool")?,
                    "online".to_string(),
                ),
            };
            return print_verify(ctx, &answer, &how);
        }
        PoolCmd::Scrub { status } => {
            let answer = if status {
                ctx.client.get("/pool/scrub", "reading the scrub status")?
            } else {
                ctx.client
                    .post("/pool/scrub", json!({}), "starting a scrub pass")?
            };
            return print_scrub(ctx, &answer, !status);
        }
        PoolCmd::Stats => ctx.client.get("/pool", "reading pool statistics")?,
        PoolCmd::Set {
            capacity,
            soft_threshold,
            force,
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
            if force {
                body["force"] = true.into();
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

/// Opens the pool in `dir` (no background work) and checks it; the answer has the API's shape.
fn verify_offline(dir: &Path) -> Result<Value, CliError> {
    use ibid_engine::{Error, Pool, PoolConfig};
    let failed = |e: Error| CliError {
        code: "internal".into(),
        message: format!("pool in {}: {e}", dir.display()),
        exit: Exit::Failed,
    };
    if !ibid_engine::store::exists(dir) {
        return Err(CliError {
            code: "not_found".into(),
            message: format!("no pool in {}", dir.display()),
            exit: Exit::NotFound,
        });
    }
    let config = PoolConfig {
        background: false,
        ..PoolConfig::default()
    };
    let pool = Pool::open(dir, config).map_err(|e| match e {
        Error::Locked(_) => CliError {
            code: "in_use".into(),
            message: format!(
                "the pool in {} is open in a running server: verify it online (ibid pool \
                 verify, without --data), or stop the server first",
                dir.display()
            ),
            exit: Exit::Conflict,
        },
        e => failed(e),
    })?;
    let started = std::time::Instant::now();
    let result = pool.verify();
    let answer = crate::api::verify_answer(result, started.elapsed()).map_err(failed);
    pool.close().map_err(failed)?;
    answer
}

/// Prints a verify answer; damage is an error (exit 8) naming the problem.
fn print_verify(ctx: &Ctx, answer: &Value, how: &str) -> Result<(), CliError> {
    if answer["ok"].as_bool() != Some(true) {
        return Err(CliError {
            code: "damaged".into(),
            message: format!(
                "pool verify ({how}) found damage: {}",
                answer["problem"].as_str().unwrap_or("(no detail)")
            ),
            exit: Exit::Damaged,
        });
    }
    if ctx.json {
        print_json(answer);
        return Ok(());
    }
    println!(
        "pool verified ({how}) in {:.2} s: no problems found",
        answer["seconds"].as_f64().unwrap_or(0.0)
    );
    print_fields(&[
        (
            "volumes and snapshots",
            u64_field(answer, "volumes")?.to_string(),
        ),
        ("map entries", u64_field(answer, "map_entries")?.to_string()),
        (
            "chunks",
            format!(
                "{} ({} physical, each read back)",
                u64_field(answer, "chunks")?,
                size(u64_field(answer, "physical_bytes")?)
            ),
        ),
        ("orphan chunks", u64_field(answer, "orphans")?.to_string()),
    ]);
    Ok(())
}

fn print_scrub(ctx: &Ctx, st: &Value, started: bool) -> Result<(), CliError> {
    if started {
        // The pass runs in the background: what it finds is for `--status`.
        if ctx.json {
            print_json(st);
        } else {
            println!(
                "scrub pass started; `ibid pool scrub --status` shows its progress and findings"
            );
        }
        return Ok(());
    }
    let damaged = st["damaged"].as_array().cloned().unwrap_or_default();
    if !damaged.is_empty() {
        // Nothing on stdout on failure: the damage goes into the error.
        let listed: Vec<String> = damaged
            .iter()
            .map(|d| {
                let places: Vec<String> = (d["places"].as_array().into_iter().flatten())
                    .map(|p| {
                        format!(
                            "block {} of {:?}",
                            p["block"].as_u64().unwrap_or(0),
                            p["volume"].as_str().unwrap_or("?")
                        )
                    })
                    .collect();
                format!(
                    "chunk {:#x} ({}) is {}",
                    d["chunk"].as_u64().unwrap_or(0),
                    d["why"].as_str().unwrap_or("?"),
                    if places.is_empty() {
                        "in no volume or snapshot".to_string()
                    } else {
                        places.join(", ")
                    }
                )
            })
            .collect();
        return Err(CliError {
            code: "damaged".into(),
            message: format!(
                "the scrub found {} damaged chunk(s), whose blocks fail to read (EIO): {}",
                damaged.len(),
                listed.join("; ")
            ),
            exit: Exit::Damaged,
        });
    }
    if ctx.json {
        print_json(st);
        return Ok(());
    }
    let checked = u64_field(st, "checked_chunks")?;
    let total = u64_field(st, "total_chunks")?;
    print_fields(&[
        (
            "state",
            if st["running"].as_bool() == Some(true) {
                "running".to_string()
            } else {
                "idle".to_string()
            },
        ),
        (
            "this (or the last) pass",
            format!(
                "{checked} of {total} chunks checked ({} read), none damaged",
                size(u64_field(st, "checked_bytes")?)
            ),
        ),
        ("passes completed", u64_field(st, "passes")?.to_string()),
        (
            "rate",
            format!("{}/s", size(u64_field(st, "rate_bytes_per_s")?)),
        ),
    ]);
    Ok(())
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
        (
            "filesystem",
            format!(
                "{} available of {} ({} kept for metadata)",
                bytes("filesystem_free_bytes")?,
                bytes("filesystem_bytes")?,
                bytes("filesystem_reserve_bytes")?
            ),
        ),
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
        ("by sharing", sharing(&s["breakdown"])),
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

/// The `breakdown` of `GET /api/v1/pool` in one line: physical data by sharing, and its age.
fn sharing(b: &Value) -> String {
    let field = |k: &str| size(b[k].as_u64().unwrap_or(0));
    match b["computed_unix_s"].as_u64() {
        None => "not computed yet (the server computes it in the background)".into(),
        Some(_) => format!(
            "{} unique, {} shared, {} only in snapshots (computed {} s ago)",
            field("unique_physical_bytes"),
            field("shared_physical_bytes"),
            field("snapshot_only_physical_bytes"),
            b["age_s"].as_u64().unwrap_or(0)
        ),
    }
}
