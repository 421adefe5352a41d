//! The [`VhostUserBackend`] implementation: one worker thread per queue, each draining its ring
//! on every kick through [`start_chain`]; reads missing the memory tier complete out of order.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use tessera_metrics::{Metrics, RequestMetrics};
use tracing::{debug, debug_span, info, trace, warn};
use vhost::vhost_user::message::{VhostUserInflight, VhostUserProtocolFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringState, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{DeviceConfig, MAX_QUEUE_SIZE};
use crate::execute::{start_chain, Completion, DeferredFlush, DeferredRead, Disk, Started};
use crate::inflight::{self, InflightArea, QueueInflight};
use crate::log_limit::LogLimit;
use crate::notify::{involuntary_switches, EarlySignals};
use crate::poll::PollWindow;
use crate::record::RequestRecorder;
use crate::used::{self, Published, UsedRing};
use tessera_overlay::FlushDone;

/// Guest memory as the framework hands it over (no dirty-page bitmap).
pub type GuestMem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// How long `stop_vring` (GET_VRING_BASE) and a disconnect wait for in-flight reads.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// A vhost-user-blk backend serving one device. Cheap to clone (the framework clones it into
/// every worker); make a fresh one per connection.
#[derive(Clone)]
pub struct BlkBackend {
    inner: Arc<Inner>,
}

struct Inner {
    device: DeviceConfig,
    disk: Disk,
    mem: Mutex<Option<GuestMem>>,
    /// Whether reads missing the memory tier complete out of order (finished on the read
    /// engine's threads) rather than inline on the queue thread.
    deferred: bool,
    /// The connection this backend serves (for logs; late completions of an earlier
    /// connection reach that connection's backend, never this one).
    connection: u64,
    queues: Vec<QueueState>,
    metrics: Arc<Metrics>,
    /// `--record-requests`: every completed request goes to the trace.
    recorder: Option<Arc<RequestRecorder>>,
    /// The in-flight tracking area the front-end shares (`SET_INFLIGHT_FD`), if any.
    inflight: RwLock<Option<Arc<InflightArea>>>,
    /// Set once the front-end has gone ([`BlkBackend::detach`]): its rings are no longer ours.
    detached: AtomicBool,
}

/// Per queue: the worker's own state and the out-of-order completions.
struct QueueState {
    /// Held by the queue's worker while it serves the queue (queue `i` is served by worker
    /// thread `i`).
    worker: Mutex<Worker>,
    completions: Mutex<Completions>,
    /// Set when a completion was queued: what a polling worker looks at (one load, no lock).
    pending: AtomicBool,
    /// Signalled whenever `in_flight` drops.
    drained: Condvar,
    /// Written by a fetch thread after it queued a completion; registered with the queue's
    /// worker (`register_listener`), which then adds them to the used ring.
    event: EventFd,
    /// The queue's vring, once its worker has seen it (for `stop_vring`).
    vring: Mutex<Option<VringRwLock<GuestMem>>>,
    /// Whether the guest has been signalled on this connection yet: the first serve of a ring
    /// signals unconditionally (see [`BlkBackend::serve_queue`]).
    signalled: AtomicBool,
    /// Completions published since the guest was last considered for a signal.
    published: Published,
}

/// What a queue's worker keeps between wake-ups.
struct Worker {
    /// Write gathering.
    bounce: Vec<u8>,
    poll: PollWindow,
    /// When the worker last started to wait (the start of the poll window that found nothing,
    /// or when it went to sleep): the next wake-up adapts the window from it.
    idle_since: Option<Instant>,
    /// Whether completions are signalled as the driver asks for them or only once the ring is
    /// drained (`notify`).
    early: EarlySignals,
}

/// Reads finished on the read engine's threads, waiting to be added to the used ring.
#[derive(Default)]
struct Completions {
    /// Bumped by `stop_vring`: a completion of an older generation never reaches the ring.
    generation: u64,
    /// `(head, used_len)`.
    done: Vec<(u16, u32)>,
    /// Deferred reads not finished yet.
    in_flight: usize,
}

impl std::fmt::Debug for BlkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlkBackend")
            .field("device", &self.inner.device)
            .field("connection", &self.inner.connection)
            .finish_non_exhaustive()
    }
}

impl BlkBackend {
    /// A backend for `device` served from `disk`; reads missing the memory tier are fetched
    /// inline on the queue thread.
    pub fn new(device: DeviceConfig, disk: Disk) -> io::Result<Self> {
        Self::build(device, disk, false, 0, Metrics::unregistered(), Duration::ZERO)
    }

    /// A backend whose reads missing the memory tier complete out of order, once the read
    /// engine has fetched what they need ([`tessera_engine::BlockDevice::fetch_ahead`]);
    /// `connection` numbers the client. Requests are counted in `metrics`. Each queue's worker
    /// polls for up to `poll` after draining its ring ([`PollWindow`]; zero: never).
    pub fn deferring(
        device: DeviceConfig,
        disk: Disk,
        connection: u64,
        metrics: Arc<Metrics>,
        poll: Duration,
    ) -> io::Result<Self> {
        Self::build(device, disk, true, connection, metrics, poll)
    }

    fn build(
        device: DeviceConfig,
        disk: Disk,
        deferred: bool,
        connection: u64,
        metrics: Arc<Metrics>,
        poll: Duration,
    ) -> io::Result<Self> {
        let queues = (0..device.queues)
            .map(|_| {
                Ok(QueueState {
                    worker: Mutex::new(Worker {
                        bounce: Vec::new(),
                        poll: PollWindow::new(poll),
                        idle_since: None,
                        early: EarlySignals::default(),
                    }),
                    completions: Mutex::new(Completions::default()),
                    pending: AtomicBool::new(false),
                    drained: Condvar::new(),
                    event: EventFd::new(EFD_NONBLOCK)?,
                    vring: Mutex::new(None),
                    signalled: AtomicBool::new(false),
                    published: Published::default(),
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self {
            inner: Arc::new(Inner {
                device,
                disk,
                mem: Mutex::new(None),
                deferred,
                connection,
                queues,
                metrics,
                recorder: None,
                inflight: RwLock::new(None),
                detached: AtomicBool::new(false),
            }),
        })
    }

    /// Record every request completed from now on into `recorder` (`None`: nothing; call before
    /// the backend is cloned or shared).
    pub fn recording(mut self, recorder: Option<Arc<RequestRecorder>>) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.recorder = recorder;
        }
        self
    }

    /// The device served.
    pub fn device(&self) -> &DeviceConfig {
        &self.inner.device
    }

    /// The `device_event` of the completion eventfd (`register_listener` needs more than
    /// `num_queues`).
    pub fn completion_event(&self) -> u16 {
        self.inner.device.queues + 1
    }

    /// The completion eventfd of queue `queue`, to register with that queue's worker.
    pub fn completion_fd(&self, queue: usize) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.inner.queues.get(queue).map(|q| q.event.as_raw_fd())
    }

    /// Deferred reads not finished yet, over all queues.
    pub fn in_flight(&self) -> usize {
        self.inner.queues.iter().map(|q| lock(&q.completions).in_flight).sum()
    }

    /// Wait until no deferred read is in flight (at most `timeout` per queue); false if some
    /// still are.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.inner.queues.iter().all(|q| wait_drained(q, timeout).0)
    }

    /// The front-end has gone (its connection closed): from now on nothing is added to its
    /// rings, and no new request is taken off them. Once the connection is gone the VMM stops
    /// watching the rings' call eventfds (QEMU replaces its guest notifiers at the next start),
    /// so a completion added to a used ring now would reach guest memory without an interrupt
    /// the guest ever sees, and the next daemon would find nothing to resubmit: the guest would
    /// wait for it forever. A request still in flight finishes its I/O but stays marked in the
    /// in-flight area, which the next daemon the front-end connects resubmits from. Returns
    /// once no worker is serving a ring.
    pub fn detach(&self) {
        self.inner.detached.store(true, Ordering::SeqCst);
        for (queue, qs) in self.inner.queues.iter().enumerate() {
            // A worker serving this ring finishes its turn; the next one sees `detached`.
            drop(lock(&qs.worker));
            let mut c = lock(&qs.completions);
            c.generation += 1;
            if !c.done.is_empty() {
                debug!(
                    connection = self.inner.connection,
                    queue,
                    left = c.done.len(),
                    "completions left in the in-flight area for the next daemon"
                );
            }
            c.done.clear();
        }
    }

    /// Serve queue `queue` after a kick or a completion event: add the deferred reads that
    /// finished to the used ring, drain every available chain (reads missing the memory tier are
    /// deferred to the read engine), signal the guest once per batch, then poll the ring and the
    /// completions for the queue's adaptive window ([`PollWindow`]) before notifications are
    /// re-enabled and the worker sleeps. Queue errors (a guest-corrupted ring) are logged, not
    /// returned: returning an error would kill the worker for good.
    fn serve_queue(&self, vring: &VringRwLock<GuestMem>, queue: usize) {
        let Some(atomic) = lock(&self.inner.mem).clone() else {
            return;
        };
        let Some(qs) = self.inner.queues.get(queue) else {
            return;
        };
        {
            let mut v = lock(&qs.vring);
            if v.is_none() {
                *v = Some(vring.clone());
            }
        }
        let mut worker = lock(&qs.worker);
        if self.inner.detached.load(Ordering::SeqCst) {
            return;
        }
        let Worker { bounce, poll, idle_since, early } = &mut *worker;
        if let Some(since) = idle_since.take() {
            poll.waited(since.elapsed());
        }
        let inline = !self.inner.deferred;
        let requests = &self.inner.metrics.requests;
        let _span = debug_span!("queue", queue).entered();
        let mut state = vring.get_mut();
        // The first serve of a ring on this connection signals the guest whatever it finds:
        // a daemon before this one may have added completions to the used ring after the VMM
        // stopped watching the call eventfd it signalled (a stop between the VMM's disconnect
        // and the daemon noticing it), and a driver waiting for those would wait forever. A
        // spurious interrupt only makes the driver look at the used ring.
        if state.get_call().is_some() && !qs.signalled.swap(true, Ordering::AcqRel) {
            send_signal(&mut state, queue);
        }
        let mut polled_from = None;
        let area = self.inner.inflight_area();
        let track = area.as_ref().and_then(|a| a.queue(queue));
        let mut resubmit = track.as_ref().map(QueueInflight::take_resubmit).unwrap_or_default().into_iter();
        let result = (|| -> Result<(), virtio_queue::Error> {
            loop {
                state.get_queue_mut().disable_notification(&*atomic.memory())?;
                loop {
                    let mut served = self.take_completions(qs, &mut state, &atomic, track.as_ref())?;
                    // The avail index is read once per batch, and a memory snapshot loaded after
                    // it serves every chain up to that index. The index first, then the snapshot
                    // (an atomic load): the GuestMemoryAtomic changes on every ADD_MEM_REG, and a
                    // driver may map a buffer right before the request that uses it (libblkio
                    // does, before its first). A snapshot loaded before the index that shows the
                    // chain — this worker preempted in between — may miss that region and refuse
                    // the buffer as outside guest memory; one loaded after it holds every region
                    // mapped before the chains up to that index were made available.
                    let mut batch: Option<(u16, GuestMemoryLoadGuard<GuestMemoryMmap<()>>)> = None;
                    // When the last inline request finished: the next one's start (one clock
                    // read per request instead of two).
                    let mut finished: Option<Instant> = None;
                    loop {
                        let resubmitting;
                        let mem = if resubmit.as_slice().is_empty() {
                            let q = state.get_queue_mut();
                            if batch.as_ref().is_none_or(|(end, _)| *end == q.next_avail()) {
                                let avail = q.avail_idx(&*atomic.memory(), Ordering::Acquire)?.0;
                                if avail == q.next_avail() {
                                    break;
                                }
                                // More new entries than the ring holds: a guest-corrupted index.
                                // Refused until the ring is set up again; never spun on.
                                if avail.wrapping_sub(q.next_avail()) > q.size() {
                                    return Err(virtio_queue::Error::InvalidAvailRingIndex);
                                }
                                batch = Some((avail, atomic.memory()));
                            }
                            match &batch {
                                Some((_, mem)) => mem,
                                None => break,
                            }
                        } else {
                            resubmitting = atomic.memory();
                            &resubmitting
                        };
                        let Some((head, chain)) = inflight::next_chain(
                            state.get_queue_mut(),
                            &**mem,
                            track.as_ref(),
                            &mut resubmit,
                        ) else {
                            // The index shows work but the ring gives no chain: it is broken
                            // (the queue says why in its own log). Stop here, or the poll
                            // below would find the same "work" again and spin.
                            return Err(virtio_queue::Error::QueueNotReady);
                        };
                        let taken = finished.take().unwrap_or_else(Instant::now);
                        requests.in_flight.inc();
                        match start_chain(chain, &**mem, &self.inner.disk, &self.inner.device, bounce, inline)
                        {
                            Started::Done(done) => {
                                requests.in_flight.dec();
                                let now = Instant::now();
                                requests.of(done.kind).record(
                                    done.metric_status(),
                                    done.bytes,
                                    now.saturating_duration_since(taken),
                                );
                                if let Some(r) = &self.inner.recorder {
                                    r.record(queue, &done, taken);
                                }
                                let q = state.get_queue_mut();
                                let used = UsedRing::new(&**mem, q);
                                inflight::add_used(
                                    track.as_ref(),
                                    q,
                                    &used,
                                    &qs.published,
                                    head,
                                    done.used_len,
                                )?;
                                served += 1;
                                finished = Some(now);
                                early.served(now.saturating_duration_since(taken));
                                let queued =
                                    batch.as_ref().map_or(0, |(end, _)| end.wrapping_sub(q.next_avail()));
                                if q.event_idx_enabled() && early.due(queued, now) {
                                    signal_early(
                                        &mut state,
                                        mem,
                                        &qs.published,
                                        queue,
                                        early,
                                        now,
                                        requests,
                                    )?;
                                }
                            }
                            Started::Deferred(d) => {
                                self.defer(queue, head, d, mem.clone().into_inner(), taken);
                            }
                            Started::Flush(f) => {
                                // Nothing queued behind it: commit on this thread (a lone FLUSH
                                // then costs no hand-off); else let the ring go on meanwhile.
                                let q = state.get_queue_mut();
                                let idle = q.avail_idx(&**mem, Ordering::Acquire)?.0 == q.next_avail();
                                self.commit(queue, head, f, mem.clone().into_inner(), taken, idle)
                            }
                        }
                    }
                    if served > 0 {
                        trace!(queue, served, "batch");
                        signal(&mut state, &atomic.memory(), &qs.published, queue)?;
                    }
                    let window = poll.current();
                    if window.is_zero() {
                        break;
                    }
                    let started = Instant::now();
                    polled_from = Some(started);
                    if !poll_for_work(&mut state, &atomic.memory(), qs, started, window)? {
                        break;
                    }
                }
                if !state.get_queue_mut().enable_notification(&*atomic.memory())? {
                    return Ok(());
                }
            }
        })();
        // The next wake-up tells how long this queue waited, counted from the start of the poll
        // that found nothing (a closed window: from now).
        *idle_since = Some(polled_from.unwrap_or_else(Instant::now));
        if let Err(e) = result {
            // A guest can corrupt its rings at will and kick as often as it likes.
            static BROKEN: LogLimit = LogLimit::per_10s(5);
            if let Some(suppressed) = BROKEN.allow() {
                warn!(
                    queue,
                    error = &e as &dyn std::error::Error,
                    suppressed,
                    "virtqueue error; waiting for the next kick"
                );
            }
        }
    }

    /// Add the deferred reads of queue `qs` that finished to the used ring; how many.
    fn take_completions(
        &self,
        qs: &QueueState,
        state: &mut VringState<GuestMem>,
        atomic: &GuestMem,
        track: Option<&QueueInflight<'_>>,
    ) -> Result<usize, virtio_queue::Error> {
        if !qs.pending.swap(false, Ordering::AcqRel) {
            return Ok(0);
        }
        // Consume the event first: a completion queued after this read writes it again.
        let _ = qs.event.read();
        let done = std::mem::take(&mut lock(&qs.completions).done);
        let mem = atomic.memory();
        let q = state.get_queue_mut();
        let used = UsedRing::new(&*mem, q);
        for &(head, len) in &done {
            inflight::add_used(track, q, &used, &qs.published, head, len)?;
        }
        if !done.is_empty() {
            trace!(completed = done.len(), "out-of-order completions");
        }
        Ok(done.len())
    }

    /// Count a request that completes off the queue thread; its generation.
    fn start_deferred(&self, queue: usize) -> Option<u64> {
        let qs = self.inner.queues.get(queue)?;
        let mut c = lock(&qs.completions);
        c.in_flight += 1;
        Some(c.generation)
    }

    /// Hand a FLUSH to the overlay's group commit; it completes through the queue's completion
    /// eventfd, so reads on this queue go on while the commit syncs.
    /// `here`: run the commit on this thread if none is running
    /// ([`tessera_overlay::Overlay::flush_here`]).
    fn commit(
        &self,
        queue: usize,
        head: u16,
        flush: DeferredFlush,
        mem: Arc<GuestMemoryMmap<()>>,
        taken: Instant,
        here: bool,
    ) {
        let Disk::Overlay(overlay) = &self.inner.disk else { return };
        let Some(generation) = self.start_deferred(queue) else { return };
        trace!(queue, head, "flush to the group commit");
        let inner = Arc::clone(&self.inner);
        let done: FlushDone = Box::new(move |result| {
            let done = debug_span!("queue", queue).in_scope(|| flush.committed(&*mem, result));
            drop(mem);
            inner.finished(queue, generation, head, &done, taken);
        });
        if here {
            overlay.flush_here(done);
        } else {
            overlay.flush_async(done);
        }
    }

    /// Hand a read missing the memory tier to the read engine; it completes through the queue's
    /// completion eventfd.
    /// `taken`: when the chain came off the ring.
    fn defer(
        &self,
        queue: usize,
        head: u16,
        read: DeferredRead,
        mem: Arc<GuestMemoryMmap<()>>,
        taken: Instant,
    ) {
        let Some(generation) = self.start_deferred(queue) else { return };
        trace!(queue, head, "deferred read");
        self.inner.metrics.fetch.deferred_reads.inc();
        let inner = Arc::clone(&self.inner);
        let (offset, len) = read.range();
        // The read engine fetches the chunks the read needs (in parallel, once each) and then
        // calls back on one of its threads, where the read is copied into the guest's buffers
        // (or at once here, when nothing needs fetching any more).
        self.inner.disk.fetch_ahead(
            offset,
            len,
            Box::new(move |fetched| {
                let done = debug_span!("queue", queue).in_scope(|| match fetched {
                    Ok(()) => read.finish(&*mem, &inner.disk),
                    Err(e) => read.fail(&*mem, e),
                });
                drop(mem);
                inner.finished(queue, generation, head, &done, taken);
            }),
        );
    }

    fn add_used(&self, vring: &VringRwLock<GuestMem>, queue: usize, done: &[(u16, u32)]) {
        if done.is_empty() {
            return;
        }
        let Some(qs) = self.inner.queues.get(queue) else { return };
        let Some(atomic) = lock(&self.inner.mem).clone() else {
            return;
        };
        let mem = atomic.memory();
        let mut state = vring.get_mut();
        let area = self.inner.inflight_area();
        let track = area.as_ref().and_then(|a| a.queue(queue));
        let result = (|| -> Result<(), virtio_queue::Error> {
            let q = state.get_queue_mut();
            let used = UsedRing::new(&*mem, q);
            for &(head, len) in done {
                inflight::add_used(track.as_ref(), q, &used, &qs.published, head, len)?;
            }
            trace!(queue, completed = done.len(), "out-of-order completions");
            signal(&mut state, &mem, &qs.published, queue)
        })();
        if let Err(e) = result {
            warn!(queue, error = &e as &dyn std::error::Error, "virtqueue error adding completions");
        }
    }
}

impl Inner {
    /// The in-flight tracking area, if the front-end shared one.
    fn inflight_area(&self) -> Option<Arc<InflightArea>> {
        self.inflight.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_inflight_area(&self, area: InflightArea) {
        *self.inflight.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(area));
    }

    /// A request completed off the queue thread (taken off the ring at `taken`): count it,
    /// record it, and queue its completion for the worker.
    fn finished(&self, queue: usize, generation: u64, head: u16, done: &Completion, taken: Instant) {
        let requests = &self.metrics.requests;
        requests.in_flight.dec();
        requests.of(done.kind).record(done.metric_status(), done.bytes, taken.elapsed());
        if let Some(r) = &self.recorder {
            r.record(queue, done, taken);
        }
        self.complete(queue, generation, head, done.used_len);
    }

    /// A fetch thread finished a deferred read: queue its completion for the worker.
    fn complete(&self, queue: usize, generation: u64, head: u16, used_len: u32) {
        let Some(qs) = self.queues.get(queue) else { return };
        let mut c = lock(&qs.completions);
        c.in_flight = c.in_flight.saturating_sub(1);
        if c.generation == generation {
            c.done.push((head, used_len));
            qs.pending.store(true, Ordering::Release);
        } else {
            debug!(connection = self.connection, queue, head, "dropping a completion of a stopped ring");
        }
        drop(c);
        qs.drained.notify_all();
        if let Err(e) = qs.event.write(1) {
            warn!(queue, error = &e as &dyn std::error::Error, "cannot wake the queue worker");
        }
    }
}

/// Signal the guest that used buffers were added (`published` since the last decision), if it
/// asked to be told.
fn signal(
    state: &mut VringState<GuestMem>,
    mem: &GuestMemoryMmap<()>,
    published: &Published,
    queue: usize,
) -> Result<(), virtio_queue::Error> {
    if used::needs_signal(state.get_queue_mut(), mem, published)? {
        send_signal(state, queue);
    }
    Ok(())
}

/// Write the queue's call eventfd (a failure is logged: the driver will find the completions on
/// its next look at the ring).
fn send_signal(state: &mut VringState<GuestMem>, queue: usize) {
    if let Err(e) = state.signal_used_queue() {
        warn!(queue, error = &e as &dyn std::error::Error, "cannot signal the guest");
    }
}

/// Signal the driver now if it asked to hear of the completions published so far (its
/// `used_event`, with `VIRTIO_F_EVENT_IDX`), rather than once the ring is drained; every so often
/// count whether that cost the worker its CPU (the driver runs on this CPU), which pauses early
/// signals (`notify`).
fn signal_early(
    state: &mut VringState<GuestMem>,
    mem: &GuestMemoryMmap<()>,
    published: &Published,
    queue: usize,
    early: &mut EarlySignals,
    now: Instant,
    metrics: &RequestMetrics,
) -> Result<(), virtio_queue::Error> {
    if !used::needs_signal(state.get_queue_mut(), mem, published)? {
        return Ok(());
    }
    metrics.early_signals.inc();
    let before = if early.check_this_one() { involuntary_switches() } else { None };
    send_signal(state, queue);
    if let Some(before) = before {
        if early.checked(now, before, involuntary_switches().unwrap_or(before)) {
            metrics.early_signal_pauses.inc();
            debug!(
                queue,
                "a signal preempted the queue worker: the driver shares its CPU; early signals paused"
            );
        }
    }
    Ok(())
}

/// Poll the avail ring and `qs`'s completions from `started` for at most `window`: whether work
/// arrived. Notifications stay off meanwhile, so a driver adding a request does not kick. Each
/// turn yields the CPU (`sched_yield`), so a thread that shares this CPU — the engine thread
/// finishing this queue's deferred read or FLUSH, or the driver itself — runs at once instead of
/// waiting out the window; with the CPU to itself the worker gets it straight back.
fn poll_for_work(
    state: &mut VringState<GuestMem>,
    mem: &GuestMemoryMmap<()>,
    qs: &QueueState,
    started: Instant,
    window: Duration,
) -> Result<bool, virtio_queue::Error> {
    let queue = state.get_queue_mut();
    loop {
        if qs.pending.load(Ordering::Acquire)
            || queue.avail_idx(mem, Ordering::Acquire)?.0 != queue.next_avail()
        {
            return Ok(true);
        }
        if started.elapsed() >= window {
            return Ok(false);
        }
        std::thread::yield_now();
    }
}

/// Wait until `qs` has nothing in flight (at most `timeout`); returns whether it drained and
/// the lock.
fn wait_drained(qs: &QueueState, timeout: Duration) -> (bool, MutexGuard<'_, Completions>) {
    let deadline = Instant::now() + timeout;
    let mut c = lock(&qs.completions);
    while c.in_flight > 0 {
        let now = Instant::now();
        if now >= deadline {
            return (false, c);
        }
        c = match qs.drained.wait_timeout(c, deadline - now) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
    (true, c)
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

    /// Nothing to keep: the framework also tells every queue, whose notification calls
    /// (`disable_notification`, `enable_notification`, `needs_notification`) then follow
    /// VIRTIO_F_EVENT_IDX.
    fn set_event_idx(&self, _enabled: bool) {}

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
                warn!(error = &e as &dyn std::error::Error, "cannot create a worker exit event");
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
        // Thread `i` serves queue `i` (its one vring); `device_event` indexes this thread's
        // vrings, or is the completion event.
        let vring = if device_event == self.completion_event() {
            vrings.first()
        } else {
            vrings.get(usize::from(device_event))
        };
        if let Some(vring) = vring {
            self.serve_queue(vring, thread_id);
        }
        Ok(())
    }

    /// GET_VRING_BASE: every read still in flight on this queue completes (into the used ring)
    /// before the ring is handed back; a completion arriving later (after the timeout) belongs
    /// to an older generation and is dropped.
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let queue = queue_index as usize;
        let Some(qs) = self.inner.queues.get(queue) else { return Ok(()) };
        if self.inner.detached.load(Ordering::SeqCst) {
            return Ok(());
        }
        let (drained, mut c) = wait_drained(qs, DRAIN_TIMEOUT);
        if !drained {
            warn!(queue, in_flight = c.in_flight, "reads still in flight when the ring stopped");
        }
        let done = std::mem::take(&mut c.done);
        c.generation += 1;
        drop(c);
        let vring = lock(&qs.vring).clone();
        if let Some(vring) = vring {
            self.add_used(&vring, queue, &done);
        }
        Ok(())
    }

    /// `GET_INFLIGHT_FD`: a fresh tracking area ([`crate::inflight`]).
    fn get_inflight_fd(&self, request: &VhostUserInflight) -> io::Result<(VhostUserInflight, std::fs::File)> {
        let (area, reply, file) = InflightArea::create(request.num_queues, request.queue_size)?;
        debug!(connection = self.inner.connection, size = reply.mmap_size, "inflight area created");
        self.inner.set_inflight_area(area);
        Ok((reply, file))
    }

    /// `SET_INFLIGHT_FD`: the area this or an earlier daemon filled; recovered per queue as
    /// each ring starts ([`Self::vring_ready`]).
    fn set_inflight_fd(&self, request: &VhostUserInflight, file: std::fs::File) -> io::Result<()> {
        self.inner.set_inflight_area(InflightArea::open(file, request)?);
        debug!(
            connection = self.inner.connection,
            size = request.mmap_size,
            "inflight area from the front-end"
        );
        Ok(())
    }

    /// A ring started: recover what an earlier daemon left in flight (if the front-end shares an
    /// in-flight area), then kick the ring, so its worker serves what waits there — the
    /// resubmitted requests first — as soon as it watches the kick.
    fn vring_ready(&self, queue_index: u16, vring: &Self::Vring) -> io::Result<()> {
        let mut state = vring.get_mut();
        if let Some(qs) = self.inner.queues.get(usize::from(queue_index)) {
            qs.published.reset();
        }
        let area = self.inner.inflight_area();
        let mem = lock(&self.inner.mem).clone();
        if let (Some(track), Some(atomic)) =
            (area.as_ref().and_then(|a| a.queue(usize::from(queue_index))), mem)
        {
            let resubmitted = inflight::recover(&mut state, &*atomic.memory(), &track)?;
            debug!(
                connection = self.inner.connection,
                queue = queue_index,
                resubmitted,
                "ring started, inflight area recovered"
            );
            if resubmitted > 0 {
                info!(
                    connection = self.inner.connection,
                    queue = queue_index,
                    resubmitted,
                    "resubmitting requests in flight when the last daemon stopped"
                );
            }
        }
        inflight::kick(&state)
    }
}
