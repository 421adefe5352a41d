//! A real guest: QEMU `microvm` under TCG with Debian's cloud kernel and a busybox initramfs,
//! attached to `tessera serve` over vhost-user-blk (brief §6).
//!
//! The kernel package is fetched with `apt-get download` and unpacked (never installed) into a
//! cache outside the clone (`/var/cache/tessera-test/guest-<package>`, or `TESSERA_GUEST_CACHE`),
//! keyed by the package name, so CI downloads it once per machine. The initramfs is written here
//! as a `newc` cpio archive: busybox, the virtio modules the cloud kernel does not build in, and an
//! `/init` that runs the test's script and powers off.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

/// Virtio modules the cloud kernel has as modules, in load order.
const MODULES: &[&str] = &[
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/block/virtio_blk.ko",
];

/// The FUSE and virtio-fs modules, loaded after [`MODULES`] only by a kit made with
/// [`GuestKit::with_virtiofs`].
const VIRTIOFS_MODULES: &[&str] = &["fs/fuse/fuse.ko", "fs/fuse/virtiofs.ko"];

/// What a guest needs: kernel, modules, busybox, firmware.
#[derive(Debug, Clone)]
pub struct GuestKit {
    pub kernel: PathBuf,
    pub modules: Vec<PathBuf>,
    pub busybox: PathBuf,
    pub qboot: PathBuf,
    /// The kernel package's `lib/modules/<version>/kernel`.
    pub module_dir: PathBuf,
}

impl GuestKit {
    /// This kit with the FUSE and virtio-fs modules added (for [`Attach::Fs`] guests).
    pub fn with_virtiofs(&self) -> Result<GuestKit> {
        let mut kit = self.clone();
        for m in VIRTIOFS_MODULES {
            let path = self.module_dir.join(m);
            ensure!(path.exists(), "module {} missing from the guest kernel package", path.display());
            if !kit.modules.contains(&path) {
                kit.modules.push(path);
            }
        }
        Ok(kit)
    }
}

fn cache_root() -> PathBuf {
    std::env::var_os("TESSERA_GUEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/tessera-test"))
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The concrete cloud kernel package (`linux-image-cloud-amd64` is a metapackage).
fn kernel_package() -> Result<String> {
    let deps = output(Command::new("apt-cache").args(["depends", "linux-image-cloud-amd64"]))?;
    deps.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-cloud-amd64"))
        .map(str::to_owned)
        .context("apt-cache depends linux-image-cloud-amd64 names no linux-image-*-cloud-amd64 (run apt-get update)")
}

/// Fetch (once) and return the guest kit.
pub fn kit() -> Result<GuestKit> {
    let busybox = PathBuf::from("/bin/busybox");
    let qboot = PathBuf::from("/usr/share/qemu/qboot.rom");
    for (p, pkg) in [(&busybox, "busybox-static"), (&qboot, "qemu-system-x86")] {
        ensure!(p.exists(), "{} is missing: install {pkg} (cargo xtask test does)", p.display());
    }
    let pkg = match kernel_package() {
        Ok(p) => p,
        // Package lists may be missing or stale on a fresh machine: refresh once, as root.
        Err(_) if crate::fixtures::is_root() => {
            output(Command::new("apt-get").args(["-q", "update"]))?;
            kernel_package()?
        }
        Err(e) => return Err(e),
    };
    let dir = cache_root().join(format!("guest-{pkg}"));
    let done = dir.join("unpacked");
    if !done.exists() {
        let tmp = cache_root().join(format!(".guest-{pkg}.{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp)?;
        output(Command::new("apt-get").args(["download", &pkg]).current_dir(&tmp))?;
        let deb = fs::read_dir(&tmp)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .context("apt-get download left no .deb")?;
        output(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(tmp.join("root")))?;
        fs::write(tmp.join("unpacked"), &pkg)?;
        let _ = fs::remove_dir_all(&dir);
        fs::rename(&tmp, &dir).or_else(|e| if done.exists() { Ok(()) } else { Err(e) })?;
    }
    let root = dir.join("root");
    let kernel = fs::read_dir(root.join("boot"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .context("no vmlinuz in the kernel package")?;
    let moddir = fs::read_dir(root.join("lib/modules"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .next()
        .context("no lib/modules in the kernel package")?;
    let module_dir = moddir.join("kernel");
    let modules = MODULES.iter().map(|m| module_dir.join(m)).collect::<Vec<_>>();
    for m in &modules {
        ensure!(m.exists(), "module {} missing from {pkg}", m.display());
    }
    Ok(GuestKit { kernel, modules, busybox, qboot, module_dir })
}

/// A minimal `newc` cpio writer.
struct Cpio<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

impl<W: Write> Cpio<W> {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> Result<()> {
        self.ino += 1;
        let namesize = name.len() + 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            namesize,
            0
        );
        self.write(header.as_bytes())?;
        self.write(name.as_bytes())?;
        self.write(&[0])?;
        self.pad()?;
        self.write(data)?;
        self.pad()
    }

    fn write(&mut self, b: &[u8]) -> Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> Result<()> {
        let n = (4 - self.written % 4) % 4;
        self.write(&[0u8; 3][..n as usize])
    }
}

/// Write an initramfs whose `/init` loads the virtio modules, waits for `/dev/vda`, runs `script`
/// (a busybox sh fragment) and powers off.
pub fn initramfs(kit: &GuestKit, script: &str, out: &Path) -> Result<()> {
    initramfs_with(kit, &Initramfs { script, wait_for_vda: true, files: &[] }, out)
}

/// What [`initramfs_with`] writes.
#[derive(Debug, Clone, Copy)]
pub struct Initramfs<'a> {
    /// The busybox sh fragment `/init` runs.
    pub script: &'a str,
    /// Wait (up to 20 s) for `/dev/vda` before the script: a guest with no block device sets
    /// false.
    pub wait_for_vda: bool,
    /// Host files copied in as `(name in the initramfs, e.g. "bench/t.tar", host path)`; their
    /// directories must be among the initramfs's own (`bin dev lib mnt newroot proc sys tmp`)
    /// or `bench`.
    pub files: &'a [(&'a str, &'a Path)],
}

/// Write an initramfs whose `/init` loads the kit's modules, (optionally) waits for `/dev/vda`,
/// runs the script and powers off.
pub fn initramfs_with(kit: &GuestKit, spec: &Initramfs<'_>, out: &Path) -> Result<()> {
    let mut init = String::from(
        "#!/bin/busybox sh\n/bin/busybox --install -s /bin\n\
         mount -t proc proc /proc\nmount -t sysfs sys /sys\nmount -t devtmpfs dev /dev\n",
    );
    for m in &kit.modules {
        let name = m.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        init.push_str(&format!("insmod /lib/modules/{name}\n"));
    }
    if spec.wait_for_vda {
        init.push_str("i=0; while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done\n");
    }
    init.push_str("echo TESSERA-GUEST-READY\n");
    init.push_str(spec.script);
    init.push_str("\necho TESSERA-GUEST-DONE\npoweroff -f\n");

    let file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut c = Cpio { out: std::io::BufWriter::new(file), ino: 0, written: 0 };
    for d in ["bin", "dev", "proc", "sys", "mnt", "newroot", "lib", "lib/modules", "tmp", "bench"] {
        c.entry(d, 0o040755, (0, 0), &[])?;
    }
    c.entry("dev/console", 0o020600, (5, 1), &[])?;
    c.entry("dev/null", 0o020666, (1, 3), &[])?;
    c.entry("bin/busybox", 0o100755, (0, 0), &fs::read(&kit.busybox)?)?;
    for m in &kit.modules {
        let name = m.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        c.entry(&format!("lib/modules/{name}"), 0o100644, (0, 0), &fs::read(m)?)?;
    }
    for (name, path) in spec.files {
        let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        c.entry(name, 0o100644, (0, 0), &data)?;
    }
    c.entry("init", 0o100755, (0, 0), init.as_bytes())?;
    c.entry("TRAILER!!!", 0, (0, 0), &[])?;
    c.out.flush()?;
    Ok(())
}

/// Boot the guest against a vhost-user-blk socket; return its serial output. Fails on timeout or
/// when the init did not reach its end.
pub fn boot(
    kit: &GuestKit,
    initramfs: &Path,
    socket: &Path,
    work: &Path,
    timeout: Duration,
) -> Result<String> {
    boot_with(kit, initramfs, &Attach::Blk(socket), work, timeout, "")
}

/// The device a guest gets over vhost-user.
#[derive(Debug, Clone, Copy)]
pub enum Attach<'a> {
    /// `vhost-user-blk` (one queue) on this socket: the guest's `/dev/vda`.
    Blk(&'a Path),
    /// `vhost-user-fs-device` (virtio-fs over virtio-mmio, the microvm machine's equivalent of
    /// `vhost-user-fs-pci`; queue size 1024) on this socket (virtiofsd's `--socket-path`), mounted
    /// in the guest with `mount -t virtiofs TAG DIR`. The kit must come from
    /// [`GuestKit::with_virtiofs`].
    Fs { socket: &'a Path, tag: &'a str },
}

/// [`boot`] with the device given by `attach`.
pub fn boot_attached(
    kit: &GuestKit,
    initramfs: &Path,
    attach: &Attach<'_>,
    work: &Path,
    timeout: Duration,
) -> Result<String> {
    boot_with(kit, initramfs, attach, work, timeout, "")
}

/// [`boot`] with QEMU reconnecting to the socket `reconnect_ms` after the daemon goes away
/// (`-chardev socket,reconnect-ms=N`): a daemon killed and restarted on the same socket gets
/// the VM's disk back. The serial log is `work/serial.log` meanwhile.
pub fn boot_reconnecting(
    kit: &GuestKit,
    initramfs: &Path,
    socket: &Path,
    work: &Path,
    timeout: Duration,
    reconnect_ms: u32,
) -> Result<String> {
    boot_with(kit, initramfs, &Attach::Blk(socket), work, timeout, &format!(",reconnect-ms={reconnect_ms}"))
}

fn boot_with(
    kit: &GuestKit,
    initramfs: &Path,
    attach: &Attach<'_>,
    work: &Path,
    timeout: Duration,
    chardev_opts: &str,
) -> Result<String> {
    let serial = work.join("serial.log");
    let _ = fs::remove_file(&serial);
    let (socket, device) = match attach {
        Attach::Blk(socket) => (socket, "vhost-user-blk,chardev=c0,num-queues=1".to_owned()),
        Attach::Fs { socket, tag } => {
            (socket, format!("vhost-user-fs-device,chardev=c0,tag={tag},queue-size=1024"))
        }
    };
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-machine", "microvm,memory-backend=mem,pit=on,pic=on,rtc=on"])
        .arg("-bios")
        .arg(&kit.qboot)
        .args(["-global", "virtio-mmio.force-legacy=false", "-cpu", "max", "-m", "512M"])
        .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
        .arg("-chardev")
        .arg(format!("socket,id=c0,path={}{chardev_opts}", socket.display()))
        .arg("-device")
        .arg(&device)
        .args(["-nodefaults", "-display", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .arg("-kernel")
        .arg(&kit.kernel)
        .arg("-initrd")
        .arg(initramfs)
        // TCG on a loaded 2-core host cannot calibrate the TSC against the PIT reliably (the boot
        // then hangs): give the kernel its clock and delay-loop constants instead. Under TCG the
        // guest's TSC is the host's, so the host's rate keeps guest time right (a wrong rate
        // puts the guest's superblock write times in the future).
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 tsc_early_khz={} lpj=2000000 no_timer_check{}",
            host_tsc_khz(),
            if std::env::var_os("TESSERA_GUEST_VERBOSE").is_some() { "" } else { " quiet" }
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting qemu-system-x86_64 (install qemu-system-x86 from bookworm-backports)")?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            let log = read_lossy(&serial);
            bail!("guest timed out after {timeout:?}; serial log:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = read_lossy(&serial);
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    ensure!(status.success(), "qemu exited with {status}: {err}\nserial log:\n{log}");
    ensure!(log.contains("TESSERA-GUEST-DONE"), "guest init did not finish; serial log:\n{log}");
    Ok(log)
}

/// The serial log as text: it may hold stray non-UTF-8 bytes (console control output).
fn read_lossy(path: &Path) -> String {
    fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

/// The host's TSC rate in kHz (`cpu MHz` of /proc/cpuinfo), 2 GHz if unknown.
fn host_tsc_khz() -> u64 {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map_or(2_000_000, |mhz| (mhz * 1000.0) as u64)
}

/// A guest script that mounts `/dev/vda` read-only and prints `sha256  ./path` for every regular file
/// (and `L target ./path` for every symlink) between markers.
pub const CHECKSUM_SCRIPT: &str = "\
if mount -t ext4 -o ro /dev/vda /mnt; then
  cd /mnt
  echo TESSERA-SUMS-BEGIN
  find . -type f | sort | while read -r f; do sha256sum \"$f\"; done
  find . -type l | sort | while read -r f; do echo \"L $(readlink \"$f\") $f\"; done
  echo TESSERA-SUMS-END
  cd /
  umount /mnt
else
  echo TESSERA-MOUNT-FAILED
fi";

/// Parse the checksum script's output: path → `sha256 hex` or `-> target`.
pub fn parse_sums(log: &str) -> Result<BTreeMap<String, String>> {
    let begin = log.find("TESSERA-SUMS-BEGIN").context("no TESSERA-SUMS-BEGIN in the serial log")?;
    let end = log.find("TESSERA-SUMS-END").context("no TESSERA-SUMS-END in the serial log")?;
    let mut out = BTreeMap::new();
    for line in log[begin..end].lines().skip(1) {
        let line = line.trim_end_matches('\r');
        if let Some(rest) = line.strip_prefix("L ") {
            let (target, path) = rest.rsplit_once(' ').context("bad symlink line")?;
            out.insert(path.trim_start_matches("./").to_owned(), format!("-> {target}"));
        } else if let Some((sum, path)) = line.split_once("  ") {
            out.insert(path.trim_start_matches("./").to_owned(), sum.to_owned());
        }
    }
    Ok(out)
}

/// The same map computed on the host for a source tree (UTF-8 names without newlines only).
pub fn host_sums(src: &Path) -> Result<BTreeMap<String, String>> {
    use sha2::{Digest, Sha256};
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir)? {
            let e = e?;
            let path = e.path();
            let rel = path.strip_prefix(src)?.to_string_lossy().into_owned();
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(path);
            } else if ft.is_symlink() {
                out.insert(rel, format!("-> {}", fs::read_link(&path)?.to_string_lossy()));
            } else if ft.is_file() {
                let mut h = Sha256::new();
                std::io::copy(&mut fs::File::open(&path)?, &mut h)?;
                out.insert(rel, hex::encode(h.finalize()));
            }
        }
    }
    Ok(out)
}

/// An initramfs script that makes the Tessera image the root filesystem: mount `/dev/vda` and
/// `switch_root` into it, running its `/sbin/init`.
pub const SWITCH_ROOT_SCRIPT: &str = "\
umount /proc /sys
mount -t ext4 -o ro /dev/vda /newroot || { echo TESSERA-MOUNT-FAILED; poweroff -f; }
umount /dev
exec switch_root /newroot /sbin/init";

/// A minimal bootable root filesystem: busybox, its applet links, an `/sbin/init` that prints
/// `TESSERA-GUEST-DONE` after running `command`, and an `/etc/motd`.
pub fn bootable_rootfs(kit: &GuestKit, dest: &Path, command: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if dest.exists() {
        fs::remove_dir_all(dest)?;
    }
    for d in ["bin", "sbin", "etc", "dev", "proc", "sys", "tmp", "root", "usr/bin"] {
        fs::create_dir_all(dest.join(d))?;
    }
    fs::copy(&kit.busybox, dest.join("bin/busybox"))?;
    let applets = output(Command::new(&kit.busybox).arg("--list"))?;
    for a in applets.lines().map(str::trim).filter(|a| !a.is_empty() && *a != "busybox") {
        let link = dest.join("bin").join(a);
        if !link.exists() {
            std::os::unix::fs::symlink("busybox", &link)?;
        }
    }
    fs::write(
        dest.join("etc/motd"),
        "Hello from a Tessera image: ext4 synthesized by tessera build, served lazily by tessera serve.\n",
    )?;
    let init = format!(
        "#!/bin/sh\nmount -t proc proc /proc\nmount -t sysfs sys /sys\nmount -t devtmpfs dev /dev\n\
         echo TESSERA-DEMO-BEGIN\n{command}\necho TESSERA-DEMO-END\necho TESSERA-GUEST-DONE\npoweroff -f\n"
    );
    fs::write(dest.join("sbin/init"), init)?;
    fs::set_permissions(dest.join("sbin/init"), fs::Permissions::from_mode(0o755))?;
    Ok(())
}
