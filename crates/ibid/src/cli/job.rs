//! `ibid job list|cancel`, and following a job to its end with a progress bar (what `snapshot
//! push` and `volume restore` do: they start their job in the background and poll it).

use super::error::CliError;
use super::output::{print_json, print_table, size, str_field, u64_field};
use super::Ctx;
use clap::Subcommand;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::time::Duration;

/// Time between two polls of a job.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// Job commands.
#[derive(Subcommand)]
pub enum JobCmd {
    /// List the jobs (pushes, restores) running and recently finished, with their progress.
    List,
    /// Cancel a running job, e.g. `ibid job cancel 3`: a push leaves nothing visible in the
    /// remote, a restore deletes the volume it was making.
    Cancel {
        /// Job id (`ibid job list`).
        id: u64,
    },
}

/// Runs a job command.
pub fn run(ctx: &Ctx, cmd: JobCmd) -> Result<(), CliError> {
    match cmd {
        JobCmd::List => {
            let list = ctx.client.get("/jobs", "listing jobs")?;
            if ctx.json {
                print_json(&list);
                return Ok(());
            }
            let mut rows = Vec::new();
            for j in super::output::array(&list, "")? {
                rows.push(vec![
                    u64_field(j, "id")?.to_string(),
                    str_field(j, "kind")?.to_string(),
                    str_field(j, "target")?.to_string(),
                    str_field(j, "state")?.to_string(),
                    format!(
                        "{} / {}",
                        size(u64_field(j, "bytes_done")?),
                        size(u64_field(j, "bytes_total")?)
                    ),
                ]);
            }
            print_table(&["ID", "KIND", "TARGET", "STATE", "PROGRESS"], 4, &rows);
            Ok(())
        }
        JobCmd::Cancel { id } => {
            let j = ctx.client.post(
                &format!("/jobs/{id}/cancel"),
                json!({}),
                &format!("cancelling job {id}"),
            )?;
            if ctx.json {
                print_json(&j);
            } else {
                println!("job {id} asked to stop");
            }
            Ok(())
        }
    }
}

/// Polls job `job` (as the API answered it) until it ends: its result, or its error. Draws a
/// progress bar on a terminal; with `--json`, writes progress events to standard error
/// instead (standard output keeps the one JSON result), one JSON object per line:
/// `{"event": "progress", "id", "kind", "target", "bytes_done", "bytes_total"}` when the
/// progress moved, then `{"event": "succeeded" | "failed" | "cancelled", ...}` with the same
/// fields (and `error` when it failed).
pub fn follow(ctx: &Ctx, job: Value, label: &str) -> Result<Value, CliError> {
    let id = u64_field(&job, "id")?;
    let bar = (!ctx.json && std::io::stderr().is_terminal()).then(|| {
        let style = ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} ({binary_bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
            .with_style(style)
            .with_message(label.to_string())
    });
    let mut job = job;
    let mut told = None;
    loop {
        if let Some(bar) = &bar {
            bar.set_length(job["bytes_total"].as_u64().unwrap_or(0));
            bar.set_position(job["bytes_done"].as_u64().unwrap_or(0));
        }
        if ctx.json {
            let now = (job["state"].clone(), job["bytes_done"].clone());
            if told.as_ref() != Some(&now) {
                eprintln!("{}", event(&job));
                told = Some(now);
            }
        }
        match job["state"].as_str() {
            Some("running") => {}
            Some("succeeded") => {
                if let Some(bar) = &bar {
                    bar.finish_and_clear();
                }
                return Ok(job["result"].clone());
            }
            _ => {
                if let Some(bar) = &bar {
                    bar.abandon();
                }
                let code = job["error"]["code"].as_str().unwrap_or("internal");
                let message = job["error"]["message"].as_str().unwrap_or("the job failed");
                let status = job["error"]["status"].as_u64().unwrap_or(500) as u16;
                return Err(CliError::api(status, code, message));
            }
        }
        std::thread::sleep(POLL_INTERVAL);
        job = ctx.client.get(&format!("/jobs/{id}"), label)?;
    }
}

/// A job's progress event (see [`follow`]).
fn event(job: &Value) -> Value {
    let event = match job["state"].as_str() {
        Some("running") | None => "progress",
        Some(state) => state,
    };
    let mut e = json!({
        "event": event,
        "id": job["id"],
        "kind": job["kind"],
        "target": job["target"],
        "bytes_done": job["bytes_done"],
        "bytes_total": job["bytes_total"],
    });
    if !job["error"].is_null() {
        e["error"] = job["error"].clone();
    }
    e
}
