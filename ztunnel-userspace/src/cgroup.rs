//! Locating cgroup v2: the attach point of the capture programs.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// Errors locating or opening the cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No `cgroup2` mount in `/proc/self/mounts`.
    #[error(
        "no cgroup v2 hierarchy is mounted (no `cgroup2` entry in /proc/self/mounts): the \
         capture programs attach to a cgroup v2 directory; mount one or pass --cgroup"
    )]
    NoCgroup2,
    /// The configured path is not a cgroup v2 directory.
    #[error("--cgroup {0} is not a directory of a cgroup v2 hierarchy")]
    NotCgroup2(PathBuf),
    /// Reading the mount table failed.
    #[error("cannot read /proc/self/mounts: {0}")]
    Mounts(std::io::Error),
}

/// The mount point of the cgroup v2 hierarchy, read from `/proc/self/mounts`
/// (hybrid hosts mount it at `/sys/fs/cgroup/unified`, pure v2 hosts at
/// `/sys/fs/cgroup`; never assume either).
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let mounts = fs::read_to_string("/proc/self/mounts").map_err(CgroupError::Mounts)?;
    parse_cgroup2_mount(&mounts).ok_or(CgroupError::NoCgroup2)
}

fn parse_cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let _source = fields.next()?;
        let target = fields.next()?;
        let fstype = fields.next()?;
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(target)))
    })
}

/// `/proc/self/mounts` escapes spaces and friends as octal (`\040`).
fn unescape_mount_path(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..=i + 3].iter().all(u8::is_ascii_digit)
        {
            let code = u8::from_str_radix(&raw[i + 1..=i + 3], 8).unwrap_or(b'?');
            out.push(code);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks that `path` is a directory inside a cgroup v2 hierarchy.
pub fn validate(path: &Path) -> Result<(), CgroupError> {
    if path.join("cgroup.procs").is_file() && path.join("cgroup.controllers").is_file() {
        Ok(())
    } else {
        Err(CgroupError::NotCgroup2(path.to_path_buf()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_line_among_v1_mounts() {
        let mounts = "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        assert_eq!(
            parse_cgroup2_mount(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn no_cgroup2_line_is_none() {
        assert_eq!(parse_cgroup2_mount("proc /proc proc rw 0 0\n"), None);
    }

    #[test]
    fn octal_escapes_are_decoded() {
        assert_eq!(unescape_mount_path("/a\\040b"), "/a b");
    }
}
