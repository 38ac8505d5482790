// Shared by the chat page and the dashboard: the API key the user entered
// (kept in this browser's localStorage), authenticated fetches, and a reader
// for server-sent events over fetch (EventSource cannot send a key header).
"use strict";

const sipp = (() => {
  const KEY = "sipp.apiKey";

  function apiKey() {
    return localStorage.getItem(KEY) || "";
  }

  function setApiKey(k) {
    if (k) localStorage.setItem(KEY, k);
    else localStorage.removeItem(KEY);
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = apiKey();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }

  // fetch with the key; `opts.headers` are added to it.
  function api(path, opts) {
    const o = Object.assign({}, opts || {});
    o.headers = headers(o.headers);
    return fetch(path, o);
  }

  // The error message of a failed answer (OpenAI's error shape, else text).
  async function errorText(resp) {
    const text = await resp.text();
    try {
      const v = JSON.parse(text);
      if (v && v.error && v.error.message) return resp.status + ": " + v.error.message;
    } catch (_) {
      // not JSON
    }
    return resp.status + ": " + (text || resp.statusText);
  }

  // Calls onEvent({event, data}) for each server-sent event of a response
  // body until it ends; resolves when it does.
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent({ event, data: data.join("\n") });
      }
    }
  }

  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const c of children || []) e.append(c);
    return e;
  }

  return { apiKey, setApiKey, api, errorText, readEvents, el };
})();
