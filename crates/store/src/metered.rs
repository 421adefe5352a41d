//! A [`ChunkSource`] wrapper that counts the chunk reads of one tier.

use std::time::Instant;

use tessera_image::{ChunkRef, PackLocation, Sha256Digest};
use tessera_metrics::{Tier, TierMetrics};
use tracing::debug_span;

use crate::error::StoreError;
use crate::source::{ChunkSource, RangeGot, RangeSink};

/// Counts every `read_stored` of `inner` as a hit (bytes, latency) or an error of one tier, and
/// wraps it in a debug span (`chunk_read`, with the tier, pack, offset and length).
#[derive(Debug)]
pub struct Metered<S> {
    inner: S,
    tier: Tier,
    metrics: TierMetrics,
}

impl<S> Metered<S> {
    /// `inner`'s reads, counted as tier `tier` in `metrics`.
    pub fn new(inner: S, tier: Tier, metrics: &tessera_metrics::Metrics) -> Self {
        Self { inner, tier, metrics: metrics.tiers.of(tier).clone() }
    }

    /// The source underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: ChunkSource> ChunkSource for Metered<S> {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        let _span = debug_span!("chunk_read", tier = self.tier.label(), %pack, offset, len).entered();
        let start = Instant::now();
        let result = self.inner.read_stored(pack, offset, len);
        match &result {
            Ok(bytes) => self.metrics.hit(bytes.len() as u64, start.elapsed()),
            Err(_) => self.metrics.error(start.elapsed()),
        }
        result
    }

    /// Counted as one read when the whole range is in.
    fn read_stored_streamed(
        &self,
        pack: &Sha256Digest,
        offset: u64,
        len: u32,
        sink: &mut RangeSink<'_>,
    ) -> Result<(), StoreError> {
        let _span = debug_span!("chunk_read", tier = self.tier.label(), %pack, offset, len).entered();
        let start = Instant::now();
        let result = self.inner.read_stored_streamed(pack, offset, len, sink);
        match &result {
            Ok(()) => self.metrics.hit(u64::from(len), start.elapsed()),
            Err(_) => self.metrics.error(start.elapsed()),
        }
        result
    }

    /// Forwarded whole (a remote source fetches near ranges in one request, far ones in
    /// parallel: the default one-by-one loop would make a batch serial), each range counted as
    /// one read that took until it was handed over; the ranges an error left without bytes, as
    /// errors.
    fn read_stored_many(
        &self,
        pack: &Sha256Digest,
        ranges: &[(u64, u32)],
        got: &mut RangeGot<'_>,
    ) -> Result<(), StoreError> {
        let _span =
            debug_span!("chunk_reads", tier = self.tier.label(), %pack, ranges = ranges.len()).entered();
        let start = Instant::now();
        let mut handed = 0;
        let result = self.inner.read_stored_many(pack, ranges, &mut |i, bytes| {
            self.metrics.hit(bytes.len() as u64, start.elapsed());
            handed += 1;
            got(i, bytes);
        });
        if result.is_err() {
            (handed..ranges.len()).for_each(|_| self.metrics.error(start.elapsed()));
        }
        result
    }

    fn ranges_per_request(&self) -> usize {
        self.inner.ranges_per_request()
    }

    fn holds(&self, chunk: &ChunkRef, pack: &Sha256Digest, loc: &PackLocation) -> bool {
        self.inner.holds(chunk, pack, loc)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    struct Fixed(Option<Vec<u8>>);

    impl ChunkSource for Fixed {
        fn read_stored(&self, _: &Sha256Digest, _: u64, len: u32) -> Result<Vec<u8>, StoreError> {
            std::thread::sleep(Duration::from_millis(2));
            match &self.0 {
                Some(b) => Ok(b[..len as usize].to_vec()),
                None => Err(StoreError::Io {
                    op: "reading",
                    path: "pack".into(),
                    source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short"),
                }),
            }
        }
    }

    #[test]
    fn counts_hits_bytes_errors_and_latency() {
        let m = tessera_metrics::Metrics::new();
        let pack = Sha256Digest::of(b"pack");
        let ok = Metered::new(Fixed(Some(vec![7; 100])), Tier::Local, &m);
        assert_eq!(ok.read_stored(&pack, 0, 60).unwrap().len(), 60);
        assert_eq!(ok.read_stored(&pack, 60, 40).unwrap().len(), 40);
        let bad = Metered::new(Fixed(None), Tier::Origin, &m);
        assert!(bad.read_stored(&pack, 0, 10).is_err());
        let local = m.tiers.of(Tier::Local);
        assert_eq!((local.hits.get(), local.bytes.get(), local.errors.get()), (2, 100, 0));
        assert_eq!(local.latency.get_sample_count(), 2);
        assert!(local.latency.get_sample_sum() >= 0.004, "two reads of at least 2 ms");
        let origin = m.tiers.of(Tier::Origin);
        assert_eq!((origin.hits.get(), origin.bytes.get(), origin.errors.get()), (0, 0, 1));
    }

    /// A source with its own `read_stored_many` (one request for them all).
    struct Batched(std::sync::atomic::AtomicU64);

    impl ChunkSource for Batched {
        fn read_stored(&self, _: &Sha256Digest, _: u64, _: u32) -> Result<Vec<u8>, StoreError> {
            unreachable!("a batch goes through read_stored_many")
        }

        fn read_stored_many(
            &self,
            _: &Sha256Digest,
            ranges: &[(u64, u32)],
            got: &mut RangeGot<'_>,
        ) -> Result<(), StoreError> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ranges.iter().enumerate().for_each(|(i, &(_, len))| got(i, vec![1; len as usize]));
            Ok(())
        }
    }

    #[test]
    fn a_batch_is_forwarded_whole_and_counted_per_range() {
        let m = tessera_metrics::Metrics::new();
        let s = Metered::new(Batched(Default::default()), Tier::Origin, &m);
        let got = crate::read_all(&s, &Sha256Digest::of(b"pack"), &[(0, 10), (10, 20), (40, 5)]).unwrap();
        assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), [10, 20, 5]);
        assert_eq!(s.inner().0.load(std::sync::atomic::Ordering::Relaxed), 1, "one call underneath");
        let origin = m.tiers.of(Tier::Origin);
        assert_eq!((origin.hits.get(), origin.bytes.get(), origin.errors.get()), (3, 35, 0));
    }
}
