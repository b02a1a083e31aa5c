//! `ibid snapshot ...`: create, list and delete a volume's snapshots, and export one read-only
//! over iSCSI (and unexport it). A snapshot is named
//! `VOLUME SNAPSHOT` or `VOLUME@SNAPSHOT`, as NBD exports and clone sources name it.

use super::client::segment;
use super::error::CliError;
use super::output::{
    array, print_json, print_table, size, str_field, timestamp, u64_field, BLOCK_BYTES,
};
use super::{split_snapshot, Ctx};
use clap::Subcommand;
use serde_json::{json, Value};

/// Snapshot commands.
#[derive(Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a volume: `ibid snapshot create vm1 golden` (or `vm1@golden`); with
    /// `--export` (or `--lun N`) it is also exported read-only over iSCSI at once.
    Create {
        /// Volume (or VOLUME@SNAPSHOT).
        volume: String,
        /// Snapshot name.
        name: Option<String>,
        /// Export the snapshot read-only over iSCSI (at the lowest free LUN, or --lun).
        #[arg(long)]
        export: bool,
        /// iSCSI LUN to export it as (implies --export).
        #[arg(long)]
        lun: Option<u64>,
    },
    /// List the snapshots of a volume, or of every volume; with --remote, those a remote holds.
    List {
        /// Volume (default: all volumes).
        volume: Option<String>,
        /// List the snapshots pushed to this remote instead.
        #[arg(long)]
        remote: Option<String>,
    },
    /// Push a snapshot to a remote, e.g. `ibid snapshot push vm1@nightly --remote offsite`:
    /// only the chunks the remote lacks are sent (incremental), and the snapshot appears in
    /// the remote only once whole. A push that was interrupted completes when run again.
    Push {
        /// VOLUME@SNAPSHOT (or VOLUME SNAPSHOT).
        volume: String,
        /// Snapshot name.
        name: Option<String>,
        /// The remote (`ibid remote list`).
        #[arg(long)]
        remote: String,
    },
    /// Delete a snapshot: `ibid snapshot delete vm1 golden` (or `vm1@golden`). Refused while
    /// NBD clients have it open (exit 4, `in_use`), unless --force.
    Delete {
        /// Volume (or VOLUME@SNAPSHOT).
        volume: String,
        /// Snapshot name.
        name: Option<String>,
        /// Delete even with clients connected: their reads fail from then on.
        #[arg(long)]
        force: bool,
        /// Delete the snapshot from this remote instead (its data is freed by `ibid remote
        /// gc`).
        #[arg(long, conflicts_with = "force")]
        remote: Option<String>,
    },
    /// Export a snapshot read-only over iSCSI, e.g. `ibid snapshot export vm1@golden --lun 5`,
    /// so a host or backup proxy can mount it; kept until unexported or the snapshot deleted.
    /// Writes to it fail with DATA PROTECT / WRITE PROTECTED.
    Export {
        /// VOLUME@SNAPSHOT (or VOLUME SNAPSHOT).
        volume: String,
        /// Snapshot name.
        name: Option<String>,
        /// iSCSI LUN number, 0 to 16383 (default: the lowest free one).
        #[arg(long)]
        lun: Option<u64>,
    },
    /// Stop exporting a snapshot over iSCSI (its LUN disappears; initiators rescan). Refused
    /// while iSCSI sessions use it (exit 4, `in_use`), unless --force.
    Unexport {
        /// VOLUME@SNAPSHOT (or VOLUME SNAPSHOT).
        volume: String,
        /// Snapshot name.
        name: Option<String>,
        /// Unexport even with sessions using it: their commands to it fail from then on.
        #[arg(long)]
        force: bool,
    },
}

/// Runs a snapshot command.
pub fn run(ctx: &Ctx, cmd: SnapshotCmd) -> Result<(), CliError> {
    match cmd {
        SnapshotCmd::Create {
            volume,
            name,
            export,
            lun,
        } => {
            let (volume, name) = names(&volume, name.as_deref())?;
            let mut body = json!({ "name": name });
            if export {
                body["export"] = true.into();
            }
            if let Some(l) = lun {
                body["lun"] = l.into();
            }
            let s = ctx.client.post(
                &format!("/volumes/{}/snapshots", segment(volume)),
                body,
                &format!("snapshotting {volume} as {name}"),
            )?;
            print_snapshots(ctx, &s, std::slice::from_ref(&s))
        }
        SnapshotCmd::List {
            volume,
            remote: Some(remote),
        } => super::remote::list(ctx, &remote, volume.as_deref()),
        SnapshotCmd::Push {
            volume,
            name,
            remote,
        } => {
            let (volume, name) = names(&volume, name.as_deref())?;
            super::remote::push(ctx, volume, name, &remote)
        }
        SnapshotCmd::Delete {
            volume,
            name,
            remote: Some(remote),
            ..
        } => {
            let (volume, name) = names(&volume, name.as_deref())?;
            super::remote::delete(ctx, volume, name, &remote)
        }
        SnapshotCmd::List {
            volume,
            remote: None,
        } => {
            let list = match volume {
                Some(v) => ctx.client.get(
                    &format!("/volumes/{}/snapshots", segment(&v)),
                    "listing snapshots",
                )?,
                None => all_snapshots(ctx)?,
            };
            print_snapshots(ctx, &list, array(&list, "")?)
        }
        SnapshotCmd::Export { volume, name, lun } => {
            let (volume, name) = names(&volume, name.as_deref())?;
            let body = match lun {
                Some(l) => json!({ "lun": l }),
                None => json!({}),
            };
            let s = ctx.client.post(
                &format!(
                    "/volumes/{}/snapshots/{}/export",
                    segment(volume),
                    segment(name)
                ),
                body,
                &format!("exporting {volume}@{name}"),
            )?;
            print_snapshots(ctx, &s, std::slice::from_ref(&s))
        }
        SnapshotCmd::Unexport {
            volume,
            name,
            force,
        } => {
            let (volume, name) = names(&volume, name.as_deref())?;
            let force = if force { "?force=true" } else { "" };
            ctx.client.delete(
                &format!(
                    "/volumes/{}/snapshots/{}/export{force}",
                    segment(volume),
                    segment(name)
                ),
                &format!("unexporting {volume}@{name}"),
            )?;
            if ctx.json {
                print_json(&json!({ "unexported": format!("{volume}@{name}") }));
            } else {
                println!("snapshot {volume}@{name} is no longer exported over iSCSI");
            }
            Ok(())
        }
        SnapshotCmd::Delete {
            volume,
            name,
            force,
            remote: None,
        } => {
            let (volume, name) = names(&volume, name.as_deref())?;
            let force = if force { "?force=true" } else { "" };
            ctx.client.delete(
                &format!(
                    "/volumes/{}/snapshots/{}{force}",
                    segment(volume),
                    segment(name)
                ),
                &format!("deleting {volume}@{name}"),
            )?;
            if ctx.json {
                // The API answers 204 with no body; scripts still get one JSON document.
                print_json(&json!({ "deleted": format!("{volume}@{name}") }));
            } else {
                println!("deleted snapshot {volume}@{name}");
            }
            Ok(())
        }
    }
}

/// (volume, snapshot) from `VOLUME SNAPSHOT` or `VOLUME@SNAPSHOT`.
fn names<'a>(volume: &'a str, name: Option<&'a str>) -> Result<(&'a str, &'a str), CliError> {
    match (split_snapshot(volume)?, name) {
        ((v, None), Some(n)) => Ok((v, n)),
        ((v, Some(n)), None) => Ok((v, n)),
        ((_, Some(_)), Some(_)) => Err(CliError::usage(
            "give the snapshot as VOLUME SNAPSHOT or VOLUME@SNAPSHOT, not both",
        )),
        ((_, None), None) => Err(CliError::usage(
            "which snapshot? give VOLUME SNAPSHOT or VOLUME@SNAPSHOT",
        )),
    }
}

/// The snapshots of every volume, one list (the API lists per volume).
fn all_snapshots(ctx: &Ctx) -> Result<Value, CliError> {
    let volumes = ctx.client.get("/volumes", "listing volumes")?;
    let mut all = Vec::new();
    for v in array(&volumes, "")? {
        let name = str_field(v, "name")?;
        let snaps = ctx.client.get(
            &format!("/volumes/{}/snapshots", segment(name)),
            "listing snapshots",
        )?;
        all.extend(array(&snaps, "")?.iter().cloned());
    }
    Ok(Value::Array(all))
}

/// Prints snapshots: the API's answer `doc` as JSON, or a table of `snapshots`.
fn print_snapshots(ctx: &Ctx, doc: &Value, snapshots: &[Value]) -> Result<(), CliError> {
    if ctx.json {
        print_json(doc);
        return Ok(());
    }
    let mut rows = Vec::new();
    for s in snapshots {
        rows.push(vec![
            format!("{}@{}", str_field(s, "volume")?, str_field(s, "name")?),
            size(u64_field(s, "size_bytes")?),
            size(u64_field(s, "mapped_blocks")? * BLOCK_BYTES),
            timestamp(u64_field(s, "created_unix_s")?),
            super::volume::lun_text(s),
        ]);
    }
    print_table(&["SNAPSHOT", "SIZE", "MAPPED", "CREATED", "LUN"], 1, &rows);
    Ok(())
}
