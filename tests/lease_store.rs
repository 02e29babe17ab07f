//! One conformance suite for every `LeaseStore`: the memory store always, the DynamoDB store
//! against the live endpoint (one fresh table per test, created by `prepare()`). Both must give the
//! same typed answers to the same conditional writes, including under a race of eight takers.

mod support;

use std::time::{Duration, UNIX_EPOCH};

use futures::future::join_all;
use shardwise::lease::{
    Checkpoint, CheckpointWrite, DynamoDbLeaseStore, ITEM_WRITES_PER_SECOND, Lease, LeaseStore,
    MAX_SEEK_MOVES, MemoryLeaseStore, NewLease, Ownership, Renewal, Roster, SeekMove,
};
use shardwise::paged::{Cursor, PagePosition, PagedProgress};
use shardwise::{Error, Position, SequenceNumber};

const SHARD: &str = "shardId-000000000000";

fn new_lease(stream: &str, shard_id: &str) -> NewLease {
    NewLease {
        stream: stream.into(),
        shard_id: shard_id.into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: vec![],
    }
}

fn at(sequence: &str, sub: u64) -> Checkpoint {
    Checkpoint::At(Position::new(SequenceNumber::parse(sequence).unwrap(), sub))
}

/// A real-looking 56-digit Kinesis sequence number.
const SEQ_56: &str = "49590338271490256608559692538361571095921575989136588898";

fn stream_name() -> String {
    support::unique_name("stream")
}

/// Creates the row and returns it as read back.
async fn created(store: &dyn LeaseStore, stream: &str) -> Lease {
    assert!(store.create(&new_lease(stream, SHARD)).await.unwrap());
    row(store, stream).await
}

async fn row(store: &dyn LeaseStore, stream: &str) -> Lease {
    store
        .get(stream, SHARD)
        .await
        .unwrap()
        .expect("the row exists")
}

/// Creates the row and takes it for `owner`.
async fn held(store: &dyn LeaseStore, stream: &str, owner: &str) -> (Lease, Ownership) {
    let seen = created(store, stream).await;
    let taken = store.take(&seen, owner).await.unwrap().expect("take");
    let ownership = taken.ownership().expect("owned");
    (taken, ownership)
}

// ---------------------------------------------------------------------------------------------
// The suite

async fn create_twice_keeps_the_first(store: &dyn LeaseStore) {
    let stream = stream_name();
    let mut first = new_lease(&stream, SHARD);
    first.parents = vec!["shardId-000000000007".into()];
    assert!(store.create(&first).await.unwrap());
    let mut second = new_lease(&stream, SHARD);
    second.checkpoint = Checkpoint::Latest;
    assert!(!store.create(&second).await.unwrap(), "second create");

    let row = row(store, &stream).await;
    assert_eq!(row.stream, stream);
    assert_eq!(row.shard_id, SHARD);
    assert_eq!(row.owner, None);
    assert_eq!((row.counter, row.owner_epoch, row.seek_epoch), (0, 0, 0));
    assert_eq!(
        row.checkpoint,
        Checkpoint::TrimHorizon,
        "the first create wins"
    );
    assert_eq!(row.parents, vec!["shardId-000000000007".to_string()]);
    assert!(row.children.is_empty());
    assert_eq!(row.complete_through, None);
    assert_eq!(
        store.get(&stream, "shardId-000000000001").await.unwrap(),
        None
    );
}

async fn take_unowned_then_stale_take_gets_nothing(store: &dyn LeaseStore) {
    let stream = stream_name();
    let seen = created(store, &stream).await;
    let taken = store.take(&seen, "worker-a").await.unwrap().expect("take");
    assert_eq!(taken.owner.as_deref(), Some("worker-a"));
    assert_eq!((taken.counter, taken.owner_epoch), (1, 1));
    assert_eq!(
        taken,
        row(store, &stream).await,
        "take returns the stored row"
    );

    assert_eq!(
        store.take(&seen, "worker-b").await.unwrap(),
        None,
        "stale seen row"
    );
    assert_eq!(
        row(store, &stream).await,
        taken,
        "the refused take changed nothing"
    );

    // A row that does not exist cannot be taken (and is not created by trying).
    let mut ghost = seen.clone();
    ghost.shard_id = "shardId-000000000099".into();
    assert_eq!(store.take(&ghost, "worker-a").await.unwrap(), None);
    assert_eq!(store.get(&stream, &ghost.shard_id).await.unwrap(), None);
}

async fn renew_by_the_owner_only(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (taken, mine) = held(store, &stream, "worker-a").await;
    assert!(store.renew(&mine).await.unwrap().is_renewed());
    assert!(store.renew(&mine).await.unwrap().is_renewed());
    let after = row(store, &stream).await;
    assert_eq!(after.counter, taken.counter + 2);
    assert_eq!(
        after.owner_epoch, taken.owner_epoch,
        "renew keeps the epoch"
    );

    let wrong_epoch = Ownership {
        epoch: mine.epoch + 1,
        ..mine.clone()
    };
    assert!(!store.renew(&wrong_epoch).await.unwrap().is_renewed());
    let wrong_owner = Ownership {
        owner: "worker-b".into(),
        ..mine.clone()
    };
    assert!(!store.renew(&wrong_owner).await.unwrap().is_renewed());
    let missing = Ownership {
        shard_id: "shardId-000000000099".into(),
        ..mine
    };
    assert!(!store.renew(&missing).await.unwrap().is_renewed());
    assert_eq!(
        row(store, &stream).await,
        after,
        "refused renews changed nothing"
    );
}

async fn checkpoint_moves_forward_only(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, mine) = held(store, &stream, "worker-a").await;
    let ten = at("10", 0);
    assert_eq!(
        store
            .checkpoint(&mine, &ten, Some(1_700_000_000_000))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    let stored = row(store, &stream).await;
    assert_eq!(stored.checkpoint, ten);
    assert_eq!(stored.complete_through, Some(1_700_000_000_000));

    // Numeric, not lexicographic: 10 > 9; the sub-sequence counts too.
    for not_newer in [at("10", 0), at("9", 0), at("9", 5), at("0", 0)] {
        assert_eq!(
            store.checkpoint(&mine, &not_newer, Some(1)).await.unwrap(),
            CheckpointWrite::NotNewer,
            "{not_newer}"
        );
    }
    assert_eq!(
        store
            .checkpoint(&mine, &Checkpoint::TrimHorizon, None)
            .await
            .unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(row(store, &stream).await, stored, "unchanged");

    assert_eq!(
        store.checkpoint(&mine, &at("10", 1), None).await.unwrap(),
        CheckpointWrite::Written
    );
    let stored = row(store, &stream).await;
    assert_eq!(stored.checkpoint, at("10", 1));
    assert_eq!(
        stored.complete_through,
        Some(1_700_000_000_000),
        "no complete_through leaves it as it was"
    );
    assert_eq!(
        store
            .checkpoint(&mine, &at("100", 0), Some(1_700_000_000_500))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    let stored = row(store, &stream).await;
    assert_eq!(stored.checkpoint, at("100", 0));
    assert_eq!(stored.complete_through, Some(1_700_000_000_500));
    assert_eq!(
        stored.owner_epoch, mine.epoch,
        "a checkpoint is not a change of owner"
    );
}

async fn a_zombie_cannot_checkpoint(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, a) = held(store, &stream, "worker-a").await;
    assert_eq!(
        store.checkpoint(&a, &at(SEQ_56, 0), None).await.unwrap(),
        CheckpointWrite::Written
    );
    // A pauses past expiry; B observes the row and takes it.
    let fresh = row(store, &stream).await;
    let b = store
        .take(&fresh, "worker-b")
        .await
        .unwrap()
        .expect("B takes the expired lease");
    assert_eq!(b.owner_epoch, 2);
    let before = row(store, &stream).await;

    // A wakes up and tries to move the checkpoint, further or not.
    let later = at(&format!("{}9", &SEQ_56[..SEQ_56.len() - 1]), 0);
    for attempt in [
        later.clone(),
        Checkpoint::ShardEnd,
        at(SEQ_56, 0),
        at("1", 0),
    ] {
        assert_eq!(
            store.checkpoint(&a, &attempt, Some(5)).await.unwrap(),
            CheckpointWrite::Lost,
            "zombie write of {attempt}"
        );
    }
    assert!(!store.renew(&a).await.unwrap().is_renewed());
    assert!(!store.release(&a).await.unwrap());
    assert_eq!(
        row(store, &stream).await,
        before,
        "the zombie changed nothing"
    );

    // The rightful owner can.
    let b = b.ownership().unwrap();
    assert_eq!(
        store.checkpoint(&b, &later, None).await.unwrap(),
        CheckpointWrite::Written
    );
}

async fn shard_end_beats_any_sequence(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, mine) = held(store, &stream, "worker-a").await;
    let biggest = at(&"9".repeat(129), u64::MAX);
    assert_eq!(
        store.checkpoint(&mine, &biggest, None).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(
        store
            .checkpoint(&mine, &Checkpoint::ShardEnd, None)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.checkpoint, Checkpoint::ShardEnd);
    for after_the_end in [biggest, at(SEQ_56, 0), Checkpoint::ShardEnd] {
        assert_eq!(
            store.checkpoint(&mine, &after_the_end, None).await.unwrap(),
            CheckpointWrite::NotNewer
        );
    }
    assert_eq!(row(store, &stream).await.checkpoint, Checkpoint::ShardEnd);
}

async fn a_129_digit_sequence_beats_a_56_digit_one(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, mine) = held(store, &stream, "worker-a").await;
    // As strings, "1000…" < "4959…": only the padded key orders them numerically.
    let long = at(&format!("1{}", "0".repeat(128)), 0);
    assert_eq!(
        store.checkpoint(&mine, &at(SEQ_56, 0), None).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(
        store.checkpoint(&mine, &long, None).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.checkpoint, long);
    assert_eq!(
        store.checkpoint(&mine, &at(SEQ_56, 0), None).await.unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(row(store, &stream).await.checkpoint, long);
}

async fn release_gives_the_lease_up(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (taken, mine) = held(store, &stream, "worker-a").await;
    let stranger = Ownership {
        owner: "worker-b".into(),
        ..mine.clone()
    };
    assert!(!store.release(&stranger).await.unwrap(), "not the owner");
    assert!(store.release(&mine).await.unwrap());
    let released = row(store, &stream).await;
    assert_eq!(released.owner, None);
    assert_eq!(released.counter, taken.counter + 1);
    assert_eq!(released.owner_epoch, taken.owner_epoch);
    assert!(!store.release(&mine).await.unwrap(), "already released");
    assert!(!store.renew(&mine).await.unwrap().is_renewed());
    assert_eq!(
        store.checkpoint(&mine, &at("5", 0), None).await.unwrap(),
        CheckpointWrite::Lost
    );
    assert_eq!(row(store, &stream).await, released);

    // Unowned again: anyone may take it, under a new epoch.
    let again = store
        .take(&released, "worker-b")
        .await
        .unwrap()
        .expect("take");
    assert_eq!(again.owner_epoch, taken.owner_epoch + 1);
    assert_eq!(again.counter, released.counter + 1);
}

/// An idle partition's owner retires it: the row is left unowned with `retiredAt`, fenced like
/// every write (a stranger or a zombie cannot), never at SHARD_END; a take removes the mark, and
/// so does a seek.
async fn retire_leaves_the_row_unowned_with_its_mark_until_a_take(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (taken, mine) = held(store, &stream, "worker-a").await;
    let stranger = Ownership {
        owner: "worker-b".into(),
        ..mine.clone()
    };
    assert!(
        !store.retire(&stranger, 1_000).await.unwrap(),
        "not the owner"
    );
    let zombie = Ownership {
        epoch: mine.epoch - 1,
        ..mine.clone()
    };
    assert!(
        !store.retire(&zombie, 1_000).await.unwrap(),
        "an older epoch"
    );
    assert_eq!(row(store, &stream).await, taken, "nothing changed");
    assert!(store.retire(&mine, 1_000).await.unwrap());
    let retired = row(store, &stream).await;
    assert_eq!(retired.retired_at, Some(1_000));
    assert_eq!(retired.owner, None);
    assert_eq!(retired.counter, taken.counter + 1);
    assert_eq!(retired.owner_epoch, taken.owner_epoch);
    assert_eq!(retired.checkpoint, taken.checkpoint);
    assert!(!store.retire(&mine, 2_000).await.unwrap(), "no longer held");
    assert!(!store.renew(&mine).await.unwrap().is_renewed());

    // Woken: a take removes the mark.
    let woken = store
        .take(&retired, "worker-b")
        .await
        .unwrap()
        .expect("take");
    assert_eq!(woken.retired_at, None);
    assert_eq!(woken.owner_epoch, taken.owner_epoch + 1);
    assert_eq!(row(store, &stream).await.retired_at, None);

    // Retired again, then moved by a seek: the mark goes with the owner.
    let again = woken.ownership().unwrap();
    assert!(store.retire(&again, 3_000).await.unwrap());
    let retired = row(store, &stream).await;
    assert_eq!(retired.retired_at, Some(3_000));
    assert!(store.seek(&[mv(&retired, at("7", 0))]).await.unwrap());
    assert_eq!(row(store, &stream).await.retired_at, None);

    // Never at SHARD_END: an ended partition is deleted, not retired.
    let (_, ended) = held(store, &format!("{stream}-ended"), "worker-a").await;
    assert_eq!(
        store
            .checkpoint(&ended, &Checkpoint::ShardEnd, None)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    assert!(!store.retire(&ended, 1_000).await.unwrap(), "at SHARD_END");
    assert_eq!(row(store, &ended.stream).await.retired_at, None);
}

async fn steal_from_a_live_owner(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (a_row, a) = held(store, &stream, "worker-a").await;
    assert!(store.renew(&a).await.unwrap().is_renewed());
    // The row B saw before A's renew is stale.
    assert_eq!(store.take(&a_row, "worker-b").await.unwrap(), None);
    // A thief must name the owner it saw: a steal conditioned on "unowned" fails.
    let fresh = row(store, &stream).await;
    let unowned_view = Lease {
        owner: None,
        ..fresh.clone()
    };
    assert_eq!(store.take(&unowned_view, "worker-b").await.unwrap(), None);
    let stolen = store
        .take(&fresh, "worker-b")
        .await
        .unwrap()
        .expect("steal");
    assert_eq!(stolen.owner.as_deref(), Some("worker-b"));
    assert_eq!(stolen.owner_epoch, a.epoch + 1);
    assert_eq!(stolen.counter, fresh.counter + 1);
    assert!(
        !store.renew(&a).await.unwrap().is_renewed(),
        "the old owner lost it"
    );
    assert!(
        store
            .renew(&stolen.ownership().unwrap())
            .await
            .unwrap()
            .is_renewed()
    );
}

async fn list_returns_only_the_stream(store: &dyn LeaseStore) {
    let stream = stream_name();
    let other = stream_name();
    let shards = [
        "shardId-000000000002",
        "shardId-000000000000",
        "shardId-000000000001",
    ];
    for shard in shards {
        assert!(store.create(&new_lease(&stream, shard)).await.unwrap());
    }
    assert!(store.create(&new_lease(&other, SHARD)).await.unwrap());
    let mut child = new_lease(&stream, "shardId-000000000003");
    child.parents = vec![shards[1].into(), shards[2].into()];
    assert!(store.create(&child).await.unwrap());
    let children = vec!["shardId-000000000003".to_string()];
    store
        .set_children(&stream, shards[1], &children)
        .await
        .unwrap();
    store
        .set_children(&stream, shards[2], &children)
        .await
        .unwrap();
    // Children of a shard with no row: nothing to record, not an error, nothing created.
    store
        .set_children(&stream, "shardId-000000000042", &children)
        .await
        .unwrap();

    let mut rows = store.list(&stream).await.unwrap();
    rows.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
    let ids: Vec<&str> = rows.iter().map(|r| r.shard_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "shardId-000000000000",
            "shardId-000000000001",
            "shardId-000000000002",
            "shardId-000000000003"
        ]
    );
    assert!(rows.iter().all(|r| r.stream == stream));
    assert_eq!(rows[0].children, children);
    assert_eq!(rows[1].children, children);
    assert!(rows[2].children.is_empty());
    assert_eq!(rows[3].parents, child.parents);
    assert_eq!(store.list(&other).await.unwrap().len(), 1);
    assert!(store.list(&stream_name()).await.unwrap().is_empty());
}

async fn at_timestamp_round_trips(store: &dyn LeaseStore) {
    let stream = stream_name();
    let when = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
    let mut lease = new_lease(&stream, SHARD);
    lease.checkpoint = Checkpoint::AtTimestamp(when);
    assert!(store.create(&lease).await.unwrap());
    let stored = row(store, &stream).await;
    assert_eq!(stored.checkpoint, Checkpoint::AtTimestamp(when));
    assert_eq!(store.list(&stream).await.unwrap(), vec![stored.clone()]);
    let taken = store
        .take(&stored, "worker-a")
        .await
        .unwrap()
        .expect("take");
    assert_eq!(taken.checkpoint, Checkpoint::AtTimestamp(when));
    let mine = taken.ownership().unwrap();
    // A start sentinel is never newer than itself.
    assert_eq!(
        store
            .checkpoint(&mine, &Checkpoint::AtTimestamp(when), None)
            .await
            .unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(
        store.checkpoint(&mine, &at("1", 0), None).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.checkpoint, at("1", 0));
}

/// Eight workers race to take the same lease from the same observed row, twenty rounds in a row;
/// the winner's row is what the next round's racers saw (a steal from the last winner).
async fn eight_takers_race_and_one_wins(store: &dyn LeaseStore) {
    let stream = stream_name();
    let mut seen = created(store, &stream).await;
    let mut previous: Option<Ownership> = None;
    for round in 0..20u64 {
        let owners: Vec<String> = (0..8).map(|i| format!("worker-{round}-{i}")).collect();
        let results = join_all(owners.iter().map(|owner| store.take(&seen, owner))).await;
        let winners: Vec<Lease> = results
            .into_iter()
            .filter_map(|r| r.expect("take"))
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: exactly one winner: {winners:?}"
        );
        let winner = winners.into_iter().next().unwrap();
        assert_eq!(winner.owner_epoch, seen.owner_epoch + 1, "round {round}");
        assert_eq!(winner.counter, seen.counter + 1, "round {round}");
        assert_eq!(winner.owner_epoch, round + 1);
        assert_eq!(row(store, &stream).await, winner, "round {round}");
        if let Some(previous) = &previous {
            assert!(
                !store.renew(previous).await.unwrap().is_renewed(),
                "round {round}"
            );
        }
        previous = winner.ownership();
        seen = winner;
    }
}

/// A seek moves the checkpoint back, fences the owner out, frees the lease, and loses to a
/// concurrent seek that came first.
async fn seek_moves_back_and_fences_the_owner(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, a) = held(store, &stream, "worker-a").await;
    assert_eq!(
        store.checkpoint(&a, &at("900", 0), Some(50)).await.unwrap(),
        CheckpointWrite::Written
    );
    let seen = row(store, &stream).await;
    assert!(
        store
            .seek(&[mv(&seen, Checkpoint::TrimHorizon)])
            .await
            .unwrap()
    );
    let after = row(store, &stream).await;
    assert_eq!(after.checkpoint, Checkpoint::TrimHorizon, "moved back");
    assert_eq!(after.owner, None, "the lease is free");
    assert_eq!(
        (after.seek_epoch, after.owner_epoch),
        (seen.seek_epoch + 1, seen.owner_epoch + 1)
    );
    assert_eq!(
        after.complete_through,
        Some(50),
        "the frontier coordinate is kept"
    );
    // The old owner can neither renew nor write a late checkpoint.
    assert!(!store.renew(&a).await.unwrap().is_renewed());
    assert_eq!(
        store.checkpoint(&a, &at("901", 0), None).await.unwrap(),
        CheckpointWrite::Lost
    );
    // A seek from the stale row loses.
    assert!(!store.seek(&[mv(&seen, Checkpoint::Latest)]).await.unwrap());
    let before = Checkpoint::Before(shardwise::Position::new(
        shardwise::SequenceNumber::parse("77").unwrap(),
        2,
    ));
    assert!(store.seek(&[mv(&after, before.clone())]).await.unwrap());
    assert_eq!(
        row(store, &stream).await.checkpoint,
        before,
        "Before round-trips"
    );
}

/// A seek frees the row of a handoff request too (the taker asked the owner the seek removed), and
/// `announce` raises the roster's `changes` so every worker scans (issue 27, defect 10).
async fn a_seek_clears_a_handoff_request_and_announce_raises_changes(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (seen, _) = held(store, &stream, "worker-a").await;
    assert!(store.request(&seen, "worker-b").await.unwrap());
    let asked = row(store, &stream).await;
    assert_eq!(asked.wanted_by.as_deref(), Some("worker-b"));
    assert!(
        store
            .seek(&[mv(&asked, Checkpoint::TrimHorizon)])
            .await
            .unwrap()
    );
    let after = row(store, &stream).await;
    assert_eq!((after.owner, after.wanted_by), (None, None));

    let before = store.beat(&stream, 0, "w", 1, false).await.unwrap().changes;
    store.announce(&stream).await.unwrap();
    let roster = store.beat(&stream, 0, "w", 2, false).await.unwrap();
    assert_eq!(roster.changes, before + 1, "announced");
    assert_eq!(
        roster.beats.keys().collect::<Vec<_>>(),
        ["w"],
        "no worker added"
    );
}

/// DynamoDB's TransactWriteItems takes at most 100 items: a seek of more rows than that (a lineage
/// of 101 shards) is refused as a whole by both stores, and no row moves.
async fn a_seek_of_more_rows_than_a_transaction_takes_is_refused_whole(store: &dyn LeaseStore) {
    let stream = stream_name();
    let mut rows = Vec::new();
    for i in 0..=MAX_SEEK_MOVES {
        let shard = format!("shardId-{i:012}");
        assert!(store.create(&new_lease(&stream, &shard)).await.unwrap());
        rows.push(store.get(&stream, &shard).await.unwrap().unwrap());
    }
    let moves: Vec<SeekMove> = rows.iter().map(|r| mv(r, Checkpoint::Latest)).collect();
    let refused = store.seek(&moves).await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("more than one transaction takes"),
        "{refused}"
    );
    assert_eq!(store.list(&stream).await.unwrap(), rows, "no row moved");
}

fn mv(seen: &Lease, to: Checkpoint) -> SeekMove {
    SeekMove {
        seen: seen.clone(),
        to,
        progress: None,
        skipped: None,
    }
}

/// A seek of several rows (a parent and its children) writes all of them or none: one row seen
/// with a stale seek epoch refuses the whole move, and the others keep owner and checkpoint.
async fn a_seek_of_several_rows_moves_all_or_none(store: &dyn LeaseStore) {
    let stream = stream_name();
    let mut rows = Vec::new();
    for shard in [
        "shardId-000000000000",
        "shardId-000000000001",
        "shardId-000000000002",
    ] {
        assert!(store.create(&new_lease(&stream, shard)).await.unwrap());
        let seen = store.get(&stream, shard).await.unwrap().unwrap();
        let taken = store.take(&seen, "worker-a").await.unwrap().unwrap();
        let o = taken.ownership().unwrap();
        assert_eq!(
            store.checkpoint(&o, &at("500", 0), None).await.unwrap(),
            CheckpointWrite::Written
        );
        rows.push(store.get(&stream, shard).await.unwrap().unwrap());
    }
    // Another seek moved the last row first: the group's move is refused as a whole.
    assert!(
        store
            .seek(&[mv(&rows[2], Checkpoint::TrimHorizon)])
            .await
            .unwrap()
    );
    let group = [
        mv(
            &rows[0],
            Checkpoint::Before(Position::new(SequenceNumber::parse("7").unwrap(), 0)),
        ),
        mv(&rows[1], Checkpoint::TrimHorizon),
        mv(&rows[2], Checkpoint::TrimHorizon),
    ];
    assert!(
        !store.seek(&group).await.unwrap(),
        "one stale row refuses all"
    );
    for r in &rows[..2] {
        let now = store.get(&stream, &r.shard_id).await.unwrap().unwrap();
        assert_eq!(now, *r, "{}: untouched by the refused move", r.shard_id);
    }
    // Read again, the whole group moves at once.
    let fresh: Vec<Lease> = join_all(rows.iter().map(|r| store.get(&stream, &r.shard_id)))
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    let group: Vec<SeekMove> = fresh
        .iter()
        .zip(&group)
        .map(|(seen, m)| mv(seen, m.to.clone()))
        .collect();
    assert!(store.seek(&group).await.unwrap());
    for (before, m) in fresh.iter().zip(&group) {
        let after = store.get(&stream, &before.shard_id).await.unwrap().unwrap();
        assert_eq!(after.checkpoint, m.to);
        assert_eq!(after.owner, None);
        assert_eq!(after.seek_epoch, before.seek_epoch + 1);
        assert_eq!(after.owner_epoch, before.owner_epoch + 1);
    }
}

/// `completeThrough` never goes down, even when a checkpoint write carries a lower coordinate
/// (after an earlier write that timed out but was applied): the checkpoint still moves.
async fn complete_through_never_goes_down_with_a_checkpoint(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, a) = held(store, &stream, "worker-a").await;
    // The first write "timed out" for its writer, but it was applied.
    assert_eq!(
        store
            .checkpoint(&a, &at("100", 0), Some(1_000))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    // The next one carries a lower coordinate.
    assert_eq!(
        store
            .checkpoint(&a, &at("200", 0), Some(900))
            .await
            .unwrap(),
        CheckpointWrite::Written,
        "the checkpoint is newer: it is written"
    );
    let r = row(store, &stream).await;
    assert_eq!(r.checkpoint, at("200", 0));
    assert_eq!(
        r.complete_through,
        Some(1_000),
        "the coordinate did not go down"
    );
    // Equal and higher coordinates are written as usual.
    assert_eq!(
        store
            .checkpoint(&a, &at("300", 0), Some(1_500))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.complete_through, Some(1_500));
    // A checkpoint that is not newer stays refused, whatever its coordinate.
    assert_eq!(
        store
            .checkpoint(&a, &at("250", 0), Some(2_000))
            .await
            .unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(row(store, &stream).await.complete_through, Some(1_500));
}

/// Pinning a LATEST start is an ordinary fenced checkpoint write: AT_TIMESTAMP sorts above LATEST
/// and below every position, so it can be written once and never over a real checkpoint.
async fn a_latest_start_is_pinned_by_a_fenced_write(store: &dyn LeaseStore) {
    let stream = stream_name();
    let mut latest = new_lease(&stream, SHARD);
    latest.checkpoint = Checkpoint::Latest;
    assert!(store.create(&latest).await.unwrap());
    let seen = row(store, &stream).await;
    let a = store
        .take(&seen, "worker-a")
        .await
        .unwrap()
        .unwrap()
        .ownership()
        .unwrap();
    let pin = Checkpoint::AtTimestamp(UNIX_EPOCH + Duration::from_millis(1_700_000_000_123));
    assert_eq!(
        store.checkpoint(&a, &pin, None).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.checkpoint, pin);
    assert_eq!(
        store.checkpoint(&a, &pin, None).await.unwrap(),
        CheckpointWrite::NotNewer,
        "the same pin again (an answer lost, retried) changes nothing"
    );
    assert_eq!(
        store.checkpoint(&a, &at(SEQ_56, 0), None).await.unwrap(),
        CheckpointWrite::Written,
        "the first record's checkpoint passes the pin"
    );
    assert_eq!(
        store.checkpoint(&a, &pin, None).await.unwrap(),
        CheckpointWrite::NotNewer,
        "a pin never goes over a checkpoint"
    );
    // A zombie cannot pin.
    let seen = row(store, &stream).await;
    store.take(&seen, "worker-b").await.unwrap().unwrap();
    let later = Checkpoint::AtTimestamp(UNIX_EPOCH + Duration::from_millis(1_800_000_000_000));
    assert_eq!(
        store.checkpoint(&a, &later, None).await.unwrap(),
        CheckpointWrite::Lost
    );
}

/// The frontier coordinate rises alone (no checkpoint move), only for the owner, only upwards.
/// A shard on tumbling windows: the window state goes with the checkpoint in one fenced write;
/// a write at the stored position may change it (a window closed with nothing more settled),
/// one behind it may not; a plain checkpoint leaves it; a zombie cannot write it; SHARD_END and
/// a seek remove it.
async fn a_window_state_is_written_with_the_checkpoint_and_fenced(store: &dyn LeaseStore) {
    use shardwise::window::{Window, WindowState};
    let stream = stream_name();
    let (_, held) = held(store, &stream, "w1").await;
    let state = |text: &str| WindowState {
        window: Window {
            start_ms: 1_800_000_000_000,
            end_ms: 1_800_000_060_000,
        },
        state: text.as_bytes().to_vec().into(),
    };
    let ten = at("10", 0);
    assert_eq!(
        store
            .checkpoint_window(&held, &ten, None, Some(&state("{\"n\":10}")))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    let read = row(store, &stream).await;
    assert_eq!(
        (read.checkpoint.clone(), read.window),
        (ten.clone(), Some(state("{\"n\":10}")))
    );
    // At the same position: the window closed.
    assert_eq!(
        store
            .checkpoint_window(&held, &ten, None, None)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.window, None);
    // Behind the stored position: refused, nothing changed.
    assert_eq!(
        store
            .checkpoint_window(&held, &at("9", 0), None, Some(&state("{}")))
            .await
            .unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(row(store, &stream).await.window, None);
    store
        .checkpoint_window(&held, &at("11", 0), None, Some(&state("{\"n\":11}")))
        .await
        .unwrap();
    // A plain checkpoint leaves it.
    assert_eq!(
        store.checkpoint(&held, &at("12", 0), None).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(row(store, &stream).await.window, Some(state("{\"n\":11}")));
    // A zombie (an older epoch) writes nothing.
    let zombie = Ownership {
        epoch: held.epoch - 1,
        ..held.clone()
    };
    assert_eq!(
        store
            .checkpoint_window(&zombie, &at("13", 0), None, None)
            .await
            .unwrap(),
        CheckpointWrite::Lost
    );
    assert_eq!(row(store, &stream).await.window, Some(state("{\"n\":11}")));
    // SHARD_END removes it.
    store
        .checkpoint(&held, &Checkpoint::ShardEnd, None)
        .await
        .unwrap();
    assert_eq!(row(store, &stream).await.window, None);
    // And a seek.
    let other = stream_name();
    let (_, held) = held_again(store, &other).await;
    store
        .checkpoint_window(&held, &ten, None, Some(&state("{}")))
        .await
        .unwrap();
    let seen = row(store, &other).await;
    assert!(seen.window.is_some());
    assert!(store.seek(&[mv(&seen, at("5", 0))]).await.unwrap());
    assert_eq!(row(store, &other).await.window, None);
}

async fn held_again(store: &dyn LeaseStore, stream: &str) -> (Lease, Ownership) {
    held(store, stream, "w2").await
}

async fn advance_frontier_only_rises(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, a) = held(store, &stream, "worker-a").await;
    assert_eq!(
        store.advance_frontier(&a, 100).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(
        store.advance_frontier(&a, 100).await.unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(
        store.advance_frontier(&a, 99).await.unwrap(),
        CheckpointWrite::NotNewer
    );
    assert_eq!(row(store, &stream).await.complete_through, Some(100));
    let seen = row(store, &stream).await;
    store.take(&seen, "worker-b").await.unwrap().expect("steal");
    assert_eq!(
        store.advance_frontier(&a, 200).await.unwrap(),
        CheckpointWrite::Lost
    );
    assert_eq!(row(store, &stream).await.complete_through, Some(100));
}

/// Only an ended row nobody touched since it was read can be deleted.
async fn delete_takes_only_an_untouched_ended_row(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, a) = held(store, &stream, "worker-a").await;
    let open = row(store, &stream).await;
    assert!(!store.delete(&open).await.unwrap(), "not at SHARD_END");
    store
        .checkpoint(&a, &Checkpoint::ShardEnd, None)
        .await
        .unwrap();
    let ended = row(store, &stream).await;
    assert!(store.release(&a).await.unwrap());
    assert!(
        !store.delete(&ended).await.unwrap(),
        "touched since it was read"
    );
    let ended = row(store, &stream).await;
    assert!(store.delete(&ended).await.unwrap());
    assert!(store.get(&stream, SHARD).await.unwrap().is_none());
}

// ---------------------------------------------------------------------------------------------
// One test per (store, case)

fn progress(cursor: Option<&str>, applied: Option<u64>, version: u64) -> PagedProgress {
    PagedProgress {
        resume_cursor: cursor.map(|c| Cursor::new(c.to_string())),
        applied_position: applied.map(PagePosition::from_u64),
        checkpoint_version: version,
        closed_through: None,
        // Stored and read back as written by both stores (`receiptsSince`).
        receipts_since: Some(1_764_000_000_000 + version as i64),
    }
}

/// The progress a seek leaves (no cursor, no applied position, nothing known of receipts).
fn sought(version: u64) -> PagedProgress {
    PagedProgress {
        receipts_since: None,
        ..progress(None, None, version)
    }
}

/// Seed 003's walkthrough as store writes: from nothing to C7/105, then 106 applied under the same
/// attempt, then the barrier to C8. Every write is a compare-and-swap on the attempt (cursor and
/// version): a stale attempt loses and changes nothing; the applied position never goes down.
async fn paged_progress_moves_by_compare_and_swap_on_the_attempt(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, me) = held(store, &stream, "w1").await;
    let start = PagedProgress::default();
    assert_eq!(
        row(store, &stream).await.progress,
        None,
        "a new row has none"
    );
    let c7 = progress(Some("C7"), Some(105), 1);
    assert_eq!(
        store.paged_checkpoint(&me, &start, &c7).await.unwrap(),
        CheckpointWrite::Written,
        "the first barrier"
    );
    assert_eq!(row(store, &stream).await.progress, Some(c7.clone()));

    // 106 applied under the attempt (C7, version 1).
    let c7_106 = progress(Some("C7"), Some(106), 1);
    assert_eq!(
        store.paged_checkpoint(&me, &c7, &c7_106).await.unwrap(),
        CheckpointWrite::Written
    );
    // The same applied position again, or a lower one, is not newer.
    for stale in [c7_106.clone(), progress(Some("C7"), Some(104), 1)] {
        assert_eq!(
            store.paged_checkpoint(&me, &c7_106, &stale).await.unwrap(),
            CheckpointWrite::NotNewer,
            "{stale:?}"
        );
    }
    // A stale attempt (fetched at version 0, or at another cursor) loses the compare-and-swap.
    let c8 = progress(Some("C8"), Some(107), 2);
    for stale in [start.clone(), progress(Some("C6"), Some(106), 1)] {
        assert_eq!(
            store.paged_checkpoint(&me, &stale, &c8).await.unwrap(),
            CheckpointWrite::NotNewer,
            "{stale:?}"
        );
    }
    assert_eq!(row(store, &stream).await.progress, Some(c7_106.clone()));
    // A barrier may not lower the applied position, nor skip a version.
    for bad in [
        progress(Some("C8"), Some(105), 2),
        progress(Some("C8"), None, 2),
        progress(Some("C8"), Some(107), 3),
    ] {
        assert_eq!(
            store.paged_checkpoint(&me, &c7_106, &bad).await.unwrap(),
            CheckpointWrite::NotNewer,
            "{bad:?}"
        );
    }
    // The barrier: C8, version 2. The two attempts that raced for it: one wins, the other rereads.
    assert_eq!(
        store.paged_checkpoint(&me, &c7_106, &c8).await.unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(
        store.paged_checkpoint(&me, &c7_106, &c8).await.unwrap(),
        CheckpointWrite::NotNewer,
        "the loser of two attempts with the same version"
    );
    assert_eq!(row(store, &stream).await.progress, Some(c8.clone()));
    // An empty page's barrier keeps the applied position.
    let c9 = progress(Some("C9"), Some(107), 3);
    assert_eq!(
        store.paged_checkpoint(&me, &c8, &c9).await.unwrap(),
        CheckpointWrite::Written
    );
}

/// A paged write is fenced by owner and epoch like every checkpoint: a zombie's is `Lost`.
async fn a_zombie_cannot_write_paged_progress(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (seen, zombie) = held(store, &stream, "w1").await;
    let seen = store
        .get(&seen.stream, &seen.shard_id)
        .await
        .unwrap()
        .unwrap();
    store.take(&seen, "w2").await.unwrap().expect("stolen");
    let to = progress(Some("C1"), Some(1), 1);
    assert_eq!(
        store
            .paged_checkpoint(&zombie, &PagedProgress::default(), &to)
            .await
            .unwrap(),
        CheckpointWrite::Lost
    );
    assert_eq!(row(store, &stream).await.progress, None);
}

/// A seek of a paged partition replaces its cursor and applied position and bumps its version, so
/// a page fetched before the seek cannot pass its barrier.
async fn a_seek_resets_paged_progress_and_bumps_the_version(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, me) = held(store, &stream, "w1").await;
    let c3 = progress(Some("C3"), Some(30), 1);
    store
        .paged_checkpoint(&me, &PagedProgress::default(), &c3)
        .await
        .unwrap();
    let seen = row(store, &stream).await;
    let moved = store
        .seek(&[SeekMove {
            seen,
            to: Checkpoint::TrimHorizon,
            progress: Some(PagedProgress::default()),
            skipped: None,
        }])
        .await
        .unwrap();
    assert!(moved);
    let after = row(store, &stream).await;
    assert_eq!(after.progress, Some(sought(2)));
    assert_eq!(after.owner, None);
    // A barrier of the attempt at C3 version 1 is refused (and the lease is gone anyway).
    let c4 = progress(Some("C4"), Some(40), 2);
    assert_ne!(
        store.paged_checkpoint(&me, &c3, &c4).await.unwrap(),
        CheckpointWrite::Written
    );
}

/// A source read by timestamp (seed 000): `closedThrough` moves with the version, by
/// compare-and-swap on the generation and the closed timestamp seen, never back. Two retries of one
/// generation: one wins, the other is refused and changes nothing. A seek clears it.
async fn closed_through_moves_forward_by_compare_and_swap(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (_, me) = held(store, &stream, "w1").await;
    let closed = |t: Option<i64>, version: u64| PagedProgress {
        checkpoint_version: version,
        closed_through: t,
        ..PagedProgress::default()
    };
    let (t10_00, t10_01, t10_02) = (36_000_000, 36_060_000, 36_120_000);
    let start = PagedProgress::default();
    assert_eq!(
        store
            .paged_checkpoint(&me, &start, &closed(Some(t10_00), 1))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    assert_eq!(
        row(store, &stream).await.progress,
        Some(closed(Some(t10_00), 1))
    );
    // Two retries of generation 1 close 10:01: the first wins, the loser changes nothing.
    let winner = closed(Some(t10_01), 2);
    assert_eq!(
        store
            .paged_checkpoint(&me, &closed(Some(t10_00), 1), &winner)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    for stale in [winner.clone(), closed(Some(t10_02), 2)] {
        assert_eq!(
            store
                .paged_checkpoint(&me, &closed(Some(t10_00), 1), &stale)
                .await
                .unwrap(),
            CheckpointWrite::NotNewer,
            "{stale:?}"
        );
    }
    assert_eq!(row(store, &stream).await.progress, Some(winner.clone()));
    // Never back, and never moved without a new generation.
    for bad in [
        closed(Some(t10_00), 3),
        closed(None, 3),
        closed(Some(t10_02), 2),
    ] {
        assert_eq!(
            store.paged_checkpoint(&me, &winner, &bad).await.unwrap(),
            CheckpointWrite::NotNewer,
            "{bad:?}"
        );
    }
    assert_eq!(
        store
            .paged_checkpoint(&me, &winner, &closed(Some(t10_02), 3))
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    // A seek to the start clears it and bumps the version.
    let seen = row(store, &stream).await;
    assert!(
        store
            .seek(&[SeekMove {
                seen,
                to: Checkpoint::TrimHorizon,
                progress: Some(PagedProgress::default()),
                skipped: None,
            }])
            .await
            .unwrap()
    );
    assert_eq!(row(store, &stream).await.progress, Some(closed(None, 4)));
}

/// The frontier membership (seed 001): the first publication only where none is stored, each
/// change only from the epoch seen, the loser of a race refused and changing nothing; it is kept
/// apart from the lease rows (a listing of the stream does not see it).
async fn membership_is_published_by_compare_and_swap_on_its_epoch(store: &dyn LeaseStore) {
    use shardwise::frontier::Membership;
    let stream = stream_name();
    assert_eq!(store.membership(&stream).await.unwrap(), None);
    let first = Membership {
        epoch: 1,
        members: vec!["a".into(), "b".into()],
        seeks: 0,
        ..Membership::default()
    };
    assert!(
        store
            .publish_membership(&stream, None, &first)
            .await
            .unwrap()
    );
    assert!(
        !store
            .publish_membership(&stream, None, &first)
            .await
            .unwrap(),
        "a first publication only where none is stored"
    );
    assert_eq!(
        store.membership(&stream).await.unwrap(),
        Some(first.clone())
    );
    let grown = Membership {
        epoch: 2,
        members: vec!["a".into(), "b".into(), "c".into()],
        seeks: 1,
        seek_epochs: [("c".to_string(), 1)].into(),
    };
    let other = Membership {
        epoch: 2,
        members: vec!["a".into()],
        seeks: 0,
        ..Membership::default()
    };
    assert!(
        store
            .publish_membership(&stream, Some(1), &grown)
            .await
            .unwrap()
    );
    assert!(
        !store
            .publish_membership(&stream, Some(1), &other)
            .await
            .unwrap(),
        "the loser of the race from epoch 1"
    );
    assert_eq!(store.membership(&stream).await.unwrap(), Some(grown));
    assert!(
        store.list(&stream).await.unwrap().is_empty(),
        "not a lease row"
    );
    assert_eq!(
        store.membership(&format!("{stream}-other")).await.unwrap(),
        None
    );
}

/// Cooperative handoff: a taker asks (`wantedBy`), the owner keeps renewing and checkpointing,
/// then passes the lease to that taker alone (owner, epoch + 1, request cleared). A second request
/// while one is pending, a request from a stale view, and a pass to anyone else are refused; the
/// old owner is fenced after the pass. A take or a release clears a request.
async fn a_handoff_is_requested_once_and_passed_only_to_the_taker(store: &dyn LeaseStore) {
    let stream = stream_name();
    let (seen, w1) = held(store, &stream, "w1").await;
    assert!(store.request(&seen, "w2").await.unwrap());
    assert!(
        !store.request(&seen, "w3").await.unwrap(),
        "one request at a time"
    );
    let wanted = row(store, &stream).await;
    assert_eq!(wanted.wanted_by.as_deref(), Some("w2"));
    assert_eq!(
        (wanted.owner.as_deref(), wanted.owner_epoch),
        (Some("w1"), w1.epoch)
    );
    assert_eq!(
        store.renew(&w1).await.unwrap(),
        Renewal::Renewed {
            wanted_by: Some("w2".into())
        },
        "the owner keeps renewing, and its renewal carries the request"
    );
    assert_eq!(
        store
            .checkpoint(
                &w1,
                &at(
                    "49590338271490256608559692538361571095921575989136588898",
                    0
                ),
                None
            )
            .await
            .unwrap(),
        CheckpointWrite::Written,
        "and checkpointing"
    );
    // The owner acknowledges the request it noticed (the taker's patience counts from this),
    // only that taker's and only while it holds the lease.
    assert!(!wanted.handoff_acked);
    assert!(
        !store.acknowledge(&w1, "w3").await.unwrap(),
        "not w3's request"
    );
    assert!(store.acknowledge(&w1, "w2").await.unwrap());
    let acked = row(store, &stream).await;
    assert!(acked.handoff_acked);
    assert_eq!(
        (acked.wanted_by.as_deref(), acked.owner_epoch),
        (Some("w2"), w1.epoch)
    );
    assert!(
        !store.pass(&w1, "w3").await.unwrap(),
        "only to the taker that asked"
    );
    assert!(store.pass(&w1, "w2").await.unwrap());
    let passed = row(store, &stream).await;
    assert_eq!(passed.owner.as_deref(), Some("w2"));
    assert_eq!(passed.owner_epoch, w1.epoch + 1);
    assert_eq!(passed.wanted_by, None);
    assert!(!passed.handoff_acked, "the pass clears the acknowledgement");
    assert!(
        !store.acknowledge(&w1, "w2").await.unwrap(),
        "the old owner cannot acknowledge"
    );
    assert!(
        !store.renew(&w1).await.unwrap().is_renewed(),
        "the old owner is fenced"
    );
    assert!(!store.pass(&w1, "w2").await.unwrap());
    assert!(
        !store.request(&seen, "w3").await.unwrap(),
        "a stale view cannot ask"
    );

    // A take (here by the new owner's rival, after expiry) and a release clear a request.
    let w2 = passed.ownership().unwrap();
    assert!(store.request(&passed, "w3").await.unwrap());
    assert!(store.release(&w2).await.unwrap());
    let released = row(store, &stream).await;
    assert_eq!((&released.owner, &released.wanted_by), (&None, &None));
    let taken = store.take(&released, "w3").await.unwrap().unwrap();
    assert!(store.request(&taken, "w4").await.unwrap());
    assert!(
        store
            .acknowledge(&taken.ownership().unwrap(), "w4")
            .await
            .unwrap()
    );
    let again = row(store, &stream).await;
    let stolen = store.take(&again, "w5").await.unwrap().unwrap();
    assert_eq!(
        (stolen.wanted_by, stolen.handoff_acked),
        (None, false),
        "a steal clears the request and its acknowledgement"
    );
}

async fn the_roster_counts_beats_and_forgets_a_worker_only_as_seen(store: &dyn LeaseStore) {
    let stream = stream_name();
    let other = stream_name();
    let first = store.beat(&stream, 0, "w1", 1, false).await.unwrap();
    assert_eq!(first.beats.get("w1"), Some(&1));
    assert_eq!(first.changes, 0);
    assert_eq!(first.founder.as_deref(), Some("w1"), "the first to beat");
    assert_eq!(first.beat_before, None, "no entry before");
    let both = store.beat(&stream, 0, "w2", 1, false).await.unwrap();
    assert_eq!(
        both.beats
            .iter()
            .map(|(w, b)| (w.as_str(), *b))
            .collect::<Vec<_>>(),
        [("w1", 1), ("w2", 1)],
        "a beat returns the whole roster"
    );
    assert_eq!(both.founder.as_deref(), Some("w1"), "the founder stays");
    assert_eq!(both.beat_before, None, "w2's own entry was new");
    let announced = store.beat(&stream, 0, "w1", 2, true).await.unwrap();
    assert_eq!((announced.beats["w1"], announced.changes), (2, 1));
    assert_eq!(announced.beat_before, Some(1), "w1's own last beat");
    // Beats are set, not added: a value as large as a tagged beat round-trips whole.
    let tagged = (1u64 << 63) + 3;
    let big = store.beat(&stream, 0, "w1", tagged, false).await.unwrap();
    assert_eq!((big.beats["w1"], big.beat_before), (tagged, Some(2)));
    let again = store.beat(&stream, 0, "w1", 4, false).await.unwrap();
    assert_eq!((again.beats["w1"], again.beat_before), (4, Some(tagged)));
    assert_eq!(
        store.beat(&other, 0, "w1", 1, false).await.unwrap().beats["w1"],
        1,
        "each stream has its own roster"
    );
    // The roster is not a lease row.
    held(store, &stream, "w1").await;
    assert_eq!(store.list(&stream).await.unwrap().len(), 1);

    assert!(
        !store.forget(&stream, 0, "w2", Some(7)).await.unwrap(),
        "w2 beat since it was seen at 7"
    );
    assert!(store.forget(&stream, 0, "w2", Some(1)).await.unwrap());
    assert!(
        !store.forget(&stream, 0, "w2", Some(1)).await.unwrap(),
        "forgotten already"
    );
    let after = store.beat(&stream, 0, "w1", 5, false).await.unwrap();
    assert_eq!(after.beats.keys().collect::<Vec<_>>(), ["w1"]);
    assert_eq!(after.changes, 1);
    // Leaving is unconditional and announced (every worker scans), and a worker that comes back
    // writes its beat into a new entry.
    assert!(store.forget(&stream, 0, "w1", None).await.unwrap());
    let back = store.beat(&stream, 0, "w1", 1, false).await.unwrap();
    assert_eq!((back.beats["w1"], back.changes), (1, 2));
    assert_eq!(back.beat_before, None, "leaving removed the entry");

    // A split roster: section 0 says how many sections there are (1 until split); each section
    // is an item of its own, with its own entries, founder and counter, and they are read in one
    // request.
    assert_eq!(back.sections, Some(1));
    assert!(store.split_roster(&stream, 1, 4).await.unwrap());
    assert!(
        !store.split_roster(&stream, 1, 2).await.unwrap(),
        "split already: the count read is stale"
    );
    let third = store.beat(&stream, 3, "w9", 7, true).await.unwrap();
    assert_eq!(third.beats.keys().collect::<Vec<_>>(), ["w9"]);
    assert_eq!(
        (third.changes, third.sections, third.founder.as_deref()),
        (1, None, Some("w9"))
    );
    let read = store.read_roster(&stream, &[0, 2, 3]).await.unwrap();
    assert_eq!(read.len(), 3);
    assert_eq!((read[0].sections, read[0].beats["w1"]), (Some(4), 1));
    assert_eq!(read[1], Roster::default(), "a section nobody beat in");
    assert_eq!((read[2].beats["w9"], read[2].beat_before), (7, None));
    assert!(store.split_roster(&stream, 4, 8).await.unwrap());
    assert_eq!(
        store
            .beat(&stream, 0, "w1", 2, false)
            .await
            .unwrap()
            .sections,
        Some(8)
    );
    assert!(store.forget(&stream, 3, "w9", Some(7)).await.unwrap());
    assert!(
        store.read_roster(&stream, &[3]).await.unwrap()[0]
            .beats
            .is_empty()
    );
}

/// What a seek records as skipped round-trips on the row (the paged attributes and the owner
/// removed beside it), a row written without it reads as none, and a later seek that says
/// `None` removes it; `list` and `get` agree.
async fn a_seek_records_what_it_skipped_on_the_row(store: &dyn LeaseStore) {
    use shardwise::frontier::{SeekCoordinate, SkippedRange};
    let stream = stream_name();
    let (_, _me) = held(store, &stream, "w1").await;
    let seen = row(store, &stream).await;
    assert_eq!(seen.seek_skipped, None, "a row no seek moved");
    assert_eq!(seen.sought_at, None, "a row no seek moved");
    let before = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let forward = SkippedRange {
        from: SeekCoordinate::Checkpoint(SEQ_56.into()),
        to: SeekCoordinate::Time(1_764_452_220_123),
        seek_epoch: 1,
    };
    let to = Checkpoint::AtTimestamp(UNIX_EPOCH + Duration::from_millis(1_764_452_220_123));
    assert!(
        store
            .seek(&[SeekMove {
                skipped: Some(forward.clone()),
                ..mv(&seen, to)
            }])
            .await
            .unwrap()
    );
    let after = row(store, &stream).await;
    assert_eq!(
        (
            after.seek_epoch,
            after.owner.as_deref(),
            after.seek_skipped.as_ref()
        ),
        (1, None, Some(&forward))
    );
    // When it was moved: receipts recorded before it are of events the seek asked for again.
    assert!(
        after.sought_at.is_some_and(|t| t >= before - 1_000),
        "{:?}",
        after.sought_at
    );
    assert_eq!(
        store.list(&stream).await.unwrap(),
        std::slice::from_ref(&after)
    );
    let paged = SkippedRange {
        from: SeekCoordinate::Start,
        to: SeekCoordinate::End,
        seek_epoch: 2,
    };
    assert!(
        store
            .seek(&[SeekMove {
                progress: Some(PagedProgress::default()),
                skipped: Some(paged.clone()),
                ..mv(&after, Checkpoint::TrimHorizon)
            }])
            .await
            .unwrap()
    );
    let after = row(store, &stream).await;
    assert_eq!(after.seek_skipped, Some(paged));
    assert_eq!(after.progress, Some(sought(1)));
    assert!(
        store
            .seek(&[mv(&after, Checkpoint::TrimHorizon)])
            .await
            .unwrap()
    );
    assert_eq!(row(store, &stream).await.seek_skipped, None, "read again");
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let store = MemoryLeaseStore::new();
                    store.prepare().await.unwrap();
                    super::$case(&store).await;
                }
            )*
        }

        mod dynamodb {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let live = live_or_skip!();
                    let table = support::unique_name("leases");
                    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
                    store.prepare().await.expect("prepare creates the table");
                    super::$case(&store).await;
                    live.delete_table(&table).await;
                }
            )*
        }
    };
}

conformance!(
    create_twice_keeps_the_first,
    take_unowned_then_stale_take_gets_nothing,
    renew_by_the_owner_only,
    checkpoint_moves_forward_only,
    a_zombie_cannot_checkpoint,
    shard_end_beats_any_sequence,
    a_129_digit_sequence_beats_a_56_digit_one,
    release_gives_the_lease_up,
    retire_leaves_the_row_unowned_with_its_mark_until_a_take,
    steal_from_a_live_owner,
    list_returns_only_the_stream,
    at_timestamp_round_trips,
    eight_takers_race_and_one_wins,
    seek_moves_back_and_fences_the_owner,
    a_seek_of_several_rows_moves_all_or_none,
    complete_through_never_goes_down_with_a_checkpoint,
    a_latest_start_is_pinned_by_a_fenced_write,
    advance_frontier_only_rises,
    a_window_state_is_written_with_the_checkpoint_and_fenced,
    delete_takes_only_an_untouched_ended_row,
    paged_progress_moves_by_compare_and_swap_on_the_attempt,
    a_zombie_cannot_write_paged_progress,
    a_seek_resets_paged_progress_and_bumps_the_version,
    closed_through_moves_forward_by_compare_and_swap,
    membership_is_published_by_compare_and_swap_on_its_epoch,
    a_seek_records_what_it_skipped_on_the_row,
    a_handoff_is_requested_once_and_passed_only_to_the_taker,
    the_roster_counts_beats_and_forgets_a_worker_only_as_seen,
    a_seek_clears_a_handoff_request_and_announce_raises_changes,
    a_seek_of_more_rows_than_a_transaction_takes_is_refused_whole,
);

// ---------------------------------------------------------------------------------------------
// The DynamoDB store only: the table itself.

/// With the service's limits, a roster item takes 1,000 write units a second, as a DynamoDB item
/// does, and a write takes a unit per KB of the item: the next beat in the same second is
/// throttled without effect, the next second takes more, and a larger item takes fewer beats.
#[tokio::test(start_paused = true)]
async fn memory_a_roster_item_takes_a_thousand_write_units_a_second() {
    let store = MemoryLeaseStore::new();
    store.service_limits();
    for beat in 1..=u64::from(ITEM_WRITES_PER_SECOND) {
        store.beat("s", 0, "w", beat, false).await.unwrap();
    }
    let refused = store.beat("s", 0, "w", 1_001, false).await.unwrap_err();
    assert!(format!("{refused:?}").contains("throttled"), "{refused:?}");
    // Another stream's roster, and another section, are other items.
    store.beat("t", 0, "w", 1, false).await.unwrap();
    store.beat("s", 1, "w", 1, false).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let roster = store.beat("s", 0, "w", 2_000, false).await.unwrap();
    assert_eq!(
        roster.beat_before,
        Some(1_000),
        "the refused beat had no effect, this one did"
    );
    // 40 workers with 100-character ids: an item of about 4.8 KB, 5 units a write.
    let id = |i: usize| format!("{i:0>100}");
    for i in 0..40 {
        store.beat("u", 0, &id(i), 1, false).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut taken = 0;
    while store.beat("u", 0, &id(0), taken + 2, false).await.is_ok() {
        taken += 1;
    }
    assert_eq!(taken, 200, "1,000 units at 5 a write");
    assert_eq!(
        store.busiest_item(),
        Some(("~workers#s".to_string(), 1_000))
    );
}

/// A roster throttled for a while (a hot item) refuses every beat and forget of its stream, and
/// nothing else; released, it takes them again.
#[tokio::test]
async fn memory_a_throttled_roster_refuses_its_writes_until_released() {
    let store = MemoryLeaseStore::new();
    store.beat("s", 0, "a", 1, false).await.unwrap();
    store.throttle_roster("s", true);
    assert!(store.beat("s", 0, "a", 2, false).await.is_err());
    assert!(
        store.beat("s", 3, "a", 2, false).await.is_err(),
        "every section"
    );
    assert!(store.forget("s", 0, "a", None).await.is_err());
    store.beat("t", 0, "a", 1, false).await.unwrap();
    assert!(store.create(&new_lease("s", SHARD)).await.unwrap());
    store.throttle_roster("s", false);
    let roster = store.beat("s", 0, "a", 3, false).await.unwrap();
    assert_eq!(
        roster.beat_before,
        Some(1),
        "the throttled beat had no effect"
    );
}

/// A slow answer is applied at once and answered late, but answered: not a lost one.
#[tokio::test(start_paused = true)]
async fn memory_a_slow_answer_is_applied_at_once_and_answered_late() {
    let store = MemoryLeaseStore::new();
    store.inject(
        1,
        shardwise::testing::Faults::default()
            .slow_answer(1.0)
            .timeout(0.0, Duration::from_secs(2)),
    );
    let started = tokio::time::Instant::now();
    let new = new_lease("s", SHARD);
    let create = store.create(&new);
    tokio::pin!(create);
    tokio::select! {
        _ = &mut create => panic!("answered at once"),
        _ = tokio::time::sleep(Duration::from_millis(10)) => {}
    }
    assert_eq!(store.snapshot().len(), 1, "applied before the answer");
    assert!(create.await.unwrap());
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

#[tokio::test]
async fn memory_snapshot_and_clones_share_rows() {
    let store = MemoryLeaseStore::new();
    let clone = store.clone();
    assert!(store.create(&new_lease("a", SHARD)).await.unwrap());
    assert!(!clone.create(&new_lease("a", SHARD)).await.unwrap());
    assert!(clone.create(&new_lease("b", SHARD)).await.unwrap());
    let keys: Vec<String> = store.snapshot().iter().map(Lease::key).collect();
    assert_eq!(keys, [format!("a#{SHARD}"), format!("b#{SHARD}")]);
}

fn schema_error(err: Error) -> String {
    match &err {
        Error::LeaseTableSchema { .. } => err.to_string(),
        other => panic!("expected LeaseTableSchema, got {other:?}"),
    }
}

#[tokio::test]
async fn dynamodb_prepare_twice_and_by_two_workers_at_once() {
    let live = live_or_skip!();
    let table = support::unique_name("leases");
    let a = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    let b = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    let (ra, rb) = tokio::join!(a.prepare(), b.prepare());
    ra.expect("worker a");
    rb.expect("worker b");
    a.prepare().await.expect("an existing, right table");
    assert!(a.create(&new_lease("s", SHARD)).await.unwrap());
    assert!(format!("{a:?}").contains(&table));
    live.delete_table(&table).await;
}

#[tokio::test]
async fn dynamodb_prepare_refuses_a_table_keyed_by_another_attribute() {
    let live = live_or_skip!();
    let table = support::unique_name("leases");
    live.create_table(&table, "id").await;
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    let message = schema_error(store.prepare().await.unwrap_err());
    assert!(message.contains(&table), "{message}");
    assert!(message.contains("`id`"), "{message}");
    assert!(message.contains("`leaseKey` (S)"), "{message}");
    live.delete_table(&table).await;
}

#[tokio::test]
async fn dynamodb_prepare_refuses_a_numeric_lease_key() {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    let live = live_or_skip!();
    let table = support::unique_name("leases");
    live.dynamodb
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("leaseKey")
                .attribute_type(ScalarAttributeType::N)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("leaseKey")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .expect("CreateTable");
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    let message = schema_error(store.prepare().await.unwrap_err());
    assert!(message.contains(&table), "{message}");
    assert!(message.contains("`leaseKey` is of type N"), "{message}");
    assert!(message.contains("expected `leaseKey` (S)"), "{message}");
    live.delete_table(&table).await;
}

#[tokio::test]
async fn dynamodb_prepare_refuses_a_range_key() {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    let live = live_or_skip!();
    let table = support::unique_name("leases");
    let definition = |name: &str| {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .unwrap()
    };
    let key = |name: &str, key_type| {
        KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(key_type)
            .build()
            .unwrap()
    };
    live.dynamodb
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(definition("leaseKey"))
        .attribute_definitions(definition("owner"))
        .key_schema(key("leaseKey", KeyType::Hash))
        .key_schema(key("owner", KeyType::Range))
        .send()
        .await
        .expect("CreateTable");
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    let message = schema_error(store.prepare().await.unwrap_err());
    assert!(message.contains(&table), "{message}");
    assert!(message.contains("range key `owner`"), "{message}");
    live.delete_table(&table).await;
}

#[tokio::test]
async fn dynamodb_prepare_without_create_fails_on_a_missing_table() {
    let live = live_or_skip!();
    let table = support::unique_name("missing");
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table).create_if_missing(false);
    let message = schema_error(store.prepare().await.unwrap_err());
    assert!(message.contains(&table), "{message}");
    assert!(message.contains("does not exist"), "{message}");
    assert!(message.contains("`leaseKey` (S)"), "{message}");
    // Nothing was created.
    let tables = live.dynamodb.list_tables().send().await.unwrap();
    assert!(!tables.table_names().contains(&table));
}

#[tokio::test]
async fn dynamodb_unreadable_row_is_corrupt_naming_row_and_attribute() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let live = live_or_skip!();
    let table = support::unique_name("leases");
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    store.prepare().await.unwrap();
    let stream = stream_name();
    assert!(store.create(&new_lease(&stream, SHARD)).await.unwrap());
    let key = format!("{stream}#{SHARD}");
    live.dynamodb
        .update_item()
        .table_name(&table)
        .key("leaseKey", AttributeValue::S(key.clone()))
        .update_expression("SET #c = :bad")
        .expression_attribute_names("#c", "leaseCounter")
        .expression_attribute_values(":bad", AttributeValue::S("many".into()))
        .send()
        .await
        .unwrap();
    for err in [
        store.list(&stream).await.unwrap_err(),
        store.get(&stream, SHARD).await.unwrap_err(),
    ] {
        assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains(&key) && message.contains("`leaseCounter`"),
            "{message}"
        );
    }
    live.delete_table(&table).await;
}

#[tokio::test]
async fn dynamodb_an_unreachable_table_is_a_dynamodb_error() {
    let live = live_or_skip!();
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), support::unique_name("absent"));
    // No prepare: the table does not exist, so every call fails as a DynamoDB error naming it.
    let err = store.get("s", SHARD).await.unwrap_err();
    match &err {
        Error::DynamoDb { operation, .. } => assert_eq!(*operation, "GetItem"),
        other => panic!("expected DynamoDb, got {other:?}"),
    }
}

/// Every call to the lease table is bounded (issue 57, defect 7): through a proxy that accepts
/// connections and forwards nothing (a half-open connection, a peer that stopped answering),
/// each call the manager makes returns an error within the store's call timeout instead of
/// waiting for as long as the socket lives (the SDK sets no read or operation timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb_every_call_fails_within_the_call_timeout_when_the_connection_stalls() {
    use futures::future::BoxFuture;
    use shardwise::lease::CALL_TIMEOUT;
    use support::proxy::Proxy;

    let live = live_or_skip!();
    let table = support::unique_name("stall");
    let endpoint = std::env::var("AWS_ENDPOINT_URL_DYNAMODB").unwrap();
    let proxy = Proxy::start(&endpoint).await;
    let store = DynamoDbLeaseStore::new(proxy.dynamodb().await, &table);
    store.prepare().await.expect("prepare creates the table");
    let stream = stream_name();
    let (seen, held) = held(&store, &stream, "a").await;
    assert!(store.request(&seen, "b").await.unwrap());
    let seen = row(&store, &stream).await;

    proxy.stall();
    let started = std::time::Instant::now();
    let to = at(SEQ_56, 0);
    let calls: Vec<(&str, BoxFuture<'_, Result<(), Error>>)> = vec![
        (
            "list (Scan)",
            Box::pin(async { store.list(&stream).await.map(drop) }),
        ),
        (
            "get",
            Box::pin(async { store.get(&stream, SHARD).await.map(drop) }),
        ),
        (
            "take",
            Box::pin(async { store.take(&seen, "c").await.map(drop) }),
        ),
        (
            "renew",
            Box::pin(async { store.renew(&held).await.map(drop) }),
        ),
        (
            "checkpoint",
            Box::pin(async { store.checkpoint(&held, &to, None).await.map(drop) }),
        ),
        (
            "request",
            Box::pin(async { store.request(&seen, "c").await.map(drop) }),
        ),
        (
            "acknowledge",
            Box::pin(async { store.acknowledge(&held, "b").await.map(drop) }),
        ),
        (
            "pass",
            Box::pin(async { store.pass(&held, "b").await.map(drop) }),
        ),
        (
            "release",
            Box::pin(async { store.release(&held).await.map(drop) }),
        ),
        (
            "beat",
            Box::pin(async { store.beat(&stream, 0, "a", 7, false).await.map(drop) }),
        ),
        (
            "read_roster",
            Box::pin(async { store.read_roster(&stream, &[0]).await.map(drop) }),
        ),
        (
            "forget",
            Box::pin(async { store.forget(&stream, 0, "z", None).await.map(drop) }),
        ),
        (
            "membership",
            Box::pin(async { store.membership(&stream).await.map(drop) }),
        ),
    ];
    let limit = CALL_TIMEOUT + Duration::from_secs(10);
    let answers = join_all(
        calls
            .into_iter()
            .map(|(name, call)| async move { (name, tokio::time::timeout(limit, call).await) }),
    )
    .await;
    let took = started.elapsed();
    for (name, answer) in &answers {
        match answer {
            Ok(Err(_)) => {}
            Ok(Ok(())) => panic!("{name} succeeded through a stalled connection"),
            Err(_) => panic!("{name} was still waiting after {limit:?}: the call is unbounded"),
        }
    }
    assert!(took <= limit, "the calls took {took:?}");
    live.delete_table(&table).await;
}
