//! `--record-trace`: a real libblkio client reads through the daemon; the trace lists exactly the
//! chunks those reads needed, each once, in first-touch order — and nothing for reads of the
//! metadata prefix or of zeros.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{fixture, reader, Client, Running};
use tessera_engine::{FetchLimits, MemTier, TraceRecorder};
use tessera_image::{ChunkId, SegmentSource, Trace};
use tessera_vhost::{DeviceConfig, Disk};

#[test]
fn the_trace_lists_first_touches_in_order() {
    let f = fixture();
    let plain = reader(&f.store, &f.id);
    let map = plain.image().record().block_map.clone();
    let g = plain.image().record().geometry;
    let kind_at = |offset: u64| map.plan(offset, 4096).unwrap().next().unwrap().source;
    // Device offsets of the first block of three distinct chunks, in file-data order.
    let mut chunk_offsets: Vec<(u64, u32)> = Vec::new();
    for block in g.data_start_block..g.data_end_block {
        if let SegmentSource::Chunk { chunk, .. } = kind_at(block * 4096) {
            if chunk_offsets.iter().all(|&(_, c)| c != chunk) {
                chunk_offsets.push((block * 4096, chunk));
            }
        }
    }
    assert!(chunk_offsets.len() >= 3);
    let zero_off = (g.data_end_block..g.blocks)
        .map(|b| b * 4096)
        .find(|&o| matches!(kind_at(o), SegmentSource::Zero))
        .unwrap();

    let trace_path = f.dir.path().join("boot.trace");
    let recorder = Arc::new(TraceRecorder::create(&trace_path, f.id, &map).unwrap());
    let tier = MemTier::new(reader(&f.store, &f.id), 64 << 20, FetchLimits::new(4))
        .unwrap()
        .with_trace(recorder.clone());
    let device = DeviceConfig::new(&f.id, tier.device_bytes(), 1, true);
    let server = Running::serve(&f.dir.path().join("trace.sock"), device, Disk::Base(Arc::new(tier)));
    let mut c = Client::connect(&server.socket, 1);
    let (a, b, d) = (chunk_offsets[2], chunk_offsets[0], chunk_offsets[1]);
    // Superblock (prefix), zeros: no chunk. Then chunk a, a again, b; a flush in between; then d.
    for (off, _) in [(0, 0), (zero_off, 0), a, a, b] {
        assert_eq!(c.read(off, 0, 4096), 0);
    }
    recorder.flush().unwrap();
    assert_eq!(c.read(d.0, 0, 4096), 0);
    assert_eq!(c.read(b.0, 0, 4096), 0);
    drop(c);
    server.finish();
    assert_eq!(recorder.finish().unwrap(), 3);

    let trace = Trace::decode(&std::fs::read(&trace_path).unwrap()).unwrap();
    assert_eq!(trace.image(), f.id);
    let id = |chunk: u32| map.chunks()[chunk as usize].id;
    let got: Vec<ChunkId> = trace.entries().iter().map(|e| e.chunk).collect();
    assert_eq!(got, vec![id(a.1), id(b.1), id(d.1)]);
    assert_eq!(trace.entries()[0].at_us, 0);
}
