// A looprl RewardService written in Node.js, outside looprl: the default recipe's reward (digit
// reversal, partial credit per digit in position plus a bonus for the right length), served over
// gRPC from the contract in protos/looprl/reward/v1/reward.proto (loaded with @grpc/proto-loader),
// with mutual TLS and per-RPC authorization as looprl's own services do, the standard health
// service and server reflection.
//
//   node server.js --port 7000 --tls-dir DIR   (ca.crt, reward.crt, reward.key: `looprl certs DIR`)
//
// The contract's promises (what each field may hold, which status answers what) are the proto
// comments; `looprl conformance reward --address 127.0.0.1:7000 --tls-dir DIR` checks them.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { ReflectionService } = require('@grpc/reflection');
const { HealthImplementation } = require('grpc-health-check');

const SERVICE = 'looprl.reward.v1.RewardService';
const MAX_COMPLETION_CHARS = 1 << 20;
const MAX_BATCH = 1024;
const LENGTH_BONUS = 0.1;

// Who may call what (looprl's table is services/kit/rpc/authz.py; health and reflection are open to
// any certificate of the CA, the handshake having checked it).
const CALLERS = {
  Score: ['environment-sandbox'],
  ScoreBatch: ['environment-sandbox'],
  ListRewards: ['environment-sandbox', 'gateway', 'operator'],
  LoadReward: ['gateway', 'operator'],
};

// ---- the reward ---------------------------------------------------------------------------------

class VerifierError extends Error {}

function codePoints(text) {
  return Array.from(text); // Python's len() and zip() count code points, not UTF-16 units
}

function digitsTarget(task) {
  if ('answer' in task) return String(task.answer);
  if (!('digits' in task)) {
    throw new VerifierError('task_json: has no reference answer (looked for digits)');
  }
  const digits = String(task.digits);
  const op = task.op === undefined ? 'rev' : task.op;
  return op === 'rev' ? codePoints(digits).reverse().join('') : digits;
}

// 0.9 * the fraction of the target's digits answered in position, + 0.1 for the right length.
function digitsPartial(input) {
  const target = codePoints(digitsTarget(input.task));
  if (target.length === 0) throw new VerifierError('task_json.answer: empty');
  const answer = codePoints(input.completion.trim());
  let correct = 0;
  for (let i = 0; i < Math.min(answer.length, target.length); i++) {
    if (answer[i] === target[i]) correct += 1;
  }
  return (0.9 * correct) / target.length + (answer.length === target.length ? LENGTH_BONUS : 0.0);
}

const VERIFIERS = {
  digits_partial: {
    fn: digitsPartial,
    description: 'digits right in position + length bonus',
  },
};
const REWARDS = {
  digits: {
    kind: 'composite',
    parts: [['digits_partial', 1.0]],
    description: 'digits environment: partial credit per digit',
  },
  digits_partial: { kind: 'verifier', parts: [['digits_partial', 1.0]], description: VERIFIERS.digits_partial.description },
};

function score(name, input) {
  const components = REWARDS[name].parts.map(([part, weight]) => {
    try {
      const value = VERIFIERS[part].fn(input);
      return { name: part, score: value, weight, ok: true, reason: '' };
    } catch (err) {
      const reason = err instanceof VerifierError ? err.message : `crashed: ${err.name}: ${err.message}`;
      return { name: part, score: 0.0, weight, ok: false, reason };
    }
  });
  const total = components.filter((c) => c.ok).reduce((sum, c) => sum + c.score * c.weight, 0.0);
  return { score: total, components, ok: components.every((c) => c.ok) };
}

// ---- requests -------------------------------------------------------------------------------------

class Refusal extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

function validated(request, where = '') {
  if (!request.reward) {
    throw new Refusal(grpc.status.INVALID_ARGUMENT, `${where}reward: required (name of a registered reward)`);
  }
  if (!(request.reward in REWARDS)) {
    const known = Object.keys(REWARDS).sort().join(', ');
    throw new Refusal(grpc.status.NOT_FOUND, `${where}reward: unknown reward ${JSON.stringify(request.reward)}; known: ${known}`);
  }
  let task = {};
  if (request.task_json) {
    try {
      task = JSON.parse(request.task_json);
    } catch (err) {
      throw new Refusal(grpc.status.INVALID_ARGUMENT, `${where}task_json: not valid JSON: ${err.message}`);
    }
  }
  if (task === null || typeof task !== 'object' || Array.isArray(task)) {
    throw new Refusal(grpc.status.INVALID_ARGUMENT, `${where}task_json: must be a JSON object`);
  }
  if (codePoints(request.completion).length > MAX_COMPLETION_CHARS) {
    throw new Refusal(grpc.status.INVALID_ARGUMENT, `${where}completion: longer than ${MAX_COMPLETION_CHARS} characters`);
  }
  const hasEnvironmentReward = request._environment_reward === 'environment_reward';
  if (hasEnvironmentReward && !Number.isFinite(request.environment_reward)) {
    throw new Refusal(grpc.status.INVALID_ARGUMENT, `${where}environment_reward: must be finite`);
  }
  return [request.reward, { task, completion: request.completion }];
}

const handlers = {
  Score(request) {
    return score(...validated(request));
  },
  ScoreBatch(request) {
    if (request.requests.length > MAX_BATCH) {
      throw new Refusal(grpc.status.INVALID_ARGUMENT, `requests: ${request.requests.length} requests, at most ${MAX_BATCH} per call`);
    }
    // Every request is validated before any is scored: a bad one fails the call.
    const inputs = request.requests.map((r, i) => validated(r, `requests[${i}].`));
    return { responses: inputs.map((args) => score(...args)) };
  },
  ListRewards() {
    const rewards = Object.keys(REWARDS)
      .sort()
      .map((name) => ({ name, kind: REWARDS[name].kind, description: REWARDS[name].description }));
    return { rewards };
  },
  // The gateway loads a run's reward before the run exists. This service has no plugins: a reward
  // is one of its own, which takes no settings and scores no trials.
  LoadReward(request) {
    if (!request.reward) {
      throw new Refusal(grpc.status.INVALID_ARGUMENT, 'reward: required');
    }
    const reward = REWARDS[request.reward];
    if (reward === undefined) {
      const known = Object.keys(REWARDS).sort().join(', ');
      throw new Refusal(grpc.status.NOT_FOUND, `unknown reward ${JSON.stringify(request.reward)}: this reward service serves ${known}`);
    }
    if (request.config_json) {
      throw new Refusal(grpc.status.INVALID_ARGUMENT, 'reward.config: only a plugin reward takes settings, and this service has none');
    }
    return { reward: { name: request.reward, kind: reward.kind, description: reward.description }, trials: [] };
  },
};

// ---- serving --------------------------------------------------------------------------------------

const MALFORMED = Symbol('malformed');

function callerIdentity(call) {
  const auth = typeof call.getAuthContext === 'function' ? call.getAuthContext() : null;
  const cert = auth && auth.sslPeerCertificate;
  return cert && cert.subject ? cert.subject.CN : null;
}

function serve(method, handler, secure) {
  return (call, callback) => {
    try {
      if (secure) {
        const identity = callerIdentity(call);
        if (!identity) {
          throw new Refusal(grpc.status.UNAUTHENTICATED, `/${SERVICE}/${method}: the caller presented no verified client certificate`);
        }
        if (!CALLERS[method].includes(identity)) {
          throw new Refusal(
            grpc.status.PERMISSION_DENIED,
            `/${SERVICE}/${method}: ${JSON.stringify(identity)} may not call it (allowed: ${CALLERS[method].join(', ')})`,
          );
        }
      }
      if (call.request[MALFORMED] !== undefined) {
        throw new Refusal(grpc.status.INVALID_ARGUMENT, `${method}: malformed request (${call.request[MALFORMED]})`);
      }
      callback(null, handler(call.request));
    } catch (err) {
      if (err instanceof Refusal) {
        callback({ code: err.code, details: err.message });
      } else {
        console.error(`${method} failed:`, err);
        callback({ code: grpc.status.INTERNAL, details: `internal error in ${method}` });
      }
    }
  };
}

// grpc-js answers bytes that do not parse with INTERNAL; the contract says INVALID_ARGUMENT.
function withParseRefusal(definition) {
  const out = {};
  for (const [name, method] of Object.entries(definition)) {
    const deserialize = method.requestDeserialize;
    out[name] = {
      ...method,
      requestDeserialize: (bytes) => {
        try {
          return deserialize(bytes);
        } catch (err) {
          return { [MALFORMED]: err.message };
        }
      },
    };
  }
  return out;
}

function parseArgs(argv) {
  const args = { port: 0, host: '127.0.0.1', tlsDir: process.env.LOOPRL_TLS_DIR || '', identity: 'reward', insecure: false };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const next = () => argv[++i];
    if (flag === '--port') args.port = Number(next());
    else if (flag === '--host') args.host = next();
    else if (flag === '--tls-dir') args.tlsDir = next();
    else if (flag === '--identity') args.identity = next();
    else if (flag === '--insecure') args.insecure = true;
    else throw new Error(`unknown argument ${flag}`);
  }
  return args;
}

function credentials(args) {
  if (args.insecure) {
    console.warn('reward: TLS is OFF (--insecure): no caller is authenticated. Local development only.');
    return grpc.ServerCredentials.createInsecure();
  }
  if (!args.tlsDir) {
    console.error('reward: no certificates: give --tls-dir DIR (ca.crt, reward.crt, reward.key; `looprl certs DIR`) or --insecure');
    process.exit(2);
  }
  const read = (name) => fs.readFileSync(path.join(args.tlsDir, name));
  // Client certificates are required and checked against the CA: mutual TLS.
  return grpc.ServerCredentials.createSsl(
    read('ca.crt'),
    [{ private_key: read(`${args.identity}.key`), cert_chain: read(`${args.identity}.crt`) }],
    true,
  );
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const protos = process.env.LOOPRL_PROTOS || path.resolve(__dirname, '..', '..', 'protos');
  const definition = protoLoader.loadSync('looprl/reward/v1/reward.proto', {
    includeDirs: [protos],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const service = grpc.loadPackageDefinition(definition).looprl.reward.v1.RewardService.service;
  const secure = !args.insecure;
  const server = new grpc.Server();
  const impl = {};
  for (const name of Object.keys(handlers)) impl[name] = serve(name, handlers[name], secure);
  server.addService(withParseRefusal(service), impl);
  const health = new HealthImplementation({ '': 'NOT_SERVING', [SERVICE]: 'NOT_SERVING' });
  health.addToServer(server);
  new ReflectionService(definition).addToServer(server);

  server.bindAsync(`${args.host}:${args.port}`, credentials(args), (err, port) => {
    if (err) {
      console.error(`reward: cannot listen on ${args.host}:${args.port}: ${err.message}`);
      process.exit(1);
    }
    health.setStatus('', 'SERVING');
    health.setStatus(SERVICE, 'SERVING');
    console.log(`ADDRESS ${args.host}:${port}`);
  });

  const stop = () => {
    health.setStatus('', 'NOT_SERVING');
    health.setStatus(SERVICE, 'NOT_SERVING');
    server.tryShutdown(() => process.exit(0));
    setTimeout(() => server.forceShutdown(), 5000).unref();
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main();
