#!/usr/bin/env python3
"""Mutation check of the power-loss simulator: applies one named mutation to the engine (a
removed fsync, a write ordered after its metadata, ...), rebuilds `ibid-bench`, runs seeds from
0 until the first failure, and restores the source. Usage: scripts/sim-mutations.py NAME...
(names: see M). Figures: docs/BENCHMARKS.md, "Power-loss simulator"."""
import os, subprocess, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R = os.path.join(ROOT, 'crates/ibid-engine/src/')
M = {
 'segment-fsync': ('segment/mod.rs', """        let sync_file = |(id, f): &(u64, Arc<SegmentFile>)| {
            (f.file.sync_data()).map_err(|e| Error::io(format!("sync segment {id:016x}"), e))
        };""", """        let sync_file = |(_id, _f): &(u64, Arc<SegmentFile>)| -> Result<()> { Ok(()) };"""),
 'journal-fsync': ('journal.rs', """            files.files[i]
                .file
                .sync_data()
                .map_err(|e| Error::io("sync journal", e))?;""", """            let _ = &files.files[i];"""),
 'segment-dir-sync': ('segment/mod.rs', """            if dir_dirty {
                sync_dir()?;
            }
        }""", """            let _ = (dir_dirty, sync_dir);
        }"""),
 'journal-no-checksum': ('journal.rs', """        if crc != u32_at(h, 20) {
            break;
        }""", """        let _ = crc;"""),
 'segment-tail-unwritten': ('segment/mod.rs', """            self.writers.iter().try_for_each(write)?;""", """            let _ = write;"""),
 'metadata-before-data': ('commit.rs', """                return self.apply(&batch, &mut record, log, || self.segments.sync());""", """                let applied = self.apply(&batch, &mut record, log, || Ok(()));
                return applied.and_then(|a| self.segments.sync().map(|()| a));"""),
 'ref-log-fold-drops-batch': ('commit.rs', """            let mut sums = std::mem::take(&mut by_slice[slice]);""", """            let mut sums = ref_log::Deltas::new();"""),
 'ref-log-rows-kept': ('ref_log.rs', """        for (key, v) in txn.extract_range_if(meta::CHUNK_DELTAS, lo..=hi, |_, _| true)? {""", """        for (key, v) in txn.range(meta::CHUNK_DELTAS, lo..=hi)? {"""),
 'ref-log-flatten-unlogged': ('snapshot.rs', """                cs.ref_log
                    .append(&mut txn, &crate::ref_log::by_slice(&released));""", """                let _ = &released;"""),
}
def run(name):
    f, a, b = M[name]
    p = R + f
    s = open(p).read()
    assert s.count(a) == 1, name
    open(p, 'w').write(s.replace(a, b))
    try:
        r = subprocess.run(['cargo', 'build', '-p', 'ibid-bench', '--profile', 'ci'], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:])
            return
        t0 = time.time()
        for seed in range(0, 400):
            r = subprocess.run([os.path.join(ROOT, 'target/ci/ibid-bench'), 'simulate', '--seeds', str(seed)], capture_output=True, text=True)
            if r.returncode != 0:
                first = [l for l in r.stderr.splitlines() if l.startswith('seed')][:1]
                print(f"{name}: caught at seed {seed} after {time.time()-t0:.1f} s: {first}")
                break
        else:
            print(f"{name}: NOT caught in 400 seeds ({time.time()-t0:.1f} s)")
    finally:
        open(p, 'w').write(s)


for name in sys.argv[1:] or M:
    run(name)
# Leave the binary built from the unmutated source.
subprocess.run(['cargo', 'build', '-p', 'ibid-bench', '--profile', 'ci'], cwd=ROOT, capture_output=True)
