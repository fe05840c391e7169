//! Checking a log filter before it replaces the running one.
//!
//! tracing's `EnvFilter` reads a bare word that is not a level as "this
//! target at TRACE", and a filter without a default level as "everything
//! else off". So `/logging?level=garbage`, or a URL-encoded
//! `ztunnel%3Ddebug`, parsed "fine" and silently turned off every log line,
//! warnings and the access log included. The rules here (the same for
//! `--log` and the admin `/logging` endpoint):
//!
//! - the value of `/logging?level=` is URL-decoded first (`%XX`, `+`);
//! - every directive is a level (`off`, `error`, `warn`, `info`, `debug`,
//!   `trace`) or `target[span{field}]=level`; a bare word is refused with
//!   the directive named, and so is anything `EnvFilter` does not parse;
//! - a filter without a default level gets [`DEFAULT_LEVEL`] for
//!   everything it does not name (`ztunnel=debug` means more of ztunnel,
//!   not nothing of anyone else);
//! - the access log (target `access`) stays on at `info` unless a
//!   directive names it: turning it off is `access=off`, never a side
//!   effect of `warn` or `off`.

use tracing_subscriber::EnvFilter;

/// The level everything gets when a filter names none.
pub const DEFAULT_LEVEL: &str = "info";
/// The access log's tracing target (see `telemetry::connection`).
pub const ACCESS_TARGET: &str = "access";
/// Level names, most severe first.
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Why a log filter was refused. Each names what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogFilterError {
    /// A `%` not followed by two hex digits, or bytes that are not UTF-8.
    #[error("{0:?} is not valid URL encoding")]
    Encoding(String),
    /// Nothing but commas and spaces.
    #[error("the filter is empty")]
    Empty,
    /// A directive without `=level` that is not a level itself; EnvFilter
    /// would read it as "that target at TRACE, everything else off".
    #[error(
        "directive {0:?} has no level: write it as a level (off, error, warn, info, debug, trace) or as target=level"
    )]
    NoLevel(String),
    /// `target=something` where something is not a level.
    #[error(
        "directive {directive:?}: {level:?} is not a level (off, error, warn, info, debug, trace)"
    )]
    BadLevel {
        /// The directive.
        directive: String,
        /// What stood where the level goes.
        level: String,
    },
    /// `EnvFilter` refused it.
    #[error("{filter:?} does not parse: {reason}")]
    Syntax {
        /// The whole filter.
        filter: String,
        /// EnvFilter's message.
        reason: String,
    },
}

/// Decodes a URL query value: `%XX` escapes and `+` for a space.
pub fn url_decode(raw: &str) -> Result<String, LogFilterError> {
    let bad = || LogFilterError::Encoding(raw.to_owned());
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).ok_or_else(bad)?;
                let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

fn is_level(word: &str) -> bool {
    LEVELS.iter().any(|l| l.eq_ignore_ascii_case(word))
}

/// The target a directive names (`""` for a span-only directive).
fn target_of(directive: &str) -> &str {
    let end = directive.find(['[', '=']).unwrap_or(directive.len());
    directive[..end].trim()
}

/// Checks `filter` and returns the filter to install (see the module
/// docs for the rules), or why it is refused.
pub fn complete(filter: &str) -> Result<String, LogFilterError> {
    let directives: Vec<&str> = filter
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if directives.is_empty() {
        return Err(LogFilterError::Empty);
    }
    let mut default = None;
    let mut names_access = false;
    for directive in &directives {
        if is_level(directive) {
            default = Some(directive.to_ascii_lowercase());
            continue;
        }
        // The level follows the last `=`; span field filters (`{f=v}`) sit
        // before it, inside brackets.
        let Some((_, level)) = directive.rsplit_once('=') else {
            return Err(LogFilterError::NoLevel((*directive).to_owned()));
        };
        let level = level.trim();
        if level.contains([']', '}']) {
            return Err(LogFilterError::NoLevel((*directive).to_owned()));
        }
        if !is_level(level) {
            return Err(LogFilterError::BadLevel {
                directive: (*directive).to_owned(),
                level: level.to_owned(),
            });
        }
        // EnvFilter matches targets by prefix: `acc=off` reaches `access`.
        let target = target_of(directive);
        names_access |= !target.is_empty() && ACCESS_TARGET.starts_with(target);
    }
    let mut out: Vec<String> = directives.iter().map(|d| (*d).to_owned()).collect();
    let default = default.unwrap_or_else(|| {
        out.insert(0, DEFAULT_LEVEL.to_owned());
        DEFAULT_LEVEL.to_owned()
    });
    let access_hidden = ["off", "error", "warn"].contains(&default.as_str());
    if access_hidden && !names_access {
        out.push(format!("{ACCESS_TARGET}={DEFAULT_LEVEL}"));
    }
    let completed = out.join(",");
    EnvFilter::builder()
        .parse(&completed)
        .map_err(|e| LogFilterError::Syntax {
            filter: filter.to_owned(),
            reason: e.to_string(),
        })?;
    Ok(completed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_url_decoded() {
        assert_eq!(
            url_decode("ztunnel%3Ddebug%2Cinfo").as_deref(),
            Ok("ztunnel=debug,info")
        );
        assert_eq!(
            url_decode("info,+access=off").as_deref(),
            Ok("info, access=off")
        );
        assert!(matches!(
            url_decode("info%2"),
            Err(LogFilterError::Encoding(_))
        ));
        assert!(matches!(
            url_decode("info%zz"),
            Err(LogFilterError::Encoding(_))
        ));
        assert!(matches!(
            url_decode("%ff"),
            Err(LogFilterError::Encoding(_))
        ));
    }

    #[test]
    fn bare_words_and_bad_levels_are_refused_with_the_directive_named() {
        let e = complete("garbage").expect_err("bare word");
        assert_eq!(e, LogFilterError::NoLevel("garbage".into()));
        assert!(e.to_string().contains("\"garbage\""), "{e}");
        // Not decoded: what the old endpoint installed and logged nothing with.
        assert!(matches!(
            complete("ztunnel%3Ddebug"),
            Err(LogFilterError::NoLevel(_))
        ));
        assert_eq!(
            complete("info,ztunnel=verbose"),
            Err(LogFilterError::BadLevel {
                directive: "ztunnel=verbose".into(),
                level: "verbose".into()
            })
        );
        assert!(matches!(
            complete("ztunnel[{a=1}]"),
            Err(LogFilterError::NoLevel(_))
        ));
        assert_eq!(complete(" , "), Err(LogFilterError::Empty));
    }

    #[test]
    fn a_filter_without_a_default_level_keeps_info_for_the_rest() {
        assert_eq!(
            complete("ztunnel=debug").as_deref(),
            Ok("info,ztunnel=debug")
        );
        assert_eq!(complete("debug").as_deref(), Ok("debug"));
        assert_eq!(
            complete("info,ztunnel::proxy=trace").as_deref(),
            Ok("info,ztunnel::proxy=trace")
        );
    }

    #[test]
    fn the_access_log_is_only_off_when_named() {
        assert_eq!(complete("warn").as_deref(), Ok("warn,access=info"));
        assert_eq!(complete("OFF").as_deref(), Ok("OFF,access=info"));
        assert_eq!(
            complete("warn,access=off").as_deref(),
            Ok("warn,access=off")
        );
        assert_eq!(complete("off,acc=off").as_deref(), Ok("off,acc=off"));
        assert_eq!(
            complete("info,access=off").as_deref(),
            Ok("info,access=off")
        );
    }

    #[test]
    fn what_complete_returns_is_what_envfilter_accepts() {
        for filter in [
            "info",
            "ztunnel=debug",
            "warn",
            "info,ztunnel[conn{id=3}]=trace",
        ] {
            let done = complete(filter).expect("valid");
            EnvFilter::builder().parse(&done).expect("parses");
        }
    }
}
