// The Node.js runner of `shardwise consume --lambda-handler MODULE.FUNCTION --lambda-runtime node`.
//
// shardwise runs it (embedded in the binary, handed over in SHARDWISE_RUNNER_CODE and started with
// `node -e`) as each of its --exec children, in the function's directory (--lambda-dir). It loads
// MODULE.js, .mjs or .cjs as Lambda's Node.js runtime does (CommonJS or ES module; MODULE may hold
// slashes, FUNCTION dots) and calls FUNCTION(event, context, callback) once per batch, one batch at
// a time, speaking `--exec-format lambda` on stdin and stdout:
//
//   in:  {"id": B, "event": {"Records": [...]}, "records": [...]}
//   out: {"id": B, "response": <what the function returned>}
//        {"id": B, "error": {"errorType": ..., "errorMessage": ..., "trace": [...]}}   (it threw)
//
// The answer is what an async function's promise resolves to, or what it passed to the callback
// (or context.done, context.succeed, context.fail); a function that neither returns a promise nor
// takes a callback answers null once it returns. stdout carries the protocol alone: what the
// function writes there (console.log included) goes to stderr, which shardwise passes to its log.
// Other lines (the shutdown notice {"shutdown": {...}}, anything without an "id") are skipped.
//
// With SHARDWISE_RUNNER_CHECK=1 it loads the function and exits: 0, or 1 with the reason on stderr.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const readline = require('readline');
const { pathToFileURL } = require('url');

// A setting shardwise passed, taken out of the environment the function sees.
function setting(name, fallback) {
  const value = process.env[name];
  delete process.env[name];
  return value === undefined ? fallback : value;
}

const HANDLER = setting('SHARDWISE_RUNNER_HANDLER', '');
const FUNCTION_NAME = setting('SHARDWISE_RUNNER_FUNCTION_NAME', 'shardwise');
const FUNCTION_ARN = setting('SHARDWISE_RUNNER_FUNCTION_ARN', '');
const TIMEOUT_MS = Number(setting('SHARDWISE_RUNNER_TIMEOUT_MS', '900000'));
const CHECK = setting('SHARDWISE_RUNNER_CHECK', '') === '1';
setting('SHARDWISE_RUNNER_CODE');
// `import()` from the launcher's `node -e` context: code run by `vm` cannot import by itself.
const importModule = globalThis.shardwiseImport || ((url) => import(url));
delete globalThis.shardwiseImport;

// The protocol keeps the real stdout; everything else written to stdout goes to stderr.
const answer = process.stdout.write.bind(process.stdout);
process.stdout.write = process.stderr.write.bind(process.stderr);

// The function `handler` names, loaded as Lambda's Node.js runtime loads it.
async function load(handler) {
  const slash = handler.lastIndexOf('/');
  const base = handler.slice(slash + 1);
  const dot = base.indexOf('.');
  if (dot < 1 || dot === base.length - 1) {
    throw new Error(
      `Bad handler '${handler}': expected MODULE.FUNCTION, as Lambda names it (index.handler)`,
    );
  }
  const name = handler.slice(0, slash + 1) + base.slice(0, dot);
  const stem = path.resolve(process.cwd(), name);
  const file = ['.js', '.mjs', '.cjs'].map((ext) => stem + ext).find((f) => fs.existsSync(f));
  if (!file) {
    throw new Error(`Cannot find module '${name}' (.js, .mjs or .cjs) in ${process.cwd()}`);
  }
  let module;
  if (file.endsWith('.mjs')) {
    module = await importModule(pathToFileURL(file).href);
  } else {
    try {
      module = require(file);
    } catch (e) {
      if (e.code !== 'ERR_REQUIRE_ESM' && e.code !== 'ERR_REQUIRE_ASYNC_MODULE') throw e;
      module = await importModule(pathToFileURL(file).href);
    }
  }
  const find = (root) =>
    base
      .slice(dot + 1)
      .split('.')
      .reduce((at, part) => (at == null ? undefined : at[part]), root);
  let fn = find(module);
  if (typeof fn !== 'function' && module && module.default) fn = find(module.default);
  if (typeof fn !== 'function') {
    throw new Error(`${handler} is undefined or not exported`);
  }
  return fn;
}

// The `context` Lambda's Node.js runtime passes, with the same field names.
function contextFor(requestId, logStreamName) {
  const deadline = Date.now() + TIMEOUT_MS;
  return {
    callbackWaitsForEmptyEventLoop: true,
    functionName: FUNCTION_NAME,
    functionVersion: process.env.AWS_LAMBDA_FUNCTION_VERSION || '$LATEST',
    invokedFunctionArn: FUNCTION_ARN,
    memoryLimitInMB: process.env.AWS_LAMBDA_FUNCTION_MEMORY_SIZE || '128',
    awsRequestId: requestId,
    logGroupName: `/aws/lambda/${FUNCTION_NAME}`,
    logStreamName,
    identity: undefined,
    clientContext: undefined,
    getRemainingTimeInMillis: () => Math.max(0, deadline - Date.now()),
  };
}

// What the function answers for one event: its promise's value, or its callback's.
function invoke(fn, event, context) {
  return new Promise((resolve, reject) => {
    let settled = false;
    const callback = (err, result) => {
      if (settled) return;
      settled = true;
      if (err !== undefined && err !== null) reject(err);
      else resolve(result === undefined ? null : result);
    };
    context.done = callback;
    context.succeed = (result) => callback(null, result);
    context.fail = (err) => callback(err == null ? new Error('context.fail') : err);
    let returned;
    try {
      returned = fn(event, context, callback);
    } catch (e) {
      callback(e == null ? new Error('threw') : e);
      return;
    }
    if (returned && typeof returned.then === 'function') {
      returned.then(
        (result) => callback(null, result),
        (e) => callback(e == null ? new Error('rejected') : e),
      );
    } else if (fn.length < 3) {
      setImmediate(() => callback(null, null));
    }
  });
}

function errorOf(e) {
  if (e instanceof Error) {
    return {
      errorType: e.name || 'Error',
      errorMessage: e.message,
      trace: String(e.stack || '').split('\n'),
    };
  }
  return { errorType: typeof e, errorMessage: String(e), trace: [] };
}

async function handle(fn, line, logStreamName) {
  let request;
  try {
    request = JSON.parse(line);
  } catch (e) {
    return;
  }
  if (!request || typeof request !== 'object' || !('id' in request) || !('event' in request)) {
    return;
  }
  const requestId = crypto.randomUUID();
  let text;
  try {
    const result = await invoke(fn, request.event, contextFor(requestId, logStreamName));
    try {
      text = JSON.stringify({ id: request.id, response: result });
    } catch (e) {
      console.error(`ERROR\tRuntime.MarshalError\t${e}`);
      const error = errorOf(e);
      error.errorType = 'Runtime.MarshalError';
      text = JSON.stringify({ id: request.id, error });
    }
  } catch (e) {
    console.error(`ERROR\tInvoke Error\t${requestId}`, e);
    text = JSON.stringify({ id: request.id, error: errorOf(e) });
  }
  answer(text + '\n');
}

async function main() {
  let fn;
  try {
    fn = await load(HANDLER);
  } catch (e) {
    console.error(e);
    console.error(
      `shardwise lambda runner: cannot load handler '${HANDLER}' from ${process.cwd()}`,
    );
    process.exit(1);
  }
  if (CHECK) process.exit(0);
  const day = new Date().toISOString().slice(0, 10).replace(/-/g, '/');
  const version = process.env.AWS_LAMBDA_FUNCTION_VERSION || '$LATEST';
  const logStreamName = `${day}/[${version}]${crypto.randomBytes(16).toString('hex')}`;
  // One event at a time, in the order they came, as one Lambda instance takes them.
  let queue = Promise.resolve();
  const lines = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
  lines.on('line', (line) => {
    queue = queue.then(() => handle(fn, line, logStreamName));
  });
  lines.on('close', () => queue.then(() => process.exit(0)));
}

main();
