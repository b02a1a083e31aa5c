//! The `ibid` command: runs the storage server (`serve`) and manages a running one through its
//! HTTP API (`volume`, `snapshot`, `pool`).

mod api;
mod cli;
mod clients;
mod copy_gates;
mod durable;
mod history;
mod instant_restores;
mod iscsi_luns;
mod jobs;
mod lun_map;
mod metrics;
mod nbd_exports;
mod qos;
mod remotes;
mod schedules;
mod scrub;
mod serve;
mod space;
mod units;
mod web;

/// mimalloc, tuned by [`ibid_engine::allocator::tune`] (see `allocator.rs` for why).
#[global_allocator]
static GLOBAL: ibid_engine::allocator::Allocator = ibid_engine::allocator::Allocator;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// ibid: an all-flash storage array in software.
#[derive(Parser)]
#[command(version, about, after_help = cli::error::EXIT_CODES_HELP)]
struct Cli {
    #[command(flatten)]
    client: cli::ClientOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a pool's volumes over NBD (creating the pool if needed).
    Serve(Box<ServeArgs>),
    #[command(flatten)]
    Client(cli::ClientCommand),
}

/// Options of `ibid serve`.
#[derive(Args)]
struct ServeArgs {
    /// Pool directory.
    #[arg(long, default_value = "ibid-data", env = "IBID_DATA")]
    data: PathBuf,
    /// Capacity of a new pool, e.g. 100G (default: the filesystem's free space less a reserve
    /// for metadata).
    #[arg(long, value_parser = units::parse_size)]
    capacity: Option<u64>,
    /// Accept a --capacity larger than the filesystem has available (the pool then promises
    /// space the filesystem may not have; writes get ENOSPC when it fills).
    #[arg(long, requires = "capacity")]
    capacity_force: bool,
    /// NBD listen address.
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd: SocketAddr,
    /// iSCSI listen address; `off` disables the target.
    #[arg(long, default_value = "127.0.0.1:3260", value_parser = parse_optional_addr)]
    iscsi: OptionalAddr,
    /// HTTP API listen address; `off` disables the API. Off loopback, --api-token is required.
    #[arg(long, default_value = "127.0.0.1:7800", value_parser = parse_optional_addr)]
    http: OptionalAddr,
    /// Bearer token the HTTP API requires (`Authorization: Bearer TOKEN`).
    #[arg(long, env = "IBID_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// A host name the HTTP listener (dashboard and API) answers to besides its own address,
    /// e.g. the name of a reverse proxy (repeatable; requests naming any other host in their
    /// `Host` header are refused, against DNS rebinding).
    #[arg(long = "http-allowed-host", value_name = "NAME")]
    http_allowed_hosts: Vec<String>,
    /// iSCSI target name (IQN).
    #[arg(long, default_value = "iqn.2026-11.org.ibid:pool")]
    iqn: String,
    /// Create this volume if it does not exist: NAME=SIZE, e.g. vm1=50G (repeatable).
    #[arg(long = "volume", value_parser = parse_volume_arg)]
    volumes: Vec<(String, u64)>,
    /// Don't create the default volume (disk0, 16 GiB thin) in a new pool.
    #[arg(long)]
    no_default_volume: bool,
    /// Certificate (PEM) for NBD TLS; with --nbd-tls-key, enables STARTTLS.
    #[arg(long, requires = "nbd_tls_key")]
    nbd_tls_cert: Option<PathBuf>,
    /// Private key (PEM) for NBD TLS.
    #[arg(long, requires = "nbd_tls_cert")]
    nbd_tls_key: Option<PathBuf>,
    /// Pre-shared keys for NBD TLS instead of a certificate: a file of `identity:hexkey`
    /// lines (as `psktool` writes it; qemu's `tls-creds-psk` and libnbd's `tls-psk-file` read
    /// the same format).
    #[arg(long, conflicts_with = "nbd_tls_cert")]
    nbd_tls_psk: Option<PathBuf>,
    /// Refuse NBD clients that do not use TLS.
    #[arg(long)]
    nbd_tls_required: bool,
    /// Threads that run NBD requests, shared by all NBD connections.
    #[arg(long, default_value_t = ibid_nbd::WORKERS_DEFAULT as u16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    nbd_workers: u16,
    /// Threads of the async runtime that read and write every connection's socket (NBD,
    /// iSCSI, HTTP); blocking backend calls run elsewhere. Default: a quarter of the cores, at
    /// least one.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    io_threads: Option<u16>,
    /// Hand every NBD write to the worker threads, small ones included (by default a write of
    /// up to 64 KiB runs on its connection's task when it will not wait: fewer thread
    /// hand-offs; this switch is for comparing the two).
    #[arg(long)]
    nbd_no_inline_writes: bool,
    /// Hand every NBD read to the worker threads (by default a read of up to 64 KiB is first
    /// tried on its connection's task, reading only what is in memory, and goes to a worker
    /// only if it would wait for the disk; this switch is for comparing the two).
    #[arg(long)]
    nbd_no_inline_reads: bool,
    /// Seconds the HTTP API waits for a request's headers, and again for its body, before it
    /// gives up on the request (a stalled client cannot hold a connection open).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_timeout: u64,
    /// Most bytes per second the background scrub reads (it checks every stored chunk against
    /// its checksum and fingerprint), e.g. 32M.
    #[arg(long, default_value = "32M", value_parser = units::parse_size)]
    scrub_rate: u64,
    /// Time between the starts of scrub passes, e.g. 12h, 7d (s, m, h, d); 0 runs them only
    /// when asked (`ibid pool scrub`).
    #[arg(long, default_value = "7d", value_parser = parse_duration)]
    scrub_every: std::time::Duration,
    /// Memory for the read cache (blocks read twice are kept, checked, and sent from memory),
    /// e.g. 1G; 0 disables it. Default: a sixteenth of the RAM, at most 2 GiB, taken as it
    /// fills.
    #[arg(long, value_parser = units::parse_size)]
    read_cache: Option<u64>,
}

/// Parses `30s`, `10m`, `12h`, `7d` or plain seconds.
pub(crate) fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?}: expected a number with s, m, h or d, e.g. 12h"))?;
    let secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{s:?}: unit must be s, m, h or d")),
    };
    n.checked_mul(secs)
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// A listen address, or `off`.
#[derive(Clone)]
struct OptionalAddr(Option<SocketAddr>);

fn parse_optional_addr(s: &str) -> Result<OptionalAddr, String> {
    if s == "off" {
        return Ok(OptionalAddr(None));
    }
    s.parse()
        .map(|a| OptionalAddr(Some(a)))
        .map_err(|e| format!("{s:?}: {e}"))
}

fn parse_volume_arg(s: &str) -> Result<(String, u64), String> {
    let (name, size) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=SIZE, e.g. vm1=50G"))?;
    ibid_engine::validate_volume_name(name).map_err(|e| e.to_string())?;
    Ok((name.to_string(), units::parse_size(size)?))
}

/// Parses the command line. With `--json`, a usage error is printed as the client commands'
/// JSON error (`code` `usage`, exit 2); help and version print as usual.
fn parse() -> (Cli, clap::ArgMatches) {
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    parsed.unwrap_or_else(|e| {
        use clap::error::ErrorKind;
        let json = std::env::args_os()
            .take_while(|a| a != "--")
            .any(|a| a == "--json");
        let informational = matches!(
            e.kind(),
            ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
        if json && !informational {
            let text = e.render().to_string();
            let message = text.trim().trim_start_matches("error: ");
            cli::print_error(&cli::error::CliError::usage(message), true);
            std::process::exit(e.exit_code());
        }
        e.exit()
    })
}

/// Raises the soft limit on open files to the hard one, as servers that hold many files do:
/// a pool keeps a segment file per 32 MiB of data and garbage open (up to half the soft
/// limit, `PoolConfig::segment_files_open_max`), and the usual soft limit of 1,024 would have
/// it reopen files past ~16 GiB. Left as it is if the call fails.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads and sets this process's limit through a plain struct owned here.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn main() -> ExitCode {
    ibid_engine::allocator::tune();
    raise_open_files_limit();
    let (cli, matches) = parse();
    match cli.command {
        Command::Client(command) => {
            // A client's output piped into `head` or `grep -q` ends quietly when the reader
            // goes, as other command-line tools do (Rust ignores SIGPIPE by default, which
            // makes println! panic instead).
            // SAFETY: restores the default disposition of one signal, before any thread runs.
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            cli::run(&cli.client, command)
        }
        Command::Serve(args) => {
            let misplaced = cli::CLIENT_OPTION_IDS.iter().find(|id| {
                matches!(
                    matches.value_source(id),
                    Some(clap::parser::ValueSource::CommandLine)
                )
            });
            if let Some(id) = misplaced {
                eprintln!(
                    "Error: --{id} is an option of the client commands (volume, snapshot, pool), \
                     not of serve"
                );
                return ExitCode::from(2);
            }
            serve_main(*args)
        }
    }
}

fn serve_main(args: ServeArgs) -> ExitCode {
    match run_serve(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `ibid serve` with logging to stderr.
fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never into a log file or journal.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let ServeArgs {
        data,
        capacity,
        capacity_force,
        nbd,
        iscsi,
        iqn,
        http,
        api_token,
        http_allowed_hosts,
        volumes,
        no_default_volume,
        nbd_tls_cert,
        nbd_tls_key,
        nbd_tls_psk,
        nbd_tls_required,
        nbd_workers,
        io_threads,
        nbd_no_inline_writes,
        nbd_no_inline_reads,
        http_timeout,
        scrub_rate,
        scrub_every,
        read_cache,
    } = args;
    let credentials = match (nbd_tls_cert, nbd_tls_key, nbd_tls_psk) {
        (Some(cert), Some(key), None) => Some(ibid_nbd::TlsCredentials::X509 {
            cert_chain_pem: cert,
            private_key_pem: key,
            client_ca_pem: None,
        }),
        (None, None, Some(keys_file)) => Some(ibid_nbd::TlsCredentials::Psk { keys_file }),
        _ => None,
    };
    if nbd_tls_required && credentials.is_none() {
        return Err(anyhow::anyhow!(
            "--nbd-tls-required needs --nbd-tls-cert and --nbd-tls-key, or --nbd-tls-psk"
        ));
    }
    let nbd_tls = credentials.map(|credentials| ibid_nbd::TlsConfig {
        credentials,
        required: nbd_tls_required,
    });
    serve::run(serve::ServeOptions {
        data,
        capacity,
        capacity_force,
        nbd,
        iscsi: iscsi.0,
        iqn,
        http: http.0,
        api_token,
        http_allowed_hosts,
        volumes,
        default_volume: !no_default_volume,
        nbd_tls,
        nbd_workers: usize::from(nbd_workers),
        nbd_inline_writes: !nbd_no_inline_writes,
        nbd_inline_reads: !nbd_no_inline_reads,
        io_threads: io_threads.map_or_else(serve::io_threads_default, usize::from),
        http_timeout: std::time::Duration::from_secs(http_timeout),
        scrub_rate,
        scrub_every: (!scrub_every.is_zero()).then_some(scrub_every),
        read_cache_bytes: read_cache.unwrap_or_else(ibid_engine::config::read_cache_bytes_default),
    })
}
