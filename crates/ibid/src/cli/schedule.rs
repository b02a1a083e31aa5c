//! `ibid schedule set|list|remove`: snapshot schedules with retention, run by the server.

use super::client::segment;
use super::error::CliError;
use super::output::{print_json, print_table, str_field, timestamp, u64_field};
use super::Ctx;
use clap::Subcommand;
use serde_json::{json, Value};

/// Schedule commands.
#[derive(Subcommand)]
pub enum ScheduleCmd {
    /// Snapshot a volume on a schedule, e.g. `ibid schedule set vm1 --every 1h --keep 24
    /// --remote offsite --keep-remote 7`: snapshots are named auto-YYYYMMDDTHHMMSSZ, the newest
    /// --keep kept in the pool; with --remote each is pushed and the newest --keep-remote kept
    /// there. Replaces the volume's schedule if it has one.
    Set {
        /// Volume name.
        volume: String,
        /// Time between snapshots: 30s, 10m, 1h, 1d.
        #[arg(long, value_parser = crate::parse_duration)]
        every: std::time::Duration,
        /// Snapshots kept in the pool.
        #[arg(long)]
        keep: u64,
        /// Push each snapshot to this remote.
        #[arg(long)]
        remote: Option<String>,
        /// Snapshots kept in the remote.
        #[arg(long, requires = "remote")]
        keep_remote: Option<u64>,
    },
    /// List the schedules with their last and next runs.
    List,
    /// Stop a volume's schedule (its snapshots stay).
    Remove {
        /// Volume name.
        volume: String,
    },
}

/// Runs a schedule command.
pub fn run(ctx: &Ctx, cmd: ScheduleCmd) -> Result<(), CliError> {
    match cmd {
        ScheduleCmd::Set {
            volume,
            every,
            keep,
            remote,
            keep_remote,
        } => {
            let s = ctx.client.put(
                &format!("/volumes/{}/schedule", segment(&volume)),
                json!({ "every_s": every.as_secs(), "keep": keep, "remote": remote,
                        "keep_remote": keep_remote }),
                &format!("scheduling {volume}"),
            )?;
            print(ctx, &s, std::slice::from_ref(&s))
        }
        ScheduleCmd::List => {
            let list = ctx.client.get("/schedules", "listing schedules")?;
            print(ctx, &list, super::output::array(&list, "")?)
        }
        ScheduleCmd::Remove { volume } => {
            ctx.client.delete(
                &format!("/volumes/{}/schedule", segment(&volume)),
                &format!("unscheduling {volume}"),
            )?;
            if ctx.json {
                print_json(&json!({ "removed": volume }));
            } else {
                println!("volume {volume} is no longer snapshotted on a schedule");
            }
            Ok(())
        }
    }
}

fn print(ctx: &Ctx, doc: &Value, list: &[Value]) -> Result<(), CliError> {
    if ctx.json {
        print_json(doc);
        return Ok(());
    }
    let mut rows = Vec::new();
    for s in list {
        let remote = match s["remote"].as_str() {
            Some(r) => format!("{r} (keep {})", s["keep_remote"]),
            None => "-".into(),
        };
        rows.push(vec![
            str_field(s, "volume")?.to_string(),
            remote,
            format!("{} s", u64_field(s, "every_s")?),
            u64_field(s, "keep")?.to_string(),
            s["last_run_unix_s"]
                .as_u64()
                .map_or_else(|| "-".into(), timestamp),
            timestamp(u64_field(s, "next_run_unix_s")?),
            match (s["last_error"].as_str(), s["push_retry_unix_s"].as_u64()) {
                (Some(e), Some(at)) => format!("{e} (push tried again at {})", timestamp(at)),
                (e, _) => e.unwrap_or("").to_string(),
            },
        ]);
    }
    print_table(
        &["VOLUME", "REMOTE", "EVERY", "KEEP", "LAST", "NEXT", "ERROR"],
        2,
        &rows,
    );
    Ok(())
}
