//! Out-of-order completion: a read that misses the memory tier is finished by the fetch pool,
//! so one slow fetch never stalls the other requests of its queue. The slow fetch comes from a
//! chunk source that holds one chunk back until the test opens a gate (fault injection, no
//! timing).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Condvar, Mutex};

use blkio::ReqFlags;
use common::{fixture, reader, Client, Running};
use tessera_engine::{FetchLimits, MemTier};
use tessera_image::{SegmentSource, Sha256Digest};
use tessera_store::{ChunkSource, ImageReader, LocalStore, OpenImage, StoreError};
use tessera_vhost::{DeviceConfig, Disk};

/// A chunk source whose read of one pack range blocks until [`Gate::open`].
struct Gated {
    inner: LocalStore,
    held: (Sha256Digest, u64),
    gate: Arc<Gate>,
}

#[derive(Default)]
struct Gate {
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Gate {
    fn open(&self) {
        self.state.lock().unwrap().0 = true;
        self.changed.notify_all();
    }

    /// Block until a held read is waiting at the gate.
    fn wait_for_waiter(&self) {
        let mut s = self.state.lock().unwrap();
        while s.1 == 0 {
            s = self.changed.wait(s).unwrap();
        }
    }
}

impl ChunkSource for Gated {
    fn read_stored(&self, pack: &Sha256Digest, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        if (*pack, offset) == self.held {
            let mut s = self.gate.state.lock().unwrap();
            s.1 += 1;
            self.gate.changed.notify_all();
            while !s.0 {
                s = self.gate.changed.wait(s).unwrap();
            }
        }
        self.inner.read_stored(pack, offset, len)
    }
}

/// The BlockMap chunk holding device byte `offset`, if any.
fn chunk_at(r: &ImageReader<LocalStore>, offset: u64) -> Option<u32> {
    let seg = r.image().record().block_map.plan(offset, 4096).unwrap().next()?;
    match seg.source {
        SegmentSource::Chunk { chunk, .. } => Some(chunk),
        _ => None,
    }
}

/// The memory tier over `source`. With `fetcher`, the chunks of a read missing memory are
/// fetched ahead on the chunk fetcher's threads; without it the tier keeps nothing in memory
/// and such a read is finished (fetching inline) as a job on those threads.
fn tier(f: &common::Fixture, source: Gated, fetcher: bool) -> Arc<MemTier<Gated>> {
    let image = OpenImage::open(&f.store, &f.id).unwrap();
    let memory = if fetcher { 64 << 20 } else { 0 };
    Arc::new(MemTier::new(ImageReader::new(image, source), memory, FetchLimits::new(4)).unwrap())
}

#[test]
fn a_slow_fetch_does_not_stall_the_queue() {
    slow_fetch(false)
}

#[test]
fn a_slow_fetch_does_not_stall_the_queue_with_the_chunk_fetcher() {
    slow_fetch(true)
}

fn slow_fetch(fetcher: bool) {
    let f = fixture();
    let plain = reader(&f.store, &f.id);
    let g = plain.image().record().geometry;
    // Device offsets of 4 KiB blocks in distinct chunks, in the file-data region.
    let mut seen = HashSet::new();
    let mut targets = Vec::new();
    for block in g.data_start_block..g.data_end_block {
        let off = block * 4096;
        if let Some(c) = chunk_at(&plain, off) {
            if seen.insert(c) {
                targets.push((off, c));
            }
        }
    }
    assert!(targets.len() >= 9, "need 9 distinct chunks, have {}", targets.len());
    let (slow_off, slow_chunk) = targets[0];
    let (_, pack, loc) = plain.image().chunk_location(slow_chunk).unwrap();
    let gate = Arc::new(Gate::default());
    let source = Gated { inner: f.store.clone(), held: (pack, loc.offset), gate: Arc::clone(&gate) };
    let tier = tier(&f, source, fetcher);
    let device = DeviceConfig::new(&f.id, tier.device_bytes(), 1, true);
    let server = Running::serve(&f.dir.path().join("async.sock"), device, Disk::Base(tier.clone()));

    let mut c = Client::connect(&server.socket, 1);
    // The slow read first, then eight reads of other chunks (misses too) and one of the
    // metadata prefix (served inline), all on queue 0.
    let ptr = c.ptr(0);
    c.queues[0].read(slow_off, ptr, 4096, 0, ReqFlags::empty());
    let mut expect = vec![(0usize, slow_off)];
    for (i, &(off, _)) in targets[1..9].iter().enumerate() {
        let user = i + 1;
        let ptr = c.ptr(user * 4096);
        c.queues[0].read(off, ptr, 4096, user, ReqFlags::empty());
        expect.push((user, off));
    }
    let ptr = c.ptr(9 * 4096);
    c.queues[0].read(0, ptr, 4096, 9, ReqFlags::empty());
    expect.push((9, 0));
    // The slow fetch is held at the gate while the nine others complete.
    let first = c.complete(0, 9);
    gate.wait_for_waiter();
    let users: HashSet<usize> = first.iter().map(|d| d.0).collect();
    assert_eq!(users, (1..=9).collect::<HashSet<_>>(), "the held read completed before the gate opened");
    assert!(first.iter().all(|d| d.1 == 0));
    gate.open();
    let last = c.complete(0, 1);
    assert_eq!(last, vec![(0, 0)]);
    for (user, off) in expect {
        let off = off as usize;
        assert!(c.buf(user * 4096, 4096) == &f.raw[off..off + 4096], "request {user} at {off}");
    }
    assert!(tier.stats().fetches.load(std::sync::atomic::Ordering::Relaxed) >= 9);
    drop(c);
    server.finish();
}

#[test]
fn a_client_leaving_with_a_read_in_flight() {
    client_leaving(false)
}

#[test]
fn a_client_leaving_with_a_read_in_flight_with_the_chunk_fetcher() {
    client_leaving(true)
}

fn client_leaving(fetcher: bool) {
    let f = fixture();
    let (slow_off, gate, server, c) = held_read(&f, fetcher, "leave.sock");
    drop(c);
    // The next client connects while the old read is still held; the server finishes it (into
    // the old client's memory) before serving the new one, whose ring sees only its own reads.
    let socket = server.socket.clone();
    let next = std::thread::spawn(move || {
        let mut c = Client::connect(&socket, 1);
        let r = c.read(slow_off, 0, 4096);
        (r, c.buf(0, 4096).to_vec())
    });
    gate.open();
    let (ret, bytes) = next.join().unwrap();
    assert_eq!(ret, 0);
    let off = slow_off as usize;
    assert!(bytes == f.raw[off..off + 4096]);
    server.finish();
}

/// A stop (SIGTERM) while a read waits for its fetch: the read finishes its I/O, but it is not
/// completed into the client's ring once the connection is closed — a VMM stops watching the
/// ring's interrupts then, so a completion added later would never reach the guest and the
/// next daemon would not resubmit it. It stays in flight (in the in-flight area, for a VMM that
/// shares one) for the next daemon to resubmit.
#[test]
fn a_read_in_flight_at_a_stop_is_left_for_the_next_daemon() {
    let f = fixture();
    let (_, gate, mut server, mut c) = held_read(&f, true, "stop.sock");
    server.stop.stop();
    gate.open();
    // The server waits for the read's I/O, then joins its workers and returns: after that
    // nothing can reach the ring any more.
    server.thread.take().unwrap().join().unwrap().unwrap();
    let mut one = [std::mem::MaybeUninit::<blkio::Completion>::uninit()];
    let mut timeout = std::time::Duration::from_millis(0);
    let got = c.queues[0].do_io(&mut one, 0, Some(&mut timeout), None);
    let first = matches!(got, Ok(1)).then(|| {
        // SAFETY: do_io initialized the first entry.
        let c = unsafe { one[0].assume_init_ref() };
        (c.user_data, c.ret)
    });
    assert!(
        matches!(got, Ok(0) | Err(_)),
        "the read was completed into the ring after the stop: {got:?} {first:?}"
    );
}

/// A server over `f` whose source holds the first data chunk's read at the gate, a client on
/// it, and that chunk's read submitted on queue 0 and held (the server waits at the gate);
/// returns the read's device offset.
fn held_read(f: &common::Fixture, fetcher: bool, socket: &str) -> (u64, Arc<Gate>, Running, Client) {
    let plain = reader(&f.store, &f.id);
    let g = plain.image().record().geometry;
    let (slow_off, slow_chunk) = (g.data_start_block..g.data_end_block)
        .find_map(|b| chunk_at(&plain, b * 4096).map(|c| (b * 4096, c)))
        .unwrap();
    let (_, pack, loc) = plain.image().chunk_location(slow_chunk).unwrap();
    let gate = Arc::new(Gate::default());
    let source = Gated { inner: f.store.clone(), held: (pack, loc.offset), gate: Arc::clone(&gate) };
    let tier = tier(f, source, fetcher);
    let device = DeviceConfig::new(&f.id, tier.device_bytes(), 1, true);
    let server = Running::serve(&f.dir.path().join(socket), device, Disk::Base(tier));

    let mut c = Client::connect(&server.socket, 1);
    // A read served before the held one completes as usual.
    assert_eq!(c.read(0, 4096, 4096), 0);
    let ptr = c.ptr(0);
    c.queues[0].read(slow_off, ptr, 4096, 0, ReqFlags::empty());
    // Submit without waiting for the completion.
    let mut none: [std::mem::MaybeUninit<blkio::Completion>; 0] = [];
    let mut timeout = std::time::Duration::from_millis(0);
    let _ = c.queues[0].do_io(&mut none, 0, Some(&mut timeout), None);
    gate.wait_for_waiter();
    (slow_off, gate, server, c)
}
