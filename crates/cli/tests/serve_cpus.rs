//! `tessera serve --cpus queues=Q,fetch=F` as a black box: with a client connected, every queue
//! worker (`vring_worker`) and the vhost-user protocol thread may run on CPU Q only, and every
//! chunk fetcher thread (`tessera-chunk-N`) on CPU F only, as the kernel reports them in
//! `/proc/PID/task/*/status` (`Cpus_allowed_list`); without `--cpus` they keep the CPUs the
//! daemon was started with. And `--poll-us`: the queue workers poll instead of sleeping after
//! every request, and use no CPU when idle.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod blk;
mod common;

use blk::Client;
use common::TESSERA;

/// Held by each test for its whole run: the poll test counts a queue worker's sleeps against the
/// requests it served, which a daemon of the other test busy on the same CPUs changes (the
/// worker preempted between a completion and its look at the ring finds the next request there
/// and does not sleep: 2 089 sleeps in 3 000 reads in a CI run where the two ran together).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `Cpus_allowed_list` of a `/proc/.../status` text.
fn allowed(status: &str) -> String {
    let line = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
    line.trim().to_owned()
}

/// "0-2,5" → [0, 1, 2, 5].
fn expand(list: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => out.push(part.parse().unwrap()),
        }
    }
    out
}

/// Thread name → the CPU lists of the threads of that name, for process `pid`.
fn threads(pid: u32) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for task in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let (Ok(comm), Ok(status)) =
            (fs::read_to_string(dir.join("comm")), fs::read_to_string(dir.join("status")))
        else {
            continue; // the thread exited meanwhile
        };
        out.entry(comm.trim().to_owned()).or_default().push(allowed(&status));
    }
    out
}

fn serve(dir: &Path, extra: &[&str]) -> Child {
    let socket = dir.join("vm.sock");
    let _ = fs::remove_file(&socket);
    let store = dir.join("store");
    let mut child = Command::new(TESSERA)
        .args(["serve", "img", "--store", store.to_str().unwrap(), "--socket", socket.to_str().unwrap()])
        .arg("--overlay")
        .arg(dir.join("vm.overlay"))
        .args(["--queues", "2"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("tessera serve exited early: {status}");
        }
        assert!(Instant::now() < deadline, "no socket within 30 s");
        std::thread::sleep(Duration::from_millis(5)); // polling interval, not a fixed wait
    }
    child
}

/// Connect a client (the queue workers exist once a client is connected), read a block (a
/// fetcher thread fetches its chunk), and return the daemon's threads.
fn threads_while_serving(dir: &Path, extra: &[&str]) -> BTreeMap<String, Vec<String>> {
    let mut d = serve(dir, extra);
    let mut c = Client::connect(&dir.join("vm.sock"));
    assert_eq!(c.read(0, 4096), 0);
    // A thread names itself once it runs (std sets the name from the new thread), so a queue
    // worker spawned as the client connected may still carry its parent's name on a loaded
    // machine: wait until both queues' workers show theirs (or the deadline, and the callers'
    // checks fail on what is there).
    let deadline = Instant::now() + Duration::from_secs(10);
    let t = loop {
        let t = threads(d.id());
        if t.get("vring_worker").map_or(0, Vec::len) >= 2 || Instant::now() > deadline {
            break t;
        }
        std::thread::sleep(Duration::from_millis(5)); // polling interval, not a fixed wait
    };
    drop(c);
    // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
    assert_eq!(unsafe { libc::kill(d.id() as i32, libc::SIGTERM) }, 0);
    assert!(d.wait().unwrap().success());
    t
}

#[test]
fn cpus_pins_queue_workers_and_fetchers_apart() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("file"), common::noise(1, 300_000)).unwrap();
    let store = dir.path().join("store");
    common::build_img(&src, &store);

    // The CPUs this test may use: the queue workers go to the last, the fetchers to the first
    // (the same one on a 1-CPU machine, where only the pinning itself is shown).
    let ours = allowed(&fs::read_to_string("/proc/self/status").unwrap());
    let cpus = expand(&ours);
    let (q, f) = (cpus[cpus.len() - 1], cpus[0]);

    let t = threads_while_serving(dir.path(), &["--cpus", &format!("queues={q},fetch={f}")]);
    let workers = &t["vring_worker"];
    assert_eq!(workers.len(), 2, "one worker per queue: {t:?}");
    assert!(workers.iter().all(|c| *c == q.to_string()), "queue workers on CPU {q}: {t:?}");
    assert!(t["tessera-vhost"].iter().all(|c| *c == q.to_string()), "protocol thread on CPU {q}: {t:?}");
    let fetchers: Vec<&String> =
        t.iter().filter(|(name, _)| name.starts_with("tessera-chunk")).flat_map(|(_, c)| c).collect();
    // Fetch threads start as reads need them (at most 4 for a local store), from whichever
    // thread queued the work, and still run on the fetch CPUs.
    assert!((1..=4).contains(&fetchers.len()), "1 to 4 fetcher threads for a local store: {t:?}");
    assert!(fetchers.iter().all(|c| **c == f.to_string()), "fetchers on CPU {f}: {t:?}");

    // Without --cpus every thread keeps the CPUs the daemon was started with (this test's).
    let t = threads_while_serving(dir.path(), &[]);
    assert!(t.values().flatten().all(|c| *c == ours), "all threads on {ours}: {t:?}");
    assert_eq!(t["vring_worker"].len(), 2);
}

/// `(CPU ticks, voluntary context switches)` of the queue workers (`vring_worker`) of `pid`.
fn worker_usage(pid: u32) -> (u64, u64) {
    let (mut ticks, mut switches) = (0, 0);
    for task in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let (Ok(comm), Ok(stat), Ok(status)) = (
            fs::read_to_string(dir.join("comm")),
            fs::read_to_string(dir.join("stat")),
            fs::read_to_string(dir.join("status")),
        ) else {
            continue;
        };
        if comm.trim() != "vring_worker" {
            continue;
        }
        // Fields after the parenthesised name: state is field 3; utime and stime are 14 and 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        ticks += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        let v = status.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:")).unwrap();
        switches += v.trim().parse::<u64>().unwrap();
    }
    (ticks, switches)
}

/// `--poll-us`: with a window, back-to-back reads find the worker polling (it sleeps far less
/// often than once per request, as it does with `--poll-us 0`); with or without one, a
/// connected but idle daemon's queue workers use no CPU once the window has passed.
#[test]
fn poll_window_saves_wakeups_and_idles_at_zero_cpu() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("file"), common::noise(2, 1 << 20)).unwrap();
    let store = dir.path().join("store");
    common::build_img(&src, &store);

    // The queue worker on one CPU, this test's client on another (when there are two).
    let cpus = expand(&allowed(&fs::read_to_string("/proc/self/status").unwrap()));
    let (q, client) = (cpus[cpus.len() - 1], cpus[0]);
    let mut set = rustix::thread::CpuSet::new();
    set.set(client);
    rustix::thread::sched_setaffinity(None, &set).unwrap();

    const READS: u64 = 3000;
    let mut switches = BTreeMap::new();
    for poll in ["0", "2000"] {
        let mut d = serve(dir.path(), &["--cpus", &format!("queues={q}"), "--poll-us", poll]);
        let mut c = Client::connect(&dir.path().join("vm.sock"));
        // Warm: what the reads below touch is in memory, so they complete on the queue thread.
        assert_eq!(c.read(0, 1 << 20), 0);
        let (_, before) = worker_usage(d.id());
        for i in 0..READS {
            assert_eq!(c.read((i * 4096) % (1 << 20), 4096), 0);
        }
        let (_, after) = worker_usage(d.id());
        switches.insert(poll, after - before);
        // Idle, connected: nothing may run once the window (2 ms at most) has passed.
        std::thread::sleep(Duration::from_millis(100));
        let (t0, _) = worker_usage(d.id());
        std::thread::sleep(Duration::from_millis(1500));
        let (t1, _) = worker_usage(d.id());
        assert!(t1 - t0 <= 2, "--poll-us {poll}: the idle queue worker used {} ticks in 1.5 s", t1 - t0);
        drop(c);
        // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
        assert_eq!(unsafe { libc::kill(d.id() as i32, libc::SIGTERM) }, 0);
        assert!(d.wait().unwrap().success());
    }
    eprintln!("queue worker sleeps over {READS} reads: {switches:?}");
    // (A request the driver adds right before the worker re-enables notifications is served
    // without a sleep, so not quite every one.)
    assert!(
        switches["0"] >= READS * 9 / 10,
        "without polling the worker sleeps after (nearly) every request: {switches:?}"
    );
    if q != client {
        assert!(
            switches["2000"] * 2 < switches["0"],
            "with a 2 ms window back-to-back reads should mostly find the worker polling: {switches:?}"
        );
    }
}
