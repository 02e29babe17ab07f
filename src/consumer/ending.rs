//! When a shard's work is over, and which write ends it. Pure, and tested from a table of cases.
//!
//! A shard ends (SHARD_END is written, its children become eligible) only when it can have no
//! more records for us and every delivery read from it has settled. It stops (the final
//! checkpoint is written and the lease released, so the next owner rereads what did not settle)
//! when the worker is stopping and nothing more will settle here.

/// How reading a shard stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    /// The reader runs (or waits for room in the window).
    Open,
    /// The reader was stopped: the worker is stopping.
    Stopped,
    /// A closed shard was read to its end.
    Closed,
    /// The shard is no longer in the stream: its records aged out of retention before it was read
    /// to its end. Nothing more can be read from it, so it ends once what was read has settled.
    AgedOut,
}

/// What the shard loop knows when it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShardState {
    pub(crate) reading: Reading,
    /// A graceful stop was requested.
    pub(crate) stopping: bool,
    /// The shutdown deadline passed: running handlers and writes were aborted.
    pub(crate) aborted: bool,
    /// Deliveries read and not settled.
    pub(crate) unsettled: usize,
    /// Of those, deliveries that will not settle while this worker holds the shard: refused
    /// retries, and copies whose writes fail for good (a missing stream, a record too large).
    pub(crate) held: usize,
}

/// What the shard loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Keep reading, handling and settling.
    Continue,
    /// Write the final checkpoint over what settled and give the lease back.
    Stop,
    /// Write SHARD_END: every record of the shard has a durable outcome.
    End,
}

pub(crate) fn step(s: &ShardState) -> Step {
    let at_end = matches!(s.reading, Reading::Closed | Reading::AgedOut);
    if at_end && s.unsettled == 0 {
        return Step::End;
    }
    if s.aborted {
        return Step::Stop;
    }
    let nothing_more_settles = s.unsettled == s.held;
    if s.stopping && s.reading != Reading::Open && nothing_more_settles {
        return Step::Stop;
    }
    Step::Continue
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(
        reading: Reading,
        stopping: bool,
        aborted: bool,
        unsettled: usize,
        held: usize,
    ) -> ShardState {
        ShardState {
            reading,
            stopping,
            aborted,
            unsettled,
            held,
        }
    }

    #[test]
    fn table_of_cases() {
        use Reading::*;
        use Step::*;
        // (why, state, expected)
        let cases: &[(&str, ShardState, Step)] = &[
            (
                "reading with work in flight goes on",
                state(Open, false, false, 5, 0),
                Continue,
            ),
            (
                "reading and idle goes on: an open shard never ends",
                state(Open, false, false, 0, 0),
                Continue,
            ),
            (
                "a closed shard read to its end waits for its deliveries",
                state(Closed, false, false, 3, 0),
                Continue,
            ),
            (
                "a closed shard read to its end with everything settled ends",
                state(Closed, false, false, 0, 0),
                End,
            ),
            (
                "a refused retry in a closed shard holds SHARD_END (and the children) back",
                state(Closed, false, false, 1, 1),
                Continue,
            ),
            (
                "an aged-out shard ends once what was read settled",
                state(AgedOut, false, false, 0, 0),
                End,
            ),
            (
                "an aged-out shard waits for what was read",
                state(AgedOut, false, false, 2, 0),
                Continue,
            ),
            (
                "stopping waits for deliveries that can still settle",
                state(Stopped, true, false, 4, 1),
                Continue,
            ),
            (
                "stopping with everything settled stops",
                state(Stopped, true, false, 0, 0),
                Stop,
            ),
            (
                "stopping with only refused retries or stuck writes left stops: the next owner rereads them",
                state(Stopped, true, false, 2, 2),
                Stop,
            ),
            (
                "a stop requested before the reader was told is not final yet",
                state(Open, true, false, 0, 0),
                Continue,
            ),
            (
                "the deadline passed: stop with what settled",
                state(Stopped, true, true, 7, 0),
                Stop,
            ),
            (
                "stopping at the end of a closed shard with everything settled still ends it",
                state(Closed, true, false, 0, 0),
                End,
            ),
            (
                "the deadline passed at the end of a closed shard, everything settled: ends",
                state(Closed, true, true, 0, 0),
                End,
            ),
            (
                "the deadline passed at the end of a closed shard with work left: stop, never end",
                state(Closed, true, true, 1, 0),
                Stop,
            ),
        ];
        for (why, s, expected) in cases {
            assert_eq!(step(s), *expected, "{why}: {s:?}");
        }
    }
}
