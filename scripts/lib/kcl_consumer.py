#!/usr/bin/env python3
"""A KCL application for cli/tests/kcl_live.rs: kcl-rs (PyPI, a Rust port of KCL 3.x with KCL's
own lease table) consumes a stream and checkpoints where the test says, so that
`shardwise import-kcl` has a real KCL lease table to read.

Usage:
  kcl_consumer.py --stream S --app A --plan JSON [--initial-position TRIM_HORIZON|LATEST|AT_TIMESTAMP
                  [--timestamp EPOCH_SECONDS]] [--stream-identifier ACCOUNT:STREAM:EPOCH]
                  [--hold] [--timeout SECONDS]

The plan says, per shard id, what the KCL record processor of that shard does:
  {"shardId-000000000000": {"checkpoint_after": 7, "pending_after": 12, "end": false}}
  checkpoint_after N  handle (print) the first N records the shard delivers, then checkpoint at the
                      N-th one, with its sequence and sub-sequence number (mid-aggregate when it is
                      a KPL sub-record), and handle nothing after it
  pending_after M     (M > N) at the M-th record, a prepared checkpoint that is never committed
                      (KCL's pendingCheckpoint)
  end                 checkpoint SHARD_END when the shard ends (else the row never reaches it)
Shards not in the plan are read and nothing is handled or checkpointed.

Prints one JSON object per line on stdout: `record` (shard, sequence, subsequence, data),
`checkpoint` and `pending` (shard, sequence, subsequence), `ended` (shard), then `done` once every
shard of the plan got there. Without --hold it then shuts the scheduler down gracefully and exits
0; with --hold it keeps running (the leases stay held and renewed) until SIGTERM. Exits 2 after
--timeout seconds without `done`.

Endpoints, region and credentials come from the standard AWS variables (scripts/emulators env);
kcl-rs reads AWS_ENDPOINT_URL_KINESIS and AWS_ENDPOINT_URL_DYNAMODB like every Rust AWS SDK client.
Its CloudWatch metrics go to AWS_ENDPOINT_URL_CLOUDWATCH, which defaults here to the DynamoDB
endpoint (moto answers CloudWatch too). Polling retrieval: kinesis-mock's fan-out is not what KCL
is tested against here.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time


def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", required=True)
    parser.add_argument("--app", required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--initial-position", default="TRIM_HORIZON")
    parser.add_argument("--timestamp", type=float)
    parser.add_argument("--stream-identifier")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()

    if os.environ.get("AWS_ENDPOINT_URL_DYNAMODB"):
        os.environ.setdefault("AWS_ENDPOINT_URL_CLOUDWATCH", os.environ["AWS_ENDPOINT_URL_DYNAMODB"])

    import kcl_rs  # after the environment is set

    plan = json.loads(args.plan)
    lock = threading.Lock()
    reached = {shard: set() for shard in plan}
    all_done = threading.Event()

    def wanted(shard):
        step = plan[shard]
        goals = {"checkpoint"}
        if step.get("pending_after"):
            goals.add("pending")
        if step.get("end"):
            goals.add("ended")
        return goals

    def reach(shard, goal):
        with lock:
            reached[shard].add(goal)
            if all(wanted(s) <= reached[s] for s in plan):
                all_done.set()

    class Processor(kcl_rs.RecordProcessorBase):
        def __init__(self):
            self.shard = None
            self.seen = 0

        def initialize(self, initialize_input):
            # The shard id alone, also should a multi-stream port hand over the whole lease key.
            self.shard = (initialize_input.shard_id or "").rsplit(":", 1)[-1]

        def process_records(self, process_records_input):
            step = plan.get(self.shard)
            if step is None:
                return
            checkpoint_after = step["checkpoint_after"]
            pending_after = step.get("pending_after") or 0
            checkpointer = process_records_input.checkpointer
            for record in process_records_input.records:
                self.seen += 1
                seq, sub = record.sequence_number, record.sub_sequence_number
                if self.seen <= checkpoint_after:
                    emit(
                        event="record",
                        shard=self.shard,
                        sequence=seq,
                        subsequence=sub,
                        data=record.data.decode("utf-8", "replace"),
                    )
                if self.seen == checkpoint_after:
                    checkpointer.checkpoint(sequence_number=seq, sub_sequence_number=sub)
                    emit(event="checkpoint", shard=self.shard, sequence=seq, subsequence=sub)
                    reach(self.shard, "checkpoint")
                if self.seen == pending_after:
                    checkpointer.prepare_checkpoint(sequence_number=seq, sub_sequence_number=sub)
                    emit(event="pending", shard=self.shard, sequence=seq, subsequence=sub)
                    reach(self.shard, "pending")

        def lease_lost(self, lease_lost_input):
            pass

        def shard_ended(self, shard_ended_input):
            step = plan.get(self.shard)
            if step and step.get("end"):
                shard_ended_input.checkpointer.checkpoint()
                emit(event="ended", shard=self.shard)
                reach(self.shard, "ended")

        def shutdown_requested(self, shutdown_requested_input):
            # No checkpoint: the table keeps exactly the checkpoints of the plan.
            pass

    options = dict(
        application_name=args.app,
        record_processor_factory=Processor,
        worker_identifier="kcl-" + str(os.getpid()),
        region=os.environ.get("AWS_REGION", "us-east-1"),
        initial_position=args.initial_position,
        retrieval_mode="POLLING",
        idle_time_between_reads_millis=200,
        shard_sync_interval_millis=2000,
    )
    if args.timestamp is not None:
        options["timestamp"] = args.timestamp
    if args.stream_identifier:
        options["stream_identifiers"] = [args.stream_identifier]
    else:
        options["stream_name"] = args.stream
    scheduler = kcl_rs.Scheduler(**options)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    started = time.monotonic()
    scheduler.start()
    emit(event="started")
    while not all_done.is_set() and not stop.is_set():
        if time.monotonic() - started > args.timeout:
            with lock:
                missing = {s: sorted(wanted(s) - reached[s]) for s in plan if wanted(s) - reached[s]}
            sys.stderr.write("kcl_consumer: timed out; missing: %s\n" % json.dumps(missing))
            scheduler.shutdown()
            return 2
        all_done.wait(0.1)
    if all_done.is_set():
        emit(event="done", seconds=round(time.monotonic() - started, 3))
    if args.hold:
        while not stop.is_set():
            stop.wait(0.1)
    scheduler.shutdown()
    emit(event="stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
