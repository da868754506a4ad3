#!/usr/bin/env python3
"""An agent that publishes articles through the receipt gateway.

Standard library only. The one change from calling the API directly is the
base URL: the gateway records a receipt before the bytes leave, injects the
API's credentials, and says after every answer what the agent may do next.

The rules it follows (the "retry" member of the gateway's problem
documents, or Receipt-Retryable on an upstream refusal):

  2xx                 done (the effect exists; a replay says so too)
  after_settlement    the outcome is unknown: do NOT send it under another
                      key; long-poll wait_url until the receipt settles, then
                      send the same Idempotency-Key again (the gateway answers
                      with the settled outcome, or sends attempt n+1 once the
                      reconciler proved the effect absent)
  same_key            nothing was done: send the same key again after
                      Retry-After
  anything else       give up on this call and report it

Environment: GATEWAY_URL (http://127.0.0.1:7070), GATEWAY_TOKEN (this
agent's token), GATEWAY_PATH (/blog/articles), AGENT_PREFIX (py),
AGENT_CALLS (10), AGENT_CONCURRENCY (4). It prints one JSON line at the end:
{"done": n, "failed": [...], "sends": n, "waits": n}, and exits 0 when every
call was done, 1 when any failed (2 when GATEWAY_TOKEN is not set).
"""

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

BASE = os.environ.get("GATEWAY_URL", "http://127.0.0.1:7070").rstrip("/")
TOKEN = os.environ.get("GATEWAY_TOKEN", "")
PATH = os.environ.get("GATEWAY_PATH", "/blog/articles")
PREFIX = os.environ.get("AGENT_PREFIX", "py")
CALLS = int(os.environ.get("AGENT_CALLS", "10"))
CONCURRENCY = int(os.environ.get("AGENT_CONCURRENCY", "4"))
MAX_ANSWERS = 30


def key_part(s):
    """Escape a part of a key as the Go ledger's Key does."""
    return s.replace("%", "%25").replace(":", "%3A").replace("#", "%23")


def step_key(task, step, operation):
    """The harness-owned idempotency key: task:step:operation, never the model's."""
    return ":".join(key_part(p) for p in (task, step, operation))


def request(method, url, body=None, headers=None):
    """One HTTP exchange; returns (status, headers, body bytes), errors included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read()


def retry_after(value):
    """Seconds to wait before sending again: Retry-After's seconds, else 1 (at most 60)."""
    try:
        return min(max(float(value), 0.0), 60.0)
    except (TypeError, ValueError):
        return 1.0


def wait_settled(wait_url):
    """Long-poll the receipt (GET /receipts/{id}?wait=30s) until it settles."""
    while True:
        status, _, body = request("GET", BASE + wait_url, headers={"Authorization": "Bearer " + TOKEN})
        if status != 200:
            raise RuntimeError("wait: HTTP %d: %s" % (status, body[:200]))
        if json.loads(body)["settled"]:
            return


def publish(i):
    """Publish article i; returns (sends, waits). Raises when the gateway says to stop."""
    key = step_key("%s-task-%d" % (PREFIX, i), "publish", "articles.create")
    # The key doubles as a marker the reconciler's readback can find.
    body = json.dumps({"title": "Article %s %d" % (PREFIX, i), "marker": key}).encode()
    headers = {"Authorization": "Bearer " + TOKEN, "Idempotency-Key": key, "Content-Type": "application/json"}
    sends = waits = 0
    for _ in range(MAX_ANSWERS):
        sends += 1
        status, resp_headers, resp_body = request("POST", BASE + PATH, body, headers)
        if 200 <= status <= 299:
            return sends, waits
        retry = "no"
        problem = {}
        if resp_headers.get("Content-Type") == "application/problem+json":
            problem = json.loads(resp_body)
            retry = problem.get("retry", "no")
        elif resp_headers.get("Receipt-Retryable") == "true":
            retry = "same_key"
        if retry == "after_settlement":
            waits += 1
            wait_settled(problem["wait_url"])
        elif retry == "same_key":
            time.sleep(retry_after(resp_headers.get("Retry-After")))
        else:
            raise RuntimeError("HTTP %d: %s" % (status, resp_body[:300].decode(errors="replace")))
    raise RuntimeError("not done after %d answers" % MAX_ANSWERS)


def main():
    if not TOKEN:
        print("GATEWAY_TOKEN is not set", file=sys.stderr)
        return 2
    report = {"done": 0, "failed": [], "sends": 0, "waits": 0}
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        futures = {pool.submit(publish, i): i for i in range(CALLS)}
        for fut, i in futures.items():
            try:
                sends, waits = fut.result()
                report["done"] += 1
                report["sends"] += sends
                report["waits"] += waits
            except Exception as err:  # reported, not hidden
                report["failed"].append("%d: %s" % (i, err))
    print(json.dumps(report))
    # A script running this must be able to tell: 1 when any call failed.
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
