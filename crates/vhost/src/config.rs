//! The device's identity and limits: virtio feature bits, the virtio-blk configuration space
//! (`struct virtio_blk_config`, 96 bytes, little-endian) and the GET_ID serial.

use tessera_image::{BlockSize, ImageId};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO,
    VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES,
};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::request::{MAX_DISCARD_SEGMENTS, SECTOR_SIZE, SEG_MAX};

/// Size of `struct virtio_blk_config` (up to and including the zoned fields).
pub const CONFIG_SPACE_LEN: usize = 96;
/// Largest single data buffer the guest may use (`size_max`).
pub const SIZE_MAX: u32 = 1 << 20;
/// Ring size the backend accepts; microvm uses 1024-entry rings whatever `queue-size` says.
pub const MAX_QUEUE_SIZE: usize = 1024;
/// Most queues a device may have.
pub const MAX_QUEUES: u16 = 64;
/// Largest DISCARD / WRITE_ZEROES range in sectors (advertised when writable).
pub const MAX_DISCARD_SECTORS: u32 = u32::MAX / SECTOR_SIZE as u32;

/// Everything that decides what the guest sees of the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device size in bytes (a multiple of 512).
    pub capacity_bytes: u64,
    /// Number of virtqueues (1..=[`MAX_QUEUES`]).
    pub queues: u16,
    /// Whether the device refuses writes (VIRTIO_BLK_F_RO).
    pub read_only: bool,
    /// The GET_ID answer.
    pub serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
}

impl DeviceConfig {
    /// A device for image `id` of `capacity_bytes`.
    pub fn new(id: &ImageId, capacity_bytes: u64, queues: u16, read_only: bool) -> Self {
        Self { capacity_bytes, queues, read_only, serial: serial_for(id) }
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_bytes / SECTOR_SIZE
    }

    /// The virtio feature bits offered (PROTOCOL_FEATURES included: the framework does not add it).
    pub fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_BLK_F_SIZE_MAX)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_MQ)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= (1 << VIRTIO_BLK_F_DISCARD) | (1 << VIRTIO_BLK_F_WRITE_ZEROES);
        }
        f
    }

    /// The vhost-user protocol features offered (vhost adds REPLY_ACK handling itself).
    pub fn protocol_features() -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
    }

    /// The whole configuration space.
    pub fn config_space(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut c = [0u8; CONFIG_SPACE_LEN];
        let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &self.capacity_sectors().to_le_bytes()); // capacity
        put(8, &SIZE_MAX.to_le_bytes()); // size_max
        put(12, &SEG_MAX.to_le_bytes()); // seg_max
                                         // 16..20 geometry: not offered
        put(20, &BlockSize::U32.to_le_bytes()); // blk_size: the image's block size
                                                // 24..32 topology: not offered; 32 writeback: no CONFIG_WCE
        put(34, &self.queues.to_le_bytes()); // num_queues
        if !self.read_only {
            let align = BlockSize::U32 / SECTOR_SIZE as u32;
            put(36, &MAX_DISCARD_SECTORS.to_le_bytes()); // max_discard_sectors
            put(40, &MAX_DISCARD_SEGMENTS.to_le_bytes()); // max_discard_seg
            put(44, &align.to_le_bytes()); // discard_sector_alignment
            put(48, &MAX_DISCARD_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
            put(52, &MAX_DISCARD_SEGMENTS.to_le_bytes()); // max_write_zeroes_seg
            put(56, &[1]); // write_zeroes_may_unmap
        }
        c
    }

    /// Exactly `size` bytes of the configuration space from `offset`; bytes past its end read as
    /// zeros (clients ask for different prefixes: libblkio 60 bytes, QEMU 57, the struct is 96,
    /// and any other reply length makes them fail).
    pub fn read_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = self.config_space();
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(CONFIG_SPACE_LEN);
        let end = (offset as usize).saturating_add(size as usize).min(CONFIG_SPACE_LEN);
        if start < end {
            out[..end - start].copy_from_slice(&space[start..end]);
        }
        out
    }
}

/// The 20-byte GET_ID serial of an image: `tessera-` and the first 12 hex digits of its ID
/// (stable across daemons and hosts; exactly 20 bytes, so no NUL terminator, as the spec allows).
pub fn serial_for(id: &ImageId) -> [u8; VIRTIO_BLK_ID_BYTES as usize] {
    let mut s = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let text = format!("tessera-{}", id.digest().hex());
    let n = s.len().min(text.len());
    s[..n].copy_from_slice(&text.as_bytes()[..n]);
    s
}

#[cfg(test)]
mod tests {
    use tessera_image::Sha256Digest;

    use super::*;

    fn cfg(read_only: bool) -> DeviceConfig {
        DeviceConfig::new(&ImageId(Sha256Digest::of(b"x")), 8 << 20, 2, read_only)
    }

    #[test]
    fn config_space_layout() {
        let c = cfg(true).config_space();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), (8 << 20) / 512);
        assert_eq!(u32::from_le_bytes(c[8..12].try_into().unwrap()), SIZE_MAX);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), SEG_MAX);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert!(c[36..].iter().all(|&b| b == 0));
        let w = cfg(false).config_space();
        assert_eq!(u32::from_le_bytes(w[40..44].try_into().unwrap()), 1);
        assert_eq!(w[56], 1);
    }

    #[test]
    fn read_config_returns_exactly_size_bytes() {
        let d = cfg(true);
        for (offset, size) in [(0, 60), (0, 57), (0, 96), (8, 4), (90, 20), (200, 8), (0, 0)] {
            let got = d.read_config(offset, size);
            assert_eq!(got.len(), size as usize, "offset {offset} size {size}");
        }
        assert_eq!(d.read_config(8, 4), SIZE_MAX.to_le_bytes());
        assert_eq!(d.read_config(u32::MAX, 4), vec![0; 4]);
    }

    #[test]
    fn features_and_serial() {
        let ro = cfg(true).features();
        assert_ne!(ro & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(ro & (1 << VIRTIO_BLK_F_DISCARD), 0);
        assert_ne!(ro & (1 << 30), 0, "PROTOCOL_FEATURES");
        assert_ne!(ro & (1 << 32), 0, "VERSION_1");
        let rw = cfg(false).features();
        assert_eq!(rw & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(rw & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
        let s = cfg(true).serial;
        assert!(s.starts_with(b"tessera-"));
        assert_eq!(s, serial_for(&ImageId(Sha256Digest::of(b"x"))));
        assert_ne!(s, serial_for(&ImageId(Sha256Digest::of(b"y"))));
    }
}
