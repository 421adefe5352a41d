//! Publishes the memory tier's figures in [`Metrics`]: the counters it already keeps are copied
//! in at each scrape, so its hot paths pay nothing more.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tessera_metrics::{mirror, Metrics, Tier};
use tessera_store::ChunkSource;

use crate::tier::{Ahead, MemTier};

/// Publish `tier`'s hits, misses, fills and size (as `tier="memory"`).
pub fn watch_mem_tier<S: ChunkSource + 'static>(metrics: &Arc<Metrics>, tier: &Arc<MemTier<S>>) {
    metrics.memory_tier.capacity_bytes.set(gauge_value(tier.capacity()));
    let m = Arc::clone(metrics);
    let tier = Arc::downgrade(tier);
    metrics.on_scrape(move || {
        let Some(tier) = tier.upgrade() else { return };
        // First: delivers moka's pending evictions (prefetched chunks evicted unused).
        m.memory_tier.bytes.set(gauge_value(tier.weighted_size()));
        m.prefetch.unused_bytes.set(gauge_value(tier.prefetch_unused_bytes()));
        let stats = tier.stats();
        let memory = m.tiers.of(Tier::Memory);
        mirror(&memory.hits, stats.hits.load(Ordering::Relaxed));
        mirror(&memory.misses, stats.misses.load(Ordering::Relaxed));
        mirror(&m.memory_tier.fills, stats.fetches.load(Ordering::Relaxed));
        mirror(&m.memory_tier.fill_bytes, stats.fetched_bytes.load(Ordering::Relaxed));
        mirror(&m.memory_tier.refetches, tier.refetches());
        let (spans, stored) = tier.reader().span_bytes();
        m.memory_tier.span_bytes.set(gauge_value(spans));
        m.memory_tier.span_stored_bytes.set(gauge_value(stored));
        mirror(&m.prefetch.readahead_queued, stats.readahead_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.pack_window_queued, stats.pack_window_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.profile_queued, stats.prefetch_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.whole_file_queued, stats.whole_file_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.stretch_queued, stats.stretch_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.elf_deps_queued, stats.elf_dep_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.chunks, stats.prefetched_chunks.load(Ordering::Relaxed));
        mirror(&m.prefetch.bytes, stats.prefetched_bytes.load(Ordering::Relaxed));
        mirror(&m.prefetch.used_bytes, stats.prefetch_used_bytes.load(Ordering::Relaxed));
        mirror(&m.prefetch.wasted_bytes, stats.prefetch_wasted_bytes.load(Ordering::Relaxed));
        for why in Ahead::ALL {
            let a = stats.ahead(why);
            for (outcome, n) in
                [("fetched", &a.fetched_bytes), ("used", &a.used_bytes), ("wasted", &a.wasted_bytes)]
            {
                mirror(
                    &m.prefetch.reason_bytes.with_label_values(&[why.label(), outcome]),
                    n.load(Ordering::Relaxed),
                );
            }
        }
        m.memory_tier.chunks.set(gauge_value(tier.chunks()));
        m.fetch.queue_depth.set(gauge_value(tier.pending_fetches() as u64));
        let f = tier.fetcher_stats();
        m.fetch.threads.set(gauge_value(f.threads.load(Ordering::Relaxed) as u64));
        mirror(&m.fetch.demand_fetches, f.demand.load(Ordering::Relaxed));
        mirror(&m.fetch.background_fetches, f.background.load(Ordering::Relaxed));
        mirror(&m.fetch.joined, f.joined.load(Ordering::Relaxed));
        mirror(&m.fetch.behind_background, f.behind_background.load(Ordering::Relaxed));
        mirror(&m.fetch.remembered_failures, f.remembered_failures.load(Ordering::Relaxed));
    });
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
