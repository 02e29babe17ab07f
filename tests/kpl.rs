//! KPL aggregates: round trips, corrupt aggregates delivered whole, byte compatibility.

use bytes::Bytes;
use md5::{Digest, Md5};
use proptest::prelude::*;
use shardwise::kpl::{
    self, CORRUPT_DIGEST, CORRUPT_EMPTY, CORRUPT_PARTITION_KEY_INDEX, CORRUPT_PROTOBUF,
    CORRUPT_TRUNCATED, Deaggregated, KPL_MAGIC, SubRecord, aggregate, deaggregate,
};

type Input = (String, Option<String>, Bytes);

fn input(partition_key: &str, explicit_hash_key: Option<&str>, data: &[u8]) -> Input {
    (
        partition_key.to_owned(),
        explicit_hash_key.map(str::to_owned),
        Bytes::copy_from_slice(data),
    )
}

/// Magic, `body`, MD5 of `body`.
fn wrap(body: &[u8]) -> Bytes {
    let mut out = KPL_MAGIC.to_vec();
    out.extend_from_slice(body);
    out.extend_from_slice(Md5::digest(body).as_slice());
    Bytes::from(out)
}

fn sub_records(blob: &Bytes) -> Vec<SubRecord> {
    match deaggregate(blob) {
        Deaggregated::Aggregate(records) => records,
        other => panic!("not an aggregate: {other:?}"),
    }
}

fn assert_round_trip(inputs: &[Input]) {
    let blob = aggregate(inputs);
    assert!(kpl::has_magic(&blob));
    let records = sub_records(&blob);
    assert_eq!(records.len(), inputs.len());
    for (i, (record, (pk, ehk, data))) in records.iter().zip(inputs).enumerate() {
        assert_eq!(record.sub_sequence, i as u64);
        assert_eq!(&record.partition_key, pk);
        assert_eq!(&record.explicit_hash_key, ehk);
        assert_eq!(
            record.data.as_ref(),
            data.as_ref(),
            "data of sub-record {i}"
        );
    }
}

#[test]
fn round_trip_one_record() {
    assert_round_trip(&[input("only", None, b"payload")]);
    assert_round_trip(&[input("only", Some("123456789"), b"")]);
}

#[test]
fn round_trip_three_records_with_shared_and_distinct_keys() {
    assert_round_trip(&[
        input("a", None, b"one"),
        input("b", Some("170141183460469231731687303715884105728"), b"two"),
        input(
            "a",
            Some("170141183460469231731687303715884105728"),
            b"\x00\xFF three",
        ),
    ]);
    assert_round_trip(&[
        input("same", Some("1"), b"x"),
        input("same", Some("2"), b"y"),
        input("same", None, b"z"),
    ]);
}

#[test]
fn round_trip_five_hundred_records() {
    let inputs: Vec<Input> = (0..500u32)
        .map(|i| {
            let pk = format!("key-{}", i % 37);
            let ehk = (i % 3 == 0).then(|| format!("{}", i % 11));
            let data: Vec<u8> = (0..(i % 200)).map(|b| (b ^ i) as u8).collect();
            (pk, ehk, Bytes::from(data))
        })
        .collect();
    assert_round_trip(&inputs);
}

#[test]
fn keys_are_deduplicated_into_the_tables() {
    let repeated = aggregate(&vec![
        input("a-fairly-long-partition-key", Some("99"), b"x");
        100
    ]);
    let distinct: Vec<Input> = (0..100)
        .map(|i| {
            (
                format!("a-fairly-long-partition-k{i:02}"),
                Some(format!("{i:02}")),
                Bytes::from_static(b"x"),
            )
        })
        .collect();
    assert!(repeated.len() + 2000 < aggregate(&distinct).len());
}

#[test]
fn blobs_without_the_magic_are_plain() {
    for blob in [
        &b""[..],
        b"\xF3",
        b"\xF3\x89\x9A",
        b"hello",
        b"\xF3\x89\x9A\xC3 not kpl",
    ] {
        assert_eq!(
            deaggregate(&Bytes::copy_from_slice(blob)),
            Deaggregated::Plain
        );
    }
}

fn sample() -> Bytes {
    aggregate(&[input("a", None, b"one"), input("b", Some("7"), b"two")])
}

#[test]
fn a_flipped_protobuf_byte_fails_the_digest() {
    let blob = sample();
    for i in KPL_MAGIC.len()..blob.len() - 16 {
        let mut bad = blob.to_vec();
        bad[i] ^= 0x01;
        assert_eq!(
            deaggregate(&Bytes::from(bad)),
            Deaggregated::Corrupt(CORRUPT_DIGEST),
            "byte {i}"
        );
    }
}

#[test]
fn a_flipped_digest_byte_fails_the_digest() {
    let blob = sample();
    for i in blob.len() - 16..blob.len() {
        let mut bad = blob.to_vec();
        bad[i] ^= 0x80;
        assert_eq!(
            deaggregate(&Bytes::from(bad)),
            Deaggregated::Corrupt(CORRUPT_DIGEST),
            "byte {i}"
        );
    }
}

#[test]
fn truncated_blobs_are_corrupt() {
    let blob = sample();
    for len in KPL_MAGIC.len()..KPL_MAGIC.len() + 16 {
        assert_eq!(
            deaggregate(&blob.slice(..len)),
            Deaggregated::Corrupt(CORRUPT_TRUNCATED),
            "len {len}"
        );
    }
    // Long enough, but cut: the last 16 bytes are no longer the digest.
    for len in KPL_MAGIC.len() + 16..blob.len() {
        assert_eq!(
            deaggregate(&blob.slice(..len)),
            Deaggregated::Corrupt(CORRUPT_DIGEST),
            "len {len}"
        );
    }
}

#[test]
fn magic_only_is_corrupt() {
    assert_eq!(
        deaggregate(&Bytes::from_static(&KPL_MAGIC)),
        Deaggregated::Corrupt(CORRUPT_TRUNCATED)
    );
}

#[test]
fn a_valid_digest_over_garbage_protobuf_is_corrupt() {
    let garbage: [&[u8]; 5] = [
        b"\x0F",                                         // wire type 7 does not exist
        b"\x0A\x05ab",                                   // string longer than the message
        b"\x1A\x03\x08\x80\x80",                         // record cut inside a varint
        b"\x0A\x02\xC3\x28",                             // partition key that is not UTF-8
        b"\xFF\xFF\xFF\xFF\xFF\xFF\xFF\xFF\xFF\xFF\xFF", // varint key too long
    ];
    for body in garbage {
        assert_eq!(
            deaggregate(&wrap(body)),
            Deaggregated::Corrupt(CORRUPT_PROTOBUF),
            "{body:02X?}"
        );
    }
}

#[test]
fn an_index_out_of_range_is_corrupt() {
    // pk table ["a"]; record { pk index 1, data "x" }
    let body = [0x0A, 0x01, b'a', 0x1A, 0x05, 0x08, 0x01, 0x1A, 0x01, b'x'];
    assert_eq!(
        deaggregate(&wrap(&body)),
        Deaggregated::Corrupt(CORRUPT_PARTITION_KEY_INDEX)
    );
    // The same with index 0 reads.
    let body = [0x0A, 0x01, b'a', 0x1A, 0x05, 0x08, 0x00, 0x1A, 0x01, b'x'];
    assert_eq!(sub_records(&wrap(&body)).len(), 1);
}

#[test]
fn zero_records_is_corrupt() {
    assert_eq!(
        deaggregate(&wrap(&[])),
        Deaggregated::Corrupt(CORRUPT_EMPTY)
    );
    assert_eq!(
        deaggregate(&wrap(&[0x0A, 0x01, b'a', 0x12, 0x01, b'1'])),
        Deaggregated::Corrupt(CORRUPT_EMPTY)
    );
    assert_eq!(
        deaggregate(&aggregate(&[])),
        Deaggregated::Corrupt(CORRUPT_EMPTY)
    );
}

/// A tiny aggregate encoded by hand, as protobuf (and so the KPL) writes it: fields in tag
/// order, required fields always present, absent optional fields omitted.
#[test]
fn byte_compatible_with_a_hand_built_encoding() {
    let body: Vec<u8> = [
        &[0x0A, 0x01, b'a'][..],                     // partition_key_table[0] = "a"
        &[0x0A, 0x02, b'b', b'c'],                   // partition_key_table[1] = "bc"
        &[0x12, 0x02, b'4', b'2'],                   // explicit_hash_key_table[0] = "42"
        &[0x1A, 0x05, 0x08, 0x00, 0x1A, 0x01, b'x'], // { pk 0, data "x" }
        &[0x1A, 0x08, 0x08, 0x01, 0x10, 0x00, 0x1A, 0x02, b'y', b'z'], // { pk 1, ehk 0, data "yz" }
        &[0x1A, 0x04, 0x08, 0x00, 0x1A, 0x00],       // { pk 0, data "" }
    ]
    .concat();
    let hand_built = wrap(&body);
    assert_eq!(&hand_built[..4], &[0xF3, 0x89, 0x9A, 0xC2]);

    let inputs = [
        input("a", None, b"x"),
        input("bc", Some("42"), b"yz"),
        input("a", None, b""),
    ];
    assert_eq!(
        sub_records(&hand_built),
        inputs
            .iter()
            .enumerate()
            .map(|(i, (pk, ehk, data))| SubRecord {
                partition_key: pk.clone(),
                explicit_hash_key: ehk.clone(),
                data: data.clone(),
                sub_sequence: i as u64,
            })
            .collect::<Vec<_>>()
    );
    assert_eq!(aggregate(&inputs), hand_built);
}

fn arbitrary_records() -> impl Strategy<Value = Vec<Input>> {
    let key = prop::sample::select(vec!["a", "b", "", "partition-key-ü", "k"]);
    let hash_key = prop::option::of(prop::sample::select(vec![
        "0",
        "1",
        "340282366920938463463374607431768211455",
    ]));
    let data = prop::collection::vec(any::<u8>(), 0..=64);
    prop::collection::vec(
        (key, hash_key, data)
            .prop_map(|(k, h, d)| (k.to_owned(), h.map(str::to_owned), Bytes::from(d))),
        1..50,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn aggregate_then_deaggregate_is_identity(records in arbitrary_records()) {
        let blob = aggregate(&records);
        let Deaggregated::Aggregate(subs) = deaggregate(&blob) else {
            return Err(TestCaseError::fail("not an aggregate"));
        };
        prop_assert_eq!(subs.len(), records.len());
        for (i, (sub, (pk, ehk, data))) in subs.iter().zip(&records).enumerate() {
            prop_assert_eq!(sub.sub_sequence, i as u64);
            prop_assert_eq!(&sub.partition_key, pk);
            prop_assert_eq!(&sub.explicit_hash_key, ehk);
            prop_assert_eq!(&sub.data, data);
        }
    }

    #[test]
    fn blobs_with_the_magic_never_panic(tail in prop::collection::vec(any::<u8>(), 0..300)) {
        let mut blob = KPL_MAGIC.to_vec();
        blob.extend_from_slice(&tail);
        let _ = deaggregate(&Bytes::from(blob));
    }

    /// Random bodies under a correct digest reach the protobuf parser and the index checks.
    #[test]
    fn bodies_with_a_valid_digest_never_panic(body in prop::collection::vec(any::<u8>(), 0..300)) {
        match deaggregate(&wrap(&body)) {
            Deaggregated::Plain => prop_assert!(false, "a blob with the magic is never plain"),
            Deaggregated::Corrupt(reason) => prop_assert_ne!(reason, CORRUPT_DIGEST),
            Deaggregated::Aggregate(subs) => prop_assert!(!subs.is_empty()),
        }
    }

    /// Single flipped bits anywhere after the magic are always caught by the digest.
    #[test]
    fn a_flipped_bit_never_yields_an_aggregate(records in arbitrary_records(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut blob = aggregate(&records).to_vec();
        let i = KPL_MAGIC.len() + at.index(blob.len() - KPL_MAGIC.len());
        blob[i] ^= 1 << bit;
        prop_assert_eq!(deaggregate(&Bytes::from(blob)), Deaggregated::Corrupt(CORRUPT_DIGEST));
    }
}
