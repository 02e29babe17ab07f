//! One conformance suite for every `ReceiptStore`: the memory ledger always, the DynamoDB ledger
//! against the live endpoint (a fresh receipt table and effect table per test). Both must give the
//! same answers: a terminal receipt is never overwritten, effects are written with their receipt or
//! not at all, a replay writes nothing, and effects that break DynamoDB's limits are refused before
//! anything is sent.

mod support;

use aws_sdk_dynamodb::types::AttributeValue;
use shardwise::Error;
use shardwise::receipts::{
    Apply, Committed, Disposition, DynamoDbReceipts, Effect, Effects, EventId, Expect,
    MemoryReceipts, ReceiptStore, Recorded, key,
};

/// The store, the effect table it may write (key `id`), and how to read a counter from it.
struct Subject<'a> {
    store: &'a dyn ReceiptStore,
    counts: &'a str,
    count: &'a (dyn Fn(&str) -> futures::future::BoxFuture<'static, Option<i64>> + Sync),
}

fn event(n: &str) -> EventId {
    EventId::new(format!("kinesis/orders/shardId-000000000000/{n}.0"))
}

fn bump(table: &str, id: &str) -> Effects {
    Effect::update(table, key("id", id)).add("count", 1).into()
}

async fn records_and_never_overwrites_a_terminal_receipt(s: &Subject<'_>) {
    let e = event("1");
    assert_eq!(s.store.get(&e).await.unwrap(), None);
    let held = Disposition::Held("operator review".into());
    assert_eq!(
        s.store.record(&e, &held, "w1").await.unwrap(),
        Recorded::Recorded
    );
    let r = s.store.get(&e).await.unwrap().expect("held");
    assert_eq!((r.disposition, r.by.as_str()), (held.clone(), "w1"));
    // A held receipt is replaced by a terminal one.
    let quarantined = Disposition::Quarantined("bad schema".into());
    assert_eq!(
        s.store.record(&e, &quarantined, "w2").await.unwrap(),
        Recorded::Recorded
    );
    // A terminal one is never replaced.
    match s
        .store
        .record(&e, &Disposition::Applied, "w3")
        .await
        .unwrap()
    {
        Recorded::Exists(r) => assert_eq!(r.disposition, quarantined),
        other => panic!("expected the existing receipt, got {other:?}"),
    }
    assert!(
        !s.store.release(&e).await.unwrap(),
        "a terminal receipt is not released"
    );
    assert_eq!(
        s.store.get(&e).await.unwrap().unwrap().disposition,
        quarantined
    );
}

async fn a_released_hold_is_gone(s: &Subject<'_>) {
    let e = event("2");
    assert!(!s.store.release(&e).await.unwrap(), "nothing to release");
    s.store
        .record(&e, &Disposition::Held("later".into()), "w")
        .await
        .unwrap();
    assert!(s.store.release(&e).await.unwrap());
    assert_eq!(s.store.get(&e).await.unwrap(), None);
}

async fn effects_are_written_once_with_their_receipt(s: &Subject<'_>) {
    let apply = Apply {
        event: event("3"),
        effects: bump(s.counts, "a"),
    };
    assert_eq!(
        s.store
            .commit(std::slice::from_ref(&apply), "w")
            .await
            .unwrap(),
        vec![Committed::Applied]
    );
    assert_eq!((s.count)("a").await, Some(1));
    let r = s.store.get(&apply.event).await.unwrap().unwrap();
    assert_eq!(r.disposition, Disposition::Applied);
    // A replay writes nothing.
    assert_eq!(
        s.store.commit(&[apply], "w").await.unwrap(),
        vec![Committed::Replay]
    );
    assert_eq!((s.count)("a").await, Some(1));
}

async fn a_replay_among_several_leaves_the_others_applied(s: &Subject<'_>) {
    let first = Apply {
        event: event("10"),
        effects: bump(s.counts, "x"),
    };
    s.store
        .commit(std::slice::from_ref(&first), "w")
        .await
        .unwrap();
    let batch = vec![
        Apply {
            event: event("11"),
            effects: bump(s.counts, "y"),
        },
        first, // its receipt exists: the transaction's condition on it fails
        Apply {
            event: event("12"),
            effects: bump(s.counts, "z"),
        },
        // The same item as the first of the batch: it cannot share its transaction.
        Apply {
            event: event("13"),
            effects: bump(s.counts, "y"),
        },
    ];
    let answers = s.store.commit(&batch, "w").await.unwrap();
    assert_eq!(
        answers,
        vec![
            Committed::Applied,
            Committed::Replay,
            Committed::Applied,
            Committed::Applied
        ]
    );
    assert_eq!((s.count)("x").await, Some(1), "the replay wrote nothing");
    assert_eq!((s.count)("y").await, Some(2), "two events counted y");
    assert_eq!((s.count)("z").await, Some(1));
}

async fn a_refused_condition_writes_nothing(s: &Subject<'_>) {
    let apply = Apply {
        event: event("20"),
        effects: Effects::new()
            .with(Effect::update(s.counts, key("id", "c")).add("count", 1))
            .with(Effect::check(
                s.counts,
                key("id", "never-written"),
                Expect::Exists,
            )),
    };
    match &s
        .store
        .commit(std::slice::from_ref(&apply), "w")
        .await
        .unwrap()[..]
    {
        [Committed::Refused(_)] => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(
        (s.count)("c").await,
        None,
        "the other effect was not written"
    );
    assert_eq!(
        s.store.get(&apply.event).await.unwrap(),
        None,
        "nor the receipt"
    );
}

async fn effects_over_the_limits_are_refused_before_the_call(s: &Subject<'_>) {
    let too_many: Effects = (0..100)
        .map(|i| Effect::update(s.counts, key("id", format!("n{i}"))).add("count", 1))
        .collect();
    let twice = Effects::new()
        .with(Effect::update(s.counts, key("id", "d")).add("count", 1))
        .with(Effect::delete(s.counts, key("id", "d")));
    let missing = bump("no-such-table-shardwise", "e");
    let answers = s
        .store
        .commit(
            &[
                Apply {
                    event: event("30"),
                    effects: too_many,
                },
                Apply {
                    event: event("31"),
                    effects: twice,
                },
                Apply {
                    event: event("32"),
                    effects: missing,
                },
                Apply {
                    event: event("33"),
                    effects: bump(s.counts, "ok"),
                },
            ],
            "w",
        )
        .await
        .unwrap();
    let reasons: Vec<String> = answers[..3]
        .iter()
        .map(|a| match a {
            Committed::Invalid(why) => why.clone(),
            other => panic!("expected invalid, got {other:?}"),
        })
        .collect();
    assert!(reasons[0].contains("at most 100"), "{}", reasons[0]);
    assert!(
        reasons[1].contains("writes each item once"),
        "{}",
        reasons[1]
    );
    assert!(
        reasons[2].contains("no-such-table-shardwise") && reasons[2].contains("does not exist"),
        "{}",
        reasons[2]
    );
    assert_eq!(
        answers[3],
        Committed::Applied,
        "a valid apply beside them is committed"
    );
    for n in ["30", "31", "32"] {
        assert_eq!(
            s.store.get(&event(n)).await.unwrap(),
            None,
            "nothing recorded for {n}"
        );
    }
    assert_eq!((s.count)("n0").await, None);
}

/// An update that would grow its item past 400 KB cannot be seen from the effect alone: the store
/// refuses the whole transaction (DynamoDB: a ValidationException for the request). The apply it
/// is for is answered invalid (it goes the spent way, with a durable outcome); the others that
/// shared its transaction commit.
async fn an_update_past_the_item_limit_is_invalid_and_the_others_commit(s: &Subject<'_>) {
    let big = Effect::update(s.counts, key("id", "big")).set("blob", "x".repeat(300_000));
    let first = s
        .store
        .commit(
            &[Apply {
                event: event("40"),
                effects: big.into(),
            }],
            "w",
        )
        .await
        .unwrap();
    assert_eq!(first, vec![Committed::Applied]);
    let grow = Effect::update(s.counts, key("id", "big"))
        .set("more", "y".repeat(200_000))
        .add("count", 1);
    let answers = s
        .store
        .commit(
            &[
                Apply {
                    event: event("41"),
                    effects: bump(s.counts, "before"),
                },
                Apply {
                    event: event("42"),
                    effects: grow.into(),
                },
                Apply {
                    event: event("43"),
                    effects: bump(s.counts, "after"),
                },
            ],
            "w",
        )
        .await
        .expect("a refused transaction is not an error of the whole commit");
    assert_eq!(answers[0], Committed::Applied, "{answers:?}");
    assert!(
        matches!(&answers[1], Committed::Invalid(why) if why.contains("size")),
        "{answers:?}"
    );
    assert_eq!(answers[2], Committed::Applied, "{answers:?}");
    assert_eq!((s.count)("before").await, Some(1));
    assert_eq!((s.count)("after").await, Some(1));
    assert_eq!(
        (s.count)("big").await,
        None,
        "nothing of the refused update"
    );
    assert_eq!(s.store.get(&event("42")).await.unwrap(), None);
}

async fn lists_the_applications_receipts(s: &Subject<'_>) {
    s.store
        .record(&event("40"), &Disposition::Applied, "w")
        .await
        .unwrap();
    s.store
        .record(&event("41"), &Disposition::Held("x".into()), "w")
        .await
        .unwrap();
    let all = s.store.list(1000).await.unwrap();
    assert!(all.iter().any(|r| r.event == event("40")));
    assert!(
        all.iter()
            .any(|r| r.event == event("41") && !r.disposition.is_terminal())
    );
    assert_eq!(s.store.list(1).await.unwrap().len(), 1);
}

/// Receipt-only use: a sink with its own idempotency asks whether an event was done, and records
/// it once done; a held event is not done.
async fn seen_is_true_only_for_a_terminal_receipt(s: &Subject<'_>) {
    let e = event("11");
    assert!(!s.store.seen(&e).await.unwrap(), "no receipt");
    let held = Disposition::Held("later".into());
    s.store.record(&e, &held, "w1").await.unwrap();
    assert!(!s.store.seen(&e).await.unwrap(), "held is not done");
    assert_eq!(
        s.store
            .record(&e, &Disposition::Applied, "w1")
            .await
            .unwrap(),
        Recorded::Recorded
    );
    assert!(s.store.seen(&e).await.unwrap(), "applied is done");
    let q = event("12");
    s.store
        .record(&q, &Disposition::Quarantined("bad".into()), "w1")
        .await
        .unwrap();
    assert!(s.store.seen(&q).await.unwrap(), "quarantined is done");
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test]
                async fn $case() {
                    let store = MemoryReceipts::new().table("counts", &["id"]);
                    let s2 = store.clone();
                    let count = move |id: &str| -> futures::future::BoxFuture<'static, Option<i64>> {
                        let n = s2.number("counts", &key("id", id), "count");
                        Box::pin(async move { n })
                    };
                    super::$case(&Subject { store: &store, counts: "counts", count: &count }).await;
                }
            )*
        }

        mod dynamodb {
            use super::*;
            $(
                #[tokio::test]
                async fn $case() {
                    let live = live_or_skip!();
                    let receipts = support::unique_name("receipts");
                    let counts = support::unique_name("counts");
                    live.create_table(&counts, "id").await;
                    let store = DynamoDbReceipts::new(live.dynamodb.clone(), &receipts, "app");
                    store.prepare().await.expect("prepare creates the ledger");
                    let (client, table) = (live.dynamodb.clone(), counts.clone());
                    let count = move |id: &str| -> futures::future::BoxFuture<'static, Option<i64>> {
                        let (client, table, id) = (client.clone(), table.clone(), id.to_string());
                        Box::pin(async move {
                            let item = client
                                .get_item()
                                .table_name(table)
                                .key("id", AttributeValue::S(id))
                                .consistent_read(true)
                                .send()
                                .await
                                .expect("GetItem")
                                .item?;
                            item.get("count")?.as_n().ok()?.parse().ok()
                        })
                    };
                    super::$case(&Subject { store: &store, counts: &counts, count: &count }).await;
                    live.delete_table(&receipts).await;
                    live.delete_table(&counts).await;
                }
            )*
        }
    };
}

conformance!(
    records_and_never_overwrites_a_terminal_receipt,
    a_released_hold_is_gone,
    effects_are_written_once_with_their_receipt,
    a_replay_among_several_leaves_the_others_applied,
    a_refused_condition_writes_nothing,
    effects_over_the_limits_are_refused_before_the_call,
    an_update_past_the_item_limit_is_invalid_and_the_others_commit,
    lists_the_applications_receipts,
    seen_is_true_only_for_a_terminal_receipt,
);

#[tokio::test]
async fn dynamodb_a_ledger_with_the_wrong_key_is_refused_naming_it() {
    let live = live_or_skip!();
    let table = support::unique_name("receipts");
    live.create_table(&table, "id").await;
    let store = DynamoDbReceipts::new(live.dynamodb.clone(), &table, "app");
    let err = store.prepare().await.unwrap_err();
    match &err {
        Error::Table { table: t, reason } => {
            assert_eq!(t, &table);
            assert!(
                reason.contains("`id`") && reason.contains("`receiptKey` (S)"),
                "{reason}"
            );
        }
        other => panic!("expected Error::Table, got {other:?}"),
    }
    assert!(err.to_string().contains(&table), "{err}");
    live.delete_table(&table).await;
}

#[tokio::test]
async fn dynamodb_prepare_turns_on_the_ttl_and_two_applications_share_a_table() {
    let live = live_or_skip!();
    let table = support::unique_name("receipts");
    let a = DynamoDbReceipts::new(live.dynamodb.clone(), &table, "app-a");
    let b = DynamoDbReceipts::new(live.dynamodb.clone(), &table, "app-b");
    a.prepare().await.unwrap();
    b.prepare()
        .await
        .expect("a second prepare finds the TTL on");
    let ttl = live
        .dynamodb
        .describe_time_to_live()
        .table_name(&table)
        .send()
        .await
        .unwrap();
    let d = ttl.time_to_live_description().unwrap();
    assert_eq!(d.attribute_name(), Some("expiresAt"));
    // The same event is recorded once per application.
    let e = event("50");
    assert_eq!(
        a.record(&e, &Disposition::Applied, "w").await.unwrap(),
        Recorded::Recorded
    );
    assert_eq!(
        b.record(&e, &Disposition::Applied, "w").await.unwrap(),
        Recorded::Recorded
    );
    assert_eq!(a.list(10).await.unwrap().len(), 1);
    live.delete_table(&table).await;
}

/// Only an applied receipt carries `expiresAt`: a held receipt deleted by TTL would turn the hold
/// into a release no one saw, and a quarantined one deleted would let a replay handle its event
/// again (issue 23). A held receipt made terminal takes the terminal receipt's attributes.
#[tokio::test]
async fn dynamodb_only_applied_receipts_expire() {
    let live = live_or_skip!();
    let table = support::unique_name("receipts");
    let store = DynamoDbReceipts::new(live.dynamodb.clone(), &table, "app");
    store.prepare().await.unwrap();
    assert_eq!(
        ReceiptStore::retention(&store),
        Some(shardwise::receipts::DEFAULT_RETENTION)
    );
    let expires = |id: &'static str| {
        let live = &live;
        let table = &table;
        async move {
            let item = live
                .dynamodb
                .get_item()
                .table_name(table)
                .key(
                    "receiptKey",
                    aws_sdk_dynamodb::types::AttributeValue::S(format!(
                        "app|{}",
                        event(id).as_str()
                    )),
                )
                .consistent_read(true)
                .send()
                .await
                .unwrap()
                .item
                .expect("the receipt");
            item.contains_key("expiresAt")
        }
    };
    let cases = [
        ("60", Disposition::Applied, true),
        ("61", Disposition::Quarantined("poison".into()), false),
        ("62", Disposition::Held("review".into()), false),
    ];
    for (id, disposition, expiring) in &cases {
        store.record(&event(id), disposition, "w").await.unwrap();
        assert_eq!(expires(id).await, *expiring, "{disposition:?}");
    }
    // The held one applied later: it expires from then on.
    store
        .record(&event("62"), &Disposition::Applied, "w")
        .await
        .unwrap();
    assert!(expires("62").await, "applied after the hold");
    // An operator done with the quarantined event starts its retention; nothing else has one
    // to start.
    assert!(store.start_retention(&event("61")).await.unwrap());
    assert!(expires("61").await, "quarantined, its retention started");
    let receipt = store.get(&event("61")).await.unwrap().unwrap();
    assert_eq!(
        receipt.disposition,
        Disposition::Quarantined("poison".into())
    );
    store
        .record(&event("63"), &Disposition::Held("review".into()), "w")
        .await
        .unwrap();
    assert!(!store.start_retention(&event("63")).await.unwrap(), "held");
    assert!(!expires("63").await);
    assert!(
        !store.start_retention(&event("64")).await.unwrap(),
        "unknown"
    );
    live.delete_table(&table).await;
}
