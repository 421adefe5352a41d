//! CPU placement for the replay benchmarks on a small machine: the daemon under test (or the
//! peer) on one CPU, the replaying client on another. Unpinned, the scheduler puts the client,
//! the daemon's queue thread and its fetch threads wherever it likes, run by run, and on two CPUs
//! that placement alone moves a warmed replay by half (`docs/benchmarks.md`); pinned, a ratio of
//! two daemons measures their code. The daemon gets the CPU the issue calls production's layout:
//! its own.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// Which CPU the client and the daemon run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub client: usize,
    pub daemon: usize,
}

impl Placement {
    /// The first two CPUs this process may use: the client on the first, the daemon on the
    /// second. `None` on a one-CPU machine.
    pub fn split() -> Option<Self> {
        let all = sched_getaffinity(None).ok()?;
        let mut cpus = (0..CpuSet::MAX_CPU).filter(|&c| all.is_set(c));
        Some(Self { client: cpus.next()?, daemon: cpus.next()? })
    }

    /// A command running `program` on the daemon's CPU (`taskset`, util-linux: it execs the
    /// program, so the child is the daemon itself).
    pub fn daemon_command(&self, program: impl AsRef<Path>) -> Command {
        let mut cmd = Command::new("taskset");
        cmd.arg("-c").arg(self.daemon.to_string()).arg(program.as_ref());
        cmd
    }

    /// Run `f` with the calling thread on the client's CPU, then give the thread back the CPUs
    /// it had.
    pub fn on_client<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let before = sched_getaffinity(None).context("sched_getaffinity")?;
        let mut only = CpuSet::new();
        only.set(self.client);
        sched_setaffinity(None, &only).context("sched_setaffinity")?;
        let out = f();
        sched_setaffinity(None, &before).context("sched_setaffinity (restoring)")?;
        Ok(out)
    }
}

/// `program` as a command on `placement`'s daemon CPU, or as it is.
pub fn daemon_command(placement: Option<Placement>, program: impl AsRef<Path>) -> Command {
    match placement {
        Some(p) => p.daemon_command(program),
        None => Command::new(program.as_ref()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_runs_where_it_is_put_and_gets_its_cpus_back() {
        let Some(p) = Placement::split() else { return }; // a one-CPU machine has nothing to place
        assert_ne!(p.client, p.daemon);
        let before = sched_getaffinity(None).unwrap();
        let inside = p.on_client(|| sched_getaffinity(None).unwrap()).unwrap();
        let set: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| inside.is_set(c)).collect();
        assert_eq!(set, vec![p.client]);
        let after = sched_getaffinity(None).unwrap();
        assert!((0..CpuSet::MAX_CPU).all(|c| after.is_set(c) == before.is_set(c)));
        // The daemon's command runs on the daemon's CPU, whatever the caller's.
        let out = p.daemon_command("grep").args(["Cpus_allowed_list", "/proc/self/status"]).output().unwrap();
        let line = String::from_utf8(out.stdout).unwrap();
        assert_eq!(line.split_whitespace().nth(1), Some(p.daemon.to_string().as_str()), "{line}");
    }
}
