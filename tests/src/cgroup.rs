//! cgroup v2 directories created by tests, removed on drop.

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// Folder under the cgroup2 root that holds every test run's cgroups.
pub const TESTS_DIR: &str = "ztunnel-tests";

/// The cgroup2 mount, from `/proc/self/mounts` (never hard-coded).
pub fn cgroup2_root() -> PathBuf {
    ztunnel::cgroup::cgroup2_mount().expect("cgroup v2 must be mounted")
}

/// Owns one cgroup directory (and must be dropped after its children).
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup2>/ztunnel-tests/<relative>`.
    pub fn create(relative: &str) -> Self {
        let path = cgroup2_root().join(TESTS_DIR).join(relative);
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Self { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `cgroup.procs`, where a pid is written to move it here.
    pub fn procs(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        remove_cgroup(&self.path);
    }
}

/// Removes a cgroup directory, waiting briefly for exiting processes to
/// leave it (rmdir fails with EBUSY until they have).
pub fn remove_cgroup(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match fs::remove_dir(path) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if Instant::now() >= deadline => {
                eprintln!("cleanup: cannot remove cgroup {}: {e}", path.display());
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
