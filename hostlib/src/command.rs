//! External commands (systemctl, kill, ...) go through [`CommandRunner`]:
//! the real one logs what ran and puts stderr into the error; the recording
//! one lets tests assert the exact calls.

use std::sync::Mutex;

/// A command that failed, with what it said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{command}` failed: {message}")]
pub struct CommandError {
    /// The command line, for the message.
    pub command: String,
    /// Its stderr (or why it could not start).
    pub message: String,
}

/// Runs external commands.
pub trait CommandRunner: Send + Sync + std::fmt::Debug {
    /// Runs `argv` to completion; stdout on success.
    fn run(&self, argv: &[String]) -> Result<String, CommandError>;
}

/// Runs commands for real.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemRunner;

impl CommandRunner for SystemRunner {
    fn run(&self, argv: &[String]) -> Result<String, CommandError> {
        let line = argv.join(" ");
        let (program, args) = argv.split_first().ok_or_else(|| CommandError {
            command: line.clone(),
            message: "empty command".into(),
        })?;
        let out = std::process::Command::new(program)
            .args(args)
            .output()
            .map_err(|e| CommandError {
                command: line.clone(),
                message: e.to_string(),
            })?;
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        tracing::info!(command = %line, status = %out.status, stderr = %stderr, "ran a host command");
        if !out.status.success() {
            return Err(CommandError {
                command: line,
                message: if stderr.is_empty() {
                    out.status.to_string()
                } else {
                    stderr
                },
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Records every command and answers from a script (default: success, no output).
#[derive(Debug, Default)]
pub struct RecordingRunner {
    calls: Mutex<Vec<Vec<String>>>,
    fail_with: Mutex<Option<String>>,
}

impl RecordingRunner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every command so far.
    pub fn calls(&self) -> Vec<Vec<String>> {
        self.calls.lock().unwrap().clone()
    }

    /// Make every later command fail with `message`.
    pub fn fail_with(&self, message: &str) {
        *self.fail_with.lock().unwrap() = Some(message.to_string());
    }
}

impl CommandRunner for RecordingRunner {
    fn run(&self, argv: &[String]) -> Result<String, CommandError> {
        self.calls.lock().unwrap().push(argv.to_vec());
        match self.fail_with.lock().unwrap().clone() {
            Some(message) => Err(CommandError {
                command: argv.join(" "),
                message,
            }),
            None => Ok(String::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_runner_puts_stderr_in_the_error() {
        let err = SystemRunner
            .run(&["sh".into(), "-c".into(), "echo broken >&2; exit 3".into()])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "`sh -c echo broken >&2; exit 3` failed: broken"
        );
        assert_eq!(
            SystemRunner.run(&["echo".into(), "hi".into()]).unwrap(),
            "hi\n"
        );
    }

    #[test]
    fn recorder_records_and_fails_on_demand() {
        let r = RecordingRunner::new();
        r.run(&["systemctl".into(), "restart".into(), "containerd".into()])
            .unwrap();
        r.fail_with("Unit containerd.service not found.");
        assert!(r.run(&["x".into()]).is_err());
        assert_eq!(
            r.calls(),
            vec![
                vec![
                    "systemctl".to_string(),
                    "restart".into(),
                    "containerd".into()
                ],
                vec!["x".to_string()]
            ]
        );
    }
}
