// An agent that publishes articles through the receipt gateway, in
// TypeScript with Node's built-in fetch and nothing else.
//
// The one change from calling the API directly is the base URL: the gateway
// records a receipt before the bytes leave, injects the API's credentials,
// and says after every answer what the agent may do next (the "retry" member
// of its problem documents, or Receipt-Retryable on an upstream refusal):
//
//   2xx                done (the effect exists; a replay says so too)
//   after_settlement   the outcome is unknown: do NOT send it under another
//                      key; long-poll wait_url until the receipt settles,
//                      then send the same Idempotency-Key again
//   same_key           nothing was done: send the same key again after
//                      Retry-After
//   anything else      give up on this call and report it
//
// Build and run (Node 18+; Debian: apt-get install nodejs node-typescript):
//   tsc --strict --target es2020 --module commonjs --lib es2020,dom --outDir out agent.ts
//   GATEWAY_URL=http://127.0.0.1:7070 GATEWAY_TOKEN=... node out/agent.js
//
// Environment: GATEWAY_URL, GATEWAY_TOKEN, GATEWAY_PATH (/blog/articles),
// AGENT_PREFIX (ts), AGENT_CALLS (10), AGENT_CONCURRENCY (4). It prints one
// JSON line at the end: {"done": n, "failed": [...], "sends": n, "waits": n},
// and exits 0 when every call was done, 1 when any failed (2 without a token).

// Node's globals, declared here so the example needs no @types package.
declare const process: {
  env: Record<string, string | undefined>;
  exitCode?: number;
};

const env = process.env;
const BASE = (env.GATEWAY_URL ?? "http://127.0.0.1:7070").replace(/\/+$/, "");
const TOKEN = env.GATEWAY_TOKEN ?? "";
const PATH = env.GATEWAY_PATH ?? "/blog/articles";
const PREFIX = env.AGENT_PREFIX ?? "ts";
const CALLS = Number(env.AGENT_CALLS ?? "10");
const CONCURRENCY = Number(env.AGENT_CONCURRENCY ?? "4");
const MAX_ANSWERS = 30;

/** An RFC 9457 problem document with the gateway's members. */
interface Problem {
  type: string;
  title: string;
  status: number;
  detail?: string;
  retry: "no" | "same_key" | "after_settlement" | "after_review";
  receipt_id?: number;
  receipt_state?: string;
  wait_url?: string;
}

interface Report {
  done: number;
  failed: string[];
  sends: number;
  waits: number;
}

/** Escapes a part of a key as the Go ledger's Key does. */
function keyPart(s: string): string {
  return s.replace(/%/g, "%25").replace(/:/g, "%3A").replace(/#/g, "%23");
}

/** The harness-owned idempotency key: task:step:operation, never the model's. */
function stepKey(task: string, step: string, operation: string): string {
  return [task, step, operation].map(keyPart).join(":");
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function retryAfterMs(value: string | null): number {
  const s = Number(value ?? "1");
  return Number.isFinite(s) ? Math.min(Math.max(s, 0), 60) * 1000 : 1000;
}

/** Long-polls the receipt (GET /receipts/{id}?wait=30s) until it settles. */
async function waitSettled(waitURL: string): Promise<void> {
  for (;;) {
    const resp = await fetch(BASE + waitURL, { headers: { Authorization: "Bearer " + TOKEN } });
    const text = await resp.text();
    if (resp.status !== 200) {
      throw new Error(`wait: HTTP ${resp.status}: ${text.slice(0, 200)}`);
    }
    if ((JSON.parse(text) as { settled: boolean }).settled) {
      return;
    }
  }
}

/** Publishes article i; resolves with its sends and waits, rejects when told to stop. */
async function publish(i: number): Promise<{ sends: number; waits: number }> {
  const key = stepKey(`${PREFIX}-task-${i}`, "publish", "articles.create");
  // The key doubles as a marker the reconciler's readback can find.
  const body = JSON.stringify({ title: `Article ${PREFIX} ${i}`, marker: key });
  let sends = 0;
  let waits = 0;
  for (let n = 0; n < MAX_ANSWERS; n++) {
    sends++;
    const resp = await fetch(BASE + PATH, {
      method: "POST",
      headers: { Authorization: "Bearer " + TOKEN, "Idempotency-Key": key, "Content-Type": "application/json" },
      body,
    });
    const text = await resp.text();
    if (resp.status >= 200 && resp.status <= 299) {
      return { sends, waits };
    }
    let retry: Problem["retry"] = "no";
    let problem: Problem | undefined;
    if (resp.headers.get("Content-Type") === "application/problem+json") {
      problem = JSON.parse(text) as Problem;
      retry = problem.retry;
    } else if (resp.headers.get("Receipt-Retryable") === "true") {
      retry = "same_key";
    }
    if (retry === "after_settlement" && problem?.wait_url) {
      waits++;
      await waitSettled(problem.wait_url);
    } else if (retry === "same_key") {
      await sleep(retryAfterMs(resp.headers.get("Retry-After")));
    } else {
      throw new Error(`HTTP ${resp.status}: ${text.slice(0, 300)}`);
    }
  }
  throw new Error(`not done after ${MAX_ANSWERS} answers`);
}

async function main(): Promise<void> {
  if (!TOKEN) {
    console.error("GATEWAY_TOKEN is not set");
    process.exitCode = 2;
    return;
  }
  const report: Report = { done: 0, failed: [], sends: 0, waits: 0 };
  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < CALLS) {
      const i = next++;
      try {
        const r = await publish(i);
        report.done++;
        report.sends += r.sends;
        report.waits += r.waits;
      } catch (err) {
        report.failed.push(`${i}: ${err instanceof Error ? err.message : String(err)}`);
      }
    }
  };
  await Promise.all(Array.from({ length: CONCURRENCY }, worker));
  console.log(JSON.stringify(report));
  // A script running this must be able to tell: 1 when any call failed.
  if (report.failed.length > 0) {
    process.exitCode = 1;
  }
}

main().catch((err) => {
  console.error(err);
  process.exitCode = 1;
});
