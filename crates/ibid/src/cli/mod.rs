//! The client commands of `ibid` (`volume`, `snapshot`, `pool`): a command-line client of the
//! HTTP API of a running `ibid serve`. Human output by default, the API's JSON with `--json`, and
//! exit codes that follow the API's stable error codes ([`error::Exit`]).

pub mod client;
pub mod error;
pub mod job;
pub mod output;
pub mod pool;
pub mod progress;
pub mod remote;
pub mod schedule;
pub mod snapshot;
pub mod volume;

use clap::{Args, Subcommand};
use client::Client;
use error::{CliError, Exit};
use std::process::ExitCode;

/// Where `ibid serve`'s API listens by default.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7800";

/// How to reach the server and how to print: options of `ibid` itself, accepted before or
/// after the command group (`ibid --server URL volume list`, `ibid volume list --json`).
#[derive(Args, Clone)]
pub struct ClientOpts {
    /// Client commands: URL of the ibid HTTP API (`http://HOST:PORT` or `HOST:PORT`).
    #[arg(long, global = true, env = "IBID_SERVER", default_value = DEFAULT_SERVER)]
    pub server: String,
    /// Client commands: bearer token the API requires (`ibid serve --api-token`).
    #[arg(long, global = true, env = "IBID_API_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Client commands: print the API's JSON answer (pretty) for scripts instead of human
    /// output; errors too, as JSON on stderr.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The names of [`ClientOpts`]' options, which `ibid serve` refuses.
pub const CLIENT_OPTION_IDS: [&str; 3] = ["server", "token", "json"];

/// The client command groups, flattened into `ibid`'s command list.
#[derive(Subcommand)]
pub enum ClientCommand {
    /// Manage volumes: create, list, describe, resize, delete, convert, clone, copy.
    Volume {
        #[command(subcommand)]
        cmd: volume::VolumeCmd,
    },
    /// Manage snapshots: create, list, delete, export read-only over iSCSI.
    Snapshot {
        #[command(subcommand)]
        cmd: snapshot::SnapshotCmd,
    },
    /// Pool statistics and settings.
    Pool {
        #[command(subcommand)]
        cmd: pool::PoolCmd,
    },
    /// Snapshot schedules with retention (and pushes to a remote): set, list, remove.
    Schedule {
        #[command(subcommand)]
        cmd: schedule::ScheduleCmd,
    },
    /// Long operations (pushes, restores): list, cancel.
    Job {
        #[command(subcommand)]
        cmd: job::JobCmd,
    },
    /// S3-compatible object stores snapshots are pushed to: add, list, remove, verify, gc.
    Remote {
        #[command(subcommand)]
        cmd: remote::RemoteCmd,
    },
}

/// What a command handler needs: the connection and the output mode.
pub struct Ctx {
    /// The API client.
    pub client: Client,
    /// `--json`: print the API's JSON instead of human output.
    pub json: bool,
}

/// Runs a client command; errors are printed as `ibid: MESSAGE (CODE)` on stderr, or with
/// `--json` as one JSON object `{"code", "message", "exit"}` on stderr.
pub fn run(opts: &ClientOpts, command: ClientCommand) -> ExitCode {
    let ctx = ctx(opts);
    let result = match command {
        ClientCommand::Volume { cmd } => volume::run(&ctx, cmd),
        ClientCommand::Snapshot { cmd } => snapshot::run(&ctx, cmd),
        ClientCommand::Pool { cmd } => pool::run(&ctx, cmd),
        ClientCommand::Remote { cmd } => remote::run(&ctx, cmd),
        ClientCommand::Job { cmd } => job::run(&ctx, cmd),
        ClientCommand::Schedule { cmd } => schedule::run(&ctx, cmd),
    };
    match result {
        Ok(()) => ExitCode::from(Exit::Ok as u8),
        Err(e) => {
            print_error(&e, opts.json);
            ExitCode::from(e.exit as u8)
        }
    }
}

/// Prints a failed command's error on stderr: `ibid: MESSAGE (CODE)`, or as JSON.
pub fn print_error(e: &CliError, json: bool) {
    if json {
        eprintln!(
            "{}",
            serde_json::json!({ "code": e.code, "message": e.message, "exit": e.exit as u8 })
        );
    } else {
        eprintln!("ibid: {e}");
    }
}

fn ctx(opts: &ClientOpts) -> Ctx {
    Ctx {
        client: Client::new(&opts.server, opts.token.clone(), !opts.json),
        json: opts.json,
    }
}

/// Parses a volume format name (local check: a typo is a usage error, exit 2).
pub fn parse_format(s: &str) -> Result<String, String> {
    s.parse::<ibid_engine::VolumeFormat>()
        .map(|f| f.as_str().to_string())
        .map_err(|e| e.to_string())
}

/// Splits `VOLUME@SNAPSHOT`; `None` for the snapshot when there is no `@`.
pub fn split_snapshot(s: &str) -> Result<(&str, Option<&str>), CliError> {
    match s.split_once('@') {
        Some((v, snap)) if !v.is_empty() && !snap.is_empty() => Ok((v, Some(snap))),
        Some(_) => Err(CliError::usage(format!("{s:?}: expected VOLUME@SNAPSHOT"))),
        None => Ok((s, None)),
    }
}
