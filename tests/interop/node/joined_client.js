'use strict';
// A @grpc/grpc-js client on ONE long-lived connection, for recordings that join it mid-stream
// (tests/test_capture_joined.py). It makes a first batch of calls, says so, waits for a line on stdin
// (the test starts the recorder meanwhile), makes a second batch on the same connection and prints
// its own log: which method each call used and the request bytes it sent.
//
//   node joined_client.js --target 127.0.0.1:PORT --plan plan.json [--watchdog-ms 30000]
//
// plan.json: {"before": [CALL, ...], "after": [CALL, ...]}, CALL = {"method": "/pkg.Svc/Method",
// "kind": "unary" | "bidi", "requests": [base64, ...]} (a unary call has exactly one request). Messages
// are raw bytes with identity serializers: the test serializes them, no .proto is needed here.
//
// stdout, one JSON object a line: {"phase": "before", "done": N} once the first batch is answered,
// then {"calls": [{"phase", "method", "kind", "requests": [base64], "responses": n, "code": c}, ...]}
// at the end; {"fatal": "..."} on a failure.

const grpc = require('@grpc/grpc-js');
const readline = require('readline');

function parseArgs(argv) {
  const opts = { target: null, plan: null, watchdogMs: 30000 };
  for (let i = 0; i < argv.length; i += 2) {
    const [key, value] = [argv[i], argv[i + 1]];
    if (key === '--target') opts.target = value;
    else if (key === '--plan') opts.plan = value;
    else if (key === '--watchdog-ms') opts.watchdogMs = Number(value);
    else throw new Error(`unknown argument ${key}`);
  }
  if (!opts.target || !opts.plan) throw new Error('--target HOST:PORT and --plan FILE are required');
  return opts;
}

const identity = (b) => b;
const deadlineIn = (ms) => new Date(Date.now() + ms);
const emit = (obj) => process.stdout.write(`${JSON.stringify(obj)}\n`);

function unary(client, call) {
  return new Promise((resolve) => {
    const [request] = call.requests;
    client.makeUnaryRequest(call.method, identity, identity, request, new grpc.Metadata(),
      { deadline: deadlineIn(10000) }, (err, response) => {
        resolve({ responses: err ? 0 : 1, code: err ? err.code : grpc.status.OK });
      });
  });
}

function bidi(client, call) {
  return new Promise((resolve) => {
    const stream = client.makeBidiStreamRequest(call.method, identity, identity, new grpc.Metadata(),
      { deadline: deadlineIn(10000) });
    let responses = 0;
    stream.on('data', () => { responses += 1; });
    stream.on('error', () => {});  // the status event says how it ended
    stream.on('status', (status) => resolve({ responses, code: status.code }));
    for (const request of call.requests) stream.write(request);
    stream.end();
  });
}

async function runBatch(client, phase, calls, log) {
  for (const call of calls) {
    const spec = { ...call, requests: call.requests.map((b) => Buffer.from(b, 'base64')) };
    const result = await (call.kind === 'bidi' ? bidi(client, spec) : unary(client, spec));
    log.push({ phase, method: call.method, kind: call.kind, requests: call.requests, ...result });
  }
}

function firstLine() {
  return new Promise((resolve) => {
    const rl = readline.createInterface({ input: process.stdin });
    rl.once('line', (line) => {
      rl.close();
      process.stdin.destroy();  // an open stdin would keep node running after the last call
      resolve(line);
    });
    rl.once('close', () => resolve(null));
  });
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const watchdog = setTimeout(() => {
    emit({ fatal: `watchdog: not done after ${opts.watchdogMs} ms` });
    process.exit(3);
  }, opts.watchdogMs);
  const plan = JSON.parse(require('fs').readFileSync(opts.plan, 'utf8'));
  // One client object, one subchannel of its own: every call below shares one HTTP/2 connection.
  const client = new grpc.Client(opts.target, grpc.credentials.createInsecure(),
    { 'grpc.use_local_subchannel_pool': 1 });
  const log = [];
  await runBatch(client, 'before', plan.before, log);
  emit({ phase: 'before', done: log.length });
  await firstLine();
  await runBatch(client, 'after', plan.after, log);
  client.close();
  clearTimeout(watchdog);
  emit({ calls: log });
}

main().catch((err) => {
  emit({ fatal: String(err && err.stack ? err.stack : err) });
  process.exit(2);
});
