//! Where `consume --start` begins and `seek --to` goes, spelled the same way by both, and the one
//! reading of the times they take.

use std::time::SystemTime;

use jiff::Timestamp;
use jiff::civil::Time;
use jiff::fmt::temporal::Pieces;
use jiff::tz::Offset;
use shardwise::lease::InitialPosition;
use shardwise::seek::SeekTarget;
use shardwise::{Position, SequenceNumber};

/// The `value_name` of `--start`.
pub(crate) const START_VALUES: &str = "trim-horizon|latest|at-timestamp:TIME";

/// The `value_name` of `--to`: the places of `--start`, or one shard to a record.
pub(crate) const SEEK_VALUES: &str =
    "trim-horizon|latest|at-timestamp:TIME|sequence:SHARD:SEQ[.SUB]";

/// What both flags say about `TIME` in their help (a macro, for `concat!`).
macro_rules! time_help {
    () => {
        "TIME is RFC 3339 with `Z` or an offset (`2026-11-29T21:37:00Z`, \
         `2026-11-29T21:37:00+02:00`, `2026-11-29T21:37:00.250Z`) or a date alone (`2026-11-29`, \
         midnight UTC); `timestamp:TIME` is the same as `at-timestamp:TIME`"
    };
}
pub(crate) use time_help;

/// The forms a time may take, an example each, for rejections.
const TIME_FORMS: &str = "expected `2026-11-29T21:37:00Z` (RFC 3339, UTC), \
     `2026-11-29T21:37:00+02:00` (an offset from UTC), `2026-11-29T21:37:00.250Z` (fractional \
     seconds) or `2026-11-29` (a date: midnight UTC)";

/// A place in every shard of the stream, as both flags spell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    TrimHorizon,
    Latest,
    AtTimestamp(SystemTime),
}

/// Reads `--start`.
pub(crate) fn parse_start(s: &str) -> Result<InitialPosition, String> {
    match place(s)? {
        Some(Place::TrimHorizon) => Ok(InitialPosition::TrimHorizon),
        Some(Place::Latest) => Ok(InitialPosition::Latest),
        Some(Place::AtTimestamp(t)) => Ok(InitialPosition::AtTimestamp(t)),
        None => Err(format!(
            "`{s}`: expected trim-horizon, latest or at-timestamp:TIME"
        )),
    }
}

/// Reads `--to`.
pub(crate) fn parse_seek_target(s: &str) -> Result<SeekTarget, String> {
    match place(s)? {
        Some(Place::TrimHorizon) => Ok(SeekTarget::TrimHorizon),
        Some(Place::Latest) => Ok(SeekTarget::Latest),
        Some(Place::AtTimestamp(t)) => Ok(SeekTarget::Timestamp(t)),
        None => match s.strip_prefix("sequence:") {
            Some(record) => parse_record(s, record),
            None => Err(format!(
                "`{s}`: expected trim-horizon, latest, at-timestamp:TIME or \
                 sequence:SHARD:SEQ[.SUB]"
            )),
        },
    }
}

/// `trim-horizon`, `latest`, `at-timestamp:TIME` or `timestamp:TIME`; `None` for anything else.
fn place(s: &str) -> Result<Option<Place>, String> {
    match s {
        "trim-horizon" => return Ok(Some(Place::TrimHorizon)),
        "latest" => return Ok(Some(Place::Latest)),
        _ => {}
    }
    s.strip_prefix("at-timestamp:")
        .or_else(|| s.strip_prefix("timestamp:"))
        .map(|time| parse_time(time).map(Place::AtTimestamp))
        .transpose()
}

/// `SHARD:SEQ[.SUB]` of `sequence:SHARD:SEQ[.SUB]` (`s`); a shard may be given by its number.
fn parse_record(s: &str, record: &str) -> Result<SeekTarget, String> {
    let (shard, seq) = record
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: expected sequence:SHARD:SEQ[.SUB]"))?;
    let (digits, sub) = match seq.split_once('.') {
        Some((d, sub)) => (
            d,
            sub.parse::<u64>()
                .map_err(|_| format!("`{sub}` is not a sub-sequence number"))?,
        ),
        None => (seq, 0),
    };
    let sequence = SequenceNumber::parse(digits).map_err(|e| e.to_string())?;
    let shard_id = match shard.parse::<u64>() {
        Ok(n) => format!("shardId-{n:012}"),
        Err(_) => shard.to_string(),
    };
    Ok(SeekTarget::Position {
        shard_id,
        position: Position::new(sequence, sub),
    })
}

/// Reads a time: RFC 3339 with `Z` or an offset, fractional seconds allowed, or a date alone
/// (midnight UTC). A time without an offset is refused rather than read in some zone.
pub(crate) fn parse_time(text: &str) -> Result<SystemTime, String> {
    if text.is_empty() {
        return Err(format!("no time given; {TIME_FORMS}"));
    }
    if let Ok(t) = text.parse::<Timestamp>() {
        return Ok(t.into());
    }
    let pieces =
        Pieces::parse(text).map_err(|e| format!("`{text}` is not a time ({e}); {TIME_FORMS}"))?;
    match (
        pieces.time(),
        pieces.offset(),
        pieces.time_zone_annotation(),
    ) {
        (None, None, None) => Offset::UTC
            .to_timestamp(pieces.date().to_datetime(Time::midnight()))
            .map(SystemTime::from)
            .map_err(|e| format!("`{text}` is out of range ({e}); {TIME_FORMS}")),
        (Some(_), None, _) => Err(format!(
            "`{text}` has no offset from UTC (add `Z` or one like `+02:00`); {TIME_FORMS}"
        )),
        _ => Err(format!("`{text}` is not a time; {TIME_FORMS}")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    /// 2026-11-29T21:37:00Z.
    const T: u64 = 1_795_988_220;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn times_read_offsets_fractions_and_dates() {
        let cases = [
            // UTC, upper and lower case.
            ("2026-11-29T21:37:00Z", at(T, 0)),
            ("2026-11-29t21:37:00z", at(T, 0)),
            // An offset east of UTC is earlier in UTC; west is later.
            ("2026-11-29T23:37:00+02:00", at(T, 0)),
            ("2026-11-29T16:07:00-05:30", at(T, 0)),
            ("2026-11-29T21:37:00+00:00", at(T, 0)),
            ("2026-11-29T21:37:00-00:00", at(T, 0)),
            // Fractions, down to nanoseconds.
            ("2026-11-29T21:37:00.25Z", at(T, 250_000_000)),
            ("2026-11-29T21:37:00.123456789Z", at(T, 123_456_789)),
            ("2026-11-29T23:37:00.5+02:00", at(T, 500_000_000)),
            // A date alone is midnight UTC.
            ("2026-11-29", at(T - (21 * 3600 + 37 * 60), 0)),
            ("1970-01-01", UNIX_EPOCH),
            // Before the epoch.
            ("1969-12-31T23:59:59Z", UNIX_EPOCH - Duration::from_secs(1)),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_time(text), Ok(expected), "{text}");
        }
    }

    #[test]
    fn rejections_say_what_is_accepted() {
        let cases = [
            // A local time: which zone is not guessed.
            (
                "2026-11-29T21:37:00",
                "`2026-11-29T21:37:00` has no offset from UTC",
            ),
            (
                "2026-11-29T21:37:00[Europe/Paris]",
                "`2026-11-29T21:37:00[Europe/Paris]` has no offset from UTC",
            ),
            // Not a time at all.
            ("yesterday", "`yesterday` is not a time ("),
            ("1795988220", "`1795988220` is not a time ("),
            // Past the end of the month, past the end of the day.
            ("2026-02-30", "`2026-02-30` is not a time ("),
            (
                "2026-11-29T24:30:00Z",
                "`2026-11-29T24:30:00Z` is not a time (",
            ),
            // A zone on a date alone.
            ("2026-11-29[UTC]", "`2026-11-29[UTC]` is not a time;"),
            ("", "no time given;"),
        ];
        for (text, start) in cases {
            let err = parse_time(text).expect_err(text);
            assert!(err.starts_with(start), "{text}: {err}");
            assert!(err.ends_with(TIME_FORMS), "{text}: {err}");
        }
        for example in [
            "`2026-11-29T21:37:00Z`",
            "`2026-11-29T21:37:00+02:00`",
            "`2026-11-29T21:37:00.250Z`",
            "`2026-11-29`",
        ] {
            assert!(TIME_FORMS.contains(example), "{example}");
            assert_eq!(parse_time(example.trim_matches('`')).err(), None);
        }
    }

    #[test]
    fn both_flags_spell_places_the_same_way() {
        let time = at(T, 0);
        let cases = [
            ("trim-horizon", Place::TrimHorizon),
            ("latest", Place::Latest),
            (
                "at-timestamp:2026-11-29T21:37:00Z",
                Place::AtTimestamp(time),
            ),
            (
                "timestamp:2026-11-29T23:37:00+02:00",
                Place::AtTimestamp(time),
            ),
        ];
        for (text, place) in cases {
            let (start, to) = match place {
                Place::TrimHorizon => (InitialPosition::TrimHorizon, SeekTarget::TrimHorizon),
                Place::Latest => (InitialPosition::Latest, SeekTarget::Latest),
                Place::AtTimestamp(t) => {
                    (InitialPosition::AtTimestamp(t), SeekTarget::Timestamp(t))
                }
            };
            assert_eq!(parse_start(text), Ok(start), "{text}");
            assert_eq!(parse_seek_target(text), Ok(to), "{text}");
        }
    }

    #[test]
    fn seeks_take_a_record_of_one_shard() {
        let sequence = SequenceNumber::parse("4959").unwrap();
        assert_eq!(
            parse_seek_target("sequence:3:4959.2"),
            Ok(SeekTarget::Position {
                shard_id: "shardId-000000000003".into(),
                position: Position::new(sequence, 2),
            })
        );
        assert_eq!(
            parse_seek_target("sequence:shardId-000000000003:4959"),
            Ok(SeekTarget::Position {
                shard_id: "shardId-000000000003".into(),
                position: Position::new(sequence, 0),
            })
        );
        assert!(parse_start("sequence:3:4959").is_err());
    }

    #[test]
    fn unknown_places_list_the_spellings() {
        assert_eq!(
            parse_start("oldest"),
            Err("`oldest`: expected trim-horizon, latest or at-timestamp:TIME".into())
        );
        assert_eq!(
            parse_seek_target("oldest"),
            Err(
                "`oldest`: expected trim-horizon, latest, at-timestamp:TIME or \
                 sequence:SHARD:SEQ[.SUB]"
                    .into()
            )
        );
        let err = parse_start("at-timestamp:2026-11-29T21:37:00").unwrap_err();
        assert!(err.contains("has no offset"), "{err}");
        let err = parse_seek_target("timestamp:soon").unwrap_err();
        assert!(err.contains("is not a time"), "{err}");
    }
}
