//! Ranged reads of a pack's records, kept as the pieces the responses arrived in.
//!
//! `ObjectStore::get_ranges` gathers each response into one fresh buffer before it slices the
//! ranges out: for a restore that is a second copy of every byte received, into memory the
//! kernel must fault in and clear first — together ~10 % of a restore's CPU, measured (session
//! 56). Here a range's bytes stay in the body's own pieces (`Bytes` share the client's read
//! buffers); the decoder copies them once, into the volume's write runs.

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

/// The bytes of each of `ranges` (sorted by start, not overlapping) of the object at `path`:
/// close ranges are read with one request. A range the object ends inside comes back short.
pub(crate) async fn get_pieces(
    store: &dyn ObjectStore,
    path: &Path,
    ranges: &[Range<u64>],
) -> Result<Vec<Pieces>> {
    debug_assert!(ranges.windows(2).all(|w| w[0].end <= w[1].start));
    let requests = merge(ranges);
    let bodies: Vec<(Range<u64>, Pieces)> = futures::stream::iter(requests)
        .map(|r| async move {
            let options = GetOptions {
                range: Some(GetRange::Bounded(r.clone())),
                ..GetOptions::default()
            };
            let body: Pieces = store
                .get_opts(path, options)
                .await?
                .into_stream()
                .try_collect()
                .await?;
            Ok::<_, crate::Error>((r, body))
        })
        .buffered(REQUESTS_INFLIGHT)
        .try_collect()
        .await?;
    let mut out = Vec::with_capacity(ranges.len());
    let mut ranges = ranges.iter().peekable();
    for (request, body) in &bodies {
        let mut cursor = Cursor::new(body, request.start);
        // `merge` put every range that starts inside this request wholly inside it.
        while let Some(r) = ranges.next_if(|r| r.start < request.end) {
            out.push(cursor.take(r));
        }
    }
    Ok(out)
}

/// Reads ranges of one response body in order, without copying.
struct Cursor<'a> {
    pieces: std::slice::Iter<'a, Bytes>,
    /// The piece the cursor is in, and the object offset it starts at.
    piece: Option<(&'a Bytes, u64)>,
}

impl<'a> Cursor<'a> {
    /// At the start of `body`, which starts at object offset `start`.
    fn new(body: &'a Pieces, start: u64) -> Cursor<'a> {
        let mut pieces = body.iter();
        let piece = pieces.next().map(|p| (p, start));
        Cursor { pieces, piece }
    }

    /// The bytes of `r` (at or past every range taken before), short where the body is.
    fn take(&mut self, r: &Range<u64>) -> Pieces {
        let mut out = Vec::new();
        while let Some((piece, at)) = self.piece {
            let end = at + piece.len() as u64;
            if end > r.start && at < r.end {
                let lo = r.start.saturating_sub(at) as usize;
                let hi = (r.end.min(end) - at) as usize;
                out.push(piece.slice(lo..hi));
            }
            if end > r.end {
                // The next range may start in this piece too.
                break;
            }
            self.piece = self.pieces.next().map(|p| (p, end));
        }
        out
    }
}

/// The requests that cover `ranges`: each range in the request of the range before it when at
/// most [`COALESCE_GAP`] bytes lie between them.
fn merge(ranges: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    for r in ranges {
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

    /// Ranges near each other share a request and far ones do not; each comes back whole, one
    /// past the object's end short.
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
        // A range the object ends inside: the store refuses it or it comes back short.
        if let Ok(got) = get_pieces(&store, &path, &ranges).await {
            assert_eq!(join(&got[4]), object[(3 << 20) - 4..]);
        }
    }

    /// A body in many pieces is cut at the ranges' bounds without losing or repeating a byte,
    /// ranges starting and ending inside, at and across pieces.
    #[test]
    fn a_cursor_cuts_pieces_at_the_ranges() {
        let bytes: Vec<u8> = (0..200u8).collect();
        let body: Pieces = [0usize, 7, 7, 50, 51, 120, 200]
            .windows(2)
            .map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]]))
            .collect();
        let start = 1000u64;
        let ranges = [
            1000..1003,
            1003..1007,
            1010..1051,
            1051..1052,
            1060..1130,
            1190..1200,
        ];
        let mut cursor = Cursor::new(&body, start);
        for r in &ranges {
            let (lo, hi) = ((r.start - start) as usize, (r.end - start) as usize);
            assert_eq!(join(&cursor.take(r)), bytes[lo..hi], "{r:?}");
        }
        // Past the body: nothing.
        assert!(cursor.take(&(1200..1300)).is_empty());
    }
}
