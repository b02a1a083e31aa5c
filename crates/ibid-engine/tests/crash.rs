//! Crash test: a child process writes, zeroes, flushes and cleans segments while the parent
//! kills it with SIGKILL at random moments. After every kill the pool reopens, passes a full
//! consistency check, and every sector reads back either its last flushed content or the
//! content of a write issued after that flush — never anything else, never another sector's.
//!
//! Snapshots, clones and range copies (2 MiB into a new volume, by frames) are made and
//! deleted along the way: each one that exists after a kill must hold exactly its source's
//! content at the moment it was made (making one commits), and the cleaner makes copies
//! permanent and flattens layers once their sharers are gone.
//!
//! Every sector written carries its own identity (volume, sector number, version) and a fill
//! derived from it, so a sector showing another sector's or volume's data is caught.

use ibid_engine::{Pool, PoolConfig, VolumeFormat};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

const SECTOR: usize = 512;
const VOLUME_SECTORS: u64 = 8192; // 4 MiB
const VOLUMES: [&str; 2] = ["crash-a", "crash-b"];
const ROUNDS: usize = 25;

fn config() -> PoolConfig {
    PoolConfig {
        capacity_bytes: Some(1 << 30),
        segment_bytes_max: 128 << 10,
        background_interval_ms: 5,
        commit_interval_ms: 5,
        gc_live_pct_max: 90,
        // Dedup index keys in runs (merged a slice of 3 at a time past a few keys held, or
        // at the fourth run) when a crash comes.
        dedup_run_keys_min: 1,
        dedup_runs_max: 4,
        dedup_merge_slices: 3,
        dedup_run_keys_target: 6,
        ..PoolConfig::default()
    }
}

/// The content of one sector at one version (version 0 is zeros).
fn sector_content(vol: usize, sector: u64, version: u64) -> [u8; SECTOR] {
    let mut s = [0u8; SECTOR];
    if version == 0 {
        return s;
    }
    s[0] = 0xA5;
    s[1] = vol as u8;
    s[8..16].copy_from_slice(&sector.to_le_bytes());
    s[16..24].copy_from_slice(&version.to_le_bytes());
    let mut x = (sector << 20) ^ version ^ ((vol as u64) << 60) | 1;
    for chunk in s[24..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = chunk.len();
        chunk.copy_from_slice(&x.to_le_bytes()[..n]);
    }
    s
}

/// Decodes a sector read back: its version, or an error if it is not a valid sector of this
/// volume and position.
fn decode_sector(vol: usize, sector: u64, s: &[u8]) -> Result<u64, String> {
    if s.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let version = u64::from_le_bytes(s[16..24].try_into().expect("8 bytes"));
    if s[..] != sector_content(vol, sector, version)[..] {
        return Err(format!(
            "volume {vol} sector {sector}: content is not a valid version of this sector"
        ));
    }
    Ok(version)
}

/// The child: runs until killed. Prints each operation before issuing it and `F` after each
/// completed flush.
#[test]
#[ignore = "helper process for crash_recovers_every_flushed_sector"]
fn crash_child() {
    let Ok(dir) = std::env::var("IBID_CRASH_DIR") else {
        return;
    };
    let seed: u64 = std::env::var("IBID_CRASH_SEED")
        .expect("seed")
        .parse()
        .expect("seed");
    let gc_heavy = seed % 2 == 1;
    let pool = Pool::open(&dir, config()).expect("open pool");
    let vols: Vec<_> = VOLUMES
        .iter()
        .map(|n| pool.volume(n).expect("volume"))
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut version = seed << 32;
    let mut out = std::io::stdout().lock();
    // The test harness has printed "test crash_child ... " without a newline.
    writeln!(out).expect("stdout");
    let mut made: Vec<(usize, u64)> = Vec::new();
    loop {
        version += 1;
        let vol = rng.random_range(0..VOLUMES.len());
        let sectors = *[1u64, 3, 8, 8, 16, 64]
            .get(rng.random_range(0..6))
            .expect("len");
        let start = rng.random_range(0..VOLUME_SECTORS - sectors);
        match rng.random_range(0..40) {
            36 | 37 => {
                // Snapshot or clone of a live volume; printed once it exists (and is durable).
                let n = version & 0xffff_ffff;
                if rng.random_range(0..2) == 0 {
                    pool.create_snapshot(VOLUMES[vol], &format!("s{seed}-{n}"))
                        .expect("snapshot");
                    writeln!(out, "S {vol} s{seed}-{n}").expect("stdout");
                } else {
                    pool.clone_volume(VOLUMES[vol], &format!("c{seed}-{n}"))
                        .expect("clone");
                    writeln!(out, "C {vol} c{seed}-{n}").expect("stdout");
                }
                out.flush().expect("stdout");
                made.push((vol, n));
            }
            35 => {
                // A range copy into a new volume, at the same offsets (so every sector keeps
                // its identity): 2 MiB goes by frames (a catalog operation that commits) unless
                // the source's stack is too deep for them; the flush covers that case.
                let n = version & 0xffff_ffff;
                let blocks = 512u64;
                let first = rng.random_range(0..VOLUME_SECTORS / 8 - blocks) * 8;
                let name = format!("r{seed}-{n}");
                let dst = pool
                    .create_volume(&name, VOLUME_SECTORS * 512)
                    .expect("create copy target");
                let report = dst
                    .copy_from(&vols[vol], first * 512, first * 512, blocks * 4096)
                    .expect("range copy");
                assert_eq!(report.shared_bytes, blocks * 4096);
                dst.flush().expect("flush");
                writeln!(out, "R {vol} {name} {first} {}", blocks * 8).expect("stdout");
                out.flush().expect("stdout");
                made.push((vol, n));
            }
            38 if !made.is_empty() => {
                // Delete one made in this round (it may survive the kill, or not).
                let (v, n) = made.swap_remove(rng.random_range(0..made.len()));
                writeln!(out, "X {v} {n}").expect("stdout");
                out.flush().expect("stdout");
                if pool
                    .delete_snapshot(VOLUMES[v], &format!("s{seed}-{n}"))
                    .is_err()
                    && pool.delete_volume(&format!("c{seed}-{n}")).is_err()
                {
                    pool.delete_volume(&format!("r{seed}-{n}"))
                        .expect("delete clone or copy");
                }
            }
            39 => {
                // A format change (a reservation moves): `verify` after the kill checks the
                // pool's reservation count against the durable records.
                let format = VolumeFormat::ALL[rng.random_range(0..VolumeFormat::ALL.len())];
                pool.set_volume_format(VOLUMES[vol], format)
                    .expect("set format");
            }
            0..=3 => {
                writeln!(out, "Z {vol} {start} {sectors}").expect("stdout");
                out.flush().expect("stdout");
                vols[vol]
                    .write_zeroes(start * 512, sectors * 512, false)
                    .expect("zero");
            }
            4..=7 => {
                vols[vol].flush().expect("flush");
                writeln!(out, "F").expect("stdout");
                out.flush().expect("stdout");
                if gc_heavy {
                    pool.gc_now().expect("gc");
                }
            }
            _ => {
                writeln!(out, "W {vol} {start} {sectors} {version}").expect("stdout");
                out.flush().expect("stdout");
                let data: Vec<u8> = (start..start + sectors)
                    .flat_map(|s| sector_content(vol, s, version))
                    .collect();
                let fua = rng.random_range(0..20) == 0;
                vols[vol].write(start * 512, &data, fua).expect("write");
                if fua {
                    writeln!(out, "F").expect("stdout");
                    out.flush().expect("stdout");
                }
            }
        }
    }
}

#[test]
fn crash_recovers_every_flushed_sector() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool_dir = dir.path().join("pool");
    {
        let pool = Pool::create(&pool_dir, config()).expect("create");
        for v in VOLUMES {
            pool.create_volume(v, VOLUME_SECTORS * 512)
                .expect("create volume");
        }
        pool.close().expect("close");
    }
    // Durable state: version per (volume, sector).
    let mut durable: HashMap<(usize, u64), u64> = HashMap::new();
    let exe = std::env::current_exe().expect("test binary");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x1b1d);
    let mut gc_rounds = 0;
    // Snapshots, clones and copies that must exist: name → (source volume, is snapshot,
    // versions).
    let mut copies: HashMap<String, (usize, bool, Vec<u64>)> = HashMap::new();
    let mut copies_checked = 0usize;
    let (mut ops_total, mut flushes_total) = (0usize, 0usize);
    for round in 0..ROUNDS {
        let seed = round as u64 + 1;
        gc_rounds += (seed % 2) as usize;
        let mut child = Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "crash_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IBID_CRASH_DIR", &pool_dir)
            .env("IBID_CRASH_SEED", seed.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn child");
        std::thread::sleep(Duration::from_millis(rng.random_range(100..600)));
        child.kill().expect("kill");
        child.wait().expect("wait");
        let lines: Vec<String> = BufReader::new(child.stdout.take().expect("stdout"))
            .lines()
            .map_while(Result::ok)
            .filter(|l| l.starts_with(['W', 'Z', 'F', 'S', 'C', 'R', 'X']))
            .collect();
        ops_total += lines.iter().filter(|l| l.starts_with(['W', 'Z'])).count();
        flushes_total += lines.iter().filter(|l| *l == "F").count();
        // Apply everything up to the last flush to the durable state; remember what follows.
        let last_flush = lines
            .iter()
            .rposition(|l| l == "F" || l.starts_with(['S', 'C', 'R']));
        let mut maybe: HashMap<(usize, u64), Vec<u64>> = HashMap::new();
        for (i, line) in lines.iter().enumerate() {
            let f: Vec<&str> = line.split(' ').collect();
            if f[0] == "F" {
                continue;
            }
            if f[0] == "S" || f[0] == "C" {
                // Everything before is durable: the copy holds exactly that.
                let vol: usize = f[1].parse().expect("vol");
                let content: Vec<u64> = (0..VOLUME_SECTORS)
                    .map(|s| durable.get(&(vol, s)).copied().unwrap_or(0))
                    .collect();
                copies.insert(f[2].to_string(), (vol, f[0] == "S", content));
                continue;
            }
            if f[0] == "R" {
                let vol: usize = f[1].parse().expect("vol");
                let first: u64 = f[3].parse().expect("first");
                let n: u64 = f[4].parse().expect("sectors");
                let content: Vec<u64> = (0..VOLUME_SECTORS)
                    .map(|s| match s >= first && s < first + n {
                        true => durable.get(&(vol, s)).copied().unwrap_or(0),
                        false => 0,
                    })
                    .collect();
                copies.insert(f[2].to_string(), (vol, false, content));
                continue;
            }
            if f[0] == "X" {
                let (vol, n) = (f[1], f[2]);
                copies.retain(|name, (v, _, _)| {
                    !(name.ends_with(&format!("-{n}"))
                        && v.to_string() == vol
                        && name[1..].starts_with(&format!("{seed}-")))
                });
                continue;
            }
            let vol: usize = f[1].parse().expect("vol");
            let start: u64 = f[2].parse().expect("start");
            let n: u64 = f[3].parse().expect("n");
            let version: u64 = if f[0] == "W" {
                f[4].parse().expect("version")
            } else {
                0
            };
            for s in start..start + n {
                if last_flush.is_some_and(|lf| i < lf) {
                    durable.insert((vol, s), version);
                    maybe.remove(&(vol, s));
                } else {
                    maybe.entry((vol, s)).or_default().push(version);
                }
            }
        }
        let pool = Pool::open(&pool_dir, config()).expect("reopen after kill");
        pool.verify()
            .unwrap_or_else(|e| panic!("round {round}: metadata inconsistent after kill: {e}"));
        for (vi, name) in VOLUMES.iter().enumerate() {
            let vol = pool.volume(name).expect("volume");
            let mut buf = vec![0u8; (VOLUME_SECTORS as usize) * SECTOR];
            vol.read(0, &mut buf).expect("read after kill");
            for s in 0..VOLUME_SECTORS {
                let got =
                    decode_sector(vi, s, &buf[s as usize * SECTOR..(s as usize + 1) * SECTOR])
                        .unwrap_or_else(|e| panic!("round {round}: {e}"));
                let want = durable.get(&(vi, s)).copied().unwrap_or(0);
                let later = maybe.get(&(vi, s));
                assert!(
                    got == want || later.is_some_and(|l| l.contains(&got)),
                    "round {round}: volume {name} sector {s} reads version {got:#x}, flushed {want:#x}, later {later:?}"
                );
                durable.insert((vi, s), got);
            }
        }
        for (name, (vi, is_snapshot, want)) in &copies {
            let handle = if *is_snapshot {
                pool.snapshot(VOLUMES[*vi], name)
                    .unwrap_or_else(|e| panic!("round {round}: snapshot {name}: {e}"))
            } else {
                pool.volume(name)
                    .unwrap_or_else(|e| panic!("round {round}: clone {name}: {e}"))
            };
            let mut buf = vec![0u8; (VOLUME_SECTORS as usize) * SECTOR];
            handle.read(0, &mut buf).expect("read copy");
            for s in 0..VOLUME_SECTORS {
                let got =
                    decode_sector(*vi, s, &buf[s as usize * SECTOR..(s as usize + 1) * SECTOR])
                        .unwrap_or_else(|e| panic!("round {round}: {name}: {e}"));
                if got != want[s as usize] {
                    let bad: Vec<u64> = (0..VOLUME_SECTORS)
                        .filter(|&t| {
                            decode_sector(
                                *vi,
                                t,
                                &buf[t as usize * SECTOR..(t as usize + 1) * SECTOR],
                            )
                            .ok()
                                != Some(want[t as usize])
                        })
                        .collect();
                    panic!(
                        "round {round}: {name} sector {s}: {got:#x}, want {:#x}; {} bad sectors {:?}..{:?}; depth {}",
                        want[s as usize],
                        bad.len(),
                        bad.first(),
                        bad.last(),
                        handle.stack_depth()
                    );
                }
            }
            copies_checked += 1;
        }
        pool.close().expect("close");
    }
    eprintln!("crash test: {copies_checked} snapshot/clone checks");
    assert!(
        copies_checked >= ROUNDS,
        "too few snapshots and clones checked: {copies_checked}"
    );
    assert!(gc_rounds >= 10, "rounds with the cleaner running flat out");
    // The test only means something if the children got real work done before each kill.
    assert!(
        ops_total >= ROUNDS * 20,
        "only {ops_total} operations in {ROUNDS} rounds"
    );
    assert!(
        flushes_total >= ROUNDS * 2,
        "only {flushes_total} flushes in {ROUNDS} rounds"
    );
    eprintln!("crash test: {ROUNDS} rounds, {ops_total} operations, {flushes_total} flushes");
}
