//! Where a shard's reading stands, as the lease table stores it: start sentinels, positions, and
//! the end of a closed shard, with the sortable key every checkpoint write is compared on.

use std::fmt;
use std::time::SystemTime;

use crate::position::{Position, SequenceNumber};
use crate::time::{from_millis, millis};

/// Where a shard's reading stands, as the lease table stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checkpoint {
    /// Nothing handled yet: start at the oldest record.
    TrimHorizon,
    /// Nothing handled yet: start at the tip.
    Latest,
    /// Nothing handled yet: start at the first record that arrived at or after this time.
    AtTimestamp(SystemTime),
    /// Every record up to and including this position has a durable outcome.
    At(Position),
    /// Reading starts at this position, inclusive: what a seek to a record writes.
    Before(Position),
    /// The shard is closed and every one of its records has a durable outcome.
    ShardEnd,
}

/// `checkpoint` values of the start sentinels and the end.
pub(crate) const TRIM_HORIZON: &str = "TRIM_HORIZON";
pub(crate) const LATEST: &str = "LATEST";
pub(crate) const AT_TIMESTAMP: &str = "AT_TIMESTAMP";
pub(crate) const SHARD_END: &str = "SHARD_END";
/// `checkpoint` of a [`Checkpoint::Before`]: the prefix, then the sequence number.
pub(crate) const BEFORE_PREFIX: &str = "AT:";

impl Checkpoint {
    /// The string stored in `checkpointKey`, whose byte order is checkpoint order: TRIM_HORIZON and
    /// LATEST first, then AT_TIMESTAMP by its time, positions by [`Position::sort_key`], and
    /// `SHARD_END` last.
    pub fn sort_key(&self) -> String {
        match self {
            Checkpoint::TrimHorizon | Checkpoint::Latest => "0".into(),
            // Above the other start sentinels, so pinning a LATEST start is an ordinary fenced
            // checkpoint write; below every position ('!' sorts before every digit), ordered by
            // time among themselves.
            Checkpoint::AtTimestamp(t) => format!("0!{:020}", millis(*t).max(0)),
            // Before(p) < At(p) < Before(anything after p).
            Checkpoint::At(p) => format!("{}1", p.sort_key()),
            Checkpoint::Before(p) => format!("{}0", p.sort_key()),
            // 'S' sorts after every ASCII digit.
            Checkpoint::ShardEnd => SHARD_END.into(),
        }
    }

    /// Whether this checkpoint marks a fully handled, closed shard.
    pub fn is_shard_end(&self) -> bool {
        matches!(self, Checkpoint::ShardEnd)
    }

    /// The value stored in `checkpoint`.
    pub fn label(&self) -> String {
        match self {
            Checkpoint::TrimHorizon => TRIM_HORIZON.into(),
            Checkpoint::Latest => LATEST.into(),
            Checkpoint::AtTimestamp(_) => AT_TIMESTAMP.into(),
            Checkpoint::At(p) => p.sequence().to_string(),
            Checkpoint::Before(p) => format!("{BEFORE_PREFIX}{}", p.sequence()),
            Checkpoint::ShardEnd => SHARD_END.into(),
        }
    }

    /// Rebuilds a checkpoint from the stored `checkpoint`, `checkpointSub` and
    /// `startingTimestamp` (ms) values.
    pub fn from_stored(label: &str, sub: u64, starting_ms: Option<i64>) -> Option<Self> {
        Some(match label {
            TRIM_HORIZON => Checkpoint::TrimHorizon,
            LATEST => Checkpoint::Latest,
            AT_TIMESTAMP => Checkpoint::AtTimestamp(from_millis(starting_ms?)),
            SHARD_END => Checkpoint::ShardEnd,
            other => match other.strip_prefix(BEFORE_PREFIX) {
                Some(digits) => {
                    Checkpoint::Before(Position::new(SequenceNumber::parse(digits).ok()?, sub))
                }
                None => Checkpoint::At(Position::new(SequenceNumber::parse(other).ok()?, sub)),
            },
        })
    }

    /// The KPL sub-sequence stored in `checkpointSub` (0 unless the checkpoint is inside an aggregate).
    pub fn sub_sequence(&self) -> u64 {
        match self {
            Checkpoint::At(p) | Checkpoint::Before(p) => p.sub_sequence(),
            _ => 0,
        }
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpoint::At(p) => write!(f, "{p}"),
            Checkpoint::Before(p) => write!(f, "before {p}"),
            Checkpoint::AtTimestamp(t) => write!(f, "{AT_TIMESTAMP}({}ms)", millis(*t)),
            other => f.write_str(&other.label()),
        }
    }
}

/// Where a shard with no checkpoint starts. Children of a split or merge always start at the trim
/// horizon, so nothing written to them before their parents ended is missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InitialPosition {
    /// The oldest record the stream retains.
    #[default]
    TrimHorizon,
    /// Records written after the consumer starts.
    Latest,
    /// Records that arrived at or after this time.
    AtTimestamp(SystemTime),
}

impl InitialPosition {
    /// The checkpoint a new lease row starts with.
    pub fn checkpoint(self) -> Checkpoint {
        match self {
            InitialPosition::TrimHorizon => Checkpoint::TrimHorizon,
            InitialPosition::Latest => Checkpoint::Latest,
            InitialPosition::AtTimestamp(t) => Checkpoint::AtTimestamp(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seq: &str, sub: u64) -> Checkpoint {
        Checkpoint::At(Position::new(SequenceNumber::parse(seq).unwrap(), sub))
    }

    #[test]
    fn sort_keys_order_starts_positions_and_the_end() {
        let ordered = [
            Checkpoint::TrimHorizon,
            Checkpoint::AtTimestamp(from_millis(0)),
            Checkpoint::AtTimestamp(from_millis(1_700_000_000_000)),
            Checkpoint::AtTimestamp(from_millis(1_700_000_000_001)),
            Checkpoint::Before(Position::new(SequenceNumber::parse("0").unwrap(), 0)),
            Checkpoint::Before(Position::new(SequenceNumber::parse("1").unwrap(), 0)),
            at("1", 0),
            Checkpoint::Before(Position::new(SequenceNumber::parse("1").unwrap(), 1)),
            at("1", 1),
            at("9", 0),
            at(&"9".repeat(129), u64::MAX),
            Checkpoint::ShardEnd,
        ];
        for pair in ordered.windows(2) {
            assert!(
                pair[0].sort_key() < pair[1].sort_key(),
                "{} !< {}",
                pair[0],
                pair[1]
            );
        }
        assert_eq!(
            Checkpoint::Latest.sort_key(),
            Checkpoint::TrimHorizon.sort_key()
        );
    }

    #[test]
    fn stored_values_round_trip() {
        let t = from_millis(1_700_000_000_123);
        for c in [
            Checkpoint::TrimHorizon,
            Checkpoint::Latest,
            Checkpoint::AtTimestamp(t),
            Checkpoint::ShardEnd,
            at("4959033827149025660855969253836157109592157598913658", 3),
            Checkpoint::Before(Position::new(SequenceNumber::parse("77").unwrap(), 2)),
        ] {
            let back = Checkpoint::from_stored(&c.label(), c.sub_sequence(), Some(millis(t)));
            assert_eq!(back, Some(c));
        }
        assert_eq!(Checkpoint::from_stored("12x", 0, None), None);
    }
}
