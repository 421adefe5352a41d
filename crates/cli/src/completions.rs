//! `tessera completions SHELL` and `tessera man`: generated from the clap definitions
//! (clap_complete, clap_mangen), so they cannot disagree with `--help`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};
use clap_complete::Shell;

/// Print a shell completion script for tessera to stdout.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
tessera completions bash > /etc/bash_completion.d/tessera\n  \
tessera completions zsh > \"${fpath[1]}/_tessera\"\n  \
tessera completions fish > ~/.config/fish/completions/tessera.fish\n  \
tessera completions elvish >> ~/.config/elvish/rc.elv\n  \
tessera completions powershell >> $PROFILE")]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: Shell,
}

/// Write tessera's manual pages (roff), generated from the same definitions as --help.
#[derive(Debug, Args)]
#[command(after_help = "Without --out, prints tessera(1) to stdout. With --out, writes tessera.1 and one \
page per subcommand (tessera-build.1, tessera-cache-gc.1, ...) into DIR.\n\
\n\
Examples:\n  \
tessera man | man -l -\n  \
tessera man --out /usr/local/share/man/man1 && mandb -q\n  \
man tessera-serve")]
pub struct ManArgs {
    /// Write every page into this directory (created if missing) instead of tessera.1 to stdout.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub fn completions(a: CompletionsArgs) -> Result<()> {
    let mut cmd = crate::Cli::command();
    let mut out = std::io::stdout().lock();
    clap_complete::generate(a.shell, &mut cmd, "tessera", &mut out);
    out.flush().context("write the completion script to stdout")
}

pub fn man(a: ManArgs) -> Result<()> {
    let cmd = crate::Cli::command();
    match a.out {
        None => {
            let mut out = std::io::stdout().lock();
            clap_mangen::Man::new(cmd).render(&mut out).context("write tessera.1 to stdout")?;
            out.flush().context("write tessera.1 to stdout")
        }
        Some(dir) => write_pages(cmd, &dir),
    }
}

/// tessera.1 and tessera-SUB[-SUB].1 for every subcommand (clap_mangen's naming).
fn write_pages(cmd: clap::Command, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    clap_mangen::generate_to(cmd, dir).with_context(|| format!("write manual pages into {}", dir.display()))
}
