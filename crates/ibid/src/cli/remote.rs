//! `ibid remote ...` (add, list, remove, verify, gc) and the remote halves of the snapshot and
//! volume commands: `ibid snapshot push|list|delete --remote NAME`, `ibid volume restore`.

use super::client::segment;
use super::error::{CliError, Exit};
use super::output::{print_fields, print_json, print_table, size, str_field, timestamp, u64_field};
use super::Ctx;
use clap::Subcommand;
use serde_json::{json, Value};
use std::path::PathBuf;

/// Remote commands.
#[derive(Subcommand)]
pub enum RemoteCmd {
    /// Add an S3-compatible object store as a remote, e.g. `ibid remote add offsite
    /// --endpoint https://s3.example.com --bucket ibid`. Credentials come from
    /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or --credentials-file; the server keeps
    /// them (owner-only file in the pool directory) and never shows them again.
    Add {
        /// Remote name: letters, digits, '.', '_' and '-'.
        name: String,
        /// Endpoint URL (https://...; http:// for a store on loopback or a trusted network).
        #[arg(long, env = "AWS_ENDPOINT_URL")]
        endpoint: String,
        /// Bucket (must exist).
        #[arg(long)]
        bucket: String,
        /// Region (default us-east-1).
        #[arg(long)]
        region: Option<String>,
        /// Key prefix in the bucket (to share a bucket between pools).
        #[arg(long)]
        prefix: Option<String>,
        /// A file with the credentials: AWS's shared credentials format
        /// (`aws_access_key_id = ...`, `aws_secret_access_key = ...`, [default] profile).
        #[arg(long)]
        credentials_file: Option<PathBuf>,
    },
    /// List the remotes (never their credentials).
    List,
    /// Forget a remote (what it holds stays in the bucket).
    Remove {
        /// Remote name.
        name: String,
    },
    /// Read every manifest and every chunk of a remote and check each against its BLAKE3;
    /// exit 8 (`damaged`) if anything is wrong.
    Verify {
        /// Remote name.
        name: String,
    },
    /// Delete the objects of a remote no snapshot needs any more (after `ibid snapshot delete
    /// --remote`). Refused (exit 4, `busy`) while a push to it runs.
    Gc {
        /// Remote name.
        name: String,
    },
}

/// Runs a remote command.
pub fn run(ctx: &Ctx, cmd: RemoteCmd) -> Result<(), CliError> {
    match cmd {
        RemoteCmd::Add {
            name,
            endpoint,
            bucket,
            region,
            prefix,
            credentials_file,
        } => {
            let (key, secret) = credentials(credentials_file.as_deref())?;
            let r = ctx.client.post(
                "/remotes",
                json!({
                    "name": name, "endpoint": endpoint, "bucket": bucket, "region": region,
                    "prefix": prefix, "access_key_id": key, "secret_access_key": secret,
                }),
                &format!("adding remote {name}"),
            )?;
            print_remotes(ctx, &r, std::slice::from_ref(&r))
        }
        RemoteCmd::List => {
            let list = ctx.client.get("/remotes", "listing remotes")?;
            print_remotes(ctx, &list, super::output::array(&list, "")?)
        }
        RemoteCmd::Remove { name } => {
            ctx.client.delete(
                &format!("/remotes/{}", segment(&name)),
                &format!("removing remote {name}"),
            )?;
            if ctx.json {
                print_json(&json!({ "removed": name }));
            } else {
                println!("removed remote {name} (its bucket is untouched)");
            }
            Ok(())
        }
        RemoteCmd::Verify { name } => {
            let r = ctx.client.post(
                &format!("/remotes/{}/verify", segment(&name)),
                json!({}),
                &format!("verifying remote {name}"),
            )?;
            if r["ok"].as_bool() != Some(true) {
                let problems: Vec<&str> = r["problems"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_str).take(5).collect())
                    .unwrap_or_default();
                if ctx.json {
                    print_json(&r);
                }
                return Err(CliError {
                    code: "damaged".into(),
                    message: format!(
                        "remote {name}: {} problems: {}",
                        r["problem_count"],
                        problems.join("; ")
                    ),
                    exit: Exit::Damaged,
                });
            }
            if ctx.json {
                print_json(&r);
            } else {
                println!(
                    "remote {name} verified: {} snapshots, {} packs, {} chunks checked ({} read), \
                     {} unreferenced packs; no problems found",
                    r["snapshots"],
                    r["packs"],
                    r["chunks_checked"],
                    size(u64_field(&r, "bytes_read")?),
                    r["unreferenced_packs"]
                );
            }
            Ok(())
        }
        RemoteCmd::Gc { name } => {
            let r = ctx.client.post(
                &format!("/remotes/{}/gc", segment(&name)),
                json!({}),
                &format!("collecting remote {name}"),
            )?;
            if ctx.json {
                print_json(&r);
            } else {
                println!(
                    "remote {name}: deleted {} packs ({}), kept {} for {} snapshots",
                    r["packs_deleted"],
                    size(u64_field(&r, "bytes_freed")?),
                    r["packs_kept"],
                    r["snapshots"]
                );
                if u64_field(&r, "packs_repacked")? > 0 {
                    println!(
                        "repacked {} packs mostly garbage: {} chunks moved into {} of new packs, \
                         {} manifests rewritten",
                        r["packs_repacked"],
                        r["chunks_moved"],
                        size(u64_field(&r, "bytes_written")?),
                        r["manifests_rewritten"]
                    );
                }
            }
            Ok(())
        }
    }
}

/// The access key id and secret: from `file`, else from the environment.
fn credentials(file: Option<&std::path::Path>) -> Result<(String, String), CliError> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::usage(format!("read {}: {e}", path.display())))?;
        return parse_credentials(&text).ok_or_else(|| {
            CliError::usage(format!(
                "{}: no aws_access_key_id and aws_secret_access_key in its [default] profile",
                path.display()
            ))
        });
    }
    match (
        std::env::var("AWS_ACCESS_KEY_ID"),
        std::env::var("AWS_SECRET_ACCESS_KEY"),
    ) {
        (Ok(k), Ok(s)) if !k.is_empty() && !s.is_empty() => Ok((k, s)),
        _ => Err(CliError::usage(
            "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give --credentials-file",
        )),
    }
}

/// Reads AWS's shared credentials format: the `[default]` profile, or keys before any section.
fn parse_credentials(text: &str) -> Option<(String, String)> {
    let (mut section, mut key, mut secret) = (None::<String>, None, None);
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.trim().to_string());
            continue;
        }
        if section.as_deref().is_some_and(|s| s != "default") {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            match k.trim() {
                "aws_access_key_id" => key = Some(v.trim().to_string()),
                "aws_secret_access_key" => secret = Some(v.trim().to_string()),
                _ => {}
            }
        }
    }
    Some((key?, secret?))
}

fn print_remotes(ctx: &Ctx, doc: &Value, remotes: &[Value]) -> Result<(), CliError> {
    if ctx.json {
        print_json(doc);
        return Ok(());
    }
    let mut rows = Vec::new();
    for r in remotes {
        rows.push(vec![
            str_field(r, "name")?.to_string(),
            str_field(r, "endpoint")?.to_string(),
            str_field(r, "bucket")?.to_string(),
            r["prefix"].as_str().unwrap_or("-").to_string(),
        ]);
    }
    print_table(&["REMOTE", "ENDPOINT", "BUCKET", "PREFIX"], 4, &rows);
    Ok(())
}

/// `ibid snapshot push VOL@SNAP --remote NAME`.
pub fn push(ctx: &Ctx, volume: &str, snapshot: &str, remote: &str) -> Result<(), CliError> {
    let label = format!("pushing {volume}@{snapshot} to {remote}");
    let job = ctx.client.post(
        &format!(
            "/volumes/{}/snapshots/{}/push",
            segment(volume),
            segment(snapshot)
        ),
        json!({ "remote": remote, "background": true }),
        &label,
    )?;
    report(ctx, job, &label, |r| {
        println!("pushed {volume}@{snapshot} to {remote}");
        Ok(vec![
            ("sent", size(u64_field(r, "bytes_sent")?)),
            ("data", size(u64_field(r, "data_bytes")?)),
            ("read", size(u64_field(r, "bytes_read")?)),
            ("chunks sent", u64_field(r, "chunks_sent")?.to_string()),
            (
                "chunks skipped",
                u64_field(r, "chunks_skipped")?.to_string(),
            ),
        ])
    })
}

/// Follows `job` to its end (`label` names it), then prints its result: as JSON, or the line
/// and fields `fields` gives, with the job's duration last.
fn report(
    ctx: &Ctx,
    job: Value,
    label: &str,
    fields: impl FnOnce(&Value) -> Result<Vec<(&'static str, String)>, CliError>,
) -> Result<(), CliError> {
    let r = super::job::follow(ctx, job, label)?;
    if ctx.json {
        print_json(&r);
        return Ok(());
    }
    let mut shown = fields(&r)?;
    shown.push((
        "seconds",
        format!("{:.2}", r["duration_s"].as_f64().unwrap_or(0.0)),
    ));
    print_fields(&shown);
    Ok(())
}

/// `ibid snapshot list --remote NAME`.
pub fn list(ctx: &Ctx, remote: &str, volume: Option<&str>) -> Result<(), CliError> {
    let list = ctx.client.get(
        &format!("/remotes/{}/snapshots", segment(remote)),
        &format!("listing the snapshots in {remote}"),
    )?;
    let all = super::output::array(&list, "")?;
    let shown: Vec<Value> = all
        .iter()
        .filter(|s| volume.is_none_or(|v| s["volume"] == v))
        .cloned()
        .collect();
    if ctx.json {
        print_json(&Value::Array(shown));
        return Ok(());
    }
    let mut rows = Vec::new();
    for s in &shown {
        rows.push(vec![
            format!("{}@{}", str_field(s, "volume")?, str_field(s, "name")?),
            size(u64_field(s, "size_bytes")?),
            size(u64_field(s, "data_bytes")?),
            timestamp(u64_field(s, "created_unix_s")?),
            timestamp(u64_field(s, "pushed_unix_s")?),
        ]);
    }
    print_table(&["SNAPSHOT", "SIZE", "DATA", "CREATED", "PUSHED"], 1, &rows);
    Ok(())
}

/// `ibid snapshot delete VOL@SNAP --remote NAME`.
pub fn delete(ctx: &Ctx, volume: &str, snapshot: &str, remote: &str) -> Result<(), CliError> {
    ctx.client.delete(
        &format!(
            "/remotes/{}/snapshots/{}",
            segment(remote),
            segment(&format!("{volume}@{snapshot}"))
        ),
        &format!("deleting {volume}@{snapshot} from {remote}"),
    )?;
    if ctx.json {
        print_json(&json!({ "deleted": format!("{volume}@{snapshot}"), "remote": remote }));
    } else {
        println!(
            "deleted snapshot {volume}@{snapshot} from {remote} (`ibid remote gc {remote}` frees its data)"
        );
    }
    Ok(())
}

/// `ibid volume restore NEW --remote NAME --snapshot VOL@SNAP --instant`: answers once the
/// volume is usable; the background fetch is a job (`ibid job list`).
pub fn restore_instant(
    ctx: &Ctx,
    name: &str,
    remote: &str,
    snapshot: &str,
    fill_rate: Option<u64>,
) -> Result<(), CliError> {
    let r = ctx.client.post(
        &format!("/remotes/{}/restore", segment(remote)),
        json!({
            "snapshot": snapshot,
            "volume": name,
            "instant": true,
            "fill_bytes_per_s": fill_rate,
        }),
        &format!("restoring {snapshot} from {remote} as {name}"),
    )?;
    if ctx.json {
        print_json(&r);
        return Ok(());
    }
    println!(
        "volume {name} is usable now; {snapshot} arrives from {remote} in the background (job {}, `ibid job list`)",
        u64_field(&r["job"], "id")?
    );
    print_fields(&[
        ("size", size(u64_field(&r, "size_bytes")?)),
        ("data", size(u64_field(&r, "data_bytes")?)),
    ]);
    Ok(())
}

/// `ibid volume restore NEW --remote NAME --snapshot VOL@SNAP`.
pub fn restore(ctx: &Ctx, name: &str, remote: &str, snapshot: &str) -> Result<(), CliError> {
    let label = format!("restoring {snapshot} from {remote} as {name}");
    let job = ctx.client.post(
        &format!("/remotes/{}/restore", segment(remote)),
        json!({ "snapshot": snapshot, "volume": name, "background": true }),
        &label,
    )?;
    report(ctx, job, &label, |r| {
        println!("restored {snapshot} from {remote} as volume {name}");
        Ok(vec![
            ("size", size(u64_field(r, "size_bytes")?)),
            ("received", size(u64_field(r, "bytes_received")?)),
            ("data", size(u64_field(r, "data_bytes")?)),
        ])
    })
}

#[cfg(test)]
mod tests {
    /// The default profile's keys are read; other profiles' are not.
    #[test]
    fn shared_credentials_files_are_read() {
        let text = "[other]\naws_access_key_id = no\naws_secret_access_key = no\n\
                    [default]\n# comment\naws_access_key_id = AK\naws_secret_access_key=SK\n";
        assert_eq!(
            super::parse_credentials(text),
            Some(("AK".to_string(), "SK".to_string()))
        );
        assert_eq!(
            super::parse_credentials("[default]\naws_access_key_id = AK\n"),
            None
        );
    }
}
