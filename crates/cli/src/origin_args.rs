//! How remote stores (`http(s)://`, `docker://`) are reached: the settings are read here, in
//! the binary, from the environment (`TESSERA_HTTP_*`), and passed down typed.

use anyhow::Result;
use tessera_store::{HttpConfig, OriginOptions};

/// The origin settings from the process environment.
pub fn origin_options() -> Result<OriginOptions> {
    let http = HttpConfig::from_vars(|name| std::env::var(name).ok())?;
    Ok(OriginOptions { http, ..OriginOptions::default() })
}
