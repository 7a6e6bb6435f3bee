// The chat: streamed answers, and under each one the feedback the server learns from (👍 / 👎 with a comment, an
// edit that becomes a correction, a regenerated second answer to choose from), with each entry's state kept live.
import { api, chosenModel, models, notice, settings, setupBar, streamChat } from "./api.js";

const log = document.getElementById("log");
const prompt = document.getElementById("prompt");
const form = document.getElementById("composer");
const POLL_MS = 1500;
const FINAL = new Set(["trained", "skipped"]);

let turns = []; // {role: "user", text} | an assistant Turn
let busy = false;
const pending = new Set(); // feedback entries whose state may still change

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== false && value != null) node.setAttribute(name, value === true ? "" : value);
  }
  node.append(...children);
  return node;
}

function setBusy(value) {
  busy = value;
  for (const b of document.querySelectorAll("[data-needs-idle]")) b.disabled = value;
}

function messagesBefore(turn) {
  const out = [];
  for (const t of turns) {
    if (t === turn) break;
    out.push(t.role === "user" ? { role: "user", content: t.text } : { role: "assistant", content: t.chosen.text });
  }
  return out;
}

function versionOf(fingerprint) {
  const m = /^alchemist-v(\d+)$/.exec(fingerprint || "");
  return m ? Number(m[1]) : null;
}

// --- one answer, streamed ---------------------------------------------------------------------------------------

function answerView(label) {
  const answer = { id: null, text: "", version: null };
  answer.textEl = h("p", { class: "text" });
  answer.versionEl = h("span", { class: "version", hidden: true });
  answer.adapterEl = h("span", { class: "adapter", hidden: true });
  answer.labelEl = h("div", { class: "answer-label", hidden: !label }, label || "");
  answer.chooseEl = h("button", { type: "button", hidden: true, class: "choose" });
  answer.el = h("div", { class: "bubble answer", "aria-busy": "true" },
    answer.labelEl, answer.textEl, h("div", { class: "meta" }, answer.adapterEl, answer.versionEl), answer.chooseEl);
  return answer;
}

async function stream(turn, answer) {
  const s = settings();
  const [base] = await models();
  const body = { model: await chosenModel(), messages: turn.messages, max_tokens: s.maxTokens, temperature: s.temperature,
                 alchemist: { record: true } }; // recorded: feedback on it trains by replaying this prefill
  performance.mark("alchemist:send");
  let painted = false;
  for await (const chunk of streamChat(body)) {
    answer.id = chunk.id;
    answer.el.dataset.responseId = chunk.id;
    if (chunk.model && chunk.model !== base && answer.adapterEl.hidden) { // a named adapter answered
      answer.adapterEl.textContent = chunk.model;
      answer.adapterEl.title = `Written by the adapter ${chunk.model}`;
      answer.adapterEl.hidden = false;
    }
    const version = versionOf(chunk.system_fingerprint);
    if (version !== null && version !== answer.version) {
      answer.version = version;
      answer.versionEl.textContent = `v${version}`;
      answer.versionEl.title = version ? `Written by adapter version ${version}` : "Written by the base model (v0)";
      answer.versionEl.hidden = false;
    }
    const delta = chunk.choices[0]?.delta?.content;
    if (delta) {
      answer.text += delta;
      answer.textEl.textContent = answer.text;
      if (!painted) {
        painted = true; // the frame after this one shows the first words (bench ui reads the mark)
        requestAnimationFrame(() => setTimeout(() => performance.mark("alchemist:painted")));
      }
    }
  }
  answer.el.removeAttribute("aria-busy");
}

// --- an assistant turn: answers, actions, feedback --------------------------------------------------------------

function turnView(turn) {
  turn.answersEl = h("div", { class: "answers" });
  turn.statesEl = h("ul", { class: "states", role: "status", "aria-label": "Feedback" });
  const button = (label, title, onclick, extra = {}) =>
    h("button", { type: "button", title, onclick, "data-needs-idle": true, ...extra }, label);
  turn.buttons = {
    up: button("✓ Good", "Good answer", () => openForm(turn, "up"), { "aria-label": "Good answer" }),
    down: button("✗ Bad", "Bad answer", () => openForm(turn, "down"), { "aria-label": "Bad answer" }),
    edit: button("Edit", "Edit the answer (a correction)", () => openForm(turn, "edit"), { class: "edit" }),
    regen: button("Regenerate", "Regenerate and choose the better answer", () => regenerate(turn)),
  };
  turn.actionsEl = h("div", { class: "actions" }, ...Object.values(turn.buttons));
  turn.formEl = feedbackForm(turn);
  turn.el = h("article", { class: "turn assistant" }, turn.answersEl, turn.statesEl, turn.actionsEl, turn.formEl);
  return turn;
}

function feedbackForm(turn) {
  const comment = h("input", { name: "comment", autocomplete: "off" });
  const correction = h("textarea", { name: "correction", rows: 3 });
  const correctionLabel = h("label", {}, "How it should read (optional: a correction)", correction);
  const cancel = h("button", { type: "button", onclick: () => closeForm(turn) }, "Cancel");
  const el = h("form", { class: "feedback-form", hidden: true, "aria-label": "Feedback" },
    h("label", {}, "Comment (optional)", comment), correctionLabel,
    h("div", { class: "row" }, h("button", { type: "submit", class: "primary" }, "Send feedback"), cancel));
  el.addEventListener("submit", (e) => { e.preventDefault(); sendForm(turn); });
  el.addEventListener("keydown", (e) => {
    if (e.key === "Escape") closeForm(turn);
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); sendForm(turn); }
  });
  Object.assign(turn, { comment, correction, correctionLabel });
  return el;
}

function openForm(turn, mode) {
  turn.mode = mode;
  turn.opener = turn.buttons[mode];
  for (const [name, b] of Object.entries(turn.buttons)) b.setAttribute("aria-pressed", String(name === mode));
  turn.comment.value = "";
  turn.correctionLabel.hidden = mode === "up";
  turn.correction.value = mode === "edit" ? turn.chosen.text : "";
  turn.formEl.hidden = false;
  (mode === "up" ? turn.comment : turn.correction).focus();
}

function closeForm(turn) {
  turn.formEl.hidden = true;
  for (const b of Object.values(turn.buttons)) b.setAttribute("aria-pressed", "false");
  turn.opener?.focus();
}

async function sendForm(turn) {
  const body = { response_id: turn.chosen.id };
  if (turn.mode !== "edit") body.rating = turn.mode === "up" ? 1 : -1;
  const comment = turn.comment.value.trim();
  if (comment) body.comment = comment;
  const correction = turn.correction.value.trim();
  if (turn.mode !== "up" && correction && correction !== turn.chosen.text.trim()) body.correction = correction;
  if (turn.mode === "edit" && !body.correction) { notice("Change the answer to send it as a correction."); return; }
  const label = body.correction ? "correction" : body.rating === 1 ? "good" : "bad";
  if (await sendFeedback(turn, body, label)) {
    if (body.correction) {
      turn.chosen.text = body.correction; // the conversation continues from the corrected answer
      turn.chosen.textEl.textContent = body.correction;
    }
    closeForm(turn);
  }
}

async function sendFeedback(turn, body, label) {
  try {
    const entry = await api("/v1/feedback", { method: "POST", body });
    notice("");
    const view = { id: entry.id, label, el: h("li", { class: "state", "data-feedback-id": entry.id }) };
    turn.statesEl.append(view.el);
    showState(view, entry);
    return true;
  } catch (e) {
    notice(`Feedback not sent: ${e.message}`);
    return false;
  }
}

function showState(view, entry) {
  const state = entry.state || "queued";
  const text = state === "trained" ? `trained in v${entry.trained_version}`
    : state === "skipped" ? `skipped${entry.skip_reason ? `: ${entry.skip_reason}` : ""}`
    : state === "quarantined" ? "held for review (its loss looked wrong)" : "queued";
  view.el.className = `state ${state}`;
  view.el.dataset.state = state;
  view.el.textContent = `${view.label} · ${text}`;
  if (FINAL.has(state)) pending.delete(view); else pending.add(view);
}

async function poll() {
  for (const view of [...pending]) {
    try {
      showState(view, await api(`/v1/feedback/${encodeURIComponent(view.id)}`));
    } catch (e) {
      if (e.status === 404) pending.delete(view); // a server without the endpoint: the state stays as sent
    }
  }
  setTimeout(poll, POLL_MS);
}

// --- asking, regenerating, choosing -----------------------------------------------------------------------------

async function ask(text) {
  document.getElementById("empty")?.remove();
  const user = { role: "user", text };
  turns.push(user);
  const userEl = h("div", { class: "turn user" }, h("p", { class: "bubble text" }, text));
  log.append(userEl);
  const turn = turnView({ role: "assistant" });
  turn.messages = messagesBefore(null); // every turn so far, this question last
  turn.chosen = answerView();
  turn.answersEl.append(turn.chosen.el);
  turns.push(turn);
  log.append(turn.el);
  turn.el.scrollIntoView({ block: "end" });
  if (!(await run(() => stream(turn, turn.chosen))) && !turn.chosen.id) {
    turns.splice(-2); // nothing was answered: the question goes back to the box
    userEl.remove();
    turn.el.remove();
    prompt.value = text;
  }
}

async function regenerate(turn) {
  const [a, b] = [turn.chosen, answerView("Answer B")];
  a.labelEl.textContent = "Answer A";
  a.labelEl.hidden = false;
  turn.answersEl.classList.add("choosing");
  turn.answersEl.append(b.el);
  const ok = await run(() => stream(turn, b));
  if (!ok || !b.id) { b.el.remove(); endChoice(turn, a); return; }
  setBusy(true); // until a choice is made, nothing else starts
  for (const [better, worse, name] of [[a, b, "A"], [b, a, "B"]]) {
    better.chooseEl.textContent = `${name} is better`;
    better.chooseEl.hidden = false;
    better.chooseEl.onclick = async () => {
      if (await sendFeedback(turn, { response_id: better.id, preferred_over: worse.id }, "preference")) {
        worse.el.remove();
        endChoice(turn, better);
      }
    };
  }
  a.chooseEl.focus();
}

function endChoice(turn, kept) {
  turn.chosen = kept;
  kept.labelEl.hidden = true;
  kept.chooseEl.hidden = true;
  turn.answersEl.classList.remove("choosing");
  setBusy(false);
  turn.buttons.regen.focus();
}

async function run(work) {
  setBusy(true);
  try {
    await work();
    return true;
  } catch (e) {
    notice(`No answer: ${e.message}`);
    return false;
  } finally {
    setBusy(false);
  }
}

form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = prompt.value.trim();
  if (!text || busy) return;
  prompt.value = "";
  prompt.style.height = "";
  ask(text).then(() => prompt.focus());
});
prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); form.requestSubmit(); }
});
prompt.addEventListener("input", () => {
  prompt.style.height = "";
  prompt.style.height = `${prompt.scrollHeight}px`;
});
document.getElementById("new-chat").addEventListener("click", () => {
  turns = [];
  log.replaceChildren(h("p", { class: "empty", id: "empty" }, "A new conversation. Ask something."));
  prompt.focus();
});
document.getElementById("send").dataset.needsIdle = "";

setupBar();
prompt.focus();
poll();
