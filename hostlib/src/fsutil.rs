//! Atomic file writes: a temp file in the same directory, fsync, rename,
//! fsync of the directory. A reader (or a crash) sees the old file or the
//! whole new one, never a part.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Writes `contents` to `path` atomically with permission bits `mode`.
///
/// The temp file is `.<name>.gpu-agent-tmp.<pid>` beside the target, so the
/// rename never crosses a filesystem. On error the temp file is removed and
/// the target is untouched.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp: PathBuf = dir.join(format!(
        ".{}.gpu-agent-tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(contents)?;
        // The mode given to open() is masked by the umask; set it exactly.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_file_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        fs::write(&p, "old contents that are longer").unwrap();
        write_atomic(&p, b"new", 0o644).unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "new");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f")]);
    }

    #[test]
    fn failure_leaves_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        // The target is a non-empty directory: rename fails.
        let p = dir.path().join("d");
        fs::create_dir(&p).unwrap();
        fs::write(p.join("inner"), "x").unwrap();
        assert!(write_atomic(&p, b"new", 0o644).is_err());
        assert_eq!(fs::read_to_string(p.join("inner")).unwrap(), "x");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
