#!/usr/bin/env python3
"""A shardwise handler in Python, run by `shardwise consume --exec`.

    shardwise consume --stream orders --app billing --lanes 4 \
        --exec 'python3 examples/exec_handler.py'

shardwise writes one JSON object per delivery on this program's stdin, one per line:

    {"id": 17, "stream": "orders", "shard": "shardId-000000000000",
     "sequence": "4959...", "subsequence": 0, "partition_key": "key-3",
     "attempt": 1, "idempotency_key": "kinesis/orders/shardId-000000000000/4959....0",
     "origin": {...}, "arrived_ms": 1764452220123, "data": "{\"id\":7}"}

(`data_b64` instead of `data` when the payload is not UTF-8), and reads one answer per line on
stdout, naming the delivery by its `id`:

    {"id": 17, "outcome": "ack"}

An outcome is "ack", "drop", "retry", {"retry_after_ms": N}, or with --receipts
{"hold": "reason"} or {"quarantine": "reason"}. With `--batch N` a line carries a batch,
{"id": B, "batch": [delivery, ...]}, answered with
{"id": B, "outcomes": [{"id": ..., "outcome": ...}, ...]} (a delivery left out is retried).
When the worker starts shutting down, a line {"shutdown": {"deadline_ms": N}} comes first; this
program skips it, and any other line without an "id".

Anything else goes to stderr, which shardwise passes to its log. If this program exits, hangs
past --handler-timeout or prints something that is not an answer, shardwise starts it again
and sends it the deliveries it left unanswered: nothing is lost, and nothing needs saving here.

This example acks records whose payload is JSON with an "id", drops any other payload (a poison
record passes), and retries a record whose "id" is listed in HANDLER_RETRY_IDS on its first
attempt. HANDLER_DELAY_MS adds that much work per record.
"""

import json
import os
import sys
import time

DELAY = int(os.environ.get("HANDLER_DELAY_MS", "0")) / 1000.0
RETRY_IDS = {s for s in os.environ.get("HANDLER_RETRY_IDS", "").split(",") if s}


def handle(delivery):
    """The outcome of one delivery."""
    try:
        record = json.loads(delivery.get("data", ""))
    except ValueError:
        print(f"dropping a payload that is not JSON at {delivery.get('sequence')}", file=sys.stderr)
        return "drop"
    if not isinstance(record, dict) or "id" not in record:
        return "drop"
    if DELAY:
        time.sleep(DELAY)
    if str(record["id"]) in RETRY_IDS and delivery["attempt"] == 1:
        return "retry"
    return "ack"


def main():
    print(f"exec_handler.py started (child {os.environ.get('SHARDWISE_CHILD')})", file=sys.stderr)
    for line in sys.stdin:
        request = json.loads(line)
        if "id" not in request:
            continue
        if "batch" in request:
            outcomes = [{"id": d["id"], "outcome": handle(d)} for d in request["batch"]]
            answer = {"id": request["id"], "outcomes": outcomes}
        else:
            answer = {"id": request["id"], "outcome": handle(request)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
