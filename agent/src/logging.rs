//! Logs are events: `tracing` with fields (`gpu=`, `stage=`). Under systemd
//! they go to the journal (structured fields kept); in a container to stderr
//! as text or JSON.

use std::io::IsTerminal;
use std::os::unix::fs::MetadataExt;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

/// Where and how to log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// The journal when stderr is connected to it (systemd sets
    /// `JOURNAL_STREAM`), text otherwise.
    Auto,
    Text,
    Json,
    Journald,
}

/// True when stderr is the journal stream systemd gave us: `JOURNAL_STREAM`
/// is `<dev>:<inode>` of that stream, which we compare with fd 2.
pub fn stderr_is_journal() -> bool {
    let Ok(v) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.split_once(':') else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    dev.parse::<u64>().ok() == Some(meta.dev()) && ino.parse::<u64>().ok() == Some(meta.ino())
}

/// Installs the global subscriber. The filter comes from `GPU_AGENT_LOG`
/// (e.g. `debug`, `gpu_agent=trace`), else `default_level`. Returns a note
/// for the user when the journal was asked for but cannot be reached (we
/// then log text to stderr rather than lose the logs).
pub fn init(format: LogFormat, default_level: &str) -> Option<String> {
    let filter = || {
        EnvFilter::try_from_env("GPU_AGENT_LOG").unwrap_or_else(|_| EnvFilter::new(default_level))
    };
    let want_journal = match format {
        LogFormat::Journald => true,
        LogFormat::Auto => stderr_is_journal(),
        _ => false,
    };
    let mut note = None;
    if want_journal {
        match tracing_journald::layer() {
            Ok(layer) => {
                // No field prefix: `journalctl STAGE=discover GPU_UUID=GPU-...` works.
                let layer = layer
                    .with_syslog_identifier("gpu-agent".into())
                    .with_field_prefix(None);
                let _ = tracing_subscriber::registry()
                    .with(filter())
                    .with(layer)
                    .try_init();
                return None;
            }
            Err(e) => {
                note = Some(format!(
                    "cannot log to the journal ({e}); logging to stderr instead"
                ));
            }
        }
    }
    let registry = tracing_subscriber::registry().with(filter());
    let _ = if format == LogFormat::Json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init()
    } else {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(colour(
                        std::io::stderr().is_terminal(),
                        std::env::var_os("NO_COLOR"),
                    ))
                    .with_target(false),
            )
            .try_init()
    };
    note
}

/// Colour codes only for a person at a terminal: never into a file, a pipe
/// or `kubectl logs`, and not when `NO_COLOR` is set to anything but the
/// empty string (no-color.org).
pub fn colour(stderr_is_tty: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_tty && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())));
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None));
    }
}
