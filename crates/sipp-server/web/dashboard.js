// The operator dashboard: one server-sent event stream from /v1/dashboard
// (an admin key when keys are configured), redrawn on every event.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = sipp.el;
  let controller = null;
  const COLORS = ["#2f6fde", "#d9572b", "#2a9d5c", "#9b51e0", "#c99a00"];

  function status(text, bad) {
    const s = $("status");
    s.textContent = text;
    s.className = bad ? "bad" : "";
  }

  function bytes(n) {
    if (n < 1024) return n + " B";
    if (n < 1 << 20) return (n / 1024).toFixed(1) + " KiB";
    return (n / (1 << 20)).toFixed(1) + " MiB";
  }

  function targetCard(t) {
    const card = el("article", { class: "target", "data-target": t.id }, [el("h2", { text: t.id + " (" + t.kind + ", " + t.state + ")" })]);
    if (t.error) card.append(el("p", { class: "bad", text: t.error }));
    const e = t.engine;
    if (!e) return card;
    const slots = el("div", { class: "slots" }, e.slots.map((s) =>
      el("div", { class: "slot phase-" + s.phase, "data-phase": s.phase, title: s.request_id ? "request " + s.request_id : "idle" }, [
        el("b", { text: "#" + s.index }),
        el("span", { text: s.phase }),
        el("small", { text: s.request_id ? s.prompt_tokens + "p/" + s.cached_tokens + "c/" + s.generated_tokens + "g" : "" }),
      ])
    ));
    const kvShare = e.kv_cells_total ? e.kv_cells_used / e.kv_cells_total : 0;
    const bar = el("div", { class: "bar" }, [el("div", { class: "fill" })]);
    bar.firstChild.style.width = (100 * kvShare).toFixed(1) + "%";
    const facts = el("dl", {}, [
      el("dt", { text: "busy slots" }), el("dd", { class: "busy", text: e.busy_slots + " / " + e.slots.length }),
      el("dt", { text: "queue" }), el("dd", { class: "queue", text: String(e.queue_depth) }),
      el("dt", { text: "KV cells" }), el("dd", { text: e.kv_cells_used + " / " + e.kv_cells_total }),
      el("dt", { text: "prefix-cache hit rate" }), el("dd", { text: (100 * e.prefix_cache.hit_rate).toFixed(1) + "% (" + e.prefix_cache.hit_tokens + " of " + e.prefix_cache.prompt_tokens + " prompt tokens)" }),
      el("dt", { text: "snapshots" }), el("dd", { text: e.snapshot_entries + " (" + bytes(e.snapshot_bytes) + ")" }),
      el("dt", { text: "requests" }), el("dd", { text: e.requests_completed + " done, " + e.requests_cancelled + " cancelled, " + e.requests_failed + " failed" }),
    ]);
    card.append(slots, bar, facts);
    return card;
  }

  function chart(samples) {
    const svg = $("chart");
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    const ids = [...new Set(samples.flatMap((s) => Object.keys(s.tokens_per_sec)))];
    const max = Math.max(1, ...samples.flatMap((s) => Object.values(s.tokens_per_sec)));
    const n = 300;
    ids.forEach((id, i) => {
      const pts = samples.map((s, j) => {
        const x = ((n - samples.length + j) / (n - 1)) * 600;
        const y = 155 - ((s.tokens_per_sec[id] || 0) / max) * 145;
        return x.toFixed(1) + "," + y.toFixed(1);
      });
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("points", pts.join(" "));
      line.setAttribute("fill", "none");
      line.setAttribute("stroke", COLORS[i % COLORS.length]);
      line.setAttribute("stroke-width", "2");
      svg.append(line);
    });
    const latest = samples.length ? samples[samples.length - 1].tokens_per_sec : {};
    $("chart-legend").replaceChildren(...ids.map((id, i) => {
      const sw = el("span", { class: "swatch" });
      sw.style.background = COLORS[i % COLORS.length];
      return el("span", { class: "legend" }, [sw, id + ": " + (latest[id] || 0).toFixed(1) + " tok/s now, peak " + max.toFixed(1)]);
    }));
  }

  function recent(rows) {
    $("recent").tBodies[0].replaceChildren(...rows.map((r) => el("tr", {}, [
      el("td", { text: new Date(r.finished_at_ms).toLocaleTimeString() }),
      el("td", { text: r.model }),
      el("td", { text: r.finish_reason }),
      el("td", { text: String(Math.round(r.ttft_ms)) }),
      el("td", { text: String(r.prompt_tokens) }),
      el("td", { text: String(r.cached_tokens) }),
      el("td", { text: String(r.generated_tokens) }),
      el("td", { text: String(Math.round(r.total_ms)) }),
    ])));
  }

  function draw(state) {
    $("targets").replaceChildren(...state.targets.map(targetCard));
    chart(state.throughput);
    recent(state.recent_requests);
  }

  async function connect() {
    if (controller) controller.abort();
    controller = new AbortController();
    const mine = controller;
    status("connecting…");
    try {
      const resp = await sipp.api("/v1/dashboard", { headers: { Accept: "text/event-stream" }, signal: mine.signal });
      if (!resp.ok) {
        status(await sipp.errorText(resp), true);
        return;
      }
      status("live");
      await sipp.readEvents(resp, ({ event, data }) => {
        if (event === "state") draw(JSON.parse(data));
      });
      if (!mine.signal.aborted) {
        status("disconnected; retrying", true);
        setTimeout(connect, 2000);
      }
    } catch (e) {
      if (e.name !== "AbortError") {
        status("disconnected (" + e.message + "); retrying", true);
        setTimeout(connect, 2000);
      }
    }
  }

  $("api-key").value = sipp.apiKey();
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sipp.setApiKey($("api-key").value.trim());
    connect();
  });
  connect();
})();
