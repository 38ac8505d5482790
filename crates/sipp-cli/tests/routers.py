"""Two sipp replicas behind the routers operators run: sglang-router and
vllm-router from PyPI, on loopback.

For each router: 4 long system prompts x 8 questions, sent at once, with
`cache_aware` and with `round_robin` (fresh replicas for each run, so both
start cold). The replicas' own /metrics say how many prompt tokens they
computed (prompt tokens minus prefix-cache hits); `cache_aware` must need at
most 0.6x what `round_robin` needs, and each prefix must live on one replica.
Streaming and non-streaming answers pass through the router unchanged (the
same text as the replica gives directly). Killing one replica mid-run loses
at most the requests it held, and the router keeps serving.

Usage: routers.py SIPP_BIN MODEL ROUTERS_BIN_DIR
"""

import http.client as httpclient
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

SIPP, MODEL, ROUTERS = sys.argv[1], sys.argv[2], sys.argv[3]

# The balance thresholds both routers use in these runs (their defaults,
# given explicitly): cache-aware placement holds while the busiest worker has
# fewer than 64 more requests in flight than the idlest, or less than 1.5x
# as many; past that both fall back to the least-loaded worker.
CACHE_THRESHOLD = "0.3"
BALANCE_ABS = "64"
BALANCE_REL = "1.5"
MAX_RATIO = 0.6

TOPICS = ["lighthouse", "orchard", "observatory", "foundry"]
QUESTIONS = [
    "What is rule 3?",
    "Summarise rule 7 in five words.",
    "Which rule mentions the ledger?",
    "Is rule 12 about safety?",
    "What comes after rule 20?",
    "Name one tool from the rules.",
    "How many rules are there?",
    "What is the first word of rule 30?",
]
VERBS = ["inspect", "record", "polish", "count", "label", "seal", "weigh", "sketch"]
NOUNS = ["ledger", "lantern", "barrel", "compass", "gauge", "crate", "valve", "chart"]


def system_prompt(k):
    topic = TOPICS[k]
    rules = []
    for i in range(1, 41):
        v = VERBS[(i * (k + 3)) % len(VERBS)]
        n = NOUNS[(i * (k + 5)) % len(NOUNS)]
        m = NOUNS[(i + k) % len(NOUNS)]
        rules.append(f"Rule {i} of the {topic} desk: always {v} the {n} before the {m} is moved.")
    return f"You are the assistant of the {topic} team. " + " ".join(rules)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, httpclient.HTTPException, ConnectionError,
            TimeoutError, OSError) as e:
        # A connection cut mid-answer (a replica killed) is a lost request.
        return 0, str(e)


class Proc:
    def __init__(self, name, argv):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"sipp-{name}-", suffix=".log", delete=False)
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()

    def tail(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def discard_log(self):
        self.log.close()
        try:
            os.unlink(self.log.name)
        except FileNotFoundError:
            pass


def wait_for(what, f, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if f():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


class Replica(Proc):
    def __init__(self, name, load_format):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [
            SIPP, "serve", "-m", MODEL, "-p", str(self.port), "-t", "1",
            "--parallel", "4", "--ctx-size", "8192", "--load-format", load_format,
        ])

    def ready(self):
        wait_for(f"{self.name} /health", lambda: http("GET", self.url + "/health", timeout=2)[0] == 200)

    def counters(self):
        st, text = http("GET", self.url + "/metrics", timeout=10)
        assert st == 200, (st, text)
        out = {}
        for name in ["sipp_prompt_tokens_total", "sipp_prefix_cache_hit_tokens_total",
                     "sipp_busy_slots", "sipp_queue_depth"]:
            out[name] = sum(float(m.group(1)) for m in re.finditer(
                rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M))
        out["computed"] = out["sipp_prompt_tokens_total"] - out["sipp_prefix_cache_hit_tokens_total"]
        return out


class Router(Proc):
    def __init__(self, kind, policy, workers):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        common = ["--host", "127.0.0.1", "--port", str(self.port),
                  "--prometheus-port", str(free_port()),
                  "--worker-urls", *[w.url for w in workers], "--policy", policy,
                  "--cache-threshold", CACHE_THRESHOLD,
                  "--balance-abs-threshold", BALANCE_ABS,
                  "--balance-rel-threshold", BALANCE_REL,
                  "--health-check-interval-secs", "1"]
        if kind == "sglang":
            argv = [os.path.join(ROUTERS, "sglang-router"), "launch", *common]
        else:
            argv = [os.path.join(ROUTERS, "vllm-router"), *common]
        super().__init__(f"{kind}-router-{policy}", argv)

    def probe(self):
        """A one-token chat through the router; its HTTP status."""
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        return http("POST", self.url + "/v1/chat/completions", body, timeout=10)[0]

    def ready(self):
        wait_for(f"{self.name} to route", lambda: self.probe() == 200)

    def reaches(self, workers):
        """Probes until every worker has served one of them (round_robin)."""
        before = [w.counters()["sipp_prompt_tokens_total"] for w in workers]

        def all_served():
            self.probe()
            now = [w.counters()["sipp_prompt_tokens_total"] for w in workers]
            return all(n > b for n, b in zip(now, before))

        wait_for(f"{self.name} to route to every worker", all_served, timeout=60)


MODEL_ID = MODEL


def chat(base, k, q, stream, max_tokens=4):
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "system", "content": system_prompt(k)},
                     {"role": "user", "content": QUESTIONS[q]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    st, text = http("POST", base + "/v1/chat/completions", body)
    if st != 200:
        return st, None
    if not stream:
        return st, json.loads(text)["choices"][0]["message"]["content"]
    parts = []
    done = False
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        for c in json.loads(data).get("choices", []):
            parts.append(c.get("delta", {}).get("content") or "")
    assert done, f"stream without [DONE]: {text[-300:]}"
    return st, "".join(parts)


def prefix_tokens(replica, k):
    st, text = http("POST", replica.url + "/tokenize", {
        "model": MODEL_ID,
        "messages": [{"role": "system", "content": system_prompt(k)}],
        "add_generation_prompt": False,
    })
    assert st == 200, text
    return json.loads(text)["count"]


def workload(base):
    """All 32 requests at once; every other one streamed. Submitted prefix by
    prefix: round_robin then splits each prefix's questions over both
    replicas, as routing that knows nothing of prefixes does. (Submitted
    question by question, 4 prefixes alternating over 2 replicas, round_robin
    would keep each prefix on one replica whenever the requests arrived in
    order, and its baseline moved from ~3,600 to ~6,700 computed tokens with
    the arrival jitter.)"""
    jobs = [(k, q) for k in range(len(TOPICS)) for q in range(len(QUESTIONS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: chat(base, j[0], j[1], (j[0] + j[1]) % 2 == 0), jobs))
    bad = [(j, st) for j, (st, _) in zip(jobs, results) if st != 200]
    assert not bad, f"requests failed through the router: {bad}"


def run(kind, policy, check):
    fmt = "vllm" if kind == "vllm" else "sglang"
    reps = [Replica(f"{kind}-{policy}-a", fmt), Replica(f"{kind}-{policy}-b", fmt)]
    router = None
    try:
        for r in reps:
            r.ready()
        router = Router(kind, policy, reps)
        router.ready()
        if policy == "round_robin":
            # The router routes once one worker passes its health check; the
            # baseline needs both (with one, round_robin sends every request
            # to it, each prefix is computed once, and the ratio reads 1.0).
            router.reaches(reps)
        before = [r.counters() for r in reps]
        t0 = time.time()
        workload(router.url)
        secs = time.time() - t0
        after = [r.counters() for r in reps]
        computed = [a["computed"] - b["computed"] for a, b in zip(after, before)]
        print(f"{kind} {policy}: computed prompt tokens per replica {computed}, "
              f"total {sum(computed):.0f}, workload {secs:.1f} s", flush=True)
        if check:
            check(router, reps, computed)
        return sum(computed)
    except BaseException:
        for p in [*reps, *([router] if router else [])]:
            print(f"--- {p.name} log tail ---\n{p.tail()}", file=sys.stderr)
        raise
    finally:
        for p in [*([router] if router else []), *reps]:
            p.kill()
            p.discard_log()


def sticky_and_failover(kind):
    def check(router, reps, computed):
        lens = [prefix_tokens(reps[0], k) for k in range(len(TOPICS))]
        # Each prefix computed once over both replicas: what was computed is
        # the four prefixes plus the 32 questions' own tokens (under 40 each),
        # less than one more prefix.
        assert sum(computed) < sum(lens) + min(lens), (computed, lens)
        # Each prefix lives where the router sends it: one more question per
        # prefix lands on one replica and reuses the whole prefix there.
        homes = {}
        for k in range(len(TOPICS)):
            b = [r.counters() for r in reps]
            st, _ = chat(router.url, k, 0, False, max_tokens=1)
            assert st == 200
            a = [r.counters() for r in reps]
            served = [i for i in range(2) if a[i]["sipp_prompt_tokens_total"] > b[i]["sipp_prompt_tokens_total"]]
            assert len(served) == 1, (k, served)
            i = served[0]
            hit = a[i]["sipp_prefix_cache_hit_tokens_total"] - b[i]["sipp_prefix_cache_hit_tokens_total"]
            assert hit >= lens[k] - 2, f"prefix {k} was not cached on replica {i}: {hit} of {lens[k]}"
            homes[k] = i
        print(f"{kind}: prefixes' replicas {homes}, prefix lengths {lens}", flush=True)

        # Pass-through: the same greedy answer directly, through the router
        # non-streamed and streamed (the prompt is cached on every path).
        k = 0
        home = reps[homes[k]]
        direct = [chat(home.url, k, 1, False, max_tokens=12) for _ in range(2)][1]
        routed = chat(router.url, k, 1, False, max_tokens=12)
        streamed = chat(router.url, k, 1, True, max_tokens=12)
        assert direct[0] == routed[0] == streamed[0] == 200
        assert routed[1] == direct[1] and streamed[1] == direct[1], (direct, routed, streamed)

        # Kill a replica while it holds requests.
        victim = reps[1]
        jobs = [(k, q) for q in range(4) for k in range(len(TOPICS))]
        with ThreadPoolExecutor(len(jobs)) as pool:
            # Answers long enough that the victim still holds them when killed.
            futures = [pool.submit(chat, router.url, k, q, q % 2 == 0, 96) for k, q in jobs]
            wait_for("the victim to hold requests",
                     lambda: victim.counters()["sipp_busy_slots"] > 0, timeout=30)
            # The router may still be forwarding requests to the victim when
            # its first slot fills: count what it holds once that number has
            # stayed the same for three reads 100 ms apart.
            seen = []
            while (len(seen) < 3 or len(set(seen[-3:])) > 1) and len(seen) < 30:
                c = victim.counters()
                seen.append(c["sipp_busy_slots"] + c["sipp_queue_depth"])
                time.sleep(0.1)
            held = seen[-1]
            victim.kill()
            results = [f.result() for f in futures]
        failed = sum(1 for st, _ in results if st != 200)
        print(f"{kind}: killed a replica holding {held:.0f} requests: "
              f"{failed} of {len(jobs)} failed", flush=True)
        # The router may retry some of the victim's requests elsewhere; it
        # must not lose more than the victim held (a request sent to it in
        # the instant before the kill counts as held).
        assert failed <= held + 1, (failed, held)
        time.sleep(3)
        later = [chat(router.url, k, 2, k % 2 == 0, 2) for k in range(len(TOPICS)) for _ in range(2)]
        assert all(st == 200 for st, _ in later), f"the router stopped serving: {later}"
    return check


def main():
    for kind in ["sglang", "vllm"]:
        aware = run(kind, "cache_aware", sticky_and_failover(kind))
        rr = run(kind, "round_robin", None)
        ratio = aware / rr
        print(f"{kind}: cache_aware / round_robin computed prompt tokens = "
              f"{aware:.0f} / {rr:.0f} = {ratio:.2f}", flush=True)
        assert ratio <= MAX_RATIO, f"{kind}: ratio {ratio:.2f} over {MAX_RATIO}"
    print("routers: all checks passed")


if __name__ == "__main__":
    main()
