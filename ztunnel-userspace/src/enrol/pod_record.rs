//! Pods the CNI plugin enrolled, kept on the node so that a restarted
//! ztunnel can enrol them again.
//!
//! The plugin runs only when a pod is created or deleted. Without these
//! records a ztunnel that restarts (an upgrade, a crash) would not know the
//! pods enrolled before, and after `--reconcile-grace` its sweep would
//! remove their capture: their traffic would then leave around the mesh.
//! So `ztunnel-cni` writes one file per pod at `ADD` (before asking
//! ztunnel, so no enrolled pod lacks one) and removes it at `DEL` (even
//! when ztunnel is down); ztunnel reads them at start, before the sweep, and
//! enrols each pod whose network namespace still exists. A record whose
//! namespace is gone (the runtime removed the sandbox) is deleted.
//!
//! One JSON file per pod, `<dir>/<uid>.json`, written to a temporary name
//! and renamed, so a reader never sees half a record.

use std::{
    io,
    path::{Path, PathBuf},
};

/// Default folder, beside the enrolment socket (both host paths the
/// plugin and ztunnel share).
pub const DEFAULT_DIR: &str = "/var/run/ztunnel/pods";

/// One pod.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodRecord {
    /// Pod uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account.
    pub service_account: String,
    /// The network namespace path the runtime gave (`CNI_NETNS`).
    pub netns: PathBuf,
}

/// Errors of the record folder; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Reading, writing or removing failed.
    #[error("pod record {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The file is not a record.
    #[error("pod record {path} is not valid: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A uid that cannot be a file name.
    #[error("pod uid {0:?} cannot name a record file (empty, '.', '..' or containing '/')")]
    Uid(String),
}

fn file(dir: &Path, uid: &str) -> Result<PathBuf, RecordError> {
    if uid.is_empty() || uid == "." || uid == ".." || uid.contains('/') || uid.contains('\0') {
        return Err(RecordError::Uid(uid.to_owned()));
    }
    Ok(dir.join(format!("{uid}.json")))
}

/// Writes (or replaces) the record of `record.uid`.
pub fn write(dir: &Path, record: &PodRecord) -> Result<(), RecordError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = file(dir, &record.uid)?;
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RecordError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let tmp = dir.join(format!(".{}.tmp", record.uid));
    let text = serde_json::to_vec_pretty(record).map_err(|e| RecordError::Invalid {
        path: path.clone(),
        message: e.to_string(),
    })?;
    {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        f.write_all(&text).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io_err(&path))
}

/// Removes the record of `uid`; whether there was one.
pub fn remove(dir: &Path, uid: &str) -> Result<bool, RecordError> {
    let path = file(dir, uid)?;
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(RecordError::Io { path, source }),
    }
}

/// Every record in `dir` (none when it does not exist), each with its
/// file; a file that is not a valid record is an error naming it.
pub fn read_all(dir: &Path) -> Vec<Result<PodRecord, RecordError>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read(&path).map_err(|source| RecordError::Io {
                path: path.clone(),
                source,
            })?;
            let record: PodRecord =
                serde_json::from_slice(&text).map_err(|e| RecordError::Invalid {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            if file(dir, &record.uid)? != path {
                return Err(RecordError::Invalid {
                    path,
                    message: format!("it holds uid {:?}, not its file name's", record.uid),
                });
            }
            Ok(record)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(uid: &str) -> PodRecord {
        PodRecord {
            uid: uid.into(),
            name: "web".into(),
            namespace: "demo".into(),
            service_account: "web".into(),
            netns: "/var/run/netns/cni-1".into(),
        }
    }

    #[test]
    fn records_are_written_read_back_and_removed() {
        let dir = std::env::temp_dir().join(format!("zt-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(read_all(&dir).is_empty());
        write(&dir, &record("u1")).expect("write");
        write(&dir, &record("u2")).expect("write");
        let read: Vec<PodRecord> = read_all(&dir).into_iter().map(Result::unwrap).collect();
        assert_eq!(read, vec![record("u1"), record("u2")]);
        assert!(remove(&dir, "u1").expect("remove"));
        assert!(!remove(&dir, "u1").expect("again"));
        // A truncated file, and one that lies about its uid, are named.
        std::fs::write(dir.join("bad.json"), b"{\"uid\": \"ba").expect("write");
        std::fs::write(
            dir.join("other.json"),
            serde_json::to_vec(&record("u2")).expect("json"),
        )
        .expect("write");
        let errors: Vec<String> = read_all(&dir)
            .into_iter()
            .filter_map(Result::err)
            .map(|e| e.to_string())
            .collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("bad.json"), "{errors:?}");
        assert!(errors[1].contains("other.json") && errors[1].contains("u2"));
        assert!(matches!(
            write(&dir, &record("../x")),
            Err(RecordError::Uid(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
