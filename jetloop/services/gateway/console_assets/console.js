// The jetloop console: one module, no library, no build step.
//
// Everything shown comes from the gateway's /v1 routes with the bearer token the person
// signed in with, kept in this tab's sessionStorage and never put in a URL. Live views read
// the gateway's Server-Sent Events with fetch (EventSource cannot send a header), resuming
// by Last-Event-ID. Every list is paged by the server: no view loads everything.
//
// A token may act in several namespaces: the one chosen (kept beside the token) is added to
// every request as ?namespace=; without a choice the gateway acts in the token's first.

const TOKEN_KEY = "jetloop.token";
const NAMESPACE_KEY = "jetloop.namespace";
const PAGE = 50;
let me = null; // {name, scopes}
let current = null; // AbortController of the view on screen

// --- small helpers ---------------------------------------------------------------------

function h(tag, attrs = {}, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

const view = () => document.getElementById("view");
// Fills an element (a view: the main one); left-out parts (null, false) are left out.
const fill = (el, ...kids) => el.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
const show = (...kids) => fill(view(), ...kids);
const can = (scope) => !!me && me.scopes.includes(scope);
const enc = encodeURIComponent;

function when(ts) {
  if (!ts) return "—";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19);
}

function clock(ts) {
  return ts ? new Date(ts * 1000).toISOString().slice(11, 23) : "";
}

function secs(d) {
  if (d === null || d === undefined || Number.isNaN(d)) return "";
  return d < 1 ? `${Math.round(d * 1000)} ms` : `${d.toFixed(2)} s`;
}

function badge(text, kind) {
  return h("span", { class: `badge ${kind || text}` }, text);
}

function json(v) {
  return typeof v === "string" ? v : JSON.stringify(v, null, 2);
}

function debounce(fn, ms) {
  let t = null;
  return () => {
    clearTimeout(t);
    t = setTimeout(fn, ms);
  };
}

// --- the API -----------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super(`${problem.title || status}${problem.detail ? ": " + problem.detail : ""}`);
    this.status = status;
    this.problem = problem;
  }
}

function authHeaders(extra = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

// The path in the chosen namespace (who the token is and what it holds are no namespace's).
function inNamespace(path) {
  const ns = sessionStorage.getItem(NAMESPACE_KEY);
  if (!ns || !path.startsWith("/v1/") || path === "/v1/whoami" || path === "/v1/namespaces") return path;
  return `${path}${path.includes("?") ? "&" : "?"}namespace=${enc(ns)}`;
}

async function api(path, { method = "GET", body, signal } = {}) {
  const headers = authHeaders(body === undefined ? {} : { "Content-Type": "application/json" });
  const res = await fetch(inNamespace(path), {
    method,
    headers,
    signal,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new ApiError(res.status, data || {});
  return data;
}

// Server-Sent Events over fetch: yields {id, type, data}; reconnects with Last-Event-ID
// until the signal aborts.
async function follow(path, after, signal, onEvent) {
  let last = after;
  while (!signal.aborted) {
    try {
      const headers = authHeaders(last === null ? {} : { "Last-Event-ID": String(last) });
      const res = await fetch(inNamespace(path), { headers, signal });
      if (!res.ok) throw new Error(`${res.status}`);
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const ev = { id: null, type: "message", data: null };
          for (const line of block.split("\n")) {
            if (line.startsWith("id: ")) ev.id = Number(line.slice(4));
            else if (line.startsWith("event: ")) ev.type = line.slice(7);
            else if (line.startsWith("data: ")) ev.data = JSON.parse(line.slice(6));
          }
          if (ev.id !== null) {
            last = ev.id;
            onEvent(ev);
          }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

// A list from the read model, kept live: the events say something changed, and the read
// model catches up with them a moment later (the projector follows the same stream), so
// the list is read again shortly after an event and once more a little later.
function keepLive(load, signal) {
  const soon = debounce(() => load().catch(() => {}), 400);
  const later = debounce(() => load().catch(() => {}), 1500);
  follow("/v1/events", null, signal, () => (soon(), later()));
  const tick = setInterval(() => (signal.aborted ? clearInterval(tick) : load().catch(() => {})), 10000);
}

// --- sign-in -----------------------------------------------------------------------------

async function signIn() {
  try {
    me = await api("/v1/whoami");
    return true;
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 401) throw err;
    sessionStorage.removeItem(TOKEN_KEY);
    me = null;
    return false;
  }
}

function showSignIn(message) {
  document.getElementById("nav").hidden = true;
  document.getElementById("who").replaceChildren();
  const form = document.getElementById("signin").content.firstElementChild.cloneNode(true);
  view().replaceChildren(form);
  form.querySelector("#signin-error").textContent = message || "";
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    sessionStorage.removeItem(NAMESPACE_KEY);
    sessionStorage.setItem(TOKEN_KEY, form.querySelector("#token").value.trim());
    try {
      if (await signIn()) return start();
      showSignIn("That token is not known to this gateway.");
    } catch (err) {
      sessionStorage.removeItem(TOKEN_KEY);
      showSignIn(err.message);
    }
  });
  form.querySelector("#token").focus();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionStorage.removeItem(NAMESPACE_KEY);
  me = null;
  if (current) current.abort();
  location.hash = "#/sessions";
  boot();
}

// --- sessions ----------------------------------------------------------------------------

function sessionStatus(s) {
  if (s.status !== "idle" && s.waiting_for && s.waiting_for.length)
    return badge(`waiting for ${s.waiting_for.join(", ")}`, "waiting");
  if (s.status === "idle" && s.last_turn_status === "failed") return badge("failed");
  return badge(s.status || "—", s.status);
}

async function sessionsView(signal, params) {
  const q = params.get("q") || "";
  const status = params.get("status") || "";
  const agent = params.get("agent") || "";
  const offset = Number(params.get("offset") || 0);
  const go = (changes) => {
    const p = new URLSearchParams({ q, status, agent, offset: 0, ...changes });
    for (const [k, v] of [...p]) if (!v || v === "0") p.delete(k);
    location.hash = `#/sessions?${p}`;
  };
  const search = h("input", { id: "search", type: "search", placeholder: "search ids, agents, texts", value: q });
  const pick = h(
    "select",
    { id: "status-filter", onchange: () => go({ q: search.value, status: pick.value, agent: agentIn.value }) },
    ...["", "running", "waiting", "approval", "answer", "idle", "failed"].map((v) =>
      h("option", { value: v, selected: v === status }, v ? v : "any status"),
    ),
  );
  const agentIn = h("input", { id: "agent-filter", placeholder: "agent", value: agent, size: 10 });
  const form = h(
    "form",
    { class: "toolbar", onsubmit: (e) => (e.preventDefault(), go({ q: search.value, status: pick.value, agent: agentIn.value })) },
    search, pick, agentIn, h("button", { type: "submit" }, "Search"),
    h("span", { class: "live" }, "live"),
  );
  const body = h("tbody");
  const info = h("span", { class: "mute", id: "sessions-total" });
  const prev = h("button", { class: "secondary", onclick: () => go({ q, status, agent, offset: Math.max(0, offset - PAGE) }) }, "← newer");
  const next = h("button", { class: "secondary", onclick: () => go({ q, status, agent, offset: offset + PAGE }) }, "older →");
  show(
    h("h1", {}, "Sessions"),
    form,
    h("table", { id: "sessions" },
      h("thead", {}, h("tr", {}, ["session", "agent", "status", "turns", "last activity", "last message"].map((t) => h("th", {}, t)))),
      body),
    h("div", { class: "pager" }, prev, next, info),
  );
  const load = async () => {
    const p = new URLSearchParams({ limit: PAGE, offset });
    if (q) p.set("q", q);
    if (status) p.set("status", status);
    if (agent) p.set("agent", agent);
    const page = await api(`/v1/sessions?${p}`, { signal });
    body.replaceChildren(
      ...page.sessions.map((s) =>
        h("tr", { class: "clickable", "data-session": s.session_id, onclick: () => (location.hash = `#/session/${enc(s.session_id)}`) },
          h("td", {}, h("code", {}, s.session_id)),
          h("td", {}, s.agent || "—"),
          h("td", {}, sessionStatus(s)),
          h("td", {}, `${s.turns_total}`, s.turns_failed ? h("span", { class: "error" }, ` (${s.turns_failed} failed)`) : ""),
          h("td", { title: s.updated_at ? new Date(s.updated_at * 1000).toISOString() : "" }, when(s.updated_at)),
          h("td", { class: "mute" }, (s.last_text || "").slice(0, 80)),
        ),
      ),
    );
    if (!page.sessions.length) body.append(h("tr", {}, h("td", { colspan: 6, class: "mute" }, "no sessions")));
    info.textContent = `${page.total ? offset + 1 : 0}–${offset + page.sessions.length} of ${page.total}`;
    prev.disabled = offset === 0;
    next.disabled = offset + page.sessions.length >= page.total;
  };
  await load();
  keepLive(load, signal);
}

async function sessionView(signal, sid) {
  const snap = await api(`/v1/sessions/${enc(sid)}?history_limit=20`, { signal }).catch((e) => ({ error: e }));
  const turns = await api(`/v1/sessions/${enc(sid)}/turns?limit=${PAGE}`, { signal });
  const used = await api(`/v1/usage?session=${enc(sid)}&by=turn`, { signal }).catch(() => null);
  const perTurn = Object.fromEntries((used ? used.groups : []).map((g) => [g.group, g]));
  show(
    h("h1", {}, "Session ", h("code", {}, sid)),
    h("div", { class: "card kv" },
      snap.error
        ? h("span", { class: "error" }, snap.error.message)
        : [
            h("span", {}, h("b", {}, "agent"), snap.agent),
            h("span", {}, h("b", {}, "status"), badge(snap.status.replaceAll("_", " "), snap.status.startsWith("waiting") ? "waiting" : snap.status)),
            h("span", {}, h("b", {}, "turns done"), snap.turns_done),
            h("span", {}, h("b", {}, "queued"), snap.queued.length + snap.unaccepted),
            h("span", { id: "session-usage" }, h("b", {}, "usage"), used ? spent(used.total) : "—"),
          ],
      h("a", { href: `#/chat?session=${enc(sid)}${snap.agent ? "&agent=" + enc(snap.agent) : ""}` }, "chat in this session →"),
    ),
    h("h2", {}, `Turns (${turns.total}, newest first)`),
    h("table", { id: "turns" },
      h("thead", {}, h("tr", {}, ["turn", "status", "model steps", "tool calls", "tokens", "cost", "started", "error"].map((t) => h("th", {}, t)))),
      h("tbody", {},
        turns.turns.map((t) =>
          h("tr", { class: "clickable", "data-turn": t.turn_id, onclick: () => (location.hash = `#/turn/${enc(sid)}/${enc(t.turn_id)}`) },
            h("td", {}, h("code", {}, t.turn_id)),
            h("td", {}, badge(t.status)),
            h("td", {}, t.model_step + 1),
            h("td", {}, t.tool_calls_made),
            h("td", {}, perTurn[`${sid}/${t.turn_id}`] ? perTurn[`${sid}/${t.turn_id}`].tokens : ""),
            h("td", {}, perTurn[`${sid}/${t.turn_id}`]?.cost_usd ? `$${perTurn[`${sid}/${t.turn_id}`].cost_usd.toFixed(4)}` : ""),
            h("td", {}, when(t.started_at)),
            h("td", { class: "error" }, t.error || ""),
          ),
        ),
      ),
    ),
  );
}

// --- a turn's timeline -------------------------------------------------------------------

const KIND = {
  "turn.accepted": "turn", "turn.started": "turn", "turn.completed": "turn", "turn.failed": "bad",
  "turn.cancelled": "bad", "model.answered": "model", "model.usage": "model", "call.outcome": "call", "call.reconciled": "call",
  "approval.requested": "human", "approval.decided": "human", "question.asked": "human",
  "question.answered": "human", "timer.set": "timer", "timer.fired": "timer", "task.started": "call",
  "delegation.started": "call", "context.compacted": "model", "agent.run.crash_resumed": "crash",
  "agent.run.lost": "crash", "agent.run.checkpoint_rejected": "crash",
  "agent.run.step_dead_lettered": "crash",
};

function usage(u) {
  if (!u || !Object.keys(u).length) return h("span", { class: "usage mute" }, h("b", {}, "usage"), "not reported by the model");
  return h("span", { class: "usage" }, h("b", {}, "usage"), Object.entries(u).map(([k, v]) => `${k} ${v}`).join(" · "));
}

// The usage ledger's totals (/v1/usage, or summed from model.usage events): tokens and cost.
function spent(t) {
  if (!t || !t.calls) return "none recorded";
  const cost = t.cost_usd ? ` · $${t.cost_usd.toFixed(4)}` : "";
  const unpriced = t.unpriced_calls ? ` (${t.unpriced_calls} unpriced)` : "";
  return `${t.calls} model call(s) · ${t.input_tokens} in · ${t.output_tokens} out${cost}${unpriced}`;
}

function sumUsage(events) {
  const t = { calls: 0, input_tokens: 0, output_tokens: 0, cost_usd: 0, unpriced_calls: 0 };
  for (const e of events) {
    if (e.type !== "model.usage" || e.truncated) continue;
    t.calls += 1;
    t.input_tokens += e.data.input_tokens || 0;
    t.output_tokens += e.data.output_tokens || 0;
    if (e.data.cost_usd === null || e.data.cost_usd === undefined) t.unpriced_calls += 1;
    else t.cost_usd += e.data.cost_usd;
  }
  return t;
}

function field(name, value) {
  if (value === null || value === undefined || value === "") return null;
  return h("span", {}, h("b", {}, name), value instanceof Node ? value : String(value));
}

function decisionButtons(sid, approvalId, after) {
  if (!can("approve")) return h("span", { class: "mute", "data-no-approve": "" }, "needs a token with the approve scope");
  const reason = h("input", { placeholder: "reason (optional)", class: "reason" });
  const decide = async (approve, btn) => {
    btn.disabled = true;
    try {
      await api(`/v1/sessions/${enc(sid)}/approvals/${enc(approvalId)}`, { method: "POST", body: { approve, reason: reason.value || null } });
      after();
    } catch (err) {
      btn.disabled = false;
      alert(err.message);
    }
  };
  return h("span", { class: "actions" }, reason,
    h("button", { class: "approve", onclick: (e) => decide(true, e.target) }, "Approve"),
    h("button", { class: "danger reject", onclick: (e) => decide(false, e.target) }, "Reject"));
}

function answerBox(sid, questionId, after) {
  if (!can("write")) return h("span", { class: "mute" }, "needs a token with the write scope");
  const text = h("input", { placeholder: "your answer", class: "answer-text" });
  return h("form", { class: "actions", onsubmit: async (e) => {
    e.preventDefault();
    try {
      await api(`/v1/sessions/${enc(sid)}/questions/${enc(questionId)}`, { method: "POST", body: { answer: text.value } });
      after();
    } catch (err) {
      alert(err.message);
    }
  } }, text, h("button", { type: "submit", class: "answer" }, "Answer"));
}

function reconcileButtons(call, after) {
  if (!can("approve")) return h("span", { class: "mute" }, "reconciling needs the approve scope");
  const act = async (succeeded) => {
    if (!confirm(`Record ${call.tool} as ${succeeded ? "succeeded" : "failed"}? Check the vendor first.`)) return;
    try {
      await api(`/v1/calls/${enc(call.call_key)}/reconcile`, { method: "POST", body: { succeeded } });
      after();
    } catch (err) {
      alert(err.message);
    }
  };
  return h("span", { class: "actions" },
    h("button", { onclick: () => act(true) }, "It happened: mark succeeded"),
    h("button", { class: "danger", onclick: () => act(false) }, "It did not: mark failed"));
}

function eventBody(sid, ev, ctx) {
  const d = ev.data || {};
  if (ev.truncated) {
    const box = h("div", {}, h("pre", {}, d));
    box.append(h("button", { class: "secondary more", onclick: async (e) => {
      e.target.disabled = true;
      const whole = await api(`/v1/sessions/${enc(sid)}/events/${ev.seq}`);
      box.replaceChildren(eventBody(sid, whole, ctx));
    } }, `load the whole payload (${ev.size} bytes)`));
    return box;
  }
  const call = d.call_key ? ctx.calls[d.call_key] : null;
  switch (ev.type) {
    case "turn.accepted":
      return h("div", { class: "kv" }, field("request", d.request_id), d.queued ? field("queued", "behind another turn") : null);
    case "turn.started":
      return h("div", { class: "kv" }, field("agent", d.agent), field("request", d.request_id));
    case "model.answered":
      return h("div", {},
        h("div", { class: "kv" }, field("model step", d.model_step), usage(d.usage), d.text ? field("text", d.text) : null),
        (d.calls || []).map((c) => h("div", { class: "kv" }, field("→ call", c.tool), badge(c.effect), h("code", {}, JSON.stringify(c.args)))));
    case "model.usage":
      return h("div", { class: "kv" }, field("model step", d.model_step), field("attempt", d.attempt),
        d.purpose !== "answer" ? field("purpose", d.purpose) : null, field("model", d.model),
        field("tokens", `${d.input_tokens} in · ${d.output_tokens} out`),
        field("cost", d.cost_usd === null || d.cost_usd === undefined ? "no price for this model" : `$${d.cost_usd.toFixed(6)}`));
    case "call.outcome":
      return h("div", {},
        h("div", { class: "kv" }, field("tool", d.tool), badge(d.effect), badge(d.state), field("attempts", d.attempts),
          call ? field("idempotency key", h("code", {}, call.idempotency_key)) : null,
          field("duration", secs(ctx.callStart[d.call_key] ? ev.at - ctx.callStart[d.call_key] : null)),
          field("settlement", d.settlement), field("error", d.error)),
        d.state === "outcome_unknown" ? unknownBanner(call || { call_key: d.call_key, tool: d.tool }, ctx) : null);
    case "call.reconciled":
      return h("div", { class: "kv" }, field("call", h("code", {}, d.call_key)), badge(d.state), field("reconciled by", d.by), field("error", d.error));
    case "approval.requested":
      return h("div", {},
        h("div", { class: "kv" }, field("tool", d.tool), field("approval", h("code", {}, d.approval_id)), h("code", {}, JSON.stringify(d.args))),
        ctx.pending.has(d.approval_id) ? decisionButtons(sid, d.approval_id, ctx.reload) : null);
    case "approval.decided":
      return h("div", { class: "kv" }, badge(d.status), field("decided by", d.by), field("reason", d.reason));
    case "question.asked":
      return h("div", {}, h("div", { class: "kv" }, field("question", d.question)),
        ctx.open.has(d.question_id) ? answerBox(sid, d.question_id, ctx.reload) : null);
    case "question.answered":
      return h("div", { class: "kv" }, field("answer", d.answer), field("answered by", d.by));
    case "timer.set":
      return h("div", { class: "kv" }, field("due", d.at), field("call", h("code", {}, d.call_key)));
    case "timer.fired":
      return h("div", { class: "kv" }, field("late", secs(d.late_seconds)));
    case "context.compacted":
      return h("div", { class: "kv" }, field("covers", `${d.covers} history entries`), field("compaction", d.compaction), field("attempts", d.attempts));
    case "agent.run.crash_resumed":
      return h("div", { class: "kv" }, field("step", h("code", {}, d.step)), field("losses", d.losses), field("lost attempt", d.lost_attempt),
        field("lost worker", d.lost_worker), field("settled", Object.keys(d.settled || {}).length ? JSON.stringify(d.settled) : "nothing in doubt"));
    case "agent.run.lost":
      return h("div", { class: "kv" }, field("losses", d.losses), field("step", h("code", {}, d.step)));
    case "agent.run.checkpoint_rejected":
      return h("div", { class: "kv" }, field("key", d.key), field("reason", d.reason));
    case "agent.run.step_dead_lettered":
      return h("div", { class: "kv" }, field("step", h("code", {}, d.step)), field("reason", d.reason),
        field("dead letter", d.dead_letter));
    case "turn.completed":
      return h("div", {}, h("div", { class: "kv" }, field("model steps", d.model_steps), usage(d.usage)), d.text ? h("pre", {}, d.text) : null);
    case "turn.failed":
      return h("div", { class: "kv error" }, field("error", d.error));
    case "turn.cancelled":
      return h("div", { class: "kv" }, field("cancelled by", d.by));
    default:
      return h("pre", {}, json(d));
  }
}

function unknownBanner(call, ctx) {
  const reconciled = call.reconciled_by;
  return h("div", { class: "unknown-banner", "data-outcome-unknown": call.call_key },
    h("strong", {}, "⚠ OUTCOME UNKNOWN"), " — ",
    `${call.tool || "the tool"} was started and may or may not have taken effect; jetloop will not retry it. `,
    reconciled
      ? h("span", {}, `Reconciled by ${reconciled}.`)
      : h("span", {}, "Reconcile: check the vendor for idempotency key ",
          h("code", {}, call.idempotency_key || "?"), ", then record what happened. ",
          reconcileButtons(call, ctx.reload)));
}

async function timelineView(signal, sid, tid) {
  const events = [];
  let tl = null;
  let after = 0;
  const draw = () => {
    const calls = Object.fromEntries(tl.calls.map((c) => [c.call_key, c]));
    const ctx = {
      calls,
      callStart: {},
      pending: new Set(),
      open: new Set(),
      reload: () => refresh().catch(() => {}),
    };
    const decided = new Set(events.filter((e) => e.type === "approval.decided").map((e) => e.data.approval_id));
    const answered = new Set(events.filter((e) => e.type === "question.answered").map((e) => e.data.question_id));
    for (const e of events) {
      if (e.type === "approval.requested" && !decided.has(e.data.approval_id)) ctx.pending.add(e.data.approval_id);
      if (e.type === "question.asked" && !answered.has(e.data.question_id)) ctx.open.add(e.data.question_id);
      // A call runs from its plan (or its approval, answer, timer) to its outcome.
      if (e.type === "model.answered") (e.data.calls || []).forEach((c, i) => (ctx.callStart[`${sid}.${tid}.${e.data.model_step}.${i}`] = e.at));
      if (["approval.decided", "question.answered", "timer.fired"].includes(e.type) && e.data.call_key) ctx.callStart[e.data.call_key] = e.at;
    }
    const t = tl.turn || {};
    const start = events.length ? events[0].at : null;
    let prev = start;
    const unknown = tl.calls.filter((c) => c.state === "outcome_unknown");
    show(
      h("h1", {}, "Turn ", h("code", {}, tid), " of ", h("a", { href: `#/session/${enc(sid)}` }, sid)),
      h("div", { class: "card kv", id: "turn-summary" },
        field("status", h("span", { id: "turn-status" }, badge(t.status || "unknown"))),
        field("agent", t.agent), field("request", t.request_id), field("model steps", t.model_steps),
        field("duration", secs(t.ended_at && t.started_at ? t.ended_at - t.started_at : null)),
        field("cancelled by", t.cancelled_by), field("error", t.error),
        h("span", { id: "turn-usage" }, h("b", {}, "usage"), spent(sumUsage(events))),
        h("span", { class: "live" }, "live")),
      t.user_text ? h("div", { class: "card" }, h("b", {}, "user: "), t.user_text) : null,
      unknown.map((c) => unknownBanner(c, ctx)),
      h("h2", {}, `Calls (${tl.calls.length})`),
      h("table", { id: "calls" },
        h("thead", {}, h("tr", {}, ["step.call", "tool", "effect", "state", "attempts", "idempotency key", "waits", "settlement"].map((x) => h("th", {}, x)))),
        h("tbody", {}, tl.calls.map((c) => h("tr", { "data-call": c.call_key },
          h("td", {}, `${c.model_step}.${c.call_index}`), h("td", {}, c.tool), h("td", {}, c.effect ? badge(c.effect) : ""),
          h("td", {}, badge(c.state || "planned")), h("td", {}, c.attempts ?? ""), h("td", {}, h("code", {}, c.idempotency_key || "")),
          h("td", {}, c.approval_id ? "approval" : c.question_id ? "answer" : c.timer_due ? `timer ${clock(c.timer_due)}` : ""),
          h("td", {}, c.reconciled_by ? `reconciled by ${c.reconciled_by}` : c.settlement || ""))))),
      h("h2", {}, `Timeline (${events.length} events)`),
      h("ol", { class: "timeline", id: "timeline" },
        events.map((e) => {
          const dt = prev === null ? null : e.at - prev;
          prev = e.at;
          return h("li", { class: KIND[e.type] || "turn", "data-type": e.type, "data-seq": e.seq },
            h("div", { class: "mono", title: new Date(e.at * 1000).toISOString() }, clock(e.at), h("br"), h("span", { class: "mute" }, `+${secs(dt) || "0 ms"}`)),
            h("div", { class: "kind" }, e.type.replace("agent.run.", "")),
            eventBody(sid, e, ctx));
        })),
      tl.next_after ? h("button", { class: "secondary", onclick: () => more().then(draw) }, "load more events") : null,
    );
  };
  const more = async () => {
    tl = await api(`/v1/sessions/${enc(sid)}/turns/${enc(tid)}/timeline?after=${after}&limit=500`, { signal });
    events.push(...tl.events);
    if (tl.events.length) after = tl.events[tl.events.length - 1].seq;
  };
  const refresh = async () => {
    await more();
    while (tl.next_after && events.length < 2000) await more();
    draw();
  };
  // The read model may not have the turn yet (it was just sent): ask again a few times.
  for (let i = 0; ; i++) {
    try {
      await refresh();
      break;
    } catch (err) {
      if (!(err instanceof ApiError) || err.status !== 404 || i > 20) throw err;
      await new Promise((r) => setTimeout(r, 500));
    }
  }
  const soon = debounce(() => refresh().catch(() => {}), 300);
  const later = debounce(() => refresh().catch(() => {}), 1500);
  // The end of the turn, heard live, may reach the read model later than 1.5 s on a busy
  // machine: until the turn's row says it ended too, read again every second (20 s at most).
  const ENDS = ["turn.completed", "turn.failed", "turn.cancelled"];
  let catchingUp = false;
  const catchUp = async () => {
    if (catchingUp) return;
    catchingUp = true;
    for (let i = 0; i < 20 && !signal.aborted; i++) {
      await new Promise((r) => setTimeout(r, 1000));
      if (["completed", "failed", "cancelled"].includes((tl.turn || {}).status)) break;
      await refresh().catch(() => {});
    }
    catchingUp = false;
  };
  follow(`/v1/sessions/${enc(sid)}/events`, after, signal, (ev) => {
    if (!ev.data || ev.data.turn_id !== tid) return;
    soon();
    later();
    if (ENDS.includes(ev.data.type)) catchUp();
  });
}

// --- inbox -------------------------------------------------------------------------------

async function inboxView(signal, params) {
  const offset = Number(params.get("offset") || 0);
  const list = h("div", { id: "inbox" });
  const info = h("span", { class: "mute" });
  const older = h("button", { class: "secondary", onclick: () => (location.hash = `#/inbox?offset=${offset + PAGE}`) }, "older →");
  show(h("h1", {}, "Inbox ", h("span", { class: "live" }, "live")),
    h("p", { class: "mute" }, "Calls held for approval and questions the agents asked, across sessions, newest first.",
      can("write") || can("approve") ? [" Your decisions and answers are recorded as ", h("b", {}, me.name), "."] : " This token may only read."),
    list, h("div", { class: "pager" },
      h("button", { class: "secondary", disabled: offset === 0, onclick: () => (location.hash = `#/inbox?offset=${Math.max(0, offset - PAGE)}`) }, "← newer"),
      older, info));
  const load = async () => {
    const page = await api(`/v1/inbox?limit=${PAGE}&offset=${offset}`, { signal });
    info.textContent = `${page.total ? offset + 1 : 0}–${offset + page.items.length} of ${page.total}`;
    older.disabled = offset + page.items.length >= page.total;
    setCount(page.total);
    list.replaceChildren(...page.items.map((it) =>
      h("div", { class: "card item", "data-kind": it.kind, "data-session": it.session_id, "data-id": it.id },
        h("div", {},
          h("div", {}, badge(it.kind === "approval" ? "approval" : "question", "waiting"), " ",
            h("a", { href: `#/turn/${enc(it.session_id)}/${enc(it.turn_id || "")}` }, `${it.session_id} / ${it.turn_id}`),
            h("span", { class: "mute" }, ` · ${when(it.at)}`)),
          it.kind === "approval"
            ? h("div", { class: "kv" }, field("tool", it.tool), h("code", {}, JSON.stringify(it.args)))
            : h("div", {}, h("b", {}, "asks: "), it.question)),
        it.kind === "approval" ? decisionButtons(it.session_id, it.id, load) : answerBox(it.session_id, it.id, load))));
    if (!page.items.length) list.append(h("p", { class: "mute" }, "Nothing waits for a person."));
  };
  await load();
  keepLive(load, signal);
}

function setCount(n) {
  document.getElementById("inbox-count").textContent = n ? String(n) : "";
}

// --- chat --------------------------------------------------------------------------------

async function chatView(signal, params) {
  const sid = params.get("session") || `web-${Math.random().toString(36).slice(2, 8)}`;
  const agent = params.get("agent") || "demo";
  const log = h("div", { class: "chat-log", id: "chat-log" });
  const text = h("textarea", { id: "chat-text", placeholder: "message (try: close ticket T-1, or: ask me what colour)" });
  const agentIn = h("input", { id: "chat-agent", value: agent, size: 10 });
  const sidIn = h("input", { id: "chat-session", value: sid, size: 18 });
  const mine = new Set();
  let following = false;
  const send = async (e) => {
    e.preventDefault();
    if (!text.value.trim()) return;
    const msg = text.value;
    text.value = "";
    log.append(h("div", { class: "msg user" }, msg));
    try {
      const out = await api(`/v1/agents/${enc(agentIn.value)}/sessions/${enc(sidIn.value)}/messages`, { method: "POST", body: { text: msg } });
      mine.add(out.turn_id);
      log.append(h("div", { class: "msg step" }, "turn ", h("a", { href: `#/turn/${enc(sidIn.value)}/${enc(out.turn_id)}`, class: "turn-link" }, out.turn_id), ` ${out.status}`));
      flush();
      if (!following) startFollowing();
    } catch (err) {
      log.append(h("div", { class: "msg step error" }, err.message));
    }
  };
  show(
    h("h1", {}, "Chat"),
    h("form", { class: "card", onsubmit: send },
      h("div", { class: "toolbar" }, "agent", agentIn, "session", sidIn),
      text, h("div", { class: "toolbar" }, h("button", { type: "submit", id: "chat-send", disabled: !can("write") }, "Send"),
        can("write") ? null : h("span", { class: "mute" }, "sending needs the write scope"))),
    log);
  const startFollowing = async () => {
    following = true;
    // From the session's current end: a long session's past is not replayed.
    let after = 0;
    try {
      const page = await api(`/v1/sessions?q=${enc(sidIn.value)}&limit=200`, { signal });
      const row = page.sessions.find((s) => s.session_id === sidIn.value);
      if (row) after = row.last_seq;
    } catch (err) { /* no read model yet: from the start */ }
    follow(`/v1/sessions/${enc(sidIn.value)}/events`, after, signal, (ev) => {
      // The stream may tell of a turn before the send's answer names it: kept until then.
      if (mine.has(ev.data.turn_id)) render(ev);
      else if (early.push(ev) > 500) early.shift();
    });
  };
  // Events of turns this page has not been told of yet (the send's answer may come after).
  let early = [];
  const flush = () => {
    const now = early.filter((e) => mine.has(e.data.turn_id));
    early = early.filter((e) => !mine.has(e.data.turn_id));
    now.forEach(render);
  };
  // Buttons used once: a decision or an answer sent from here takes them away (the log
  // then tells what was recorded).
  const once = (make) => {
    const el = make(() => el.remove());
    return el;
  };
  const render = (ev) => {
      const d = ev.data;
      const x = d.data || {};
      if (ev.type === "turn.completed") log.append(h("div", { class: "msg agent" }, x.text || "(answer in the blob store: open the turn)"));
      else if (ev.type === "approval.requested")
        log.append(h("div", { class: "msg step" }, `${x.tool} waits for approval `, once((after) => decisionButtons(d.session_id, x.approval_id, after))));
      else if (ev.type === "question.asked")
        log.append(h("div", { class: "msg agent" }, x.question, once((after) => answerBox(d.session_id, x.question_id, after))));
      else if (ev.type === "approval.decided") log.append(h("div", { class: "msg step" }, `${x.status} by ${x.by}${x.reason ? ": " + x.reason : ""}`));
      else if (ev.type === "question.answered") log.append(h("div", { class: "msg user" }, x.answer));
      else if (ev.type === "turn.failed") log.append(h("div", { class: "msg step error" }, `failed: ${x.error}`));
      else if (ev.type === "call.outcome") log.append(h("div", { class: "msg step" }, `${x.tool}: ${x.state}`));
      else log.append(h("div", { class: "msg step" }, ev.type));
  };
  if (params.get("session")) startFollowing();
  text.focus();
}

// --- operations --------------------------------------------------------------------------

// Prometheus text → {name{labels}: value} of the families we draw.
function parseMetrics(text) {
  let steps = 0;
  const buckets = new Map();
  let count = 0;
  for (const line of text.split("\n")) {
    if (line.startsWith("jetloop_steps_total{")) steps += Number(line.split(" ").pop());
    else if (line.startsWith("jetloop_step_seconds_bucket{")) {
      const le = line.match(/le="([^"]+)"/)[1];
      buckets.set(le, (buckets.get(le) || 0) + Number(line.split(" ").pop()));
    } else if (line.startsWith("jetloop_step_seconds_count{")) count += Number(line.split(" ").pop());
  }
  return { steps, buckets, count, at: performance.now() / 1000 };
}

function quantile(prev, cur, q) {
  const n = cur.count - prev.count;
  if (n <= 0) return null;
  const les = [...cur.buckets.keys()].map((k) => [k, k === "+Inf" ? Infinity : Number(k)]).sort((a, b) => a[1] - b[1]);
  let lower = 0, below = 0;
  for (const [key, le] of les) {
    const c = cur.buckets.get(key) - (prev.buckets.get(key) || 0);
    if (c >= q * n) {
      if (le === Infinity) return lower;
      const inBucket = c - below;
      return inBucket > 0 ? lower + ((q * n - below) / inBucket) * (le - lower) : le;
    }
    below = c;
    lower = le;
  }
  return lower;
}

const SVG = "http://www.w3.org/2000/svg";
function chart(series, unit) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 300 100");
  svg.setAttribute("preserveAspectRatio", "none");
  const all = series.flatMap((s) => s.points.filter((v) => v !== null));
  const max = Math.max(1e-9, ...all) * 1.1;
  for (const s of series) {
    // Right-aligned: the newest sample at the right edge, 2 s apart.
    const n = s.points.length;
    const pts = s.points.map((v, i) => (v === null ? null : `${300 - ((n - 1 - i) * 300) / 59},${100 - (v / max) * 100}`)).filter(Boolean);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", s.color);
    line.setAttribute("stroke-width", "2");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
  }
  const last = series.map((s) => {
    const v = [...s.points].reverse().find((x) => x !== null);
    return h("span", { class: s.cls }, `${s.name} ${v === undefined ? "—" : unit(v)}  `);
  });
  return [svg, h("div", { class: "legend" }, ...last, h("span", {}, ` (max ${unit(max / 1.1)}, last 2 min)`))];
}

async function opsView(signal, params) {
  const before = params.get("before");
  const rate = [], p50 = [], p99 = [];
  const charts = h("div", { class: "charts", id: "charts" });
  const figures = h("div", { id: "ops-figures" });
  const dead = h("div", { id: "dead-letters" });
  show(h("h1", {}, "Operations"), h("h2", {}, "Steps (from /metrics, every 2 s)"), charts, figures, h("h2", {}, "Dead letters"), dead);
  let prev = null;
  const sample = async () => {
    const res = await fetch("/metrics", { signal });
    const cur = parseMetrics(await res.text());
    if (prev) {
      const dt = cur.at - prev.at;
      rate.push(dt > 0 ? (cur.steps - prev.steps) / dt : 0);
      p50.push(quantile(prev, cur, 0.5));
      p99.push(quantile(prev, cur, 0.99));
      for (const a of [rate, p50, p99]) while (a.length > 60) a.shift();
    }
    prev = cur;
    charts.replaceChildren(
      h("div", { class: "card chart" }, h("b", {}, "steps/s"), ...chart([{ name: "steps/s", points: rate, color: "#12805c", cls: "rate" }], (v) => v.toFixed(1))),
      h("div", { class: "card chart" }, h("b", {}, "step latency"), ...chart([
        { name: "p50", points: p50, color: "#2855d8", cls: "p50" },
        { name: "p99", points: p99, color: "#c0262d", cls: "p99" }], (v) => secs(v))));
  };
  const loadFigures = async () => {
    const ops = await api("/v1/operations", { signal });
    fill(figures,
      h("h2", {}, `Workers (${ops.workers.length})`),
      h("table", { id: "workers" }, h("thead", {}, h("tr", {}, ["worker", "agents", "pools", "since", "release"].map((x) => h("th", {}, x)))),
        h("tbody", {}, ops.workers.map((w) => h("tr", {}, h("td", {}, h("code", {}, w.worker_id)), h("td", {}, w.agents.join(", ")),
          h("td", {}, w.pools.join(", ")), h("td", {}, when(w.since)), h("td", {}, w.release ?? "before 0.2.0"))))),
      h("p", { class: "mute" }, `Agents ever served: ${ops.agents.join(", ") || "none"}. Read model at JL_EVENTS #${ops.readmodel_position ?? "—"} of #${(ops.streams.find((s) => s.name === "JL_EVENTS") || {}).last_seq ?? "—"}.`),
      h("h2", {}, "Consumers (lag = messages not yet delivered)"),
      h("table", { id: "consumers" }, h("thead", {}, h("tr", {}, ["consumer", "stream", "lag", "ack pending", "redelivered"].map((x) => h("th", {}, x)))),
        h("tbody", {}, ops.consumers.map((c) => h("tr", {}, h("td", {}, h("code", {}, c.name)), h("td", {}, c.stream),
          h("td", { class: c.pending ? "error" : "" }, c.pending), h("td", {}, c.ack_pending), h("td", {}, c.redelivered))))));
  };
  const loadDead = async () => {
    const page = await api(`/v1/dead-letters?limit=20${before ? "&before=" + enc(before) : ""}`, { signal });
    fill(dead,
      h("p", { class: "mute" }, `${page.total} in JL_DEAD, newest first.`),
      ...page.letters.map((l) => {
        const body = h("pre", {}, json(l.body));
        return h("div", { class: "card dead-letter", "data-seq": l.seq },
          h("div", { class: "kv" }, field("#", l.seq), field("time", l.time), field("subject", h("code", {}, l.subject)),
            field("from", `${l.stream || "?"} #${l.stream_seq || "?"}`)),
          h("div", { class: "error reason" }, h("b", {}, "reason: "), l.reason),
          body,
          l.truncated ? h("button", { class: "secondary", onclick: async () => body.replaceChildren(json((await api(`/v1/dead-letters/${l.seq}`)).body)) }, `whole message (${l.size} bytes)`) : null);
      }),
      page.next_before ? h("a", { href: `#/ops?before=${page.next_before}` }, "older dead letters →") : null);
  };
  await Promise.all([sample(), loadFigures(), loadDead()]);
  const tick = setInterval(() => {
    if (signal.aborted) return clearInterval(tick);
    sample().catch(() => {});
    loadFigures().catch(() => {});
  }, 2000);
}

// --- routing -----------------------------------------------------------------------------

const ROUTES = [
  [/^#\/sessions$/, (s, p) => sessionsView(s, p), "sessions"],
  [/^#\/session\/([^/]+)$/, (s, p, m) => sessionView(s, decodeURIComponent(m[1])), "sessions"],
  [/^#\/turn\/([^/]+)\/([^/]+)$/, (s, p, m) => timelineView(s, decodeURIComponent(m[1]), decodeURIComponent(m[2])), "sessions"],
  [/^#\/inbox$/, (s, p) => inboxView(s, p), "inbox"],
  [/^#\/chat$/, (s, p) => chatView(s, p), "chat"],
  [/^#\/ops$/, (s, p) => opsView(s, p), "ops"],
];

async function route() {
  if (!me) return;
  if (current) current.abort();
  current = new AbortController();
  const signal = current.signal;
  const [path, query] = (location.hash || "#/sessions").split("?");
  const params = new URLSearchParams(query || "");
  for (const [re, open, page] of ROUTES) {
    const m = path.match(re);
    if (!m) continue;
    for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
    show(h("p", { class: "mute" }, "loading…"));
    document.body.dataset.page = page;
    try {
      await open(signal, params, m);
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) return signOut();
      show(h("div", { class: "card error", role: "alert" }, err.message));
    }
    return;
  }
  location.hash = "#/sessions";
}

// A choice of namespace, when the token holds more than one.
async function namespaceChoice() {
  const held = await api("/v1/namespaces").then((r) => r.namespaces).catch(() => []);
  const chosen = sessionStorage.getItem(NAMESPACE_KEY);
  if (chosen && !held.includes(chosen)) sessionStorage.removeItem(NAMESPACE_KEY);
  if (held.length < 2) return null;
  const current = sessionStorage.getItem(NAMESPACE_KEY) || held[0];
  return h("select", {
    id: "namespace",
    "aria-label": "namespace",
    onchange: (e) => {
      sessionStorage.setItem(NAMESPACE_KEY, e.target.value);
      // What was open belongs to the other namespace: its sessions instead (no hashchange).
      history.replaceState(null, "", "#/sessions");
      start();
    },
  }, held.map((ns) => h("option", { value: ns, selected: ns === current }, ns)));
}

async function start() {
  document.getElementById("nav").hidden = false;
  fill(document.getElementById("who"),
    await namespaceChoice(),
    h("span", { id: "whoami" }, me.name, " · ", me.scopes.join(", ")),
    h("button", { onclick: signOut, id: "signout" }, "Sign out"));
  // The inbox's count in the menu, whatever page is open (one row read, now and then).
  const count = () => (me ? api("/v1/inbox?limit=1").then((p) => setCount(p.total)).catch(() => {}) : null);
  count();
  clearInterval(window.jetloopCount);
  window.jetloopCount = setInterval(count, 10000);
  route();
}

async function boot() {
  try {
    if (await signIn()) return start();
    showSignIn();
  } catch (err) {
    showSignIn(err.message);
  }
}

window.addEventListener("hashchange", route);
boot();
