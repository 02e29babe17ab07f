//! The header envelope records carry on the wire, compatible with ruststream-kinesis.
//!
//! Kinesis records have no headers, so headers travel inside the data blob:
//!
//! ```text
//! RSK2: b"RSK2" | u32 BE block length | block | payload
//!       block = repeated (u32 BE name length | UTF-8 name | u32 BE value length | value bytes)
//! RSK1: b"RSK1" | u32 BE block length | block | payload      (read only)
//!       block = UTF-8 lines "name: value", separated by '\n'
//! ```
//!
//! An envelope is written only when there are headers. Decoding never fails: a blob that does not
//! parse as a whole envelope is a headerless payload, byte for byte, so records from other producers
//! are delivered untouched.

use bytes::{BufMut, Bytes, BytesMut};

/// The count of retries before this record, in decimal, exactly as ruststream-runtime reads and
/// writes it: absent or malformed means 0; a copy of a delivery whose header says `n` carries
/// `n + 1`; the attempt of a delivery is its count + 1. So a first delivery (no header) is attempt
/// 1, its first copy carries `1` and is attempt 2, and the dead letter of attempt 3 carries `3`.
pub const RETRY_COUNT_HEADER: &str = "x-ruststream-retry-count";

/// The origin header that shardwise builds before 0.1.0 wrote on their copies, under a name
/// ruststream never writes. Those builds counted attempts, not retries (their first copy carried
/// `2`), so a record that carries this header and not
/// [`ORIGIN_SEQUENCE_HEADER`](crate::retry::ORIGIN_SEQUENCE_HEADER) is read by their rule: header
/// `n` is attempt `n`.
pub const LEGACY_ORIGIN_SEQUENCE_HEADER: &str = "x-ruststream-origin-sequence";

const RSK2: &[u8; 4] = b"RSK2";
const RSK1: &[u8; 4] = b"RSK1";
const PREFIX_LEN: usize = 8;

/// Record headers in the order they were written. Names are case-sensitive; values are bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    entries: Vec<(String, Bytes)>,
}

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The value of the first header called `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_ref())
    }

    /// The value of the first header called `name`, if it is UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Sets `name` to `value`, replacing every earlier header of that name.
    ///
    /// ```
    /// use shardwise::envelope::Headers;
    /// let mut headers = Headers::new();
    /// headers.insert("tenant", "a");
    /// headers.insert("tenant", "b");
    /// assert_eq!(headers.get_str("tenant"), Some("b"));
    /// assert_eq!(headers.len(), 1);
    /// ```
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        let name = name.into();
        self.entries.retain(|(n, _)| *n != name);
        self.entries.push((name, value.into()));
    }

    /// Adds a header without touching others of the same name.
    pub fn append(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        self.entries.push((name.into(), value.into()));
    }

    /// Removes every header called `name`; returns whether there was one.
    pub fn remove(&mut self, name: &str) -> bool {
        let before = self.entries.len();
        self.entries.retain(|(n, _)| n != name);
        before != self.entries.len()
    }

    /// The headers in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v.as_ref()))
    }

    /// The retries before this record: [`RETRY_COUNT_HEADER`] (its name in any case) as a decimal,
    /// or 0 when it is absent or malformed.
    pub fn retry_count(&self) -> u32 {
        self.entries
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(RETRY_COUNT_HEADER))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// The attempt this record is: its retry count + 1 (1 for a record without the header). A copy
    /// written by a shardwise build before 0.1.0 (see [`LEGACY_ORIGIN_SEQUENCE_HEADER`]) is read by
    /// that build's rule: header `n` is attempt `n`.
    pub fn attempt(&self) -> u32 {
        let count = self.retry_count();
        let legacy = self.get(LEGACY_ORIGIN_SEQUENCE_HEADER).is_some()
            && self.get(crate::retry::ORIGIN_SEQUENCE_HEADER).is_none();
        if legacy {
            count.max(1)
        } else {
            count.saturating_add(1)
        }
    }
}

impl<N: Into<String>, V: Into<Bytes>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        Self {
            entries: iter
                .into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
        }
    }
}

/// Which form a blob was read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// No envelope: the whole blob is the payload.
    Plain,
    /// The legacy text-header envelope.
    Rsk1,
    /// The binary header envelope.
    Rsk2,
}

/// A decoded blob: headers (possibly none), the payload, and the form it was read in.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Decoded {
    /// The headers; empty for a plain payload.
    pub headers: Headers,
    /// The application payload (a zero-copy slice of the blob).
    pub payload: Bytes,
    /// Which form the blob had.
    pub format: Format,
}

/// Writes `payload` with `headers` as an RSK2 envelope, or the payload alone when there are none.
///
/// ```
/// use shardwise::envelope::{decode, encode, Headers};
/// let mut headers = Headers::new();
/// headers.insert("x-ruststream-retry-count", "2");
/// let blob = encode(&headers, b"hello");
/// let back = decode(blob);
/// assert_eq!(back.payload.as_ref(), b"hello");
/// assert_eq!(back.headers.retry_count(), 2);
/// assert_eq!(back.headers.attempt(), 3);
/// ```
///
/// # Panics
/// If a header name or value is longer than `u32::MAX` bytes (Kinesis records are at most 10 MiB).
pub fn encode(headers: &Headers, payload: &[u8]) -> Bytes {
    if headers.is_empty() {
        return Bytes::copy_from_slice(payload);
    }
    let block_len: usize = headers
        .entries
        .iter()
        .map(|(n, v)| 8 + n.len() + v.len())
        .sum();
    let mut out = BytesMut::with_capacity(PREFIX_LEN + block_len + payload.len());
    out.put_slice(RSK2);
    out.put_u32(len_u32(block_len));
    for (name, value) in &headers.entries {
        out.put_u32(len_u32(name.len()));
        out.put_slice(name.as_bytes());
        out.put_u32(len_u32(value.len()));
        out.put_slice(value);
    }
    out.put_slice(payload);
    out.freeze()
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).expect("header longer than u32::MAX bytes")
}

/// Whether `blob` starts as an envelope does (RSK2 or RSK1), well-formed or not.
#[cfg_attr(not(feature = "cloudwatch-logs"), allow(dead_code))]
pub(crate) fn looks_enveloped(blob: &[u8]) -> bool {
    blob.get(..4).is_some_and(|m| m == RSK2 || m == RSK1)
}

/// Reads a blob. Never fails: anything that is not a complete, well-formed envelope is returned
/// whole as a plain payload with no headers.
pub fn decode(blob: Bytes) -> Decoded {
    let parsed = match blob.get(..4) {
        Some(m) if m == RSK2 => {
            split(&blob).and_then(|(block, _)| parse_rsk2(block).map(|h| (h, Format::Rsk2)))
        }
        Some(m) if m == RSK1 => {
            split(&blob).and_then(|(block, _)| parse_rsk1(block).map(|h| (h, Format::Rsk1)))
        }
        _ => None,
    };
    match parsed {
        Some((headers, format)) => {
            let (block, _) = split(&blob).expect("checked above");
            let payload = blob.slice(PREFIX_LEN + block.len()..);
            Decoded {
                headers,
                payload,
                format,
            }
        }
        None => Decoded {
            headers: Headers::new(),
            payload: blob,
            format: Format::Plain,
        },
    }
}

/// Splits `magic | len | block | payload` into block and payload, if the length fits.
fn split(blob: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u32::from_be_bytes(blob.get(4..8)?.try_into().ok()?) as usize;
    let rest = &blob[PREFIX_LEN..];
    (len <= rest.len()).then(|| rest.split_at(len))
}

fn parse_rsk2(mut block: &[u8]) -> Option<Headers> {
    let mut headers = Headers::new();
    while !block.is_empty() {
        let (name, rest) = take_field(block)?;
        let (value, rest) = take_field(rest)?;
        headers.append(
            std::str::from_utf8(name).ok()?,
            Bytes::copy_from_slice(value),
        );
        block = rest;
    }
    Some(headers)
}

fn take_field(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u32::from_be_bytes(buf.get(..4)?.try_into().ok()?) as usize;
    let rest = &buf[4..];
    (len <= rest.len()).then(|| rest.split_at(len))
}

fn parse_rsk1(block: &[u8]) -> Option<Headers> {
    let text = std::str::from_utf8(block).ok()?;
    let mut headers = Headers::new();
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':')?;
        let value = value.strip_prefix(' ').unwrap_or(value);
        headers.append(name, Bytes::copy_from_slice(value.as_bytes()));
    }
    Some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(pairs: &[(&str, &str)]) -> Headers {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), Bytes::copy_from_slice(v.as_bytes())))
            .collect()
    }

    #[test]
    fn an_envelope_looks_enveloped_and_a_plain_payload_does_not() {
        let enveloped = encode(&headers(&[("x-cloudwatch-log-group", "g")]), b"line");
        assert!(looks_enveloped(&enveloped));
        assert!(looks_enveloped(b"RSK1 and anything"));
        assert!(!looks_enveloped(b"line"));
        assert!(!looks_enveloped(b"RS"));
        assert!(!looks_enveloped(&[0x1f, 0x8b, 0x08, 0x00]));
    }

    fn rsk2_bytes(pairs: &[(&str, &[u8])], payload: &[u8]) -> Vec<u8> {
        let mut block = Vec::new();
        for (n, v) in pairs {
            block.extend_from_slice(&(n.len() as u32).to_be_bytes());
            block.extend_from_slice(n.as_bytes());
            block.extend_from_slice(&(v.len() as u32).to_be_bytes());
            block.extend_from_slice(v);
        }
        let mut out = b"RSK2".to_vec();
        out.extend_from_slice(&(block.len() as u32).to_be_bytes());
        out.extend_from_slice(&block);
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn no_headers_writes_the_bare_payload() {
        let blob = encode(&Headers::new(), b"{\"id\":1}");
        assert_eq!(blob.as_ref(), b"{\"id\":1}");
        assert_eq!(decode(blob).format, Format::Plain);
    }

    #[test]
    fn writes_the_documented_byte_layout() {
        let h = headers(&[("a", "xy"), ("bc", "")]);
        let blob = encode(&h, b"P");
        assert_eq!(
            blob.as_ref(),
            rsk2_bytes(&[("a", b"xy"), ("bc", b"")], b"P").as_slice()
        );
        assert_eq!(&blob[..8], b"RSK2\x00\x00\x00\x15");
    }

    #[test]
    fn round_trips_headers_order_and_binary_values() {
        let mut h = Headers::new();
        h.append("x-ruststream-retry-count", "3");
        h.append("bin", Bytes::from_static(&[0, 255, 10, 13]));
        h.append("bin", "again");
        let d = decode(encode(&h, &[1, 2, 3]));
        assert_eq!(d.format, Format::Rsk2);
        assert_eq!(d.headers, h);
        assert_eq!(d.payload.as_ref(), &[1, 2, 3]);
        assert_eq!(d.headers.attempt(), 4);
    }

    #[test]
    fn foreign_blobs_are_plain_payloads() {
        for blob in [
            &b""[..],
            b"RSK",
            b"RSK2",
            b"{\"json\":true}",
            b"\xF3\x89\x9A\xC2 kpl-ish",
            b"RSK3\x00\x00\x00\x00",
        ] {
            let d = decode(Bytes::copy_from_slice(blob));
            assert_eq!(d.format, Format::Plain, "{blob:?}");
            assert_eq!(d.payload.as_ref(), blob);
            assert!(d.headers.is_empty());
            assert_eq!(d.headers.attempt(), 1);
        }
    }

    #[test]
    fn truncated_blocks_are_plain_payloads() {
        let whole = rsk2_bytes(&[("name", b"value")], b"payload");
        // Block length beyond the blob.
        let mut long = whole.clone();
        long[7] = 200;
        // A field length that overruns the block.
        let mut overrun = whole.clone();
        overrun[11] = 99;
        // Cut inside the block.
        let cut = whole[..12].to_vec();
        // A name that is not UTF-8.
        let bad_name = rsk2_bytes(&[("\u{0}", b"v")], b"p");
        let mut bad_name = bad_name;
        bad_name[12] = 0xFF;
        for blob in [long, overrun, cut, bad_name] {
            let d = decode(Bytes::from(blob.clone()));
            assert_eq!(d.format, Format::Plain);
            assert_eq!(d.payload.as_ref(), blob.as_slice());
        }
    }

    #[test]
    fn reads_rsk1_text_headers() {
        let block = "x-ruststream-retry-count: 2\ntenant: acme\n";
        let mut blob = b"RSK1".to_vec();
        blob.extend_from_slice(&(block.len() as u32).to_be_bytes());
        blob.extend_from_slice(block.as_bytes());
        blob.extend_from_slice(b"body");
        let d = decode(Bytes::from(blob));
        assert_eq!(d.format, Format::Rsk1);
        assert_eq!(d.headers.attempt(), 3);
        assert_eq!(d.headers.get_str("tenant"), Some("acme"));
        assert_eq!(d.payload.as_ref(), b"body");
    }

    #[test]
    fn rsk1_with_a_line_that_is_not_a_header_is_plain() {
        let block = "no colon here\n";
        let mut blob = b"RSK1".to_vec();
        blob.extend_from_slice(&(block.len() as u32).to_be_bytes());
        blob.extend_from_slice(block.as_bytes());
        let d = decode(Bytes::from(blob.clone()));
        assert_eq!(d.format, Format::Plain);
        assert_eq!(d.payload.as_ref(), blob.as_slice());
    }

    #[test]
    fn the_attempt_is_the_retry_count_plus_one_and_malformed_counts_read_as_zero() {
        // (header value, retry count, attempt): as ruststream-runtime 0.7.7's `current_retry_count`
        // and `attempt_of` read them.
        for (value, count, attempt) in [
            ("0", 0, 1),
            ("1", 1, 2),
            ("7", 7, 8),
            ("-2", 0, 1),
            ("x", 0, 1),
            (" 4 ", 0, 1),
            ("", 0, 1),
            ("99999999999", u32::MAX, u32::MAX),
        ] {
            let h = headers(&[(RETRY_COUNT_HEADER, value)]);
            assert_eq!(
                (h.retry_count(), h.attempt()),
                (count, attempt),
                "{value:?}"
            );
        }
        assert_eq!(Headers::new().attempt(), 1, "no header: the first delivery");
        assert_eq!(
            headers(&[("X-Ruststream-Retry-Count", "2")]).attempt(),
            3,
            "any case"
        );
    }

    #[test]
    fn copies_of_older_shardwise_builds_keep_their_own_count() {
        // Older builds wrote "2" on the first copy (attempt 2), with origin headers under the
        // ruststream prefix.
        let old = headers(&[
            (RETRY_COUNT_HEADER, "2"),
            (LEGACY_ORIGIN_SEQUENCE_HEADER, "42"),
        ]);
        assert_eq!(old.attempt(), 2);
        // A copy that also has the current origin header follows the current rule.
        let current = headers(&[
            (RETRY_COUNT_HEADER, "2"),
            (LEGACY_ORIGIN_SEQUENCE_HEADER, "42"),
            (crate::retry::ORIGIN_SEQUENCE_HEADER, "42"),
        ]);
        assert_eq!(current.attempt(), 3);
    }

    proptest! {
        #[test]
        fn any_headers_round_trip(
            pairs in proptest::collection::vec(("[a-z-]{0,12}", proptest::collection::vec(any::<u8>(), 0..16)), 1..6),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let h: Headers = pairs.iter().map(|(n, v)| (n.clone(), Bytes::from(v.clone()))).collect();
            let d = decode(encode(&h, &payload));
            prop_assert_eq!(d.headers, h);
            prop_assert_eq!(d.payload.as_ref(), payload.as_slice());
        }

        #[test]
        fn decode_never_loses_bytes(
            magic in prop_oneof![Just(&b""[..]), Just(&b"RSK2"[..]), Just(&b"RSK1"[..])],
            tail in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let blob = [magic, tail.as_slice()].concat();
            let d = decode(Bytes::from(blob.clone()));
            if d.format == Format::Plain {
                prop_assert_eq!(d.payload.as_ref(), blob.as_slice());
            } else {
                prop_assert!(blob.ends_with(&d.payload));
            }
        }
    }
}
