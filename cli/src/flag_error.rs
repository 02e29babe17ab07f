//! A setting the library rejected, said in the words of the command line: the flag the user typed
//! and the value as given, rather than the library's setting name.

use anyhow::anyhow;
use shardwise::ConfigError;

/// Where a library setting comes from on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// A flag, e.g. `--lanes`.
    Flag(&'static str),
    /// The environment; the library's reason names the variable (`AWS_REGION`).
    Environment,
}

/// The error to report for `err`: `invalid --lanes 0: must be 1 to 1024` for a setting a flag
/// sets (`given`: the value the user typed, `None` when the flag was not given); the library's
/// reason alone for one from the environment; the library's message for any other.
///
/// `source_of` says where each setting comes from; setting names in the reason are replaced by
/// their flags too (`shorter than lease_duration` reads `shorter than --lease-duration-ms`).
pub(crate) fn invalid_setting(
    err: &ConfigError,
    given: Option<String>,
    source_of: impl Fn(&str) -> Option<Source>,
) -> anyhow::Error {
    let reason = err.reason();
    match source_of(err.field()) {
        Some(Source::Flag(flag)) => {
            let reason = with_flags(reason, &source_of);
            match given {
                Some(value) => anyhow!("invalid {flag} {}: {reason}", shell_word(&value)),
                None => anyhow!("invalid {flag}: {reason}"),
            }
        }
        Some(Source::Environment) => anyhow!("{reason}"),
        None => anyhow!("{err}"),
    }
}

/// `reason` with every setting name that has a flag (a word with an underscore) replaced by it.
fn with_flags(reason: &str, source_of: impl Fn(&str) -> Option<Source>) -> String {
    let in_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(reason.len());
    for piece in reason.split_inclusive(|c: char| !in_word(c)) {
        let (word, rest) = piece.split_at(piece.trim_end_matches(|c: char| !in_word(c)).len());
        match source_of(word) {
            Some(Source::Flag(flag)) if word.contains('_') => out.push_str(flag),
            _ => out.push_str(word),
        }
        out.push_str(rest);
    }
    out
}

/// `value` as it would be typed in a shell: bare when that is unambiguous, quoted otherwise.
fn shell_word(value: &str) -> String {
    let bare = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:,=/@+%".contains(c));
    if bare {
        value.to_owned()
    } else {
        format!("{value:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source_of(setting: &str) -> Option<Source> {
        match setting {
            "lanes" => Some(Source::Flag("--lanes")),
            "lease_duration" | "checkpoint_interval" => Some(Source::Flag("--x-ms")),
            "worker_id" => Some(Source::Flag("--worker-id")),
            "region" => Some(Source::Environment),
            _ => None,
        }
    }

    fn message(err: ConfigError, given: Option<&str>) -> String {
        invalid_setting(&err, given.map(str::to_owned), source_of).to_string()
    }

    #[test]
    fn a_flag_is_named_with_the_value_given() {
        let cases = [
            // A number as typed.
            (
                ConfigError::new("lanes", 0, "must be 1 to 1024"),
                Some("0"),
                "invalid --lanes 0: must be 1 to 1024",
            ),
            // An empty or spaced value is quoted.
            (
                ConfigError::new("worker_id", "", "must be 1 to 256 characters"),
                Some(""),
                r#"invalid --worker-id "": must be 1 to 256 characters"#,
            ),
            (
                ConfigError::new("worker_id", "a b", "bad"),
                Some("a b"),
                r#"invalid --worker-id "a b": bad"#,
            ),
            // Not given: the flag alone.
            (
                ConfigError::new("worker_id", "x", "bad"),
                None,
                "invalid --worker-id: bad",
            ),
            // Setting names in the reason become flags; other words stay.
            (
                ConfigError::new(
                    "checkpoint_interval",
                    std::time::Duration::from_secs(20),
                    "must be shorter than lease_duration (10s) and lanes",
                ),
                Some("20000"),
                "invalid --x-ms 20000: must be shorter than --x-ms (10s) and lanes",
            ),
        ];
        for (err, given, expected) in cases {
            assert_eq!(message(err, given), expected);
        }
    }

    #[test]
    fn other_settings_keep_the_library_words() {
        let region = ConfigError::new(
            "region",
            "none",
            "no AWS region is configured: set AWS_REGION",
        );
        assert_eq!(
            message(region, None),
            "no AWS region is configured: set AWS_REGION"
        );
        let unknown = ConfigError::new("max_in_flight", 0, "must be at least 1");
        assert_eq!(
            message(unknown, Some("0")),
            "invalid `max_in_flight` = 0: must be at least 1"
        );
    }
}
