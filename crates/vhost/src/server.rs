//! The listening side: one socket, one client at a time, a fresh [`VhostUserDaemon`] per
//! connection (reusing one fails with "already claimed" for the second client), until stopped.

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags};
use tracing::{debug, info, warn};
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::{Error as DaemonError, ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use crate::backend::{BlkBackend, DRAIN_TIMEOUT};
use crate::config::{DeviceConfig, MAX_QUEUES};
use crate::error::ServeError;
use crate::execute::Disk;
use crate::poll::DEFAULT_POLL_US;
use crate::record::RequestRecorder;
use crate::request::SECTOR_SIZE;
use tessera_metrics::Metrics;

/// Socket permissions unless told otherwise.
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

/// A bound vhost-user-blk server. The socket exists (and accepts) from [`Server::bind`] on and
/// is removed when [`Server::run`] returns or the server is dropped.
pub struct Server {
    listener: Listener,
    /// The same socket as `listener` (a dup), to poll it.
    poll_fd: UnixListener,
    path: PathBuf,
    /// Whether the socket file is ours to remove ([`Server::bind`]) or the supervisor's
    /// ([`Server::from_listener`]).
    owns_socket: bool,
    device: DeviceConfig,
    disk: Disk,
    stop: StopHandle,
    connections: Arc<AtomicU64>,
    metrics: Arc<Metrics>,
    /// The longest a queue worker polls after draining its ring.
    poll: Duration,
    recorder: Option<Arc<RequestRecorder>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("path", &self.path)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// Stops a running [`Server`] from any thread (a signal handler thread, a test).
#[derive(Clone, Debug)]
pub struct StopHandle {
    inner: Arc<StopInner>,
}

#[derive(Debug)]
struct StopInner {
    stopped: AtomicBool,
    /// A byte written to `wake_tx` makes `wake_rx` readable for the accept loop's poll.
    wake_tx: UnixStream,
    wake_rx: UnixStream,
    current: Mutex<Option<ShutdownHandleDebug>>,
}

/// The connection being served: its shutdown handle (which has no Debug; hence the wrapper) and
/// its backend, detached before the connection is shut.
struct ShutdownHandleDebug(ShutdownHandle, BlkBackend);

impl std::fmt::Debug for ShutdownHandleDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShutdownHandle")
    }
}

impl StopHandle {
    fn new() -> Result<Self, ServeError> {
        let (wake_tx, wake_rx) = UnixStream::pair()
            .map_err(|source| ServeError::Io { what: "creating the stop socket pair", source })?;
        wake_tx
            .set_nonblocking(true)
            .map_err(|source| ServeError::Io { what: "creating the stop socket pair", source })?;
        Ok(Self {
            inner: Arc::new(StopInner {
                stopped: AtomicBool::new(false),
                wake_tx,
                wake_rx,
                current: Mutex::new(None),
            }),
        })
    }

    /// Ask the server to stop: close the current connection and stop accepting. Requests the
    /// client had in flight finish their I/O but are not completed into its rings (the client
    /// has gone): they stay in the in-flight area the client shares, and the next daemon it
    /// connects to resubmits them ([`BlkBackend::detach`]). Idempotent.
    pub fn stop(&self) {
        self.inner.stopped.store(true, Ordering::SeqCst);
        if let Err(e) = (&self.inner.wake_tx).write(&[1]) {
            warn!(error = &e as &dyn std::error::Error, "cannot signal the stop event");
        }
        if let Some(h) = self.current().as_ref() {
            // Detached first: between the shutdown and the server noticing it, a worker would
            // still complete requests into rings the VMM no longer watches.
            h.1.detach();
            h.0.shutdown();
        }
    }

    /// Whether [`Self::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.inner.stopped.load(Ordering::SeqCst)
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<ShutdownHandleDebug>> {
        self.inner.current.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Server {
    /// Create the socket at `path` with permissions `mode` and start listening. The socket is
    /// bound under a temporary name, chmod-ed, then renamed into place, so `path` appears only
    /// once it accepts connections, with the right mode (an existing file at `path`, e.g. the
    /// socket of a dead daemon, is replaced).
    pub fn bind(path: &Path, mode: u32, device: DeviceConfig, disk: Disk) -> Result<Self, ServeError> {
        check_device(&device, &disk)?;
        let name = path
            .file_name()
            .ok_or_else(|| ServeError::Socket {
                path: path.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"),
            })?
            .to_string_lossy()
            .into_owned();
        let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
        let sock_err = |p: &Path| {
            let p = p.to_owned();
            move |source| ServeError::Socket { path: p, source }
        };
        let _ = fs::remove_file(&tmp);
        let listener = UnixListener::bind(&tmp).map_err(sock_err(&tmp))?;
        let placed = fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))
            .and_then(|()| fs::rename(&tmp, path))
            .map_err(sock_err(path));
        if let Err(e) = placed {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        info!(socket = %path.display(), capacity = device.capacity_bytes, queues = device.queues, "listening");
        Self::serving(listener, path, true, device, disk)
    }

    /// Serve on `listener`, a socket its supervisor bound and listens on (systemd socket
    /// activation: `LISTEN_FDS`), named `path` in logs. The socket file is the supervisor's: it
    /// stays in place when the server stops, so a restarted daemon (or the next one systemd
    /// starts on a connection) serves on the same socket while the VMM reconnects.
    pub fn from_listener(
        listener: UnixListener,
        path: &Path,
        device: DeviceConfig,
        disk: Disk,
    ) -> Result<Self, ServeError> {
        check_device(&device, &disk)?;
        info!(socket = %path.display(), capacity = device.capacity_bytes, queues = device.queues, "listening on the socket passed by the supervisor");
        Self::serving(listener, path, false, device, disk)
    }

    fn serving(
        listener: UnixListener,
        path: &Path,
        owns_socket: bool,
        device: DeviceConfig,
        disk: Disk,
    ) -> Result<Self, ServeError> {
        let poll_fd =
            listener.try_clone().map_err(|source| ServeError::Socket { path: path.to_owned(), source })?;
        Ok(Self {
            poll_fd,
            listener: Listener::from(listener),
            path: path.to_owned(),
            owns_socket,
            device,
            disk,
            stop: StopHandle::new()?,
            connections: Arc::new(AtomicU64::new(0)),
            metrics: Metrics::unregistered(),
            poll: Duration::from_micros(DEFAULT_POLL_US),
            recorder: None,
        })
    }

    /// Count requests (and connections) in `metrics` instead of handles nobody reads.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Let each queue worker poll for up to `max` after draining its ring, adapting the window
    /// to how soon requests come ([`crate::poll::PollWindow`]; zero: never poll). Default
    /// [`DEFAULT_POLL_US`].
    pub fn with_poll(mut self, max: Duration) -> Self {
        self.poll = max;
        self
    }

    /// Record every request of every connection into `recorder` (`--record-requests`).
    pub fn with_recorder(mut self, recorder: Arc<RequestRecorder>) -> Self {
        self.recorder = Some(recorder);
        self
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle that stops [`Self::run`].
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Connections served so far (a shared counter, readable while running).
    pub fn connection_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.connections)
    }

    /// Serve clients one after another until stopped. A client that disconnects (VM reboot,
    /// VMM restart) or misbehaves at the protocol level ends its connection, not the server.
    pub fn run(mut self) -> Result<(), ServeError> {
        while self.wait_for_client()? {
            self.serve_connection()?;
        }
        // Every request has completed (the workers are joined): make the overlay durable.
        if let Disk::Overlay(o) = &self.disk {
            o.flush()?;
        }
        info!(socket = %self.path.display(), "stopped");
        Ok(())
    }

    /// Block until a client is waiting (true) or the server is stopped (false).
    fn wait_for_client(&self) -> Result<bool, ServeError> {
        loop {
            if self.stop.is_stopped() {
                return Ok(false);
            }
            let mut fds = [
                PollFd::new(&self.poll_fd, PollFlags::IN),
                PollFd::new(&self.stop.inner.wake_rx, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(ServeError::Io { what: "polling the socket", source: e.into() }),
            }
            if !fds[1].revents().is_empty() || self.stop.is_stopped() {
                return Ok(false);
            }
            if !fds[0].revents().is_empty() {
                return Ok(true);
            }
        }
    }

    fn serve_connection(&mut self) -> Result<(), ServeError> {
        let n = self.connections.load(Ordering::SeqCst) + 1;
        let backend = BlkBackend::deferring(
            self.device.clone(),
            self.disk.clone(),
            n,
            Arc::clone(&self.metrics),
            self.poll,
        )
        .map_err(|source| ServeError::Io { what: "creating the completion events", source })?
        .recording(self.recorder.clone());
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let daemon_err = |what| move |e: DaemonError| ServeError::Daemon { what, message: e.to_string() };
        let mut daemon = VhostUserDaemon::new("tessera-vhost".to_owned(), backend.clone(), mem)
            .map_err(daemon_err("creating"))?;
        // Worker `i` serves queue `i`: it also wakes on that queue's completion eventfd.
        for (i, handler) in daemon.get_epoll_handlers().iter().enumerate() {
            if let Some(fd) = backend.completion_fd(i) {
                handler
                    .register_listener(fd, EventSet::IN, u64::from(backend.completion_event()))
                    .map_err(|source| ServeError::Io { what: "registering a completion event", source })?;
            }
        }
        daemon.start(&mut self.listener).map_err(daemon_err("accepting"))?;
        self.connections.fetch_add(1, Ordering::SeqCst);
        self.metrics.device.connections.inc();
        info!(connection = n, "client connected");
        *self.stop.current() = daemon.shutdown_handle().map(|h| ShutdownHandleDebug(h, backend.clone()));
        if self.stop.is_stopped() {
            daemon.request_shutdown();
        }
        let result = daemon.wait();
        *self.stop.current() = None;
        // The client is gone (it left, or the stop shut its connection): its rings are its own
        // again. What is still in flight stays in the in-flight area for the next daemon.
        backend.detach();
        match result {
            Ok(())
            | Err(DaemonError::HandleRequest(VhostUserError::Disconnected))
            | Err(DaemonError::HandleRequest(VhostUserError::PartialMessage)) => {
                info!(connection = n, "client disconnected")
            }
            Err(e) => {
                // vhost_user_backend::Error implements Display only (no std::error::Error).
                warn!(connection = n, error = %e, "connection ended with an error")
            }
        }
        // Reads still in flight finish (into this connection's guest memory, which they hold;
        // they complete again when resubmitted) before the overlay may be flushed on stop.
        if !backend.drain(DRAIN_TIMEOUT) {
            warn!(
                connection = n,
                in_flight = backend.in_flight(),
                "reads still in flight after the client left"
            );
        }
        // Dropping the daemon sends the exit events and joins the queue workers.
        drop(daemon);
        debug!(connection = n, "workers stopped");
        Ok(())
    }
}

/// The device settings a server can serve.
fn check_device(device: &DeviceConfig, disk: &Disk) -> Result<(), ServeError> {
    if device.queues == 0 || device.queues > MAX_QUEUES {
        return Err(ServeError::Config("the number of queues must be from 1 to 64"));
    }
    if device.capacity_bytes % SECTOR_SIZE != 0 {
        return Err(ServeError::Config("the device size must be a multiple of 512 bytes"));
    }
    if !device.read_only && matches!(disk, Disk::Base(_)) {
        return Err(ServeError::Config("a writable device needs a copy-on-write overlay"));
    }
    Ok(())
}

impl Drop for Server {
    fn drop(&mut self) {
        if !self.owns_socket {
            return;
        }
        if let Err(e) = fs::remove_file(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                warn!(socket = %self.path.display(), error = &e as &dyn std::error::Error, "cannot remove the socket");
            }
        }
    }
}
