//! Helpers of the engine's integration tests.

use std::time::Duration;

use tessera_engine::BlockDevice;
use tessera_image::RunSource;
use tessera_store::OpenImage;

/// Ask the tier for a one-byte read of chunk `chunk`'s first block (missing only that chunk);
/// whether it succeeded within 10 s.
pub fn read_first_byte_of(tier: &impl BlockDevice, image: &OpenImage, chunk: u32) -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    tier.fetch_ahead(
        first_offset_of(image, chunk),
        1,
        Box::new(move |r| {
            let _ = tx.send(r.is_ok());
        }),
    );
    rx.recv_timeout(Duration::from_secs(10)).unwrap()
}

/// The device offset of chunk `chunk`'s first block.
pub fn first_offset_of(image: &OpenImage, chunk: u32) -> u64 {
    let runs = image.record().block_map.runs();
    let run = runs.iter().find(|r| r.source == RunSource::Chunk { chunk, block: 0 });
    run.unwrap().start * 4096
}
