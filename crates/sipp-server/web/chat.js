// The chat page: conversations kept in this browser's localStorage, answers
// streamed from /v1/chat/completions, rendered as sanitized markdown, with a
// stop button that aborts the request (the server cancels it when the
// connection closes) and per-answer stats.
"use strict";

(() => {
  const STORE = "sipp.conversations";
  const CURRENT = "sipp.current";
  const SETTINGS = "sipp.settings";
  const $ = (id) => document.getElementById(id);

  // Model output is untrusted: markdown becomes HTML through marked, then
  // DOMPurify keeps only inert markup (no scripts, handlers, styles, forms).
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("rel", "noopener noreferrer");
      node.setAttribute("target", "_blank");
    }
  });
  function render(markdown) {
    const html = marked.parse(markdown || "", { gfm: true, breaks: true, async: false });
    return DOMPurify.sanitize(html, {
      FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
      FORBID_ATTR: ["style"],
    });
  }
  window.sippRender = render;

  let conversations = load(STORE, []);
  let current = localStorage.getItem(CURRENT);
  let controller = null;

  function load(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null ? fallback : v;
    } catch (_) {
      return fallback;
    }
  }

  function save() {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    if (current) localStorage.setItem(CURRENT, current);
  }

  function conversation() {
    return conversations.find((c) => c.id === current);
  }

  function newConversation() {
    const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [], updated: Date.now() };
    conversations.unshift(c);
    current = c.id;
    save();
    return c;
  }

  function notice(text) {
    const n = $("notice");
    n.textContent = text || "";
    n.hidden = !text;
  }

  // --- settings -----------------------------------------------------------
  const settings = Object.assign({ system: "", temperature: 0.7, top_p: 0.95, max_tokens: 512, model: "" }, load(SETTINGS, {}));
  function readSettings() {
    settings.system = $("system-prompt").value;
    settings.temperature = parseFloat($("temperature").value);
    settings.top_p = parseFloat($("top-p").value);
    settings.max_tokens = parseInt($("max-tokens").value, 10);
    settings.model = $("model").value;
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  }
  function showSettings() {
    $("system-prompt").value = settings.system;
    $("temperature").value = settings.temperature;
    $("top-p").value = settings.top_p;
    $("max-tokens").value = settings.max_tokens;
    $("api-key").value = sipp.apiKey();
  }

  // --- models -------------------------------------------------------------
  async function loadModels() {
    let resp;
    try {
      resp = await sipp.api("/v1/models");
    } catch (e) {
      notice("The server cannot be reached: " + e.message);
      return;
    }
    if (resp.status === 401 || resp.status === 403) {
      notice("This server needs an API key: enter it under Settings.");
      $("settings").hidden = false;
      $("settings-toggle").setAttribute("aria-expanded", "true");
      return;
    }
    if (!resp.ok) {
      notice(await sipp.errorText(resp));
      return;
    }
    const list = (await resp.json()).data || [];
    const select = $("model");
    select.replaceChildren(...list.map((m) => sipp.el("option", { value: m.id, text: m.id })));
    if (list.some((m) => m.id === settings.model)) select.value = settings.model;
    notice(list.length ? "" : "No model is ready yet.");
    return true;
  }

  // --- rendering ------------------------------------------------------------
  function statsText(s) {
    if (!s) return "";
    const parts = [];
    if (s.ttft_ms !== undefined) parts.push("TTFT " + Math.round(s.ttft_ms) + " ms");
    if (s.tokens_per_sec !== undefined) parts.push(s.tokens_per_sec.toFixed(1) + " tok/s");
    if (s.completion_tokens !== undefined) parts.push(s.completion_tokens + " tokens");
    if (s.cached_tokens !== undefined) parts.push(s.cached_tokens + " cached");
    if (s.finish) parts.push(s.finish);
    return parts.join(" · ");
  }

  function messageNode(m) {
    const content = sipp.el("div", { class: "content" });
    const node = sipp.el("div", { class: "msg " + m.role }, [sipp.el("div", { class: "role", text: m.role })]);
    if (m.reasoning) {
      const d = sipp.el("details", { class: "reasoning" }, [sipp.el("summary", { text: "Reasoning" }), sipp.el("div", { class: "reasoning-text", text: m.reasoning })]);
      node.append(d);
    }
    node.append(content);
    if (m.role === "assistant") content.innerHTML = render(m.content);
    else content.textContent = m.content;
    if (m.tool_calls && m.tool_calls.length) {
      for (const t of m.tool_calls) {
        node.append(sipp.el("pre", { class: "tool-call", text: (t.function && t.function.name) + "(" + ((t.function && t.function.arguments) || "") + ")" }));
      }
    }
    if (m.stats) node.append(sipp.el("div", { class: "stats", text: statsText(m.stats) }));
    return node;
  }

  function renderConversation() {
    const c = conversation();
    $("messages").replaceChildren(...(c ? c.messages.map(messageNode) : []));
    const list = $("conversations");
    list.replaceChildren(
      ...conversations.map((x) => {
        const open = sipp.el("button", { type: "button", class: "open", text: x.title });
        open.addEventListener("click", () => {
          if (controller) return;
          current = x.id;
          save();
          renderConversation();
          document.body.classList.remove("menu-open");
        });
        const del = sipp.el("button", { type: "button", class: "delete", "aria-label": "Delete", text: "×" });
        del.addEventListener("click", () => {
          if (controller && x.id === current) return;
          conversations = conversations.filter((y) => y.id !== x.id);
          if (current === x.id) current = conversations.length ? conversations[0].id : null;
          save();
          renderConversation();
        });
        return sipp.el("li", { class: x.id === current ? "active" : "" }, [open, del]);
      })
    );
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  // --- sending --------------------------------------------------------------
  async function send(text) {
    readSettings();
    const c = conversation() || newConversation();
    if (!c.messages.length) c.title = text.slice(0, 40);
    c.messages.push({ role: "user", content: text });
    const answer = { role: "assistant", content: "", reasoning: "", stats: null };
    c.messages.push(answer);
    c.updated = Date.now();
    save();
    renderConversation();
    const node = $("messages").lastElementChild;
    const contentNode = node.querySelector(".content");
    const history = c.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content }));
    if (settings.system.trim()) history.unshift({ role: "system", content: settings.system });
    const body = {
      messages: history,
      stream: true,
      stream_options: { include_usage: true },
      temperature: settings.temperature,
      top_p: settings.top_p,
      max_tokens: settings.max_tokens,
    };
    if (settings.model) body.model = settings.model;

    controller = new AbortController();
    $("send").hidden = true;
    $("stop").hidden = false;
    const started = performance.now();
    let firstToken = null;
    let usage = null;
    let finish = null;
    let pending = false;
    const paint = () => {
      pending = false;
      contentNode.innerHTML = render(answer.content);
      const r = node.querySelector(".reasoning-text");
      if (answer.reasoning && !r) {
        node.insertBefore(sipp.el("details", { class: "reasoning" }, [sipp.el("summary", { text: "Reasoning" }), sipp.el("div", { class: "reasoning-text", text: answer.reasoning })]), contentNode);
      } else if (r) r.textContent = answer.reasoning;
      const box = $("messages");
      box.scrollTop = box.scrollHeight;
    };
    try {
      const resp = await sipp.api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await sipp.errorText(resp));
      await sipp.readEvents(resp, ({ data }) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          if ((d.content || d.reasoning_content) && firstToken === null) firstToken = performance.now();
          if (d.content) answer.content += d.content;
          if (d.reasoning_content) answer.reasoning += d.reasoning_content;
          if (d.tool_calls) {
            answer.tool_calls = answer.tool_calls || [];
            for (const t of d.tool_calls) {
              const slot = (answer.tool_calls[t.index] = answer.tool_calls[t.index] || { function: { name: "", arguments: "" } });
              if (t.function && t.function.name) slot.function.name += t.function.name;
              if (t.function && t.function.arguments) slot.function.arguments += t.function.arguments;
            }
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      });
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else notice(e.message);
    } finally {
      const end = performance.now();
      const stats = { finish: finish || "stopped" };
      if (firstToken !== null) {
        stats.ttft_ms = firstToken - started;
        const tokens = usage ? usage.completion_tokens : undefined;
        if (tokens !== undefined) {
          stats.completion_tokens = tokens;
          if (end > firstToken && tokens > 1) stats.tokens_per_sec = ((tokens - 1) * 1000) / (end - firstToken);
        }
      }
      if (usage && usage.prompt_tokens_details) stats.cached_tokens = usage.prompt_tokens_details.cached_tokens;
      answer.stats = stats;
      controller = null;
      $("send").hidden = false;
      $("stop").hidden = true;
      c.updated = Date.now();
      save();
      renderConversation();
    }
  }

  // --- wiring ---------------------------------------------------------------
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (controller) controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    if (controller) return;
    newConversation();
    renderConversation();
  });
  $("menu").addEventListener("click", () => document.body.classList.toggle("menu-open"));
  $("settings-toggle").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  });
  for (const id of ["system-prompt", "temperature", "top-p", "max-tokens", "model"]) {
    $(id).addEventListener("change", readSettings);
  }
  $("save-key").addEventListener("click", async () => {
    sipp.setApiKey($("api-key").value.trim());
    if (await loadModels()) {
      $("settings").hidden = true;
      $("settings-toggle").setAttribute("aria-expanded", "false");
    }
  });

  showSettings();
  if (!conversation()) current = conversations.length ? conversations[0].id : null;
  renderConversation();
  loadModels();
})();
