// A jetloop client in Node.js, written from docs/protocol.md alone (no jetloop code).
//
//   JL_NATS_URL=nats://client:<password>@127.0.0.1:4222 JL_AGENT=demo node conformance.mjs
//
// The credential decides the namespace (docs/protocol.md, "Namespaces"): with the one of
// <store>/namespaces/<ns>.json (user <ns>.client) everything below happens in <ns>.
//
// Against `jetloop up` (the demo agent): publish a turn (JSON body, scoped Nats-Msg-Id), a
// duplicate, follow the session's events to the answer, a turn held for approval and approved
// over jl.control.approve.<who> (the same decision again returns it, a conflicting one is 409,
// the decider is the credential's user), a snapshot over jl.control.snapshot.<who>, the turn record from the jl_state bucket, an answer too
// large to travel inline fetched from jl_blobs, and dead letters (an invalid body, an unscoped
// request id, a body that is neither msgpack nor JSON, with its headers kept). Prints one JSON
// line per check and exits 0 when all pass; 1 (with the reason) otherwise.
// tests/test_conformance.py runs it.

import { decode } from "@msgpack/msgpack";
import { AckPolicy, jetstream, jetstreamManager } from "@nats-io/jetstream";
import { Kvm } from "@nats-io/kv";
import { Objm } from "@nats-io/obj";
import { connect, headers } from "@nats-io/transport-node";

const url = process.env.JL_NATS_URL ?? "nats://127.0.0.1:4222";
const agent = process.env.JL_AGENT ?? "demo";
const session = process.env.JL_SESSION ?? `node-${Date.now().toString(36)}`;
const deadline = Date.now() + Number(process.env.JL_TIMEOUT_MS ?? 60000);

function check(name, ok, detail = {}) {
  console.log(JSON.stringify({ check: name, ok: Boolean(ok), ...detail }));
  if (!ok) throw new Error(`check failed: ${name} ${JSON.stringify(detail)}`);
}

function left() {
  const ms = deadline - Date.now();
  if (ms <= 0) throw new Error("out of time");
  return ms;
}

const parsed = new URL(url);
const natsUser = parsed.username ? decodeURIComponent(parsed.username) : "client";
// <namespace>.<who>, or a role of the default namespace (docs/protocol.md, "Namespaces").
const who = natsUser.includes(".") ? natsUser.slice(natsUser.indexOf(".") + 1) : natsUser;
const nc = await connect({
  servers: `${parsed.hostname}:${parsed.port || 4222}`,
  user: parsed.username ? decodeURIComponent(parsed.username) : undefined,
  pass: parsed.password ? decodeURIComponent(parsed.password) : undefined,
  name: "jetloop-conformance-node",
  // The `client` role hears only its own inboxes (docs/protocol.md, "Connecting").
  inboxPrefix: "_INBOX_client",
});
const js = jetstream(nc);
const enc = new TextEncoder();
const dec = new TextDecoder();

// --- Sending: jl.turn.<agent>.<session>, Nats-Msg-Id = <session>.<request id> -------------
async function send(requestId, body, msgId = `${session}.${requestId}`, extra = {}) {
  const h = headers();
  h.set("Nats-Msg-Id", msgId);
  for (const [k, v] of Object.entries(extra)) h.set(k, v);
  const data = typeof body === "string" ? enc.encode(body) : enc.encode(JSON.stringify(body));
  return js.publish(`jl.turn.${agent}.${session}`, data, { headers: h });
}

// --- Following: an unnamed (ephemeral) consumer on JL_EVENTS, filtered to jl.event.<session>.>
const events = []; // every event and history entry of the session, in stream order
const waiters = [];
const jsm = await jetstreamManager(nc);
// Made without a name: the `client` role may create consumers only that way.
async function ephemeral(stream, filter) {
  const made = await jsm.consumers.add(stream, {
    filter_subjects: [filter],
    ack_policy: AckPolicy.None,
    inactive_threshold: 30_000_000_000,
    mem_storage: true,
    num_replicas: 1,
  });
  return js.consumers.get(stream, made.name);
}
const consumer = await ephemeral("JL_EVENTS", `jl.event.${session}.>`);
const messages = await consumer.consume();
// The log's layout: JL_EVENTS's metadata `jetloop_log` (absent: separate). Folded, a history
// entry carries the events that tell the same fact in `events`; read either way, a message
// on jl.event.<session>.history.<role> yields its `events`, any other message is an event.
const layout = (await jsm.streams.info("JL_EVENTS")).config.metadata?.jetloop_log ?? "separate";
console.log(JSON.stringify({ layout }));
function told(body) {
  for (const w of [...waiters]) {
    if (w.test(body)) {
      waiters.splice(waiters.indexOf(w), 1);
      w.resolve(body);
    }
  }
}
const following = (async () => {
  for await (const m of messages) {
    const body = decode(m.data);
    events.push({ subject: m.subject, seq: m.seq, body });
    told(body);
    if (m.subject.split(".")[3] === "history") {
      for (const ev of body.events ?? []) {
        events.push({ subject: `jl.event.${session}.${ev.type}`, seq: m.seq, body: ev });
        told(ev);
      }
    }
  }
})();

function waitFor(test, what) {
  const found = events.find((e) => test(e.body));
  if (found) return Promise.resolve(found.body);
  return new Promise((resolve, reject) => {
    const w = { test, resolve };
    waiters.push(w);
    // unref: a pending timer must not keep the process alive once the checks are done
    setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), left()).unref();
  });
}

const accepted = (rid) =>
  waitFor((e) => e.type === "turn.accepted" && e.data?.request_id === rid, `accepted ${rid}`);
const ended = (tid) =>
  waitFor(
    (e) => ["turn.completed", "turn.failed", "turn.cancelled"].includes(e.type) && e.turn_id === tid,
    `end of ${tid}`,
  );

// --- Control: JSON request/reply on jl.control.<op>.<who> ---------------------------------
async function control(op, request) {
  const reply = await nc.request(`jl.control.${op}.${who}`, JSON.stringify(request), {
    timeout: Math.min(10000, left()),
  });
  return JSON.parse(dec.decode(reply.data));
}

try {
  // 1. A turn, and its duplicate.
  const first = await send("r-1", { text: "create ticket node printer" });
  check("publish", first.duplicate === false && first.stream === "JL_TURNS", { seq: first.seq });
  const again = await send("r-1", { text: "create ticket node printer" });
  check("duplicate", again.duplicate === true && again.seq === first.seq);

  const acc = await accepted("r-1");
  const tid = acc.turn_id;
  check("turn.accepted names the turn", typeof tid === "string" && tid.length > 1, { tid });
  const done = await ended(tid);
  check("answer", done.type === "turn.completed" && /create_ticket/.test(done.data.text ?? ""), {
    text: done.data.text,
  });
  check("turn.started before the end", events.some((e) => e.body.type === "turn.started" && e.body.turn_id === tid));
  const user = events.find((e) => e.subject === `jl.event.${session}.history.user` && e.body.turn_id === tid);
  check("history entry", user?.body.role === "user" && user.body.text === "create ticket node printer");

  // 2. A call held for approval, approved over the control API.
  await send("r-2", { text: "close T-1" });
  const tid2 = (await accepted("r-2")).turn_id;
  const asked = await waitFor(
    (e) => e.type === "approval.requested" && e.turn_id === tid2,
    "approval.requested",
  );
  check("approval.requested", asked.data.tool === "close_ticket" && asked.data.approval_id, asked.data);
  const decided = await control("approve", {
    session_id: session,
    approval_id: asked.data.approval_id,
    by: "node",
  });
  check("approve", decided.ok === true && decided.result.status === "approved", { reply: decided });
  // Every request is idempotent and the first decision wins: the same decision again returns
  // the recorded one; another one is 409 (not possible now: already decided otherwise).
  const repeat = await control("approve", { session_id: session, approval_id: asked.data.approval_id });
  // Who decided is the credential's user, not the body's "by".
  check("same decision repeats", repeat.ok === true && repeat.result.status === "approved" &&
    repeat.result.decided_by === natsUser, { reply: repeat });
  const conflict = await control("reject", { session_id: session, approval_id: asked.data.approval_id });
  check("conflicting decision is 409", conflict.ok === false && conflict.error?.status === 409,
    { reply: conflict });
  const done2 = await ended(tid2);
  check("approved call ran", done2.type === "turn.completed" && /close_ticket/.test(done2.data.text ?? ""));
  const outcome = events.find((e) => e.body.type === "call.outcome" && e.body.turn_id === tid2);
  check("call.outcome", outcome?.body.data.state === "succeeded", outcome?.body.data);

  // 3. Reading state: the snapshot over control, and a record from jl_state.
  const snap = await control("snapshot", { session_id: session });
  // turns_done counts a turn once the session moved on, just after its end event: not checked.
  check(
    "snapshot",
    snap.ok && snap.result.session_id === session && snap.result.agent === agent &&
      snap.result.turn?.turn_id === tid2 && snap.result.turn.status === "completed",
    { status: snap.result?.status },
  );
  const missing = await control("snapshot", { session_id: "no-such-session-node" });
  check("control error", missing.ok === false && missing.error.status === 404, { reply: missing });
  const kv = await new Kvm(nc).open("jl_state");
  const entry = await kv.get(`turn.${session}.${tid}`);
  const record = decode(entry.value);
  check("turn record", record.status === "completed" && record.request_id === "r-1", {
    status: record.status,
  });

  // 4. An answer too large to travel inline: text_ref, fetched from jl_blobs.
  const big = "x".repeat(70 * 1024);
  await send("r-3", { text: big });
  const tid3 = (await accepted("r-3")).turn_id;
  const done3 = await ended(tid3);
  const ref = done3.data.text_ref;
  check("text_ref", done3.type === "turn.completed" && ref && !done3.data.text, { ref });
  const blob = await (await new Objm(nc).open("jl_blobs")).getBlob(ref.blob);
  check("blob", blob.length === ref.size && dec.decode(blob).includes(big));

  // 5. Dead letters: an invalid body, an unscoped request id, and a body that is neither
  // msgpack nor JSON (its first byte is not `{`) with a header of our own.
  await send("bad-body", { text: 5 });
  // Unique per run, or the stream itself would drop it as a repeat of an earlier run's: the
  // very collision the scoped form prevents.
  await send("unscoped", { text: "never runs" }, `r-4-of-${session}`);
  await send("not-msgpack", "plain text, not msgpack", undefined, { "X-Conformance": "kept" });
  const dead = [];
  const deadConsumer = await ephemeral("JL_DEAD", `jl.dead.jl.turn.${agent}.${session}`);
  while (dead.length < 3) {
    const m = await deadConsumer.next({ expires: Math.min(5000, left()) });
    if (m) dead.push(m);
  }
  const reasons = dead.map((m) => m.headers.get("Jl-Dead-Reason"));
  check(
    "dead letters",
    dead.every((m) => m.headers.get("Jl-Dead-Stream") === "JL_TURNS") &&
      dead.every((m) => m.headers.get("Jl-Dead-Subject") === `jl.turn.${agent}.${session}`) &&
      reasons.some((r) => /TurnRequest invalid at text/.test(r)) &&
      reasons.some((r) => r.includes(`${session}.<request id>`)),
    { reasons },
  );
  // Original headers are kept; the original Nats-Msg-Id as Jl-Dead-Msg-Id.
  const text = dead.find((m) => m.headers.get("Jl-Dead-Msg-Id") === `${session}.not-msgpack`);
  const why = text?.headers.get("Jl-Dead-Reason") ?? "";
  check(
    "dead letter keeps headers",
    text?.headers.get("X-Conformance") === "kept" && dec.decode(text.data) === "plain text, not msgpack" &&
      /^body is not msgpack: \S/.test(why),
    { reason: why },
  );
  console.log(JSON.stringify({ conformance: "passed", session }));
} catch (err) {
  console.log(JSON.stringify({ conformance: "failed", error: String(err?.message ?? err) }));
  process.exitCode = 1;
} finally {
  messages.stop();
  await following.catch(() => {});
  await nc.close();
}
