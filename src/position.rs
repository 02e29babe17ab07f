//! Positions inside a shard: sequence numbers, KPL sub-sequences, and the sortable key every
//! checkpoint write is compared on.
//!
//! Kinesis sequence numbers are decimal strings of up to 129 digits. They are never parsed into
//! integers: ordering compares digit strings, and the lease table stores a fixed-width key so that
//! DynamoDB's string comparison agrees with numeric order.

use std::cmp::Ordering;
use std::fmt;

/// Digits a sequence number may have (the Kinesis API allows up to 128 after the first).
pub const MAX_SEQUENCE_DIGITS: usize = 129;
/// Width the sequence part of a [`Position::sort_key`] is padded to.
pub const SEQUENCE_KEY_WIDTH: usize = 130;
/// Width the sub-sequence part of a [`Position::sort_key`] is padded to (`u64::MAX` has 20 digits).
pub const SUB_SEQUENCE_KEY_WIDTH: usize = 20;

/// A Kinesis sequence number: 1 to 129 decimal digits, ordered numerically without being parsed
/// into an integer.
///
/// Stored inline as packed decimal (two digits a byte, leading zeros dropped): no heap allocation,
/// so trackers holding a million positions in flight neither allocate nor free per record.
/// Equality and order are numeric: `"0010"` equals `"10"`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SequenceNumber {
    /// Significant digits (at least 1: zero is the single digit 0).
    len: u8,
    /// Digit `i` is the high nibble of byte `i / 2` when `i` is even, the low nibble when odd.
    packed: [u8; MAX_SEQUENCE_DIGITS.div_ceil(2)],
}

/// A string that is not a sequence number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a sequence number (1 to 129 decimal digits)")]
pub struct InvalidSequenceNumber(pub String);

impl SequenceNumber {
    /// Parses a sequence number, rejecting anything but 1 to 129 ASCII digits.
    ///
    /// ```
    /// use shardwise::SequenceNumber;
    /// let seq = SequenceNumber::parse("49590338271490256608559692538361571095921575989136588898").unwrap();
    /// assert_eq!(seq.to_string().len(), 56);
    /// assert!(SequenceNumber::parse("12a").is_err());
    /// ```
    pub fn parse(s: &str) -> Result<Self, InvalidSequenceNumber> {
        if s.is_empty() || s.len() > MAX_SEQUENCE_DIGITS || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(InvalidSequenceNumber(s.to_owned()));
        }
        let trimmed = s.trim_start_matches('0');
        let significant = if trimmed.is_empty() { "0" } else { trimmed };
        let mut packed = [0u8; MAX_SEQUENCE_DIGITS.div_ceil(2)];
        for (i, d) in significant.bytes().enumerate() {
            let nibble = d - b'0';
            packed[i / 2] |= if i % 2 == 0 { nibble << 4 } else { nibble };
        }
        Ok(Self {
            len: significant.len() as u8,
            packed,
        })
    }

    /// How many significant digits the number has.
    pub fn digits(&self) -> usize {
        self.len as usize
    }

    fn digit_chars(&self) -> impl Iterator<Item = char> + '_ {
        (0..self.len as usize).map(|i| {
            let byte = self.packed[i / 2];
            let nibble = if i % 2 == 0 { byte >> 4 } else { byte & 0x0F };
            char::from(b'0' + nibble)
        })
    }
}

impl Ord for SequenceNumber {
    fn cmp(&self, other: &Self) -> Ordering {
        // Unused nibbles are zero, so equal lengths compare bytewise in digit order.
        self.len
            .cmp(&other.len)
            .then_with(|| self.packed.cmp(&other.packed))
    }
}

impl PartialOrd for SequenceNumber {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for SequenceNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SequenceNumber({self})")
    }
}

impl fmt::Display for SequenceNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        let width = f.width().unwrap_or(0);
        for _ in self.digits()..width {
            f.write_char('0')?;
        }
        self.digit_chars().try_for_each(|c| f.write_char(c))
    }
}

/// One record's place in its shard: the sequence number of the Kinesis record and, for a record
/// unpacked from a KPL aggregate, its index inside the aggregate (0 for a plain record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Position {
    sequence: SequenceNumber,
    sub_sequence: u64,
}

impl Position {
    /// A position from a sequence number and a sub-sequence (0 for a plain record).
    pub fn new(sequence: SequenceNumber, sub_sequence: u64) -> Self {
        Self {
            sequence,
            sub_sequence,
        }
    }

    /// Sequence number 0, sub-sequence 0: below every record (the position of a paged event,
    /// which has its own).
    pub fn zero() -> Self {
        // The single digit 0 (what `SequenceNumber::parse("0")` gives), built without parsing:
        // every paged delivery starts from it.
        let zero = SequenceNumber {
            len: 1,
            packed: [0; MAX_SEQUENCE_DIGITS.div_ceil(2)],
        };
        Self::new(zero, 0)
    }

    /// The Kinesis record's sequence number.
    pub fn sequence(&self) -> &SequenceNumber {
        &self.sequence
    }

    /// The index inside a KPL aggregate; 0 for a plain record.
    pub fn sub_sequence(&self) -> u64 {
        self.sub_sequence
    }

    /// A fixed-width string whose byte order is the position's order: the sequence zero-padded to
    /// 130 digits, then the sub-sequence zero-padded to 20. The lease table compares these in its
    /// conditional writes.
    ///
    /// ```
    /// use shardwise::{Position, SequenceNumber};
    /// let small = Position::new(SequenceNumber::parse("9").unwrap(), 0);
    /// let large = Position::new(SequenceNumber::parse("10").unwrap(), 0);
    /// assert!(small.sort_key() < large.sort_key());
    /// ```
    pub fn sort_key(&self) -> String {
        format!(
            "{:w$}{:0>s$}",
            self.sequence,
            self.sub_sequence,
            w = SEQUENCE_KEY_WIDTH,
            s = SUB_SEQUENCE_KEY_WIDTH
        )
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sub_sequence == 0 {
            write!(f, "{}", self.sequence)
        } else {
            write!(f, "{}.{}", self.sequence, self.sub_sequence)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seq(s: &str) -> SequenceNumber {
        SequenceNumber::parse(s).unwrap()
    }

    #[test]
    fn zero_is_the_number_zero() {
        assert_eq!(Position::zero(), Position::new(seq("0"), 0));
        assert_eq!(Position::zero().sequence().to_string(), "0");
    }

    #[test]
    fn rejects_what_is_not_digits() {
        for bad in ["", "-1", "1.5", "12a", " 1", &"1".repeat(130)] {
            assert!(SequenceNumber::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(SequenceNumber::parse(&"9".repeat(129)).is_ok());
    }

    #[test]
    fn displays_the_digits_without_leading_zeros() {
        let long = "4959033827149025660855969253836157109592157598913658889";
        assert_eq!(seq(long).to_string(), long);
        assert_eq!(seq("007").to_string(), "7");
        assert_eq!(seq("000").to_string(), "0");
        assert_eq!(format!("{:5}", seq("42")), "00042");
        let max = "9".repeat(129);
        assert_eq!(seq(&max).to_string(), max);
    }

    #[test]
    fn orders_by_value_not_by_text() {
        assert!(seq("9") < seq("10"));
        assert!(seq("0010") == seq("0010"));
        assert_eq!(seq("0010").cmp(&seq("10")), Ordering::Equal);
        assert!(seq(&"9".repeat(128)) < seq(&format!("1{}", "0".repeat(128))));
    }

    #[test]
    fn sub_sequence_orders_inside_one_record() {
        let a = Position::new(seq("5"), 3);
        let b = Position::new(seq("5"), 4);
        let c = Position::new(seq("6"), 0);
        assert!(a < b && b < c);
        assert!(a.sort_key() < b.sort_key() && b.sort_key() < c.sort_key());
        assert_eq!(
            a.sort_key().len(),
            SEQUENCE_KEY_WIDTH + SUB_SEQUENCE_KEY_WIDTH
        );
    }

    fn digits() -> impl Strategy<Value = String> {
        "[0-9]{1,129}"
    }

    proptest! {
        #[test]
        fn order_is_numeric_order(a in digits(), b in digits()) {
            let (ta, tb) = (a.trim_start_matches('0'), b.trim_start_matches('0'));
            let numeric = ta.len().cmp(&tb.len()).then_with(|| ta.cmp(tb));
            prop_assert_eq!(seq(&a).cmp(&seq(&b)), numeric);
            prop_assert_eq!(seq(&a).to_string(), if ta.is_empty() { "0" } else { ta });
        }

        #[test]
        fn sort_key_order_is_position_order(a in digits(), b in digits(), sa in any::<u64>(), sb in any::<u64>()) {
            let pa = Position::new(seq(&a), sa);
            let pb = Position::new(seq(&b), sb);
            prop_assert_eq!(pa.cmp(&pb), pa.sort_key().cmp(&pb.sort_key()));
        }
    }
}
