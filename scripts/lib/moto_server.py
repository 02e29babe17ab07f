"""moto's server, with each DynamoDB table used by one request at a time, no memory kept per
object ever created, and a cheaper backup in DynamoDB TransactWriteItems.

Started by scripts/emulators in place of moto's `moto_server` entry point, with the same
arguments. Three facts about moto 5.2.5 measured here (README, "Emulator facts"):

- Its server runs each request on its own thread, but its DynamoDB backend is not thread-safe:
  TransactWriteItems deep-copies the tables it touches for rollback while other requests write to
  them ("RuntimeError: dictionary changed size during iteration", answered as HTTP 500), and a
  rollback restores that copy over whatever other requests wrote meanwhile. DynamoDB applies each
  request atomically; here a request holds a lock on each table it names (in name order, so two
  requests never wait on each other crosswise), and requests that create, delete or list tables,
  or name none, hold the catalogue's lock too. Requests on other tables run meanwhile: a lease
  renewal does not wait behind a 100-action transaction on an effect table. Requests to other
  services take one lock per service.
- TransactWriteItems backs up a table once per action that touches it (every item copied, again
  for each action), so a transaction of n actions on a table of m items costs n * m item copies.
  The backups are identical: they are all taken before any action is applied. Here a table's
  first backup in a transaction serves its later actions too, so the rollback is exactly what it
  was and a 100-action transaction costs one copy per table.
- Every model object it creates is appended to a class-level list for its dashboard and never
  released: each item a write creates, each copy a read returns, each table backup above. Two
  tables of 5,000 items grown by 50-record transactions held 2.7 million objects and 420 MB; a
  working session of tests, with 10,000-record receipt runs among them, grew the server to
  16.8 GB. Here model objects are not tracked (the dashboard shows nothing; nothing else reads
  that list).
"""

import copy
import io
import json
import sys
import threading

from moto.core.common_models import BaseModel
from moto.dynamodb.models import DynamoDBBackend
from moto.dynamodb.models.table import Table
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.server import main

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_dispatch = DomainDispatcherApplication.__call__
_CATALOGUE = "\0catalogue"
_CATALOGUE_OPERATIONS = {"CreateTable", "DeleteTable", "ListTables"}


def _lock(name):
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


def _names(environ):
    """What a request touches: its DynamoDB tables (plus the catalogue), or its service. Reads the
    body and puts it back for moto."""
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    service, _, operation = target.partition(".")
    if not service.startswith("DynamoDB_"):
        return {"\0service:" + (service or environ.get("PATH_INFO", ""))}
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length) if length else b""
    environ["wsgi.input"] = io.BytesIO(body)
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        request = {}
    names = set()
    if isinstance(request.get("TableName"), str):
        names.add(request["TableName"])
    for item in request.get("TransactItems") or []:
        for action in item.values():
            if isinstance(action, dict) and isinstance(action.get("TableName"), str):
                names.add(action["TableName"])
    names.update(name for name in request.get("RequestItems") or {} if isinstance(name, str))
    if not names or operation in _CATALOGUE_OPERATIONS:
        names.add(_CATALOGUE)
    return names


def _dispatch_locked(self, environ, start_response):
    locks = [_lock(name) for name in sorted(_names(environ))]
    for lock in locks:
        lock.acquire()
    try:
        body = _dispatch(self, environ, start_response)
        try:
            return [b"".join(body)]
        finally:
            if hasattr(body, "close"):
                body.close()
    finally:
        for lock in reversed(locks):
            lock.release()


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
DomainDispatcherApplication.__call__ = _dispatch_locked
DynamoDBBackend.transact_write_items = _transact_write_items_backing_up_once
Table.__deepcopy__ = _table_deepcopy

if __name__ == "__main__":
    sys.exit(main())
