//! A guest that floods the device with bad requests cannot flood the host's logs: 10 000
//! malformed chains and 10 000 failing reads give at most a burst of warnings each
//! (`log_limit`), and the daemon keeps answering every request. Its own test binary, so the
//! per-call-site limits are not shared with other tests.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use tessera_image::{ImageId, Sha256Digest};
use tessera_vhost::{serve_chain, DeviceConfig, Disk, Status};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

mod failing;
use failing::Failing;

/// Log lines, shared with the subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_flood_of_bad_requests_gives_a_few_warnings() {
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let mem: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let device = DeviceConfig::new(&ImageId(Sha256Digest::of(b"flood")), 4 << 20, 1, true);
    let disk = Disk::Base(Arc::new(Failing));
    let d = |addr: u64, len: u32, flags: u16| RawDescriptor::from(Descriptor::new(addr, len, flags, 0));
    let (hdr, data, status) = (0x10000, 0x20000, 0x80000);
    mem.write_slice(&[0u8; 16], GuestAddress(hdr)).unwrap(); // a read of sector 0
    const N: usize = 10_000;
    let mut failed = 0;
    tracing::subscriber::with_default(subscriber, || {
        for _ in 0..N {
            // No device-writable status byte: dropped.
            let q = MockSplitQueue::new(&mem, 16);
            let chain = q.build_desc_chain(&[d(hdr, 16, 0), d(status, 1, 0)]).unwrap();
            assert_eq!(serve_chain(chain, &mem, &disk, &device, &mut Vec::new()).status, None);
            // A read the image fails: answered with an I/O error.
            let q = MockSplitQueue::new(&mem, 16);
            let chain = q.build_desc_chain(&[d(hdr, 16, 0), d(data, 512, 2), d(status, 1, 2)]).unwrap();
            let c = serve_chain(chain, &mem, &disk, &device, &mut Vec::new());
            failed += usize::from(c.status == Some(Status::IoErr));
        }
    });
    assert_eq!(failed, N, "every failing read is still answered");
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let count = |what: &str| text.lines().filter(|l| l.contains(what)).count();
    let (malformed, read_failed) = (count("dropping a malformed descriptor chain"), count("request failed"));
    eprintln!("{N} malformed chains → {malformed} log lines; {N} failed reads → {read_failed} log lines");
    assert!((1..=5).contains(&malformed), "{malformed} lines for {N} malformed chains:\n{text}");
    assert!((1..=5).contains(&read_failed), "{read_failed} lines for {N} failed reads:\n{text}");
    assert!(
        text.lines().all(|l| l.contains("suppressed=0")),
        "the first burst reports no suppressed messages"
    );
}
