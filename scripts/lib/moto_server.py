"""moto's server, with requests handled one at a time, no memory kept per object ever created,
and a cheaper backup in DynamoDB TransactWriteItems.

Started by scripts/emulators in place of moto's `moto_server` entry point, with the same
arguments. Three facts about moto 5.2.5 measured here (README, "Emulator facts"):

- Its server runs each request on its own thread, but its DynamoDB backend is not thread-safe:
  TransactWriteItems deep-copies the tables it touches for rollback while other requests write to
  them ("RuntimeError: dictionary changed size during iteration", answered as HTTP 500), and a
  rollback restores that copy over whatever other requests wrote meanwhile. DynamoDB applies each
  request atomically; here each request runs alone, under one lock, as a single-threaded server
  would (moto holds Python's global interpreter lock while it works anyway).
- TransactWriteItems backs up a table once per action that touches it (every item copied, again
  for each action), so a transaction of n actions on a table of m items costs n * m item copies.
  The backups are identical: they are all taken before any action is applied. Here a table's
  first backup in a transaction serves its later actions too, so the rollback is exactly what it
  was and a 100-action transaction costs one copy per table.
- Every model object it creates is appended to a class-level list for its dashboard and never
  released: each item a write creates, each copy a read returns, each table backup above. Two
  tables of 5,000 items grown by 50-record transactions held 2.7 million objects and 420 MB; a
  working session of tests, with 10,000-record receipt runs among them, grew the server to 16.8 GB. Here model objects are not tracked (the
  dashboard shows nothing; nothing else reads that list).
"""

import copy
import sys
import threading

from moto.core.common_models import BaseModel
from moto.dynamodb.models import DynamoDBBackend
from moto.dynamodb.models.table import Table
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.server import main

_one_at_a_time = threading.Lock()
_dispatch = DomainDispatcherApplication.__call__


def _dispatch_alone(self, environ, start_response):
    with _one_at_a_time:
        body = _dispatch(self, environ, start_response)
        try:
            return [b"".join(body)]
        finally:
            if hasattr(body, "close"):
                body.close()


_transaction = threading.local()
_transact_write_items = DynamoDBBackend.transact_write_items


def _transact_write_items_backing_up_once(self, transact_items):
    _transaction.backups = {}
    try:
        return _transact_write_items(self, transact_items)
    finally:
        _transaction.backups = None


def _table_deepcopy(self, memo):
    backups = getattr(_transaction, "backups", None)
    if backups is not None and id(self) in backups:
        return backups[id(self)]
    # What copy.deepcopy does for a plain object (Table has no slots or state hooks): a new
    # instance holding a deep copy of the original's attributes.
    result = Table.__new__(type(self))
    memo[id(self)] = result
    for name, value in self.__dict__.items():
        setattr(result, name, copy.deepcopy(value, memo))
    if backups is not None:
        backups[id(self)] = result
    return result


def _new_untracked(cls, *args, **kwargs):
    return super(BaseModel, cls).__new__(cls)


BaseModel.__new__ = staticmethod(_new_untracked)
DomainDispatcherApplication.__call__ = _dispatch_alone
DynamoDBBackend.transact_write_items = _transact_write_items_backing_up_once
Table.__deepcopy__ = _table_deepcopy

if __name__ == "__main__":
    sys.exit(main())
