//! A private bpffs instance per test, so pins never mix with the machine's
//! or another test's. Mounted under `/run/ztunnel-tests/<prefix>`, unmounted
//! and removed on drop (which also drops every pin in it).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use crate::{run, run_quiet};

/// Parent folder of every test bpffs mount.
pub const MOUNT_PARENT: &str = "/run/ztunnel-tests";

/// Owns a bpffs mount.
#[derive(Debug)]
pub struct TestBpffs {
    mount: PathBuf,
}

impl TestBpffs {
    /// Mounts a fresh bpffs at `/run/ztunnel-tests/<prefix>`.
    pub fn mount(prefix: &str) -> Self {
        let mount = PathBuf::from(MOUNT_PARENT).join(prefix);
        fs::create_dir_all(&mount).expect("create bpffs mount point");
        run(Command::new("mount").args(["-t", "bpf", "bpf"]).arg(&mount));
        Self { mount }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// Every pin below the mount, for leak checks. The kernel's own
    /// `maps.debug`/`progs.debug` iterator files of a fresh bpffs are not pins.
    pub fn pins(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        collect(&self.mount, &mut out);
        out.retain(|p| {
            !matches!(
                p.file_name().and_then(|n| n.to_str()),
                Some("maps.debug" | "progs.debug")
            )
        });
        out.sort();
        out
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                collect(&p, out);
            } else {
                out.push(p);
            }
        }
    }
}

impl Drop for TestBpffs {
    fn drop(&mut self) {
        unmount(&self.mount);
    }
}

/// Unmounts and removes a test bpffs mount point.
pub fn unmount(mount: &Path) {
    run_quiet(Command::new("umount").arg(mount));
    if let Err(e) = fs::remove_dir(mount)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("cleanup: cannot remove {}: {e}", mount.display());
    }
}
