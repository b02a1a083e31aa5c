//! Ranged reads of a pack's records, kept as the pieces the responses arrived in (restores and
//! instant restores' fetches).
//!
//! `ObjectStore::get_ranges` gathers each response into one fresh buffer before it slices the
//! ranges out: a second copy of every byte received, into memory the kernel must fault in and
//! clear first (10.6 % of the server's samples in a restore from RGW, session 56). Here a
//! range's bytes stay in the body's own pieces (`Bytes` share the client's read buffers); the
//! decoder copies them once, into the volume's write runs.

use crate::Result;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};
use std::ops::Range;

/// Ranges this close together (bytes between them) go in one request, as `get_ranges` does.
const COALESCE_GAP: u64 = 1 << 20;
/// Requests of one call in flight at once.
const REQUESTS_INFLIGHT: usize = 4;

/// One range's bytes, in the pieces they arrived in (in order, back to back).
pub(crate) type Pieces = Vec<Bytes>;

/// The bytes of each of `ranges` (in any order, overlapping or not) of the object at `path`:
/// ranges close together are read with one request. A range the object ends inside comes back
/// short.
pub(crate) async fn get_pieces(
    store: &dyn ObjectStore,
    path: &Path,
    ranges: &[Range<u64>],
) -> Result<Vec<Pieces>> {
    let requests = merge(ranges);
    let bodies: Vec<Body> = futures::stream::iter(requests)
        .map(|r| async move {
            let options = GetOptions {
                range: Some(GetRange::Bounded(r.clone())),
                ..GetOptions::default()
            };
            let pieces: Pieces = store
                .get_opts(path, options)
                .await?
                .into_stream()
                .try_collect()
                .await?;
            Ok::<_, crate::Error>(Body::new(r.start, pieces))
        })
        .buffered(REQUESTS_INFLIGHT)
        .try_collect()
        .await?;
    Ok(ranges
        .iter()
        .map(|r| {
            // `merge` put each range wholly inside the last request that starts at or before it.
            let i = bodies.partition_point(|b| b.starts[0] <= r.start) - 1;
            bodies[i].slice(r)
        })
        .collect())
}

/// One response body: its pieces and the object offset each starts at.
struct Body {
    pieces: Pieces,
    /// `starts[i]`: where piece `i` starts; one more entry, where the body ends.
    starts: Vec<u64>,
}

impl Body {
    fn new(start: u64, pieces: Pieces) -> Body {
        let mut starts = Vec::with_capacity(pieces.len() + 1);
        starts.push(start);
        for p in &pieces {
            starts.push(starts[starts.len() - 1] + p.len() as u64);
        }
        Body { pieces, starts }
    }

    /// The bytes of `r` (which starts inside this body's request), without copying; short
    /// where the body is.
    fn slice(&self, r: &Range<u64>) -> Pieces {
        let first = self
            .starts
            .partition_point(|&s| s <= r.start)
            .saturating_sub(1);
        let mut out = Vec::new();
        for (piece, &at) in self.pieces[first.min(self.pieces.len())..]
            .iter()
            .zip(&self.starts[first..])
        {
            if at >= r.end {
                break;
            }
            let end = at + piece.len() as u64;
            if end > r.start {
                let lo = r.start.saturating_sub(at) as usize;
                let hi = (r.end.min(end) - at) as usize;
                out.push(piece.slice(lo..hi));
            }
        }
        out
    }
}

/// The requests that cover `ranges`, in order: ranges sorted by start, each in the request of
/// the one before it when they overlap or at most [`COALESCE_GAP`] bytes lie between them.
fn merge(ranges: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::new();
    for r in &sorted {
        match out.last_mut() {
            Some(last) if r.start <= last.end + COALESCE_GAP => last.end = last.end.max(r.end),
            _ => out.push(r.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::PutPayload;

    fn join(pieces: &Pieces) -> Vec<u8> {
        pieces.concat()
    }

    /// Ranges near each other share a request and far ones do not; each comes back whole (in
    /// any order, overlapping), one past the object's end short.
    #[tokio::test]
    async fn ranges_come_back_whole_from_shared_and_separate_requests() {
        let object: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 251) as u8).collect();
        let store = InMemory::new();
        let path = Path::from("p");
        store
            .put(&path, PutPayload::from(object.clone()))
            .await
            .expect("put");
        let ranges = [
            0..45,
            45..1000,
            5000..70000,
            (2 << 20) + 1..(2 << 20) + 9,
            (3 << 20) - 4..(3 << 20) + 10,
        ];
        assert_eq!(merge(&ranges), [0..70000, (2 << 20) + 1..(3 << 20) + 10]);
        let got = get_pieces(&store, &path, &ranges[..4]).await.expect("get");
        for (r, pieces) in ranges.iter().zip(&got) {
            assert_eq!(join(pieces), object[r.start as usize..r.end as usize]);
        }
        // In any order, overlapping, twice.
        let mixed = [
            5000..70000,
            0..45,
            40..1000,
            0..45,
            (2 << 20) + 1..(2 << 20) + 9,
        ];
        let got = get_pieces(&store, &path, &mixed).await.expect("get");
        for (r, pieces) in mixed.iter().zip(&got) {
            assert_eq!(join(pieces), object[r.start as usize..r.end as usize]);
        }
        // A range the object ends inside: the store refuses it or it comes back short.
        if let Ok(got) = get_pieces(&store, &path, &ranges).await {
            assert_eq!(join(&got[4]), object[(3 << 20) - 4..]);
        }
    }

    /// A body in many pieces is cut at the ranges' bounds without losing or repeating a byte,
    /// ranges starting and ending inside, at and across pieces, in any order, overlapping.
    #[test]
    fn a_body_is_cut_at_the_ranges() {
        let bytes: Vec<u8> = (0..200u8).collect();
        let pieces: Pieces = [0usize, 7, 7, 50, 51, 120, 200]
            .windows(2)
            .map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]]))
            .collect();
        let start = 1000u64;
        let body = Body::new(start, pieces);
        let ranges = [
            1060..1130,
            1000..1003,
            1003..1007,
            1010..1051,
            1051..1052,
            1190..1200,
            1000..1200,
            1060..1130,
            1007..1007,
        ];
        for r in &ranges {
            let (lo, hi) = ((r.start - start) as usize, (r.end - start) as usize);
            assert_eq!(join(&body.slice(r)), bytes[lo..hi], "{r:?}");
        }
        // Past the body: nothing; across its end: short.
        assert!(body.slice(&(1200..1300)).is_empty());
        assert_eq!(join(&body.slice(&(1195..1300))), bytes[195..]);
    }
}
