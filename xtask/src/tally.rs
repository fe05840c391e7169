//! Honest counting of libtest output, shared by `xtask test` (cargo's
//! stdout) and `xtask vm-test` (the output a VM wrote to its results folder).
//!
//! A binary that crashes after its `running N tests` line counts its
//! unreported tests as failed, and a result line whose totals differ from
//! the announced number is a failure.

/// Steps and tests counted so far.
#[derive(Default)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
    pub skipped: u64,
    pub failures: Vec<String>,
}

impl Tally {
    /// Counts one step (not a libtest test) as passed or failed.
    pub fn step(&mut self, name: &str, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
            self.failures.push(name.to_owned());
        }
    }

    /// Applies the skip log (one line per test that returned early because
    /// it could not run, e.g. not root). libtest counted those as passed;
    /// they are skipped, and under CI (`ci`) failed: CI must run them.
    pub fn account_skips(&mut self, skip_log: &str, ci: bool) {
        let skipped: Vec<&str> = skip_log.lines().filter(|l| !l.trim().is_empty()).collect();
        self.passed = self.passed.saturating_sub(skipped.len() as u64);
        if ci {
            self.failed += skipped.len() as u64;
            self.failures.extend(
                skipped
                    .iter()
                    .map(|s| format!("{s} (skipped under CI=true)")),
            );
        } else {
            self.skipped += skipped.len() as u64;
        }
    }

    /// Adds another tally's counts, its failures prefixed with `label`.
    pub fn absorb(&mut self, other: Tally, label: &str) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped += other.skipped;
        self.failures
            .extend(other.failures.into_iter().map(|f| format!("{label}: {f}")));
    }
}

/// One test binary's progress, from libtest's `running N tests` line to its
/// `test result:` line.
#[derive(Default)]
struct Binary {
    expected: u64,
    reported: u64,
    open: bool,
}

impl Binary {
    /// A binary that announced `expected` tests but printed no result line
    /// crashed (or was killed): every test it did not report counts as
    /// failed.
    fn close_crashed(&mut self, tally: &mut Tally) {
        if self.open {
            let missing = self.expected.saturating_sub(self.reported).max(1);
            tally.failed += missing;
            tally.failures.push(format!(
                "a test binary stopped after {} of its {} tests without a result line (crash?)",
                self.reported, self.expected
            ));
        }
        *self = Self::default();
    }
}

/// Feeds libtest output line by line into a [`Tally`].
#[derive(Default)]
pub struct LineCounter {
    binary: Binary,
}

impl LineCounter {
    /// Counts what `line` says.
    pub fn feed(&mut self, line: &str, tally: &mut Tally) {
        if let Some(n) = parse_running(line) {
            self.binary.close_crashed(tally);
            self.binary = Binary {
                expected: n,
                reported: 0,
                open: true,
            };
        }
        if line.starts_with("test ")
            && (line.ends_with(" ... ok") || line.ends_with(" ... ignored"))
        {
            self.binary.reported += 1;
        }
        if let Some(name) = line
            .strip_prefix("test ")
            .and_then(|l| l.strip_suffix(" ... FAILED"))
        {
            self.binary.reported += 1;
            tally.failures.push(name.to_owned());
        }
        if let Some((passed, failed, ignored)) = parse_result(line) {
            tally.passed += passed;
            tally.failed += failed;
            if self.binary.open && passed + failed + ignored != self.binary.expected {
                tally.failed += 1;
                tally.failures.push(format!(
                    "a test binary announced {} tests but reported {}",
                    self.binary.expected,
                    passed + failed + ignored
                ));
            }
            self.binary = Binary::default();
        }
    }

    /// The output ended: a binary still open crashed.
    pub fn finish(mut self, tally: &mut Tally) {
        self.binary.close_crashed(tally);
    }
}

/// `running 5 tests` -> 5.
fn parse_running(line: &str) -> Option<u64> {
    let rest = line.trim().strip_prefix("running ")?;
    let n = rest
        .strip_suffix(" tests")
        .or_else(|| rest.strip_suffix(" test"))?;
    n.parse().ok()
}

/// `test result: ok. 4 passed; 1 failed; 2 ignored; ...` -> (4, 1, 2).
fn parse_result(line: &str) -> Option<(u64, u64, u64)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let number_before = |word: &str| {
        rest.split(';').find_map(|part| {
            part.trim()
                .strip_suffix(word)?
                .split_whitespace()
                .last()?
                .parse()
                .ok()
        })
    };
    Some((
        number_before(" passed")?,
        number_before(" failed")?,
        number_before(" ignored").unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::{Binary, LineCounter, Tally, parse_result, parse_running};

    #[test]
    fn parses_libtest_summary() {
        let line = "test result: ok. 4 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.6s";
        assert_eq!(parse_result(line), Some((4, 1, 2)));
        assert_eq!(parse_result("running 4 tests"), None);
        assert_eq!(parse_running("running 4 tests"), Some(4));
        assert_eq!(parse_running("running 1 test"), Some(1));
        assert_eq!(parse_running("test result: ok."), None);
    }

    #[test]
    fn a_binary_without_a_result_line_counts_its_missing_tests_as_failed() {
        let mut tally = Tally::default();
        let mut binary = Binary {
            expected: 5,
            reported: 2,
            open: true,
        };
        binary.close_crashed(&mut tally);
        assert_eq!(tally.failed, 3);
        assert_eq!(tally.failures.len(), 1);
        // A closed binary adds nothing.
        binary.close_crashed(&mut tally);
        assert_eq!(tally.failed, 3);
    }

    #[test]
    fn output_cut_short_counts_as_failed() {
        // What a VM that died half way through a binary leaves behind.
        let mut tally = Tally::default();
        let mut counter = LineCounter::default();
        for line in [
            "running 2 tests",
            "test a ... ok",
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out",
            "running 3 tests",
            "test b ... ok",
        ] {
            counter.feed(line, &mut tally);
        }
        counter.finish(&mut tally);
        // 1 passed in the first binary; the announced total mismatch (2 vs 1)
        // and the two unreported tests of the second binary are failures.
        assert_eq!(tally.passed, 1);
        assert_eq!(tally.failed, 3);
    }
}
