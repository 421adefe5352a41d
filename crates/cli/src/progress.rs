//! Progress bars on stderr (drawn only when stderr is a terminal).

use indicatif::{ProgressBar, ProgressStyle};

/// A byte-counting bar for long phases.
#[derive(Debug)]
pub struct Bar {
    bar: ProgressBar,
    label: &'static str,
}

impl Bar {
    pub fn new(label: &'static str) -> Self {
        let bar = ProgressBar::hidden();
        Self { bar, label }
    }
}

impl Bar {
    /// Jump to an absolute position (for callbacks that report totals).
    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
    }
}

impl tessera_builder::Progress for Bar {
    fn start(&self, total: u64) {
        self.bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        self.bar.set_length(total);
        let style = ProgressStyle::with_template(
            "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        self.bar.set_style(style);
        self.bar.set_message(self.label);
    }

    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
