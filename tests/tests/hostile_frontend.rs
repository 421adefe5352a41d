//! A hostile guest against a whole daemon (issue 13): a raw vhost-user frontend
//! (`tessera_e2e::frontend`) sends a `tessera serve --read-only` what no VMM would — sectors past
//! the end and past 2^64 bytes, absurd lengths, buffers outside guest memory, descriptor loops,
//! headers too short, unknown request types, writes to the read-only device, a flood of
//! malformed chains, and finally an avail ring index that lies. Every bad request gets an error
//! status or is dropped; the daemon never dies, keeps answering good requests with the right
//! bytes on the same connection, writes at most a few log lines however many bad requests came
//! (rate-limited, with a count), burns no CPU on a lying ring, and serves the next client.

use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tessera_e2e::daemon::BlkClient;
use tessera_e2e::frontend::{
    Desc, RawFrontend, DATA, MEM_BASE, MEM_LEN, NEXT, QUEUE_SIZE, T_IN, T_OUT, WRITE,
};
use tessera_e2e::prng::Prng;
use tessera_e2e::tessera;
use tessera_e2e::testutil::{tmp, Killed};

const STATUS_OK: u8 = 0;
const STATUS_IOERR: u8 = 1;
const STATUS_UNSUPP: u8 = 2;
const WAIT: Duration = Duration::from_secs(10);

/// `tessera serve` with its stderr in `log`; waits for the socket.
fn serve(store: &Path, socket: &Path, log: &Path) -> Result<Killed> {
    let child = tessera::command(["serve", "demo", "--read-only", "--store"])
        .arg(store)
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(fs::File::create(log)?)
        .spawn()?;
    let mut child = Killed(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if let Some(status) = child.0.try_wait()? {
            bail!("tessera serve exited with {status}: {}", fs::read_to_string(log)?);
        }
        ensure!(Instant::now() < deadline, "no socket after 30 s");
        std::thread::sleep(Duration::from_millis(10)); // polling interval
    }
    Ok(child)
}

fn alive(child: &mut Killed, log: &Path, when: &str) -> Result<()> {
    if let Some(status) = child.0.try_wait()? {
        bail!("the daemon died {when} ({status}): {}", fs::read_to_string(log)?);
    }
    Ok(())
}

/// CPU time (user + system, clock ticks) of process `pid`.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(')').context("/proc stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Ok(f[11].parse::<u64>()? + f[12].parse::<u64>()?)
}

/// One well-formed read of `len` bytes at `sector` with head `head`: (status, bytes).
fn good_read(f: &mut RawFrontend, head: u16, sector: u64, len: u32) -> Result<(u8, Vec<u8>)> {
    let status = f.request(head, T_IN, sector, len)?;
    f.submit(&[head])?;
    let used = f.wait_used(1, WAIT)?;
    ensure!(used[0].0 == u32::from(head), "completed head {} for {head}", used[0].0);
    let s = f.read(status, 1)?[0];
    Ok((s, f.read(RawFrontend::slot(head) + 16, len as usize)?))
}

/// Submit the chain at `head` and return its status byte (at `status`) once completed; `None`
/// when the daemon dropped it (used length 0, status untouched).
fn outcome(f: &mut RawFrontend, head: u16, status: u64) -> Result<Option<u8>> {
    f.write(status, &[0xff])?;
    f.submit(&[head])?;
    let used = f.wait_used(1, WAIT)?;
    ensure!(used[0].0 == u32::from(head), "completed head {} for {head}", used[0].0);
    let s = f.read(status, 1)?[0];
    if used[0].1 == 0 {
        ensure!(s == 0xff, "a dropped chain (used length 0) still got status {s}");
        return Ok(None);
    }
    Ok(Some(s))
}

#[test]
fn a_hostile_guest_gets_errors_and_the_daemon_keeps_serving() -> Result<()> {
    let t = tmp("hostile-frontend")?;
    let (src, store) = (t.path().join("src"), t.path().join("store"));
    let mut rng = Prng::from_label("hostile-frontend");
    fs::create_dir_all(&src)?;
    fs::write(src.join("data.bin"), rng.bytes(1 << 20))?;
    tessera::build(&src, &store, &["--tag", "demo"])?;
    let raw_path = t.path().join("local.raw");
    tessera::export("demo", &store, &raw_path)?;
    let raw = fs::read(&raw_path)?;
    let sectors = raw.len() as u64 / 512;

    let (socket, log) = (t.path().join("vm.sock"), t.path().join("serve.log"));
    let mut daemon = serve(&store, &socket, &log)?;
    let mut f = RawFrontend::connect(&socket)?;

    // A good read first: the setup works.
    let (s, bytes) = good_read(&mut f, 0, 0, 4096)?;
    ensure!(s == STATUS_OK && bytes == raw[..4096], "the first good read: status {s}");

    // Bad requests, each answered with its status (or dropped), none served wrong.
    let mut cases = 0u32;
    let expect = |f: &mut RawFrontend, what: &str, head: u16, status: u64, want: Option<u8>| -> Result<()> {
        let got = outcome(f, head, status)?;
        ensure!(got == want, "{what}: {got:?}, expected {want:?}");
        Ok(())
    };
    let refused = |f: &mut RawFrontend, what: &str, head: u16, status: u64| -> Result<()> {
        let got = outcome(f, head, status)?;
        ensure!(got != Some(STATUS_OK), "{what} was served");
        Ok(())
    };
    // Past the end of the device, and at a sector whose byte offset overflows u64.
    for (what, sector) in
        [("past the end", sectors), ("straddling the end", sectors - 1), ("2^63 sectors", 1u64 << 63)]
    {
        let st = f.request(3, T_IN, sector, 4096)?;
        expect(&mut f, what, 3, st, Some(STATUS_IOERR))?;
        cases += 1;
    }
    // A write to the read-only device; an unknown request type.
    let st = f.request(6, T_OUT, 8, 4096)?;
    expect(&mut f, "write to a read-only device", 6, st, Some(STATUS_IOERR))?;
    cases += 1;
    let st = f.request(9, 0x77, 0, 512)?;
    expect(&mut f, "unknown request type", 9, st, Some(STATUS_UNSUPP))?;
    cases += 1;
    // A data length of almost 4 GiB inside a 4 MiB guest: the buffer is outside memory.
    let st = f.request(12, T_IN, 0, 4096)?;
    f.put_desc(
        13,
        Desc { addr: RawFrontend::slot(12) + 16, len: 0xffff_f000, flags: WRITE | NEXT, next: 14 },
    )?;
    refused(&mut f, "a 4 GiB buffer in 4 MiB of memory", 12, st)?;
    cases += 1;
    // A data buffer (and then a header) outside guest memory.
    let st = f.request(15, T_IN, 0, 4096)?;
    f.put_desc(16, Desc { addr: MEM_BASE + MEM_LEN + 4096, len: 4096, flags: WRITE | NEXT, next: 17 })?;
    refused(&mut f, "a buffer outside guest memory", 15, st)?;
    cases += 1;
    let st = f.request(18, T_IN, 0, 4096)?;
    f.put_desc(18, Desc { addr: 0xdead_0000_0000, len: 16, flags: NEXT, next: 19 })?;
    refused(&mut f, "a header outside guest memory", 18, st)?;
    cases += 1;
    // A header of 8 bytes; a descriptor loop; a chain that is only a header.
    let st = f.request(21, T_IN, 0, 4096)?;
    f.put_desc(21, Desc { addr: RawFrontend::slot(21), len: 8, flags: NEXT, next: 22 })?;
    refused(&mut f, "an 8-byte header", 21, st)?;
    cases += 1;
    let st = f.request(24, T_IN, 0, 4096)?;
    f.put_desc(25, Desc { addr: RawFrontend::slot(24) + 16, len: 512, flags: WRITE | NEXT, next: 24 })?;
    refused(&mut f, "a descriptor loop", 24, st)?;
    cases += 1;
    f.put_desc(27, Desc { addr: RawFrontend::slot(27), len: 16, flags: 0, next: 0 })?;
    refused(&mut f, "a header alone", 27, RawFrontend::slot(27) + 16)?;
    cases += 1;
    // A next index past the table.
    let st = f.request(30, T_IN, 0, 4096)?;
    f.put_desc(30, Desc { addr: RawFrontend::slot(30), len: 16, flags: NEXT, next: QUEUE_SIZE + 7 })?;
    refused(&mut f, "a next index past the table", 30, st)?;
    cases += 1;
    alive(&mut daemon, &log, "after the bad requests")?;

    // Good reads still work on the same connection, right bytes.
    let (s, bytes) = good_read(&mut f, 33, 16, 8192)?;
    ensure!(s == STATUS_OK && bytes == raw[8192..16384], "a good read after the bad ones: status {s}");

    // A flood: 20 000 chains that are only a header (dropped), 200 at a time.
    let flood = 20_000u32;
    let log_before = fs::read_to_string(&log)?.lines().count();
    let started = Instant::now();
    for d in 0..200u16 {
        f.put_desc(d, Desc { addr: DATA + 16 * u64::from(d), len: 16, flags: 0, next: 0 })?;
    }
    for _ in 0..flood / 200 {
        let heads: Vec<u16> = (0..200).collect();
        f.submit(&heads)?;
        let used = f.wait_used(200, WAIT)?;
        ensure!(used.iter().all(|&(_, len)| len == 0), "a flooded chain was not dropped");
    }
    let flood_took = started.elapsed();
    alive(&mut daemon, &log, "after the flood")?;
    let text = fs::read_to_string(&log)?;
    let flood_lines = text.lines().count() - log_before;
    // 5 per 10 s window (log_limit), the next one carrying the count of those suppressed.
    let windows = flood_took.as_secs() / 10 + 1;
    ensure!(
        flood_lines as u64 <= 5 * windows + 1,
        "{flood} bad chains in {flood_took:?} wrote {flood_lines} log lines:\n{text}"
    );
    let (s, bytes) = good_read(&mut f, 210, 0, 4096)?;
    ensure!(s == STATUS_OK && bytes == raw[..4096], "a good read after the flood: status {s}");

    // A lying ring: the avail index jumps 1000 entries ahead of what the guest wrote. The
    // daemon must neither serve garbage nor spin: CPU time over the next second stays near 0.
    let pid = daemon.0.id();
    f.publish(f_avail_jump(&f))?;
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_ticks(pid)?;
    std::thread::sleep(Duration::from_secs(1));
    let spent = cpu_ticks(pid)? - before;
    alive(&mut daemon, &log, "after the lying ring")?;
    let lines_after_lie = fs::read_to_string(&log)?.lines().count();
    ensure!(spent <= 10, "a lying avail index made the daemon burn {spent} ticks in 1 s");
    ensure!(
        lines_after_lie - log_before - flood_lines <= 6,
        "a lying avail index flooded the log: {}",
        fs::read_to_string(&log)?
    );
    drop(f);

    // The next client is served, right bytes, and the daemon stops cleanly.
    let mut c = BlkClient::connect(&socket, 1, true)?;
    let (device, failed) = c.read_device(1 << 20, 4)?;
    ensure!(failed.is_empty() && device == raw, "the next client's read of the device: {failed:?}");
    drop(c);
    // SAFETY: kill(2) on our own child, not reaped yet.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let status = daemon.0.wait()?;
    ensure!(
        status.success(),
        "tessera serve exited with {status} after SIGTERM: {}",
        fs::read_to_string(&log)?
    );
    let text = fs::read_to_string(&log)?;
    ensure!(!text.contains("panicked"), "the daemon panicked: {text}");
    eprintln!(
        "hostile frontend: {cases} kinds of bad request answered with an error or dropped, 0 served; \
         {flood} malformed chains in {} ms wrote {flood_lines} log lines; a lying avail index cost {spent} \
         CPU ticks in 1 s; good reads exact before, between and after; the next client read the whole \
         device exactly; SIGTERM → exit 0",
        flood_took.as_millis()
    );
    Ok(())
}

/// The avail index 1000 entries past the last one published.
fn f_avail_jump(f: &RawFrontend) -> u16 {
    f.avail().wrapping_add(1000)
}
