//! Debian's generic kernels, fetched with `apt-get download` through an
//! apt configuration of our own under `target/vm/apt` (the machine's
//! sources and `/boot` are never touched), unpacked with `dpkg-deb -x` and
//! given a `modules.dep` with `depmod -b`.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result, bail};

/// A kernel line we test on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Line {
    /// Debian 12's kernel (6.1 LTS): no tcx, clsact fallback.
    #[value(name = "6.1")]
    V6_1,
    /// Debian 12 backports' kernel (6.12 LTS): tcx.
    #[value(name = "6.12")]
    V6_12,
}

impl Line {
    pub const ALL: [Self; 2] = [Self::V6_1, Self::V6_12];

    pub fn label(self) -> &'static str {
        match self {
            Self::V6_1 => "6.1",
            Self::V6_12 => "6.12",
        }
    }

    /// Package names of this line (`apt-cache search --names-only`).
    fn pattern(self) -> &'static str {
        match self {
            Self::V6_1 => r"^linux-image-6\.1\.0-[0-9]+-amd64$",
            Self::V6_12 => r"^linux-image-6\.12\.[0-9]+\+deb12-amd64$",
        }
    }
}

/// An unpacked kernel package.
pub struct Kernel {
    /// `uname -r` of the kernel.
    pub release: String,
    /// The folder the package was unpacked into (holds `boot/` and
    /// `lib/modules/<release>/`).
    pub root: PathBuf,
}

impl Kernel {
    pub fn image(&self) -> PathBuf {
        self.root
            .join("boot")
            .join(format!("vmlinuz-{}", self.release))
    }
}

const SOURCES: &str = "\
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main
";

/// Package lists older than this are refreshed (point releases replace
/// the kernel packages and delete the old ones from the mirror).
const LISTS_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

struct Apt {
    dir: PathBuf,
}

impl Apt {
    fn new(vm_dir: &Path) -> Result<Self> {
        let dir = vm_dir.join("apt");
        for sub in ["lists/partial", "cache/archives/partial"] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("create {}", dir.join(sub).display()))?;
        }
        std::fs::write(dir.join("sources.list"), SOURCES)?;
        Ok(Self { dir })
    }

    fn options(&self) -> Vec<String> {
        let d = self.dir.display();
        vec![
            format!("-oDir::Etc::SourceList={d}/sources.list"),
            "-oDir::Etc::SourceParts=/nonexistent".into(),
            format!("-oDir::State::Lists={d}/lists"),
            format!("-oDir::Cache={d}/cache"),
            // Our own state folder: no lock shared with the machine's apt.
            "-oDebug::NoLocking=1".into(),
            "-oAPT::Sandbox::User=root".into(),
        ]
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.args(self.options());
        c
    }

    fn lists_fresh(&self) -> bool {
        let stamp = self.dir.join("lists").join("updated");
        std::fs::metadata(&stamp)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age < LISTS_MAX_AGE)
    }

    fn update(&self) -> Result<()> {
        if self.lists_fresh() {
            return Ok(());
        }
        eprintln!(
            "xtask: vm: apt-get update (own lists under {})",
            self.dir.display()
        );
        let ok = self
            .command("apt-get")
            .args(["update", "-q"])
            .status()
            .context("run apt-get update")?
            .success();
        if !ok {
            bail!(
                "apt-get update failed for the kernel package lists (is deb.debian.org reachable?)"
            );
        }
        std::fs::write(self.dir.join("lists").join("updated"), b"")?;
        Ok(())
    }

    /// The newest package whose name matches `pattern`.
    fn newest(&self, pattern: &str) -> Result<String> {
        let out = self
            .command("apt-cache")
            .args(["search", "--names-only", pattern])
            .output()
            .context("run apt-cache search")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        names.sort_by_key(|n| version_key(n));
        names
            .last()
            .map(|s| (*s).to_owned())
            .with_context(|| format!("no kernel package matches {pattern}"))
    }

    fn download(&self, package: &str, into: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(into)?;
        let ok = self
            .command("apt-get")
            .current_dir(into)
            .args(["download", "-q", package])
            .status()
            .context("run apt-get download")?
            .success();
        if !ok {
            bail!("apt-get download {package} failed");
        }
        std::fs::read_dir(into)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{package}_")))
                    && p.extension().is_some_and(|e| e == "deb")
            })
            .with_context(|| format!("apt-get download left no .deb for {package}"))
    }
}

/// Numbers in a package name, for ordering `6.1.0-9` before `6.1.0-50`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// Makes sure the newest kernel of `line` is unpacked under
/// `<vm_dir>/kernels/` and returns it. Reuses an unpacked one when the
/// package lists cannot be refreshed (offline).
pub fn fetch(vm_dir: &Path, line: Line) -> Result<Kernel> {
    let kernels = vm_dir.join("kernels");
    let apt = Apt::new(vm_dir)?;
    let package = match apt.update().and_then(|()| apt.newest(line.pattern())) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "xtask: vm: {e:#}; looking for an unpacked {} kernel",
                line.label()
            );
            return unpacked(&kernels, line)?.with_context(|| {
                format!(
                    "no {} kernel unpacked and none can be fetched",
                    line.label()
                )
            });
        }
    };
    let root = kernels.join(&package);
    if !root.join(".unpacked").is_file() {
        eprintln!("xtask: vm: fetching {package}");
        let deb = apt.download(&package, &vm_dir.join("debs"))?;
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)?;
        let ok = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&root)
            .status()
            .context("run dpkg-deb")?
            .success();
        if !ok {
            bail!("dpkg-deb -x {} failed", deb.display());
        }
        let release = release_of(&root)?;
        let ok = Command::new("depmod")
            .arg("-b")
            .arg(&root)
            .arg(&release)
            .status()
            .context("run depmod (package kmod)")?
            .success();
        if !ok {
            bail!("depmod -b {} {release} failed", root.display());
        }
        std::fs::write(root.join(".unpacked"), &release)?;
        // The .deb is not needed once unpacked.
        let _ = std::fs::remove_file(&deb);
    }
    let release = release_of(&root)?;
    Ok(Kernel { release, root })
}

fn unpacked(kernels: &Path, line: Line) -> Result<Option<Kernel>> {
    let Ok(entries) = std::fs::read_dir(kernels) else {
        return Ok(None);
    };
    let re_prefix = match line {
        Line::V6_1 => "linux-image-6.1.",
        Line::V6_12 => "linux-image-6.12.",
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join(".unpacked").is_file())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(re_prefix))
        })
        .collect();
    found.sort_by_key(|p| version_key(&p.to_string_lossy()));
    match found.pop() {
        Some(root) => Ok(Some(Kernel {
            release: release_of(&root)?,
            root,
        })),
        None => Ok(None),
    }
}

/// `uname -r` of an unpacked package: its one `lib/modules/<release>`.
fn release_of(root: &Path) -> Result<String> {
    let modules = root.join("lib").join("modules");
    let mut names: Vec<String> = std::fs::read_dir(&modules)
        .with_context(|| format!("read {}", modules.display()))?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    if names.len() != 1 {
        bail!(
            "{} holds {names:?}, expected one kernel release",
            modules.display()
        );
    }
    Ok(names.remove(0))
}

#[cfg(test)]
mod tests {
    use super::version_key;

    #[test]
    fn newer_abi_sorts_later() {
        let mut names = [
            "linux-image-6.1.0-50-amd64",
            "linux-image-6.1.0-9-amd64",
            "linux-image-6.1.0-47-amd64",
        ];
        names.sort_by_key(|n| version_key(n));
        assert_eq!(names.last(), Some(&"linux-image-6.1.0-50-amd64"));
        let mut names = [
            "linux-image-6.12.9+deb12-amd64",
            "linux-image-6.12.73+deb12-amd64",
        ];
        names.sort_by_key(|n| version_key(n));
        assert_eq!(names.last(), Some(&"linux-image-6.12.73+deb12-amd64"));
    }
}
