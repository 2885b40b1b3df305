// Polls stats (GET /lorastar/stats) once a second; tokens/s from the generated-token counter's deltas.
"use strict";
const POLL_MS = 1000, HISTORY = 120;
const history = [];  // [time, tokens/s]
let last = null;
let key = sessionStorage.getItem("lorastar-api-key") || "";  // servers with api_keys: the form below

const $ = (id) => document.getElementById(id);
const fmt = (v) => (v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US"));

function cell(text, cls) {
  const td = document.createElement("td");
  if (cls) td.className = cls;
  td.textContent = text;
  return td;
}

function render(s) {
  $("model").textContent = s.model;
  $("meta").textContent = [s.dtype, s.device, s.max_model_len && `max_model_len ${s.max_model_len}`,
    s.healthy ? "healthy" : "not healthy"].filter(Boolean).join(" · ");
  const kv = s.kv_cache_usage ?? 0;
  $("kv").textContent = `${(kv * 100).toFixed(1)}%`;
  $("kvbar").style.width = `${Math.min(100, kv * 100)}%`;
  $("kvblocks").textContent = `${fmt(s.num_used_blocks)} / ${fmt(s.num_blocks)} blocks`;
  $("running").textContent = fmt(s.num_running);
  $("waiting").textContent = fmt(s.num_waiting);
  $("gen").textContent = fmt(s.generation_tokens_total);
  const sd = s.spec_decode;  // speculative decoding: share of drafts kept, tokens a drafted step adds
  $("speccard").hidden = !sd;
  if (sd) {
    $("spec").textContent = sd.num_draft_tokens ? `${((100 * sd.num_accepted_tokens) / sd.num_draft_tokens).toFixed(1)}%` : "–";
    $("specsub").textContent = sd.num_drafts
      ? `${(1 + sd.num_accepted_tokens / sd.num_drafts).toFixed(2)} tokens per drafted step` : "no drafts yet";
  }
  // (none while the engine restarts; lower after a restart: counted from 0, as Prometheus' rate())
  if (last && last.generation_tokens_total !== undefined && s.generation_tokens_total !== undefined) {
    const dt = s.time - last.time, d = s.generation_tokens_total - last.generation_tokens_total;
    const tps = dt > 0 ? (d < 0 ? s.generation_tokens_total : d) / dt : 0;
    history.push([s.time, Math.max(0, tps)]);
    if (history.length > HISTORY) history.shift();
    $("tps").textContent = tps.toFixed(1);
  }
  last = s;
  const peak = Math.max(1, ...history.map((h) => h[1]));
  $("line").setAttribute("points", history.map((h, i) =>
    `${(i / (HISTORY - 1)) * 630 + 5},${130 - (h[1] / peak) * 105}`).join(" "));
  $("chartlabel").textContent = `tokens/s (last 2 min, peak ${peak.toFixed(1)})`;
  const body = $("adapters");
  body.replaceChildren(...s.adapters.map((a) => {
    const tr = document.createElement("tr");
    tr.dataset.adapter = a.name;
    const tier = document.createElement("td");
    const badge = document.createElement("span");
    badge.className = `tier tier-${a.tier}`;
    badge.textContent = a.tier === "device" ? `device slot ${a.slot}` : a.tier;
    tier.append(badge);
    tr.append(cell(a.name), tier, cell(a.rank ?? "–", "n"), cell(fmt(a.running), "n"), cell(fmt(a.waiting), "n"),
      cell(fmt(a.requests), "n"), cell(fmt(a.prompt_tokens), "n"), cell(fmt(a.generation_tokens), "n"));
    return tr;
  }));
}

async function poll() {
  try {
    // a server that went away without closing the connection: give up, say so, poll again
    const ctl = new AbortController(), timer = setTimeout(() => ctl.abort(), 5 * POLL_MS);
    const r = await fetch("stats", { cache: "no-store", signal: ctl.signal,
      headers: key ? { Authorization: `Bearer ${key}` } : {} }).finally(() => clearTimeout(timer));
    $("auth").hidden = r.status !== 401;
    if (r.status === 401) throw new Error(key ? "API key refused" : "this server needs an API key");
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
    $("error").textContent = "";
  } catch (e) {
    $("error").textContent = `stats unavailable: ${e.name === "AbortError" ? "no answer" : e.message}`;
  }
  setTimeout(poll, POLL_MS);
}
$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  key = $("key").value.trim();
  sessionStorage.setItem("lorastar-api-key", key);
});
poll();
