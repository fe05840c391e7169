//! The bpffs folder where ztunnel pins its maps and links.
//!
//! Layout under the pin root (default `/sys/fs/bpf/ztunnel`):
//! - `maps/<MAP_NAME>`: every map, reused by a restarted ztunnel;
//! - `links/cgroup_<program>`: the cgroup attachments;
//! - `links/tc_<pod>`: each enrolled pod's tcx attachment.
//!
//! Pinned links keep the programs attached while no ztunnel runs, which is
//! what makes capture fail closed: traffic still goes to the (now absent)
//! listeners instead of silently going direct.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

/// `BPF_FS_MAGIC` from `statfs(2)`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Errors preparing the pin folder.
#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    /// The folder is not on a bpffs mount.
    #[error(
        "{0} is not on a bpf filesystem: mount one (`mount -t bpf bpf /sys/fs/bpf`) or pass \
         --bpffs with a folder on one"
    )]
    NotBpffs(PathBuf),
    /// Creating or listing a folder failed.
    #[error("cannot prepare pin folder {path}: {source}")]
    Io {
        /// The folder.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// The pin folder of one ztunnel.
#[derive(Debug, Clone)]
pub struct PinRoot {
    root: PathBuf,
}

impl PinRoot {
    /// Checks that `root`'s nearest existing ancestor is on bpffs, then
    /// creates `root/maps` and `root/links`.
    pub fn prepare(root: &Path) -> Result<Self, BpffsError> {
        let existing = root
            .ancestors()
            .find(|p| p.exists())
            .unwrap_or_else(|| Path::new("/"));
        if !is_bpffs(existing) {
            return Err(BpffsError::NotBpffs(root.to_path_buf()));
        }
        let this = Self {
            root: root.to_path_buf(),
        };
        for dir in [this.maps(), this.links()] {
            fs::create_dir_all(&dir).map_err(|source| BpffsError::Io { path: dir, source })?;
        }
        Ok(this)
    }

    /// `root` as a name only, neither checked nor created: for a ztunnel
    /// that pins nothing (`--capture istio-cni`).
    pub fn unused(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
        }
    }

    /// The root folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Folder of pinned maps.
    pub fn maps(&self) -> PathBuf {
        self.root.join("maps")
    }

    /// Folder of pinned links.
    pub fn links(&self) -> PathBuf {
        self.root.join("links")
    }

    /// Path of a pinned link by name.
    pub fn link(&self, name: &str) -> PathBuf {
        self.links().join(name)
    }

    /// Every pinned object below the root (files only), for audits and tests.
    pub fn pinned_objects(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for dir in [self.maps(), self.links()] {
            if let Ok(entries) = fs::read_dir(&dir) {
                out.extend(entries.flatten().map(|e| e.path()));
            }
        }
        out.sort();
        out
    }

    /// Removes every pin and the folders themselves (`--cleanup`). Objects
    /// still referenced by open fds live on until those close.
    pub fn remove_all(&self) -> Result<(), BpffsError> {
        for pin in self.pinned_objects() {
            fs::remove_file(&pin).map_err(|source| BpffsError::Io { path: pin, source })?;
        }
        for dir in [self.maps(), self.links(), self.root.clone()] {
            match fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(BpffsError::Io { path: dir, source }),
            }
        }
        Ok(())
    }
}

/// Whether `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
}
