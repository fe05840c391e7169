//! What the tests get back from `zt-raw`: [`Outcome`], the one JSON line the
//! binary prints, with its parser, and [`bin_path`] to find the binary.

use std::path::PathBuf;

/// What one `zt-raw` session saw; printed as one JSON line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The target answered the SYN with a SYN-ACK.
    pub syn_ack: bool,
    /// Data the target sent back (lossy UTF-8; may be empty).
    pub data: String,
    /// The target closed its side (FIN).
    pub fin: bool,
    /// The target reset the connection (to the SYN or later).
    pub rst: bool,
    /// The attacker's source port.
    pub sport: u16,
}

impl Outcome {
    /// The JSON line, fields in a fixed order (no trailing newline).
    pub fn to_json_line(&self) -> String {
        format!(
            r#"{{"syn_ack":{},"data":{},"fin":{},"rst":{},"sport":{}}}"#,
            self.syn_ack,
            serde_json::Value::String(self.data.clone()),
            self.fin,
            self.rst,
            self.sport
        )
    }

    /// Reads the line `zt-raw` printed; `None` if it is not one.
    pub fn parse(line: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        Some(Self {
            syn_ack: v.get("syn_ack")?.as_bool()?,
            data: v.get("data")?.as_str()?.to_owned(),
            fin: v.get("fin")?.as_bool()?,
            rst: v.get("rst")?.as_bool()?,
            sport: u16::try_from(v.get("sport")?.as_u64()?).ok()?,
        })
    }
}

/// Path of the `zt-raw` binary, next to the running test binary's target
/// directory (like [`crate::probe_bin`]).
pub fn bin_path() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("target dir")
    } else {
        dir
    };
    let bin = dir.join("zt-raw");
    assert!(
        bin.is_file(),
        "{} missing: build the ztunnel-tests package's binaries",
        bin.display()
    );
    bin
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_round_trips_through_its_json_line() {
        let out = Outcome {
            syn_ack: true,
            data: "HELLO\n\"x\"".into(),
            fin: false,
            rst: true,
            sport: 40001,
        };
        let line = out.to_json_line();
        assert_eq!(
            line,
            r#"{"syn_ack":true,"data":"HELLO\n\"x\"","fin":false,"rst":true,"sport":40001}"#
        );
        assert_eq!(Outcome::parse(&line), Some(out));
        assert_eq!(Outcome::parse("READY"), None);
    }
}
