"""The Python runner of `shardwise consume --lambda-handler MODULE.FUNCTION --lambda-runtime python`.

shardwise runs it (embedded in the binary, handed over in SHARDWISE_RUNNER_CODE and started with
`python3 -u -c`) as each of its --exec children, in the function's directory (--lambda-dir). It
imports MODULE as Lambda's Python runtime does (MODULE may be a dotted or slashed path under that
directory) and calls FUNCTION(event, context) once per batch, one batch at a time, speaking
`--exec-format lambda` on stdin and stdout:

    in:  {"id": B, "event": {"Records": [...]}, "records": [...]}
    out: {"id": B, "response": <what the function returned>}
         {"id": B, "error": {"errorType": ..., "errorMessage": ..., ...}}   (the function raised)

stdout carries the protocol alone: whatever the function prints (on sys.stdout or file
descriptor 1, programs it starts included) goes to stderr, which shardwise passes to its log.
Other lines (the shutdown notice {"shutdown": {...}}, anything without an "id") are skipped.

With SHARDWISE_RUNNER_CHECK=1 it loads the function and exits: 0, or 1 with the reason on stderr.
"""

import datetime
import importlib
import json
import os
import secrets
import sys
import time
import traceback
import uuid


def setting(name, default):
    """A setting shardwise passed, taken out of the environment the function sees."""
    return os.environ.pop(name, default)


HANDLER = setting("SHARDWISE_RUNNER_HANDLER", "")
FUNCTION_NAME = setting("SHARDWISE_RUNNER_FUNCTION_NAME", "shardwise")
FUNCTION_ARN = setting("SHARDWISE_RUNNER_FUNCTION_ARN", "")
TIMEOUT_MS = int(setting("SHARDWISE_RUNNER_TIMEOUT_MS", "900000"))
CHECK = setting("SHARDWISE_RUNNER_CHECK", "") == "1"
setting("SHARDWISE_RUNNER_CODE", None)


class LambdaContext:
    """The `context` Lambda's Python runtime passes, with the same attribute names."""

    def __init__(self, request_id, log_stream_name):
        self.function_name = FUNCTION_NAME
        self.function_version = os.environ.get("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST")
        self.invoked_function_arn = FUNCTION_ARN
        self.memory_limit_in_mb = os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128")
        self.aws_request_id = request_id
        self.log_group_name = "/aws/lambda/" + FUNCTION_NAME
        self.log_stream_name = log_stream_name
        self.identity = None
        self.client_context = None
        self.tenant_id = None
        self._deadline_ms = time.time() * 1000 + TIMEOUT_MS

    def get_remaining_time_in_millis(self):
        """Milliseconds left of the handler timeout (--handler-timeout, else Lambda's 15 minutes)."""
        return max(0, int(self._deadline_ms - time.time() * 1000))

    def __repr__(self):
        return "LambdaContext(function_name=%r, aws_request_id=%r)" % (
            self.function_name,
            self.aws_request_id,
        )


def load(handler):
    """The function `handler` names, imported as Lambda's Python runtime imports it."""
    module_name, _, function_name = handler.rpartition(".")
    if not module_name or not function_name:
        raise ValueError(
            "Bad handler '%s': expected MODULE.FUNCTION, as Lambda names it "
            "(lambda_function.lambda_handler)" % handler
        )
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name.replace("/", "."))
    function = getattr(module, function_name, None)
    if not callable(function):
        raise AttributeError(
            "Handler '%s' missing on module '%s'" % (function_name, module_name)
        )
    return function


def error_of(e, request_id):
    """An exception as Lambda reports a function error."""
    return {
        "errorType": type(e).__name__,
        "errorMessage": str(e),
        "requestId": request_id,
        "stackTrace": traceback.format_tb(e.__traceback__),
    }


def invoke(function, request, log_stream_name):
    """The answer line to one request."""
    request_id = str(uuid.uuid4())
    context = LambdaContext(request_id, log_stream_name)
    try:
        result = function(request["event"], context)
    except (Exception, SystemExit) as e:
        print("[ERROR] %s: %s" % (type(e).__name__, e), file=sys.stderr)
        traceback.print_exc()
        return json.dumps({"id": request["id"], "error": error_of(e, request_id)})
    try:
        return json.dumps({"id": request["id"], "response": result})
    except (TypeError, ValueError) as e:
        print("[ERROR] Runtime.MarshalError: %s" % e, file=sys.stderr)
        error = error_of(e, request_id)
        error["errorType"] = "Runtime.MarshalError"
        return json.dumps({"id": request["id"], "error": error})


def main():
    # The protocol keeps the real stdout; file descriptor 1 becomes stderr, so that nothing the
    # function prints can be taken for an answer.
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        function = load(HANDLER)
    except (Exception, SystemExit):
        traceback.print_exc()
        print(
            "shardwise lambda runner: cannot load handler %r from %s" % (HANDLER, os.getcwd()),
            file=sys.stderr,
        )
        sys.exit(1)
    if CHECK:
        return
    log_stream_name = "%s/[%s]%s" % (
        datetime.date.today().strftime("%Y/%m/%d"),
        os.environ.get("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST"),
        secrets.token_hex(16),
    )
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if not isinstance(request, dict) or "id" not in request or "event" not in request:
            continue
        protocol.write(invoke(function, request, log_stream_name) + "\n")
        protocol.flush()


if __name__ == "__main__":
    main()
