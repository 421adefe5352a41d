//! Reading `tessera serve --metrics`: scrape `/metrics` over HTTP and look samples up.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let m = tessera_e2e::metrics::scrape("127.0.0.1:9100")?;
//! let reads = m.value("tessera_requests_total", &[("type", "read"), ("status", "ok")])?;
//! let bytes = m.value("tessera_request_bytes_total", &[("type", "read")])?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

/// One scrape: the samples, by name, with their labels.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

/// Spawn `cmd` (a `tessera serve` command line) with `--metrics 127.0.0.1:0 --ready-fd N`
/// added, and wait until it is ready: returns the child and the metrics address (`HOST:PORT`)
/// it announced.
pub fn spawn_with_metrics(cmd: &mut Command) -> Result<(Child, String)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) fills two new descriptors; without O_CLOEXEC the child inherits the
    // write end under the same number.
    ensure!(unsafe { libc::pipe(fds.as_mut_ptr()) } == 0, "pipe: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just created and nothing else owns them.
    let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let child = cmd
        .args(["--metrics", "127.0.0.1:0", "--ready-fd", &fds[1].to_string()])
        .spawn()
        .context("starting tessera serve")?;
    drop(tx);
    let lines: Vec<String> =
        BufReader::new(std::fs::File::from(rx)).lines().take(2).collect::<std::io::Result<_>>()?;
    let addr = lines
        .get(1)
        .and_then(|l| l.strip_prefix("metrics http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .with_context(|| format!("tessera serve did not announce its metrics: {lines:?}"))?;
    Ok((child, addr.to_owned()))
}

/// GET `http://ADDR/metrics` and parse it.
pub fn scrape(addr: &str) -> Result<Scrape> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("no end of the response head")?;
    ensure!(head.starts_with("HTTP/1.1 200 "), "GET /metrics: {}", head.lines().next().unwrap_or(""));
    Scrape::parse(body)
}

impl Scrape {
    /// Parse the text exposition format (samples only; comments are skipped).
    pub fn parse(text: &str) -> Result<Self> {
        let mut samples = Vec::new();
        for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').with_context(|| format!("sample line {line:?}"))?;
            let value = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().with_context(|| format!("value in {line:?}"))?,
            };
            let (name, labels) = match series.split_once('{') {
                None => (series, BTreeMap::new()),
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').with_context(|| format!("labels in {line:?}"))?;
                    (name, parse_labels(body).with_context(|| format!("labels in {line:?}"))?)
                }
            };
            samples.push((name.to_owned(), labels, value));
        }
        Ok(Self { samples })
    }

    /// The one sample `name` whose labels include `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        let mut found = self.matching(name, labels);
        match (found.next(), found.next()) {
            (Some(v), None) => Ok(v),
            (None, _) => bail!("no sample {name} {labels:?}"),
            (Some(_), Some(_)) => bail!("several samples {name} {labels:?}"),
        }
    }

    /// The sum of the samples `name` whose labels include `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).sum()
    }

    /// The `q` quantile (0..1) of histogram `name` with `labels`, as the upper bound of the
    /// bucket holding it (what the exposition can tell); `None` without observations.
    pub fn histogram_quantile(&self, name: &str, labels: &[(&str, &str)], q: f64) -> Option<f64> {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|(n, l, _)| {
                *n == bucket && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .filter_map(|(_, l, v)| {
                let le = l.get("le")?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, *v))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        buckets.iter().find(|(_, c)| *c >= q * total).map(|(le, _)| *le)
    }

    fn matching<'a>(&'a self, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = f64> + 'a {
        self.samples
            .iter()
            .filter(move |(n, l, _)| {
                n == name && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| *v)
    }
}

fn parse_labels(body: &str) -> Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut chars = body.chars();
    loop {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if key.is_empty() {
            break;
        }
        ensure!(chars.next() == Some('"'), "label {key} is not quoted");
        let mut val = String::new();
        loop {
            match chars.next() {
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some('n') => val.push('\n'),
                    Some(c) => val.push(c),
                    None => bail!("unterminated escape"),
                },
                Some(c) => val.push(c),
                None => bail!("unterminated label value"),
            }
        }
        labels.insert(key, val);
        match chars.next() {
            Some(',') | None => {}
            Some(c) => bail!("{c:?} after label value"),
        }
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_labels_and_histograms() {
        let text = "# HELP a x\n# TYPE a counter\na 3\nb{x=\"1\",y=\"q\\\"\"} 2\nb{x=\"2\"} 5\n\
                    h_bucket{le=\"0.1\"} 1\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 4\nh_count 4\n";
        let s = Scrape::parse(text).unwrap();
        assert_eq!(s.value("a", &[]).unwrap(), 3.0);
        assert_eq!(s.value("b", &[("y", "q\"")]).unwrap(), 2.0);
        assert_eq!(s.sum("b", &[]), 7.0);
        assert!(s.value("b", &[]).is_err(), "two samples match");
        assert_eq!(s.histogram_quantile("h", &[], 0.5), Some(1.0));
        assert_eq!(s.histogram_quantile("h", &[], 0.25), Some(0.1));
        assert_eq!(s.histogram_quantile("h", &[], 0.99), Some(f64::INFINITY));
        assert!(Scrape::parse("x{a=1} 2\n").is_err());
    }
}
