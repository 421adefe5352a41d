//! The [`VhostUserBackend`] implementation: one worker thread per queue, each draining its ring
//! on every kick through [`serve_chain`].

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{trace, warn};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::config::{DeviceConfig, MAX_QUEUE_SIZE};
use crate::execute::{serve_chain, Disk};

/// Guest memory as the framework hands it over (no dirty-page bitmap).
pub type GuestMem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// A vhost-user-blk backend serving one device. Cheap to clone (the framework clones it into
/// every worker); make a fresh one per connection.
#[derive(Clone)]
pub struct BlkBackend {
    inner: Arc<Inner>,
}

struct Inner {
    device: DeviceConfig,
    disk: Disk,
    event_idx: AtomicBool,
    mem: Mutex<Option<GuestMem>>,
    /// One bounce buffer per queue (queue `i` is served by worker thread `i`).
    bounce: Vec<Mutex<Vec<u8>>>,
}

impl std::fmt::Debug for BlkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkBackend").field("device", &self.inner.device).finish_non_exhaustive()
    }
}

impl BlkBackend {
    /// A backend for `device` served from `disk`.
    pub fn new(device: DeviceConfig, disk: Disk) -> Self {
        let bounce = (0..device.queues).map(|_| Mutex::new(Vec::new())).collect();
        Self {
            inner: Arc::new(Inner {
                device,
                disk,
                event_idx: AtomicBool::new(false),
                mem: Mutex::new(None),
                bounce,
            }),
        }
    }

    /// The device served.
    pub fn device(&self) -> &DeviceConfig {
        &self.inner.device
    }

    /// Drain every available chain of `vring` (queue `queue`), signalling the guest once per
    /// batch, before notifications are re-enabled. Queue errors (a guest-corrupted ring) are
    /// logged, not returned: returning an error would kill the worker for good.
    fn process_queue(&self, vring: &VringRwLock<GuestMem>, queue: usize) {
        let Some(atomic) = lock(&self.inner.mem).clone() else {
            return;
        };
        let Some(bounce) = self.inner.bounce.get(queue) else {
            return;
        };
        let mut bounce = lock(bounce);
        let event_idx = self.inner.event_idx.load(Ordering::Relaxed);
        let mut state = vring.get_mut();
        let result = (|| -> Result<(), virtio_queue::Error> {
            loop {
                if event_idx {
                    state.get_queue_mut().disable_notification(&*atomic.memory())?;
                }
                let mut served = 0usize;
                loop {
                    // A fresh snapshot per chain (an atomic load): the GuestMemoryAtomic changes
                    // on every ADD_MEM_REG (libblkio maps its buffers right before its first
                    // request), and a chain made available after a map must see the new memory.
                    let mem = atomic.memory();
                    let Some(chain) = state.get_queue_mut().pop_descriptor_chain(&*mem) else { break };
                    let head = chain.head_index();
                    let done = serve_chain(chain, &*mem, &self.inner.disk, &self.inner.device, &mut bounce);
                    state.get_queue_mut().add_used(&*mem, head, done.used_len)?;
                    served += 1;
                }
                let mem = atomic.memory();
                if served > 0 {
                    trace!(queue, served, "batch");
                    if state.get_queue_mut().needs_notification(&*mem)? {
                        if let Err(e) = state.signal_used_queue() {
                            warn!(queue, error = %e, "cannot signal the guest");
                        }
                    }
                }
                if !event_idx || !state.get_queue_mut().enable_notification(&*mem)? {
                    return Ok(());
                }
            }
        })();
        if let Err(e) = result {
            warn!(queue, error = %e, "virtqueue error; waiting for the next kick");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here can be left half-updated by a panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock<GuestMem>;

    fn num_queues(&self) -> usize {
        usize::from(self.inner.device.queues)
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.inner.device.features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        DeviceConfig::protocol_features()
    }

    fn set_event_idx(&self, enabled: bool) {
        self.inner.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.inner.device.read_config(offset, size)
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::PermissionDenied, "the configuration space is read-only"))
    }

    fn update_memory(&self, mem: GuestMem) -> io::Result<()> {
        *lock(&self.inner.mem) = Some(mem);
        Ok(())
    }

    /// One worker thread per queue (bitmasks: thread `i` serves queue `i`).
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.inner.device.queues).map(|i| 1u64 << i).collect()
    }

    /// A fresh event pair per worker, or workers of a finished connection never exit.
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok(pair) => Some(pair),
            Err(e) => {
                warn!(error = %e, "cannot create a worker exit event");
                None
            }
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            warn!(device_event, ?evset, "unexpected event set");
            return Ok(());
        }
        // `device_event` indexes this thread's vrings; thread `i` serves queue `i`.
        if let Some(vring) = vrings.get(usize::from(device_event)) {
            self.process_queue(vring, thread_id);
        }
        Ok(())
    }
}
