//! Structured logging: `RUST_LOG` filters (default `info`), text or JSON lines.

use crate::config::LogFormat;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; later calls do nothing.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
