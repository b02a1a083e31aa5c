//! qemu-img and qemu-io through `iscsi://` (libiscsi inside qemu): convert an
//! image in and out, compare, and write/zero/discard with read-back.

mod common;

use ibid_iscsi::Lun;
use std::process::Command;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

/// A LUN-sized raw image: 8 MiB of pseudo-random data at 4 MiB, zeros elsewhere.
fn make_image(path: &std::path::Path) -> Vec<u8> {
    let mut img = vec![0u8; common::LUN_SIZE as usize];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in img[4 << 20..12 << 20].iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(path, &img).expect("write image");
    img
}

/// Convert a raw image into LUN 1 and back out; compare both ways.
#[test]
fn qemu_img_convert_in_and_out() {
    common::require("qemu-img", "qemu-utils and qemu-block-extra");
    let t = common::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (src, back) = (dir.path().join("src.raw"), dir.path().join("back.raw"));
    let img = make_image(&src);
    let url = t.url(1);
    run(Command::new("timeout")
        .args(["120", "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&url));
    let mut lun = vec![0u8; img.len()];
    t.luns[1].read(0, &mut lun).unwrap();
    assert!(lun == img, "LUN content differs from the converted image");
    run(Command::new("timeout")
        .args(["120", "qemu-img", "compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&url));
    run(Command::new("timeout")
        .args(["120", "qemu-img", "convert", "-f", "raw", "-O", "raw"])
        .arg(&url)
        .arg(&back));
    assert!(
        std::fs::read(&back).expect("read back") == img,
        "image converted out differs"
    );
}

/// qemu-io: pattern write and read-back, write-zeroes and discard read back
/// as zeros, and discard really deallocates in the backend.
#[test]
fn qemu_io_write_zero_discard() {
    common::require("qemu-io", "qemu-utils and qemu-block-extra");
    let t = common::start();
    let cmds = [
        "write -P 0xab 0 4M",
        "read -P 0xab 0 4M",
        "write -z 0 64k",
        "read -P 0 0 64k",
        "read -P 0xab 64k 64k",
        "discard 1M 1M",
        "read -P 0 1M 1M",
        "read -P 0xab 2M 2M",
        "write -P 0x5c 511k 3k",
        "read -P 0x5c 511k 3k",
        "flush",
    ];
    let mut c = Command::new("timeout");
    c.args(["120", "qemu-io", "-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = run(c.arg(t.url(0)));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.to_lowercase().contains("error"), "{out}");
    let st = t.luns[0].block_status(1 << 20, 1 << 20).unwrap();
    assert!(
        st.iter().all(|e| !e.mapped),
        "discarded range still mapped: {st:?}"
    );
}
