//! The catalog under concurrent changes: names stay unique whichever way a volume or snapshot
//! is created (a new volume, a clone, a snapshot), every creation that reports success is
//! there after a reopen, and `verify` finds the catalog consistent.

mod common;

use common::quiet_config;
use ibid_engine::{Error, Pool};
use std::sync::{Arc, Barrier};

/// Runs `make(i)` on `n` threads at once and returns how many succeeded, panicking on any
/// error other than `AlreadyExists`.
fn race(n: usize, make: impl Fn(usize) -> Result<(), Error> + Send + Sync + 'static) -> usize {
    let make = Arc::new(make);
    let start = Arc::new(Barrier::new(n));
    (0..n)
        .map(|i| {
            let (make, start) = (make.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                match make(i) {
                    Ok(()) => true,
                    Err(Error::AlreadyExists(_)) => false,
                    Err(e) => panic!("creation {i}: {e}"),
                }
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("creator"))
        .filter(|&ok| ok)
        .count()
}

/// Eight threads create the same snapshot, then the same clone name from a volume, a
/// snapshot and as a new volume at once: exactly one of each succeeds, and the pool verifies
/// and reopens with exactly those.
#[test]
fn one_of_many_creations_of_one_name_succeeds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let pool = Arc::new(Pool::create(&path, quiet_config(1 << 30)).expect("create"));
    let v = pool.create_volume("v", 64 << 20).expect("v");
    v.write(0, &vec![7u8; 1 << 20], false).expect("write");
    for round in 0..5 {
        let snap = format!("s{round}");
        let p = pool.clone();
        let won = race(8, move |_| p.create_snapshot("v", &snap).map(|_| ()));
        assert_eq!(
            won, 1,
            "round {round}: {won} snapshots named s{round} created"
        );

        let name = format!("c{round}");
        let (p, snap) = (pool.clone(), format!("v@s{round}"));
        let won = race(8, move |i| {
            let made = match i % 3 {
                0 => p.clone_volume("v", &name),
                1 => p.clone_volume(&snap, &name),
                _ => p.create_volume(&name, 1 << 20),
            };
            made.map(|_| ())
        });
        assert_eq!(
            won, 1,
            "round {round}: {won} volumes named c{round} created"
        );
    }
    pool.verify().expect("verify");
    let volumes = pool.list_volumes().len();
    let snapshots = pool.list_snapshots(None).len();
    assert_eq!((volumes, snapshots), (6, 5));
    drop(v);
    Arc::try_unwrap(pool)
        .ok()
        .expect("one handle")
        .close()
        .expect("close");
    let pool = Pool::open(&path, quiet_config(1 << 30)).expect("reopen");
    assert_eq!(pool.list_volumes().len(), 6);
    assert_eq!(pool.list_snapshots(None).len(), 5);
    pool.verify().expect("verify after reopen");
}

/// A volume deleted while another thread creates a volume of the same name: whenever the
/// creation reports success, the new volume is there after a reopen (the delete's commit
/// removes the old record by name, and must not remove the new one, which nothing else writes
/// again here).
#[test]
fn a_name_deleted_and_created_at_once_keeps_the_new_volume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool");
    let mut pool = Arc::new(Pool::create(&path, quiet_config(1 << 30)).expect("create"));
    for round in 0..30u8 {
        let old = pool.create_volume("x", 1 << 20).expect("old x");
        old.write(0, &[1u8; 4096], false).expect("old data");
        drop(old);
        let start = Arc::new(Barrier::new(2));
        let (p, s) = (pool.clone(), start.clone());
        let deleter = std::thread::spawn(move || {
            s.wait();
            p.delete_volume("x").expect("delete");
        });
        start.wait();
        // Until the delete has taken the old volume out, the name is taken.
        let new = loop {
            match pool.create_volume("x", 2 << 20) {
                Ok(v) => break v,
                Err(Error::AlreadyExists(_)) => std::thread::yield_now(),
                Err(e) => panic!("round {round}: {e}"),
            }
        };
        drop(new);
        deleter.join().expect("deleter");
        pool.sync().expect("sync");
        Arc::try_unwrap(pool)
            .ok()
            .expect("one handle")
            .close()
            .expect("close");
        pool = Arc::new(Pool::open(&path, quiet_config(1 << 30)).expect("reopen"));
        let x = pool
            .volume("x")
            .unwrap_or_else(|e| panic!("round {round}: the new x is gone: {e}"));
        assert_eq!(x.size(), 2 << 20, "round {round}: x is the old volume");
        let mut got = vec![1u8; 4096];
        x.read(0, &mut got).expect("read");
        assert!(
            got.iter().all(|&b| b == 0),
            "round {round}: x shows the old data"
        );
        drop(x);
        pool.delete_volume("x").expect("clean up");
    }
    pool.verify().expect("verify");
}
