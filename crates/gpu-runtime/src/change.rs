//! One file's planned change and its unified diff: what every runtime's
//! planner returns and the stage shows before writing.

/// One file's planned change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileChange {
    /// Host path.
    pub path: String,
    /// `None`: the file does not exist yet.
    pub before: Option<String>,
    pub after: String,
}

impl FileChange {
    pub fn new(path: &str, before: Option<String>, after: String) -> Self {
        FileChange {
            path: path.to_string(),
            before,
            after,
        }
    }

    pub fn changes_anything(&self) -> bool {
        self.before.as_deref() != Some(self.after.as_str())
    }

    /// A unified diff (`--- a/<path>` / `+++ b/<path>`).
    pub fn diff(&self) -> String {
        let before = self.before.as_deref().unwrap_or("");
        let old = if self.before.is_some() {
            format!("a{}", self.path)
        } else {
            "/dev/null".to_string()
        };
        similar::TextDiff::from_lines(before, &self.after)
            .unified_diff()
            .context_radius(3)
            .header(&old, &format!("b{}", self.path))
            .to_string()
    }
}
