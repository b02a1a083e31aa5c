//! `ibid volume ...`: create, list, describe (the `vmkfstools -D` view), resize, delete, format
//! conversions (format, inflate, eagerzero, reserve), clone, range copy and QoS limits.

use super::client::segment;
use super::error::CliError;
use super::output::{
    array, blocks, print_fields, print_json, print_table, size, str_field, timestamp, u64_field,
    BLOCK_BYTES,
};
use super::{parse_format, split_snapshot, Ctx};
use crate::units::{overwrite_headroom_max, parse_size, reservation_rule};
use clap::Subcommand;
use serde_json::{json, Map, Value};

/// Volume commands.
#[derive(Subcommand)]
pub enum VolumeCmd {
    /// Create a volume, e.g. `ibid volume create vm1 --size 50G --format eagerzeroedthick`.
    Create {
        /// Volume name: letters, digits, '.', '_' and '-'.
        name: String,
        /// Size with a unit (powers of 1024): 512M, 50G, 1.5TiB.
        #[arg(long, value_parser = parse_size)]
        size: u64,
        /// thin (default), lazyzeroedthick (zeroedthick) or eagerzeroedthick.
        #[arg(long, value_parser = parse_format)]
        format: Option<String>,
        /// iSCSI LUN number, 0 to 16383 (default: the lowest free one).
        #[arg(long)]
        lun: Option<u64>,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Move a volume to another iSCSI LUN number, e.g. `ibid volume set-lun vm1 3`. Refused if
    /// another volume or snapshot has it (exit 4, `lun_in_use`); initiators are told that the
    /// LUN inventory changed (REPORTED LUNS DATA HAS CHANGED) and rescan.
    SetLun {
        /// Volume name.
        name: String,
        /// The new LUN number, 0 to 16383.
        lun: u64,
    },
    /// List the volumes.
    List,
    /// Restore a snapshot from a remote as a new thin volume, e.g. `ibid volume restore vm1b
    /// --remote offsite --snapshot vm1@nightly` (on this pool or any other reaching the
    /// bucket). Every chunk is checked against its BLAKE3; a failed restore leaves no volume.
    /// With --instant the volume is usable at once: what a host reads before it has arrived
    /// is fetched first, and the rest comes in the background (`ibid job list`), resumed
    /// after a restart.
    Restore {
        /// Name of the new volume.
        name: String,
        /// The remote (`ibid remote list`).
        #[arg(long)]
        remote: String,
        /// The snapshot in the remote, VOLUME@SNAPSHOT (`ibid snapshot list --remote NAME`).
        #[arg(long)]
        snapshot: String,
        /// Make the volume usable at once and fetch its data in the background.
        #[arg(long)]
        instant: bool,
        /// With --instant: at most this much received per second by the background fetch,
        /// e.g. 50M (reads of data not fetched yet are not limited).
        #[arg(long, value_parser = parse_size, requires = "instant")]
        fill_rate: Option<u64>,
    },
    /// Fetch the rest of an instant restore in the background again, after its job was
    /// cancelled (`ibid job cancel`), or at another rate.
    Fill {
        /// The volume being restored.
        name: String,
        /// At most this much received per second, e.g. 50M (0: no limit; default: the rate
        /// the restore had).
        #[arg(long, value_parser = parse_size)]
        fill_rate: Option<u64>,
    },
    /// Show a volume's space (the `vmkfstools -D` view): size, blocks, mapped, tbz, unique,
    /// shared, physical, reserved, snapshots.
    Describe {
        /// Volume name.
        name: String,
    },
    /// Grow or shrink a volume.
    Resize {
        /// Volume name.
        name: String,
        /// New size with a unit, e.g. 100G.
        #[arg(long, value_parser = parse_size)]
        size: u64,
    },
    /// Delete a volume and its snapshots (clones keep their data). Refused while clients are
    /// connected to it or its snapshots (exit 4, `in_use`), unless --force.
    Delete {
        /// Volume name.
        name: String,
        /// Delete even with clients connected: their I/O fails from then on.
        #[arg(long)]
        force: bool,
    },
    /// Convert a volume to another format (reserves or releases space).
    Format {
        /// Volume name.
        name: String,
        /// thin, lazyzeroedthick (zeroedthick) or eagerzeroedthick.
        #[arg(value_parser = parse_format)]
        format: String,
    },
    /// Thin to eager-zeroed thick (`vmkfstools --inflatedisk`).
    Inflate {
        /// Volume name.
        name: String,
    },
    /// Lazy- to eager-zeroed thick (`vmkfstools -k`).
    Eagerzero {
        /// Volume name.
        name: String,
    },
    /// Reserve a thin volume's space: thin to lazy-zeroed thick.
    Reserve {
        /// Volume name.
        name: String,
    },
    /// Clone a volume or a snapshot (`VOLUME@SNAPSHOT`): fast (shares all blocks) or --full.
    Clone {
        /// Source: VOLUME or VOLUME@SNAPSHOT.
        source: String,
        /// Name of the new volume.
        name: String,
        /// A full clone: its map refers to no other volume.
        #[arg(long)]
        full: bool,
        /// Format of the clone (default thin).
        #[arg(long, value_parser = parse_format)]
        format: Option<String>,
    },
    /// Show or change a volume's QoS limits, e.g. `ibid volume qos vm1 --write-iops 500
    /// --read-mbps 100`: the limits given change, the others stay; with --clear, the others
    /// are removed. In force at once on every connection (NBD and iSCSI), kept across restarts.
    /// With no limit and no --clear, shows the limits.
    Qos {
        /// Volume name.
        name: String,
        #[command(flatten)]
        limits: QosArgs,
        /// Remove every limit not given on this command line.
        #[arg(long)]
        clear: bool,
    },
    /// Copy a range from a volume or snapshot into another volume, by reference where aligned.
    Copy {
        /// Source: VOLUME or VOLUME@SNAPSHOT.
        source: String,
        /// Destination volume.
        destination: String,
        /// Offset in the source, e.g. 1M (default 0).
        #[arg(long, value_parser = parse_size)]
        source_offset: Option<u64>,
        /// Offset in the destination (default 0).
        #[arg(long, value_parser = parse_size)]
        offset: Option<u64>,
        /// Bytes to copy (default: the rest of the source).
        #[arg(long, value_parser = parse_size)]
        length: Option<u64>,
    },
}

/// Runs a volume command.
pub fn run(ctx: &Ctx, cmd: VolumeCmd) -> Result<(), CliError> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            format,
            lun,
            qos,
        } => create(ctx, &name, size, format, lun, &qos),
        VolumeCmd::SetLun { name, lun } => {
            let v = ctx.client.patch(
                &format!("/volumes/{}", segment(&name)),
                json!({ "lun": lun }),
                &format!("moving {name} to LUN {lun}"),
            )?;
            show_volume(ctx, &v)
        }
        VolumeCmd::Qos {
            name,
            limits,
            clear,
        } => set_qos(ctx, &name, &limits, clear),
        VolumeCmd::List => list(ctx),
        VolumeCmd::Restore {
            name,
            remote,
            snapshot,
            instant,
            fill_rate,
        } => {
            if let (_, None) = super::split_snapshot(&snapshot)? {
                return Err(CliError::usage(format!(
                    "--snapshot {snapshot:?}: expected VOLUME@SNAPSHOT"
                )));
            }
            if instant {
                return super::remote::restore_instant(ctx, &name, &remote, &snapshot, fill_rate);
            }
            super::remote::restore(ctx, &name, &remote, &snapshot)
        }
        VolumeCmd::Fill { name, fill_rate } => {
            let job = ctx.client.post(
                &format!("/volumes/{}/fill", segment(&name)),
                json!({ "fill_bytes_per_s": fill_rate }),
                &format!("filling {name}"),
            )?;
            if ctx.json {
                print_json(&job);
            } else {
                println!(
                    "volume {name}: the rest arrives in the background (job {}, `ibid job list`)",
                    u64_field(&job, "id")?
                );
            }
            Ok(())
        }
        VolumeCmd::Describe { name } => describe(ctx, &name),
        VolumeCmd::Resize { name, size } => resize(ctx, &name, size),
        VolumeCmd::Delete { name, force } => delete(ctx, &name, force),
        VolumeCmd::Format { name, format } => {
            let v = ctx.client.post(
                &format!("/volumes/{}/format", segment(&name)),
                json!({ "format": format }),
                &format!("converting {name} to {format}"),
            )?;
            show_volume(ctx, &v)
        }
        VolumeCmd::Inflate { name } => convert(ctx, &name, "inflate", "inflating"),
        VolumeCmd::Eagerzero { name } => convert(ctx, &name, "eagerzero", "eager-zeroing"),
        VolumeCmd::Reserve { name } => convert(ctx, &name, "reserve", "reserving"),
        VolumeCmd::Clone {
            source,
            name,
            full,
            format,
        } => clone(ctx, &source, &name, full, format),
        VolumeCmd::Copy {
            source,
            destination,
            source_offset,
            offset,
            length,
        } => copy(ctx, &source, &destination, source_offset, offset, length),
    }
}

/// QoS limits on the command line: a volume's requests per second (IOPS) and MiB per second
/// (MB/s, 2^20 bytes), for reads, writes (zeroing and unmap included) and both together. Each
/// is a whole number from 1 up (IOPS up to 10000000, MB/s up to 1048576).
#[derive(clap::Args, Default)]
pub struct QosArgs {
    /// QoS: reads and writes per second, together.
    #[arg(long, visible_alias = "max-iops", value_name = "IOPS")]
    iops: Option<u64>,
    /// QoS: MiB read and written per second, together.
    #[arg(long, visible_alias = "max-mbps", value_name = "MB/s")]
    mbps: Option<u64>,
    /// QoS: reads per second.
    #[arg(long, value_name = "IOPS")]
    read_iops: Option<u64>,
    /// QoS: MiB read per second.
    #[arg(long, value_name = "MB/s")]
    read_mbps: Option<u64>,
    /// QoS: writes per second.
    #[arg(long, value_name = "IOPS")]
    write_iops: Option<u64>,
    /// QoS: MiB written per second.
    #[arg(long, value_name = "MB/s")]
    write_mbps: Option<u64>,
}

impl QosArgs {
    /// The limits given, as the API's fields (with `clear`, the others as null).
    fn body(&self, clear: bool) -> Map<String, Value> {
        let mut body = Map::new();
        for (field, value) in [
            ("total_iops", self.iops),
            ("total_mbps", self.mbps),
            ("read_iops", self.read_iops),
            ("read_mbps", self.read_mbps),
            ("write_iops", self.write_iops),
            ("write_mbps", self.write_mbps),
        ] {
            match value {
                Some(v) => {
                    body.insert(field.to_string(), v.into());
                }
                None if clear => {
                    body.insert(field.to_string(), Value::Null);
                }
                None => {}
            }
        }
        body
    }
}

/// A volume view's `qos` object in words: "write 200 IOPS, read 20 MiB/s", or "none".
fn qos_text(v: &Value) -> String {
    let parts: Vec<String> = [
        ("total_iops", "total", "IOPS"),
        ("total_mbps", "total", "MiB/s"),
        ("read_iops", "read", "IOPS"),
        ("read_mbps", "read", "MiB/s"),
        ("write_iops", "write", "IOPS"),
        ("write_mbps", "write", "MiB/s"),
    ]
    .iter()
    .filter_map(|(field, what, unit)| {
        v["qos"][field]
            .as_u64()
            .map(|n| format!("{what} {n} {unit}"))
    })
    .collect();
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(", ")
    }
}

fn set_qos(ctx: &Ctx, name: &str, limits: &QosArgs, clear: bool) -> Result<(), CliError> {
    let body = limits.body(clear);
    let v = if body.is_empty() {
        find_volume(ctx, name)?
    } else {
        ctx.client.patch(
            &format!("/volumes/{}/qos", segment(name)),
            Value::Object(body),
            &format!("setting the QoS limits of {name}"),
        )?
    };
    if ctx.json {
        print_json(&v);
    } else {
        print_fields(&[
            ("name", str_field(&v, "name")?.to_string()),
            ("qos", qos_text(&v)),
        ]);
    }
    Ok(())
}

fn create(
    ctx: &Ctx,
    name: &str,
    size: u64,
    format: Option<String>,
    lun: Option<u64>,
    qos: &QosArgs,
) -> Result<(), CliError> {
    let mut body = json!({ "name": name, "size": size });
    if let Some(f) = format {
        body["format"] = f.into();
    }
    if let Some(l) = lun {
        body["lun"] = l.into();
    }
    let limits = qos.body(false);
    if !limits.is_empty() {
        body["qos"] = Value::Object(limits);
    }
    let v = ctx
        .client
        .post("/volumes", body, &format!("creating volume {name}"))?;
    show_volume(ctx, &v)
}

fn list(ctx: &Ctx) -> Result<(), CliError> {
    let v = ctx.client.get("/volumes", "listing volumes")?;
    if ctx.json {
        print_json(&v);
        return Ok(());
    }
    let mut rows = Vec::new();
    for vol in array(&v, "")? {
        rows.push(vec![
            str_field(vol, "name")?.to_string(),
            str_field(vol, "format")?.to_string(),
            lun_text(vol),
            size(u64_field(vol, "size_bytes")?),
            size(u64_field(vol, "mapped_blocks")? * BLOCK_BYTES),
            size(u64_field(vol, "tbz_blocks")? * BLOCK_BYTES),
            size(u64_field(vol, "reserved_bytes")?),
        ]);
    }
    print_table(
        &["NAME", "FORMAT", "LUN", "SIZE", "MAPPED", "TBZ", "RESERVED"],
        2,
        &rows,
    );
    Ok(())
}

/// A volume's or snapshot's `lun` field: the number, or `-` when it has none.
pub fn lun_text(v: &Value) -> String {
    v["lun"]
        .as_u64()
        .map_or_else(|| "-".to_string(), |l| l.to_string())
}

fn describe(ctx: &Ctx, name: &str) -> Result<(), CliError> {
    let d = ctx.client.get(
        &format!("/volumes/{}", segment(name)),
        &format!("measuring {name}"),
    )?;
    if ctx.json {
        print_json(&d);
        return Ok(());
    }
    let size_bytes = u64_field(&d, "size_bytes")?;
    let snapshots: Vec<String> = array(&d, "snapshots")?
        .iter()
        .map(|s| {
            Ok(format!(
                "{} ({} mapped, {})",
                str_field(s, "name")?,
                size(u64_field(s, "mapped_blocks")? * BLOCK_BYTES),
                timestamp(u64_field(s, "created_unix_s")?)
            ))
        })
        .collect::<Result<_, CliError>>()?;
    let clients: Vec<String> = array(&d, "clients")?
        .iter()
        .map(|c| {
            let mut line = format!("{} {}", str_field(c, "protocol")?, str_field(c, "remote")?);
            if let Some(i) = c["initiator"].as_str() {
                line.push_str(&format!(" ({i})"));
            }
            if let Some(e) = c["export"].as_str().filter(|e| e.contains('@')) {
                line.push_str(&format!(" on {e}"));
            }
            Ok(line)
        })
        .collect::<Result<_, CliError>>()?;
    print_fields(&[
        ("name", str_field(&d, "name")?.to_string()),
        ("id", u64_field(&d, "id")?.to_string()),
        ("lun", lun_text(&d)),
        ("format", str_field(&d, "format")?.to_string()),
        ("created", timestamp(u64_field(&d, "created_unix_s")?)),
        ("size", format!("{} ({size_bytes} bytes)", size(size_bytes))),
        ("blocks", format!("{} of 4 KiB", u64_field(&d, "blocks")?)),
        ("mapped", blocks(u64_field(&d, "mapped_blocks")?)),
        ("tbz", blocks(u64_field(&d, "tbz_blocks")?)),
        ("unique", blocks(u64_field(&d, "unique_blocks")?)),
        ("shared", blocks(u64_field(&d, "shared_blocks")?)),
        (
            "physical",
            format!(
                "{} ({} unique, {} shared; {} distinct chunks)",
                size(u64_field(&d, "physical_bytes")?),
                size(u64_field(&d, "exclusive_physical_bytes")?),
                size(u64_field(&d, "shared_physical_bytes")?),
                u64_field(&d, "distinct_chunks")?
            ),
        ),
        ("reserved", size(u64_field(&d, "reserved_bytes")?)),
        (
            "qos",
            format!(
                "{} ({} requests throttled, {:.1} s waited)",
                qos_text(&d),
                d["qos_throttled_requests"].as_u64().unwrap_or(0),
                d["qos_throttled_seconds"].as_f64().unwrap_or(0.0)
            ),
        ),
        (
            "snapshots",
            if snapshots.is_empty() {
                "none".to_string()
            } else {
                snapshots.join(", ")
            },
        ),
        (
            "clients",
            if clients.is_empty() {
                "none".to_string()
            } else {
                clients.join(", ")
            },
        ),
    ]);
    Ok(())
}

fn resize(ctx: &Ctx, name: &str, size_bytes: u64) -> Result<(), CliError> {
    ctx.client.post(
        &format!("/volumes/{}/resize", segment(name)),
        json!({ "size": size_bytes }),
        &format!("resizing {name}"),
    )?;
    // The API answers 204: show the volume as it now is.
    let v = find_volume(ctx, name)?;
    show_volume(ctx, &v)
}

fn delete(ctx: &Ctx, name: &str, force: bool) -> Result<(), CliError> {
    let force = if force { "?force=true" } else { "" };
    ctx.client.delete(
        &format!("/volumes/{}{force}", segment(name)),
        &format!("deleting {name}"),
    )?;
    if ctx.json {
        // The API answers 204 with no body; scripts still get one JSON document.
        print_json(&json!({ "deleted": name }));
    } else {
        println!("deleted volume {name}");
    }
    Ok(())
}

/// One of the `vmkfstools`-style conversions: POST `/volumes/NAME/{route}`.
fn convert(ctx: &Ctx, name: &str, route: &str, doing: &str) -> Result<(), CliError> {
    let v = ctx.client.post(
        &format!("/volumes/{}/{route}", segment(name)),
        Value::Object(Map::new()),
        &format!("{doing} {name}"),
    )?;
    show_volume(ctx, &v)
}

fn clone(
    ctx: &Ctx,
    source: &str,
    name: &str,
    full: bool,
    format: Option<String>,
) -> Result<(), CliError> {
    let (volume, snapshot) = split_snapshot(source)?;
    // A full clone is a job: started in the background and followed (a progress bar).
    let mut body = json!({ "name": name, "full": full, "background": full });
    if let Some(s) = snapshot {
        body["snapshot"] = s.into();
    }
    if let Some(f) = format {
        body["format"] = f.into();
    }
    let kind = if full { "full clone" } else { "clone" };
    let label = format!("making a {kind} of {source} as {name}");
    let answer = ctx
        .client
        .post(&format!("/volumes/{}/clone", segment(volume)), body, &label)?;
    let v = if full {
        super::job::follow(ctx, answer, &label)?
    } else {
        answer
    };
    show_volume(ctx, &v)
}

fn copy(
    ctx: &Ctx,
    source: &str,
    destination: &str,
    source_offset: Option<u64>,
    offset: Option<u64>,
    length: Option<u64>,
) -> Result<(), CliError> {
    split_snapshot(source)?;
    let mut body = json!({ "source": source });
    for (key, value) in [
        ("source_offset", source_offset),
        ("offset", offset),
        ("length", length),
    ] {
        if let Some(v) = value {
            body[key] = v.into();
        }
    }
    let r = ctx.client.post(
        &format!("/volumes/{}/copy", segment(destination)),
        body,
        &format!("copying {source} to {destination}"),
    )?;
    if ctx.json {
        print_json(&r);
        return Ok(());
    }
    println!(
        "copied {} from {source} to {destination} in {:.2} s: {} by reference, {} as data",
        size(u64_field(&r, "length")?),
        r["seconds"].as_f64().unwrap_or(0.0),
        size(u64_field(&r, "shared_bytes")?),
        size(u64_field(&r, "data_bytes")?)
    );
    Ok(())
}

/// The listing entry of one volume (the same view create and the conversions answer with).
fn find_volume(ctx: &Ctx, name: &str) -> Result<Value, CliError> {
    let all = ctx.client.get("/volumes", "listing volumes")?;
    array(&all, "")?
        .iter()
        .find(|v| v["name"] == name)
        .cloned()
        .ok_or_else(|| CliError::api(404, "not_found", &format!("volume {name:?} not found")))
}

/// Prints a volume view (`{"name","format","size_bytes",...}`): JSON as is, or one line.
fn show_volume(ctx: &Ctx, v: &Value) -> Result<(), CliError> {
    if ctx.json {
        print_json(v);
        return Ok(());
    }
    let format = str_field(v, "format")?;
    let reserved = u64_field(v, "reserved_bytes")?;
    let thick = format != "thin";
    print_fields(&[
        ("name", str_field(v, "name")?.to_string()),
        ("lun", lun_text(v)),
        ("format", format.to_string()),
        ("size", size(u64_field(v, "size_bytes")?)),
        (
            "reserved",
            if thick {
                format!("{} ({})", size(reserved), reservation_rule())
            } else {
                size(reserved)
            },
        ),
        ("mapped", blocks(u64_field(v, "mapped_blocks")?)),
        ("qos", qos_text(v)),
    ]);
    if thick {
        println!("{}", headroom_note());
    }
    Ok(())
}

/// The pool-wide overwrite headroom thick volumes add to their reservations.
fn headroom_note() -> String {
    let headroom = overwrite_headroom_max();
    format!(
        "note: the pool also keeps overwrite headroom for its thick volumes (a block's reservation \
         per block of theirs, {} at most; `ibid pool stats` shows it): new data is stored before \
         the commit that frees what it replaces",
        size(headroom)
    )
}
