//! Ties the daemon's parts to [`Metrics`]: values they already keep (the store's tiers, the
//! overlay's block map; the memory tier publishes itself, `tessera_engine::metrics`) are copied in at each scrape, so their hot paths pay nothing more.
//! Requests are counted by the backend itself (`tessera_vhost::Server::with_metrics`).

use std::sync::Arc;

use tessera_metrics::{mirror, Metrics, Tier};
use tessera_store::{OpenImage, OpenedStore};

use tessera_overlay::Overlay;

/// Publish the counters of `store`'s tiers below memory: the host disk cache (hits, misses,
/// bytes, corrupt entries; what it fetched from the origin counts as origin reads) and the
/// remote origin's transport (requests, retries, bytes, errors by kind; its request-duration
/// histogram is adopted now).
pub fn watch_store(metrics: &Arc<Metrics>, store: &OpenedStore) {
    if let Some(t) = &store.origin {
        metrics.adopt_origin_latency(t.latency_histogram());
    }
    let m = Arc::clone(metrics);
    let (cache, origin) = (store.cache.clone(), store.origin.clone());
    metrics.on_scrape(move || {
        if let Some(cache) = &cache {
            let c = cache.stats();
            let disk = m.tiers.of(Tier::DiskCache);
            mirror(&disk.hits, c.hits);
            mirror(&disk.bytes, c.hit_bytes);
            mirror(&disk.misses, c.misses);
            mirror(&m.disk_cache.corrupt, c.corrupt);
            mirror(&m.disk_cache.evictions, c.evictions);
            mirror(&m.disk_cache.evicted_bytes, c.evicted_bytes);
            let origin = m.tiers.of(Tier::Origin);
            mirror(&origin.hits, c.fetches);
            mirror(&origin.bytes, c.fetch_bytes);
            mirror(&m.disk_cache.full_skips, c.full_skips);
            m.disk_cache.capacity_bytes.set(gauge_value(cache.max_bytes().unwrap_or(0)));
            // Never waits for the cache-wide lock (another process's `cache gc` may hold it for
            // minutes): while it is busy the gauge keeps the last size read.
            match cache.size_now() {
                Ok(Some((bytes, _entries))) => m.disk_cache.bytes.set(gauge_value(bytes)),
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "disk cache size"),
            }
        }
        if let Some(h) = origin.as_ref().map(|t| t.stats()) {
            mirror(&m.origin.requests, h.requests);
            mirror(&m.origin.retries, h.retries);
            mirror(&m.origin.resends, h.resends);
            mirror(&m.origin.bytes, h.bytes);
            let errors = &m.origin.errors;
            mirror(&errors.status, h.errors.status);
            mirror(&errors.transport, h.errors.transport);
            mirror(&errors.timeout, h.errors.timeout);
            mirror(&errors.body, h.errors.body);
            mirror(&errors.digest, h.errors.digest);
        }
    });
}

/// Publish `overlay`'s written and zeroed blocks, file size and syncs.
pub fn watch_overlay(metrics: &Arc<Metrics>, overlay: &Arc<Overlay>) {
    let m = Arc::clone(metrics);
    let overlay = Arc::downgrade(overlay);
    metrics.on_scrape(move || {
        let Some(overlay) = overlay.upgrade() else { return };
        let stats = overlay.stats();
        let block = u64::from(overlay.params().block_size);
        m.overlay.written_blocks.set(gauge_value(stats.written_blocks));
        m.overlay.zero_blocks.set(gauge_value(stats.zero_blocks));
        m.overlay.file_bytes.set(gauge_value(stats.file_slots.saturating_mul(block)));
        mirror(&m.overlay.syncs, stats.syncs);
    });
}

/// Publish the device size and the image's chunk count, chunk bytes and prefix size.
pub fn describe_image(metrics: &Metrics, image: &OpenImage) {
    let chunks = image.record().block_map.chunks();
    metrics.device.device_bytes.set(gauge_value(image.device_bytes()));
    metrics.device.image_chunks.set(gauge_value(chunks.len() as u64));
    metrics.device.image_chunk_bytes.set(gauge_value(chunks.iter().map(|c| u64::from(c.len)).sum()));
    metrics.device.image_prefix_bytes.set(gauge_value(image.prefix().len() as u64));
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
