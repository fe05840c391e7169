//! Removes objects left by crashed earlier test runs: namespaces, cgroups
//! and bpffs mounts named `zt-<pid>-...` whose `<pid>` is no longer a
//! running process. Objects of live test processes (including this one) and
//! anything not carrying our prefix are never touched.

use std::{fs, path::Path, process::Command};

use crate::{PREFIX, bpffs, cgroup, run_quiet};

/// Parent of every test's scratch folder.
pub const SCRATCH_PARENT: &str = "/tmp/ztunnel-tests";

/// The pid encoded in `zt-<pid>-...`, if the name has our shape.
fn owner_pid(name: &str) -> Option<i32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

fn is_stale(name: &str) -> bool {
    owner_pid(name).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
}

/// Sweeps every kind of object we create.
pub fn stale() {
    if let Ok(entries) = fs::read_dir("/var/run/netns") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_stale(&name) {
                eprintln!("sweep: removing stale namespace {name}");
                run_quiet(Command::new("ip").args(["netns", "del", &name]));
            }
        }
    }
    let tests = cgroup::cgroup2_root().join(cgroup::TESTS_DIR);
    if let Ok(entries) = fs::read_dir(&tests) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_stale(&name) {
                eprintln!("sweep: removing stale cgroup {name}");
                if let Ok(children) = fs::read_dir(e.path()) {
                    for c in children.flatten().filter(|c| c.path().is_dir()) {
                        cgroup::remove_cgroup(&c.path());
                    }
                }
                cgroup::remove_cgroup(&e.path());
            }
        }
    }
    if let Ok(entries) = fs::read_dir(SCRATCH_PARENT) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_stale(&name) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    if let Ok(entries) = fs::read_dir(bpffs::MOUNT_PARENT) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_stale(&name) {
                eprintln!("sweep: removing stale bpffs {name}");
                bpffs::unmount(&e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_shape_has_an_owner() {
        assert_eq!(owner_pid("zt-123-4-fabric"), Some(123));
        assert_eq!(owner_pid("zt-abc"), None);
        assert_eq!(owner_pid("cni-123"), None);
    }

    #[test]
    fn this_process_is_never_stale() {
        assert!(!is_stale(&format!("zt-{}-0-x", std::process::id())));
    }
}
