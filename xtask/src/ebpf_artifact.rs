//! Where the built eBPF object lives and how to tell whether it is current.
//!
//! This file is compiled twice: into `xtask` (which writes the object and its
//! stamp) and, via `#[path]`, into `ztunnel-userspace/build.rs` (which refuses
//! to embed an object whose stamp does not match the sources). Keeping the one
//! definition here is what makes "stale object embedded silently" impossible
//! without a second copy of the logic. It uses only `std` for that reason.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// File name of the object that `ztunnel-userspace` embeds.
pub const OBJECT_NAME: &str = "ztunnel-ebpf.o";

/// The built object and the stamp that records which sources made it.
pub struct Artifact {
    /// `<target>/ebpf/ztunnel-ebpf.o`.
    pub object: PathBuf,
    /// `<object>.stamp`: the input hash it was built from.
    pub stamp: PathBuf,
}

/// The cargo target directory: `$CARGO_TARGET_DIR` or `<workspace>/target`.
pub fn target_dir(workspace: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace.join(dir)
            }
        }
        _ => workspace.join("target"),
    }
}

impl Artifact {
    /// Paths of the artifact for the workspace rooted at `workspace`.
    pub fn locate(workspace: &Path) -> Self {
        let object = target_dir(workspace).join("ebpf").join(OBJECT_NAME);
        let stamp = object.with_extension("o.stamp");
        Self { object, stamp }
    }

    /// `Ok(())` when the object exists and was built from the current inputs;
    /// otherwise a sentence saying what is wrong.
    pub fn check_current(&self, workspace: &Path) -> Result<(), String> {
        if !self.object.is_file() {
            return Err(format!("{} does not exist", self.object.display()));
        }
        let recorded = fs::read_to_string(&self.stamp).unwrap_or_default();
        let now = input_hash(workspace);
        if recorded.trim() != now {
            return Err(format!(
                "{} is stale: the eBPF sources changed since it was built",
                self.object.display()
            ));
        }
        Ok(())
    }
}

/// Every file whose content can change the object: the eBPF crate, the shared
/// crate, the workspace manifest and the lock file. Sorted, so the hash does
/// not depend on directory order.
pub fn input_files(workspace: &Path) -> Vec<PathBuf> {
    let mut files = vec![workspace.join("Cargo.toml"), workspace.join("Cargo.lock")];
    for krate in ["ztunnel-ebpf", "ztunnel-common"] {
        files.push(workspace.join(krate).join("Cargo.toml"));
        collect(&workspace.join(krate).join("src"), &mut files);
    }
    files.retain(|f| f.is_file());
    files.sort();
    files
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// FNV-1a (64-bit) over each input's workspace-relative path and content,
/// as 16 hex digits. Not cryptographic: it detects edits, not attacks.
pub fn input_hash(workspace: &Path) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    for file in input_files(workspace) {
        let rel = file.strip_prefix(workspace).unwrap_or(&file);
        feed(rel.to_string_lossy().as_bytes());
        feed(&[0]);
        feed(&fs::read(&file).unwrap_or_default());
        feed(&[0]);
    }
    format!("{hash:016x}")
}
